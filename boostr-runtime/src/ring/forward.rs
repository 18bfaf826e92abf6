//! The forward of one rank: its queries against every block of keys as
//! the blocks come round, the partial rows merged as the variant's weights
//! merge them.

use super::link::Exchange;
use super::{Pair, Pass, Ring, RingOps, Schedule, host};
use crate::backend::{AttentionRuntime, CallKeys, KeyLayout};
use crate::cpu::weights::RowWeights as _;
use crate::error::Result;
use crate::variant::{HostVariant, Variant, Weights};
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// One query chunk's running result: `out` (in f32 once merged), `lse`
/// and, where the call returns it, each row's largest score.
struct Partial<R: Runtime> {
    out: Tensor<R>,
    lse: Tensor<R>,
    max: Option<Tensor<R>>,
}

/// Merge the partial result of more keys into `acc`: `out` and `lse` (in
/// f32) as `weights` merges partial rows (a softmax over both key sets,
/// where rows no key of either set sees stay `out = 0`, `lse = −inf`, or
/// the sum of sigmoid weights' outputs), and each row's largest score as
/// the larger of the two.
fn merge<R: Runtime<DType = DType>>(
    weights: Weights,
    acc: Option<Partial<R>>,
    part: crate::op::Output<R>,
) -> Result<Partial<R>>
where
    R::Client: RingOps<R>,
{
    let crate::op::Output {
        out,
        lse,
        max_scores,
    } = part;
    let Some(acc) = acc else {
        // The first part stands as it is (and is the result if alone).
        return Ok(Partial {
            out,
            lse: lse.contiguous()?,
            max: max_scores,
        });
    };
    let max = match (acc.max, max_scores) {
        (Some(a), Some(b)) => Some(a.maximum(&b)?),
        _ => None,
    };
    let (out, lse) = merge_rows(weights, (acc.out, acc.lse), &out, &lse)?;
    Ok(Partial { out, lse, max })
}

/// The softmax (or sigmoid) merge of two partial `(out, lse)` (also
/// [`merge_states`](crate::merge_states)').
pub(crate) fn merge_rows<R: Runtime<DType = DType>>(
    weights: Weights,
    (acc_out, acc_lse): (Tensor<R>, Tensor<R>),
    out: &Tensor<R>,
    lse: &Tensor<R>,
) -> Result<(Tensor<R>, Tensor<R>)>
where
    R::Client: RingOps<R>,
{
    if let Some(merged) = host::merge(weights, (&acc_out, &acc_lse), out, lse) {
        return Ok(merged);
    }
    let out = out.to_dtype(DType::F32)?;
    if !weights.merges_by_lse() {
        return Ok((acc_out.to_dtype(DType::F32)?.add(&out)?, acc_lse));
    }
    // m = max(l1, l2), −inf raised to the least f32 so that exp(l − m)
    // is 0 (not NaN) where both are −inf.
    let m = acc_lse
        .maximum(lse)?
        .clamp(f64::from(f32::MIN), f64::INFINITY)?;
    let w1 = acc_lse.sub(&m)?.exp()?;
    let w2 = lse.sub(&m)?.exp()?;
    let sum = w1.add(&w2)?;
    let merged_lse = m.add(&sum.log()?)?;
    // sum ≥ 1 wherever some key is seen (its larger weight is 1), and 0
    // where none is: dividing by max(sum, 1) leaves those rows at 0.
    let denom = sum.clamp(1.0, f64::INFINITY)?;
    let (a1, a2) = (
        w1.div(&denom)?.unsqueeze(-1)?,
        w2.div(&denom)?.unsqueeze(-1)?,
    );
    let merged = acc_out
        .to_dtype(DType::F32)?
        .mul(&a1)?
        .add(&out.mul(&a2)?)?;
    Ok((merged, merged_lse))
}

/// The blocks of keys and values as they reach a rank.
pub(super) enum Blocks<R: Runtime> {
    /// The block in hand; the next arrives during the step.
    Ring((Tensor<R>, Tensor<R>)),
    /// Every rank's K and V, `[world, B, Hkv, n, ..]`.
    Gathered(Tensor<R>, Tensor<R>),
}

impl<R: Runtime<DType = DType>> Blocks<R>
where
    R::Client: RingOps<R>,
{
    pub(super) fn new<V: Variant>(
        ring: &Ring<'_, V>,
        k: &Tensor<R>,
        v: &Tensor<R>,
    ) -> Result<Self> {
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        Ok(match ring.schedule {
            Schedule::AllGather => Blocks::Gathered(
                ring.link.gather(&k, "the all-gather of K")?,
                ring.link.gather(&v, "the all-gather of V")?,
            ),
            _ => Blocks::Ring((k, v)),
        })
    }

    /// Rank `src`'s block.
    pub(super) fn block(&self, src: usize) -> Result<(Tensor<R>, Tensor<R>)> {
        Ok(match self {
            Blocks::Ring((k, v)) => (k.clone(), v.clone()),
            Blocks::Gathered(k, v) => {
                let one = |t: &Tensor<R>| -> Result<Tensor<R>> {
                    Ok(t.narrow(0, src, 1)?.reshape(&t.shape()[1..])?)
                };
                (one(k)?, one(v)?)
            }
        })
    }

    /// What a step sends on to the next rank (nothing when gathered).
    pub(super) fn to_send(&self) -> Vec<Tensor<R>> {
        match self {
            Blocks::Ring((k, v)) => vec![k.clone(), v.clone()],
            Blocks::Gathered(..) => Vec::new(),
        }
    }

    /// What a step receives (shapes and dtypes), as [`to_send`](Self::to_send).
    pub(super) fn to_receive(&self) -> Vec<(Vec<usize>, DType)> {
        self.to_send()
            .iter()
            .map(|t| (t.shape().to_vec(), t.dtype()))
            .collect()
    }
}

