//! How a CUDA kernel is described: entry point, arguments in order, launch
//! geometry. The source's `extern "C"` signature is written from the
//! description ([`Kernel::signature`]), the runtime builds the argument list
//! from it by role, and [`Display`] writes the launch contract.

use super::CudaTiles;
use crate::emit::interface::{Access, Arg, Buffer, Elem, Extent, GridTooLarge, Sizes};
use std::fmt::{self, Display, Formatter};

/// A tile size of [`CudaTiles`] that launch geometry counts in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Size {
    /// Forward: query rows per block (`BQ`).
    BlockQ,
    /// Backward: query rows per tile (`BBQ`).
    BwdBlockQ,
    /// Backward: keys per tile (`BBKV`).
    BwdBlockKv,
    /// `D_i` pre-pass: rows per block ([`DELTA_ROWS_PER_BLOCK`](super::DELTA_ROWS_PER_BLOCK)).
    DeltaRows,
}

impl Display for Size {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Size::BlockQ => "BQ",
            Size::BwdBlockQ => "BBQ",
            Size::BwdBlockKv => "BBKV",
            Size::DeltaRows => "DELTA_ROWS",
        })
    }
}

/// Threads per block of a kernel, by the constant the source defines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Threads {
    /// `FWD_THREADS`: [`CudaTiles::threads`].
    Forward,
    /// `BWD_THREADS`: [`CudaTiles::bwd_threads`].
    Backward,
    /// `DELTA_THREADS`: [`DELTA_THREADS`](super::DELTA_THREADS).
    Delta,
}

impl Threads {
    /// The source's constant.
    pub const fn constant(self) -> &'static str {
        match self {
            Threads::Forward => "FWD_THREADS",
            Threads::Backward => "BWD_THREADS",
            Threads::Delta => "DELTA_THREADS",
        }
    }
}

/// Dynamic shared memory of a kernel, by the layout it uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Smem {
    /// None.
    None,
    /// [`CudaTiles::forward_layout`] (`FWD_SMEM_BYTES`).
    Forward,
    /// [`CudaTiles::backward_layout`] (`BWD_SMEM_BYTES`).
    Backward,
}

/// One `extern "C" __global__` kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    /// The entry point's name.
    pub entry: &'static str,
    /// Its arguments, in order: buffers are `E*` (`const` when read only)
    /// or `float*`, `k` and `v` read as `kv_t*` (`E`, or an fp8 cache's
    /// bytes), sizes `int`, the scale `float`, the parameter block the
    /// 128-byte `Params` struct by value.
    pub args: &'static [Arg],
    /// Blocks along x, y, z.
    pub grid: [Extent<Size>; 3],
    /// Threads per block (along x).
    pub threads: Threads,
    /// Dynamic shared memory.
    pub smem: Smem,
    /// `__launch_bounds__`' minimum resident blocks per SM, if any.
    pub min_blocks: Option<u32>,
}

/// The geometry of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchDims {
    /// Blocks along x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block.
    pub block: u32,
    /// Dynamic shared memory in bytes; above 48 KiB the kernel must first
    /// be allowed it (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`).
    pub smem_bytes: u32,
}

impl Kernel {
    /// Dynamic shared memory in bytes under `cfg`.
    pub fn smem_bytes(&self, cfg: &CudaTiles) -> u64 {
        match self.smem {
            Smem::None => 0,
            Smem::Forward => cfg.forward_smem_bytes(),
            Smem::Backward => cfg.dq_smem_bytes(),
        }
    }

    /// Threads per block under `cfg`.
    pub fn block_threads(&self, cfg: &CudaTiles) -> u32 {
        match self.threads {
            Threads::Forward => cfg.threads(),
            Threads::Backward => cfg.bwd_threads(),
            Threads::Delta => super::DELTA_THREADS,
        }
    }

    /// The launch for a problem of `sizes` under `cfg`.
    pub fn launch_dims(&self, cfg: &CudaTiles, sizes: &Sizes) -> Result<LaunchDims, GridTooLarge> {
        let size = |s: Size| cfg.size(s);
        let [x, y, z] = &self.grid;
        Ok(LaunchDims {
            grid: (
                x.blocks("x", (1 << 31) - 1, sizes, &size)?,
                y.blocks("y", 65535, sizes, &size)?,
                z.blocks("z", 65535, sizes, &size)?,
            ),
            block: self.block_threads(cfg),
            smem_bytes: u32::try_from(self.smem_bytes(cfg)).unwrap_or(u32::MAX),
        })
    }

    /// The kernel's declaration up to its opening brace, as the source has it.
    pub fn signature(&self) -> impl Display + '_ {
        Signature(self)
    }
}

fn c_type(arg: Arg) -> &'static str {
    match arg {
        // K and V as stored: the element type, or an fp8 cache's bytes.
        Arg::Buffer(Buffer::K | Buffer::V, Access::Read) => "const kv_t* __restrict__",
        Arg::Buffer(b, access) => match (b.elem(), access) {
            (Elem::Input, Access::Read) => "const elem_t* __restrict__",
            (Elem::Input, Access::ReadWrite) => "elem_t* __restrict__",
            (_, Access::Read) => "const float* __restrict__",
            (_, Access::ReadWrite) => "float* __restrict__",
        },
        Arg::Scalar(s) if s.is_float() => "float",
        Arg::Scalar(_) => "int",
        Arg::Params => "Params",
        Arg::Captures => "unsigned* __restrict__",
    }
}

struct Signature<'a>(&'a Kernel);

impl Display for Signature<'_> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let k = self.0;
        write!(
            f,
            "extern \"C\" __global__ void __launch_bounds__({}",
            k.threads.constant()
        )?;
        if let Some(n) = k.min_blocks {
            write!(f, ", {n}")?;
        }
        writeln!(f, ")\n{}(", k.entry)?;
        for (i, a) in k.args.iter().enumerate() {
            let sep = if i + 1 < k.args.len() { "," } else { ") {" };
            writeln!(f, "    {} {}{sep}", c_type(*a), a.name())?;
        }
        Ok(())
    }
}

/// The launch contract: `entry(arguments)`, each with its shape, then grid,
/// block and shared memory.
impl Display for Kernel {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.entry)?;
        for (i, a) in self.args.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            let ty = c_type(*a).trim_end_matches(" __restrict__");
            write!(f, "{ty} {}", a.name())?;
            if let Arg::Buffer(b, _) = a {
                write!(f, " {}", b.shape())?;
            }
        }
        let [x, y, z] = &self.grid;
        write!(
            f,
            "): grid ({x}, {y}, {z}), block {}, dynamic shared memory {}",
            self.threads.constant(),
            match self.smem {
                Smem::None => "none",
                Smem::Forward => "FWD_SMEM_BYTES",
                Smem::Backward => "BWD_SMEM_BYTES",
            }
        )
    }
}

/// One translation unit: device code its kernels share, then the kernels,
/// each a [`Kernel`] and the body that follows its signature.
#[derive(Clone, Copy, Debug)]
pub struct Module {
    /// A short name for file names and messages (`fwd`, `bwd`).
    pub name: &'static str,
    /// Device code before the kernels, in pieces (a source that holds
    /// several modules writes a piece they share once).
    pub preamble: &'static [&'static str],
    /// The kernels with their bodies (from the opening brace's next line).
    pub kernels: &'static [(&'static Kernel, &'static str)],
}

impl Module {
    /// The kernels' descriptions, in order.
    pub fn interfaces(&self) -> impl Iterator<Item = &'static Kernel> + '_ {
        self.kernels.iter().map(|(k, _)| *k)
    }
}
