//! Context parallelism: attention over a sequence sharded across ranks,
//! the keys and values passed around a ring over a numr [`Communicator`].
//!
//! Every rank calls the same op on its shard of `q`, `k` and `v` (`[B, H,
//! S / world, D]`, laid out as [`Shards`] says) and gets its shard of
//! `out` and `lse`: the rows of the single-device result that it holds.
//!
//! - **Positions stay global.** Each kernel call is a window of the whole
//!   sequence: its variant sees global query and key positions, reads its
//!   captured tensors (over the whole sequence, on every rank) at global
//!   positions, and a (query chunk, key chunk) pair that the variant's
//!   tile classifier finds empty for every batch and head is skipped (a
//!   causal ring skips about half its pairs). Every variant runs
//!   unchanged.
//! - **Merging.** Partial results merge as the variant's weights merge
//!   partial rows (by their `lse` for a softmax; sigmoid weights add), in
//!   f32, in the ring's order (fixed for a rank, so results are the same
//!   bits run to run). A sink joins each row's softmax once: in the call of
//!   the row's own chunk against itself. Dropout draws each call's pairs at
//!   their positions in the whole sequence: the same pairs as one device.
//! - **Backward.** dQ stays local. The dK/dV of each block travel the ring
//!   behind it in f32, each rank adding its part, and return to the owner
//!   after `world` hops. Learnable tensors' gradients are summed over the
//!   ranks in rank order (all-gathered, then added), so every rank holds
//!   the same bits.
//! - **Overlap.** Each step's exchange runs on a helper thread while the
//!   rank computes on the block it has ([`Schedule::Ring`]).
//! - **Failure.** The ranks agree on a header first (shapes, dtype,
//!   scale, layout, schedule, variant and its parameters): a disagreement
//!   is the same `Err` on every rank. A rank whose kernel fails keeps
//!   passing blocks so that nobody waits for it, and every rank returns an
//!   `Err` after the ring; a peer that stops answering is an `Err` after
//!   [`RingOptions::timeout`].
//!
//! Backends: the CPU (`AttentionRuntime::GLOBAL_POSITIONS`). The GPU kernels
//! place positions from the start of each call; on them the op is an
//! [`Error::LayoutUnsupported`] before any communication.

mod host;
mod link;
mod positioned;
mod shards;

#[cfg(test)]
mod tests;

pub use link::RingTimes;
pub use shards::Shards;

/// Where the time of the calling thread's last ring call
/// ([`ring_attention`] or its backward) went: its communications' time on
/// their helper threads, and how much of it the rank waited for. The rest
/// was hidden behind compute.
pub fn last_ring_times() -> RingTimes {
    link::times()
}

use crate::backend::{AttentionGrads, AttentionRuntime, BackwardTensors, KeyLayout, Keys};
use crate::cpu::weights::RowWeights as _;
use crate::error::{Error, Result};
use crate::op::AttentionOptions;
use crate::problem::Problem;
use crate::validate;
use crate::variant::{HostVariant, TileClass, Variant, Weights};
use link::{Exchange, Link};
use numr::autograd::{GradFn, TensorId, Var};
use numr::dtype::DType;
use numr::ops::{BinaryOps, ShapeOps, TypeConversionOps, UnaryOps, UtilityOps};
use numr::runtime::{Communicator, Runtime};
use numr::tensor::Tensor;
use positioned::Positioned;
use shards::Chunk;
use std::sync::Arc;
use std::time::Duration;

/// How the blocks of keys and values reach every rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// [`AllGather`](Schedule::AllGather) where the gathered keys and
    /// values take no more memory than the rank's own `q` and `out`
    /// (`world · (K + V) ≤ Q + O`, e.g. GQA with few kv heads), else
    /// [`Ring`](Schedule::Ring).
    #[default]
    Auto,
    /// `world − 1` steps, each sending the block in hand to the next rank
    /// while computing on it: memory for two blocks, traffic overlapped
    /// with compute. Needs point-to-point `send`/`recv` (numr's nexar and
    /// NCCL communicators; not numr's `LocalCommunicator`).
    Ring,
    /// One all-gather of every rank's K and V, then compute: memory for
    /// the whole sequence's keys and values, no overlap, collectives only
    /// (the backward sums dK/dV at their owners with one reduce-scatter
    /// each, in the communicator's order).
    AllGather,
}

