//! Numerical checks of attention variants and backends, used by the tests that
//! `#[attention(tests = [...])]` generates, and usable by hand:
//!
//! ```
//! use boostr_runtime::stock::CausalSoftcap;
//! use boostr_runtime::testing::{Cpu, check_reference_gradients, check_variant};
//!
//! let variant = CausalSoftcap { cap: 30.0 };
//! // The oracle's backward is right for this variant (finite differences)...
//! check_reference_gradients(&variant);
//! // ...and the CPU kernels agree with the oracle, through the tensor ops
//! // and through autograd.
//! check_variant::<Cpu, _>(&variant);
//! ```
//!
//! - [`reference_forward`] / [`reference_backward`]: the oracle, naive attention
//!   in f64 over the variant's f64 closures (and the same algorithm in f32).
//! - [`check_reference_gradients`]: finite differences against the oracle's
//!   analytic backward.
//! - [`check_parity`]: one backend against another (e.g. wgpu against the CPU)
//!   on the same inputs, under the same rule.
//! - [`check_variant`]: a [`TestBackend`]'s kernels against the oracle on the
//!   standard [`CASES`], under FlashAttention's tolerance rule, per tensor:
//!   `max|kernel − ref| ≤ 2·max|naive_f32 − ref| + 1e-6·(1 + max|ref|) + ε·M`
//!   (`naive_f32`: the oracle's algorithm in f32 over the variant's f32
//!   closures; `ε·M`: one f32 rounding of the largest term summed into the
//!   tensor, for results that cancel; details at [`check_variant`]).
//!
//! Every check draws fresh random inputs per run; set `BOOSTR_TEST_SEED` to
//! replay the seed a failure printed.

// Each file has one job: the backends checked, the cases and their inputs,
// the reference and the naive f32 yardstick, running a backend, the
// tolerance rule, the exact-zero and contract checks, and the two checks
// built from them.
mod backends;
mod cases;
mod check_variant;
mod comm;
mod contract;
mod data;
mod exact_zeros;
#[cfg(test)]
pub(crate) mod fixtures;
mod gradcheck;
mod inputs;
mod layouts;
mod naive;
mod parity;
pub(crate) mod reference;
mod report;
pub(crate) mod rng;
mod run_backend;
mod shared_keys;
mod tolerance;

#[cfg(feature = "wgpu")]
pub use crate::wgpu::{
    forward_in_splits as wgpu_forward_in_splits, forward_splits_of as wgpu_forward_splits,
};
#[cfg(feature = "cuda")]
pub use backends::Cuda;
#[cfg(feature = "wgpu")]
pub use backends::Wgpu;
#[cfg(all(test, feature = "cuda"))]
pub(crate) use backends::device_or_skip;
pub use backends::{Cpu, REQUIRE_DEVICE_ENV, TestBackend};
pub use cases::{CASES, CPU_CASES, Case, HEAD_DIM_CASES, Logits, SMALL_CASES};
pub use check_variant::{
    check_variant, check_variant_built, check_variant_built_on, check_variant_on,
};
pub use comm::{MessageCount, ThreadComm};
pub use data::TestData;
#[doc(hidden)]
pub use data::build;
pub use exact_zeros::seen_keys;
pub use gradcheck::{check_reference_gradients, check_reference_gradients_built};
#[doc(hidden)]
pub use numr::runtime::cpu::CpuRuntime;
pub use parity::{check_parity, check_parity_built};
pub use reference::{
    Forward, Gradients, Real, reference_backward, reference_backward_lse, reference_forward,
};
pub use rng::{Rng, SEED_ENV, choose_seed};
#[cfg(test)]
pub(crate) use run_backend::out_and_lse_loss;

/// `variant` as one kernel call of a ring: queries from position
/// `starts.0` and keys from `starts.1` of the sequence of `whole` (`Sq =
/// Sk`), the call's sizes `call`; its rows carry the sink where `sink`
/// holds. Its host functions and its GPU kernels see the whole sequence's
/// positions, and its captured tensors span the whole sequence. For
/// checking a backend's kernels on windows against the reference.
pub fn ring_call<V: crate::Variant>(
    variant: V,
    whole: crate::Problem,
    call: &crate::Problem,
    starts: (usize, usize),
    sink: bool,
) -> impl crate::Variant {
    crate::ring::Positioned::new(variant, whole, call, starts, sink)
}

/// Row-major coordinates of flat `index` in `shape`.
fn unravel(shape: &[usize], mut index: usize) -> Vec<usize> {
    let mut coords = vec![0; shape.len()];
    for (c, &n) in coords.iter_mut().zip(shape).rev() {
        *c = index % n;
        index /= n;
    }
    coords
}

#[cfg(test)]
mod tests;