/// The forward of one rank.
pub(super) fn forward<V: Variant, R: AttentionRuntime>(
    ring: &Ring<'_, V>,
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
) -> Result<crate::op::Output<R>>
where
    R::Client: RingOps<R>,
{
    let (link, world) = (&ring.link, ring.link.world);
    let device = q.device();
    let own = &ring.chunks[link.rank];
    let mut acc: Vec<Option<Partial<R>>> = own.iter().map(|_| None).collect();
    let mut blocks = Blocks::new(ring, k, v)?;
    let mut failure = None;
    for step in 0..world {
        let src = (link.rank + world - step) % world;
        let ring_step = matches!(blocks, Blocks::Ring(_)) && step + 1 < world;
        let pending = if ring_step {
            let x = Exchange {
                send: blocks.to_send(),
                recv: blocks.to_receive(),
            };
            Some(link.exchange(x, device, Ring::<V>::tag(Pass::Forward, step, 0))?)
        } else {
            None
        };
        if failure.is_none() {
            let (kb, vb) = blocks.block(src)?;
            if let Err(e) = forward_block(ring, q, (&kb, &vb), src, &mut acc) {
                failure = Some(e);
            }
        }
        if let Some(pending) = pending {
            let mut got = pending.wait(link)?.into_iter();
            if let (Some(k), Some(v)) = (got.next(), got.next()) {
                blocks = Blocks::Ring((k, v));
            }
        }
    }
    link.settle::<R>(failure, device)?;
    let p = &ring.local;
    let dtype = q.dtype();
    let mut outs = Vec::with_capacity(own.len());
    let mut lses = Vec::with_capacity(own.len());
    let mut maxes = Vec::with_capacity(own.len());
    for (c, partial) in own.iter().zip(acc) {
        match partial {
            Some(Partial { out, lse, max }) => {
                outs.push(out.to_dtype(dtype)?);
                lses.push(lse);
                maxes.extend(max);
            }
            None => {
                let shape = [p.batch, p.heads_q, c.len];
                outs.push(Tensor::<R>::zeros(
                    &[p.batch, p.heads_q, c.len, p.head_dim_v],
                    dtype,
                    device,
                )?);
                // A row that sees no key: `lse = -inf` (0 for sigmoid
                // weights, which have none).
                let empty = <V::Host as HostVariant>::WEIGHTS.lse(f32::NEG_INFINITY, 0.0);
                lses.push(Tensor::<R>::full_scalar(
                    &shape,
                    DType::F32,
                    f64::from(empty),
                    device,
                )?);
                if p.max_scores {
                    maxes.push(Tensor::<R>::full_scalar(
                        &shape,
                        DType::F32,
                        f64::NEG_INFINITY,
                        device,
                    )?);
                }
            }
        }
    }
    let cat = |ts: &[Tensor<R>], dim: isize| -> Result<Tensor<R>> {
        let refs: Vec<&Tensor<R>> = ts.iter().collect();
        Ok(Tensor::cat(&refs, dim)?.contiguous()?)
    };
    Ok(crate::op::Output {
        out: cat(&outs, 2)?,
        lse: cat(&lses, 2)?,
        max_scores: if p.max_scores {
            Some(cat(&maxes, 2)?)
        } else {
            None
        },
    })
}

/// This rank's queries against rank `src`'s block, merged into `acc`.
fn forward_block<V: Variant, R: AttentionRuntime>(
    ring: &Ring<'_, V>,
    q: &Tensor<R>,
    (k, v): (&Tensor<R>, &Tensor<R>),
    src: usize,
    acc: &mut [Option<Partial<R>>],
) -> Result<()>
where
    R::Client: RingOps<R>,
{
    for Pair {
        i, qc, kc, sink, ..
    } in ring.pairs(src)
    {
        let (positioned, p) = ring.call(qc, kc, sink);
        let qs = q.narrow(2, qc.row, qc.len)?;
        let ks = ring.kv_view(&k.narrow(2, kc.row, kc.len)?)?;
        let vs = ring.kv_view(&v.narrow(2, kc.row, kc.len)?)?;
        let keys = CallKeys {
            k: &ks,
            v: &vs,
            layout: KeyLayout::Dense,
            scales: None,
        };
        let part = R::attention_forward(&positioned, &p, &qs, keys)?;
        let weights = <V::Host as HostVariant>::WEIGHTS;
        acc[i] = Some(merge(weights, acc[i].take(), part)?);
    }
    Ok(())
}
