//! `check_variant`: a backend's kernels against the f64 reference, on the
//! standard cases, through both the tensor ops and the autograd op.

use super::backends::{TestBackend, device_or_skip};
use super::cases::Case;
use super::contract::contract;
use super::data::TestData;
use super::exact_zeros::exact_zeros;
use super::inputs::{Expected, Inputs, learnable_names};
use super::layouts::{LAYOUT_CASES, check_layouts};
use super::report::{CaseReport, run_cases};
use super::rng::{SEED_ENV, choose_seed};
use super::run_backend::expect_out_of_range;
use super::run_backend::run_backend;
use super::shared_keys::check_shared_keys;
use super::tolerance::{NAIVE_FACTOR, SLACK, compare_results};
use crate::variant::{HostVariant, Variant};
use numr::runtime::Runtime;

/// Check `R`'s attention kernels for `variant` on every case of
/// [`TestBackend::cases`] ([`CASES`](super::CASES) unless the backend says otherwise).
///
/// For each case, fresh random `q, k, v, dout, dlse` (seed from the clock,
/// or from `BOOSTR_TEST_SEED`) go through
///
/// 1. [`attention`](crate::attention()) and
///    [`attention_backward`](crate::attention_backward) with `dlse`, and
/// 2. [`var_attention`](crate::var_attention) and
///    [`numr::autograd::backward`] of `L = sum(out ∘ dout) + sum(lse ∘
///    dlse)` (the `GradFn` path),
///
/// and `out, lse, dq, dk, dv` of both are compared with the f64 reference
/// ([`reference_forward`](super::reference_forward),
/// [`reference_backward`](super::reference_backward) with the variant's f64
/// closures) on the same (f32) inputs.
///
/// # Tolerance rule
///
/// Per tensor `T`, with `ref` the f64 reference and `naive` the same algorithm
/// run in f32 with the variant's f32 closures (in two summation orders over
/// the head dim, keeping per element the worse of the two):
///
/// ```text
/// max |T − ref|  ≤  2 · max |naive − ref|  +  1e-6 · (1 + max |ref|)  +  ε · M
/// ```
///
/// Maxima are over all elements (for `lse`, over the finite reference
/// entries); ε = `f32::EPSILON`. The kernel may be at most twice as
/// inaccurate as straightforward f32 arithmetic (FlashAttention's rule). The
/// two slack terms matter only where the naive f32 is (nearly) exact:
/// `1e-6·(1 + max|ref|)` is a few ulps of the result; `M` is the largest
/// magnitude of the terms summed into `T` (the same sums over absolute
/// values, e.g. for `dq` `scale·Σ_j P_ij (Σ|dO_i||v_j| + Σ|dO_i||O_i|)
/// |score_grad| |k_j|`; `|lse|` for `lse`; never less than `max |ref|`), and
/// `ε·M` is one rounding of that size, for results that cancel to ~0 while
/// their terms do not: the `dq` of a row with one visible key is pure
/// rounding noise of `dP − D`, scaled by `|k|`.
///
/// Also required:
/// - no NaN, and no infinity except `lse = −inf`, which must be exactly where
///   the reference has it (rows with no visible key);
/// - those rows have exactly `0` in `out` and `dq`, and keys visible to no
///   query have exactly `0` in `dk` and `dv`;
/// - the naive f32 is itself within `1e-2 · (1 + M)` of the reference
///   (else the variant's f32 and f64 closures disagree);
/// - the variant's own contract: `mask` and `mask_exact` agree; no mask means
///   every pair is visible; an identity score is the identity with
///   derivative 1; `classify_tile` never says `Empty` or `Full` wrongly
///   (several tilings of every case).
///
/// # Panics
///
/// When anything above fails, after running every case, with the variant,
/// backend, seed (rerun with `BOOSTR_TEST_SEED=<seed>`), the case, and the
/// worst element of each failing tensor: index, got, want, naive f32 value
/// and error.
pub fn check_variant<R: TestBackend, V: Variant>(variant: &V) {
    check_variant_built::<R, V>(|_| variant.clone());
}

/// [`check_variant`] on the given cases instead of the backend's own list
/// (and not over a cache or pages).
///
/// # Panics
///
/// As [`check_variant`].
pub fn check_variant_on<R: TestBackend, V: Variant>(variant: &V, cases: &[Case]) {
    check_variant_built_on::<R, V>(|_| variant.clone(), cases);
}

