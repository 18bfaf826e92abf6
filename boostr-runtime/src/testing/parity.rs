//! `check_parity`: one backend against another on the same inputs, under
//! the tolerance rule with the first backend in the place of the reference.

use super::backends::{TestBackend, device_or_skip};
use super::data::TestData;
use super::inputs::{Expected, Inputs, widen};
use super::reference::{Forward, Gradients};
use super::report::{CaseReport, run_cases};
use super::rng::{SEED_ENV, choose_seed};
use super::run_backend::run_backend;
use super::tolerance::{PARITY_FACTOR, SLACK, compare_results};
use crate::variant::{HostVariant, Variant};

/// Check that backend `B` agrees with backend `A` for `variant`, on `B`'s
/// [`TestBackend::cases`], inputs drawn as in
/// [`check_variant`](super::check_variant).
///
/// `B`'s `out, lse, dq, dk, dv` (tensor ops and autograd) are compared with
/// `A`'s tensor-op results under `check_variant`'s rule with `A` in the
/// place of the f64 reference, and twice its factor: `B` may differ from `A`
/// by at most four times what the naive f32 implementation differs from
/// `A`, plus the same slack (each is held to twice the naive error by its
/// own test, so two correct backends can be twice that apart). `lse
/// = −inf` must match exactly. Skipped (or failed, with
/// `BOOSTR_TEST_REQUIRE_DEVICE`) like `check_variant` when either backend
/// has no device.
///
/// # Panics
///
/// When `B` and `A` disagree, after running every case, with the seed and
/// the worst element of each failing tensor.
pub fn check_parity<A: TestBackend, B: TestBackend, V: Variant>(variant: &V) {
    check_parity_built::<A, B, V, V>(|_| variant.clone(), |_| variant.clone());
}

/// [`check_parity`] for instances built per case on each backend's device
/// from the case's [`TestData`] (the same seed gives both backends the same
/// data): `build_a` and `build_b` are one builder at the two runtimes.
/// Cases whose reads go out of range are checked by
/// [`check_variant_built`](super::check_variant_built) instead.
///
/// # Panics
///
/// As [`check_parity`].
pub fn check_parity_built<A: TestBackend, B: TestBackend, VA: Variant, VB: Variant>(
    mut build_a: impl FnMut(&mut TestData<'_, A::Runtime>) -> VA,
    mut build_b: impl FnMut(&mut TestData<'_, B::Runtime>) -> VB,
) {
    let what = format!("{} vs {} for variant `{}`", A::NAME, B::NAME, VB::NAME);
    let (Some(dev_a), Some(dev_b)) = (device_or_skip::<A>(&what), device_or_skip::<B>(&what))
    else {
        return;
    };
    let seed = choose_seed();
    let label = format!("{} on {} vs {}", VB::NAME, B::NAME, A::NAME);
    let failures = run_cases(B::cases(), &label, |stream, case| {
        let p = case.problem();
        let va = build_a(&mut TestData::new(p, &dev_a, seed, stream));
        let vb = build_b(&mut TestData::new(p, &dev_b, seed, stream));
        let host = match va.host_copy(&p) {
            Ok(host) => host,
            Err(e) => return CaseReport::error(format!("{}::host: {e}", VA::NAME)),
        };
        let mut inputs = Inputs::draw(case, seed, stream);
        inputs.poison_hidden_keys(&host, &p);
        let reference = Expected::reference(&host, &p, &inputs, Vec::new());
        if let Some(e) = host.out_of_range() {
            return CaseReport::new(Vec::new(), format!("skipped (reads out of range: {e})"));
        }
        let (a, b) = (
            run_backend::<A, VA>(&va, &dev_a, case, &inputs),
            run_backend::<B, VB>(&vb, &dev_b, case, &inputs),
        );
        match (a, b) {
            (Err(e), _) => CaseReport::error(format!("{}: {e}", A::NAME)),
            (_, Err(e)) => CaseReport::error(format!("{}: {e}", B::NAME)),
            (Ok((p, a)), Ok((_, b))) => {
                let want = Expected {
                    fwd: Forward {
                        out: widen(&a.fwd.out),
                        lse: widen(&a.fwd.lse),
                        max_scores: widen(&a.fwd.max_scores),
                    },
                    grads: Gradients {
                        dq: widen(&a.grads.dq),
                        dk: widen(&a.grads.dk),
                        dv: widen(&a.grads.dv),
                        // The other backend computes no tensor gradients.
                        tensors: Vec::new(),
                    },
                    ..reference
                };
                let mut f = Vec::new();
                let summary = compare_results(&p, &b, &want, PARITY_FACTOR, &mut f);
                CaseReport::new(f, summary)
            }
        }
    });
    assert!(
        failures.is_empty(),
        "boostr: variant `{}`: {} disagrees with {} (seed {seed}; rerun with {SEED_ENV}={seed})\n\
         tolerance: max|{} − {}| ≤ {PARITY_FACTOR}·max|naive_f32 − {}| + {SLACK:e}·(1 + max|{}|) + ε·M\n\
         {failures}",
        VB::NAME,
        B::NAME,
        A::NAME,
        B::NAME,
        A::NAME,
        A::NAME,
        A::NAME,
    );
}
