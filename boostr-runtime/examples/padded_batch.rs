//! A padded batch: sequences of different lengths in one KV cache, forward
//! and backward (`attention_fwd_cache`, `attention_bwd_cache`), checked
//! against each sequence run alone (`attention_fwd`, `attention_bwd`).
//!
//! ```text
//! cargo run --release -p boostr-runtime --example padded_batch [-- reps]
//! ```
//!
//! Shapes: `B = 4` with lengths 16, 37, 200, 256 in a cache of capacity
//! 256, `Hq = 8`, `Hkv = 2` (GQA), `D = 64`, `stock::Causal`, f32, one
//! block of `Sq = 16` query rows per sequence. The spare slots past each
//! length hold NaN: they are never read, and their `dk, dv` are exactly 0.
//! Prints the largest differences per sequence and the median time of
//! `reps` (default 5) padded forward + backward runs.

use boostr_runtime::stock::Causal;
use boostr_runtime::testing::Rng;
use boostr_runtime::{
    AttentionOptions, KvCache, attention_bwd, attention_bwd_cache, attention_fwd,
    attention_fwd_cache,
};
use numr::prelude::{CpuDevice, CpuRuntime, Tensor};
use std::time::Instant;

const LENGTHS: [usize; 4] = [16, 37, 200, 256];
const CAPACITY: usize = 256;
const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 64;
const SQ: usize = 16;
const TOL: f32 = 1e-4;

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> BoxResult<()> {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5)
        .max(1);
    let device = CpuDevice::new();
    let mut rng = Rng::new(29, 0);
    let b = LENGTHS.len();
    let (q_shape, kv_shape) = ([b, HQ, SQ, D], [b, HKV, CAPACITY, D]);
    let q = rng.normal_f32(b * HQ * SQ * D, 1.0);
    let dout = rng.normal_f32(b * HQ * SQ * D, 1.0);
    let (mut k, mut v) = (
        rng.normal_f32(b * HKV * CAPACITY * D, 1.0),
        rng.normal_f32(b * HKV * CAPACITY * D, 1.0),
    );
    // NaN in every slot past a sequence's length: never read.
    for (s, &len) in LENGTHS.iter().enumerate() {
        for h in 0..HKV {
            let row = (s * HKV + h) * CAPACITY;
            k[(row + len) * D..(row + CAPACITY) * D].fill(f32::NAN);
            v[(row + len) * D..(row + CAPACITY) * D].fill(f32::NAN);
        }
    }
    let t = |x: &[f32], shape: &[usize]| Tensor::<CpuRuntime>::from_slice(x, shape, &device);
    let (q, dout) = (t(&q, &q_shape)?, t(&dout, &q_shape)?);
    let (k, v) = (t(&k, &kv_shape)?, t(&v, &kv_shape)?);
    let lens: Vec<i32> = LENGTHS.iter().map(|&l| l as i32).collect();
    let lengths = Tensor::<CpuRuntime>::from_slice(&lens, &[b], &device)?;
    let cache = KvCache::new(&k, &v, &lengths);
    let opts = AttentionOptions::default();
    println!(
        "padded batch: lengths {LENGTHS:?}, capacity {CAPACITY}, Hq = {HQ}, Hkv = {HKV}, \
         D = {D}, Sq = {SQ}, causal, f32"
    );

    let (out, lse) = attention_fwd_cache(&Causal, &q, &cache, &opts)?;
    let (dq, dk, dv) = attention_bwd_cache(&Causal, &dout, &q, &cache, &out, &lse, &opts)?;

    // Query row i of sequence b sits at position i + lengths[b] − Sq: the
    // last Sq positions of each sequence, so alone it is a causal
    // bottom-right-aligned call on its own keys. Every length here is at
    // least Sq; a shorter one would put its first Sq − length rows before
    // position 0, where they see no key (out 0, lse -inf, zero gradients).
    let mut failed = Vec::new();
    for (s, &len) in LENGTHS.iter().enumerate() {
        let one = |x: &Tensor<CpuRuntime>| x.narrow(0, s, 1)?.contiguous();
        let keys =
            |x: &Tensor<CpuRuntime>, from, n| x.narrow(0, s, 1)?.narrow(2, from, n)?.contiguous();
        let (qs, douts, ks, vs) = (one(&q)?, one(&dout)?, keys(&k, 0, len)?, keys(&v, 0, len)?);
        let (o, l) = attention_fwd(&Causal, &qs, &ks, &vs, &opts)?;
        let (gq, gk, gv) = attention_bwd(&Causal, &douts, &qs, &ks, &vs, &o, &l, &opts)?;
        let d = [
            max_diff(&one(&out)?, &o),
            max_diff(&one(&dq)?, &gq),
            max_diff(&keys(&dk, 0, len)?, &gk),
            max_diff(&keys(&dv, 0, len)?, &gv),
        ];
        // dk, dv past the length must be exactly zero.
        let tail = |g| -> BoxResult<f32> {
            Ok(match CAPACITY - len {
                0 => 0.0,
                n => max_abs(keys(g, len, n)?.to_vec::<f32>()),
            })
        };
        let spare = max_abs([tail(&dk)?, tail(&dv)?]);
        println!(
            "seq {s} (length {len:3}): max |diff| out {:.1e}, dq {:.1e}, dk {:.1e}, dv {:.1e}; \
             max |dk, dv| past the length {spare:.1e}",
            d[0], d[1], d[2], d[3]
        );
        // A NaN anywhere in out, dq, dk or dv makes its difference NaN.
        if d.iter().any(|x| x.is_nan() || *x > TOL) || spare != 0.0 {
            failed.push(s);
        }
    }
    if !failed.is_empty() {
        let why = "differ from their own runs by more than the tolerance, are NaN, \
                   or have a nonzero dk, dv past their lengths";
        return Err(format!("sequences {failed:?} {why}").into());
    }

    let mut times = Vec::new();
    for rep in 0..=reps {
        let start = Instant::now();
        let (out, lse) = attention_fwd_cache(&Causal, &q, &cache, &opts)?;
        let grads = attention_bwd_cache(&Causal, &dout, &q, &cache, &out, &lse, &opts)?;
        std::hint::black_box(grads);
        if rep > 0 {
            times.push(start.elapsed().as_secs_f64()); // after a warm-up
        }
    }
    times.sort_by(f64::total_cmp);
    println!(
        "all match (tolerance {TOL}); padded forward + backward: {:.3} ms (median of {reps})",
        times[times.len() / 2] * 1e3
    );
    Ok(())
}

/// The largest absolute difference between two tensors of one shape.
fn max_diff(a: &Tensor<CpuRuntime>, b: &Tensor<CpuRuntime>) -> f32 {
    let (a, b) = (a.to_vec::<f32>(), b.to_vec::<f32>());
    max_abs(a.iter().zip(&b).map(|(x, y)| x - y))
}

/// The largest absolute value; NaN if any is NaN.
fn max_abs(x: impl IntoIterator<Item = f32>) -> f32 {
    let max = |m: f32, x: f32| if x.is_nan() || x > m { x } else { m };
    x.into_iter().map(f32::abs).fold(0.0, max)
}