impl Schedule {
    fn code(self) -> u64 {
        match self {
            Schedule::Auto => 0,
            Schedule::Ring => 1,
            Schedule::AllGather => 2,
        }
    }
}

/// Options of a ring attention call; every rank passes the same.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RingOptions {
    /// The attention's own options (scale).
    pub attention: AttentionOptions,
    /// How the sequence is sharded.
    pub shards: Shards,
    /// How keys and values reach the ranks.
    pub schedule: Schedule,
    /// How long a rank waits for any one communication before it gives up
    /// with [`Error::RingTimeout`].
    pub timeout: Duration,
}

impl Default for RingOptions {
    fn default() -> Self {
        RingOptions {
            attention: AttentionOptions::default(),
            shards: Shards::default(),
            schedule: Schedule::default(),
            timeout: Duration::from_secs(60),
        }
    }
}

/// The numr ops the ring's merges need, on every runtime's client.
pub trait RingOps<R: Runtime>:
    BinaryOps<R> + UnaryOps<R> + ShapeOps<R> + TypeConversionOps<R> + UtilityOps<R>
{
}

impl<R: Runtime, C> RingOps<R> for C where
    C: BinaryOps<R> + UnaryOps<R> + ShapeOps<R> + TypeConversionOps<R> + UtilityOps<R>
{
}

/// Which pass a header describes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
}

/// One rank's view of a ring call: its problem, the whole sequence's, the
/// chunks every rank holds, and its end of the ring.
struct Ring<'v, V: Variant> {
    variant: &'v V,
    /// The rank's own call: `Sq = Sk = n`, its shard.
    local: Problem,
    /// The whole sequence: `Sq = Sk = world · n`.
    whole: Problem,
    link: Link,
    schedule: Schedule,
    /// Per rank, the chunks of its shard.
    chunks: Vec<Vec<Chunk>>,
    /// The variant on the host, for skipping empty pairs.
    host: V::Host,
}

impl<'v, V: Variant> Ring<'v, V> {
    /// Validate this rank's inputs and agree on the call with the others.
    fn start<R: AttentionRuntime>(
        variant: &'v V,
        [q, k, v]: [&Tensor<R>; 3],
        comm: &Arc<dyn Communicator>,
        opts: &RingOptions,
        pass: Pass,
        wanted: &[bool],
    ) -> Result<Self> {
        if !R::GLOBAL_POSITIONS {
            return Err(Error::LayoutUnsupported {
                backend: R::name(),
                layout: "ring attention (its kernels place positions from the start of each call)",
            });
        }
        let (rank, world) = (comm.rank(), comm.world_size());
        if world == 0 || rank >= world {
            return Err(Error::Ring {
                rule: "a communicator has a rank below its world size",
                got: format!("rank {rank} of {world}"),
            });
        }
        link::reset_times();
        let link = Link {
            comm: Arc::clone(comm),
            rank,
            world,
            timeout: opts.timeout,
        };
        // The header first: a rank whose own inputs are bad still joins
        // it (with zeros), so that every rank fails together.
        let local = validate::problem(q, k, v, opts.attention.scale)
            .and_then(|p| validate::call(variant, p, &opts.attention));
        let local_ok = local.as_ref().ok();
        let header = header(variant, local_ok, q.dtype(), opts, pass, wanted);
        let agreed = link.agree::<R>(&header, q.device());
        let local = local?;
        agreed?;
        if local.seq_q != local.seq_k {
            return Err(Error::Ring {
                rule: "each rank holds the same positions of q, k and v (Sq = Sk per shard)",
                got: format!("Sq = {}, Sk = {}", local.seq_q, local.seq_k),
            });
        }
        let n = local.seq_q;
        opts.shards.check(n)?;
        let s = world.checked_mul(n).filter(|&s| s <= validate::MAX_INDEX);
        let s = s.ok_or_else(|| Error::TooLarge {
            name: "the whole sequence (world · shard)",
            value: world.saturating_mul(n),
            max: validate::MAX_INDEX,
        })?;
        let whole = Problem {
            seq_q: s,
            seq_k: s,
            ..local
        };
        let host = variant.host_copy(&whole)?;
        let chunks = (0..world)
            .map(|r| opts.shards.chunks(r, world, n))
            .collect();
        let schedule = match opts.schedule {
            Schedule::Auto => {
                let kv = local.k_len() + local.v_len();
                if world * kv <= local.q_len() + local.out_len() {
                    Schedule::AllGather
                } else {
                    Schedule::Ring
                }
            }
            s => s,
        };
        Ok(Ring {
            variant,
            local,
            whole,
            link,
            schedule,
            chunks,
            host,
        })
    }

