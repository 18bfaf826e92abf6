//! A batch of mixed decodes and prefill chunks over pages
//! ([`Keys::paged_packed`]) run as one call of each kind: every
//! sequence's last row as a paged decode (the kernels that read a few rows
//! against many keys best), and the rows of the sequences with more than
//! one as padded prefill rows (the tile kernels), the decodes' sequences
//! holding no rows there. Each sequence keeps its batch index and its
//! positions in both, so the variant sees what it sees in one call; the
//! results are put back in the packed rows' order.

use crate::backend::AttentionRuntime;
use crate::error::Result;
use crate::keys::Keys;
use crate::keys::KvScales;
use crate::op::{Output, attention};
use crate::options::AttentionOptions;
use crate::variant::{HostVariant, Variant};
use numr::dtype::DType;
use numr::tensor::Tensor;

/// The forward of a mixed batch as two calls, or `None` where one call is
/// the way (no decodes, no longer sequences, a backward to come, inputs
/// the one call will refuse with the error they deserve).
pub(crate) fn forward<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Tensor<R>,
    keys: Keys<'_, R>,
    opts: &AttentionOptions,
) -> Result<Option<Output<R>>> {
    let Keys::Paged {
        k_pages,
        v_pages,
        page_table,
        lengths,
        cu_seqlens_q: Some(cu),
        scales,
    } = keys
    else {
        return Ok(None);
    };
    if q.ndim() != 3 || cu.dtype() != DType::I32 || cu.ndim() != 1 || page_table.ndim() != 2 {
        return Ok(None);
    }
    let offsets = cu.contiguous()?.to_vec::<i32>();
    let n = page_table.shape()[0];
    let valid = offsets.len() == n + 1
        && offsets.first() == Some(&0)
        && offsets.windows(2).all(|w| w[0] <= w[1])
        && offsets.last().is_some_and(|&t| t as usize == q.shape()[0]);
    if !valid {
        return Ok(None);
    }
    let rows: Vec<usize> = offsets.windows(2).map(|w| (w[1] - w[0]) as usize).collect();
    let decodes = rows.iter().filter(|&&r| r == 1).count();
    let longer = rows.iter().filter(|&&r| r > 1).count();
    if decodes == 0 {
        return Ok(None);
    }
    let device = q.device();
    let i32s = |x: &[i32]| Tensor::<R>::from_slice(x, &[x.len()], device);
    let pages = Pages {
        k: k_pages,
        v: v_pages,
        table: page_table,
        lengths,
        scales,
    };
    let seqs = Seqs { offsets, rows };
    if <V::Host as HostVariant>::BATCH_FREE && variant.dropout() == 0.0 {
        // Each kind as a batch of its own sequences.
        let dec: Vec<usize> = (0..n).filter(|&b| seqs.rows[b] == 1).collect();
        let long: Vec<usize> = (0..n).filter(|&b| seqs.rows[b] > 1).collect();
        let first_rows: Vec<i32> = dec.iter().map(|&b| seqs.offsets[b]).collect();
        let q_dec = q.index_select(0, &i32s(&first_rows)?)?.unsqueeze(2)?;
        let decoded = attention(variant, &q_dec, pages.of(&dec, None)?.keys(), opts)?;
        let prefilled = match long[..] {
            [] => None,
            [b] => {
                // One chunk: a plain paged call over its rows.
                let (at, r) = (seqs.offsets[b] as usize, seqs.rows[b]);
                let q_b = q.narrow(0, at, r)?.permute(&[1, 0, 2])?.unsqueeze(0)?;
                let y = attention(variant, &q_b, pages.of(&[b], None)?.keys(), opts)?;
                let rows = |t: Tensor<R>| -> Result<Tensor<R>> {
                    Ok(t.squeeze(Some(0)).permute(&[1, 0, 2])?)
                };
                Some(Output {
                    out: rows(y.out)?,
                    lse: y.lse.squeeze(Some(0)),
                    max_scores: y.max_scores.map(|m| m.squeeze(Some(0))),
                })
            }
            _ => {
                let kept = seqs.rows_of(&long);
                let q_long = q.index_select(0, &i32s(&kept)?)?;
                let cu = i32s(&seqs.offsets_of(&long))?;
                Some(attention(
                    variant,
                    &q_long,
                    pages.of(&long, Some(&cu))?.keys(),
                    opts,
                )?)
            }
        };
        return combine(
            decoded,
            prefilled,
            &seqs.order(|b| dec.binary_search(&b).ok()),
            device,
        )
        .map(Some);
    }
    // The batch as it is in both calls (the variant keys by `b`): every
    // sequence's last row (an empty one's: row 0, unused) as a decode,
    // the longer sequences' rows as padded prefill rows, the others
    // holding none there.
    let last: Vec<i32> = (0..n)
        .map(|b| (seqs.offsets[b + 1] - 1).max(0).min(seqs.offsets[n] - 1))
        .collect();
    let q_last = q.index_select(0, &i32s(&last)?)?.unsqueeze(2)?;
    let decoded = attention(variant, &q_last, pages.keys(), opts)?;
    let long: Vec<usize> = (0..n).filter(|&b| seqs.rows[b] > 1).collect();
    let cu_long: Vec<i32> = std::iter::once(0)
        .chain((0..n).scan(0, |s, b| {
            *s += if seqs.rows[b] > 1 {
                seqs.rows[b] as i32
            } else {
                0
            };
            Some(*s)
        }))
        .collect();
    let cu_long = i32s(&cu_long)?;
    let prefilled = if longer == 0 {
        None
    } else {
        let q_long = q.index_select(0, &i32s(&seqs.rows_of(&long))?)?;
        Some(attention(
            variant,
            &q_long,
            pages.with_rows(&cu_long).keys(),
            opts,
        )?)
    };
    let decoded = Output {
        out: decoded.out.squeeze(Some(2)),
        lse: decoded.lse,
        max_scores: decoded.max_scores,
    };
    combine(decoded, prefilled, &seqs.order(Some), device).map(Some)
}

