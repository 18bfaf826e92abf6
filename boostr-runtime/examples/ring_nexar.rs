//! Ring attention across processes: one process per rank, joined over
//! QUIC by numr's nexar communicator, on one machine.
//!
//! ```text
//! cargo run --release -p boostr-runtime --features distributed --example ring_nexar [-- world [S]]
//! ```
//!
//! Run as above, the program is the launcher: it starts `world` (default
//! 3, at most 4) copies of itself, rank `r` as `--rank r --world w --seed
//! 127.0.0.1:PORT [--seq S]`, and waits for them. Rank 0 binds the seed;
//! the others join it. Every rank builds the same sequence (`S = 3072` by
//! default: causal documents, `B = 1`, `Hq = 8`, `Hkv = 2`, `D = 64`),
//! takes its zigzag shard, runs `var_ring_attention` and numr's `backward`
//! through the ring, and checks its rows of `out`, `dq`, `dk` and `dv`
//! against single-device attention on the whole sequence, which it also
//! computes. Each rank prints its errors, the bytes it sent and its time;
//! the launcher fails if any rank does.

use boostr_runtime::stock::CausalDocuments;
use boostr_runtime::testing::Rng;
use boostr_runtime::{
    AttentionOptions, Backward, Keys, RingOptions, Schedule, Shards, attention, attention_backward,
    last_ring_times, var_ring_attention,
};
use nexar::{ClusterConfig, CpuAdapter, NexarClient, SyncClient};
use numr::autograd::{Var, backward, var_mul, var_sum};
use numr::prelude::{CpuDevice, CpuRuntime, Runtime, Tensor};
use numr::runtime::{Communicator, NexarNetCommunicator};
use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

type T = Tensor<CpuRuntime>;
type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 64;

fn main() -> BoxResult<()> {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    match flag("--rank") {
        Some(rank) => {
            let world: usize = flag("--world").ok_or("--world")?.parse()?;
            let seed: SocketAddr = flag("--seed").ok_or("--seed")?.parse()?;
            let s: usize = flag("--seq").ok_or("--seq")?.parse()?;
            run_rank(rank.parse()?, world, seed, s)
        }
        None => {
            let world: usize = args.get(1).map_or(Ok(3), |a| a.parse())?;
            let s: usize = args.get(2).map_or(Ok(3072), |a| a.parse())?;
            launch(world, s)
        }
    }
}

/// Start `world` ranks of this program and wait for them.
fn launch(world: usize, s: usize) -> BoxResult<()> {
    if !(1..=4).contains(&world) || !s.is_multiple_of(2 * world) {
        return Err(
            format!("world must be 1 to 4 and S a multiple of 2·world; got {world}, {s}").into(),
        );
    }
    // A free port for the seed (released just before rank 0 binds it).
    let port = std::net::UdpSocket::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let seed = format!("127.0.0.1:{port}");
    let exe = std::env::current_exe()?;
    println!("{world} processes, seed {seed}, S = {s}");
    let children = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .args(["--rank", &rank.to_string(), "--world", &world.to_string()])
                .args(["--seed", &seed, "--seq", &s.to_string()])
                .spawn()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut failed = Vec::new();
    for (rank, mut child) in children.into_iter().enumerate() {
        if !child.wait()?.success() {
            failed.push(rank);
        }
    }
    if failed.is_empty() {
        println!("every rank matched single-device attention");
        Ok(())
    } else {
        Err(format!("ranks {failed:?} failed").into())
    }
}

