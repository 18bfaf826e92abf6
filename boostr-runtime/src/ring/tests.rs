//! Ring attention against single-device attention on the gathered
//! sequence: every world size from 1 to 4, both layouts, both schedules,
//! masks, captured and learnable tensors, sinks; the traffic counted; bad
//! input and failing ranks.

use super::*;
use crate::stock::{
    AlibiSlopes, Causal, CausalDocuments, CausalDropout, CausalSigmoid, CausalSlidingWindow,
    CausalSlidingWindowSinks, Full, RelativeBias,
};
use crate::testing::rng::{Rng, SEED_ENV, choose_seed};
use crate::testing::{MessageCount, ThreadComm};
use crate::{Output, attention, attention_backward};
use numr::runtime::LocalCommunicator;
use numr::runtime::cpu::{CpuDevice, CpuRuntime};

type T = Tensor<CpuRuntime>;

/// The sizes every case shares: GQA 2:1, D ≠ Dv, odd sizes.
const B: usize = 2;
const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 24;
const DV: usize = 16;
/// Rows per rank (even, for zigzag).
const N: usize = 10;

fn device() -> CpuDevice {
    CpuDevice::new()
}

/// Random `[B, H, S, dim]` f32 from `rng` on `device`.
fn normal<R: AttentionRuntime>(rng: &mut Rng, shape: [usize; 4], device: &R::Device) -> Tensor<R> {
    let n: usize = shape.iter().product();
    Tensor::<R>::from_slice(&rng.normal_f32(n, 1.0), &shape, device).expect("a tensor")
}

/// The whole sequence's inputs: `q, k, v`, and the gradients `dout` and
/// `dlse` of a loss of `out` and `lse`.
pub(crate) struct Inputs<R: Runtime> {
    q: Tensor<R>,
    k: Tensor<R>,
    v: Tensor<R>,
    dout: Tensor<R>,
    dlse: Tensor<R>,
}

impl<R: AttentionRuntime> Inputs<R>
where
    R::Client: RingOps<R>,
{
    fn new(rng: &mut Rng, s: usize, device: &R::Device) -> Self {
        Inputs {
            q: normal(rng, [B, HQ, s, D], device),
            k: normal(rng, [B, HKV, s, D], device),
            v: normal(rng, [B, HKV, s, DV], device),
            dout: normal(rng, [B, HQ, s, DV], device),
            dlse: {
                let n = B * HQ * s;
                Tensor::<R>::from_slice(&rng.normal_f32(n, 1.0), &[B, HQ, s], device)
                    .expect("a tensor")
            },
        }
    }

    /// Rank `rank`'s shards of `q, k, v, dout`.
    fn shard(&self, shards: Shards, rank: usize, world: usize) -> Result<[Tensor<R>; 4]> {
        let shard = |t: &Tensor<R>| shards.shard(t, 2, rank, world);
        Ok([
            shard(&self.q)?,
            shard(&self.k)?,
            shard(&self.v)?,
            shard(&self.dout)?,
        ])
    }

    /// Rank `rank`'s shard of `dlse`.
    fn shard_dlse(&self, shards: Shards, rank: usize, world: usize) -> Result<Tensor<R>> {
        shards.shard(&self.dlse, 2, rank, world)
    }
}

/// The options of a ring test, which each rank's [`RingOptions`] get with
/// its communicator ([`Setup::on`]).
#[derive(Clone, Copy, Debug)]
struct Setup {
    attention: AttentionOptions,
    shards: Shards,
    schedule: Schedule,
    timeout: Duration,
}

impl Setup {
    /// These options on `comm`.
    fn on(&self, comm: &Arc<dyn Communicator>) -> RingOptions {
        RingOptions::new(Arc::clone(comm))
            .with_attention(self.attention)
            .with_shards(self.shards)
            .with_schedule(self.schedule)
            .with_timeout(self.timeout)
    }

    fn with_timeout(self, timeout: Duration) -> Self {
        Setup { timeout, ..self }
    }
}

/// One rank's results.
struct RankOut<R: Runtime> {
    out: Tensor<R>,
    lse: Tensor<R>,
    /// The rows' largest scores, where the options ask for them.
    max_scores: Option<Tensor<R>>,
    grads: AttentionGrads<R>,
}

