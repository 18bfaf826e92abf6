//! Draft trees of speculative decoding as [`DraftTree`]'s preorder
//! intervals, from parent indices or ancestor bit masks.

use crate::error::{Error, Result};
use crate::keys::index_values;
use crate::stock::DraftTree;
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// An error of the tree's rules.
fn broken<T>(rule: &'static str, got: String) -> Result<T> {
    Err(Error::DraftTree { rule, got })
}

/// The preorder intervals `(pre, end)` of a tree of `parents.len()` drafts,
/// numbered from 1: draft `i`'s parent is `parents[i]`, a draft before it,
/// or −1 for a child of the prefix. `seq` names the sequence in errors.
pub(crate) fn intervals(parents: &[i32], seq: usize) -> Result<(Vec<i32>, Vec<i32>)> {
    let n = parents.len();
    let mut children = vec![Vec::new(); n];
    let mut roots = Vec::new();
    for (i, &p) in parents.iter().enumerate() {
        match usize::try_from(p) {
            Ok(p) if p < i => children[p].push(i),
            _ if p == -1 => roots.push(i),
            _ => {
                return broken(
                    "each draft's parent is an earlier draft, or -1 for the prefix",
                    format!("parents[{seq}][{i}] = {p}"),
                );
            }
        }
    }
    let (mut pre, mut end) = (vec![0i32; n], vec![0i32; n]);
    let mut next = 1i32;
    // Depth-first, children in index order; an explicit stack (a chain of
    // drafts is as deep as it is long).
    let mut stack: Vec<(usize, bool)> = roots.iter().rev().map(|&r| (r, false)).collect();
    while let Some((node, done)) = stack.pop() {
        if done {
            end[node] = next;
            continue;
        }
        pre[node] = next;
        next += 1;
        stack.push((node, true));
        stack.extend(children[node].iter().rev().map(|&c| (c, false)));
    }
    Ok((pre, end))
}

/// The parents of a tree given as ancestor masks: bit `j` of `masks[i]` is
/// set when draft `j` is an ancestor of draft `i` or `i` itself.
pub(crate) fn parents_of_masks(masks: &[i64], seq: usize) -> Result<Vec<i32>> {
    let mut parents = Vec::with_capacity(masks.len());
    for (i, &m) in masks.iter().enumerate() {
        let m = m as u64;
        let own = 1u64 << i;
        let below = m & !own;
        let bad = |rule| broken(rule, format!("masks[{seq}][{i}] = {m:#x}"));
        if m & own == 0 {
            return bad("each draft's mask has its own bit");
        }
        if m >> i > 1 {
            return bad("a draft's ancestors come before it (no bit above its own)");
        }
        let parent = if below == 0 {
            -1
        } else {
            63 - below.leading_zeros() as i32
        };
        let want = if parent < 0 {
            own
        } else {
            masks[parent as usize] as u64 | own
        };
        if m != want {
            return bad("a draft's mask is its parent's (its highest other bit) and its own bit");
        }
        parents.push(parent);
    }
    Ok(parents)
}

impl<R: Runtime<DType = DType>> DraftTree<R> {
    /// The tree of `parents` (`[B, n]` `i32`: draft `i`'s parent, an earlier
    /// draft, or −1 for a child of the prefix) over sequences of `lengths`
    /// (`[B]` `i32`, the drafts included: sequence `b`'s drafts are its
    /// positions `lengths[b] − n ..`), for calls of `seq_k` key positions
    /// (a dense call's `Sk`, a cache's capacity, pages' `max_pages ·
    /// page_size`). The call's queries are the `n` draft rows.
    pub fn from_parents(parents: &Tensor<R>, lengths: &Tensor<R>, seq_k: usize) -> Result<Self> {
        let shape = parents.shape();
        if shape.len() != 2 {
            return Err(Error::Rank {
                name: "parents",
                rank: 2,
                layout: "[B, drafts]",
                shape: shape.to_vec(),
            });
        }
        let (b, n) = (shape[0], shape[1]);
        let parents = index_values("parents", parents, shape)?;
        let lens = index_values("lengths", lengths, &[b])?;
        let mut trees = Vec::with_capacity(b);
        for seq in 0..b {
            trees.push(intervals(&parents[seq * n..][..n], seq)?);
        }
        Self::placed(&trees, &lens, seq_k, lengths.device())
    }