/// [`check_variant`] for an instance built per case, on the backend's
/// device, from the case's [`TestData`]: the check of a variant that
/// captures tensors (`tests = [|data| Documents { doc: data.documents() }]`).
///
/// Also checked, on every case: where the f64 reference reads a tensor out
/// of range (the case's sizes do not fit the declared use of its data), the
/// backend's ops must fail with
/// [`Error::IndexOutOfRange`](crate::Error::IndexOutOfRange) for that field
/// and shape, at an index that is out of range.
///
/// # Panics
///
/// As [`check_variant`].
pub fn check_variant_built<R: TestBackend, V: Variant>(
    build: impl FnMut(&mut TestData<'_, R::Runtime>) -> V,
) {
    check_built::<R, V>(build, R::cases(), LAYOUT_CASES);
}

/// [`check_variant_built`] on the given cases (and not over a cache or
/// pages).
///
/// # Panics
///
/// As [`check_variant`].
pub fn check_variant_built_on<R: TestBackend, V: Variant>(
    build: impl FnMut(&mut TestData<'_, R::Runtime>) -> V,
    cases: &[Case],
) {
    check_built::<R, V>(build, cases, &[]);
}

/// The check of `cases`, then of the variant over a KV cache and over
/// pages on `layout_cases`.
fn check_built<R: TestBackend, V: Variant>(
    mut build: impl FnMut(&mut TestData<'_, R::Runtime>) -> V,
    cases: &[Case],
    layout_cases: &[Case],
) {
    let Some(device) = device_or_skip::<R>(&format!("the check of variant `{}`", V::NAME)) else {
        return;
    };
    let seed = choose_seed();
    let label = format!("{} on {}", V::NAME, R::NAME);
    let mut failures = run_cases(cases, &label, |stream, case| {
        let mut data = TestData::new(case.problem(), &device, seed, stream);
        let variant = build(&mut data);
        run_case::<R, V>(&variant, &device, case, seed, stream)
    });
    // The same variant over a KV cache and over pages.
    let streams = cases.len() as u64;
    failures += &run_cases(layout_cases, &label, |stream, case| {
        check_layouts::<R, V>(&mut build, &device, case, seed, streams + stream)
    });
    assert!(
        failures.is_empty(),
        "boostr: variant `{}` failed on backend `{}` (seed {seed}; rerun with {SEED_ENV}={seed})\n\
         tolerance: max|got − ref| ≤ {NAIVE_FACTOR}·max|naive_f32 − ref| + {SLACK:e}·(1 + max|ref|) \
         + ε·M, M = max magnitude of the summed terms (≥ max|ref|)\n\
         {failures}",
        V::NAME,
        R::NAME
    );
}

fn run_case<R: TestBackend, V: Variant>(
    variant: &V,
    device: &<R::Runtime as Runtime>::Device,
    case: &Case,
    seed: u64,
    stream: u64,
) -> CaseReport {
    let mut inputs = Inputs::draw(case, seed, stream);
    let p = match crate::validate::call(variant, case.problem(), &inputs.opts) {
        Ok(p) => p,
        Err(e) => return CaseReport::error(format!("{}: {e}", V::NAME)),
    };
    let host = match variant.host_copy(&p) {
        Ok(host) => host,
        Err(e) => return CaseReport::error(format!("{}::host: {e}", V::NAME)),
    };
    let poisoned = inputs.poison_hidden_keys(&host, &p);
    let mut failures = Vec::new();
    contract(&host, &p, &mut failures);
    let want = Expected::reference(&host, &p, &inputs, learnable_names::<V>());
    if let Some(expected) = host.out_of_range() {
        expect_out_of_range::<R, V>(variant, device, case, &inputs, &expected, &mut failures);
        return CaseReport::new(failures, format!("fails as it must: {expected}"));
    }
    let (p, got) = match run_backend::<R, V>(variant, device, case, &inputs) {
        Ok(results) => results,
        Err(e) => return CaseReport::error(e),
    };
    let mut summary = compare_results(&p, &got, &want, NAIVE_FACTOR, &mut failures);
    if let Some(shared) =
        check_shared_keys::<R, V>(variant, device, case, (seed, stream), &mut failures)
    {
        summary.push_str(&format!(", {shared}"));
    }
    if poisoned > 0 {
        summary.push_str(&format!(", {poisoned} hidden keys of NaN/inf K, V"));
    }
    exact_zeros(
        &host,
        &p,
        &want.fwd.lse,
        [
            ("attention_fwd out", &got.fwd.out),
            ("var_attention out", &got.var_out),
            ("attention_bwd dq", &got.grads.dq),
            ("GradFn dq", &got.var_grads.dq),
        ],
        [
            ("attention_bwd dk", &got.grads.dk),
            ("attention_bwd dv", &got.grads.dv),
            ("GradFn dk", &got.var_grads.dk),
            ("GradFn dv", &got.var_grads.dv),
        ],
        &mut failures,
    );
    CaseReport::new(failures, summary)
}
