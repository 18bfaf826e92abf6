//! The backward of one rank: dQ stays local, each block's dK/dV travel the
//! ring behind it (or are reduce-scattered when the blocks were gathered),
//! and learnable tensors' gradients are summed over the ranks.

use super::forward::Blocks;
use super::link::Exchange;
use super::{Pair, Pass, Ring, RingOps, RingOptions, host};
use crate::backend::{AttentionGrads, AttentionRuntime, BackwardTensors, CallKeys, KeyLayout};
use crate::error::{Error, Result};
use crate::op::Backward;
use crate::validate;
use crate::variant::Variant;
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// The backward of every rank, with the learnable slots in `wanted`.
pub(super) fn backward_with<V: Variant, R: AttentionRuntime>(
    variant: &V,
    [q, k, v]: [&Tensor<R>; 3],
    grads: Backward<'_, R>,
    opts: &RingOptions,
    wanted: &[bool],
) -> Result<AttentionGrads<R>>
where
    R::Client: RingOps<R>,
{
    let Backward {
        out,
        lse,
        dout,
        dlse,
    } = grads;
    // `out`, `dout`, `lse` and `dlse` are this rank's inputs too: checked
    // before the header, so that a bad one fails every rank at once.
    let more = |p: &crate::problem::Problem| {
        validate::shape_of("out", out, &p.out_shape())?;
        validate::shape_of("dout", dout, &p.out_shape())?;
        validate::shape_of("lse", lse, &p.lse_shape())?;
        let like_q = [q.dtype()];
        validate::check_dtype("out", out, R::name(), &like_q, "q's dtype")?;
        validate::check_dtype("dout", dout, R::name(), &like_q, "q's dtype")?;
        validate::check_dtype("lse", lse, R::name(), &[DType::F32], "f32")?;
        if let Some(dlse) = dlse {
            validate::shape_of("dlse", dlse, &p.lse_shape())?;
            validate::check_dtype("dlse", dlse, R::name(), &[DType::F32], "f32")?;
        }
        Ok(())
    };
    let ring = Ring::start(variant, [q, k, v], opts, (Pass::Backward, wanted), more)?;
    backward(&ring, ([dout, q, k, v, out, lse], dlse), wanted)
}

/// Gradients summed in f32: `acc` becomes `acc + x` (in place on the CPU).
fn add_into<R: Runtime<DType = DType>>(acc: &mut Option<Tensor<R>>, x: &Tensor<R>) -> Result<()>
where
    R::Client: RingOps<R>,
{
    if host::add_into(acc, x) {
        return Ok(());
    }
    let x = x.to_dtype(DType::F32)?;
    *acc = Some(match acc.take() {
        Some(acc) => acc.to_dtype(DType::F32)?.add(&x)?,
        None => x,
    });
    Ok(())
}

/// What a rank sums locally over the steps: dQ by query chunk, and the
/// learnable tensors' gradients by slot.
struct Sums<R: Runtime> {
    dq: Vec<Option<Tensor<R>>>,
    tensors: Vec<Option<Tensor<R>>>,
}

/// A rank's share of the blocks' dK/dV after the last step.
enum KeyGrads<R: Runtime> {
    /// Ring: the sums of the block it worked on last, one hop from home.
    Travelling(Option<Box<[Tensor<R>; 2]>>),
    /// Gathered: its part of every block's, by step.
    Parts(Vec<[Tensor<R>; 2]>),
}

