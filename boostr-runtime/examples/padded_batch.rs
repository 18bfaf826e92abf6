//! A right-padded batch, forward and backward: sequences of different
//! lengths padded to one length, as a training step batches them
//! (`Keys::padded`), checked against each sequence run alone.
//!
//! ```text
//! cargo run --release -p boostr-runtime --example padded_batch [-- reps]
//! ```
//!
//! `Keys::padded(&k, &v, &q_lengths, &kv_lengths)`: `q`, `k` and `v` are
//! padded to `S` rows, and sequence `b` has `q_lengths[b]` query rows and
//! `kv_lengths[b]` keys, each at the start of its rows. Query row `i` of
//! sequence `b` sits at position `i + kv_lengths[b] − q_lengths[b]`: with
//! as many queries as keys (a sequence attending to itself), row `i` is at
//! position `i`, so a causal mask is causal within each sequence. Rows past
//! a sequence's query length come out exactly 0, with lse `-inf` and zero
//! gradients; keys past its key length are never read, and get zero `dk,
//! dv`.
//!
//! `Keys::cache(&k, &v, &lengths)` is for decoding instead: there the query
//! rows are the *last* `Sq` positions of each sequence (row `i` at `i +
//! lengths[b] − Sq`), right for new tokens against a KV cache, but over a
//! padded batch it would put a shorter sequence's rows `Sq − length`
//! positions before their own.
//!
//! Shapes: `B = 4` sequences of (query rows, keys) (16, 16), (37, 37),
//! (200, 200) and (64, 256) (the last 64 positions of a sequence of 256,
//! after its context), padded to `S = 256`; `Hq = 8`, `Hkv = 2` (GQA),
//! `D = 64`, `stock::Causal`, f32. The keys past each length hold NaN.
//! Each sequence alone is `attention` and `attention_backward` over
//! `Keys::dense` of its own rows and keys (`narrow`ed out of the batch),
//! which aligns them alike. Prints the largest differences per sequence and
//! the median time of `reps` (default 5) padded forward + backward runs;
//! exits with an error if a difference is over the tolerance, or a padded
//! row or key is not exactly 0 (lse `-inf`).

use boostr_runtime::stock::Causal;
use boostr_runtime::testing::Rng;
use boostr_runtime::{AttentionOptions, Backward, Keys, attention, attention_backward};
use numr::prelude::{CpuDevice, CpuRuntime, Tensor};
use std::time::Instant;

/// Each sequence's query rows.
const Q_LENGTHS: [usize; 4] = [16, 37, 200, 64];
/// Each sequence's keys.
const KV_LENGTHS: [usize; 4] = [16, 37, 200, 256];
/// The padded length of queries and keys.
const S: usize = 256;
const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 64;
const TOL: f32 = 1e-4;

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

mod common;

const USAGE: &str = "usage: padded_batch [<reps>] (default 5)";