/// One rank: join the cluster, run the ring, check against one device.
fn run_rank(rank: usize, world: usize, seed: SocketAddr, s: usize) -> BoxResult<()> {
    // The runtime that drives the QUIC connections lives as long as the
    // communicator.
    let rt = tokio::runtime::Runtime::new()?;
    let mut cfg = ClusterConfig::new(world as u32);
    cfg.bind_addr = "127.0.0.1:0".parse()?;
    cfg.requested_rank = Some(rank as u32);
    let adapter = Arc::new(CpuAdapter::new());
    let client = rt.block_on(async {
        if rank == 0 {
            NexarClient::bootstrap_seed(seed, &cfg, adapter).await
        } else {
            NexarClient::bootstrap_join(seed, &cfg, adapter).await
        }
    })?;
    let comm: Arc<dyn Communicator> =
        Arc::new(NexarNetCommunicator::new(SyncClient::from_async(client)?));

    let device = CpuDevice::new();
    let client = CpuRuntime::default_client(&device);
    // Every rank draws the same whole sequence.
    let mut rng = Rng::new(41, 0);
    let mut x = |shape: [usize; 4]| -> BoxResult<T> {
        let n = shape.iter().product();
        Ok(T::from_slice(&rng.normal_f32(n, 1.0), &shape, &device)?)
    };
    let (q, k, v, dout) = (
        x([1, HQ, s, D])?,
        x([1, HKV, s, D])?,
        x([1, HKV, s, D])?,
        x([1, HQ, s, D])?,
    );
    // Documents of 700 positions: they straddle the ranks' chunks.
    let ids: Vec<i32> = (0..s).map(|i| (i / 700) as i32).collect();
    let variant = CausalDocuments {
        doc: T::from_slice(&ids, &[1, s], &device)?,
    };
    let opts = RingOptions::new(Arc::clone(&comm))
        .with_shards(Shards::Zigzag)
        .with_schedule(Schedule::Ring);
    let shard = |t: &T| opts.shards.shard(t, 2, rank, world);

    let started = Instant::now();
    let (qv, kv, vv) = (
        Var::new(shard(&q)?, true),
        Var::new(shard(&k)?, true),
        Var::new(shard(&v)?, true),
    );
    let out = var_ring_attention(&variant, &qv, Keys::dense(&kv, &vv), &opts)?.out;
    let fwd_times = last_ring_times();
    let loss = var_sum(
        &var_mul(&out, &Var::new(shard(&dout)?, false), &client)?,
        &[0, 1, 2, 3],
        false,
        &client,
    )?;
    let grads = backward(&loss, &client)?;
    let bwd_times = last_ring_times();
    let elapsed = started.elapsed();

    // The same rows of single-device attention.
    let one = AttentionOptions::default();
    let want = attention(&variant, &q, Keys::dense(&k, &v), &one)?;
    let want_g = attention_backward(
        &variant,
        &q,
        Keys::dense(&k, &v),
        Backward::new(&want, &dout),
        &one,
    )?;
    let err = |got: &T, want: &T| -> BoxResult<f32> {
        let (g, w): (Vec<f32>, Vec<f32>) = (got.to_vec(), shard(want)?.to_vec());
        Ok(g.iter()
            .zip(&w)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs())))
    };
    let grad = |id| grads.get(id).ok_or("a gradient");
    let errors = [
        ("out", err(out.tensor(), &want.out)?),
        ("dq", err(grad(qv.id())?, &want_g.dq)?),
        ("dk", err(grad(kv.id())?, &want_g.dk)?),
        ("dv", err(grad(vv.id())?, &want_g.dv)?),
    ];
    let comm_ms = (fwd_times.comm + bwd_times.comm).as_secs_f64() * 1e3;
    let waited_ms = (fwd_times.waited + bwd_times.waited).as_secs_f64() * 1e3;
    println!(
        "rank {rank}: max |ring − one device| {}; fwd+bwd {:.1} ms, communication {comm_ms:.1} ms \
         on helper threads, {waited_ms:.1} ms of it waited for",
        errors
            .iter()
            .map(|(name, e)| format!("{name} {e:.1e}"))
            .collect::<Vec<_>>()
            .join(", "),
        elapsed.as_secs_f64() * 1e3,
    );
    if errors.iter().any(|(_, e)| e.is_nan() || *e > 1e-4) {
        return Err(format!("rank {rank}: the ring disagrees with one device").into());
    }
    drop((opts, comm));
    drop(rt);
    Ok(())
}
