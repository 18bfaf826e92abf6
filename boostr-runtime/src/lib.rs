//! Fused attention kernels compiled from `#[attention]` variant declarations,
//! exposed as tensor ops and as one autograd op on numr's [`Var`](numr::autograd::Var).
//!
//! ```
//! use boostr_runtime::{attention, attention_fwd, AttentionOptions};
//! use numr::prelude::*;
//!
//! /// Causal attention with tanh soft-capping of the logits.
//! #[attention(
//!     score = |s, _b, _h, _q, _kv| self.cap * tanh(s / self.cap),
//!     mask = |_b, _h, q, kv| kv <= q,
//! )]
//! #[derive(Clone, Debug)]
//! struct CausalSoftcap {
//!     cap: f32,
//! }
//!
//! let device = CpuDevice::new();
//! let q = Tensor::<CpuRuntime>::from_slice(&[0.5f32; 2 * 3 * 8], &[1, 2, 3, 8], &device)?;
//! let (out, lse) = attention_fwd(&CausalSoftcap { cap: 30.0 }, &q, &q, &q, &AttentionOptions::default())?;
//! assert_eq!(out.shape(), &[1, 2, 3, 8]);
//! assert_eq!(lse.shape(), &[1, 2, 3]);
//! # Ok::<(), boostr_runtime::Error>(())
//! ```
//!
//! - `score` (default: identity) maps the scaled logit `s = q·k * scale` of
//!   query position `q` and key position `kv` in batch `b`, query head `h`.
//! - `mask` (default: all visible) says whether key `kv` is visible to `q`.
//! - `sink` (default: none) is one more logit per query row, `|b, h, q|`,
//!   that joins the softmax and carries no value.
//! - Positions are bottom-right aligned: query row `i` has `q = i + Sk - Sq`.
//! - A field can be a tensor the closures read by indexing, declared
//!   `#[tensor(i32, [B, Sk])] doc: Tensor<R>` on a struct generic over its
//!   runtime `R` ([`capture`]; [`stock::CausalDocuments`] is one): checked
//!   at call time against its declaration, its reads proved in range or
//!   checked, and the tiles classified from per-call summaries of it.
//! - The compiler derives d`score`/d`s` for the backward and a tile
//!   classifier that lets kernels skip empty tiles and unmasked full tiles.
//!   [`Variant::compiled`] prints what it made.
//!
//! Backends: numr's `CpuRuntime` always (f32, and f16/bf16 computed in f32);
//! with the `wgpu` cargo feature, numr's `WgpuRuntime` too (the WGSL kernels,
//! f32 only); with the `cuda` feature, numr's `CudaRuntime` (f32, f16, bf16).

extern crate self as boostr_runtime;

pub mod backend;
pub mod capture;
pub mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
mod flash;
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
mod gpu;
mod op;
mod problem;
pub mod stock;
pub mod testing;
mod validate;
mod variant;
#[cfg(feature = "wgpu")]
mod wgpu;

pub use backend::{AttentionGrads, AttentionRuntime, BackwardTensors, CacheLengths, Pages};
pub use boostr_macros::attention;
pub use error::{BackendError, Error, Result};
pub use flash::var_flash_attention;
pub use kernels_spec::emit::Target;
pub use kernels_spec::params::ParamWords;
pub use op::{
    AttentionOptions, KvCache, LearnableGrad, PagedKvCache, attention_bwd, attention_bwd_cache,
    attention_bwd_tensors, attention_fwd, attention_fwd_cache, attention_fwd_paged,
    learnable_grads, var_attention,
};
pub use problem::Problem;
pub use variant::{CompiledStages, HostVariant, Lowering, TileClass, Variant};

/// One module of generated tests: every instance checked on one backend.
/// Each instance is a builder function of the enclosing module, generic over
/// the runtime.
#[doc(hidden)]
#[macro_export]
macro_rules! __backend_test_module {
    ($module:ident, $backend:ident; $($name:ident,)*) => {
        mod $module {
            $(
                #[test]
                fn $name() {
                    $crate::testing::check_variant_built::<$crate::testing::$backend, _>(
                        super::$name::<
                            <$crate::testing::$backend as $crate::testing::TestBackend>::Runtime,
                        >,
                    );
                }
            )*
        }
    };
}

/// Generated per-variant tests on every backend compiled in; used by the code
/// that `#[attention(tests = [..])]` expands to.
#[doc(hidden)]
#[macro_export]
macro_rules! __backend_tests {
    ($($name:ident,)*) => {
        $crate::__backend_test_module! { cpu, Cpu; $($name,)* }
        $crate::__wgpu_tests! { $($name,)* }
        $crate::__cuda_tests! { $($name,)* }
    };
}

// The per-feature parts are defined once per feature state because `cfg`
// inside a macro's expansion is evaluated in the caller's crate.

/// The wgpu part of [`__backend_tests`]: against the reference, on the
/// shapes the CPU is checked on too (`testing::CPU_CASES`).
#[cfg(feature = "wgpu")]
#[doc(hidden)]
#[macro_export]
macro_rules! __wgpu_tests {
    ($($name:ident,)*) => {
        $crate::__backend_test_module! { wgpu, Wgpu; $($name,)* }
    };
}

/// The wgpu part of [`__backend_tests`]: nothing without the feature.
#[cfg(not(feature = "wgpu"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __wgpu_tests {
    ($($tt:tt)*) => {};
}

/// The CUDA part of [`__backend_tests`]: against the reference, on the
/// shapes the CPU is checked on too (`testing::CPU_CASES`).
#[cfg(feature = "cuda")]
#[doc(hidden)]
#[macro_export]
macro_rules! __cuda_tests {
    ($($name:ident,)*) => {
        $crate::__backend_test_module! { cuda, Cuda; $($name,)* }
    };
}

/// The CUDA part of [`__backend_tests`]: nothing without the feature.
#[cfg(not(feature = "cuda"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __cuda_tests {
    ($($tt:tt)*) => {};
}
