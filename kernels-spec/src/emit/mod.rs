//! Stage 5, emit: one module per target, each lowering the validated
//! [`Program`] to that target's text or tokens. Emitters never see syn, and
//! target-specific choices live in their own module.
//!
//! - [`cpu`]: Rust tokens, inlined by the generic CPU kernels;
//! - [`gpu`]: the lowering the C-like GPU targets share, printed by each
//!   one's [`Dialect`](gpu::Dialect): [`cuda`] (CUDA C for NVRTC) and
//!   [`wgsl`] (WebGPU);
//! - [`interface`]: the roles of kernel arguments and launch geometry that
//!   every GPU target's kernel descriptions are written in.

pub mod cpu;
pub mod cuda;
pub mod gpu;
pub mod interface;
pub mod source;
pub mod wgsl;

use crate::ir::Program;
use std::fmt;

/// A target of the compiler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Target {
    /// Native Rust on the CPU.
    Cpu,
    /// WGSL compute shaders on wgpu.
    Wgsl,
    /// CUDA C through NVRTC.
    Cuda,
}

impl Target {
    /// Its lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Target::Cpu => "cpu",
            Target::Wgsl => "wgsl",
            Target::Cuda => "cuda",
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The variant section of `program` for every GPU dialect, keyed by target:
/// what each target's kernels are assembled around at run time.
pub fn gpu_lowerings(program: &Program) -> Vec<(Target, String)> {
    use gpu::{Dialect, variant_section};
    vec![
        (wgsl::Wgsl::TARGET, variant_section::<wgsl::Wgsl>(program)),
        (cuda::Cuda::TARGET, variant_section::<cuda::Cuda>(program)),
    ]
}

/// Why a tile configuration cannot run on its target.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TilingError {
    /// The head dim is outside what the kernels are written for.
    #[error("head dim {head_dim} is not {rule}")]
    HeadDim {
        /// The head dim.
        head_dim: u32,
        /// What it must be.
        rule: &'static str,
    },
    /// A tile size or a thread count breaks its rule.
    #[error("{what} = {value} is not {rule}")]
    Size {
        /// Which size.
        what: &'static str,
        /// Its value.
        value: u32,
        /// What it must be.
        rule: String,
    },
    /// A kernel would hold more accumulators per thread than fit in
    /// registers.
    #[error(
        "the {kernel} kernel needs {needed} f32 accumulators per thread, over {max} \
         (they would spill)"
    )]
    Registers {
        /// Which kernel.
        kernel: &'static str,
        /// Accumulators per thread.
        needed: u32,
        /// The bound.
        max: u32,
    },
    /// A kernel needs more on-chip memory than the target guarantees.
    #[error("the {kernel} kernel needs {bytes} bytes of {memory}, over {max} ({limit})")]
    Memory {
        /// Which kernel.
        kernel: &'static str,
        /// Which memory.
        memory: &'static str,
        /// Bytes it needs.
        bytes: u64,
        /// Bytes there are.
        max: u64,
        /// Where the bound comes from.
        limit: &'static str,
    },
}

/// A target's tile configuration for one problem.
pub trait Tiling: Copy + fmt::Debug {
    /// These tiles with a variant's `tile(q = .., kv = ..)` applied. The
    /// result may not [validate](Tiling::validate).
    fn with_override(self, q: Option<u32>, kv: Option<u32>) -> Self;

    /// Checks every derived size against the target's limits.
    fn validate(&self) -> Result<(), TilingError>;
}

/// The tiles a kernel runs with: `default` with the variant's
/// `tile(q = .., kv = ..)` override when that validates, else `default`
/// itself (an override that one target cannot honour, such as a size that
/// is no multiple of 16 on tensor cores, keeps that target's defaults).
pub fn choose_tiles<T: Tiling>(
    default: T,
    q: Option<u32>,
    kv: Option<u32>,
) -> Result<T, TilingError> {
    let wanted = default.with_override(q, kv);
    if wanted.validate().is_ok() {
        return Ok(wanted);
    }
    default.validate()?;
    Ok(default)
}
