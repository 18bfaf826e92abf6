//! The row normalisation on the CPU: how a row's scores become the weights
//! of its values, written once for every CPU kernel (f32 and bf16 tiles,
//! decode, backward) and for the test reference.
//!
//! A variant's [`Weights`] (`HostVariant::WEIGHTS`, a constant) answers
//! every question through [`RowWeights`]: its scalar steps, generic over
//! the float type ([`Float`]: the kernels' f32, the reference's f64), are
//! those the GPU targets lower from the same description
//! (`kernels_spec::emit::gpu::weights`: start a row, rescale it when its
//! max moves, weigh a pair, finish a row, merge partial rows, a pair's
//! weight and gradient in the backward); its row steps are the kernels'
//! vectorised forms of them. Every method matches on the constant, so each
//! kernel compiles to its normalisation's code alone.
//!
//! Dropout is not here: a dropped pair is zeroed in `P` by the call's draw
//! ([`crate::cpu::dropout`]), and the kept ones' `1/(1 − p)` goes into the
//! finish's factor, never into the running sum.

use crate::cpu::math::{self, Lanes};
pub use kernels_spec::ir::{Normalize, Weights};
use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};

/// The float types the normalisation runs in: `f32` (the kernels, the naive
/// f32 reference) and `f64` (the reference).
pub trait Float:
    Copy
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
    /// `0`.
    const ZERO: Self;
    /// `1`.
    const ONE: Self;
    /// `−∞`.
    const NEG_INFINITY: Self;
    /// `eˣ`.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// `|x|`.
    fn abs(self) -> Self;
    /// Exact widening (f64) or identity (f32).
    fn from_f32(x: f32) -> Self;
}

macro_rules! float {
    ($t:ident, $from:expr) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = $t::NEG_INFINITY;
            #[inline(always)]
            fn exp(self) -> Self {
                $t::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                $t::ln(self)
            }
            #[inline(always)]
            fn abs(self) -> Self {
                $t::abs(self)
            }
            #[inline(always)]
            fn from_f32(x: f32) -> Self {
                $from(x)
            }
        }
    };
}

float!(f32, |x| x);
float!(f64, f64::from);

/// `1/(1 + e^−x)`, `0` at `-inf`.
#[inline(always)]
fn sigmoid<T: Float>(x: T) -> T {
    T::ONE / (T::ONE + (-x).exp())
}

/// The normalisation's steps. Implemented once, for [`Weights`].
///
/// A row's state is its running max `m` (starting at its sink, `-inf`
/// without one) and running sum `l` ([`start`](RowWeights::start)); per
/// tile of keys the max moves to `m_new`, the state is rescaled by
/// [`rescale`](RowWeights::rescale) and each pair weighs
/// [`pair`](RowWeights::pair)`(s, m_new)`; a finished row's output is
/// multiplied by [`scale`](RowWeights::scale)`(l)` and its lse is
/// [`lse`](RowWeights::lse)`(m, l)`.
pub trait RowWeights: Copy {
    /// A row's running sum before any key, its running max being `sink`:
    /// a softmax counts a finite sink once; sigmoid weights keep no sum.
    fn start<T: Float>(self, sink: T) -> T;

    /// What a row's running sum and output are multiplied by when its max
    /// moves from `m_old` to `m_new`: `e^(m_old − m_new)` for a softmax (1
    /// while nothing is visible), 1 for sigmoid weights.
    fn rescale<T: Float>(self, m_old: T, m_new: T) -> T;

    /// The unnormalised weight of a pair with score `s` (`-inf` hidden) in a
    /// row whose running max is `m`: `e^(s − m)` (0 while nothing is
    /// visible), or `sigmoid(s)`.
    fn pair<T: Float>(self, s: T, m: T) -> T;

    /// What a finished row's output is multiplied by: `1/l` for a softmax
    /// (0 for a row that saw nothing), 1 for sigmoid weights.
    fn scale<T: Float>(self, l: T) -> T;

    /// A finished row's lse: `m + ln l` for a softmax (`-inf` for a row
    /// that saw nothing), 0 for sigmoid weights.
    fn lse<T: Float>(self, m: T, l: T) -> T;