/// Run forward and backward on every rank of `comms`, each on its shard.
/// The loss reads `out` and `lse` (`dout` and `dlse`); keys of batch 1
/// are shared by every sequence.
fn run_ring<V: Variant, R: AttentionRuntime>(
    variant: &V,
    x: &Inputs<R>,
    comms: &[Arc<dyn Communicator>],
    opts: &Setup,
) -> Vec<Result<RankOut<R>>>
where
    R::Client: RingOps<R>,
{
    on_ranks(comms, |rank, comm| {
        let ring = opts.on(comm);
        let [q, k, v, dout] = x.shard(opts.shards, rank, comms.len())?;
        let dlse = x.shard_dlse(opts.shards, rank, comms.len())?;
        let y = ring_attention(variant, &q, Keys::dense(&k, &v), &ring)?;
        let grads = Backward::new(&y, &dout).with_dlse(&dlse);
        let grads = ring_attention_backward(variant, &q, Keys::dense(&k, &v), grads, &ring)?;
        Ok(RankOut {
            out: y.out,
            lse: y.lse,
            max_scores: y.max_scores,
            grads,
        })
    })
}

/// Rank `rank`'s ring forward over its shard of `x`, its result dropped.
fn forward_on<V: Variant, R: AttentionRuntime>(
    variant: &V,
    x: &Inputs<R>,
    (rank, comm): (usize, &Arc<dyn Communicator>),
    opts: &Setup,
) -> Result<()>
where
    R::Client: RingOps<R>,
{
    let [q, k, v, _] = x.shard(opts.shards, rank, comm.world_size())?;
    ring_attention(variant, &q, Keys::dense(&k, &v), &opts.on(comm)).map(drop)
}

/// `call` on every rank of `comms`, each on its own thread; the results
/// in rank order.
fn on_ranks<O: Send>(
    comms: &[Arc<dyn Communicator>],
    call: impl Fn(usize, &Arc<dyn Communicator>) -> O + Sync,
) -> Vec<O> {
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(rank, comm)| {
                let call = &call;
                s.spawn(move || call(rank, comm))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

/// Ring options with `shards` and `schedule`, the rest default.
fn options(shards: Shards, schedule: Schedule) -> Setup {
    Setup {
        attention: AttentionOptions::default(),
        shards,
        schedule,
        timeout: Duration::from_secs(60),
    }
}

/// A seed, its stream `stream`, and the inputs of a whole sequence of
/// `world` shards.
fn inputs(stream: u64, world: usize) -> (u64, Rng, Inputs<CpuRuntime>) {
    let seed = choose_seed();
    let mut rng = Rng::new(seed, stream);
    let x = Inputs::new(&mut rng, N * world, &device());
    (seed, rng, x)
}

/// Single-device attention on the whole sequence: its output and every
/// gradient of the loss that reads `out` and `lse`.
fn one_device<V: Variant, R: AttentionRuntime>(
    variant: &V,
    x: &Inputs<R>,
    opts: &AttentionOptions,
) -> (Output<R>, AttentionGrads<R>) {
    let keys = Keys::dense(&x.k, &x.v);
    let y = attention(variant, &x.q, keys, opts).expect("single device");
    let grads = Backward::new(&y, &x.dout).with_dlse(&x.dlse);
    let grads =
        attention_backward(variant, &x.q, keys, grads, opts).expect("single device backward");
    (y, grads)
}

/// A rank's rows' largest scores, asked for.
fn max_scores_of<R: Runtime>(r: &RankOut<R>) -> &Tensor<R> {
    r.max_scores.as_ref().expect("asked for")
}

/// The whole sequence's tensor of which rank `r` holds `part(r)`.
fn gathered<R: AttentionRuntime>(
    ranks: &[RankOut<R>],
    shards: Shards,
    part: impl Fn(&RankOut<R>) -> &Tensor<R>,
) -> Tensor<R>
where
    R::Client: RingOps<R>,
{
    let parts: Vec<Tensor<R>> = ranks.iter().map(|r| part(r).clone()).collect();
    shards.unshard(&parts, 2).expect("unshard")
}

fn thread_group(world: usize) -> (Vec<Arc<ThreadComm>>, Vec<Arc<dyn Communicator>>) {
    thread_group_waiting(world, Duration::from_secs(30))
}

/// [`thread_group`] whose waits give up after `timeout`.
fn thread_group_waiting(
    world: usize,
    timeout: Duration,
) -> (Vec<Arc<ThreadComm>>, Vec<Arc<dyn Communicator>>) {
    let group = ThreadComm::group(world, timeout);
    let dyns = group
        .iter()
        .map(|c| Arc::clone(c) as Arc<dyn Communicator>)
        .collect();
    (group, dyns)
}

fn values<R: AttentionRuntime>(t: &Tensor<R>) -> Vec<f32>
where
    R::Client: RingOps<R>,
{
    t.to_dtype(DType::F32).expect("f32").to_vec()
}

/// `got` equals `want` up to f32 rounding of a different summation order
/// (`−inf` where `want` is).
#[track_caller]
fn assert_close<R: AttentionRuntime>(what: &str, got: &Tensor<R>, want: &Tensor<R>, context: &str)
where
    R::Client: RingOps<R>,
{
    assert_eq!(got.shape(), want.shape(), "{what}: shape ({context})");
    let (g, w) = (values(got), values(want));
    let scale = w
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f32, |m, x| m.max(x.abs()));
    let tol = 2e-5 * (1.0 + scale);
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = if b.is_finite() {
            (a - b).abs() <= tol
        } else {
            a == b
        };
        assert!(
            ok,
            "{what}[{i}]: ring {a}, single device {b} (tol {tol}; {context})"
        );
    }
}

