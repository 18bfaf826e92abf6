//! Exact zeros: rows that see no key, and keys no query sees.

use super::reference::q_pos;
use super::tolerance::{Layout, locate};
use crate::problem::Problem;
use crate::variant::HostVariant;

/// Rows with no visible key must give exactly 0 in `out` and `dq` (with a
/// sink too: their `lse` is the sink); keys that no query sees (under
/// `mask_exact`) exactly 0 in `dk` and `dv`. `rows` are two `out`s and two
/// `dq`s, `keys` a `dk`, a `dv`, a `dk` and a `dv`, in that order (their
/// rows are `Dv` and `D` wide).
pub(crate) fn exact_zeros<V: HostVariant>(
    variant: &V,
    p: &Problem,
    want_lse: &[f64],
    rows: [(&str, &Vec<f32>); 4],
    keys: [(&str, &Vec<f32>); 4],
    failures: &mut Vec<String>,
) {
    let (d, d_v) = (p.head_dim, p.head_dim_v);
    // Rows that see no key: lse −inf, or, with a sink, lse = sink and no
    // key visible under the mask.
    let empty: Vec<bool> = want_lse
        .iter()
        .enumerate()
        .map(|(r, &l)| {
            l == f64::NEG_INFINITY
                || V::WEIGHTS.sink && {
                    let (bh, i) = (r / p.seq_q, r % p.seq_q);
                    let (b, h) = ((bh / p.heads_q) as i32, (bh % p.heads_q) as i32);
                    (0..p.seq_k as i32).all(|j| !variant.mask_exact(b, h, q_pos(p, i), j))
                }
        })
        .collect();
    for ((label, t), width) in rows.into_iter().zip([d_v, d_v, d, d]) {
        let bad = empty
            .iter()
            .enumerate()
            .filter(|&(_, &e)| e)
            .flat_map(|(r, _)| r * width..(r + 1) * width)
            .find(|&e| t.get(e).is_none_or(|&x| x != 0.0));
        if let Some(e) = bad {
            failures.push(format!(
                "{label}: a row with no visible key must be exactly 0, got {:?} at {}",
                t.get(e),
                locate(Layout::Query(width), p, e)
            ));
        }
    }
    let seen = seen_keys(variant, p);
    for ((label, t), width) in keys.into_iter().zip([d, d_v, d, d_v]) {
        let bad = seen
            .iter()
            .enumerate()
            .filter(|&(_, &s)| !s)
            .flat_map(|(r, _)| r * width..(r + 1) * width)
            .find(|&e| t.get(e).is_none_or(|&x| x != 0.0));
        if let Some(e) = bad {
            failures.push(format!(
                "{label}: a key no query sees must have exactly 0 gradient, got {:?} at {}",
                t.get(e),
                locate(Layout::Key(width), p, e)
            ));
        }
    }
}

/// Which keys some query sees: `seen[(b·Hkv + hk)·Sk + j]` when a query of
/// kv head `hk`'s group in batch `b` sees key `j` (under `mask_exact`). The
/// checks fill the K and V rows of the others with NaN and infinities.
pub fn seen_keys<V: HostVariant>(variant: &V, p: &Problem) -> Vec<bool> {
    let mut seen = vec![false; p.batch * p.heads_kv * p.seq_k];
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            let hk = h / p.group();
            for i in 0..p.seq_q {
                for j in 0..p.seq_k {
                    let s = &mut seen[(b * p.heads_kv + hk) * p.seq_k + j];
                    if !*s && variant.mask_exact(b as i32, h as i32, q_pos(p, i), j as i32) {
                        *s = true;
                    }
                }
            }
        }
    }
    seen
}
