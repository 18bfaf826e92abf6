//! Decode on the CPU: one query row per head against long keys, timed as
//! effective bandwidth (bytes of K and V read ÷ time) against the machine's
//! read bandwidth, measured in the same run between the decode runs.
//!
//! ```text
//! cargo run --release -p boostr-runtime --example decode [-- reps [mla]]
//! ```
//!
//! (`mla`: only the absorbed-MLA decode.)
//!
//! Shapes: `Hq = 32`, `Hkv = 8`, `D = 128`, `stock::Causal`, for (B, Sk) in
//! (1, 4k), (1, 16k), (1, 64k), (8, 4k), (8, 16k), with f32 tensors
//! (`Keys::dense`), then bf16, f16, fp8 E4M3 and int8 KV caches
//! (`Keys::cache`, every length full, bf16 queries against fp8 and int8
//! keys; read as stored, widened in registers; bandwidth counts their 2- and
//! 1-byte elements). Read bandwidth: a 1 GiB buffer read by
//! all threads at once, one such read before each decode run; each shape's
//! share is against the median of the reads taken with its runs. Then
//! DeepSeek-V3's absorbed decode (Hq = 16, Hkv = 1, D = 576, Dv = 512, V
//! the first 512 columns of K read in place; bf16 and fp8 E4M3 caches, Sk
//! 4k–32k) against the same read bandwidth. Then, at B = 8,
//! Sk = 16k, the f32 keys as a KV cache against pages of 64 and of 16 keys
//! in shuffled order (`Keys::paged`). Medians of `reps`
//! (default 7) runs, rayon's workers bound one per CPU. `bench/decode.py`
//! runs this, then PyTorch's SDPA on the same shapes.

use boostr_runtime::stock::Causal;
use boostr_runtime::testing::Rng;
use boostr_runtime::{AttentionOptions, Keys, KvScales, attention};
use numr::dtype::DType;
use numr::prelude::{CpuDevice, CpuRuntime, Tensor};
use rayon::prelude::*;
use std::time::Instant;

const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;
const SHAPES: [(usize, usize); 5] = [(1, 4096), (1, 16384), (1, 65536), (8, 4096), (8, 16384)];

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

mod common;

const USAGE: &str =
    "usage: decode [<reps> [mla]] (default 7 reps; mla: only the absorbed-MLA decode)";

