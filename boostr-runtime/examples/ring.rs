//! Ring attention on one machine: two ranks, one thread each, against
//! single-device attention on both threads.
//!
//! ```text
//! cargo run --release -p boostr-runtime --example ring [-- reps [S ...] [f32] [bf16]]
//! ```
//!
//! Causal attention, `B = 1`, `Hq = Hkv = 2`, `D = 128`, at `S = 8192`
//! and `32768` (or the `S` given), f32 and bf16. Single device:
//! `attention` and `attention_backward` on rayon's pool of 2 workers, each
//! bound to its CPU. Ring: 2 ranks of an in-process group
//! (`testing::ThreadComm`), each on its own 1-thread rayon pool bound to
//! one CPU, calling `ring_attention` and `ring_attention_backward` on its
//! shard (zigzag; contiguous too at the smallest `S`). A run's time is the
//! slower rank's. Each repetition runs single device and then each ring
//! layout; `reps` (default 3) of them after one to warm up. Overhead is
//! ring ÷ single device − 1, of the medians and of the fastest runs (the
//! less noisy on a shared machine). Also printed: the bytes each rank sent, its
//! communication time on the helper threads and how much of that the
//! rank waited for (the rest was hidden behind compute).

use boostr_runtime::stock::Causal;
use boostr_runtime::testing::{Rng, ThreadComm};
use boostr_runtime::{
    AttentionOptions, Backward, Keys, RingOptions, Schedule, Shards, attention, attention_backward,
    last_ring_times, ring_attention, ring_attention_backward,
};
use numr::dtype::DType;
use numr::prelude::{CpuDevice, CpuRuntime, Tensor};
use numr::runtime::Communicator;
use std::sync::Arc;
use std::time::{Duration, Instant};

const H: usize = 2;
const D: usize = 128;
const WORLD: usize = 2;

type T = Tensor<CpuRuntime>;
type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> BoxResult<()> {
    let mut args = std::env::args().skip(1);
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(3);
    let rest: Vec<String> = args.collect();
    let mut sizes: Vec<usize> = rest.iter().filter_map(|a| a.parse().ok()).collect();
    if sizes.is_empty() {
        sizes = vec![8192, 32768];
    }
    let mut dtypes: Vec<DType> = rest
        .iter()
        .filter_map(|a| match a.as_str() {
            "f32" => Some(DType::F32),
            "bf16" => Some(DType::BF16),
            _ => None,
        })
        .collect();
    if dtypes.is_empty() {
        dtypes = vec![DType::F32, DType::BF16];
    }
    let threads = boostr_runtime::cpu::pin_threads(Some(WORLD))?;
    println!(
        "causal, B = 1, Hq = Hkv = {H}, D = {D}; single device on {threads} threads against \
         {WORLD} ranks of 1 thread (medians of {reps})"
    );
    println!(
        "{:>6} {:>5} {:>10} {:>4} {:>10} {:>10} {:>8} {:>8} {:>9} {:>9} {:>9}",
        "S",
        "dtype",
        "layout",
        "pass",
        "single ms",
        "ring ms",
        "overhead",
        "of mins",
        "MB sent",
        "comm ms",
        "waited ms"
    );
    for &s in &sizes {
        for &dtype in &dtypes {
            let mut layouts = vec![Shards::Zigzag];
            if s == sizes[0] {
                layouts.push(Shards::Contiguous);
            }
            let x = Inputs::new(s, dtype)?;
            let pools = rank_pools()?;
            // Each repetition runs single device and then each ring layout,
            // so that a slow spell of the machine touches all of them; the
            // first repetition warms up (fresh buffers' page faults) and is
            // dropped.
            let mut single = Vec::new();
            let mut rings: Vec<Vec<RingRun>> = layouts.iter().map(|_| Vec::new()).collect();
            for rep in 0..=reps {
                let one = single_device(&x)?;
                let many = layouts
                    .iter()
                    .map(|&shards| ring(&x, shards, &pools))
                    .collect::<BoxResult<Vec<_>>>()?;
                if rep > 0 {
                    single.push(one);
                    for (runs, run) in rings.iter_mut().zip(many) {
                        runs.push(run);
                    }
                }
            }
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            for (shards, runs) in layouts.iter().zip(&rings) {
                let passes: [Pass; 3] = [
                    ("fwd", |s| s.0, |r| r.fwd),
                    ("bwd", |s| s.1, |r| r.bwd),
                    ("f+b", |s| s.0 + s.1, |r| r.fwd + r.bwd),
                ];
                for (pass, one_of, ring_of) in passes {
                    let one = median(single.iter().map(one_of).collect());
                    let many = median(runs.iter().map(ring_of).collect());
                    let best_one = single.iter().map(one_of).min().unwrap_or_default();
                    let best_many = runs.iter().map(ring_of).min().unwrap_or_default();
                    println!(
                        "{s:>6} {:>5} {:>10} {pass:>4} {:>10.1} {:>10.1} {:>7.1}% {:>7.1}% {:>9.1} {:>9.1} {:>9.1}",
                        format!("{dtype:?}").to_lowercase(),
                        format!("{shards:?}").to_lowercase(),
                        ms(one),
                        ms(many),
                        (many.as_secs_f64() / one.as_secs_f64() - 1.0) * 100.0,
                        (best_many.as_secs_f64() / best_one.as_secs_f64() - 1.0) * 100.0,
                        runs[0].mb_sent,
                        ms(median(runs.iter().map(|r| r.comm).collect())),
                        ms(median(runs.iter().map(|r| r.waited).collect())),
                    );
                }
            }
        }
    }
    Ok(())
}

