//! Fused attention kernels compiled from `#[attention]` variant declarations,
//! exposed as tensor ops and as one autograd op on numr's [`Var`](numr::autograd::Var).
//!
//! ```
//! use boostr_runtime::{AttentionOptions, Keys, attention, var_attention};
//! use numr::autograd::{Var, backward, var_sum};
//! use numr::prelude::*;
//!
//! /// Gemma-2 style: causal attention with tanh soft-capping of the logits.
//! #[attention(
//!     score = |s, _b, _h, _q, _kv| self.cap * tanh(s / self.cap),
//!     mask  = |_b, _h, q, kv| kv <= q,
//!     tests = [CausalSoftcap { cap: 30.0 }, CausalSoftcap { cap: 2.0 }],
//! )]
//! #[derive(Clone, Debug)]
//! pub struct CausalSoftcap {
//!     pub cap: f32,
//! }
//!
//! fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
//!     let device = CpuDevice::new();
//!     let client = CpuRuntime::default_client(&device);
//!     // q, k, v [batch 2, heads 4, sequence 64, head dim 32]
//!     let input = |seed: f32| -> numr::error::Result<Var<CpuRuntime>> {
//!         let data: Vec<f32> = (0..2 * 4 * 64 * 32).map(|i| (i as f32 * seed).sin()).collect();
//!         let tensor = Tensor::<CpuRuntime>::from_slice(&data, &[2, 4, 64, 32], &device)?;
//!         Ok(Var::new(tensor, true))
//!     };
//!     let (q, k, v) = (input(0.37)?, input(0.73)?, input(1.31)?);
//!     let keys = Keys::dense(&k, &v); // or a KV cache, pages, a padded or packed batch
//!     let y = var_attention(&CausalSoftcap { cap: 30.0 }, &q, keys, &AttentionOptions::default())?;
//!     let loss = var_sum(&y.out, &[0, 1, 2, 3], false, &client)?;
//!     let grads = backward(&loss, &client)?; // dq, dk, dv from one fused backward
//!     assert_eq!(grads.get(q.id()).map(|dq| dq.shape()), Some(&[2, 4, 64, 32][..]));
//!     Ok(())
//! }
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
//! - A sequence sharded across the ranks of a numr `Communicator` runs as
//!   ring attention ([`ring_attention`], [`var_ring_attention`]): each rank
//!   gets its rows of the single-device result, positions global, every
//!   variant unchanged (on the CPU).
//!
//! Backends: numr's `CpuRuntime` always (f32; bf16 on AMX tiles or
//! AVX512-BF16 where the CPU has them, else, and f16, computed in f32; fp8
//! KV caches); with the `wgpu` cargo feature, numr's `WgpuRuntime` too (the
//! WGSL kernels, f32); with the `cuda` feature, numr's `CudaRuntime` (f32,
//! f16, bf16, fp8 KV caches). Every op, key source and variant runs on
//! every backend, ring attention included (fp8 keys but on wgpu, whose
//! numr runtime holds no 8-bit tensors).
//!
//! The crate's root holds what a user calls; [`prelude`] re-exports it;
//! [`variant`] is the contract between the compiler and the kernels
//! (what `#[attention]` implements, and what it made of a variant);
//! [`backend`] what a backend is given; [`cpu`] the CPU kernels called
//! directly (benchmarks, tuning); [`testing`] the checks the generated
//! tests run.

#![warn(missing_docs)]

extern crate self as boostr_runtime;

mod append;
pub mod backend;
pub mod capture;
pub mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
mod flash;
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
mod gpu;
mod keys;
mod merge;
mod mixed;
#[cfg(feature = "boostr")]
pub mod model;
mod node;
mod op;
mod options;
mod problem;
mod ring;
mod shifted;
pub mod stock;
pub mod testing;
mod tree;
mod validate;
pub mod variant;
#[cfg(feature = "wgpu")]
mod wgpu;

pub use append::{CacheSlots, amax_scales, append_kv};
pub use backend::{AttentionGrads, AttentionRuntime};
pub use boostr_macros::attention;
pub use error::{BackendError, Error, Result};
pub use flash::var_flash_attention;
pub use keys::{KeyTensor, Keys, KvScales};
pub use merge::merge_states;
pub use op::{
    Backward, LearnableGrad, Output, VarOutput, attention, attention_backward, learnable_grads,
    var_attention,
};
pub use options::AttentionOptions;
pub use problem::{Dropout, Problem};
pub use ring::{
    RingOps, RingOptions, RingTimes, Schedule, Shards, last_ring_times, ring_attention,
    ring_attention_backward, var_ring_attention,
};
pub use variant::{HostVariant, Variant};

/// What a user of the ops names, in one import: `use
/// boostr_runtime::prelude::*;`.
pub mod prelude {
    pub use crate::{
        AttentionGrads, AttentionOptions, AttentionRuntime, Backward, CacheSlots, Error, KeyTensor,
        Keys, KvScales, Output, Result, RingOptions, Schedule, Shards, VarOutput, Variant,
        append_kv, attention, attention_backward, learnable_grads, merge_states, ring_attention,
        ring_attention_backward, var_attention, var_flash_attention, var_ring_attention,
    };
}

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
/// shapes the CPU is checked on too (`testing::CPU_CASES`), for the first
/// instance. On a software adapter most of a check's time is compiling the
/// variant's pipelines, and further instances differ in parameter values
/// (a uniform) and test data, which the CPU checks on every instance.
#[cfg(feature = "wgpu")]
#[doc(hidden)]
#[macro_export]
macro_rules! __wgpu_tests {
    ($first:ident, $($rest:ident,)*) => {
        $crate::__backend_test_module! { wgpu, Wgpu; $first, }
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

#[cfg(test)]
mod readme {
    /// The first code block of `text` (its lines, without `prefix`).
    fn first_block(text: &str, prefix: &str, fence: &str) -> String {
        let lines: Vec<&str> = text
            .lines()
            .map(|l| l.strip_prefix(prefix).unwrap_or(l.trim_end_matches(' ')))
            .collect();
        let start = lines.iter().position(|l| *l == fence).expect("a block") + 1;
        let len = lines[start..]
            .iter()
            .position(|l| *l == "```")
            .expect("its end");
        lines[start..start + len].join("\n")
    }

    #[test]
    fn crate_docs_open_with_the_readme_example() {
        let readme = first_block(include_str!("../../README.md"), "", "```rust");
        let docs = first_block(include_str!("lib.rs"), "//! ", "```");
        let docs = docs.replace("//!", "");
        assert_eq!(docs, readme, "the crate docs' example is the README's");
    }
}
