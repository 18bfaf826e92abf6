//! CUDA benchmark of boostr's attention kernels: forward, and forward plus
//! backward (`attention` then `attention_backward`, the tensor ops, no
//! autograd), for the stock variants, after a correctness spot check of every
//! selected variant against the CPU backend.
//!
//! ```text
//! cargo run --release -p boostr-runtime --features cuda --example gpu_bench -- \
//!     [--variants causal,sliding_window,alibi,softcap] [--seqs 1024,4096] [--dims 64,128] \
//!     [--dtype bf16|f16|f32] [--batch 4] [--heads 16] [--warmup 3] [--reps 10] \
//!     [--no-check] [--check-only]
//! ```
//!
//! Timing: every rep is bracketed by a stream synchronize and timed with
//! `Instant`; the median over `--reps` reps after `--warmup` untimed ones (the
//! first of which compiles the kernels) is reported. FLOPs are counted over
//! the visible (query, key) pairs only: forward `4·B·H·D·pairs`, backward 2.5×
//! that, so forward+backward is `3.5 × 4·B·H·D·pairs`.
//!
//! Output: one JSON line per measurement as it completes, then a table:
//! `{"impl":"boostr","variant":..,"S":..,"D":..,"dtype":..,"fwd_ms":..,
//! "fwdbwd_ms":..,"fwd_tflops":..,"fwdbwd_tflops":..}`. Check results are
//! printed as `PASS`/`FAIL` lines; the exit status is non-zero on any failure
//! or error.
//!
//! Spot check: per variant, B=1, H=2, S=257, D=64, in bf16 and f32; random
//! inputs are rounded to the dtype on the device, the CPU backend runs the f32
//! kernels on the rounded values, and per tensor (`out, lse, dq, dk, dv`)
//! `max|cuda − cpu| ≤ tol · max|cpu|` with `tol = 2e-2` for bf16
//! (8-bit mantissa outputs and inputs to the backward) and `1e-4` for f32;
//! `lse` must be `-inf` exactly where the CPU's is.

use boostr_runtime::stock::{Alibi, Causal, CausalSlidingWindow, CausalSoftcap};
use boostr_runtime::{
    AttentionOptions, Backward, HostVariant, Keys, Variant, attention, attention_backward,
};
use numr::prelude::*;
use numr::runtime::cuda::{cuda_device, is_cuda_available};
use std::process::ExitCode;
use std::time::Instant;

type BoxResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const VARIANTS: &[&str] = &["causal", "sliding_window", "alibi", "softcap"];

#[derive(Debug)]
struct Args {
    variants: Vec<String>,
    seqs: Vec<usize>,
    dims: Vec<usize>,
    dtype: DType,
    batch: usize,
    heads: usize,
    warmup: usize,
    reps: usize,
    check: bool,
    bench: bool,
}

const USAGE: &str = "usage: gpu_bench [--variants causal,sliding_window,alibi,softcap] \
[--seqs 1024,4096] [--dims 64,128] [--dtype bf16|f16|f32] [--batch 4] [--heads 16] \
[--warmup 3] [--reps 10] [--no-check] [--check-only]";

fn list<T: std::str::FromStr>(flag: &str, s: &str) -> BoxResult<Vec<T>> {
    s.split(',')
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<T>()
                .map_err(|_| format!("{flag}: cannot parse `{x}`").into())
        })
        .collect()
}

