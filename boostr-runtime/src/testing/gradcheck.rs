//! Finite-difference check of the reference's analytic backward.

use super::data::TestData;
use super::reference::{reference_backward_lse, reference_forward};
use super::rng::{Rng, SEED_ENV, choose_seed};
use super::unravel;
use crate::problem::Problem;
use crate::variant::{HostVariant, Variant};
use numr::runtime::cpu::{CpuDevice, CpuRuntime};

/// Tiny shapes: a GQA group with `Sq < Sk` and values narrower than keys
/// (`Dv < D`), then `Sq > Sk` (under a causal mask its first two rows see
/// no key) with wider values, then batch 2 with one kv head per query head
/// (variants that depend on `b` or `h`).
fn fd_shapes() -> [(&'static str, Problem); 3] {
    [
        (
            "gqa_sq<sk_dv<d",
            Problem::new(1, (2, 1), (3, 5), 4)
                .with_head_dim_v(3)
                .with_scale(0.5),
        ),
        (
            "sq>sk_dv>d",
            Problem::new(1, (2, 1), (5, 3), 4)
                .with_head_dim_v(5)
                .with_scale(0.5),
        ),
        ("batch2", Problem::new(2, (2, 2), (4, 4), 3)),
    ]
}

/// Standard deviation of `q` and `k`: logits of std ~2, so saturating scores
/// (softcap, clamps) leave their linear region.
const QK_STD: f64 = 1.5;
/// Finite-difference step.
const STEP: f64 = 1e-6;
/// Finite-difference step of a learnable tensor's elements, which are f32:
/// the step actually taken (`fl(x + h) − x`, exact) is used.
const TENSOR_STEP: f32 = 1e-4;
/// Absolute tolerance of a tensor gradient, in units of `1 + max |gradient|`:
/// the truncation error of a central difference, about `h²·|L‴|/6`.
const TENSOR_ATOL: f64 = 1e-6;
/// Relative tolerance of an element's gradient.
const RTOL: f64 = 1e-6;
/// Absolute tolerance, in units of `1 + max |gradient|` of the tensor: the
/// rounding error of a central difference is about `ε·|L| / h ≈ 1e-9`.
const ATOL: f64 = 1e-7;
/// One-sided slopes that differ by more than this (relative to `1 + |grad|`)
/// reveal a kink of the score within one step of the point.
const KINK: f64 = 1e-4;
/// At most one element in this many may be skipped as lying on a kink.
const KINK_BUDGET: usize = 50;

/// Check the f64 reference's analytic backward against central finite
/// differences, on tiny shapes, for `variant`'s f64 closures.
///
/// The loss is `L = Σ out ∘ G` with a random `G`; every element of `q`, `k`
/// and `v` is perturbed by `±h`, `h = 1e-6`, and
/// `|ΔL/2h − ∂L/∂x| ≤ 1e-6·|∂L/∂x| + 1e-7·(1 + max |∂L/∂·|)` must hold.
/// This validates `score_grad_f64` against `score_f64` (and the reference's
/// backward itself), which every kernel check then relies on. Every element
/// of every learnable tensor is perturbed too (by `±1e-4`, the step taken in
/// f32), which checks the tensor gradients of `score` and `sink`.
///
/// Scores with kinks (`clamp`, `abs`, `max`): where a kink lies within `h` of
/// the point, the two one-sided slopes disagree; such an element is skipped
/// (at most one in 50 per tensor, else the check fails). Points exactly on a
/// kink are not generated on purpose, and `h` is small enough that hitting
/// one is rare; a step function (zero derivative almost everywhere) passes
/// only if `score_grad_f64` is zero.
///
/// The seed is fresh per run unless `BOOSTR_TEST_SEED` is set; it is printed
/// in every failure.
///
/// # Panics
///
/// On any disagreement, with the worst elements, the seed and the shape.
pub fn check_reference_gradients<V: Variant>(variant: &V) {
    check_reference_gradients_built(|_| variant.clone());
}

/// [`check_reference_gradients`] for an instance built per shape from its
/// [`TestData`] on the CPU (the instances of a variant that captures
/// tensors). Reads out of range count as reads of zero here, as the
/// checked reads return; the kernel checks require the `Err`.
///
/// # Panics
///
/// As [`check_reference_gradients`].
pub fn check_reference_gradients_built<V: Variant>(
    mut build: impl FnMut(&mut TestData<'_, CpuRuntime>) -> V,
) {
    let seed = choose_seed();
    let device = CpuDevice::new();
    let mut failures = Vec::new();
    for (n, (name, p)) in fd_shapes().iter().enumerate() {
        let variant = build(&mut TestData::new(*p, &device, seed, n as u64));
        // A dropout variant's draw: the same pairs in every evaluation.
        let opts = crate::options::AttentionOptions {
            dropout_seed: seed.rotate_left(17) ^ n as u64,
            dropout_offset: n as u32,
            ..Default::default()
        };
        let p = &match crate::validate::call(&variant, *p, &opts) {
            Ok(p) => p,
            Err(e) => {
                failures.push(format!("  shape `{name}`: {e}"));
                continue;
            }
        };
        match variant.host_copy(p) {
            Ok(host) => check_shape(host, name, p, seed, n as u64, &mut failures),
            Err(e) => failures.push(format!("  shape `{name}`: {}::host: {e}", V::NAME)),
        }
    }
    if !failures.is_empty() {
        panic!(
            "boostr: finite-difference check of the reference backward failed for variant `{}` \
             (seed {seed}; rerun with {SEED_ENV}={seed}):\n{}",
            V::NAME,
            failures.join("\n")
        );
    }
}

/// `L = Σ out ∘ g + Σ lse ∘ h` of the f64 reference (over the rows whose
/// lse is finite: the others see no key, and no input moves them).
fn loss<V: HostVariant>(
    variant: &V,
    p: &Problem,
    x: &[Vec<f64>; 3],
    (g, h): (&[f64], &[f64]),
) -> f64 {
    let f = reference_forward(variant, p, &x[0], &x[1], &x[2]);
    let by_lse: f64 = f
        .lse
        .iter()
        .zip(h)
        .filter(|(l, _)| l.is_finite())
        .map(|(l, h)| l * h)
        .sum();
    f.out.iter().zip(g).map(|(o, g)| o * g).sum::<f64>() + by_lse
}

fn check_shape<V: HostVariant>(
    mut variant: V,
    name: &str,
    p: &Problem,
    seed: u64,
    stream: u64,
    failures: &mut Vec<String>,
) {
    let mut rng = Rng::new(seed, stream);
    let mut inputs = [
        rng.normal_f64(p.q_len(), QK_STD),
        rng.normal_f64(p.k_len(), QK_STD),
        rng.normal_f64(p.v_len(), 1.0),
    ];
    let (g, h) = (
        rng.normal_f64(p.out_len(), 1.0),
        rng.normal_f64(p.lse_len(), 1.0),
    );
    let g = (&g[..], &h[..]);
    let [q, k, v] = &inputs;
    let grads = reference_backward_lse(&variant, p, [q, k, v], g);
    let l0 = loss(&variant, p, &inputs, g);
    for (slot, analytic) in grads.tensors.iter().enumerate() {
        let gmax = analytic.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let mut worst = Worst::default();
        for (e, &an) in analytic.iter().enumerate() {
            let hp = f64::from(variant.perturb_learnable(slot, e, TENSOR_STEP));
            let lp = loss(&variant, p, &inputs, g);
            variant.perturb_learnable(slot, e, -(hp as f32));
            let hm = -f64::from(variant.perturb_learnable(slot, e, -TENSOR_STEP));
            let lm = loss(&variant, p, &inputs, g);
            variant.perturb_learnable(slot, e, hm as f32);
            let fd = (lp - lm) / (hp + hm);
            let err = (fd - an).abs();
            let tol = RTOL * an.abs() + TENSOR_ATOL * (1.0 + gmax);
            if err.is_nan() || err > tol {
                worst.note(err, tol, || {
                    format!(
                        "  shape `{name}` ({p:?}): learnable tensor {slot} [{e}]: analytic \
                         {an:e}, finite difference {fd:e}, |diff| {err:.3e} > tol {tol:.3e}"
                    )
                });
            }
        }
        failures.extend(worst.line);
    }
    let shape_of = |t: usize| [p.q_shape(), p.k_shape(), p.v_shape()][t];
    // A declared `score_grad` (straight-through, clamped) is the contract
    // of dq and dk, which finite differences of `score` need not match.
    for (t, (tname, analytic)) in [("dq", &grads.dq), ("dk", &grads.dk), ("dv", &grads.dv)]
        .into_iter()
        .enumerate()
        .filter(|&(t, _)| t == 2 || !V::SCORE_GRAD_GIVEN)
    {
        let gmax = analytic.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let mut kinks = 0;
        let mut worst = Worst::default();
        for e in 0..analytic.len() {
            let x0 = inputs[t][e];
            inputs[t][e] = x0 + STEP;
            let (hp, lp) = (inputs[t][e] - x0, loss(&variant, p, &inputs, g));
            inputs[t][e] = x0 - STEP;
            let (hm, lm) = (x0 - inputs[t][e], loss(&variant, p, &inputs, g));
            inputs[t][e] = x0;
            let fd = (lp - lm) / (hp + hm);
            let an = analytic[e];
            let err = (fd - an).abs();
            let tol = RTOL * an.abs() + ATOL * (1.0 + gmax);
            // A NaN is a failure too.
            if err.is_nan() || tol.is_nan() || err > tol {
                let (right, left) = ((lp - l0) / hp, (l0 - lm) / hm);
                if an.is_finite() && (right - left).abs() > KINK * (1.0 + an.abs()) {
                    kinks += 1;
                    continue;
                }
                worst.note(err, tol, || {
                    format!(
                        "  shape `{name}` ({p:?}): {tname}{:?}: analytic {an:e}, \
                         finite difference {fd:e}, |diff| {err:.3e} > tol {tol:.3e}",
                        unravel(&shape_of(t), e)
                    )
                });
            }
        }
        failures.extend(worst.line);
        if kinks * KINK_BUDGET > analytic.len().max(KINK_BUDGET) {
            failures.push(format!(
                "  shape `{name}` ({p:?}): {tname}: {kinks} of {} elements lie on a kink of \
                 the score (one-sided differences disagree); at most 1 in {KINK_BUDGET} may",
                analytic.len()
            ));
        }
    }
}

/// The failure with the largest error to tolerance ratio (a NaN error the
/// largest of all), of one gradient.
#[derive(Default)]
struct Worst {
    ratio: f64,
    line: Option<String>,
}

impl Worst {
    /// Keep the failure `line` describes if its `err / tol` is the worst yet.
    fn note(&mut self, err: f64, tol: f64, line: impl FnOnce() -> String) {
        let ratio = if err.is_nan() {
            f64::INFINITY
        } else {
            err / tol
        };
        if self.line.is_none() || ratio > self.ratio {
            self.ratio = ratio;
            self.line = Some(line());
        }
    }
}