    /// The weight of a partial row (over some of the keys) in a merge,
    /// `m` the largest partial lse: `e^(lse − m)` for a softmax, 1 for
    /// sigmoid weights (partials add). A merge's sum of weights finishes
    /// like a row's ([`scale`](RowWeights::scale), [`lse`](RowWeights::lse)).
    fn merge<T: Float>(self, lse: T, m: T) -> T;

    /// A visible pair's weight in the backward, from its score and its
    /// row's lse (never `-inf` for a row with a visible pair).
    fn prob<T: Float>(self, s: T, lse: T) -> T;

    /// `d loss / d score` of a pair of weight `p`, with `dpz = d loss / d P`
    /// (its dropout factor included) and its row's `D_i`: `p (dpz − D_i)`
    /// for a softmax, `p (1 − p) dpz` for sigmoid weights.
    fn dz<T: Float>(self, p: T, dpz: T, delta: T) -> T;

    /// The running max of a row after a tile of its scores, `scale` times
    /// the logits in `row` (`scale > 0`; 1 where `row` holds the scores):
    /// `max(m, scale · max(row))`, or `m` for sigmoid weights, which keep
    /// none.
    fn row_max(self, m: f32, row: &[f32], scale: f32) -> f32;

    /// The rescale factors of several rows at once: `alpha` holds each
    /// row's new running max on entry and its factor on return, `m` each
    /// old max on entry and the new one on return (the softmax's `e^(m_old
    /// − m_new)` in a vectorisable `exp`, flushing factors under `2^-64`
    /// to 0 as the weights themselves are; 1 while a row sees nothing).
    fn rescale_rows(self, m: &mut [f32], alpha: &mut [f32]);

    /// A tile of one row's scores, `scale` times the logits in `row`
    /// (`-inf` hidden; as in [`row_max`](RowWeights::row_max)), into its
    /// weights in place, `m` the row's running max after the tile; returns
    /// the running sum's lanes `l` plus them (unchanged for sigmoid
    /// weights). A score is rounded to f32 before its weight is taken, so
    /// that a scale here gives the bits a scaled row would.
    fn weigh_row(self, row: &mut [f32], m_scale: (f32, f32), l: Lanes) -> Lanes;

    /// A tile of one row's scores, `scale` times the logits in `row`
    /// (`-inf` hidden; `scale > 0`, as in [`weigh_row`](RowWeights::weigh_row)),
    /// into the backward's weights in place, from the row's lse: 0 where
    /// hidden, and everywhere in a softmax row that saw nothing (`lse =
    /// -inf`).
    fn prob_row(self, row: &mut [f32], lse_scale: (f32, f32));
}

impl RowWeights for Weights {
    #[inline(always)]
    fn start<T: Float>(self, sink: T) -> T {
        match self.normalize {
            Normalize::Softmax if sink != T::NEG_INFINITY => T::ONE,
            _ => T::ZERO,
        }
    }

    #[inline(always)]
    fn rescale<T: Float>(self, m_old: T, m_new: T) -> T {
        match self.normalize {
            Normalize::Softmax if m_new != T::NEG_INFINITY => (m_old - m_new).exp(),
            _ => T::ONE,
        }
    }

    #[inline(always)]
    fn pair<T: Float>(self, s: T, m: T) -> T {
        match self.normalize {
            Normalize::Softmax if m == T::NEG_INFINITY => T::ZERO,
            Normalize::Softmax => (s - m).exp(),
            Normalize::Sigmoid if s == T::NEG_INFINITY => T::ZERO,
            Normalize::Sigmoid => sigmoid(s),
        }
    }

    #[inline(always)]
    fn scale<T: Float>(self, l: T) -> T {
        match self.normalize {
            Normalize::Softmax if l > T::ZERO => T::ONE / l,
            Normalize::Softmax => T::ZERO,
            Normalize::Sigmoid => T::ONE,
        }
    }

