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
//! Backends: every one. The CPU's kernels see the window through the
//! variant's host functions; the GPU kernels take it in their parameter
//! block (the call's query and key shifts, and whether its rows carry the
//! sink: [`kernels_spec::params::WindowWord`]), so each call of the ring
//! is one launch of the variant's own kernels. The merges and gradient
//! sums run on the device (numr's ops; in place on the CPU). A
//! communicator that cannot read the runtime's memory (wgpu's always, a
//! host communicator's with CUDA tensors) gets every buffer staged through
//! host memory; NCCL reads CUDA tensors in place.

mod backward;
mod forward;
mod host;
mod link;
mod positioned;
mod shards;

#[cfg(test)]
pub(crate) mod tests;

pub use link::RingTimes;
pub use shards::Shards;

/// Where the time of the calling thread's last ring call
/// ([`ring_attention`] or its backward) went: its communications' time on
/// their helper threads, and how much of it the rank waited for. The rest
/// was hidden behind compute.
pub fn last_ring_times() -> RingTimes {
    link::times()
}

use crate::backend::{AttentionGrads, AttentionRuntime};
use crate::error::{Error, Result};
use crate::keys::{KeyTensor, Keys};
use crate::node;
use crate::op::{Backward, Output, VarOutput};
use crate::options::AttentionOptions;
use crate::problem::Problem;
use crate::validate;
use crate::variant::{HostVariant, TileClass, Variant};
pub(crate) use forward::merge_rows;
use link::Link;
use numr::autograd::Var;
use numr::dtype::DType;
use numr::ops::{BinaryOps, ShapeOps, TypeConversionOps, UnaryOps, UtilityOps};
use numr::runtime::{Communicator, Runtime};
use numr::tensor::Tensor;
pub(crate) use positioned::Positioned;
use shards::Chunk;
use std::sync::Arc;
use std::time::Duration;

/// How the blocks of keys and values reach every rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
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

/// A ring attention call's communicator and options; every rank passes
/// the same options. `RingOptions::new(comm)`, then the `with_` methods
/// for what differs.
#[derive(Clone)]
#[non_exhaustive]
pub struct RingOptions {
    /// The ranks' communicator (this rank's end of it).
    pub comm: Arc<dyn Communicator>,
    /// The attention's own options (scale, dropout).
    pub attention: AttentionOptions,
    /// How the sequence is sharded.
    pub shards: Shards,
    /// How keys and values reach the ranks.
    pub schedule: Schedule,
    /// How long a rank waits for any one communication before it gives up
    /// with [`Error::RingTimeout`].
    pub timeout: Duration,
}

impl std::fmt::Debug for RingOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingOptions")
            .field("rank", &self.comm.rank())
            .field("world", &self.comm.world_size())
            .field("attention", &self.attention)
            .field("shards", &self.shards)
            .field("schedule", &self.schedule)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl RingOptions {
    /// A ring over `comm`: default attention options, zigzag shards
    /// ([`Shards::default`]), the schedule chosen by the shapes, a minute's
    /// timeout.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        RingOptions {
            comm,
            attention: AttentionOptions::default(),
            shards: Shards::default(),
            schedule: Schedule::default(),
            timeout: Duration::from_secs(60),
        }
    }

    /// These options with the attention's own `options` (scale, dropout).
    pub fn with_attention(self, attention: AttentionOptions) -> Self {
        RingOptions { attention, ..self }
    }

    /// These options with the sequence sharded as `shards`.
    pub fn with_shards(self, shards: Shards) -> Self {
        RingOptions { shards, ..self }
    }

    /// These options with keys and values moved by `schedule`.
    pub fn with_schedule(self, schedule: Schedule) -> Self {
        RingOptions { schedule, ..self }
    }

    /// These options with each communication given up after `timeout`.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        RingOptions { timeout, ..self }
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
    /// `k` and `v` are of batch 1, shared by every sequence.
    shared: bool,
}