    /// The tree of ancestor masks (`[B, n]` `i64`, `n <= 64`: bit `j` of
    /// row `i` set when draft `j` is an ancestor of draft `i` or `i`
    /// itself, as SGLang's and FlashInfer's bit-packed tree masks), placed
    /// as in [`from_parents`](Self::from_parents).
    pub fn from_masks(masks: &Tensor<R>, lengths: &Tensor<R>, seq_k: usize) -> Result<Self> {
        let shape = masks.shape();
        if shape.len() != 2 || shape[1] > 64 {
            return Err(Error::Rank {
                name: "masks",
                rank: 2,
                layout: "[B, drafts <= 64]",
                shape: shape.to_vec(),
            });
        }
        if masks.dtype() != DType::I64 {
            return broken("masks are i64", format!("{:?}", masks.dtype()));
        }
        let (b, n) = (shape[0], shape[1]);
        let values = masks.contiguous()?.to_vec::<i64>();
        let lens = index_values("lengths", lengths, &[b])?;
        let mut trees = Vec::with_capacity(b);
        for seq in 0..b {
            let parents = parents_of_masks(&values[seq * n..][..n], seq)?;
            trees.push(intervals(&parents, seq)?);
        }
        Self::placed(&trees, &lens, seq_k, lengths.device())
    }