    /// The call of query chunk `qc` against key chunk `kc`.
    fn call(&self, qc: Chunk, kc: Chunk, sink: bool) -> (Positioned<V>, Problem) {
        let p = Problem {
            seq_q: qc.len,
            seq_k: kc.len,
            ..self.local
        };
        let positioned = Positioned::new(
            self.variant.clone(),
            self.whole,
            &p,
            (qc.start, kc.start),
            sink,
        );
        (positioned, p)
    }

    /// Whether some pair of query chunk `qc` and key chunk `kc` may be
    /// visible, for some batch and head.
    fn visible(&self, qc: Chunk, kc: Chunk) -> bool {
        if !<V::Host as HostVariant>::HAS_MASK {
            return true;
        }
        let at = |x: usize| i32::try_from(x).expect("positions fit i32 (validated)");
        let (q_lo, q_hi) = (at(qc.start), at(qc.start + qc.len - 1));
        let (kv_lo, kv_hi) = (at(kc.start), at(kc.start + kc.len - 1));
        (0..self.local.batch).any(|b| {
            (0..self.local.heads_q).any(|h| {
                self.host
                    .classify_tile(at(b), at(h), q_lo, q_hi, kv_lo, kv_hi)
                    != TileClass::Empty
            })
        })
    }

    /// The (query chunk, key chunk) pairs of block `src` that this rank
    /// computes, with whether each carries the sink (the rank's own chunk
    /// against itself, always computed when the variant has a sink).
    fn pairs(&self, src: usize) -> Vec<Pair> {
        let own = src == self.link.rank;
        let mut pairs = Vec::new();
        for (i, &qc) in self.chunks[self.link.rank].iter().enumerate() {
            for (j, &kc) in self.chunks[src].iter().enumerate() {
                let sink = own && i == j && <V::Host as HostVariant>::WEIGHTS.sink;
                if sink || self.visible(qc, kc) {
                    pairs.push(Pair { i, j, qc, kc, sink });
                }
            }
        }
        pairs
    }

    /// Tag of slot `slot` of step `step`'s exchange.
    fn tag(pass: Pass, step: usize, slot: usize) -> u32 {
        let base = if pass == Pass::Forward { 0 } else { 1 << 20 };
        base + (step as u32) * 8 + slot as u32
    }
}

/// One kernel call of a step: query chunk `i` of this rank against key
/// chunk `j` of the block.
#[derive(Clone, Copy)]
struct Pair {
    i: usize,
    j: usize,
    qc: Chunk,
    kc: Chunk,
    /// The call adds the sink to its rows.
    sink: bool,
}

