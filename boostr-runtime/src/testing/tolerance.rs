//! The tolerance rule: one tensor against its reference, with the naive f32
//! implementation's own error as the yardstick (see
//! [`check_variant`](super::check_variant)).

use super::inputs::Expected;
use super::reference::q_pos;
use super::run_backend::BackendResults;
use super::unravel;
use crate::problem::Problem;
use std::fmt::Write as _;

/// Factor on the naive f32 implementation's max error (FlashAttention's rule).
pub(crate) const NAIVE_FACTOR: f64 = 2.0;
/// The factor of [`check_parity`]: two backends that each pass their own
/// test may each be `NAIVE_FACTOR` naive errors away from the reference, on
/// opposite sides, so twice that apart. With large logits, where every f32
/// implementation's error is decided by the rounding of a few huge logits,
/// two correct backends were measured 2.05 naive errors apart.
pub(crate) const PARITY_FACTOR: f64 = 2.0 * NAIVE_FACTOR;
/// Absolute slack, in units of `1 + max |ref|`: a few ulps of the result,
/// for kernels whose `exp` or division is off by an ulp where the naive f32
/// happens to be exact (e.g. `P = 1` in a row with one visible key).
pub(crate) const SLACK: f64 = 1e-6;
/// Slack for cancellation, in units of `M`, the largest magnitude of the
/// terms summed into the tensor (see `reference_magnitudes`): one rounding
/// of that size. Matters where the result cancels to ~0 but its terms do not
/// (the `dq` of a row with one visible key is pure rounding noise of
/// `dP − D`, scaled by `|k|`).
const CANCEL: f64 = f32::EPSILON as f64;
/// Every flash backward recomputes its scores, and may sum `q·k` in another
/// order than its forward did (a decode step's lanes against the tiles'
/// chain): its `P = exp(s − lse)` is then off by a factor `exp(δ)`, `δ` the
/// two passes' rounding of `s`, about `ε·√D·|s|`, which the naive f32 (one
/// pass: `P` of a one-key row is exactly 1) never shows. The gradients'
/// slack grows by `RECOMPUTE·ε·√D·max|s|` (see [`recomputed_scores`]),
/// relative to the result like [`SLACK`]. (A one-key row's `dv`, which the
/// naive f32 gets exactly, has been seen 18 ulps off on an x86 CPU.)
const RECOMPUTE: f64 = 2.0;

/// The relative error a backward's recomputed `P` may carry on `p`, whose
/// rows' largest scores (`max_scores` of the f64 reference) are given: the
/// gradients' slack adds this (see [`RECOMPUTE`]).
pub(crate) fn recomputed_scores(p: &Problem, max_scores: &[f64]) -> f64 {
    let s = max_scores
        .iter()
        .filter(|s| s.is_finite())
        .fold(0.0f64, |m, s| m.max(s.abs()));
    RECOMPUTE * CANCEL * (p.head_dim as f64).sqrt() * s
}
/// The naive f32 implementation itself must be this close to the reference
/// (in units of `1 + M`, see [`CANCEL`]), else the variant's f32 and f64
/// closures disagree and the tolerance would be meaningless.
const NAIVE_SANITY: f64 = 1e-2;

/// Which index space a tensor lives in, for messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// `[B, Hq, Sq, width]`: q and dq (`D`), out (`Dv`).
    Query(usize),
    /// `[B, Hkv, Sk, width]`: k and dk (`D`), v and dv (`Dv`).
    Key(usize),
    /// `[B, Hq, Sq]`.
    Lse,
    /// A learnable tensor's gradient, by linear position.
    Flat,
}

/// The position of element `index` of a `layout` tensor, in words.
pub(crate) fn locate(layout: Layout, p: &Problem, index: usize) -> String {
    match layout {
        Layout::Query(width) => {
            let [b, h, i, d] = unravel(&[p.batch, p.heads_q, p.seq_q, width], index)[..] else {
                unreachable!()
            };
            format!("[b={b}, h={h}, i={i} (q_pos {}), d={d}]", q_pos(p, i))
        }
        Layout::Key(width) => {
            let [b, h, j, d] = unravel(&[p.batch, p.heads_kv, p.seq_k, width], index)[..] else {
                unreachable!()
            };
            format!("[b={b}, h_kv={h}, j={j} (kv_pos {j}), d={d}]")
        }
        Layout::Lse => {
            let [b, h, i] = unravel(&[p.batch, p.heads_q, p.seq_q], index)[..] else {
                unreachable!()
            };
            format!("[b={b}, h={h}, i={i} (q_pos {})]", q_pos(p, i))
        }
        Layout::Flat => format!("[{index}] (row-major)"),
    }
}