fn main() -> BoxResult<()> {
    let args = common::Args::parse(USAGE, &["reps", "mla"]);
    let reps: usize = args.get(0, "reps", 7);
    let mla_only = match args.word(1) {
        None => false,
        Some("mla") => true,
        Some(other) => common::fail(USAGE, format!("<mla>: {other:?} is not `mla`")),
    };
    // One worker per CPU, each bound to its own: the runs are short, and
    // unbound workers woken together can share a CPU for a while.
    let threads = boostr_runtime::cpu::pin_threads(None)?;
    let reader = Reader::new();
    let device = CpuDevice::new();
    let mut rng = Rng::new(23, 0);
    if mla_only {
        return mla(&device, &mut rng, &reader, reps);
    }
    println!(
        "CPU decode, Sq = 1, Hq = {HQ}, Hkv = {HKV}, D = {D}, causal, {threads} threads (bound), \
         median of {reps}; read bandwidth: 1 GiB read by all threads before each run"
    );
    println!("| dtype | B | Sk | time | K/V bandwidth | read bandwidth | of read |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    // An fp8 or int8 cache's scale per kv head (its values are drawn 16 times
    // larger, see `tensor`).
    let scales = Tensor::<CpuRuntime>::from_slice(&[1.0f32 / 16.0; HKV], &[HKV], &device)?;
    for dtype in [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::FP8E4M3,
        DType::I8,
    ] {
        let quantised = matches!(dtype, DType::FP8E4M3 | DType::I8);
        for (b, sk) in SHAPES {
            let q_dtype = if quantised { DType::BF16 } else { dtype };
            let q = tensor(&mut rng, &[b, HQ, 1, D], q_dtype, &device)?;
            let k = tensor(&mut rng, &[b, HKV, sk, D], dtype, &device)?;
            let v = tensor(&mut rng, &[b, HKV, sk, D], dtype, &device)?;
            let lengths = Tensor::<CpuRuntime>::from_slice(&vec![sk as i32; b], &[b], &device)?;
            let opts = AttentionOptions::default();
            let mut cache = Keys::cache(&k, &v, &lengths);
            if quantised {
                let per_head = KvScales::PerHead {
                    k: &scales,
                    v: &scales,
                };
                cache = cache.with_scales(per_head);
            }
            let mut run = || {
                let keys = if dtype == DType::F32 {
                    Keys::dense(&k, &v)
                } else {
                    cache
                };
                let out = attention(&Causal, &q, keys, &opts);
                std::hint::black_box(out.expect("decode"));
            };
            let (t, read) = reader.time_between_reads(reps, &mut run);
            let bytes = (2 * b * HKV * sk * D * dtype.size_in_bytes()) as f64;
            println!(
                "| {dtype:?} | {b} | {sk} | {:.2} ms | {:.1} GB/s | {:.1} GB/s | {:.0}% |",
                t * 1e3,
                bytes / t / 1e9,
                read / 1e9,
                100.0 * bytes / t / read
            );
        }
    }
    mla(&device, &mut rng, &reader, reps)?;
    paged(&device, &mut rng, reps)?;
    Ok(())
}

/// DeepSeek-V3's absorbed decode: 16 query heads on one latent kv head,
/// keys of 576 (512 latent + 64 rotary), and values the first 512 columns
/// of the same latent cache (`k.narrow(3, 0, 512)`, read in place); a bf16
/// cache, and an fp8 E4M3 one with a scale per kv head. The bandwidth
/// counts the cache's bytes once (V lies inside K's rows).
fn mla(device: &CpuDevice, rng: &mut Rng, reader: &Reader, reps: usize) -> BoxResult<()> {
    let (hq, d, dv) = (16, 576, 512);
    println!(
        "\nabsorbed MLA decode, Sq = 1, Hq = {hq}, Hkv = 1, D = {d}, Dv = {dv} (V = K[.., :{dv}])"
    );
    println!("| cache | Sk | time | cache bandwidth | read bandwidth | of read |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    let scale = Tensor::<CpuRuntime>::from_slice(&[1.0f32 / 16.0], &[1], device)?;
    for (dtype, name) in [(DType::BF16, "bf16"), (DType::FP8E4M3, "fp8 e4m3")] {
        for sk in [4096, 16384, 32768] {
            let q = tensor(rng, &[1, hq, 1, d], DType::BF16, device)?;
            let latent = tensor(rng, &[1, 1, sk, d], dtype, device)?;
            let v = latent.narrow(3, 0, dv)?;
            let lengths = Tensor::<CpuRuntime>::from_slice(&[sk as i32], &[1], device)?;
            let mut cache = Keys::cache(&latent, &v, &lengths);
            if dtype == DType::FP8E4M3 {
                let per_head = KvScales::PerHead {
                    k: &scale,
                    v: &scale,
                };
                cache = cache.with_scales(per_head);
            }
            let opts = AttentionOptions::default();
            let (t, read) = reader.time_between_reads(reps, &mut || {
                std::hint::black_box(attention(&Causal, &q, cache, &opts).expect("mla"));
            });
            let bytes = (sk * d * dtype.size_in_bytes()) as f64;
            println!(
                "| {name} | {sk} | {:.2} ms | {:.1} GB/s | {:.1} GB/s | {:.0}% |",
                t * 1e3,
                bytes / t / 1e9,
                read / 1e9,
                100.0 * bytes / t / read
            );
        }
    }
    Ok(())
}

/// A tensor of normal values in `dtype` (f32, bf16, f16; fp8 E4M3 and int8
/// 16 times larger, against a scale of 1/16).
fn tensor(
    rng: &mut Rng,
    shape: &[usize],
    dtype: DType,
    device: &CpuDevice,
) -> BoxResult<Tensor<CpuRuntime>> {
    let x = rng.normal_f32(shape.iter().product(), 1.0);
    let bytes: Vec<u8> = match dtype {
        DType::BF16 => x
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        DType::F16 => x
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        // Against a scale of 1/16 (see `mla`).
        DType::FP8E4M3 => x
            .iter()
            .map(|&v| numr::dtype::FP8E4M3::from_f32(16.0 * v).0)
            .collect(),
        DType::I8 => x
            .iter()
            .map(|&v| (16.0 * v).round().clamp(-127.0, 127.0) as i8 as u8)
            .collect(),
        _ => return Ok(Tensor::from_slice(&x, shape, device)?),
    };
    Ok(Tensor::from_bytes(&bytes, shape, dtype, device)?)
}

/// The read-bandwidth probe: 1 GiB that all threads read at once.
struct Reader {
    buf: Vec<u32>,
}

impl Reader {
    fn new() -> Self {
        Self {
            buf: (0..1u32 << 28).collect(),
        }
    }

    /// Bytes per second of one read of the whole buffer.
    fn read(&self) -> f64 {
        let t = Instant::now();
        let x = self
            .buf
            .par_chunks(1 << 20)
            .map(|c| {
                // Sixteen independent lanes, so that the loads, not a
                // dependency chain, set the pace.
                let mut acc = [0u32; 16];
                for x in c.chunks_exact(16) {
                    for (a, &x) in acc.iter_mut().zip(x) {
                        *a ^= x;
                    }
                }
                acc.iter().fold(0, |a, &x| a ^ x)
            })
            .reduce(|| 0, |a, b| a ^ b);
        std::hint::black_box(x);
        (4 * self.buf.len()) as f64 / t.elapsed().as_secs_f64()
    }

    /// The median seconds of `reps` runs of `f` after one untimed, each
    /// after a read of the buffer (which also evicts the caches), and the
    /// median read bandwidth of those reads.
    fn time_between_reads(&self, reps: usize, f: &mut dyn FnMut()) -> (f64, f64) {
        f();
        let (mut times, mut reads) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
        for _ in 0..reps {
            reads.push(self.read());
            let t = Instant::now();
            f();
            times.push(t.elapsed().as_secs_f64());
        }
        (common::median(&times), common::median(&reads))
    }
}

/// The median seconds of `reps` runs of `f` after one untimed.
fn time(reps: usize, f: &mut dyn FnMut()) -> f64 {
    f();
    let times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    common::median(&times)
}

/// A full cache against the same keys in shuffled pages.
fn paged(device: &CpuDevice, rng: &mut Rng, reps: usize) -> BoxResult<()> {
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
    let cache = Keys::cache(&kt, &vt, &lengths);
    let contiguous = time(reps, &mut || {
        std::hint::black_box(attention(&Causal, &q, cache, &opts).expect("cache"));
    });
    println!(
        "B = {b}, Sk = {sk}, f32 KV cache: {:.2} ms",
        contiguous * 1e3
    );
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
        let keys = Keys::paged(&kp, &vp, &page_table, &lengths);
        let paged = time(reps, &mut || {
            std::hint::black_box(attention(&Causal, &q, keys, &opts).expect("paged"));
        });
        println!(
            "B = {b}, Sk = {sk}, pages of {ps} (shuffled): {:.2} ms, {:.3}× the KV cache",
            paged * 1e3,
            paged / contiguous
        );
    }
    Ok(())
}