/// Check every rank's results on `device` against single-device attention
/// on the gathered sequence there, and every rank's traffic.
fn check_against_single<V: Variant, R: AttentionRuntime>(
    variant: &V,
    (world, shards, schedule): (usize, Shards, Schedule),
    rng: &mut Rng,
    seed: u64,
    device: &R::Device,
) where
    R::Client: RingOps<R>,
{
    let s = N * world;
    let x = Inputs::<R>::new(rng, s, device);
    // A dropout variant draws from this seed and offset (the others
    // ignore them); the rows' largest scores merge over the ring too.
    let attention = AttentionOptions::default()
        .with_dropout(0x005e_ed0f_d80f, 3)
        .with_max_scores();
    let opts = Setup {
        attention,
        ..options(shards, schedule)
    };
    let context = format!(
        "{} on {} world {world} {shards:?} {schedule:?}; seed {seed}, rerun with {SEED_ENV}={seed}",
        V::NAME,
        R::name()
    );
    let (y, want) = one_device(variant, &x, &opts.attention);
    let (group, comms) = thread_group(world);
    let ranks: Vec<RankOut<R>> = run_ring(variant, &x, &comms, &opts)
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{context}: {e}")))
        .collect();
    let want_max = y.max_scores.as_ref().expect("asked for");
    for (what, got, want) in [
        ("out", gathered(&ranks, shards, |r| &r.out), &y.out),
        ("lse", gathered(&ranks, shards, |r| &r.lse), &y.lse),
        (
            "max_scores",
            gathered(&ranks, shards, max_scores_of),
            want_max,
        ),
        ("dq", gathered(&ranks, shards, |r| &r.grads.dq), &want.dq),
        ("dk", gathered(&ranks, shards, |r| &r.grads.dk), &want.dk),
        ("dv", gathered(&ranks, shards, |r| &r.grads.dv), &want.dv),
    ] {
        assert_close(what, &got, want, &context);
    }
    for (slot, want) in want.tensors.iter().enumerate() {
        let want = want.as_ref().expect("every tensor gradient was asked for");
        for (rank, r) in ranks.iter().enumerate() {
            let got = r.grads.tensors[slot].as_ref().expect("a tensor gradient");
            assert_close(
                &format!("tensor {slot} on rank {rank}"),
                got,
                want,
                &context,
            );
            // Every rank holds the same bits.
            assert_eq!(
                values(got),
                values(ranks[0].grads.tensors[slot].as_ref().unwrap())
            );
        }
    }
    // The traffic: a header and a status per pass; the blocks (ring) or
    // one all-gather each of K and V; dK/dV around the ring; one
    // all-gather per tensor gradient.
    let w = world as u64;
    let learnable = want.tensors.len() as u64;
    let shard_kv = (B * HKV * N * (D + DV) * 4) as u64;
    for (rank, c) in group.iter().enumerate() {
        let back = if w > 1 { 2 * w } else { 0 };
        let want = match schedule {
            Schedule::Ring => MessageCount {
                sends: 2 * (w - 1) * 2 + back,
                recvs: 2 * (w - 1) * 2 + back,
                bytes_sent: 2 * (w - 1) * shard_kv + back / 2 * shard_kv,
                all_gathers: 4 + learnable,
                bytes_gathered: c.count().bytes_gathered,
                other_collectives: 0,
            },
            _ => MessageCount {
                sends: 0,
                recvs: 0,
                bytes_sent: 0,
                all_gathers: 8 + learnable,
                bytes_gathered: c.count().bytes_gathered,
                other_collectives: 2,
            },
        };
        assert_eq!(c.count(), want, "rank {rank}'s traffic ({context})");
    }
}