/// Outcome of comparing one tensor.
#[derive(Debug)]
pub(crate) struct Comparison {
    /// Max `|got − want|` over the finite reference entries.
    pub(crate) err: f64,
    /// The bound it was held to.
    pub(crate) bound: f64,
    /// Failure lines (empty when it passed).
    pub(crate) failures: Vec<String>,
}

/// Compare `got` with the f64 reference `want` under the tolerance rule with
/// `factor` on the naive error (`NAIVE_FACTOR` against the reference,
/// `PARITY_FACTOR` between backends), `naive` being the naive f32
/// implementation's result; `recomputed` is the relative error of a
/// recomputed `P` (see [`recomputed_scores`]; 0 for the forward's results).
#[allow(clippy::too_many_arguments)]
pub(crate) fn compare(
    factor: f64,
    label: &str,
    layout: Layout,
    p: &Problem,
    got: &[f32],
    want: &[f64],
    naive: &[f32],
    magnitude: f64,
    recomputed: f64,
) -> Comparison {
    let mut failures = Vec::new();
    let at = |i: usize| locate(layout, p, i);
    if got.len() != want.len() || naive.len() != want.len() {
        failures.push(format!(
            "{label}: {} elements, the reference has {} (naive {})",
            got.len(),
            want.len(),
            naive.len()
        ));
        return Comparison {
            err: f64::INFINITY,
            bound: 0.0,
            failures,
        };
    }
    // Worst of: |got − want|, |naive − want|, and max |want|, over finite refs.
    let (mut err, mut err_at) = (0.0f64, None);
    let (mut naive_err, mut naive_at) = (0.0f64, None);
    let mut ref_max = 0.0f64;
    let (mut bad_got, mut bad_want, mut bad_naive) = (None, None, None);
    let mut bad_got_count = 0usize;
    for (i, ((&g, &w), &nv)) in got.iter().zip(want).zip(naive).enumerate() {
        let (g, nv) = (f64::from(g), f64::from(nv));
        if w.is_nan() {
            bad_want.get_or_insert(i);
            continue;
        }
        if w.is_infinite() {
            // Only lse = −inf is expected; it must be matched exactly.
            if g != w {
                bad_got_count += 1;
                bad_got.get_or_insert(i);
            }
            continue;
        }
        if !g.is_finite() {
            bad_got_count += 1;
            bad_got.get_or_insert(i);
            continue;
        }
        if !nv.is_finite() {
            bad_naive.get_or_insert(i);
            continue;
        }
        ref_max = ref_max.max(w.abs());
        if (g - w).abs() > err {
            (err, err_at) = ((g - w).abs(), Some(i));
        }
        if (nv - w).abs() > naive_err {
            (naive_err, naive_at) = ((nv - w).abs(), Some(i));
        }
    }
    if let Some(i) = bad_want {
        failures.push(format!(
            "{label}: the f64 reference is NaN at {} (the variant's f64 closures produce NaN)",
            at(i)
        ));
    }
    if let Some(i) = bad_got {
        failures.push(format!(
            "{label}: {bad_got_count} non-finite or mismatched-infinite values, first at {}: \
             got {}, want {:e}",
            at(i),
            got[i],
            want[i]
        ));
    }
    let m = magnitude.max(ref_max);
    let sanity = NAIVE_SANITY * (1.0 + m);
    if let Some(i) = bad_naive {
        failures.push(format!(
            "{label}: the naive f32 implementation is not finite at {} (got {}, want {:e}): \
             the variant's f32 closures overflow or produce NaN where its f64 closures do not",
            at(i),
            naive[i],
            want[i]
        ));
    }
    if naive_err > sanity {
        let i = naive_at.unwrap_or(0);
        failures.push(format!(
            "{label}: the naive f32 implementation differs from the f64 reference by \
             {naive_err:.3e} > {sanity:.3e} at {} (naive {}, want {:e}): the variant's f32 \
             closures (score, score_grad, mask) disagree with its f64 closures",
            at(i),
            naive[i],
            want[i]
        ));
    }
    let slack = (SLACK + recomputed) * (1.0 + ref_max);
    let bound = factor * naive_err.min(sanity) + slack + CANCEL * m;
    if err > bound {
        let i = err_at.unwrap_or(0);
        let n = naive_at.unwrap_or(0);
        failures.push(format!(
            "{label}: max |got − want| = {err:.3e} > bound {bound:.3e} \
             (= {factor}·naive err {naive_err:.3e} + ({SLACK:e} + {recomputed:.1e})·(1 + max|want| \
             {ref_max:.3e}) + ε·M, M = {m:.3e}); \
             worst at {}: got {:e}, want {:e}, naive f32 {:e} (naive err there {:.3e}); \
             naive's worst at {}",
            at(i),
            got[i],
            want[i],
            naive[i],
            (f64::from(naive[i]) - want[i]).abs(),
            at(n)
        ));
    }
    Comparison {
        err,
        bound,
        failures,
    }
}

