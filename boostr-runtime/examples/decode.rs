//! Decode on the CPU: one query row per head against long keys, timed as
//! effective bandwidth (bytes of K and V read ÷ time) against the machine's
//! memory copy bandwidth, measured in the same run.
//!
//! ```text
//! cargo run --release -p boostr-runtime --example decode [-- reps]
//! ```
//!
//! Shapes: `Hq = 32`, `Hkv = 8`, `D = 128`, f32, `stock::Causal`, for
//! (B, Sk) in (1, 4k), (1, 16k), (1, 64k), (8, 4k), (8, 16k). Copy
//! bandwidth: a 1 GiB buffer copied by all threads at once, bytes copied ÷
//! time. Medians of `reps` (default 7) runs. `bench/decode.py` runs this,
//! then PyTorch's SDPA on the same shapes.

use boostr_runtime::stock::Causal;
use boostr_runtime::testing::Rng;
use boostr_runtime::{AttentionOptions, attention_fwd};
use numr::prelude::{CpuDevice, CpuRuntime, Tensor};
use rayon::prelude::*;
use std::time::Instant;

const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;
const SHAPES: [(usize, usize); 5] = [(1, 4096), (1, 16384), (1, 65536), (8, 4096), (8, 16384)];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(7);
    let threads = rayon::current_num_threads();
    let copy = copy_bandwidth(reps);
    println!(
        "CPU decode, Sq = 1, Hq = {HQ}, Hkv = {HKV}, D = {D}, f32, causal, {threads} threads, \
         median of {reps}"
    );
    println!(
        "memory copy bandwidth: {:.1} GB/s (1 GiB, all threads)",
        copy / 1e9
    );
    let device = CpuDevice::new();
    let mut rng = Rng::new(23, 0);
    for (b, sk) in SHAPES {
        let mut tensor = |shape: &[usize]| -> Tensor<CpuRuntime> {
            let n = shape.iter().product();
            Tensor::from_slice(&rng.normal_f32(n, 1.0), shape, &device).expect("a host tensor")
        };
        let q = tensor(&[b, HQ, 1, D]);
        let k = tensor(&[b, HKV, sk, D]);
        let v = tensor(&[b, HKV, sk, D]);
        let opts = AttentionOptions::default();
        let mut times = Vec::with_capacity(reps);
        attention_fwd(&Causal, &q, &k, &v, &opts)?;
        for _ in 0..reps {
            let t = Instant::now();
            let (out, _) = attention_fwd(&Causal, &q, &k, &v, &opts)?;
            times.push(t.elapsed().as_secs_f64());
            std::hint::black_box(out);
        }
        let t = median(&mut times);
        let bytes = (2 * b * HKV * sk * D * 4) as f64;
        println!(
            "B = {b}, Sk = {sk}: {:.2} ms, {:.1} GB/s of K and V, {:.0}% of copy",
            t * 1e3,
            bytes / t / 1e9,
            100.0 * bytes / t / copy
        );
    }
    Ok(())
}

/// Bytes per second that all threads together copy, 1 GiB at a time.
fn copy_bandwidth(reps: usize) -> f64 {
    let n = 1 << 28;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let chunk = n / (4 * rayon::current_num_threads()).max(1);
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps + 1 {
        let t = Instant::now();
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        times.push(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    times.remove(0);
    (4 * n) as f64 / median(&mut times)
}

fn median(times: &mut [f64]) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