/// The words the ranks agree on before a ring call, each named for the
/// error that reports a disagreement.
fn header<V: Variant>(
    variant: &V,
    p: Option<&Problem>,
    dtype: DType,
    opts: &RingOptions,
    pass: Pass,
    wanted: &[bool],
) -> Vec<(&'static str, u64)> {
    let size = |f: fn(&Problem) -> usize| p.map_or(0, |p| f(p) as u64);
    let mut params = Fnv::new();
    params.add(V::NAME.as_bytes());
    params.add(&variant.param_words().to_le_bytes());
    for c in variant.captures() {
        params.add(c.decl.name.as_bytes());
    }
    let wanted_bits = wanted
        .iter()
        .enumerate()
        .fold(0u64, |w, (i, &b)| w | (u64::from(b) << (i % 64)));
    vec![
        ("the pass", u64::from(pass == Pass::Backward)),
        ("whether their own inputs are valid", u64::from(p.is_some())),
        ("the variant and its parameters", params.0),
        ("the layout of the shards", opts.shards.code()),
        ("the schedule", opts.schedule.code()),
        ("the batch size", size(|p| p.batch)),
        ("the query heads", size(|p| p.heads_q)),
        ("the kv heads", size(|p| p.heads_kv)),
        ("the shard length", size(|p| p.seq_q)),
        ("the key shard length", size(|p| p.seq_k)),
        ("the head dim", size(|p| p.head_dim)),
        ("the value head dim", size(|p| p.head_dim_v)),
        (
            "the scale (f32 bits)",
            p.map_or(0, |p| u64::from(p.scale.to_bits())),
        ),
        ("the dtype", dtype_code(dtype)),
        ("the dropout seed", opts.attention.dropout_seed),
        (
            "the dropout offset",
            u64::from(opts.attention.dropout_offset),
        ),
        ("the learnable gradients wanted", wanted_bits),
    ]
}

fn dtype_code(dtype: DType) -> u64 {
    let mut h = Fnv::new();
    h.add(format!("{dtype:?}").as_bytes());
    h.0
}

/// FNV-1a, 64 bits: the same digest on every rank and platform.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn add(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// One query chunk's running result: `out` (in f32 once merged) and `lse`.
struct Partial<R: Runtime> {
    out: Tensor<R>,
    lse: Tensor<R>,
}

/// Merge the partial `(out, lse)` of more keys into `acc` (in f32), as
/// `weights` merges partial rows: a softmax over both key sets (rows no key
/// of either set sees stay `out = 0`, `lse = −inf`), or the sum of sigmoid
/// weights' outputs.
fn merge<R: Runtime<DType = DType>>(
    weights: Weights,
    acc: Option<Partial<R>>,
    out: &Tensor<R>,
    lse: &Tensor<R>,
) -> Result<Partial<R>>
where
    R::Client: RingOps<R>,
{
    let Some(acc) = acc else {
        // The first part stands as it is (and is the result if alone).
        return Ok(Partial {
            out: out.clone(),
            lse: lse.contiguous()?,
        });
    };
    if let Some((out, lse)) = host::merge(weights, (&acc.out, &acc.lse), out, lse) {
        return Ok(Partial { out, lse });
    }
    let out = out.to_dtype(DType::F32)?;
    if !weights.merges_by_lse() {
        return Ok(Partial {
            out: acc.out.to_dtype(DType::F32)?.add(&out)?,
            lse: acc.lse,
        });
    }
    // m = max(l1, l2), −inf raised to the least f32 so that exp(l − m)
    // is 0 (not NaN) where both are −inf.
    let m = acc
        .lse
        .maximum(lse)?
        .clamp(f64::from(f32::MIN), f64::INFINITY)?;
    let w1 = acc.lse.sub(&m)?.exp()?;
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
    let merged = acc
        .out
        .to_dtype(DType::F32)?
        .mul(&a1)?
        .add(&out.mul(&a2)?)?;
    Ok(Partial {
        out: merged,
        lse: merged_lse,
    })
}