    #[inline(always)]
    fn lse<T: Float>(self, m: T, l: T) -> T {
        match self.normalize {
            Normalize::Softmax if l > T::ZERO => m + l.ln(),
            Normalize::Softmax => T::NEG_INFINITY,
            Normalize::Sigmoid => T::ZERO,
        }
    }

    #[inline(always)]
    fn merge<T: Float>(self, lse: T, m: T) -> T {
        match self.normalize {
            Normalize::Softmax if m == T::NEG_INFINITY => T::ZERO,
            Normalize::Softmax => (lse - m).exp(),
            Normalize::Sigmoid => T::ONE,
        }
    }

    #[inline(always)]
    fn prob<T: Float>(self, s: T, lse: T) -> T {
        match self.normalize {
            Normalize::Softmax => (s - lse).exp(),
            Normalize::Sigmoid => sigmoid(s),
        }
    }

    #[inline(always)]
    fn dz<T: Float>(self, p: T, dpz: T, delta: T) -> T {
        match self.normalize {
            Normalize::Softmax => p * (dpz - delta),
            Normalize::Sigmoid => p * (T::ONE - p) * dpz,
        }
    }

    #[inline(always)]
    fn row_max(self, m: f32, row: &[f32], scale: f32) -> f32 {
        match self.normalize {
            Normalize::Softmax => m.max(scale * math::max(row)),
            Normalize::Sigmoid => m,
        }
    }

    #[inline(always)]
    fn rescale_rows(self, m: &mut [f32], alpha: &mut [f32]) {
        match self.normalize {
            Normalize::Softmax => {
                for (a, m) in alpha.iter_mut().zip(m.iter_mut()) {
                    let m_new = *a;
                    *a = if m_new == f32::NEG_INFINITY {
                        1.0
                    } else {
                        math::exp_softmax(*m - m_new)
                    };
                    *m = m_new;
                }
            }
            Normalize::Sigmoid => alpha.fill(1.0),
        }
    }

    #[inline(always)]
    fn weigh_row(self, row: &mut [f32], (m, scale): (f32, f32), l: Lanes) -> Lanes {
        match self.normalize {
            // Nothing visible in this row yet: `e^(x − m)` would be
            // `e^(-inf + inf)` = NaN. The row contributes nothing.
            Normalize::Softmax if m == f32::NEG_INFINITY => {
                row.fill(0.0);
                l
            }
            Normalize::Softmax => math::exp_sub_lanes(row, (scale, m), l),
            Normalize::Sigmoid => {
                if scale != 1.0 {
                    math::scale(row, scale);
                }
                math::sigmoid_in_place(row);
                l
            }
        }
    }

    #[inline(always)]
    fn prob_row(self, row: &mut [f32], (lse, scale): (f32, f32)) {
        match self.normalize {
            // No visible key in this row: P = 0 (and `x − lse` would be
            // NaN).
            Normalize::Softmax if lse == f32::NEG_INFINITY => row.fill(0.0),
            Normalize::Softmax => math::exp_sub(row, (scale, lse)),
            Normalize::Sigmoid => {
                if scale != 1.0 {
                    math::scale(row, scale);
                }
                math::sigmoid_in_place(row);
            }
        }
    }
}