/// The pages of a mixed call.
struct Pages<'a, R: AttentionRuntime> {
    k: &'a Tensor<R>,
    v: &'a Tensor<R>,
    table: &'a Tensor<R>,
    lengths: &'a Tensor<R>,
    scales: Option<KvScales<'a, R>>,
}

/// The pages of some of the sequences (their table rows and lengths).
struct Subset<'a, R: AttentionRuntime> {
    pages: &'a Pages<'a, R>,
    table: Tensor<R>,
    lengths: Tensor<R>,
    cu: Option<&'a Tensor<R>>,
}

impl<'a, R: AttentionRuntime> Pages<'a, R> {
    /// The keys of every sequence.
    fn keys(&self) -> Keys<'_, R> {
        with_scales(
            Keys::paged(self.k, self.v, self.table, self.lengths),
            self.scales,
        )
    }

    /// Every sequence's pages, read by packed rows `cu`.
    fn with_rows(&'a self, cu: &'a Tensor<R>) -> Subset<'a, R> {
        Subset {
            pages: self,
            table: self.table.clone(),
            lengths: self.lengths.clone(),
            cu: Some(cu),
        }
    }

    /// Sequences `seqs`' pages, read by packed rows `cu` if given.
    fn of(&'a self, seqs: &[usize], cu: Option<&'a Tensor<R>>) -> Result<Subset<'a, R>> {
        let index: Vec<i32> = seqs.iter().map(|&b| b as i32).collect();
        let index = Tensor::<R>::from_slice(&index, &[index.len()], self.table.device())?;
        Ok(Subset {
            pages: self,
            table: self.table.index_select(0, &index)?,
            lengths: self.lengths.index_select(0, &index)?,
            cu,
        })
    }
}

impl<R: AttentionRuntime> Subset<'_, R> {
    fn keys(&self) -> Keys<'_, R> {
        let p = self.pages;
        let keys = match self.cu {
            Some(cu) => Keys::paged_packed(p.k, p.v, &self.table, &self.lengths, cu),
            None => Keys::paged(p.k, p.v, &self.table, &self.lengths),
        };
        with_scales(keys, p.scales)
    }
}

/// The packed rows of a mixed call.
struct Seqs {
    offsets: Vec<i32>,
    rows: Vec<usize>,
}

impl Seqs {
    /// The packed rows of sequences `seqs`, in order.
    fn rows_of(&self, seqs: &[usize]) -> Vec<i32> {
        seqs.iter()
            .flat_map(|&b| self.offsets[b]..self.offsets[b + 1])
            .collect()
    }

    /// The `cu_seqlens` of sequences `seqs` packed alone.
    fn offsets_of(&self, seqs: &[usize]) -> Vec<i32> {
        std::iter::once(0)
            .chain(seqs.iter().scan(0, |s, &b| {
                *s += self.rows[b] as i32;
                Some(*s)
            }))
            .collect()
    }