/// Attention over a sequence sharded across the ranks of `comm`: called
/// on every rank with its shard of `q [B, Hq, n, D]`, `k [B, Hkv, n, D]`
/// and `v [B, Hkv, n, Dv]` (`n = S / world`, laid out as `opts.shards`
/// says), it returns the rank's shard of `out [B, Hq, n, Dv]` and `lse
/// [B, Hq, n]`, the rows of the single-device [`attention_fwd`](crate::attention_fwd)
/// of the whole sequence that the rank holds.
///
/// Captured tensors span the whole sequence (`[B, S]` for a `[B, Sk]`
/// declaration) on every rank.
///
/// # Errors
/// On every rank alike: ranks that disagree on shapes, dtype, scale,
/// layout, schedule or the variant ([`Error::RingDisagree`]); a rank's
/// invalid inputs; a kernel that failed on some rank
/// ([`Error::RingPeerFailed`] on the others). A peer that stops answering
/// is [`Error::RingTimeout`] after `opts.timeout`.
pub fn ring_attention<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
    comm: &Arc<dyn Communicator>,
    opts: &RingOptions,
) -> Result<(Tensor<R>, Tensor<R>)>
where
    R::Client: RingOps<R>,
{
    let ring = Ring::start(variant, [q, k, v], comm, opts, Pass::Forward, &[])?;
    forward(&ring, q, k, v)
}

/// numr's NCCL communicator is a ring transport, and the op type-checks on
/// CUDA tensors (where it returns [`Error::LayoutUnsupported`] until the
/// CUDA kernels take global positions).
#[cfg(feature = "nccl")]
#[allow(dead_code)]
fn nccl_rings_type_check(
    comm: numr::runtime::NcclCommunicator,
    x: [&Tensor<numr::runtime::cuda::CudaRuntime>; 3],
) -> Result<()> {
    let comm: Arc<dyn Communicator> = Arc::new(comm);
    let variant = crate::stock::Causal;
    let opts = RingOptions::default();
    let (out, lse) = ring_attention(&variant, x[0], x[1], x[2], &comm, &opts)?;
    ring_attention_bwd(&variant, &out, x[0], x[1], x[2], &out, &lse, &comm, &opts)?;
    Ok(())
}

/// The blocks of keys and values as they reach a rank.
enum Blocks<R: Runtime> {
    /// The block in hand; the next arrives during the step.
    Ring((Tensor<R>, Tensor<R>)),
    /// Every rank's K and V, `[world, B, Hkv, n, ..]`.
    Gathered(Tensor<R>, Tensor<R>),
}

impl<R: Runtime<DType = DType>> Blocks<R>
where
    R::Client: RingOps<R>,
{
    fn new<V: Variant>(ring: &Ring<'_, V>, k: &Tensor<R>, v: &Tensor<R>) -> Result<Self> {
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
    fn block(&self, src: usize) -> Result<(Tensor<R>, Tensor<R>)> {
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
    fn to_send(&self) -> Vec<Tensor<R>> {
        match self {
            Blocks::Ring((k, v)) => vec![k.clone(), v.clone()],
            Blocks::Gathered(..) => Vec::new(),
        }
    }

    /// What a step receives (shapes and dtypes), as [`to_send`](Self::to_send).
    fn to_receive(&self) -> Vec<(Vec<usize>, DType)> {
        self.to_send()
            .iter()
            .map(|t| (t.shape().to_vec(), t.dtype()))
            .collect()
    }
}

/// The forward of one rank.
fn forward<V: Variant, R: AttentionRuntime>(
    ring: &Ring<'_, V>,
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
) -> Result<(Tensor<R>, Tensor<R>)>
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
    for (c, partial) in own.iter().zip(acc) {
        match partial {
            Some(Partial { out, lse }) => {
                outs.push(out.to_dtype(dtype)?);
                lses.push(lse);
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
            }
        }
    }
    let cat = |ts: &[Tensor<R>], dim: isize| -> Result<Tensor<R>> {
        let refs: Vec<&Tensor<R>> = ts.iter().collect();
        Ok(Tensor::cat(&refs, dim)?.contiguous()?)
    };
    Ok((cat(&outs, 2)?, cat(&lses, 2)?))
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
        let ks = k.narrow(2, kc.row, kc.len)?;
        let vs = v.narrow(2, kc.row, kc.len)?;
        let keys = Keys {
            k: &ks,
            v: &vs,
            layout: KeyLayout::Dense,
            scales: None,
        };
        let (out, lse) = R::attention_forward(&positioned, &p, &qs, keys)?;
        let weights = <V::Host as HostVariant>::WEIGHTS;
        acc[i] = Some(merge(weights, acc[i].take(), &out, &lse)?);
    }
    Ok(())
}

