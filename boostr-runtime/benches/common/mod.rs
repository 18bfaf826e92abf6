//! The attention benchmark shared by the per-backend bench targets: boostr's
//! fused attention against the same attention composed from numr ops
//! (matmul, scale, bias mask, softmax, matmul; autograd for the backward),
//! forward and forward+backward, in one table.
//!
//! Shapes: B = 1, Hq = Hkv = 8, f32. Each time is the median of
//! `BOOSTR_BENCH_REPS` (default 5) runs after one warm-up run. Without that
//! variable, runs that would take over 10 s together are cut to 3, and a
//! warm-up over 1 s counts as the first run, to keep the default sweep short.
//! Every timed run ends with the device idle (`synchronize`).
//!
//! FLOPs count only useful work, identically for both implementations:
//! forward `4·B·H·S²·D`, halved (×(S+1)/(2S)) for causal; backward 2.5× the
//! forward, so forward+backward is 3.5× the forward.
//!
//! Forward+backward of both implementations is the autograd path a user takes:
//! build the op on `Var`s, then `backward` of `L = sum(out ∘ dout)`.
//!
//! The composed version materialises `[B, H, S, S]` scores (and, in its
//! backward, several more such tensors); when its forward+backward at one
//! length projects (from the previous length, ×4 per doubling) to more than
//! `BOOSTR_BENCH_COMPOSED_MAX_S` seconds per run (default 60), it is skipped.

use boostr_runtime::stock::{Causal, Full};
use boostr_runtime::testing::Rng;
use boostr_runtime::{AttentionOptions, AttentionRuntime, Keys, Variant, attention, var_attention};
use numr::autograd::{
    Var, backward, var_add, var_matmul, var_mul, var_mul_scalar, var_softmax, var_sum,
    var_transpose,
};
use numr::dtype::DType;
use numr::ops::{ReduceOps, TensorOps};
use numr::prelude::{ActivationOps, BinaryOps, MatmulOps, Runtime, ScalarOps, Tensor};
use numr::runtime::RuntimeClient;
use std::error::Error;
use std::process::ExitCode;
use std::time::{Duration, Instant};

pub type BoxResult<T> = Result<T, Box<dyn Error>>;

const BATCH: usize = 1;
const HEADS: usize = 8;

/// A runtime the benchmark can drive: boostr's kernels and numr's ops.
pub trait BenchRuntime:
    AttentionRuntime<DType = DType, Client: TensorOps<Self> + ReduceOps<Self> + ScalarOps<Self>>
{
}
impl<R> BenchRuntime for R where
    R: AttentionRuntime<DType = DType, Client: TensorOps<R> + ReduceOps<R> + ScalarOps<R>>
{
}

/// One bench target: the runtime, its device and its default sweep.
pub trait Target {
    type R: BenchRuntime;
    /// Printed in the title and the usage.
    const NAME: &'static str;
    /// Default sequence lengths (`--quick` keeps the first).
    const SEQS: &'static [usize];
    /// Default head dims.
    const DIMS: &'static [usize];
    /// Whether the work runs on this process's CPU threads (then the CPU time
    /// of the process is reported, to expose contention).
    const CPU_BOUND: bool;
    fn device() -> BoxResult<<Self::R as Runtime>::Device>;
    /// The device and threads, for the title.
    fn describe(device: &<Self::R as Runtime>::Device) -> String;
}

fn usage<T: Target>() -> String {
    let list = |x: &[usize]| {
        x.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    format!(
        "usage: cargo bench -p boostr-runtime --bench {name} -- [options]
  --quick            only S = {first} (smoke test)
  --seq N[,N..]      sequence lengths (default {seqs})
  --dim D[,D..]      head dims (default {dims})
  --variant V[,V..]  full, causal (default both)
  --no-composed      skip the composed numr implementation
env: BOOSTR_BENCH_REPS (timed runs, default 5),
     BOOSTR_BENCH_COMPOSED_MAX_S (per-run limit for composed fwd+bwd, default 60)",
        name = T::NAME.to_ascii_lowercase(),
        first = T::SEQS[0],
        seqs = list(T::SEQS),
        dims = list(T::DIMS),
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Full,
    Causal,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Full => "Full",
            Kind::Causal => "Causal",
        }
    }

    /// Fraction of (query, key) pairs that are visible.
    fn visible(self, s: usize) -> f64 {
        match self {
            Kind::Full => 1.0,
            Kind::Causal => (s + 1) as f64 / (2 * s) as f64,
        }
    }
}