    /// The `[B, seq_k]` tensors of per-sequence intervals, each sequence's
    /// drafts ending at its length.
    fn placed(
        trees: &[(Vec<i32>, Vec<i32>)],
        lens: &[i32],
        seq_k: usize,
        device: &R::Device,
    ) -> Result<Self> {
        let b = trees.len();
        let (mut pre, mut end) = (vec![0i32; b * seq_k], vec![i32::MAX; b * seq_k]);
        for (seq, ((p, e), &len)) in trees.iter().zip(lens).enumerate() {
            let n = p.len();
            let Some(len) = usize::try_from(len).ok().filter(|&l| l >= n && l <= seq_k) else {
                return broken(
                    "each length holds the drafts and fits the call's keys",
                    format!("lengths[{seq}] = {len} with {n} drafts and {seq_k} keys"),
                );
            };
            let row = seq * seq_k + len - n;
            pre[row..row + n].copy_from_slice(p);
            end[row..row + n].copy_from_slice(e);
        }
        Ok(DraftTree {
            pre: Tensor::<R>::from_slice(&pre, &[b, seq_k], device)?,
            end: Tensor::<R>::from_slice(&end, &[b, seq_k], device)?,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::stock::Full;
    use crate::testing::{Rng, SEED_ENV, choose_seed};
    use crate::{AttentionOptions, AttentionRuntime, Keys, attention};

    /// Draft rows over a cache and over the same keys in shuffled pages:
    /// row `i` of a tree equals plain attention of its query over the
    /// prefix and `i`'s ancestors alone (gathered on the host), for every
    /// sequence, head and row; the prefix lengths differ per sequence.
    pub(crate) fn drafts_see_the_prefix_and_their_ancestors_on<R: AttentionRuntime>(
        device: &R::Device,
    ) {
        let seed = choose_seed();
        let context = format!("seed {seed} (rerun with {SEED_ENV}={seed})");
        let mut rng = Rng::new(seed, 0);
        let (b, hq, hkv, n, d, cap, page) = (2, 4, 2, 7, 16, 48, 8);
        let lens = [20 + n, 31 + n];
        let parents: Vec<i32> = (0..b * n)
            .map(|at| match at % n {
                0 => -1,
                i => (rng.uniform() * (i + 1) as f64) as i32 - 1,
            })
            .collect();
        let q = rng.normal_f32(b * hq * n * d, 1.0);
        let (mut k, mut v) = (
            rng.normal_f32(b * hkv * cap * d, 1.0),
            rng.normal_f32(b * hkv * cap * d, 1.0),
        );
        for (seq, &len) in lens.iter().enumerate() {
            for h in 0..hkv {
                let row = (seq * hkv + h) * cap;
                k[(row + len) * d..(row + cap) * d].fill(f32::NAN);
                v[(row + len) * d..(row + cap) * d].fill(f32::NAN);
            }
        }
        let t = |x: &[f32], shape: &[usize]| Tensor::<R>::from_slice(x, shape, device).unwrap();
        let i32s = |x: &[i32], shape: &[usize]| Tensor::<R>::from_slice(x, shape, device).unwrap();
        let lengths = i32s(&lens.map(|l| l as i32), &[b]);
        let opts = AttentionOptions::default();
        let (qt, kt, vt) = (
            t(&q, &[b, hq, n, d]),
            t(&k, &[b, hkv, cap, d]),
            t(&v, &[b, hkv, cap, d]),
        );
        let tree = DraftTree::from_parents(&i32s(&parents, &[b, n]), &lengths, cap).unwrap();
        let cached = attention(&tree, &qt, Keys::cache(&kt, &vt, &lengths), &opts).unwrap();
        // The same keys in pages, page p of sequence s at table entry
        // [s][p], the pages shuffled.
        let per_seq = cap / page;
        let order: Vec<usize> = (0..b * per_seq).rev().collect();
        let (mut kp, mut vp) = (vec![0.0; k.len()], vec![0.0; v.len()]);
        let mut table = vec![0i32; b * per_seq];
        for (logical, &physical) in order.iter().enumerate() {
            let (seq, p) = (logical / per_seq, logical % per_seq);
            table[logical] = physical as i32;
            for h in 0..hkv {
                let from = ((seq * hkv + h) * cap + p * page) * d;
                let to = (physical * hkv + h) * page * d;
                kp[to..to + page * d].copy_from_slice(&k[from..from + page * d]);
                vp[to..to + page * d].copy_from_slice(&v[from..from + page * d]);
            }
        }
        let pages = [b * per_seq, hkv, page, d];
        let paged = attention(
            &tree,
            &qt,
            Keys::paged(
                &t(&kp, &pages),
                &t(&vp, &pages),
                &i32s(&table, &[b, per_seq]),
                &lengths,
            ),
            &opts,
        )
        .unwrap();
        let (cached, paged) = (cached.out.to_vec::<f32>(), paged.out.to_vec::<f32>());
        for seq in 0..b {
            let first = lens[seq] - n;
            for i in 0..n {
                // The prefix, then the ancestors of draft i, i included.
                let mut keys: Vec<usize> = (0..first).collect();
                let mut a = i as i32;
                let mut path = Vec::new();
                while a >= 0 {
                    path.push(first + a as usize);
                    a = parents[seq * n + a as usize];
                }
                keys.extend(path.into_iter().rev());
                let m = keys.len();
                let gather = |x: &[f32]| -> Vec<f32> {
                    (0..hkv)
                        .flat_map(|h| keys.iter().map(move |&j| ((seq * hkv + h) * cap + j) * d))
                        .flat_map(|at| x[at..at + d].to_vec())
                        .collect()
                };
                let qi: Vec<f32> = (0..hq)
                    .flat_map(|h| q[((seq * hq + h) * n + i) * d..][..d].to_vec())
                    .collect();
                let want = attention(
                    &Full,
                    &t(&qi, &[1, hq, 1, d]),
                    Keys::dense(
                        &t(&gather(&k), &[1, hkv, m, d]),
                        &t(&gather(&v), &[1, hkv, m, d]),
                    ),
                    &opts,
                )
                .unwrap()
                .out
                .to_vec::<f32>();
                for h in 0..hq {
                    let at = ((seq * hq + h) * n + i) * d;
                    for (source, got) in [("cache", &cached), ("pages", &paged)] {
                        for c in 0..d {
                            let (g, w) = (got[at + c], want[h * d + c]);
                            assert!(
                                (g - w).abs() <= 2e-5 * (1.0 + w.abs()),
                                "{source}: sequence {seq} head {h} draft {i}: {g} against {w} ({context})"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn drafts_see_the_prefix_and_their_ancestors_on_the_cpu() {
        drafts_see_the_prefix_and_their_ancestors_on::<numr::runtime::cpu::CpuRuntime>(
            &numr::runtime::cpu::CpuDevice::new(),
        );
    }

    /// Draft `j` is an ancestor-or-self of `i` exactly when its interval
    /// holds `i`'s preorder number.
    #[test]
    fn intervals_hold_exactly_the_ancestors() {
        //        prefix
        //       /   |   \
        //      0    1    5
        //     / \   |
        //    2   3  4
        //    |
        //    6
        let parents = [-1, -1, 0, 0, 1, -1, 2];
        let (pre, end) = intervals(&parents, 0).unwrap();
        let ancestor = |j: usize, mut i: usize| loop {
            if i == j {
                return true;
            }
            match parents[i] {
                -1 => return false,
                p => i = p as usize,
            }
        };
        for i in 0..parents.len() {
            for j in 0..parents.len() {
                assert_eq!(
                    pre[j] <= pre[i] && pre[i] < end[j],
                    ancestor(j, i),
                    "{j} of {i}"
                );
            }
        }
        let masks: Vec<i64> = (0..parents.len())
            .map(|i| {
                (0..parents.len())
                    .filter(|&j| ancestor(j, i))
                    .map(|j| 1i64 << j)
                    .sum()
            })
            .collect();
        assert_eq!(parents_of_masks(&masks, 0).unwrap(), parents);
    }

    #[test]
    fn bad_trees_are_errors_naming_the_value() {
        let e = intervals(&[-1, 2, 0], 3).unwrap_err().to_string();
        assert!(e.contains("parents[3][1] = 2"), "{e}");
        let e = intervals(&[-2], 0).unwrap_err().to_string();
        assert!(e.contains("parents[0][0] = -2"), "{e}");
        for (masks, rule) in [
            (vec![0b1, 0b00], "its own bit"),
            (vec![0b11, 0b10], "no bit above its own"),
            (vec![0b1, 0b10, 0b101, 0b1110], "its parent's"),
        ] {
            let e = parents_of_masks(&masks, 1).unwrap_err().to_string();
            assert!(e.contains(rule) && e.contains("masks[1]"), "{e}");
        }
    }
}