impl<'v, V: Variant> Ring<'v, V> {
    /// Validate this rank's inputs (`q, k, v`, then `more` of the pass's
    /// own against the rank's problem) and agree on the call with the
    /// others: a rank whose inputs are bad fails every rank at once.
    #[allow(clippy::too_many_arguments)]
    fn start<R: AttentionRuntime>(
        variant: &'v V,
        [q, k, v]: [&Tensor<R>; 3],
        opts: &RingOptions,
        (pass, wanted): (Pass, &[bool]),
        more: impl FnOnce(&Problem) -> Result<()>,
    ) -> Result<Self> {
        let comm = &opts.comm;
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
            direct: R::communicator_reads_tensors(&**comm),
        };
        // The header first: a rank whose own inputs are bad still joins
        // it (with zeros), so that every rank fails together. Keys of
        // batch 1 are shared by every sequence: they travel as they are,
        // and each call reads them broadcast.
        let shared = crate::keys::shares_keys(q, k, v);
        let local = crate::keys::widen_shared(q, k, v)
            .and_then(|(k, v)| validate::problem(q, &k, &v, opts.attention.scale))
            .and_then(|p| validate::call(variant, p, &opts.attention))
            .and_then(|p| more(&p).map(|()| p));
        let local_ok = local.as_ref().ok();
        let header = header(variant, local_ok, (q.dtype(), shared), opts, pass, wanted);
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
            shared,
        })
    }

    /// The shape of a block of `k` (`dim` = D) or `v` (`Dv`) and of its
    /// gradient: the rank's shard, of batch 1 where the keys are shared.
    fn kv_shape(&self, dim: usize) -> [usize; 4] {
        let p = &self.local;
        let batch = if self.shared { 1 } else { p.batch };
        [batch, p.heads_kv, p.seq_k, dim]
    }

    /// A chunk of a block of keys or values as a call reads it: broadcast
    /// to the batch where shared.
    fn kv_view<R: Runtime>(&self, t: &Tensor<R>) -> Result<Tensor<R>> {
        if !self.shared {
            return Ok(t.clone());
        }
        let s = t.shape();
        Ok(t.broadcast_to(&[self.local.batch, s[1], s[2], s[3]])?)
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
    (dtype, shared): (DType, bool),
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
        ("whether the keys are shared (batch 1)", u64::from(shared)),
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

/// Attention over a sequence sharded across the ranks of `ring.comm`:
/// called on every rank with its shard of `q [B, Hq, n, D]` and of the
/// dense keys `k [B, Hkv, n, D]`, `v [B, Hkv, n, Dv]` (`n = S / world`,
/// laid out as `ring.shards` says; `k` and `v` of batch 1 are shared by
/// every sequence), it returns the rank's shard of `out [B, Hq, n, Dv]`
/// and `lse [B, Hq, n]`: the rows of the single-device
/// [`attention`](crate::attention()) of the whole sequence that the rank
/// holds.
///
/// Captured tensors span the whole sequence (`[B, S]` for a `[B, Sk]`
/// declaration) on every rank.
///
/// # Errors
/// On every rank alike: keys other than dense ([`Error::Ring`]); ranks
/// that disagree on shapes, dtype, scale, layout, schedule or the variant
/// ([`Error::RingDisagree`]); a rank's invalid inputs; a kernel that
/// failed on some rank ([`Error::RingPeerFailed`] on the others). A peer
/// that stops answering is [`Error::RingTimeout`] after `ring.timeout`.
pub fn ring_attention<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Tensor<R>,
    keys: Keys<'_, R>,
    ring: &RingOptions,
) -> Result<Output<R>>
where
    R::Client: RingOps<R>,
{
    let (k, v) = dense(&keys)?;
    let call = Ring::start(variant, [q, k, v], ring, (Pass::Forward, &[]), |_| Ok(()))?;
    forward::forward(&call, q, k, v)
}

/// The dense keys of a ring call.
fn dense<'a, R: Runtime, T: KeyTensor<R>>(
    keys: &Keys<'a, R, T>,
) -> Result<(&'a Tensor<R>, &'a Tensor<R>)> {
    match *keys {
        Keys::Dense { k, v, scales: None } => Ok((k.tensor(), v.tensor())),
        _ => Err(Error::Ring {
            rule: "each rank holds a shard of dense keys (Keys::dense), in q's dtype",
            got: keys.name().to_string(),
        }),
    }
}