/// The backward of one rank.
fn backward<V: Variant, R: AttentionRuntime>(
    ring: &Ring<'_, V>,
    inputs: ([&Tensor<R>; 6], Option<&Tensor<R>>),
    wanted: &[bool],
) -> Result<AttentionGrads<R>>
where
    R::Client: RingOps<R>,
{
    let q = inputs.0[1];
    let (device, dtype) = (q.device(), q.dtype());
    let p = ring.local;
    let own = &ring.chunks[ring.link.rank];
    let mut sums = Sums {
        dq: own.iter().map(|_| None).collect(),
        tensors: wanted.iter().map(|_| None).collect(),
    };
    let (key_grads, failure) = steps(ring, inputs, wanted, &mut sums)?;
    let [dk, dv] = home(ring, key_grads, device)?;
    ring.link.settle::<R>(failure, device)?;
    let dq = own
        .iter()
        .zip(sums.dq)
        .map(|(c, g)| match g {
            Some(g) => Ok(g.to_dtype(dtype)?),
            None => Ok(Tensor::<R>::zeros(
                &[p.batch, p.heads_q, c.len, p.head_dim],
                dtype,
                device,
            )?),
        })
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&Tensor<R>> = dq.iter().collect();
    let dq = Tensor::cat(&refs, 2)?.contiguous()?;
    Ok(AttentionGrads {
        dq,
        dk: dk.to_dtype(dtype)?,
        dv: dv.to_dtype(dtype)?,
        tensors: over_ranks(ring, sums.tensors, wanted, device)?,
    })
}

/// The ring's steps: each block's gradients computed as it comes round,
/// its dK/dV sent on behind it. A rank whose kernel fails sends zeros
/// from then on and returns its error after the traffic.
fn steps<V: Variant, R: AttentionRuntime>(
    ring: &Ring<'_, V>,
    ([dout, q, k, v, out, lse], dlse): ([&Tensor<R>; 6], Option<&Tensor<R>>),
    wanted: &[bool],
    sums: &mut Sums<R>,
) -> Result<(KeyGrads<R>, Option<Error>)>
where
    R::Client: RingOps<R>,
{
    let (link, world) = (&ring.link, ring.link.world);
    let device = q.device();
    let p = ring.local;
    let zeros = |shape: [usize; 4]| Tensor::<R>::zeros(&shape, DType::F32, device);
    let mut blocks = Blocks::new(ring, k, v)?;
    let gathered = matches!(blocks, Blocks::Gathered(..));
    let mut travelling: Option<[Tensor<R>; 2]> = None;
    let mut parts = Vec::new();
    let mut failure = None;
    for step in 0..world {
        let src = (link.rank + world - step) % world;
        let mut x = Exchange {
            send: Vec::new(),
            recv: Vec::new(),
        };
        if !gathered && step + 1 < world {
            x.send = blocks.to_send();
            x.recv = blocks.to_receive();
        }
        let receives_blocks = x.send.len();
        if let Some(t) = travelling.take() {
            x.send.extend(t);
            x.recv.extend(key_grad_shapes(ring));
        }
        let pending = if x.send.is_empty() {
            None
        } else {
            Some(link.exchange(x, device, Ring::<V>::tag(Pass::Backward, step, 0))?)
        };
        let mut part = None;
        if failure.is_none() {
            let (kb, vb) = blocks.block(src)?;
            let inputs = ([dout, q, &kb, &vb, out, lse], dlse);
            match block(ring, inputs, src, wanted, sums) {
                Ok(block) => part = Some(block),
                Err(e) => failure = Some(e),
            }
        }
        // After a failure, zeros keep the ring's traffic going.
        let [dk_part, dv_part] = match part {
            Some(part) => part,
            None => [
                zeros(ring.kv_shape(p.head_dim))?,
                zeros(ring.kv_shape(p.head_dim_v))?,
            ],
        };
        if gathered {
            parts.push([dk_part, dv_part]);
            continue;
        }
        let mut got = match pending {
            Some(pending) => pending.wait(link)?.into_iter(),
            None => Vec::new().into_iter(),
        };
        if receives_blocks > 0
            && let (Some(k), Some(v)) = (got.next(), got.next())
        {
            blocks = Blocks::Ring((k, v));
        }
        // What the previous ranks added to this block's dK/dV, then ours.
        travelling = Some(match (got.next(), got.next()) {
            (Some(dk), Some(dv)) => {
                let mut dkv = [Some(dk), Some(dv)];
                add_into(&mut dkv[0], &dk_part)?;
                add_into(&mut dkv[1], &dv_part)?;
                dkv.map(|t| t.expect("add_into leaves a sum"))
            }
            _ => [dk_part, dv_part],
        });
    }
    let key_grads = if gathered {
        KeyGrads::Parts(parts)
    } else {
        KeyGrads::Travelling(travelling.map(Box::new))
    };
    Ok((key_grads, failure))
}