fn parse_args() -> BoxResult<Args> {
    let mut a = Args {
        variants: VARIANTS.iter().map(|s| s.to_string()).collect(),
        seqs: vec![1024, 4096],
        dims: vec![64, 128],
        dtype: DType::BF16,
        batch: 4,
        heads: 16,
        warmup: 3,
        reps: 10,
        check: true,
        bench: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--variants" => a.variants = list(&flag, &value()?)?,
            "--seqs" => a.seqs = list(&flag, &value()?)?,
            "--dims" => a.dims = list(&flag, &value()?)?,
            "--dtype" => {
                a.dtype = match value()?.as_str() {
                    "bf16" => DType::BF16,
                    "f16" => DType::F16,
                    "f32" => DType::F32,
                    other => return Err(format!("--dtype: unknown `{other}`\n{USAGE}").into()),
                }
            }
            "--batch" => a.batch = value()?.parse()?,
            "--heads" => a.heads = value()?.parse()?,
            "--warmup" => a.warmup = value()?.parse()?,
            "--reps" => a.reps = value()?.parse()?,
            "--no-check" => a.check = false,
            "--check-only" => a.bench = false,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument `{other}`\n{USAGE}").into()),
        }
    }
    for v in &a.variants {
        if !VARIANTS.contains(&v.as_str()) {
            return Err(format!("unknown variant `{v}` (known: {})", VARIANTS.join(", ")).into());
        }
    }
    if a.reps == 0 {
        return Err("--reps must be at least 1".into());
    }
    Ok(a)
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}

