//! boostr in one file: declare an attention variant, look at what the compiler
//! made of it, run it forward and backward through numr autograd, check it
//! against the f64 reference, and time it.
//!
//! ```text
//! cargo run --release -p boostr-runtime --example quickstart [-- --explain]
//! ```
//!
//! It prints what the compiler derived in a few lines; `--explain` prints
//! every stage in full (the IR, the emitted Rust, the WGSL and CUDA
//! sections; the `explain` example does this for every stock variant).
//! Exits with status 1 if any result is further from the reference than the
//! tolerance.

use boostr_runtime::testing::{Rng, reference_backward, reference_forward};
use boostr_runtime::{
    AttentionOptions, HostVariant, Keys, Problem, Variant, attention, var_attention,
};
use numr::autograd::{Var, backward, var_mul, var_sum};
use numr::prelude::{CpuDevice, CpuRuntime, Runtime, Tensor};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Gemma 2 attention: causal, with the logits soft-capped by `cap * tanh(s / cap)`.
///
/// `s` is the scaled logit `q·k / sqrt(D)`; `q` and `kv` are the query's and
/// key's positions. The compiler derives d`score`/d`s` for the backward and a
/// tile classifier from the mask, so the kernels skip tiles above the diagonal.
#[attention(
    score = |s, _b, _h, _q, _kv| self.cap * tanh(s / self.cap),
    mask = |_b, _h, q, kv| kv <= q,
)]
#[derive(Clone, Debug)]
struct Gemma2 {
    cap: f32,
}