/// The shapes and dtypes of a block's dK and dV on their way round.
fn key_grad_shapes<V: Variant>(ring: &Ring<'_, V>) -> [(Vec<usize>, DType); 2] {
    let p = &ring.local;
    [
        (ring.kv_shape(p.head_dim).to_vec(), DType::F32),
        (ring.kv_shape(p.head_dim_v).to_vec(), DType::F32),
    ]
}

/// This rank's own block's dK and dV, complete: the last hop of the ring,
/// or the reduce-scatter of every rank's parts.
fn home<V: Variant, R: AttentionRuntime>(
    ring: &Ring<'_, V>,
    key_grads: KeyGrads<R>,
    device: &R::Device,
) -> Result<[Tensor<R>; 2]>
where
    R::Client: RingOps<R>,
{
    let (link, world) = (&ring.link, ring.link.world);
    match key_grads {
        KeyGrads::Parts(parts) => {
            // Every block's parts in rank order, summed at their owners.
            let mut by_block: Vec<Option<[Tensor<R>; 2]>> = (0..world).map(|_| None).collect();
            for (step, part) in parts.into_iter().enumerate() {
                by_block[(link.rank + world - step) % world] = Some(part);
            }
            let stack = |i: usize| -> Result<Tensor<R>> {
                let each = by_block
                    .iter()
                    .map(|b| Ok(b.as_ref().expect("one part per block")[i].unsqueeze(0)?))
                    .collect::<Result<Vec<_>>>()?;
                let refs: Vec<&Tensor<R>> = each.iter().collect();
                Ok(Tensor::cat(&refs, 0)?)
            };
            Ok([
                link.reduce_scatter(stack(0)?, "the reduce-scatter of dK")?,
                link.reduce_scatter(stack(1)?, "the reduce-scatter of dV")?,
            ])
        }
        // The last hop: the block's dK/dV, complete, back to its owner.
        KeyGrads::Travelling(Some(t)) if world > 1 => {
            let x = Exchange {
                send: t.to_vec(),
                recv: key_grad_shapes(ring).to_vec(),
            };
            let tag = Ring::<V>::tag(Pass::Backward, world, 0);
            let mut got = link.exchange(x, device, tag)?.wait(link)?.into_iter();
            match (got.next(), got.next()) {
                (Some(dk), Some(dv)) => Ok([dk, dv]),
                _ => unreachable!("an exchange returns what it was asked to receive"),
            }
        }
        KeyGrads::Travelling(Some(t)) => Ok(*t),
        KeyGrads::Travelling(None) => {
            let p = ring.local;
            let zeros = |shape: [usize; 4]| Tensor::<R>::zeros(&shape, DType::F32, device);
            Ok([
                zeros(ring.kv_shape(p.head_dim))?,
                zeros(ring.kv_shape(p.head_dim_v))?,
            ])
        }
    }
}