/// Deterministic uniform values in [-1, 1) (xorshift64*).
fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
            ((r >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A random tensor of `shape` on the CUDA device, in `dtype`.
fn device_tensor(
    client: &CudaClient,
    device: &CudaDevice,
    shape: &[usize],
    dtype: DType,
    seed: u64,
) -> BoxResult<Tensor<CudaRuntime>> {
    let n = shape.iter().product();
    let t = Tensor::<CudaRuntime>::from_slice(&random(n, seed), shape, device)?;
    Ok(client.cast(&t, dtype)?)
}

fn to_f32(client: &CudaClient, t: &Tensor<CudaRuntime>) -> BoxResult<Vec<f32>> {
    Ok(client.cast(t, DType::F32)?.to_vec::<f32>())
}

/// Visible (query, key) pairs of one (batch, head) with `s` queries and keys.
fn visible_pairs<V: HostVariant>(variant: &V, s: usize) -> u64 {
    let s = s as i32;
    let mut n = 0u64;
    for q in 0..s {
        n += (0..s).filter(|&kv| variant.mask(0, 0, q, kv)).count() as u64;
    }
    n
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Median milliseconds of `f` over `reps` reps after `warmup` untimed ones,
/// each rep between two stream synchronizes.
fn time_ms(
    client: &CudaClient,
    warmup: usize,
    reps: usize,
    mut f: impl FnMut() -> BoxResult<()>,
) -> BoxResult<f64> {
    for _ in 0..warmup {
        f()?;
    }
    client.synchronize();
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        client.synchronize();
        let t0 = Instant::now();
        f()?;
        client.synchronize();
        samples.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    Ok(median(samples))
}

struct Row {
    variant: String,
    s: usize,
    d: usize,
    fwd_ms: f64,
    fwdbwd_ms: f64,
    fwd_tflops: f64,
    fwdbwd_tflops: f64,
}

impl Row {
    fn json(&self, dtype: &str) -> String {
        format!(
            "{{\"impl\":\"boostr\",\"variant\":\"{}\",\"S\":{},\"D\":{},\"dtype\":\"{dtype}\",\
             \"fwd_ms\":{:.4},\"fwdbwd_ms\":{:.4},\"fwd_tflops\":{:.3},\"fwdbwd_tflops\":{:.3}}}",
            self.variant,
            self.s,
            self.d,
            self.fwd_ms,
            self.fwdbwd_ms,
            self.fwd_tflops,
            self.fwdbwd_tflops
        )
    }
}

fn bench_variant<V: Variant + HostVariant>(
    name: &str,
    variant: &V,
    client: &CudaClient,
    args: &Args,
    s: usize,
    d: usize,
    inputs: &[Tensor<CudaRuntime>; 4],
) -> BoxResult<Row> {
    let [q, k, v, dout] = inputs;
    let opts = AttentionOptions::default();
    let keys = Keys::dense(k, v);
    let fwd_ms = time_ms(client, args.warmup, args.reps, || {
        attention(variant, q, keys, &opts)?;
        Ok(())
    })?;
    let fwdbwd_ms = time_ms(client, args.warmup, args.reps, || {
        let y = attention(variant, q, keys, &opts)?;
        attention_backward(variant, q, keys, Backward::new(&y, dout), &opts)?;
        Ok(())
    })?;
    let pairs = visible_pairs(variant, s) as f64;
    let fwd_flops = 4.0 * (args.batch * args.heads * d) as f64 * pairs;
    let fwdbwd_flops = 3.5 * fwd_flops;
    Ok(Row {
        variant: name.to_string(),
        s,
        d,
        fwd_ms,
        fwdbwd_ms,
        fwd_tflops: fwd_flops / (fwd_ms * 1e-3) / 1e12,
        fwdbwd_tflops: fwdbwd_flops / (fwdbwd_ms * 1e-3) / 1e12,
    })
}

/// `max|got − want| / max|want|` over finite `want`, or an error
/// message when the non-finite entries disagree.
fn rel_err(got: &[f32], want: &[f32]) -> std::result::Result<f64, String> {
    let mut worst = 0.0f64;
    let mut scale = 1e-6f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !w.is_finite() {
            if g != w {
                return Err(format!("element {i}: got {g}, want {w}"));
            }
            continue;
        }
        if !g.is_finite() {
            return Err(format!("element {i}: got {g}, want {w}"));
        }
        scale = scale.max(f64::from(w.abs()));
        worst = worst.max(f64::from((g - w).abs()));
    }
    Ok(worst / scale)
}

/// The spot check of `variant` in `dtype`; prints one PASS/FAIL line and
/// returns whether it passed.
fn check_variant<V: Variant + HostVariant>(
    name: &str,
    variant: &V,
    client: &CudaClient,
    device: &CudaDevice,
    dtype: DType,
) -> BoxResult<bool> {
    let shape = [1usize, 2, 257, 64];
    let tol = if dtype == DType::F32 { 1e-4 } else { 2e-2 };
    let opts = AttentionOptions::default();
    let mut gpu = Vec::new();
    for seed in 1..=4u64 {
        gpu.push(device_tensor(client, device, &shape, dtype, 1000 + seed)?);
    }
    let keys = Keys::dense(&gpu[1], &gpu[2]);
    let y = attention(variant, &gpu[0], keys, &opts)?;
    let g = attention_backward(variant, &gpu[0], keys, Backward::new(&y, &gpu[3]), &opts)?;
    let got = [&y.out, &y.lse, &g.dq, &g.dk, &g.dv]
        .into_iter()
        .map(|t| to_f32(client, t))
        .collect::<BoxResult<Vec<_>>>()?;

    // The same (rounded) inputs on the CPU, in f32.
    let cpu_device = CpuDevice::new();
    let cpu: Vec<Tensor<CpuRuntime>> = gpu
        .iter()
        .map(|t| -> BoxResult<_> {
            Ok(Tensor::<CpuRuntime>::from_slice(
                &to_f32(client, t)?,
                &shape,
                &cpu_device,
            )?)
        })
        .collect::<BoxResult<_>>()?;
    let keys = Keys::dense(&cpu[1], &cpu[2]);
    let c = attention(variant, &cpu[0], keys, &opts)?;
    let c_g = attention_backward(variant, &cpu[0], keys, Backward::new(&c, &cpu[3]), &opts)?;
    let want = [&c.out, &c.lse, &c_g.dq, &c_g.dk, &c_g.dv].map(|t| t.to_vec::<f32>());

    let mut ok = true;
    let mut parts = Vec::new();
    for ((tensor, g), w) in ["out", "lse", "dq", "dk", "dv"].iter().zip(&got).zip(&want) {
        match rel_err(g, w) {
            Ok(e) => {
                ok &= e <= tol;
                parts.push(format!("{tensor} {e:.2e}"));
            }
            Err(msg) => {
                ok = false;
                parts.push(format!("{tensor} {msg}"));
            }
        }
    }
    println!(
        "{} check {name} {} B=1 H=2 S=257 D=64 (tol {tol:.0e} of max|cpu|): {}",
        if ok { "PASS" } else { "FAIL" },
        dtype_name(dtype),
        parts.join(", ")
    );
    Ok(ok)
}

/// Calls `$body` with `$v` bound to the stock variant named `$name`.
macro_rules! with_variant {
    ($name:expr, |$v:ident| $body:expr) => {
        match $name {
            "causal" => {
                let $v = &Causal;
                $body
            }
            "sliding_window" => {
                let $v = &CausalSlidingWindow { window: 256 };
                $body
            }
            "alibi" => {
                let $v = &Alibi { heads: 16 };
                $body
            }
            "softcap" => {
                let $v = &CausalSoftcap { cap: 30.0 };
                $body
            }
            other => Err(format!("unknown variant `{other}`").into()),
        }
    };
}

fn run(args: &Args) -> BoxResult<bool> {
    // numr probes the driver under `catch_unwind`; keep the probe's panic
    // message out of the output, the error below says what is missing.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let available = is_cuda_available();
    std::panic::set_hook(hook);
    if !available {
        return Err(
            "no CUDA device: numr could not open device 0 (is there an NVIDIA GPU \
                    and driver, with libcuda on the loader path?)"
                .into(),
        );
    }
    let device = cuda_device();
    let client = CudaRuntime::default_client(&device);
    println!(
        "device: {} (compute capability {:?})",
        device.name(),
        device.compute_capability().ok()
    );
    let mut all_ok = true;

    if args.check {
        let dtypes = if args.dtype == DType::F32 {
            vec![DType::F32]
        } else {
            vec![args.dtype, DType::F32]
        };
        for name in &args.variants {
            for &dtype in &dtypes {
                let ok: BoxResult<bool> = with_variant!(name.as_str(), |v| check_variant(
                    name, v, &client, &device, dtype
                ));
                all_ok &= ok?;
            }
        }
    }

    if !args.bench {
        return Ok(all_ok);
    }
    let mut rows = Vec::new();
    for &s in &args.seqs {
        for &d in &args.dims {
            let shape = [args.batch, args.heads, s, d];
            let mut inputs = Vec::new();
            for seed in 1..=4u64 {
                inputs.push(device_tensor(
                    &client,
                    &device,
                    &shape,
                    args.dtype,
                    seed * 7919 + (s * d) as u64,
                )?);
            }
            let inputs: [Tensor<CudaRuntime>; 4] = inputs
                .try_into()
                .map_err(|_| "four inputs expected".to_string())?;
            for name in &args.variants {
                let row: BoxResult<Row> = with_variant!(name.as_str(), |v| bench_variant(
                    name, v, &client, args, s, d, &inputs
                ));
                let row = row.map_err(|e| format!("{name} S={s} D={d}: {e}"))?;
                eprintln!(
                    "boostr {} S={} D={}: fwd {:.3} ms, fwd+bwd {:.3} ms",
                    row.variant, row.s, row.d, row.fwd_ms, row.fwdbwd_ms
                );
                // The JSON line now, so that a run cut short keeps it.
                println!("{}", row.json(dtype_name(args.dtype)));
                rows.push(row);
            }
        }
    }

    let dt = dtype_name(args.dtype);
    println!(
        "\nboostr on CUDA, B={} H={} {dt}, median of {} reps after {} warm-up",
        args.batch, args.heads, args.reps, args.warmup
    );
    println!(
        "{:<16} {:>6} {:>5} {:>10} {:>10} {:>12} {:>12}",
        "variant", "S", "D", "fwd ms", "fwd TF/s", "fwd+bwd ms", "fwd+bwd TF/s"
    );
    for r in &rows {
        println!(
            "{:<16} {:>6} {:>5} {:>10.3} {:>10.1} {:>12.3} {:>12.1}",
            r.variant, r.s, r.d, r.fwd_ms, r.fwd_tflops, r.fwdbwd_ms, r.fwdbwd_tflops
        );
    }
    Ok(all_ok)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpu_bench: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("gpu_bench: a correctness check FAILED (see the FAIL lines)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("gpu_bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}