const B: usize = 1;
const HQ: usize = 8;
const HKV: usize = 2; // grouped-query attention: 4 query heads per kv head
const S: usize = 512;
const D: usize = 64;
/// Timed repetitions (the median is reported), after one warm-up run.
const REPS: usize = 5;

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("FAILED: results differ from the f64 reference beyond tolerance");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<bool, Box<dyn std::error::Error>> {
    let variant = Gemma2 { cap: 50.0 };

    // 1. What the compiler made: the derivative, the tile classifier, the
    //    targets (`--explain`: every stage in full).
    let stages = Gemma2::compiled();
    println!("declared: score = cap * tanh(s / cap), mask = kv <= q");
    if std::env::args().any(|a| a == "--explain") {
        println!("{}", stages.text);
    } else {
        print!("compiled: {}", stages.summary);
    }

    // 2. Inputs: q [B, Hq, S, D], k and v [B, Hkv, S, D], and an output gradient.
    let device = CpuDevice::new();
    let client = CpuRuntime::default_client(&device);
    let mut rng = Rng::new(0x5eed_b005, 0);
    let (q_shape, kv_shape) = ([B, HQ, S, D], [B, HKV, S, D]);
    let q = rng.normal_f32(B * HQ * S * D, 1.0);
    let k = rng.normal_f32(B * HKV * S * D, 1.0);
    let v = rng.normal_f32(B * HKV * S * D, 1.0);
    let dout = rng.normal_f32(B * HQ * S * D, 1.0);
    let tensor =
        |data: &[f32], shape: &[usize]| Tensor::<CpuRuntime>::from_slice(data, shape, &device);
    let qv = Var::new(tensor(&q, &q_shape)?, true);
    let kv = Var::new(tensor(&k, &kv_shape)?, true);
    let vv = Var::new(tensor(&v, &kv_shape)?, true);
    let doutv = Var::new(tensor(&dout, &q_shape)?, false);
    let opts = AttentionOptions::default();

    // 3. Forward as an autograd op, then backward of L = sum(out ∘ dout), so
    //    that dL/dout = dout. One warm-up run, then REPS timed runs.
    let mut fwd_times = Vec::new();
    let mut bwd_times = Vec::new();
    let mut result = None;
    for rep in 0..=REPS {
        let t0 = Instant::now();
        let out = var_attention(&variant, &qv, Keys::dense(&kv, &vv), &opts)?.out;
        let t1 = Instant::now();
        let loss = var_sum(
            &var_mul(&out, &doutv, &client)?,
            &[0, 1, 2, 3],
            false,
            &client,
        )?;
        let t2 = Instant::now();
        let grads = backward(&loss, &client)?;
        let t3 = Instant::now();
        if rep > 0 {
            fwd_times.push(t1 - t0);
            bwd_times.push(t3 - t2);
        }
        result = Some((out, grads));
    }
    let (out, grads) = result.expect("REPS >= 0");
    let grad = |var: &Var<CpuRuntime>| {
        grads
            .get(var.id())
            .map(|t| t.to_vec::<f32>())
            .ok_or("autograd produced no gradient")
    };
    let got = [
        ("out", out.tensor().to_vec::<f32>()),
        ("dq", grad(&qv)?),
        ("dk", grad(&kv)?),
        ("dv", grad(&vv)?),
    ];

    // 4. The f64 reference: naive attention over the variant's f64 closures.
    let problem = Problem::new(B, (HQ, HKV), (S, S), D);
    let wide = |x: &[f32]| x.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
    let (q64, k64, v64) = (wide(&q), wide(&k), wide(&v));
    let want_f = reference_forward(&variant, &problem, &q64, &k64, &v64);
    let want_g = reference_backward(&variant, &problem, &q64, &k64, &v64, &wide(&dout));
    let want = [&want_f.out, &want_g.dq, &want_g.dk, &want_g.dv];

    println!("accuracy against the f64 reference (B={B}, Hq={HQ}, Hkv={HKV}, S={S}, D={D}):");
    let mut ok = true;
    for ((name, got), want) in got.iter().zip(want) {
        let max_ref = want.iter().fold(0.0f64, |m, &w| m.max(w.abs()));
        let err = got
            .iter()
            .zip(want)
            .fold(0.0f64, |m, (&g, &w)| m.max((f64::from(g) - w).abs()));
        // f32 accumulation over S = 512 keys: a few ulps of the largest value.
        let tol = 1e-5 * (1.0 + max_ref);
        let verdict = if err <= tol { "ok" } else { "FAIL" };
        ok &= err <= tol; // also false for NaN
        println!(
            "  {name:<3}  max |err| {err:.2e}  (tolerance {tol:.2e}, max |ref| {max_ref:.2e})  {verdict}"
        );
    }

    // 5. Speed: flops of the visible (query, key) pairs only.
    let visible = (0..HQ)
        .map(|h| {
            (0..S)
                .map(|i| {
                    (0..S)
                        .filter(|&j| variant.mask(0, h as i32, i as i32, j as i32))
                        .count()
                })
                .sum::<usize>()
        })
        .sum::<usize>() as f64
        / (HQ * S * S) as f64;
    let fwd_flops = 4.0 * (B * HQ * S * S * D) as f64 * visible;
    let bwd_flops = 2.5 * fwd_flops;
    let (tf, tb) = (median(&mut fwd_times), median(&mut bwd_times));
    let peak = fma_peak();
    println!(
        "speed ({} threads, {visible:.3} of pairs visible, median of {REPS}{}):",
        rayon::current_num_threads(),
        peak.map_or(String::new(), |p| format!(
            "; FMA peak of these threads {p:.0} GFLOP/s"
        ))
    );
    for (name, t, flops) in [("forward", tf, fwd_flops), ("backward", tb, bwd_flops)] {
        let secs = t.as_secs_f64();
        let rate = flops / secs / 1e9;
        let share = peak.map_or(String::new(), |p| {
            format!("  {:3.0}% of peak", 100.0 * rate / p)
        });
        println!(
            "  {name:<8}  {:8.2} ms  {rate:7.1} GFLOP/s{share}",
            secs * 1e3
        );
    }
    Ok(ok)
}

/// The FMA peak of every rayon thread at once, in GFLOP/s (16-lane FMAs on
/// registers only, the ceiling of the f32 kernels); `None` without
/// AVX-512.
fn fma_peak() -> Option<f64> {
    const ITERS: usize = 2_000_000;
    let t = boostr_runtime::cpu::time_fma_peak_all(ITERS)?;
    Some((rayon::current_num_threads() * ITERS * 24 * 32) as f64 / t / 1e9)
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}