/// A pass's name, and its time on one device and in a ring run.
type Pass = (
    &'static str,
    fn(&(Duration, Duration)) -> Duration,
    fn(&RingRun) -> Duration,
);

/// The whole sequence's `q, k, v, dout`.
struct Inputs {
    q: T,
    k: T,
    v: T,
    dout: T,
}

impl Inputs {
    fn new(s: usize, dtype: DType) -> BoxResult<Self> {
        let device = CpuDevice::new();
        let mut rng = Rng::new(29, s as u64);
        let mut x = || -> BoxResult<T> {
            let n = H * s * D;
            let t = T::from_slice(&rng.normal_f32(n, 1.0), &[1, H, s, D], &device)?;
            Ok(t.to_dtype(dtype)?)
        };
        Ok(Inputs {
            q: x()?,
            k: x()?,
            v: x()?,
            dout: x()?,
        })
    }
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

/// Forward and backward times on one device.
fn single_device(x: &Inputs) -> BoxResult<(Duration, Duration)> {
    let opts = AttentionOptions::default();
    let t0 = Instant::now();
    let keys = Keys::dense(&x.k, &x.v);
    let y = attention(&Causal, &x.q, keys, &opts)?;
    let t1 = Instant::now();
    attention_backward(&Causal, &x.q, keys, Backward::new(&y, &x.dout), &opts)?;
    Ok((t1 - t0, t1.elapsed()))
}

/// What the ring runs measured.
struct RingRun {
    fwd: Duration,
    bwd: Duration,
    /// MB rank 0 sent per forward + backward.
    mb_sent: f64,
    /// Rank 0's communication time on its helpers, per forward + backward.
    comm: Duration,
    /// How much of it rank 0 waited for.
    waited: Duration,
}

/// One rank's forward and backward, timed.
fn rank_run(x: &Inputs, opts: &RingOptions) -> BoxResult<[Duration; 4]> {
    let rank = opts.comm.rank();
    let shard = |t: &T| opts.shards.shard(t, 2, rank, WORLD);
    let (q, k, v, dout) = (shard(&x.q)?, shard(&x.k)?, shard(&x.v)?, shard(&x.dout)?);
    let keys = Keys::dense(&k, &v);
    let t0 = Instant::now();
    let y = ring_attention(&Causal, &q, keys, opts)?;
    let t1 = Instant::now();
    let fwd_times = last_ring_times();
    ring_attention_backward(&Causal, &q, keys, Backward::new(&y, &dout), opts)?;
    let bwd_times = last_ring_times();
    Ok([
        t1 - t0,
        t1.elapsed(),
        fwd_times.comm + bwd_times.comm,
        fwd_times.waited + bwd_times.waited,
    ])
}

/// One 1-thread rayon pool per rank, its worker bound to its own CPU.
fn rank_pools() -> BoxResult<Vec<rayon::ThreadPool>> {
    Ok((0..WORLD)
        .map(|r| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .start_handler(move |_| bind(r))
                .build()
        })
        .collect::<Result<Vec<_>, _>>()?)
}

/// One ring run: each pass's time is the slower rank's.
fn ring(x: &Inputs, shards: Shards, pools: &[rayon::ThreadPool]) -> BoxResult<RingRun> {
    let group = ThreadComm::group(WORLD, Duration::from_secs(600));
    let opts: Vec<RingOptions> = group
        .iter()
        .map(|c| {
            RingOptions::new(Arc::clone(c) as Arc<dyn Communicator>)
                .with_shards(shards)
                .with_schedule(Schedule::Ring)
        })
        .collect();
    let runs = std::thread::scope(|s| {
        let handles: Vec<_> = opts
            .iter()
            .zip(pools)
            .map(|(opts, pool)| {
                s.spawn(move || pool.install(|| rank_run(x, opts).map_err(|e| e.to_string())))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect::<Result<Vec<_>, String>>()
    })?;
    Ok(RingRun {
        fwd: runs.iter().map(|r| r[0]).max().unwrap_or_default(),
        bwd: runs.iter().map(|r| r[1]).max().unwrap_or_default(),
        mb_sent: group[0].count().bytes_sent as f64 / 1e6,
        comm: runs[0][2],
        waited: runs[0][3],
    })
}

/// Bind the calling thread to CPU `cpu` (best effort).
fn bind(cpu: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: a zeroed `cpu_set_t` with one bit set, passed with its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cpu;
}
