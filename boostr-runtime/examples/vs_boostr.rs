//! Our CPU attention against boostr 0.10's `FlashAttentionOps` on the same
//! inputs: f32, causal and full, GQA (8 query heads, 2 KV heads), D = 128,
//! S from 1024 to 4096; the forward and forward + backward, their results
//! compared, the median of interleaved runs timed.
//!
//! ```text
//! cargo run --release -p boostr-runtime --features boostr --example vs_boostr [-- <runs> <seqs>]
//! ```
//!
//! `<runs>` (default 5) runs of each cell, ours and boostr's alternating;
//! `<seqs>` a comma-separated list (default `1024,2048,4096`). Prints a
//! Markdown table; exits non-zero when a result differs from boostr's by
//! more than 1e-4 (relative to its largest element).

use boostr::ops::{AttnOutLayout, FlashAttentionOps};
use boostr_runtime::stock::{Causal, Full};
use boostr_runtime::testing::Rng;
use boostr_runtime::{AttentionOptions, Backward, Keys, Variant, attention, attention_backward};
use numr::runtime::Runtime;
use numr::runtime::cpu::{CpuClient, CpuDevice, CpuRuntime};
use numr::tensor::Tensor;
use std::time::Instant;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;
type T = Tensor<CpuRuntime>;

const HEADS: usize = 8;
const KV_HEADS: usize = 2;
const D: usize = 128;
const TOLERANCE: f64 = 1e-4;

struct Inputs {
    q: T,
    k: T,
    v: T,
    dout: T,
}

/// Max |a − b| relative to max |b|.
fn rel_diff(a: &T, b: &T) -> Result<f64> {
    let (a, b) = (
        a.contiguous()?.to_vec::<f32>(),
        b.contiguous()?.to_vec::<f32>(),
    );
    let err = a
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| f64::from(y.abs())).fold(0.0, f64::max);
    Ok(err / scale.max(f64::MIN_POSITIVE))
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    x[x.len() / 2]
}

/// One cell: ours and boostr's forward (and backward), `runs` times each,
/// alternating. Returns the medians and the largest relative difference.
fn cell<V: Variant>(
    variant: &V,
    causal: bool,
    x: &Inputs,
    backward: bool,
    runs: usize,
    client: &CpuClient,
) -> Result<(f64, f64, f64)> {
    let opts = AttentionOptions::default();
    let keys = Keys::dense(&x.k, &x.v);
    let ours = || -> Result<Vec<T>> {
        let fwd = attention(variant, &x.q, keys, &opts)?;
        if !backward {
            return Ok(vec![fwd.out]);
        }
        let g = attention_backward(variant, &x.q, keys, Backward::new(&fwd, &x.dout), &opts)?;
        Ok(vec![fwd.out, g.dq, g.dk, g.dv])
    };
    let theirs = || -> Result<Vec<T>> {
        let (out, lse) = client.flash_attention_fwd(
            &x.q,
            &x.k,
            &x.v,
            HEADS,
            KV_HEADS,
            D,
            causal,
            0,
            None,
            None,
            AttnOutLayout::HeadMajor,
        )?;
        if !backward {
            return Ok(vec![out]);
        }
        let (dq, dk, dv) = client.flash_attention_bwd(
            &x.dout, &x.q, &x.k, &x.v, &out, &lse, HEADS, KV_HEADS, D, causal, 0,
        )?;
        Ok(vec![out, dq, dk, dv])
    };
    let (mut t_ours, mut t_theirs) = (Vec::new(), Vec::new());
    let mut worst: f64 = 0.0;
    for run in 0..runs {
        let started = Instant::now();
        let a = ours()?;
        t_ours.push(started.elapsed().as_secs_f64());
        let started = Instant::now();
        let b = theirs()?;
        t_theirs.push(started.elapsed().as_secs_f64());
        if run == 0 {
            for (a, b) in a.iter().zip(&b) {
                worst = worst.max(rel_diff(a, b)?);
            }
        }
    }
    Ok((median(t_ours), median(t_theirs), worst))
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let runs: usize = args.next().map_or(Ok(5), |a| a.parse())?;
    let seqs: Vec<usize> = match args.next() {
        Some(list) => list
            .split(',')
            .map(str::parse)
            .collect::<std::result::Result<_, _>>()?,
        None => vec![1024, 2048, 4096],
    };
    let device = CpuDevice::new();
    let client = CpuRuntime::default_client(&device);
    let mut rng = Rng::new(1, 0);
    let mut tensor = |h: usize, s: usize| -> Result<T> {
        Ok(Tensor::from_slice(
            &rng.normal_f32(h * s * D, 1.0),
            &[1, h, s, D],
            &device,
        )?)
    };
    println!(
        "f32, B = 1, {HEADS} query heads, {KV_HEADS} KV heads, D = {D}; median of {runs} runs"
    );
    println!();
    println!("| mask | S | pass | ours | boostr 0.10 | speedup | max rel. difference |");
    println!("|---|---|---|---|---|---|---|");
    let mut failed = false;
    for &s in &seqs {
        let x = Inputs {
            q: tensor(HEADS, s)?,
            k: tensor(KV_HEADS, s)?,
            v: tensor(KV_HEADS, s)?,
            dout: tensor(HEADS, s)?,
        };
        for causal in [true, false] {
            for backward in [false, true] {
                let (ours, theirs, diff) = if causal {
                    cell(&Causal, true, &x, backward, runs, &client)?
                } else {
                    cell(&Full, false, &x, backward, runs, &client)?
                };
                failed |= diff > TOLERANCE;
                println!(
                    "| {} | {s} | {} | {:.1} ms | {:.1} ms | {:.2}× | {diff:.1e} |",
                    if causal { "causal" } else { "full" },
                    if backward { "fwd+bwd" } else { "fwd" },
                    ours * 1e3,
                    theirs * 1e3,
                    theirs / ours
                );
            }
        }
    }
    if failed {
        return Err(format!("a result differs from boostr's by more than {TOLERANCE:e}").into());
    }
    Ok(())
}
