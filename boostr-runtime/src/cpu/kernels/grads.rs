//! The backward's elementwise steps on a tile, shared by the f32 and the
//! bf16 backward: `P` recomputed from the lse, `dS` from `P` and `dP`
//! (through the variant's [`Weights`](crate::cpu::weights::Weights)), and the
//! learnable tensors' terms.

use crate::cpu::Band;
use crate::cpu::dropout::Draw;
use crate::cpu::forward::apply_mask;
use crate::cpu::math;
use crate::cpu::simd::Elementwise;
use crate::cpu::weights::RowWeights as _;
use crate::problem::Problem;
use crate::variant::{HostVariant, TileClass};
use std::marker::PhantomData;
use std::ops::Range;

/// `f(at, qi, kj)` for each row of each band: `at` the row's elements in a
/// tile of `cols` columns, `qi` its query's position, `kj` the position of
/// its band's first key.
pub(in crate::cpu) fn each_band_row(
    bands: &[Band],
    cols: usize,
    q_lo: i32,
    kv_lo: i32,
    mut f: impl FnMut(Range<usize>, i32, i32),
) {
    for Band { rows: r, cols: c } in bands.iter().cloned() {
        for i in r {
            f(
                i * cols + c.start..i * cols + c.end,
                q_lo + i as i32,
                kv_lo + c.start as i32,
            );
        }
    }
}

/// With dropout, a tile's pairs as the forward weighed them: `pd = P Z`
/// (the weights of `P V`, `Z` each pair's factor, 0 or `1/(1 − p)`), and
/// `dp` times `Z` in place (`d loss / d P` from `d loss / d (P Z)`).
/// `None` without dropout (the forward's `P V` used `P`). `s` holds `P`,
/// tiles of `cols` columns, pair `(i, j)` at `(q_lo + i, kv_lo + j)`.
#[allow(clippy::too_many_arguments)]
pub(in crate::cpu) fn dropped<'a, V: HostVariant>(
    p: &Problem,
    variant: &V,
    (b, h): (i32, i32),
    (q_lo, kv_lo): (i32, i32),
    bands: &[Band],
    cols: usize,
    (s, pd, dp): (&[f32], &'a mut [f32], &mut [f32]),
) -> Option<&'a [f32]> {
    if !V::WEIGHTS.dropout {
        return None;
    }
    let draw = Draw::new(p, variant, b, h)?;
    each_band_row(bands, cols, q_lo, kv_lo, |at, qi, kj| {
        draw.keep_scaled(qi, kj, &s[at.clone()], &mut pd[at.clone()]);
        draw.scale_kept(qi, kj, &mut dp[at]);
    });
    Some(pd)
}

/// The learnable tensors' terms of a tile into `grads`: by diagonal where
/// every read goes by the position difference (`diag` its scratch), else
/// pair by pair (`raw` the logits before `score`). `p` holds `P`, `dp`
/// `d loss / d P`.
#[allow(clippy::too_many_arguments)]
pub(in crate::cpu) fn learnable_terms<V: HostVariant>(
    variant: &V,
    at: (i32, i32, i32, i32),
    bands: &[Band],
    (p, raw): (&[f32], &[f32]),
    dp: &[f32],
    delta: &[f32],
    diag: &mut [f32],
    grads: &mut [&mut [f32]],
) {
    if V::SCORE_GRADS_BY_DIFFERENCE {
        diagonal_tensor_grads(variant, at, bands, p, dp, delta, diag, grads);
    } else {
        tensor_grads(variant, at, bands, p, raw, dp, delta, grads);
    }
}

/// Learnable reads of `score` over one tile: every visible pair adds
/// `dz · ∂score/∂read`, `dz` the normalisation's `d loss / d score` of its
/// weight `p` and `d loss / d P` (`dp`, its dropout factor included), in
/// row-major order.
#[allow(clippy::too_many_arguments)]
fn tensor_grads<V: HostVariant>(
    variant: &V,
    (b, h, q_lo, kv_lo): (i32, i32, i32, i32),
    bands: &[Band],
    p: &[f32],
    raw: &[f32],
    dp: &[f32],
    delta: &[f32],
    grads: &mut [&mut [f32]],
) {
    let cols = p.len() / delta.len();
    for Band { rows: r, cols: c } in bands.iter().cloned() {
        for i in r {
            let qi = q_lo + i as i32;
            for j in c.clone() {
                let at = i * cols + j;
                let pij = p[at];
                if pij == 0.0 {
                    continue;
                }
                let dz = V::WEIGHTS.dz(pij, dp[at], delta[i]);
                variant.score_tensor_grads(raw[at], b, h, qi, kv_lo + j as i32, dz, grads);
            }
        }
    }
}