    /// Where each packed row's result is in the decode results (row
    /// `decode(b)` of them, for a one-row sequence) followed by the
    /// prefill results (in order).
    fn order(&self, decode: impl Fn(usize) -> Option<usize>) -> Vec<i32> {
        let decodes = (0..self.rows.len())
            .filter(|&b| decode(b).is_some())
            .count();
        let mut next = decodes;
        let mut from = Vec::new();
        for (b, &r) in self.rows.iter().enumerate() {
            match decode(b) {
                Some(at) if r == 1 => from.push(at as i32),
                _ => {
                    for _ in 0..r {
                        if r > 1 {
                            from.push(next as i32);
                            next += 1;
                        }
                    }
                }
            }
        }
        from
    }
}

/// The decodes' results (`[m, Hq, 1, Dv]` or `[m, Hq, Dv]`, lse `[m, Hq,
/// 1]`) and the prefill's (packed), put in the packed rows' order `from`.
fn combine<R: AttentionRuntime>(
    decoded: Output<R>,
    prefilled: Option<Output<R>>,
    from: &[i32],
    device: &R::Device,
) -> Result<Output<R>> {
    // Rows already in order (the decodes packed first) are not moved.
    let identity = from.iter().enumerate().all(|(i, &f)| f as usize == i);
    let from = Tensor::<R>::from_slice(from, &[from.len()], device)?;
    let put = |t: Tensor<R>, dim: usize| -> Result<Tensor<R>> {
        Ok(if identity {
            t
        } else {
            t.index_select(dim, &from)?
        })
    };
    let rows = |t: &Tensor<R>| -> Tensor<R> {
        if t.ndim() == 4 {
            t.squeeze(Some(2))
        } else {
            t.clone()
        }
    };
    let lse_of = |t: &Tensor<R>| -> Result<Tensor<R>> { Ok(t.squeeze(Some(2)).transpose(0, 1)?) };
    let (out, lse, max_scores) = match &prefilled {
        Some(p) => (
            Tensor::cat(&[&rows(&decoded.out), &p.out], 0)?,
            Tensor::cat(&[&lse_of(&decoded.lse)?, &p.lse], 1)?,
            match (&decoded.max_scores, &p.max_scores) {
                (Some(d), Some(p)) => Some(Tensor::cat(&[&lse_of(d)?, p], 1)?),
                _ => None,
            },
        ),
        None => (
            rows(&decoded.out),
            lse_of(&decoded.lse)?,
            decoded.max_scores.as_ref().map(lse_of).transpose()?,
        ),
    };
    let (out, lse) = (put(out, 0)?, put(lse, 1)?);
    let max_scores = max_scores.map(|m| put(m, 1)).transpose()?;
    Ok(Output {
        out: out.contiguous()?,
        lse: lse.contiguous()?,
        max_scores: max_scores.map(|m| m.contiguous()).transpose()?,
    })
}