fn main() -> BoxResult<()> {
    let reps: usize = common::Args::parse(USAGE, &["reps"])
        .get(0, "reps", 5)
        .max(1);
    let device = CpuDevice::new();
    let mut rng = Rng::new(29, 0);
    let b = Q_LENGTHS.len();
    let (q_shape, kv_shape) = ([b, HQ, S, D], [b, HKV, S, D]);
    // The padded query rows hold values too: they reach no result.
    let q = rng.normal_f32(b * HQ * S * D, 1.0);
    let dout = rng.normal_f32(b * HQ * S * D, 1.0);
    let (mut k, mut v) = (
        rng.normal_f32(b * HKV * S * D, 1.0),
        rng.normal_f32(b * HKV * S * D, 1.0),
    );
    // NaN in every key past a sequence's length: never read.
    for (s, &len) in KV_LENGTHS.iter().enumerate() {
        for h in 0..HKV {
            let row = (s * HKV + h) * S;
            k[(row + len) * D..(row + S) * D].fill(f32::NAN);
            v[(row + len) * D..(row + S) * D].fill(f32::NAN);
        }
    }
    let t = |x: &[f32], shape: &[usize]| Tensor::<CpuRuntime>::from_slice(x, shape, &device);
    let (q, dout) = (t(&q, &q_shape)?, t(&dout, &q_shape)?);
    let (k, v) = (t(&k, &kv_shape)?, t(&v, &kv_shape)?);
    let lengths = |l: &[usize]| {
        let l: Vec<i32> = l.iter().map(|&l| l as i32).collect();
        Tensor::<CpuRuntime>::from_slice(&l, &[b], &device)
    };
    let (q_lengths, kv_lengths) = (lengths(&Q_LENGTHS)?, lengths(&KV_LENGTHS)?);
    let keys = Keys::padded(&k, &v, &q_lengths, &kv_lengths);
    let opts = AttentionOptions::default();
    println!(
        "padded batch: query rows {Q_LENGTHS:?}, keys {KV_LENGTHS:?}, padded to S = {S}, \
         Hq = {HQ}, Hkv = {HKV}, D = {D}, causal, f32"
    );

    let y = attention(&Causal, &q, keys, &opts)?;
    let g = attention_backward(&Causal, &q, keys, Backward::new(&y, &dout), &opts)?;

    let mut failed = Vec::new();
    for (s, (&q_len, &kv_len)) in Q_LENGTHS.iter().zip(&KV_LENGTHS).enumerate() {
        // Rows `from .. from + n` of sequence `s` (dim 2 is the sequence's
        // rows in q, k, v, their gradients and lse alike).
        let rows =
            |x: &Tensor<CpuRuntime>, from, n| x.narrow(0, s, 1)?.narrow(2, from, n)?.contiguous();
        let (qs, douts) = (rows(&q, 0, q_len)?, rows(&dout, 0, q_len)?);
        let (ks, vs) = (rows(&k, 0, kv_len)?, rows(&v, 0, kv_len)?);
        // Alone, its query rows are bottom-right aligned to its keys: row i
        // at position i + kv_len − q_len, as in the padded batch.
        let alone = Keys::dense(&ks, &vs);
        let want = attention(&Causal, &qs, alone, &opts)?;
        let want_g = attention_backward(&Causal, &qs, alone, Backward::new(&want, &douts), &opts)?;
        let d = [
            max_diff(&rows(&y.out, 0, q_len)?, &want.out),
            max_diff(&rows(&y.lse, 0, q_len)?, &want.lse),
            max_diff(&rows(&g.dq, 0, q_len)?, &want_g.dq),
            max_diff(&rows(&g.dk, 0, kv_len)?, &want_g.dk),
            max_diff(&rows(&g.dv, 0, kv_len)?, &want_g.dv),
        ];
        // Past the lengths: out and dq rows, dk and dv keys exactly 0, lse
        // -inf.
        let past = |x, len| -> BoxResult<Vec<f32>> {
            Ok(match S - len {
                0 => Vec::new(),
                n => rows(x, len, n)?.to_vec(),
            })
        };
        let zeros = [
            past(&y.out, q_len)?,
            past(&g.dq, q_len)?,
            past(&g.dk, kv_len)?,
            past(&g.dv, kv_len)?,
        ];
        let padding_exact = zeros.iter().flatten().all(|&x| x == 0.0)
            && past(&y.lse, q_len)?.iter().all(|&x| x == f32::NEG_INFINITY);
        println!(
            "seq {s} ({q_len:3} rows, {kv_len:3} keys): max |diff| out {:.1e}, lse {:.1e}, \
             dq {:.1e}, dk {:.1e}, dv {:.1e}; past the lengths {}",
            d[0],
            d[1],
            d[2],
            d[3],
            d[4],
            if padding_exact {
                "exactly 0 (lse -inf)"
            } else {
                "NOT 0"
            }
        );
        // A NaN anywhere in out, lse, dq, dk or dv makes its difference NaN.
        if d.iter().any(|x| x.is_nan() || *x > TOL) || !padding_exact {
            failed.push(s);
        }
    }
    if !failed.is_empty() {
        let why = "differ from their own runs by more than the tolerance, are NaN, \
                   or have a nonzero out, dq, dk or dv (or a finite lse) past their lengths";
        return Err(format!("sequences {failed:?} {why}").into());
    }

    let mut times = Vec::new();
    for rep in 0..=reps {
        let start = Instant::now();
        let y = attention(&Causal, &q, keys, &opts)?;
        let grads = attention_backward(&Causal, &q, keys, Backward::new(&y, &dout), &opts)?;
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