/// The backward of [`ring_attention`] on every rank: `(dq, dk, dv)` of
/// the rank's shards, given its shards of `out` and `lse` (from
/// [`ring_attention`]) and of `dout`.
///
/// # Errors
/// As [`ring_attention`].
#[allow(clippy::too_many_arguments)]
pub fn ring_attention_bwd<V: Variant, R: AttentionRuntime>(
    variant: &V,
    dout: &Tensor<R>,
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
    out: &Tensor<R>,
    lse: &Tensor<R>,
    comm: &Arc<dyn Communicator>,
    opts: &RingOptions,
) -> Result<AttentionGrads<R>>
where
    R::Client: RingOps<R>,
{
    let all = vec![true; V::LEARNABLE.len()];
    backward_with(variant, [dout, q, k, v, out, lse], comm, opts, &all)
}

fn backward_with<V: Variant, R: AttentionRuntime>(
    variant: &V,
    [dout, q, k, v, out, lse]: [&Tensor<R>; 6],
    comm: &Arc<dyn Communicator>,
    opts: &RingOptions,
    wanted: &[bool],
) -> Result<AttentionGrads<R>>
where
    R::Client: RingOps<R>,
{
    let ring = Ring::start(variant, [q, k, v], comm, opts, Pass::Backward, wanted)?;
    let p = &ring.local;
    validate::shape_of("out", out, &p.out_shape())?;
    validate::shape_of("dout", dout, &p.out_shape())?;
    validate::shape_of("lse", lse, &p.lse_shape())?;
    backward(&ring, [dout, q, k, v, out, lse], wanted)
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

/// The backward of one rank.
fn backward<V: Variant, R: AttentionRuntime>(
    ring: &Ring<'_, V>,
    [dout, q, k, v, out, lse]: [&Tensor<R>; 6],
    wanted: &[bool],
) -> Result<AttentionGrads<R>>
where
    R::Client: RingOps<R>,
{
    let (link, world) = (&ring.link, ring.link.world);
    let device = q.device();
    let p = ring.local;
    let own = &ring.chunks[link.rank];
    let mut dq: Vec<Option<Tensor<R>>> = own.iter().map(|_| None).collect();
    let mut tensor_grads: Vec<Option<Tensor<R>>> = wanted.iter().map(|_| None).collect();
    let mut blocks = Blocks::new(ring, k, v)?;
    let zeros = |shape: [usize; 4]| Tensor::<R>::zeros(&shape, DType::F32, device);
    let dkv_shapes = vec![
        (p.k_shape().to_vec(), DType::F32),
        (p.v_shape().to_vec(), DType::F32),
    ];
    let gathered = matches!(blocks, Blocks::Gathered(..));
    // Ring: the dK/dV of the block this rank worked on last step, on its
    // way around the ring. Gathered: this rank's part of every block's,
    // by block.
    let mut travelling: Option<[Tensor<R>; 2]> = None;
    let mut parts: Vec<[Tensor<R>; 2]> = Vec::new();
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
            x.recv.extend(dkv_shapes.iter().cloned());
        }
        let pending = if x.send.is_empty() {
            None
        } else {
            Some(link.exchange(x, device, Ring::<V>::tag(Pass::Backward, step, 0))?)
        };
        let mut part = None;
        if failure.is_none() {
            let (kb, vb) = blocks.block(src)?;
            let inputs = [dout, q, &kb, &vb, out, lse];
            match backward_block(ring, inputs, src, wanted, &mut dq, &mut tensor_grads) {
                Ok(block) => part = Some(block),
                Err(e) => failure = Some(e),
            }
        }
        // After a failure, zeros keep the ring's traffic going.
        let part = match part {
            Some(part) => part,
            None => [zeros(p.k_shape())?, zeros(p.v_shape())?],
        };
        if gathered {
            parts.push(part);
            continue;
        }
        let mut got = match pending {
            Some(pending) => pending.wait(link)?.into_iter(),
            None => Vec::new().into_iter(),
        };
        if receives_blocks > 0 {
            let (k, v) = (got.next(), got.next());
            if let (Some(k), Some(v)) = (k, v) {
                blocks = Blocks::Ring((k, v));
            }
        }
        // What the previous ranks added to this block's dK/dV, then ours.
        let [dk_part, dv_part] = part;
        let mut dkv = [got.next(), got.next()];
        if dkv.iter().all(Option::is_some) {
            add_into(&mut dkv[0], &dk_part)?;
            add_into(&mut dkv[1], &dv_part)?;
        } else {
            dkv = [Some(dk_part), Some(dv_part)];
        }
        let [Some(dk), Some(dv)] = dkv else {
            unreachable!("both sums were made above");
        };
        travelling = Some([dk, dv]);
    }
    let [dk, dv] = if gathered {
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
        [
            link.reduce_scatter(stack(0)?, "the reduce-scatter of dK")?,
            link.reduce_scatter(stack(1)?, "the reduce-scatter of dV")?,
        ]
    } else {
        match travelling {
            // The last hop: the block's dK/dV, complete, back to its owner.
            Some(t) if world > 1 => {
                let x = Exchange {
                    send: t.to_vec(),
                    recv: dkv_shapes.clone(),
                };
                let tag = Ring::<V>::tag(Pass::Backward, world, 0);
                let mut got = link.exchange(x, device, tag)?.wait(link)?.into_iter();
                match (got.next(), got.next()) {
                    (Some(dk), Some(dv)) => [dk, dv],
                    _ => unreachable!("an exchange returns what it was asked to receive"),
                }
            }
            Some(t) => t,
            None => [zeros(p.k_shape())?, zeros(p.v_shape())?],
        }
    };
    link.settle::<R>(failure, device)?;
    let dtype = q.dtype();
    let dq = own
        .iter()
        .zip(dq)
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
    // Learnable gradients: every rank's sum, added in rank order.
    let learnables = ring.variant.learnables();
    let mut tensors = Vec::with_capacity(tensor_grads.len());
    for (slot, g) in tensor_grads.into_iter().enumerate() {
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
        let all = link.gather(
            &g.to_dtype(DType::F32)?,
            "the all-gather of tensor gradients",
        )?;
        let mut sum: Option<Tensor<R>> = None;
        for r in 0..world {
            let part = all.narrow(0, r, 1)?.reshape(g.shape())?;
            add_into(&mut sum, &part)?;
        }
        tensors.push(sum);
    }
    Ok(AttentionGrads {
        dq,
        dk: dk.to_dtype(dtype)?,
        dv: dv.to_dtype(dtype)?,
        tensors,
    })
}