/// The variant `variant_of(rng, world, device)` on `device` against one
/// device at each world size, in both layouts, under `schedule`.
pub(crate) fn each_layout_on<V: Variant, R: AttentionRuntime>(
    device: &R::Device,
    stream: u64,
    worlds: &[usize],
    schedule: Schedule,
    variant_of: impl Fn(&mut Rng, usize, &R::Device) -> V,
) where
    R::Client: RingOps<R>,
{
    let seed = choose_seed();
    let mut rng = Rng::new(seed, stream);
    for &world in worlds {
        let variant = variant_of(&mut rng, world, device);
        for shards in [Shards::Contiguous, Shards::Zigzag] {
            check_against_single::<V, R>(
                &variant,
                (world, shards, schedule),
                &mut rng,
                seed,
                device,
            );
        }
    }
}

/// [`each_layout_on`] the CPU.
fn each_layout<V: Variant>(
    stream: u64,
    worlds: &[usize],
    schedule: Schedule,
    variant_of: impl Fn(&mut Rng, usize) -> V,
) {
    each_layout_on::<V, CpuRuntime>(&device(), stream, worlds, schedule, |rng, world, _| {
        variant_of(rng, world)
    });
}

/// A `[HQ]` f32 tensor on `device` that requires grad, of standard
/// deviation `std`.
pub(crate) fn learnable_on<R: AttentionRuntime>(
    rng: &mut Rng,
    std: f32,
    device: &R::Device,
) -> Var<R> {
    let t = Tensor::<R>::from_slice(&rng.normal_f32(HQ, std), &[HQ], device).expect("a tensor");
    Var::new(t, true)
}

/// [`learnable_on`] the CPU.
fn learnable(rng: &mut Rng, std: f32) -> Var<CpuRuntime> {
    learnable_on(rng, std, &device())
}

/// Documents of 7 positions (shifted by one per sequence) over `world`
/// shards: they straddle the shards' edges.
pub(crate) fn documents_on<R: AttentionRuntime>(
    world: usize,
    device: &R::Device,
) -> CausalDocuments<R> {
    let s = N * world;
    let ids: Vec<i32> = (0..B * s).map(|i| ((i % s) / 7 + i / s) as i32).collect();
    let doc = Tensor::<R>::from_slice(&ids, &[B, s], device).expect("ids");
    CausalDocuments { doc }
}

#[test]
fn full_attention_matches_one_device_at_every_world_size() {
    each_layout(0, &[1, 2, 3, 4], Schedule::Ring, |_, _| Full);
}

#[test]
fn causal_attention_matches_one_device_at_every_world_size() {
    each_layout(1, &[1, 2, 3, 4], Schedule::Ring, |_, _| Causal);
}

#[test]
fn a_sliding_window_narrower_than_a_chunk_matches_one_device() {
    each_layout(2, &[2, 3, 4], Schedule::Ring, |_, _| CausalSlidingWindow {
        window: 4,
    });
}

#[test]
fn document_ids_are_read_at_global_positions() {
    each_layout(3, &[2, 3, 4], Schedule::Ring, |_, world| {
        documents_on::<CpuRuntime>(world, &device())
    });
}

#[test]
fn a_learnable_bias_gets_its_gradient_summed_over_the_ranks() {
    each_layout(4, &[1, 2, 3, 4], Schedule::Ring, |rng, _| AlibiSlopes {
        slopes: learnable(rng, 0.2),
    });
}

#[test]
fn sinks_count_once_per_row() {
    // A window of 3 leaves most pairs of chunks empty; the sink still
    // joins every row once.
    each_layout(5, &[1, 2, 3, 4], Schedule::Ring, |rng, _| {
        CausalSlidingWindowSinks {
            window: 3,
            sinks: learnable(rng, 1.0),
        }
    });
}

#[test]
fn sigmoid_weights_add_across_the_ring() {
    each_layout(7, &[1, 2, 3], Schedule::Ring, |_, _| CausalSigmoid {
        bias: -1.5,
    });
}

#[test]
fn dropout_draws_the_pairs_one_device_draws() {
    each_layout(8, &[2, 3, 4], Schedule::Ring, |_, _| CausalDropout {
        p: 0.3,
    });
}