#[derive(Debug)]
struct Config {
    seqs: Vec<usize>,
    dims: Vec<usize>,
    kinds: Vec<Kind>,
    composed: bool,
    reps: Reps,
    composed_max: Duration,
}

fn parse_list(flag: &str, value: Option<String>) -> Result<Vec<usize>, String> {
    let value = value.ok_or_else(|| format!("{flag} needs a value"))?;
    value
        .split(',')
        .map(|x| {
            x.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{flag}: bad value {x:?}"))
        })
        .collect()
}

fn env_number(name: &str, default: f64) -> Result<f64, String> {
    match std::env::var(name) {
        Ok(s) => s
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|&x| x > 0.0)
            .ok_or_else(|| format!("{name}={s:?} is not a positive number")),
        Err(_) => Ok(default),
    }
}

fn parse_args<T: Target>() -> Result<Config, String> {
    let mut config = Config {
        seqs: T::SEQS.to_vec(),
        dims: T::DIMS.to_vec(),
        kinds: vec![Kind::Full, Kind::Causal],
        composed: true,
        reps: Reps {
            n: (env_number("BOOSTR_BENCH_REPS", 5.0)? as usize).max(1),
            exact: std::env::var_os("BOOSTR_BENCH_REPS").is_some(),
        },
        composed_max: Duration::from_secs_f64(env_number("BOOSTR_BENCH_COMPOSED_MAX_S", 60.0)?),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        // `--flag=value` is accepted too.
        let (flag, mut value) = match arg.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        let mut value = || value.take().or_else(|| args.next());
        match flag.as_str() {
            // `cargo bench` passes `--bench` to every bench binary.
            "--bench" => {}
            "--quick" => config.seqs = vec![T::SEQS[0]],
            "--seq" => config.seqs = parse_list("--seq", value())?,
            "--dim" => config.dims = parse_list("--dim", value())?,
            "--variant" => {
                let v = value().ok_or("--variant needs a value")?;
                config.kinds = v
                    .split(',')
                    .map(|x| match x.trim().to_ascii_lowercase().as_str() {
                        "full" => Ok(Kind::Full),
                        "causal" => Ok(Kind::Causal),
                        other => Err(format!("--variant: unknown {other:?} (full, causal)")),
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--no-composed" => config.composed = false,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(config)
}

pub fn main<T: Target>() -> ExitCode {
    let config = match parse_args::<T>() {
        Ok(c) => c,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("error: {e}");
            }
            eprintln!("{}", usage::<T>());
            return ExitCode::from(2);
        }
    };
    match run::<T>(&config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// One row of the table.
struct Row {
    kind: Kind,
    seq: usize,
    dim: usize,
    fused_fwd: Duration,
    fused_fb: Duration,
    composed_fwd: Option<Duration>,
    /// `None`: not run (`--no-composed`), or skipped as too slow.
    composed_fb: Option<Duration>,
    composed_fb_skipped: bool,
    /// Max |fused − composed| over out, dq, dk, dv (when both ran).
    max_diff: Option<f64>,
}

fn run<T: Target>(config: &Config) -> BoxResult<()> {
    let device = T::device()?;
    let client = T::R::default_client(&device);
    println!(
        "boostr {} attention benchmark: {}, B={BATCH}, Hq=Hkv={HEADS}, f32, \
         median of {} runs after 1 warm-up{}",
        T::NAME,
        T::describe(&device),
        config.reps.n,
        if config.reps.exact {
            String::new()
        } else {
            format!(
                " (at least {MIN_REPS} when they would take over {} s; \
                 a warm-up over {} s counts as a run)",
                MEASURE_BUDGET.as_secs(),
                WARM_UP_COUNTS.as_secs()
            )
        }
    );
    println!(
        "GFLOP/s counts useful work: fwd 4·B·H·S²·D (×(S+1)/2S causal), fwd+bwd 3.5× that; \
         speedup = composed time / fused time"
    );
    println!();
    print_header();

    let mut rng = Rng::new(0xb005_7a11, 0);
    let started = Instant::now();
    let cpu_start = cpu_seconds();
    let mut rows = Vec::new();
    for &dim in &config.dims {
        for &kind in &config.kinds {
            // Composed fwd+bwd time at the previous length, to project the next.
            let mut last_composed: Option<(usize, Duration)> = None;
            for &seq in &config.seqs {
                let row = bench_one::<T::R>(
                    config,
                    &client,
                    &device,
                    &mut rng,
                    kind,
                    seq,
                    dim,
                    &mut last_composed,
                )?;
                print_row(&row);
                rows.push(row);
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    println!();
    println!("total wall time {wall:.1} s");
    if let (true, Some(c0), Some(c1)) = (T::CPU_BOUND, cpu_start, cpu_seconds()) {
        let threads = rayon::current_num_threads();
        println!(
            "CPU time of this process {:.1} s = {:.0}% of {threads} threads × wall \
             (well below 100% means other processes shared the cores and times are inflated)",
            c1 - c0,
            100.0 * (c1 - c0) / (wall * threads as f64)
        );
    }
    let bad: Vec<&Row> = rows
        .iter()
        .filter(|r| r.max_diff.is_some_and(|d| d.is_nan() || d > 1e-3))
        .collect();
    if !bad.is_empty() {
        for r in &bad {
            eprintln!(
                "warning: {} S={} D={}: fused and composed differ by {:.2e}",
                r.kind.name(),
                r.seq,
                r.dim,
                r.max_diff.unwrap_or(f64::NAN)
            );
        }
        return Err("fused and composed results disagree".into());
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn bench_one<R: BenchRuntime>(
    config: &Config,
    client: &R::Client,
    device: &R::Device,
    rng: &mut Rng,
    kind: Kind,
    seq: usize,
    dim: usize,
    last_composed: &mut Option<(usize, Duration)>,
) -> BoxResult<Row> {
    let shape = [BATCH, HEADS, seq, dim];
    let n = shape.iter().product();
    let tensor = |data: &[f32]| Tensor::<R>::from_slice(data, &shape, device);
    let q = tensor(&rng.normal_f32(n, 1.0))?;
    let k = tensor(&rng.normal_f32(n, 1.0))?;
    let v = tensor(&rng.normal_f32(n, 1.0))?;
    let dout = tensor(&rng.normal_f32(n, 1.0))?;
    let inputs = Inputs { q, k, v, dout };

    let (fused_fwd, fused_fb, fused_res) = match kind {
        Kind::Full => fused::<R, _>(config.reps, client, &Full, &inputs)?,
        Kind::Causal => fused::<R, _>(config.reps, client, &Causal, &inputs)?,
    };

    let mut row = Row {
        kind,
        seq,
        dim,
        fused_fwd,
        fused_fb,
        composed_fwd: None,
        composed_fb: None,
        composed_fb_skipped: false,
        max_diff: None,
    };
    if !config.composed {
        return Ok(row);
    }
    let composed = Composed::<R>::new(client, device, kind, seq, dim)?;
    row.composed_fwd = Some(median_time(config.reps, || {
        composed.forward(&inputs).map(drop)
    })?);
    // Skip the composed backward when the previous length projects it too slow.
    if let Some((prev_seq, prev_t)) = *last_composed {
        let growth = (seq as f64 / prev_seq as f64).powi(2);
        let projected = prev_t.mul_f64(growth);
        if projected > config.composed_max {
            *last_composed = None;
            row.composed_fb_skipped = true;
            return Ok(row);
        }
    }
    let mut comp_res = None;
    let t = median_time(config.reps, || {
        comp_res = Some(composed.forward_backward(&inputs)?);
        Ok(())
    })?;
    row.composed_fb = Some(t);
    *last_composed = Some((seq, t));
    if let Some(c) = comp_res {
        let mut diff = 0.0f64;
        for (a, b) in fused_res.iter().zip(&c) {
            let d = max_abs_diff(&host(a)?, &host(b)?);
            diff = if d.is_nan() { d } else { diff.max(d) };
        }
        row.max_diff = Some(diff);
    }
    Ok(row)
}

struct Inputs<R: Runtime> {
    q: Tensor<R>,
    k: Tensor<R>,
    v: Tensor<R>,
    dout: Tensor<R>,
}

/// `[out, dq, dk, dv]` of one forward+backward, still as tensors (copied to
/// the host only after timing).
type Results<R> = [Tensor<R>; 4];

/// `L = sum(out ∘ dout)`, whose gradient with respect to `out` is `dout`.
fn loss<R: BenchRuntime>(out: &Var<R>, dout: &Var<R>, client: &R::Client) -> BoxResult<Var<R>> {
    Ok(var_sum(
        &var_mul(out, dout, client)?,
        &[0, 1, 2, 3],
        false,
        client,
    )?)
}

/// Backward of `l`; `out` and the gradients of `[q, k, v]`. Only these tensors
/// are kept: the graph and its saved intermediates are dropped on return.
fn collect<R: BenchRuntime>(
    out: &Var<R>,
    l: &Var<R>,
    vars: [&Var<R>; 3],
    client: &R::Client,
) -> BoxResult<Results<R>> {
    let grads = backward(l, client)?;
    client.synchronize();
    let grad = |v: &Var<R>| -> BoxResult<Tensor<R>> {
        Ok(grads.get(v.id()).ok_or("no gradient")?.clone())
    };
    Ok([
        out.tensor().clone(),
        grad(vars[0])?,
        grad(vars[1])?,
        grad(vars[2])?,
    ])
}

/// Fused forward (tensor op) and forward+backward (autograd) times, and the
/// results of the last forward+backward.
fn fused<R: BenchRuntime, V: Variant>(
    reps: Reps,
    client: &R::Client,
    variant: &V,
    x: &Inputs<R>,
) -> BoxResult<(Duration, Duration, Results<R>)> {
    let opts = AttentionOptions::default();
    let fwd = median_time(reps, || {
        attention(variant, &x.q, Keys::dense(&x.k, &x.v), &opts)?;
        client.synchronize();
        Ok(())
    })?;
    let mut res = None;
    let fb = median_time(reps, || {
        let (q, k, v) = (
            Var::new(x.q.clone(), true),
            Var::new(x.k.clone(), true),
            Var::new(x.v.clone(), true),
        );
        let dout = Var::new(x.dout.clone(), false);
        let out = var_attention(variant, &q, Keys::dense(&k, &v), &opts)?.out;
        let l = loss(&out, &dout, client)?;
        res = Some(collect(&out, &l, [&q, &k, &v], client)?);
        Ok(())
    })?;
    Ok((fwd, fb, res.expect("at least one run")))
}

/// Attention composed from numr ops: `softmax(scale · q kᵀ + bias) v`, with
/// `bias` a precomputed `[S, S]` tensor of `0` / `-inf` for causal.
struct Composed<'a, R: BenchRuntime> {
    client: &'a R::Client,
    scale: f64,
    bias: Option<Tensor<R>>,
}

impl<'a, R: BenchRuntime> Composed<'a, R> {
    fn new(
        client: &'a R::Client,
        device: &R::Device,
        kind: Kind,
        seq: usize,
        dim: usize,
    ) -> BoxResult<Self> {
        let bias = match kind {
            Kind::Full => None,
            Kind::Causal => {
                let data: Vec<f32> = (0..seq * seq)
                    .map(|ij| {
                        if ij % seq <= ij / seq {
                            0.0
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                    .collect();
                Some(Tensor::<R>::from_slice(&data, &[seq, seq], device)?)
            }
        };
        Ok(Composed {
            client,
            scale: 1.0 / (dim as f64).sqrt(),
            bias,
        })
    }

    fn forward(&self, x: &Inputs<R>) -> BoxResult<Tensor<R>> {
        let c = self.client;
        let kt = x.k.t()?;
        let scores = c.mul_scalar(&c.matmul(&x.q, &kt)?, self.scale)?;
        let scores = match &self.bias {
            Some(bias) => c.add(&scores, bias)?,
            None => scores,
        };
        let p = c.softmax(&scores, -1)?;
        let out = c.matmul(&p, &x.v)?;
        c.synchronize();
        Ok(out)
    }

    fn forward_backward(&self, x: &Inputs<R>) -> BoxResult<Results<R>> {
        let c = self.client;
        let (q, k, v) = (
            Var::new(x.q.clone(), true),
            Var::new(x.k.clone(), true),
            Var::new(x.v.clone(), true),
        );
        let dout = Var::new(x.dout.clone(), false);
        let scores = var_mul_scalar(&var_matmul(&q, &var_transpose(&k)?, c)?, self.scale, c)?;
        let scores = match &self.bias {
            Some(bias) => var_add(&scores, &Var::new(bias.clone(), false), c)?,
            None => scores,
        };
        let p = var_softmax(&scores, -1, c)?;
        let out = var_matmul(&p, &v, c)?;
        let l = loss(&out, &dout, c)?;
        collect(&out, &l, [&q, &k, &v], c)
    }
}

/// How many timed runs a measurement makes.
#[derive(Clone, Copy, Debug)]
struct Reps {
    n: usize,
    /// Set by `BOOSTR_BENCH_REPS`: exactly `n`, however slow.
    exact: bool,
}

/// Timed runs of one measurement beyond which slow runs are cut...
const MEASURE_BUDGET: Duration = Duration::from_secs(10);
/// ...down to no fewer than this many.
const MIN_REPS: usize = 3;
/// A warm-up run longer than this counts as a timed run.
const WARM_UP_COUNTS: Duration = Duration::from_secs(1);

/// Median of `reps` timed runs of `f`, after one warm-up run. The warm-up
/// decides whether slow runs are cut to fit [`MEASURE_BUDGET`], and a warm-up
/// of over [`WARM_UP_COUNTS`] is itself the first timed run (warming up matters
/// at the millisecond scale, not the second).
fn median_time(reps: Reps, mut f: impl FnMut() -> BoxResult<()>) -> BoxResult<Duration> {
    let warm = Instant::now();
    f()?;
    let warm = warm.elapsed();
    let n = if reps.exact {
        reps.n
    } else {
        let fit = (MEASURE_BUDGET.as_secs_f64() / warm.as_secs_f64().max(1e-9)) as usize;
        reps.n.min(fit.max(MIN_REPS))
    };
    let mut times = Vec::with_capacity(n);
    if warm > WARM_UP_COUNTS {
        times.push(warm);
    }
    while times.len() < n {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed());
    }
    times.sort();
    Ok(times[times.len() / 2])
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(&x, &y)| f64::from((x - y).abs()))
        .fold(0.0, |m, d| {
            if d.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.max(d)
            }
        })
}

fn print_header() {
    println!(
        "{:<7} {:>5} {:>4} | {:>24} {:>24} {:>8} | {:>24} {:>24} {:>8} | {:>8}",
        "variant",
        "S",
        "D",
        "fused fwd",
        "composed fwd",
        "speedup",
        "fused fwd+bwd",
        "composed fwd+bwd",
        "speedup",
        "max|Δ|"
    );
    println!(
        "{}",
        "-".repeat(7 + 6 + 5 + 3 + 24 * 2 + 2 + 9 + 3 + 24 * 2 + 2 + 9 + 3 + 8)
    );
}

fn cell(t: Option<Duration>, flops: f64, skipped: bool) -> String {
    match t {
        Some(t) => {
            let s = t.as_secs_f64();
            format!("{:>9.2} ms {:>6.1} GF/s", s * 1e3, flops / s / 1e9)
        }
        None if skipped => "skipped".to_string(),
        None => "-".to_string(),
    }
}

fn speedup(fused: Duration, composed: Option<Duration>) -> String {
    match composed {
        Some(c) => format!("{:.2}x", c.as_secs_f64() / fused.as_secs_f64()),
        None => "-".to_string(),
    }
}

fn print_row(r: &Row) {
    let fwd_flops =
        4.0 * (BATCH * HEADS) as f64 * (r.seq * r.seq * r.dim) as f64 * r.kind.visible(r.seq);
    let fb_flops = 3.5 * fwd_flops;
    let diff = match r.max_diff {
        Some(d) => format!("{d:.1e}"),
        None => "-".to_string(),
    };
    println!(
        "{:<7} {:>5} {:>4} | {:>24} {:>24} {:>8} | {:>24} {:>24} {:>8} | {:>8}",
        r.kind.name(),
        r.seq,
        r.dim,
        cell(Some(r.fused_fwd), fwd_flops, false),
        cell(r.composed_fwd, fwd_flops, false),
        speedup(r.fused_fwd, r.composed_fwd),
        cell(Some(r.fused_fb), fb_flops, false),
        cell(r.composed_fb, fb_flops, r.composed_fb_skipped),
        speedup(r.fused_fb, r.composed_fb),
        diff
    );
}

/// A tensor's elements in row-major order (autograd may return strided views).
fn host<R: Runtime>(t: &Tensor<R>) -> BoxResult<Vec<f32>> {
    Ok(t.contiguous()?.to_vec::<f32>())
}

/// User + system CPU time of this process so far (Linux: `/proc/self/stat`,
/// assuming the usual 100 ticks per second); `None` elsewhere.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 here.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}
