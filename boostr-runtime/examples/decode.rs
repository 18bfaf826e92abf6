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
//! time. Then, at B = 8, Sk = 16k, the same keys as a KV cache
//! (`attention_fwd_cache`, every length 16k) against pages of 64 and of 16
//! keys in shuffled order (`attention_fwd_paged`), and the same cache in
//! bf16 (read as stored, widened a key block at a time; bandwidth counts
//! its 2-byte elements). Medians of `reps`
//! (default 7) runs. `bench/decode.py` runs this, then PyTorch's SDPA on
//! the same shapes.

use boostr_runtime::stock::Causal;
use boostr_runtime::testing::Rng;
use boostr_runtime::{
    AttentionOptions, KvCache, PagedKvCache, attention_fwd, attention_fwd_cache,
    attention_fwd_paged,
};
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
    paged(&device, &mut rng, reps)?;
    bf16_cache(&device, &mut rng, reps, copy)?;
    Ok(())
}

/// The KV cache in bf16, every length full.
fn bf16_cache(
    device: &CpuDevice,
    rng: &mut Rng,
    reps: usize,
    copy: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    for (b, sk) in [(1usize, 65536usize), (8, 16384)] {
        let mut tensor = |shape: &[usize]| -> Result<Tensor<CpuRuntime>, numr::error::Error> {
            let n = shape.iter().product();
            let bytes: Vec<u8> = rng
                .normal_f32(n, 1.0)
                .into_iter()
                .flat_map(|x| half::bf16::from_f32(x).to_bits().to_le_bytes())
                .collect();
            Tensor::from_bytes(&bytes, shape, numr::dtype::DType::BF16, device)
        };
        let q = tensor(&[b, HQ, 1, D])?;
        let (k, v) = (tensor(&[b, HKV, sk, D])?, tensor(&[b, HKV, sk, D])?);
        let lengths = Tensor::<CpuRuntime>::from_slice(&vec![sk as i32; b], &[b], device)?;
        let cache = KvCache {
            k: &k,
            v: &v,
            lengths: &lengths,
        };
        let opts = AttentionOptions::default();
        let t = time(reps, &mut || {
            std::hint::black_box(attention_fwd_cache(&Causal, &q, &cache, &opts).expect("bf16"));
        });
        let bytes = (2 * b * HKV * sk * D * 2) as f64;
        println!(
            "B = {b}, Sk = {sk}, bf16 KV cache: {:.2} ms, {:.1} GB/s of K and V, {:.0}% of copy",
            t * 1e3,
            bytes / t / 1e9,
            100.0 * bytes / t / copy
        );
    }
    Ok(())
}

/// The median seconds of `reps` runs of `f` after one untimed.
fn time(reps: usize, f: &mut dyn FnMut()) -> f64 {
    f();
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    median(&mut times)
}

/// A full cache against the same keys in shuffled pages.
fn paged(device: &CpuDevice, rng: &mut Rng, reps: usize) -> Result<(), Box<dyn std::error::Error>> {
    let (b, sk) = (8, 16384);
    let q = rng.normal_f32(b * HQ * D, 1.0);
    let k = rng.normal_f32(b * HKV * sk * D, 1.0);
    let v = rng.normal_f32(b * HKV * sk * D, 1.0);
    let t = |x: &[f32], shape: &[usize]| Tensor::<CpuRuntime>::from_slice(x, shape, device);
    let ti = |x: &[i32], shape: &[usize]| Tensor::<CpuRuntime>::from_slice(x, shape, device);
    let q = t(&q, &[b, HQ, 1, D])?;
    let lengths = ti(&vec![sk as i32; b], &[b])?;
    let opts = AttentionOptions::default();
    let (kt, vt) = (t(&k, &[b, HKV, sk, D])?, t(&v, &[b, HKV, sk, D])?);
    let cache = KvCache {
        k: &kt,
        v: &vt,
        lengths: &lengths,
    };
    let contiguous = time(reps, &mut || {
        std::hint::black_box(attention_fwd_cache(&Causal, &q, &cache, &opts).expect("cache"));
    });
    println!("B = {b}, Sk = {sk}, KV cache: {:.2} ms", contiguous * 1e3);
    for ps in [64usize, 16] {
        let max_pages = sk / ps;
        let pages = b * max_pages;
        // Logical page n of the batch in physical page (n · 7919) mod pages.
        let place = |n: usize| n * 7919 % pages;
        let (mut kp, mut vp) = (vec![0.0f32; k.len()], vec![0.0f32; v.len()]);
        let mut table = vec![0i32; pages];
        for s in 0..b {
            for lp in 0..max_pages {
                let page = place(s * max_pages + lp);
                table[s * max_pages + lp] = page as i32;
                for h in 0..HKV {
                    let from = ((s * HKV + h) * sk + lp * ps) * D;
                    let to = (page * HKV + h) * ps * D;
                    kp[to..to + ps * D].copy_from_slice(&k[from..from + ps * D]);
                    vp[to..to + ps * D].copy_from_slice(&v[from..from + ps * D]);
                }
            }
        }
        let (kp, vp) = (t(&kp, &[pages, HKV, ps, D])?, t(&vp, &[pages, HKV, ps, D])?);
        let page_table = ti(&table, &[b, max_pages])?;
        let cache = PagedKvCache {
            k_pages: &kp,
            v_pages: &vp,
            page_table: &page_table,
            lengths: &lengths,
        };
        let paged = time(reps, &mut || {
            std::hint::black_box(attention_fwd_paged(&Causal, &q, &cache, &opts).expect("paged"));
        });
        println!(
            "B = {b}, Sk = {sk}, pages of {ps} (shuffled): {:.2} ms, {:.3}× the KV cache",
            paged * 1e3,
            paged / contiguous
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