/// This rank's part of the gradients of rank `src`'s block: dQ and the
/// tensor gradients added into `dq` and `tensor_grads`, dK and dV
/// returned (f32, block-shaped).
fn backward_block<V: Variant, R: AttentionRuntime>(
    ring: &Ring<'_, V>,
    [dout, q, k, v, out, lse]: [&Tensor<R>; 6],
    src: usize,
    wanted: &[bool],
    dq: &mut [Option<Tensor<R>>],
    tensor_grads: &mut [Option<Tensor<R>>],
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
        let (ks, vs) = (keys(k)?, keys(v)?);
        let tensors = BackwardTensors {
            q: &qs,
            keys: Keys {
                k: &ks,
                v: &vs,
                layout: KeyLayout::Dense,
                scales: None,
            },
            out: &outs,
            lse: &lses.contiguous()?,
            dout: &douts,
            tensor_grads: wanted,
        };
        let g = R::attention_backward(&positioned, &p, tensors)?;
        add_into(&mut dq[i], &g.dq)?;
        add_into(&mut dk[j], &g.dk)?;
        add_into(&mut dv[j], &g.dv)?;
        for (slot, t) in g.tensors.into_iter().enumerate() {
            if let Some(t) = t {
                add_into(&mut tensor_grads[slot], &t)?;
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
                None => Ok(Tensor::<R>::zeros(
                    &[p.batch, p.heads_kv, c.len, dim],
                    DType::F32,
                    device,
                )?),
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor<R>> = parts.iter().collect();
        Ok(Tensor::cat(&refs, 2)?.contiguous()?)
    };
    Ok([block(dk, p.head_dim)?, block(dv, p.head_dim_v)?])
}

/// [`ring_attention`] as an autograd op: the forward runs now on every
/// rank, and numr's `backward` runs [`ring_attention_bwd`] on every rank
/// (each rank must call `backward` for the ring to complete). The node's
/// inputs are `q, k, v` and the variant's learnable tensors that require
/// grad, whose gradients are summed over the ranks.
pub fn var_ring_attention<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Var<R>,
    k: &Var<R>,
    v: &Var<R>,
    comm: &Arc<dyn Communicator>,
    opts: &RingOptions,
) -> Result<Var<R>>
where
    R::Client: RingOps<R>,
{
    let learnables = variant
        .learnables()
        .iter()
        .map(|l| l.on::<R>())
        .collect::<Result<Vec<&Var<R>>>>()?;
    let (out, lse) = ring_attention(variant, q.tensor(), k.tensor(), v.tensor(), comm, opts)?;
    let tensor_grads: Vec<bool> = learnables.iter().map(|t| t.requires_grad()).collect();
    let any_tensor = tensor_grads.iter().any(|&w| w);
    if !(q.requires_grad() || k.requires_grad() || v.requires_grad() || any_tensor) {
        return Ok(Var::new(out, false));
    }
    let inputs: Vec<&Var<R>> = [q, k, v]
        .into_iter()
        .chain(learnables.iter().copied().filter(|t| t.requires_grad()))
        .collect();
    let grad_fn = RingBackward {
        variant: variant.clone(),
        comm: Arc::clone(comm),
        opts: *opts,
        input_ids: inputs.iter().map(|x| x.graph_id()).collect(),
        input_grad_fns: inputs.iter().map(|x| x.grad_fn().cloned()).collect(),
        tensor_grads,
        saved: [
            q.tensor().clone(),
            k.tensor().clone(),
            v.tensor().clone(),
            out.clone(),
            lse,
        ],
    };
    Ok(Var::from_op(out, Arc::new(grad_fn)))
}

