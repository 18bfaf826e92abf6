//! One call for a batch that mixes decodes and a chunk of prefill
//! (`Keys::paged_packed`), against the same work as two calls (the decodes
//! as one paged decode, the chunk as one paged prefill), over the same
//! pages. Checked equal, then both timed (median of the runs).
//!
//! ```text
//! cargo run --release -p boostr-runtime --example mixed_batch [-- <decodes> <chunk> <context> <runs>]
//! ```
//!
//! Defaults: 8 decodes and one chunk of 512 rows, every sequence over a
//! 4,096-token context (the chunk's last 512 of them); 32 query heads, 8
//! KV heads, D = 128, f32, pages of 16, causal.

use boostr_runtime::stock::Causal;
use boostr_runtime::testing::Rng;
use boostr_runtime::{AttentionOptions, Keys, attention};
use numr::runtime::cpu::{CpuDevice, CpuRuntime};
use numr::tensor::Tensor;
use std::time::Instant;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;
type T = Tensor<CpuRuntime>;

const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;
const PAGE: usize = 16;

mod common;
use common::{Args, median};

const USAGE: &str =
    "usage: mixed_batch [<decodes> <chunk> <context> <runs>] (defaults 8 512 4096 7)";

fn main() -> Result<()> {
    let args = Args::parse(USAGE, &["decodes", "chunk", "context", "runs"]);
    let (decodes, chunk, context, runs): (usize, usize, usize, usize) = (
        args.get(0, "decodes", 8),
        args.get(1, "chunk", 512),
        args.get(2, "context", 4096),
        args.get(3, "runs", 7),
    );
    if context % PAGE != 0 || chunk > context || decodes == 0 {
        return Err(format!(
            "the context fills whole pages of {PAGE} and holds the chunk; decodes ≥ 1"
        )
        .into());
    }
    let device = CpuDevice::new();
    let mut rng = Rng::new(11, 0);
    let n = decodes + 1;
    let per_seq = context / PAGE;
    let pages = n * per_seq;
    let mut tensor = |shape: &[usize]| -> Result<T> {
        let len = shape.iter().product();
        Ok(Tensor::from_slice(
            &rng.normal_f32(len, 1.0),
            shape,
            &device,
        )?)
    };
    let k = tensor(&[pages, HKV, PAGE, D])?;
    let v = tensor(&[pages, HKV, PAGE, D])?;
    // Sequence b's pages, interleaved across sequences as an allocator
    // hands them out.
    let table: Vec<i32> = (0..n * per_seq)
        .map(|e| ((e % per_seq) * n + e / per_seq) as i32)
        .collect();
    let i32s = |x: &[i32]| T::from_slice(x, &[x.len()], &device);
    let lengths = i32s(&vec![context as i32; n])?;
    let rows: Vec<usize> = (0..n)
        .map(|b| if b < decodes { 1 } else { chunk })
        .collect();
    let total: usize = rows.iter().sum();
    let cu: Vec<i32> = std::iter::once(0)
        .chain(rows.iter().scan(0, |s, &r| {
            *s += r as i32;
            Some(*s)
        }))
        .collect();
    let q = tensor(&[total, HQ, D])?;
    let opts = AttentionOptions::default();
    let table_all = T::from_slice(&table, &[n, per_seq], &device)?;
    let cu_q = i32s(&cu)?;
    let mixed = || {
        attention(
            &Causal,
            &q,
            Keys::paged_packed(&k, &v, &table_all, &lengths, &cu_q),
            &opts,
        )
    };
    // The two calls, each over its sequences' rows of the table.
    let table_dec = T::from_slice(&table[..decodes * per_seq], &[decodes, per_seq], &device)?;
    let table_chunk = T::from_slice(&table[decodes * per_seq..], &[1, per_seq], &device)?;
    let (len_dec, len_chunk) = (
        i32s(&vec![context as i32; decodes])?,
        i32s(&[context as i32])?,
    );
    // The decodes' rows as `[decodes, Hq, 1, D]`, the chunk's as `[1, Hq,
    // chunk, D]` (views of the packed rows).
    let q_dec = q.narrow(0, 0, decodes)?.unsqueeze(2)?;
    let q_chunk = q
        .narrow(0, decodes, chunk)?
        .permute(&[1, 0, 2])?
        .unsqueeze(0)?;
    let two_calls = |q_dec: &T, q_chunk: &T| -> boostr_runtime::Result<(T, T)> {
        let a = attention(
            &Causal,
            q_dec,
            Keys::paged(&k, &v, &table_dec, &len_dec),
            &opts,
        )?;
        let b = attention(
            &Causal,
            q_chunk,
            Keys::paged(&k, &v, &table_chunk, &len_chunk),
            &opts,
        )?;
        Ok((a.out, b.out))
    };
    // In their own layouts, made before the timing.
    let (q_dec_own, q_chunk_own) = (q_dec.contiguous()?, q_chunk.contiguous()?);
    let separate = || two_calls(&q_dec_own, &q_chunk_own);
    // The same outputs: the mixed call's rows against the two calls'.
    let one = mixed()?.out.to_vec::<f32>();
    let (dec, ch) = separate()?;
    let (dec, ch) = (dec.to_vec::<f32>(), ch.to_vec::<f32>());
    let mut worst = 0.0f32;
    for t in 0..total {
        for h in 0..HQ {
            let got = &one[(t * HQ + h) * D..][..D];
            let want = if t < decodes {
                &dec[(t * HQ + h) * D..][..D]
            } else {
                &ch[(h * chunk + t - decodes) * D..][..D]
            };
            for (a, b) in got.iter().zip(want) {
                worst = worst.max((a - b).abs());
            }
        }
    }
    println!(
        "{decodes} decodes + a chunk of {chunk}, each over {context} keys: Hq {HQ}, Hkv {HKV}, D {D}, f32, pages of {PAGE}"
    );
    println!("  largest difference between one call and two: {worst:.1e}");
    if worst > 1e-4 {
        return Err(format!("the mixed call differs from the separate calls by {worst}").into());
    }
    // Paired: each run times the three in turn, so that a slow stretch of
    // the machine falls on all of them; medians over the runs.
    // The two calls from and to the packed rows, as an engine that keeps
    // its batch packed runs them: the chunk's rows moved into `[1, Hq,
    // chunk, D]` and its output back.
    let packed_separate = || -> Result<()> {
        let (a, b) = two_calls(&q_dec, &q_chunk)?;
        let b = b.squeeze(Some(0)).permute(&[1, 0, 2])?;
        Tensor::cat(&[&a.squeeze(Some(2)), &b], 0)?;
        Ok(())
    };
    let contenders: [&dyn Fn() -> Result<()>; 3] =
        [&|| Ok(mixed().map(|_| ())?), &packed_separate, &|| {
            Ok(separate().map(|_| ())?)
        }];
    let mut times: Vec<Vec<f64>> = (0..3).map(|_| Vec::with_capacity(runs)).collect();
    for f in &contenders {
        f()?;
    }
    for _ in 0..runs {
        for (f, t) in contenders.iter().zip(&mut times) {
            let start = Instant::now();
            f()?;
            t.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    let [one_call, two_packed, two_calls] = [0, 1, 2].map(|i| median(&times[i]));
    println!("  one mixed call:                 {one_call:8.2} ms");
    println!(
        "  two calls, packed rows in/out:  {two_packed:8.2} ms  (one call at {:.2}×)",
        one_call / two_packed
    );
    println!(
        "  two calls, their own layouts:   {two_calls:8.2} ms  (one call at {:.2}×)",
        one_call / two_calls
    );
    Ok(())
}