/// numr's NCCL communicator is a ring transport for CUDA tensors: the op,
/// its backward and the autograd op type-check on it.
#[cfg(feature = "nccl")]
#[allow(dead_code)]
fn nccl_rings_type_check(
    comm: numr::runtime::NcclCommunicator,
    x: [&Tensor<numr::runtime::cuda::CudaRuntime>; 3],
) -> Result<()> {
    let ring = RingOptions::new(Arc::new(comm));
    let variant = crate::stock::Causal;
    let y = ring_attention(&variant, x[0], Keys::dense(x[1], x[2]), &ring)?;
    let grads = Backward::new(&y, x[0]);
    ring_attention_backward(&variant, x[0], Keys::dense(x[1], x[2]), grads, &ring)?;
    let q = Var::new(x[0].clone(), true);
    var_ring_attention(&variant, &q, Keys::dense(&q, &q), &ring)?;
    Ok(())
}

/// The backward of [`ring_attention`] on every rank: the gradients of the
/// rank's shards of `q`, `k` and `v` (`k`'s and `v`'s of batch 1, summed
/// over the batch and the ranks, where shared) and of the variant's
/// learnable tensors that require grad (summed over the ranks), given its
/// shards of `out`, `lse` (from [`ring_attention`]), `dout` and, where the
/// loss reads the lse, `dlse`.
///
/// # Errors
/// As [`ring_attention`].
pub fn ring_attention_backward<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Tensor<R>,
    keys: Keys<'_, R>,
    grads: Backward<'_, R>,
    ring: &RingOptions,
) -> Result<AttentionGrads<R>>
where
    R::Client: RingOps<R>,
{
    let (k, v) = dense(&keys)?;
    let wanted = variant
        .learnables()
        .iter()
        .map(|l| Ok(l.on::<R>()?.requires_grad()))
        .collect::<Result<Vec<bool>>>()?;
    backward::backward_with(variant, [q, k, v], grads, ring, &wanted)
}

/// [`ring_attention`] as an autograd op: the forward runs now on every
/// rank, and numr's `backward` runs [`ring_attention_backward`] on every
/// rank (each rank must call `backward` for the ring to complete). The
/// node's inputs are `q`, the keys' and values' `Var`s and the variant's
/// learnable tensors that require grad, whose gradients are summed over
/// the ranks; `lse` is differentiable as [`var_attention`](crate::var_attention)'s.
pub fn var_ring_attention<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Var<R>,
    keys: Keys<'_, R, Var<R>>,
    ring: &RingOptions,
) -> Result<VarOutput<R>>
where
    R::Client: RingOps<R>,
{
    let (k, v) = keys.kv();
    let y = ring_attention(
        variant,
        q.tensor(),
        Keys::dense(k.tensor(), v.tensor()),
        ring,
    )?;
    dense(&keys)?;
    let tensor_grads = variant
        .learnables()
        .iter()
        .map(|l| Ok(l.on::<R>()?.requires_grad()))
        .collect::<Result<Vec<bool>>>()?;
    let (variant_, ring) = (variant.clone(), ring.clone());
    // Every rank computes every gradient whatever it needs: the ring's
    // traffic must be the same on all of them.
    let gradients = move |[q, k, v, out, lse]: &node::Saved<R>,
                          (dout, dlse): (&Tensor<R>, Option<&Tensor<R>>),
                          _: &[bool]| {
        let grads = Backward {
            out,
            lse,
            dout,
            dlse,
        };
        backward::backward_with(&variant_, [q, k, v], grads, &ring, &tensor_grads)
    };
    let (out, lse) = node::attach(
        variant,
        [q, k, v],
        (y.out, y.lse),
        ("RingAttentionBackward", gradients),
    )?;
    Ok(VarOutput {
        out,
        lse,
        max_scores: y.max_scores,
    })
}