/// Every result of `got` under [`compare`] against `want`; returns the
/// one-line summary of the tensor-op results.
pub(crate) fn compare_results(
    p: &Problem,
    got: &BackendResults,
    want: &Expected,
    factor: f64,
    failures: &mut Vec<String>,
) -> String {
    let [m_out, m_dq, m_dk, m_dv] = want.magnitudes;
    let mut summary = String::new();
    // The forward's results carry no recomputed scores; the gradients do.
    let (fwd, grad) = (0.0, want.recomputed);
    let mut check = |label: &str, layout, got: &[f32], want: &[f64], naive: &[f32], (m, r)| {
        let c = compare(factor, label, layout, p, got, want, naive, m, r);
        failures.extend(c.failures);
        if let Some(short) = label.strip_prefix("attention_") {
            let _ = write!(summary, "{} {:.1e}/{:.1e} ", &short[4..], c.err, c.bound);
        }
    };
    let (wf, wg, nf, ng) = (&want.fwd, &want.grads, &want.naive_fwd, &want.naive_grads);
    let (q_, o_) = (Layout::Query(p.head_dim), Layout::Query(p.head_dim_v));
    let (k_, v_) = (Layout::Key(p.head_dim), Layout::Key(p.head_dim_v));
    let (fo, fl, vo) = (&got.fwd.out, &got.fwd.lse, &got.var_out);
    check("attention_fwd out", o_, fo, &wf.out, &nf.out, (m_out, fwd));
    // lse's magnitude is |lse| itself (taken inside `compare`).
    check(
        "attention_fwd lse",
        Layout::Lse,
        fl,
        &wf.lse,
        &nf.lse,
        (0.0, fwd),
    );
    // Asked for by every other case (`Inputs::draw`).
    if !got.fwd.max_scores.is_empty() {
        let (gm, wm, nm) = (&got.fwd.max_scores, &wf.max_scores, &nf.max_scores);
        check(
            "attention_fwd max_scores",
            Layout::Lse,
            gm,
            wm,
            nm,
            (0.0, fwd),
        );
    }
    check(
        "attention_bwd dq",
        q_,
        &got.grads.dq,
        &wg.dq,
        &ng.dq,
        (m_dq, grad),
    );
    check(
        "attention_bwd dk",
        k_,
        &got.grads.dk,
        &wg.dk,
        &ng.dk,
        (m_dk, grad),
    );
    check(
        "attention_bwd dv",
        v_,
        &got.grads.dv,
        &wg.dv,
        &ng.dv,
        (m_dv, grad),
    );
    check("var_attention out", o_, vo, &wf.out, &nf.out, (m_out, fwd));
    check(
        "GradFn dq",
        q_,
        &got.var_grads.dq,
        &wg.dq,
        &ng.dq,
        (m_dq, grad),
    );
    check(
        "GradFn dk",
        k_,
        &got.var_grads.dk,
        &wg.dk,
        &ng.dk,
        (m_dk, grad),
    );
    check(
        "GradFn dv",
        v_,
        &got.var_grads.dv,
        &wg.dv,
        &ng.dv,
        (m_dv, grad),
    );
    for (slot, want_t) in wg.tensors.iter().enumerate() {
        let (naive, m) = (&ng.tensors[slot], want.tensor_magnitudes[slot]);
        let label = format!("attention_bwd_tensors d{}", want.tensor_names[slot]);
        match got.grads.tensors.get(slot) {
            Some(g) => check(&label, Layout::Flat, g, want_t, naive, (m, grad)),
            None => check(&label, Layout::Flat, &[], want_t, naive, (m, grad)),
        }
        let label = format!("GradFn d{}", want.tensor_names[slot]);
        match got.var_grads.tensors.get(slot) {
            Some(g) => check(&label, Layout::Flat, g, want_t, naive, (m, grad)),
            None => check(&label, Layout::Flat, &[], want_t, naive, (m, grad)),
        }
    }
    summary.push_str("(max err / bound)");
    summary
}