/// The learnable tensors' gradients: every rank's sum, added in rank
/// order, so that every rank holds the same bits.
fn over_ranks<V: Variant, R: AttentionRuntime>(
    ring: &Ring<'_, V>,
    local: Vec<Option<Tensor<R>>>,
    wanted: &[bool],
    device: &R::Device,
) -> Result<Vec<Option<Tensor<R>>>>
where
    R::Client: RingOps<R>,
{
    let learnables = ring.variant.learnables();
    let mut tensors = Vec::with_capacity(local.len());
    for (slot, g) in local.into_iter().enumerate() {
        if !wanted.get(slot).copied().unwrap_or(false) {
            tensors.push(None);
            continue;
        }
        let g = match g {
            Some(g) => g,
            None => {
                let shape = learnables[slot].on::<R>()?.shape().to_vec();
                Tensor::<R>::zeros(&shape, DType::F32, device)?
            }
        };
        let all = ring.link.gather(
            &g.to_dtype(DType::F32)?,
            "the all-gather of tensor gradients",
        )?;
        let mut sum: Option<Tensor<R>> = None;
        for r in 0..ring.link.world {
            let part = all.narrow(0, r, 1)?.reshape(g.shape())?;
            add_into(&mut sum, &part)?;
        }
        tensors.push(sum);
    }
    Ok(tensors)
}

/// This rank's part of the gradients of rank `src`'s block: dQ and the
/// tensor gradients added into `sums`, dK and dV returned (f32,
/// block-shaped).
fn block<V: Variant, R: AttentionRuntime>(
    ring: &Ring<'_, V>,
    ([dout, q, k, v, out, lse], dlse): ([&Tensor<R>; 6], Option<&Tensor<R>>),
    src: usize,
    wanted: &[bool],
    sums: &mut Sums<R>,
) -> Result<[Tensor<R>; 2]>
where
    R::Client: RingOps<R>,
{
    let chunks = &ring.chunks[src];
    let mut dk: Vec<Option<Tensor<R>>> = chunks.iter().map(|_| None).collect();
    let mut dv: Vec<Option<Tensor<R>>> = chunks.iter().map(|_| None).collect();
    for Pair { i, j, qc, kc, sink } in ring.pairs(src) {
        let (positioned, p) = ring.call(qc, kc, sink);
        let rows = |t: &Tensor<R>| t.narrow(2, qc.row, qc.len);
        let keys = |t: &Tensor<R>| t.narrow(2, kc.row, kc.len);
        let (qs, outs, douts, lses) = (rows(q)?, rows(out)?, rows(dout)?, rows(lse)?);
        let dlses = match dlse {
            Some(g) => Some(rows(g)?.contiguous()?),
            None => None,
        };
        let (ks, vs) = (ring.kv_view(&keys(k)?)?, ring.kv_view(&keys(v)?)?);
        let tensors = BackwardTensors {
            q: &qs,
            keys: CallKeys {
                k: &ks,
                v: &vs,
                layout: KeyLayout::Dense,
                scales: None,
            },
            out: &outs,
            lse: &lses.contiguous()?,
            dout: &douts,
            dlse: dlses.as_ref(),
            tensor_grads: wanted,
        };
        let g = R::attention_backward(&positioned, &p, tensors)?;
        // Shared keys' gradients: the sum over the batch.
        let shared = |t: Tensor<R>| if ring.shared { R::sum_batch(&t) } else { Ok(t) };
        add_into(&mut sums.dq[i], &g.dq)?;
        add_into(&mut dk[j], &shared(g.dk)?)?;
        add_into(&mut dv[j], &shared(g.dv)?)?;
        for (slot, t) in g.tensors.into_iter().enumerate() {
            if let Some(t) = t {
                add_into(&mut sums.tensors[slot], &t)?;
            }
        }
    }
    let p = ring.local;
    let device = q.device();
    let block = |parts: Vec<Option<Tensor<R>>>, dim: usize| -> Result<Tensor<R>> {
        let parts = parts
            .into_iter()
            .zip(chunks)
            .map(|(g, c)| match g {
                Some(g) => Ok(g),
                None => {
                    let [batch, heads, _, _] = ring.kv_shape(dim);
                    Ok(Tensor::<R>::zeros(
                        &[batch, heads, c.len, dim],
                        DType::F32,
                        device,
                    )?)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor<R>> = parts.iter().collect();
        Ok(Tensor::cat(&refs, 2)?.contiguous()?)
    };
    Ok([block(dk, p.head_dim)?, block(dv, p.head_dim_v)?])
}