/// The backward node of [`var_ring_attention`].
struct RingBackward<V: Variant, R: AttentionRuntime> {
    variant: V,
    comm: Arc<dyn Communicator>,
    opts: RingOptions,
    input_ids: Vec<TensorId>,
    input_grad_fns: Vec<Option<Arc<dyn GradFn<R>>>>,
    tensor_grads: Vec<bool>,
    /// `[q, k, v, out, lse]`.
    saved: [Tensor<R>; 5],
}

impl<V: Variant, R: AttentionRuntime> GradFn<R> for RingBackward<V, R>
where
    R::Client: RingOps<R>,
{
    fn backward(
        &self,
        grad_output: &Tensor<R>,
        _needed: &[bool],
    ) -> numr::error::Result<Vec<Option<Tensor<R>>>> {
        let [q, k, v, out, lse] = &self.saved;
        // Every rank computes every gradient whatever it needs: the ring's
        // traffic must be the same on all of them.
        let inputs = [grad_output, q, k, v, out, lse];
        let g = backward_with(
            &self.variant,
            inputs,
            &self.comm,
            &self.opts,
            &self.tensor_grads,
        )?;
        let mut grads = vec![Some(g.dq), Some(g.dk), Some(g.dv)];
        for (slot, t) in g.tensors.into_iter().enumerate() {
            if self.tensor_grads[slot] {
                grads.push(t);
            }
        }
        Ok(grads)
    }

    fn inputs(&self) -> &[TensorId] {
        &self.input_ids
    }

    fn input_grad_fns(&self) -> Vec<Option<Arc<dyn GradFn<R>>>> {
        self.input_grad_fns.clone()
    }

    fn saved_tensors(&self) -> &[Tensor<R>] {
        &self.saved
    }

    fn name(&self) -> &'static str {
        "RingAttentionBackward"
    }
}