/// [`tensor_grads`] for reads that depend on the pair only through
/// `kv − q` ([`HostVariant::SCORE_GRADS_BY_DIFFERENCE`]): every pair of a
/// diagonal adds the same derivative at the same element, so the tile's
/// `dz` are summed per diagonal (rows in order, a vector add along each
/// row), and the reads are evaluated once per diagonal, at its first pair
/// in the tile (the logit is not read).
#[allow(clippy::too_many_arguments)]
fn diagonal_tensor_grads<V: HostVariant>(
    variant: &V,
    (b, h, q_lo, kv_lo): (i32, i32, i32, i32),
    bands: &[Band],
    p: &[f32],
    dp: &[f32],
    delta: &[f32],
    diag: &mut [f32],
    grads: &mut [&mut [f32]],
) {
    let rows = delta.len();
    let cols = p.len() / rows;
    // Diagonal `rows − 1 + j − i` holds pair (i, j).
    let diag = &mut diag[..rows + cols - 1];
    diag.fill(0.0);
    for Band { rows: r, cols: c } in bands.iter().cloned() {
        for i in r {
            let at = i * cols;
            let (p, dp) = (&p[at + c.start..at + c.end], &dp[at + c.start..at + c.end]);
            let d = &mut diag[rows - 1 - i + c.start..rows - 1 - i + c.end];
            let di = delta[i];
            for ((x, &pij), &dpij) in d.iter_mut().zip(p).zip(dp) {
                // A hidden pair (P = 0) adds nothing, even where its dP is
                // NaN (a hidden key's V row).
                *x += if pij != 0.0 {
                    V::WEIGHTS.dz(pij, dpij, di)
                } else {
                    0.0
                };
            }
        }
    }
    for (k, &dz) in diag.iter().enumerate() {
        if dz != 0.0 {
            // The diagonal's first pair in the tile.
            let i = (rows - 1).saturating_sub(k);
            let j = i + k + 1 - rows;
            variant.score_tensor_grads(0.0, b, h, q_lo + i as i32, kv_lo + j as i32, dz, grads);
        }
    }
}

/// Recompute the probabilities of one tile from the saved log-sum-exp:
/// `s` (scaled logits) becomes `P = e^(x − lse)`, 0 where hidden; `g`
/// receives `score_grad` at the raw logits (untouched for identity scores).
pub(in crate::cpu) struct Probabilities<'a, V> {
    pub(in crate::cpu) variant: &'a V,
    pub(in crate::cpu) b: i32,
    pub(in crate::cpu) h: i32,
    /// Position of the tile's first query row and first key.
    pub(in crate::cpu) q_lo: i32,
    pub(in crate::cpu) kv_lo: i32,
    pub(in crate::cpu) class: TileClass,
    /// The tile rows' log-sum-exp.
    pub(in crate::cpu) lse: &'a [f32],
    /// Logits, times `scale` (applied here: 1 where the product scaled
    /// them already).
    pub(in crate::cpu) s: &'a mut [f32],
    pub(in crate::cpu) scale: f32,
    pub(in crate::cpu) g: &'a mut [f32],
    /// Only the bands' elements are read and written.
    pub(in crate::cpu) bands: &'a [Band],
}