#[test]
fn shared_keys_match_one_device_and_travel_once() {
    let world = 3;
    for (stream, schedule) in [(24, Schedule::Ring), (25, Schedule::AllGather)] {
        let (seed, _, x) = inputs(stream, world);
        // Every sequence reads sequence 0's keys, given once: `[1, ..]`.
        let one = |t: &T| {
            t.narrow(0, 0, 1)
                .and_then(|t| t.contiguous())
                .expect("narrow")
        };
        let x = Inputs {
            k: one(&x.k),
            v: one(&x.v),
            ..x
        };
        let opts = options(Shards::Zigzag, schedule);
        let context = format!("{schedule:?}; seed {seed}, rerun with {SEED_ENV}={seed}");
        let (y, want) = one_device(&CausalSlidingWindow { window: 9 }, &x, &opts.attention);
        let (out, lse) = (y.out, y.lse);
        let (group, comms) = thread_group(world);
        let ranks: Vec<RankOut<CpuRuntime>> =
            run_ring(&CausalSlidingWindow { window: 9 }, &x, &comms, &opts)
                .into_iter()
                .map(|r| r.unwrap_or_else(|e| panic!("{context}: {e}")))
                .collect();
        for (what, got, want) in [
            ("out", gathered(&ranks, opts.shards, |r| &r.out), &out),
            ("lse", gathered(&ranks, opts.shards, |r| &r.lse), &lse),
            (
                "dq",
                gathered(&ranks, opts.shards, |r| &r.grads.dq),
                &want.dq,
            ),
            (
                "dk",
                gathered(&ranks, opts.shards, |r| &r.grads.dk),
                &want.dk,
            ),
            (
                "dv",
                gathered(&ranks, opts.shards, |r| &r.grads.dv),
                &want.dv,
            ),
        ] {
            assert_close(what, &got, want, &context);
        }
        // The blocks that travel are of batch 1.
        if schedule == Schedule::Ring {
            let block = (HKV * N * (D + DV) * 4) as u64;
            for (rank, c) in group.iter().enumerate() {
                let w = world as u64;
                let want = 2 * (w - 1) * block + w * block;
                assert_eq!(c.count().bytes_sent, want, "rank {rank} ({context})");
            }
        }
    }
}

#[test]
fn keys_other_than_dense_are_an_error_on_every_rank() {
    let world = 2;
    let (_, _, x) = inputs(26, world);
    let lengths = T::from_slice(&[N as i32; B], &[B], &device()).expect("lengths");
    let errors = errors_of(world, Duration::from_secs(30), |rank, comm| {
        let [q, k, v, _] = x.shard(Shards::Zigzag, rank, world)?;
        let opts = options(Shards::Zigzag, Schedule::Ring);
        ring_attention(&Causal, &q, Keys::cache(&k, &v, &lengths), &opts.on(comm)).map(drop)
    });
    for (rank, e) in errors.iter().enumerate() {
        assert!(
            e.contains("dense keys") && e.contains("a KV cache"),
            "rank {rank}: {e}"
        );
    }
}

#[test]
fn the_all_gather_schedule_matches_one_device() {
    each_layout(6, &[1, 3], Schedule::AllGather, |_, _| Causal);
}

