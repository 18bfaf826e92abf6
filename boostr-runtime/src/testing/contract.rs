//! The variant's own contract: `mask` and `mask_exact` agree, no mask means
//! every pair is visible, an identity score is the identity, and the tile
//! classifier never says `Empty` or `Full` wrongly.

use super::reference::q_pos;
use crate::problem::Problem;
use crate::variant::{HostVariant, TileClass};

/// Tilings on which `classify_tile` is checked: (query rows, keys) per tile.
const TILINGS: &[(usize, usize)] = &[(16, 16), (7, 13), (64, 32), (usize::MAX, usize::MAX)];

/// The variant's own contract, on the positions of problem `p`.
pub(crate) fn contract<V: HostVariant>(variant: &V, p: &Problem, failures: &mut Vec<String>) {
    let name = V::NAME;
    let (sq, sk) = (p.seq_q, p.seq_k);
    // Each kind of breach is reported once (its first instance).
    let (mut mask_reported, mut unmasked_reported, mut tile_reported) = (false, false, false);
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            let (bi, hi) = (b as i32, h as i32);
            // vis[i·Sk + j] under the f32 mask, the one kernels evaluate.
            let mut vis = vec![false; sq * sk];
            let mut mismatch: Option<(i32, i32, bool, bool)> = None;
            let mut unmasked_hidden = None;
            for i in 0..sq {
                let qi = q_pos(p, i);
                for j in 0..sk {
                    let ji = j as i32;
                    let (m32, m64) = (
                        variant.mask(bi, hi, qi, ji),
                        variant.mask_exact(bi, hi, qi, ji),
                    );
                    vis[i * sk + j] = m32;
                    if m32 != m64 && mismatch.is_none() {
                        mismatch = Some((qi, ji, m32, m64));
                    }
                    if !(V::HAS_MASK || m32 && m64) && unmasked_hidden.is_none() {
                        unmasked_hidden = Some((qi, ji));
                    }
                }
            }
            if let Some((qi, ji, m32, m64)) = mismatch.filter(|_| !mask_reported) {
                mask_reported = true;
                failures.push(format!(
                    "variant `{name}`: mask({b}, {h}, q={qi}, kv={ji}) = {m32} but mask_exact = {m64}"
                ));
            }
            if let Some((qi, ji)) = unmasked_hidden.filter(|_| !unmasked_reported) {
                unmasked_reported = true;
                failures.push(format!(
                    "variant `{name}`: HAS_MASK is false but the mask hides (b={b}, h={h}, \
                     q={qi}, kv={ji})"
                ));
            }
            if tile_reported {
                continue;
            }
            'tilings: for &(ti, tj) in TILINGS {
                for i0 in (0..sq).step_by(ti.min(sq)) {
                    let i1 = i0.saturating_add(ti).min(sq);
                    for j0 in (0..sk).step_by(tj.min(sk)) {
                        let j1 = j0.saturating_add(tj).min(sk);
                        let (q_lo, q_hi) = (q_pos(p, i0), q_pos(p, i1 - 1));
                        let (kv_lo, kv_hi) = (j0 as i32, (j1 - 1) as i32);
                        let class = variant.classify_tile(bi, hi, q_lo, q_hi, kv_lo, kv_hi);
                        let want_vis = match class {
                            TileClass::Partial => continue,
                            TileClass::Empty => false,
                            TileClass::Full => true,
                        };
                        let wrong = (i0..i1).find_map(|i| {
                            (j0..j1)
                                .find(|&j| vis[i * sk + j] != want_vis)
                                .map(|j| (i, j))
                        });
                        if let Some((i, j)) = wrong {
                            failures.push(format!(
                                "variant `{name}`: classify_tile(b={b}, h={h}, q {q_lo}..={q_hi}, \
                                 kv {kv_lo}..={kv_hi}) = {class:?}, but mask(q={}, kv={j}) = {}",
                                q_pos(p, i),
                                !want_vis
                            ));
                            tile_reported = true;
                            break 'tilings;
                        }
                    }
                }
            }
        }
    }
    if V::SCORE_IS_IDENTITY {
        for s in [-1.0e4f32, -3.5, -1.0, -0.0, 0.0, 0.25, 1.0, 7.5, 1.0e4] {
            let (qi, kv) = (q_pos(p, p.seq_q - 1), (p.seq_k - 1) as i32);
            let got = (
                variant.score(s, 0, 0, qi, kv),
                variant.score_grad(s, 0, 0, qi, kv),
                variant.score_f64(f64::from(s), 0, 0, qi, kv),
                variant.score_grad_f64(f64::from(s), 0, 0, qi, kv),
            );
            if got != (s, 1.0, f64::from(s), 1.0) {
                failures.push(format!(
                    "variant `{name}`: SCORE_IS_IDENTITY is true but at s = {s} \
                     (score, score_grad, score_f64, score_grad_f64) = {got:?}"
                ));
                break;
            }
        }
    }
}