impl<V: HostVariant> Elementwise for Probabilities<'_, V> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let Self {
            variant,
            b,
            h,
            q_lo,
            kv_lo,
            class,
            lse,
            s,
            scale,
            g,
            bands,
        } = self;
        let cols = s.len() / lse.len();
        // As in the forward: an identity score's logits are scaled as the
        // weights read them.
        let weigh_scale = if V::SCORE_IS_IDENTITY && scale > 0.0 {
            scale
        } else {
            1.0
        };
        for Band { rows: r, cols: c } in bands.iter().cloned() {
            let kv_c = kv_lo + c.start as i32;
            for i in r {
                let qi = q_lo + i as i32;
                let row = &mut s[i * cols + c.start..i * cols + c.end];
                if scale != weigh_scale {
                    math::scale(row, scale);
                }
                let g = &mut g[if V::SCORE_GRAD_IS_ONE {
                    0..0
                } else {
                    i * cols + c.start..i * cols + c.end
                }];
                if V::SCORE_CHECKS_READS && class == TileClass::Partial {
                    // A score with checked reads runs only at visible pairs
                    // (see the forward's `score_and_mask`).
                    for (j, x) in row.iter_mut().enumerate() {
                        let kv = kv_c + j as i32;
                        let visible = variant.mask(b, h, qi, kv);
                        if let Some(g) = g.get_mut(j) {
                            *g = if visible {
                                variant.score_grad(*x, b, h, qi, kv)
                            } else {
                                0.0
                            };
                        }
                        *x = if visible {
                            variant.score(*x, b, h, qi, kv)
                        } else {
                            f32::NEG_INFINITY
                        };
                    }
                } else if !V::SCORE_GRAD_IS_ONE {
                    // d score/d s at the raw logit, then the score over it,
                    // in one loop so that what they share (softcap's `tanh`,
                    // say) is computed once.
                    for (j, (g, x)) in g.iter_mut().zip(row.iter_mut()).enumerate() {
                        let kv = kv_c + j as i32;
                        *g = variant.score_grad(*x, b, h, qi, kv);
                        *x = variant.score(*x, b, h, qi, kv);
                    }
                } else if !V::SCORE_IS_IDENTITY {
                    for (j, x) in row.iter_mut().enumerate() {
                        *x = variant.score(*x, b, h, qi, kv_c + j as i32);
                    }
                }
                apply_mask(variant, b, h, qi, kv_c, class, row);
                V::WEIGHTS.prob_row(row, (lse[i], weigh_scale));
            }
        }
    }
}

/// `dS = dz ∘ score_grad`, in place over `dp`, for one tile: `dz` the
/// normalisation's `d loss / d score` of each pair's weight `P` and its
/// `d loss / d P` (`dp`, the dropout factor included), `p (dP − D)` for a
/// softmax.
pub(in crate::cpu) struct ScoreGrads<'a, V> {
    pub(in crate::cpu) p: &'a [f32],
    /// `score_grad` values (empty where it is 1).
    pub(in crate::cpu) g: &'a [f32],
    /// The tile rows' `D_i`.
    pub(in crate::cpu) delta: &'a [f32],
    pub(in crate::cpu) dp: &'a mut [f32],
    /// Only the bands' elements are read and written.
    pub(in crate::cpu) bands: &'a [Band],
    /// A `Partial` tile: some pairs are hidden, and their `dP` (from a V
    /// row that may hold NaN) must not reach `dS`.
    pub(in crate::cpu) partial: bool,
    pub(in crate::cpu) variant: PhantomData<V>,
}

impl<V: HostVariant> Elementwise for ScoreGrads<'_, V> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let Self {
            p,
            g,
            delta,
            dp,
            bands,
            partial,
            ..
        } = self;
        let w = V::WEIGHTS;
        let cols = p.len() / delta.len();
        for Band { rows: r, cols: c } in bands.iter().cloned() {
            for i in r {
                let at = i * cols + c.start..i * cols + c.end;
                let (ds, p, di) = (&mut dp[at.clone()], &p[at.clone()], delta[i]);
                if V::SCORE_GRAD_IS_ONE && !partial {
                    for (ds, &p) in ds.iter_mut().zip(p) {
                        *ds = w.dz(p, *ds, di);
                    }
                } else if V::SCORE_GRAD_IS_ONE {
                    // Hidden pairs (P = 0) stay exactly 0.
                    for (ds, &p) in ds.iter_mut().zip(p) {
                        let v = w.dz(p, *ds, di);
                        *ds = if p == 0.0 { 0.0 } else { v };
                    }
                } else {
                    // Hidden pairs (P = 0) stay exactly 0 whatever
                    // score_grad says about a logit that was never used.
                    for ((ds, &p), &g) in ds.iter_mut().zip(p).zip(&g[at.clone()]) {
                        let v = w.dz(p, *ds, di) * g;
                        *ds = if p == 0.0 { 0.0 } else { v };
                    }
                }
            }
        }
    }
}