#[test]
fn numrs_local_communicator_runs_the_all_gather_schedule_and_refuses_the_ring_on_every_rank() {
    let world = 3;
    let (seed, _, x) = inputs(15, world);
    let group = |_| {
        LocalCommunicator::with_timeout(world, Duration::from_secs(30))
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect::<Vec<_>>()
    };
    let all_gather = options(Shards::Zigzag, Schedule::AllGather);
    let keys = Keys::dense(&x.k, &x.v);
    let out = attention(&Causal, &x.q, keys, &all_gather.attention)
        .expect("one device")
        .out;
    let ranks: Vec<RankOut<CpuRuntime>> = run_ring(&Causal, &x, &group(()), &all_gather)
        .into_iter()
        .map(|r| r.expect("all-gather on LocalCommunicator"))
        .collect();
    let got = gathered(&ranks, Shards::Zigzag, |r| &r.out);
    assert_close("out", &got, &out, &format!("seed {seed}"));
    // The ring needs point-to-point messages, which LocalCommunicator
    // refuses: every rank says so, none waits.
    let ring = options(Shards::Contiguous, Schedule::Ring);
    let started = std::time::Instant::now();
    for r in run_ring(&Causal, &x, &group(()), &ring) {
        let e = r.err().expect("no rank succeeds").to_string();
        assert!(e.contains("point-to-point") || e.contains("failed"), "{e}");
    }
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn results_are_the_same_bits_run_to_run() {
    let world = 3;
    let (_, mut rng, x) = inputs(16, world);
    let variant = AlibiSlopes {
        slopes: learnable(&mut rng, 0.2),
    };
    let opts = options(Shards::Zigzag, Schedule::Ring);
    let bits = || -> Vec<Vec<u32>> {
        let (_, comms) = thread_group(world);
        run_ring(&variant, &x, &comms, &opts)
            .into_iter()
            .flat_map(|r| {
                let r = r.expect("ring");
                let mut all = vec![&r.out, &r.lse, &r.grads.dq, &r.grads.dk, &r.grads.dv];
                all.extend(r.grads.tensors.iter().flatten());
                all.into_iter()
                    .map(|t| values(t).iter().map(|x| x.to_bits()).collect())
                    .collect::<Vec<Vec<u32>>>()
            })
            .collect()
    };
    assert_eq!(bits(), bits());
}

/// What a rank does in an error test, given its rank and communicator.
type RankCall<'a> = dyn Fn(usize, &Arc<dyn Communicator>) -> Result<()> + Sync + 'a;

/// Run `world` ranks, each calling `call`, and return each rank's error
/// text ("Ok" for none).
fn errors_of(
    world: usize,
    timeout: Duration,
    call: impl Fn(usize, &Arc<dyn Communicator>) -> Result<()> + Sync,
) -> Vec<String> {
    let (_group, comms) = thread_group_waiting(world, timeout);
    on_ranks(&comms, |rank, comm| match call(rank, comm) {
        Ok(()) => "Ok".to_string(),
        Err(e) => e.to_string(),
    })
}

/// Ranks whose variants disagree (rank 2's window is 5, the others' 4)
/// all return the same error, naming the variant, before any block moves.
/// (The CPU's own test, below, covers more disagreements.)
#[cfg_attr(not(feature = "wgpu"), allow(dead_code))]
pub(crate) fn disagreeing_ranks_fail_alike_on<R: AttentionRuntime>(device: &R::Device)
where
    R::Client: RingOps<R>,
{
    let world = 3;
    let mut rng = Rng::new(choose_seed(), 22);
    let x = Inputs::<R>::new(&mut rng, N * world, device);
    let opts = options(Shards::Zigzag, Schedule::Ring);
    let errors = errors_of(world, Duration::from_secs(30), |rank, comm| {
        let variant = CausalSlidingWindow {
            window: if rank == 2 { 5 } else { 4 },
        };
        forward_on(&variant, &x, (rank, comm), &opts)
    });
    for (rank, e) in errors.iter().enumerate() {
        assert!(
            e.contains("the variant and its parameters"),
            "rank {rank}: {e}"
        );
    }
}

#[test]
fn ranks_that_disagree_all_get_the_same_error() {
    let world = 3;
    let (_, _, x) = inputs(17, world);
    let shard = |t: &T, rank: usize| Shards::Contiguous.shard(t, 2, rank, world).expect("shard");
    let opts = options(Shards::Contiguous, Schedule::Ring);
    let cases: [(&str, &RankCall<'_>); 4] = [
        ("the shard length", &|rank, comm| {
            // Rank 1 holds one row fewer.
            let len = if rank == 1 { N - 1 } else { N };
            let q = shard(&x.q, rank).narrow(2, 0, len)?.contiguous()?;
            let k = shard(&x.k, rank).narrow(2, 0, len)?.contiguous()?;
            let v = shard(&x.v, rank).narrow(2, 0, len)?.contiguous()?;
            ring_attention(&Causal, &q, Keys::dense(&k, &v), &opts.on(comm)).map(drop)
        }),
        ("the variant and its parameters", &|rank, comm| {
            let variant = CausalSlidingWindow {
                window: if rank == 2 { 5 } else { 4 },
            };
            let (q, k, v) = (shard(&x.q, rank), shard(&x.k, rank), shard(&x.v, rank));
            ring_attention(&variant, &q, Keys::dense(&k, &v), &opts.on(comm)).map(drop)
        }),
        ("the layout of the shards", &|rank, comm| {
            let opts = Setup {
                shards: if rank == 0 {
                    Shards::Zigzag
                } else {
                    Shards::Contiguous
                },
                ..opts
            };
            let (q, k, v) = (shard(&x.q, rank), shard(&x.k, rank), shard(&x.v, rank));
            ring_attention(&Causal, &q, Keys::dense(&k, &v), &opts.on(comm)).map(drop)
        }),
        ("whether their own inputs are valid", &|rank, comm| {
            // Rank 1's k has a head dim that q does not.
            let (q, v) = (shard(&x.q, rank), shard(&x.v, rank));
            let k = if rank == 1 {
                v.clone()
            } else {
                shard(&x.k, rank)
            };
            ring_attention(&Causal, &q, Keys::dense(&k, &v), &opts.on(comm)).map(drop)
        }),
    ];
    for (field, call) in cases {
        let errors = errors_of(world, Duration::from_secs(30), call);
        for (rank, e) in errors.iter().enumerate() {
            // The rank with bad inputs names its own error.
            let own = field.contains("own inputs") && rank == 1;
            let want = if own {
                "q and k must have the same head dim"
            } else {
                field
            };
            assert!(e.contains(want), "rank {rank}: {e} (wanted {want})");
        }
    }
}

/// A relative bias read past its table on some ranks only: with 4 rows
/// per rank, relative positions of 8 or more (ranks 2 and 3, from their
/// third step) read outside it, ranks 0 and 1 never do. The failing ranks
/// return their own error, the others one that names them, and nobody
/// waits for the timeout.
pub(crate) fn a_failing_kernel_fails_every_rank_on<R: AttentionRuntime>(device: &R::Device)
where
    R::Client: RingOps<R>,
{
    let seed = choose_seed();
    let mut rng = Rng::new(seed, 18);
    let (world, n) = (4, 4);
    let s = n * world;
    let x = Inputs::<R>::new(&mut rng, s, device);
    let table =
        Tensor::<R>::from_slice(&rng.normal_f32(HQ * 16, 1.0), &[HQ, 16], device).expect("table");
    let variant = RelativeBias {
        table,
        max_distance: 8,
    };
    let opts = options(Shards::Contiguous, Schedule::Ring);
    let started = std::time::Instant::now();
    let errors = errors_of(world, Duration::from_secs(30), |rank, comm| {
        forward_on(&variant, &x, (rank, comm), &opts)
    });
    for rank in [0, 1] {
        assert!(
            errors[rank].contains("rank(s) [2, 3] failed"),
            "rank {rank}: {}",
            errors[rank]
        );
    }
    for rank in [2, 3] {
        assert!(
            errors[rank].contains("outside its shape"),
            "rank {rank}: {}",
            errors[rank]
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_rank_whose_kernel_fails_mid_ring_fails_every_rank() {
    a_failing_kernel_fails_every_rank_on::<CpuRuntime>(&device());
}

#[test]
fn a_rank_that_never_joins_is_an_error_within_the_timeout() {
    let world = 3;
    let (_, _, x) = inputs(19, world);
    let opts = options(Shards::Contiguous, Schedule::Ring).with_timeout(Duration::from_secs(2));
    let started = std::time::Instant::now();
    let errors = errors_of(world, Duration::from_secs(2), |rank, comm| {
        if rank == 1 {
            // Stuck: holds its communicator and never calls.
            std::thread::sleep(Duration::from_secs(3));
            return Err(Error::Ring {
                rule: "this rank never joins",
                got: String::new(),
            });
        }
        forward_on(&Causal, &x, (rank, comm), &opts)
    });
    assert!(errors.iter().all(|e| e != "Ok"), "{errors:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn the_autograd_op_runs_the_ring_backward_on_every_rank() {
    let world = 2;
    let (seed, mut rng, x) = inputs(20, world);
    let variant = CausalSlidingWindowSinks {
        window: 7,
        sinks: learnable(&mut rng, 1.0),
    };
    let opts = options(Shards::Zigzag, Schedule::Ring);
    let client = CpuRuntime::default_client(&device());
    // Loss = Σ out ∘ dout + Σ lse ∘ dlse: d loss / d out = dout, d loss
    // / d lse = dlse.
    let loss_grads = |y: &VarOutput<CpuRuntime>, (dout, dlse): (&T, &T)| {
        let loss = crate::testing::out_and_lse_loss(&client, (&y.out, &y.lse), (dout, dlse))
            .expect("loss");
        numr::autograd::backward(&loss, &client).expect("backward")
    };
    let (q, k, v) = (
        Var::new(x.q.clone(), true),
        Var::new(x.k.clone(), true),
        Var::new(x.v.clone(), true),
    );
    let y = crate::var_attention(&variant, &q, Keys::dense(&k, &v), &opts.attention)
        .expect("one device");
    let grads = loss_grads(&y, (&x.dout, &x.dlse));
    let want_sinks = crate::learnable_grads(&variant, &grads).expect("by name")[0]
        .1
        .expect("sinks' gradient")
        .clone();
    let want_dk = grads.get(k.id()).expect("dk").clone();
    let (_, comms) = thread_group(world);
    let results: Vec<(T, T)> = on_ranks(&comms, |rank, comm| {
        let [q, k, v, dout] = x.shard(opts.shards, rank, world).expect("shard");
        let dlse = x.shard_dlse(opts.shards, rank, world).expect("shard");
        let k = Var::new(k, true);
        let (q, v) = (Var::new(q, true), Var::new(v, true));
        let y =
            var_ring_attention(&variant, &q, Keys::dense(&k, &v), &opts.on(comm)).expect("ring");
        let grads = loss_grads(&y, (&dout, &dlse));
        let sinks = crate::learnable_grads(&variant, &grads).expect("by name")[0]
            .1
            .expect("sinks' gradient")
            .clone();
        (grads.get(k.id()).expect("dk").clone(), sinks)
    });
    let dks: Vec<T> = results.iter().map(|(dk, _)| dk.clone()).collect();
    let context = format!("seed {seed}");
    assert_close(
        "dk",
        &opts.shards.unshard(&dks, 2).expect("unshard"),
        &want_dk,
        &context,
    );
    for (_, sinks) in &results {
        assert_close("d sinks", sinks, &want_sinks, &context);
    }
}

#[test]
fn bf16_shards_match_one_device_in_bf16() {
    let world = 2;
    let (seed, _, x) = inputs(21, world);
    let bf16 = |t: &T| t.to_dtype(DType::BF16).expect("bf16");
    let x = Inputs {
        q: bf16(&x.q),
        k: bf16(&x.k),
        v: bf16(&x.v),
        dout: bf16(&x.dout),
        dlse: x.dlse,
    };
    let opts = options(Shards::Zigzag, Schedule::Ring);
    let (Output { out, lse, .. }, want) = one_device(&Causal, &x, &opts.attention);
    let (_, comms) = thread_group(world);
    let ranks: Vec<RankOut<CpuRuntime>> = run_ring(&Causal, &x, &comms, &opts)
        .into_iter()
        .map(|r| r.expect("ring"))
        .collect();
    let gather = |f: fn(&RankOut<CpuRuntime>) -> &T| gathered(&ranks, opts.shards, f);
    // Both round every result to bf16 once, from f32 sums in different
    // orders: a few bf16 steps (2^-8 relative) apart at most.
    let close = |what: &str, got: &T, want: &T| {
        assert_eq!(got.dtype(), DType::BF16, "{what}");
        let (g, w) = (values(got), values(want));
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            assert!(
                (a - b).abs() <= 2e-2 * (1.0 + scale),
                "{what}[{i}]: ring {a}, one device {b} (seed {seed}, {SEED_ENV}={seed})"
            );
        }
    };
    close("out", &gather(|r| &r.out), &out);
    close("dq", &gather(|r| &r.grads.dq), &want.dq);
    close("dk", &gather(|r| &r.grads.dk), &want.dk);
    close("dv", &gather(|r| &r.grads.dv), &want.dv);
    assert_close("lse", &gather(|r| &r.lse), &lse, &format!("seed {seed}"));
}

/// A rank whose backward inputs are bad (`dout` narrowed by 4 columns, an
/// lse of another dtype) fails every rank at once: the header covers
/// `out`, `dout` and `lse`, so the others never wait for its blocks.
#[test]
fn a_bad_backward_input_on_one_rank_fails_every_rank_at_once() {
    let world = 3;
    let (_, _, x) = inputs(23, world);
    // A timeout far above the test's bound: waiting for it would fail.
    let opts = options(Shards::Contiguous, Schedule::Ring).with_timeout(Duration::from_secs(60));
    /// `(dout, lse)` made bad.
    type Spoil = fn(T, T) -> Result<(T, T)>;
    let bad_inputs: [(&str, Spoil); 2] = [
        ("dout", |dout, lse| {
            let cols = dout.shape()[3];
            Ok((dout.narrow(3, 0, cols - 4)?.contiguous()?, lse))
        }),
        ("lse", |dout, lse| {
            Ok((dout, lse.to_dtype(numr::dtype::DType::F64)?))
        }),
    ];
    for (field, spoil) in bad_inputs {
        let started = std::time::Instant::now();
        let errors = errors_of(world, Duration::from_secs(60), |rank, comm| {
            let [q, k, v, dout] = x.shard(opts.shards, rank, world)?;
            let ring = opts.on(comm);
            let y = ring_attention(&Causal, &q, Keys::dense(&k, &v), &ring)?;
            let (dout, lse) = if rank == 2 {
                spoil(dout, y.lse)?
            } else {
                (dout, y.lse)
            };
            let grads = Backward::from_tensors(&y.out, &lse, &dout);
            ring_attention_backward(&Causal, &q, Keys::dense(&k, &v), grads, &ring).map(drop)
        });
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{field}: {:?}",
            started.elapsed()
        );
        for (rank, e) in errors.iter().enumerate() {
            let want = if rank == 2 {
                field
            } else {
                "whether their own inputs are valid"
            };
            assert!(
                e.contains(want),
                "{field}, rank {rank}: {e} (wanted {want})"
            );
        }
    }
}