/// A finished row: `out` (its unnormalised output) multiplied by
/// `weights`' [`scale`](RowWeights::scale) of its running sum `l` and by
/// `keep` (`1/(1 − p)` with dropout, else 1); returns its lse. A softmax
/// row that saw nothing gets zeros (its output was never written).
#[inline(always)]
pub(in crate::cpu) fn finish_row(
    weights: Weights,
    (m, l): (f32, f32),
    out: &mut [f32],
    keep: f32,
) -> f32 {
    let scale = weights.scale(l);
    if scale == 0.0 {
        out.fill(0.0);
    } else if scale * keep != 1.0 {
        math::scale(out, scale * keep);
    }
    weights.lse(m, l)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIGMOID: Weights = Weights::new(Normalize::Sigmoid, false, false);

    /// A softmax row weighed tile by tile with rescales (the kernels' way)
    /// is the whole row's softmax, sink included; its merge of two halves
    /// is the whole row's too. Sigmoid weights are per pair, and add.
    #[test]
    fn online_steps_make_the_whole_rows_weights() {
        let z = [0.5f64, -1.0, f64::NEG_INFINITY, 2.0, 0.25];
        let sink = 1.5f64;
        for w in [Weights::SOFTMAX, SIGMOID] {
            let sink = if w.has_lse() { sink } else { f64::NEG_INFINITY };
            let (mut m, mut l) = (sink, w.start(sink));
            let mut p = Vec::new();
            for tile in z.chunks(2) {
                let m_new = tile.iter().copied().fold(m, f64::max);
                let alpha = w.rescale(m, m_new);
                l *= alpha;
                p.iter_mut().for_each(|x: &mut f64| *x *= alpha);
                p.extend(tile.iter().map(|&s| w.pair(s, m_new)));
                l += tile.iter().map(|&s| w.pair(s, m_new)).sum::<f64>();
                m = m_new;
            }
            let scale = w.scale(l);
            let lse = w.lse(m, l);
            let denominator: f64 = z.iter().map(|x| x.exp()).sum::<f64>() + sink.exp();
            for (j, &s) in z.iter().enumerate() {
                let want = match w.normalize {
                    Normalize::Softmax => s.exp() / denominator,
                    Normalize::Sigmoid => 1.0 / (1.0 + (-s).exp()),
                };
                assert!((p[j] * scale - want).abs() < 1e-15, "{w:?} pair {j}");
                assert!((w.prob(s, lse) - want).abs() < 1e-15, "{w:?} prob {j}");
            }
            if w.has_lse() {
                assert!((lse - denominator.ln()).abs() < 1e-15);
            } else {
                assert_eq!(lse, 0.0);
            }
            // Two partial rows (their own outputs of weight 1 per pair),
            // merged by their lse.
            let part = |keys: &[f64], sink: f64| {
                let m = keys.iter().copied().fold(sink, f64::max);
                let l: f64 = w.start(sink) * w.rescale(sink, m)
                    + keys.iter().map(|&s| w.pair(s, m)).sum::<f64>();
                let out: f64 = keys.iter().map(|&s| w.pair(s, m)).sum::<f64>() * w.scale(l);
                (out, w.lse(m, l))
            };
            let (a, b) = (part(&z[..2], sink), part(&z[2..], f64::NEG_INFINITY));
            let m = a.1.max(b.1);
            let (wa, wb) = (w.merge(a.1, m), w.merge(b.1, m));
            let merged = (a.0 * wa + b.0 * wb) * w.scale(wa + wb);
            let whole: f64 = z.iter().enumerate().map(|(j, _)| p[j] * scale).sum();
            assert!((merged - whole).abs() < 1e-15, "{w:?} merge");
            assert!((w.lse(m, wa + wb) - lse).abs() < 1e-15, "{w:?} merged lse");
        }
    }

    /// A row that sees nothing: no NaN anywhere, zero weights and output,
    /// lse -inf (a softmax) or 0.
    #[test]
    fn a_row_that_sees_nothing_has_no_nan() {
        for w in [Weights::SOFTMAX, SIGMOID] {
            let ninf = f32::NEG_INFINITY;
            let m = w.row_max(ninf, &[ninf; 3], 1.0);
            assert_eq!(w.rescale(ninf, m), 1.0);
            let mut row = [ninf; 20];
            let l = w.weigh_row(&mut row, (m, 1.0), [0.0; math::LANES]);
            assert!(row.iter().all(|&x| x == 0.0), "{w:?}");
            let mut bits = [7u16; 20];
            math::round_bf16(&row, &mut bits);
            assert!(bits.iter().all(|&x| x == 0), "{w:?}");
            let mut out = [f32::NAN; 4];
            let lse = finish_row(w, (m, math::sum_lanes(&l)), &mut out, 1.0);
            if w.has_lse() {
                assert!(out.iter().all(|&x| x == 0.0));
                assert_eq!(lse, ninf);
                let mut probs = [1.0f32; 3];
                w.prob_row(&mut probs, (lse, 1.0));
                assert_eq!(probs, [0.0; 3]);
            } else {
                assert_eq!(lse, 0.0);
            }
        }
    }
}