/// `keys` with an fp8 cache's `scales`, if any.
fn with_scales<'a, R: AttentionRuntime>(
    keys: Keys<'a, R>,
    scales: Option<KvScales<'a, R>>,
) -> Keys<'a, R> {
    match scales {
        Some(s) => keys.with_scales(s),
        None => keys,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::stock::{Causal, CausalDocuments};
    use crate::testing::{Rng, SEED_ENV, choose_seed};

    /// A mixed batch (decodes, an empty sequence, chunks of several rows)
    /// over shuffled pages equals each sequence run alone over its own
    /// pages, for a variant that reads neither the batch nor a tensor
    /// (each kind as a batch of its own) and for one that does (the batch
    /// kept whole in both calls), and for batches of one kind.
    pub(crate) fn mixed_batches_equal_each_sequence_alone_on<R: AttentionRuntime>(
        device: &R::Device,
    ) {
        let seed = choose_seed();
        let context = format!("seed {seed} (rerun with {SEED_ENV}={seed})");
        let mut rng = Rng::new(seed, 0);
        let (hq, hkv, d, page, max_pages) = (4, 2, 16, 8, 5);
        let cap = page * max_pages;
        for (rows, lens) in [
            (vec![1, 0, 9, 1, 4], vec![20, 7, 33, 1, 16]),
            (vec![6, 1], vec![40, 25]),
            (vec![3, 5], vec![3, 39]),
            (vec![1, 0, 1], vec![12, 0, 40]),
        ] {
            let n = rows.len();
            let total: usize = rows.iter().sum();
            let pages = n * max_pages;
            let t = |x: &[f32], shape: &[usize]| Tensor::<R>::from_slice(x, shape, device).unwrap();
            let i32s =
                |x: &[i32], shape: &[usize]| Tensor::<R>::from_slice(x, shape, device).unwrap();
            let k = t(
                &rng.normal_f32(pages * hkv * page * d, 1.0),
                &[pages, hkv, page, d],
            );
            let v = t(
                &rng.normal_f32(pages * hkv * page * d, 1.0),
                &[pages, hkv, page, d],
            );
            let table: Vec<i32> = (0..pages).map(|e| ((e * 7 + 3) % pages) as i32).collect();
            let q_host = rng.normal_f32(total * hq * d, 1.0);
            let q = t(&q_host, &[total, hq, d]);
            let cu: Vec<i32> = std::iter::once(0)
                .chain(rows.iter().scan(0, |s, &r| {
                    *s += r as i32;
                    Some(*s)
                }))
                .collect();
            let lens_i: Vec<i32> = lens.clone();
            let (table_t, lengths, cu_t) = (
                i32s(&table, &[n, max_pages]),
                i32s(&lens_i, &[n]),
                i32s(&cu, &[n + 1]),
            );
            // Documents of another length in each sequence: a batch index out of
            // place reads another sequence's ids.
            let docs: Vec<i32> = (0..n * cap)
                .map(|i| ((i % cap) / (5 + 3 * (i / cap))) as i32)
                .collect();
            let opts = AttentionOptions::default().with_max_scores();
            let keys = Keys::paged_packed(&k, &v, &table_t, &lengths, &cu_t);
            let whole_docs = CausalDocuments {
                doc: i32s(&docs, &[n, cap]),
            };
            let results = [
                ("Causal", attention(&Causal, &q, keys, &opts).unwrap()),
                (
                    "CausalDocuments",
                    attention(&whole_docs, &q, keys, &opts).unwrap(),
                ),
            ];
            for (name, got) in results {
                let (out, lse, max) = (
                    got.out.to_vec::<f32>(),
                    got.lse.to_vec::<f32>(),
                    got.max_scores.expect("asked for").to_vec::<f32>(),
                );
                assert_eq!(out.len(), total * hq * d);
                for b in 0..n {
                    let r = rows[b];
                    if r == 0 {
                        continue;
                    }
                    let at = cu[b] as usize;
                    let q_b: Vec<f32> = (0..hq)
                        .flat_map(|h| {
                            (0..r).flat_map(move |i| {
                                ((at + i) * hq + h) * d..((at + i) * hq + h + 1) * d
                            })
                        })
                        .map(|e| q_host[e])
                        .collect();
                    let q_b = t(&q_b, &[1, hq, r, d]);
                    let (tb, lb) = (
                        i32s(&table[b * max_pages..(b + 1) * max_pages], &[1, max_pages]),
                        i32s(&lens_i[b..b + 1], &[1]),
                    );
                    let alone = Keys::paged(&k, &v, &tb, &lb);
                    let want = if name == "Causal" {
                        attention(&Causal, &q_b, alone, &opts).unwrap()
                    } else {
                        let own = CausalDocuments {
                            doc: i32s(&docs[b * cap..(b + 1) * cap], &[1, cap]),
                        };
                        attention(&own, &q_b, alone, &opts).unwrap()
                    };
                    let (w_out, w_lse, w_max) = (
                        want.out.to_vec::<f32>(),
                        want.lse.to_vec::<f32>(),
                        want.max_scores.expect("asked for").to_vec::<f32>(),
                    );
                    for h in 0..hq {
                        for i in 0..r {
                            let row = at + i;
                            let what = format!(
                                "{name}, rows {rows:?}: sequence {b} head {h} row {i} ({context})"
                            );
                            let close =
                                |a: f32, b: f32| a == b || (a - b).abs() <= 2e-5 * (1.0 + b.abs());
                            assert!(close(lse[h * total + row], w_lse[h * r + i]), "lse: {what}");
                            assert!(close(max[h * total + row], w_max[h * r + i]), "max: {what}");
                            for c in 0..d {
                                let (g, w) =
                                    (out[(row * hq + h) * d + c], w_out[(h * r + i) * d + c]);
                                assert!(close(g, w), "out {g} against {w}: {what}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn mixed_batches_equal_each_sequence_alone_on_the_cpu() {
        mixed_batches_equal_each_sequence_alone_on::<numr::runtime::cpu::CpuRuntime>(
            &numr::runtime::cpu::CpuDevice::new(),
        );
    }

    #[test]
    fn only_batch_free_variants_are_split_by_kind() {
        type Cpu = numr::runtime::cpu::CpuRuntime;
        const {
            assert!(<Causal as HostVariant>::BATCH_FREE);
            assert!(!<<CausalDocuments<Cpu> as Variant>::Host as HostVariant>::BATCH_FREE);
            assert!(!<<crate::stock::DraftTree<Cpu> as Variant>::Host as HostVariant>::BATCH_FREE);
        }
    }
}
