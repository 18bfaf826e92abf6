//! What dropout and sigmoid normalisation cost on the CPU, against causal
//! softmax attention.
//!
//! ```text
//! cargo run --release -p boostr-runtime --example dropout [-- reps [S] [f32] [bf16]]
//! ```
//!
//! Causal, `B = 1`, `Hq = Hkv = 4`, `D = 128`, `S = 4096` (or the `S`
//! given), f32 and bf16, forward and backward on every core (rayon's pool,
//! bound to the CPUs). Each repetition runs, in turn: `CausalDropout` at
//! `p = 0` (no draw), at `p = 0.1`, `Causal` (plain softmax) and
//! `CausalSigmoid`, so that a slow spell of the machine touches all of
//! them; `reps` (default 5) repetitions after one to warm up. Printed:
//! medians, and each one's time over its baseline (dropout over `p = 0`,
//! sigmoid over softmax: the same visible pairs, so the ratio is the
//! per-pair speed), of the medians and of the fastest runs.

use boostr_runtime::stock::{Causal, CausalDropout, CausalSigmoid};
use boostr_runtime::testing::Rng;
use boostr_runtime::{AttentionOptions, Backward, Keys, Variant, attention, attention_backward};
use numr::dtype::DType;
use numr::prelude::{CpuDevice, CpuRuntime, Tensor};
use std::time::{Duration, Instant};

const H: usize = 4;
const D: usize = 128;

type T = Tensor<CpuRuntime>;
type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> BoxResult<()> {
    let mut args = std::env::args().skip(1);
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let rest: Vec<String> = args.collect();
    let s: usize = rest.iter().find_map(|a| a.parse().ok()).unwrap_or(4096);
    let mut dtypes: Vec<DType> = rest
        .iter()
        .filter_map(|a| match a.as_str() {
            "f32" => Some(DType::F32),
            "bf16" => Some(DType::BF16),
            _ => None,
        })
        .collect();
    if dtypes.is_empty() {
        dtypes = vec![DType::F32, DType::BF16];
    }
    let threads = boostr_runtime::cpu::pin_threads(None)?;
    println!(
        "causal, B = 1, Hq = Hkv = {H}, S = {s}, D = {D}, {threads} threads, medians of {reps}"
    );
    println!(
        "{:>5} {:>16} {:>4} {:>9} {:>12} {:>9} {:>9}",
        "dtype", "variant", "pass", "ms", "baseline", "over", "of mins"
    );
    let opts = AttentionOptions::default().with_dropout(0x5EED, 0);
    for dtype in dtypes {
        let x = Inputs::new(s, dtype)?;
        // [p = 0, p = 0.1, softmax, sigmoid] × reps, each (fwd, bwd).
        let mut runs: [Vec<(Duration, Duration)>; 4] = Default::default();
        for rep in 0..=reps {
            let these = [
                time(&CausalDropout { p: 0.0 }, &x, &opts)?,
                time(&CausalDropout { p: 0.1 }, &x, &opts)?,
                time(&Causal, &x, &opts)?,
                time(&CausalSigmoid { bias: -8.0 }, &x, &opts)?,
            ];
            if rep > 0 {
                for (r, t) in runs.iter_mut().zip(these) {
                    r.push(t);
                }
            }
        }
        let names = [
            "dropout p=0",
            "dropout p=0.1",
            "causal softmax",
            "causal sigmoid",
        ];
        // Each row's baseline: p = 0 for the dropouts, softmax for sigmoid.
        let baseline = [0, 0, 2, 2];
        let passes: [Pass; 3] = [("fwd", |t| t.0), ("bwd", |t| t.1), ("f+b", |t| t.0 + t.1)];
        for (i, name) in names.iter().enumerate() {
            for (pass, of) in passes {
                let med = |k: usize| median(runs[k].iter().map(of).collect());
                let min = |k: usize| runs[k].iter().map(of).min().unwrap_or_default();
                let ratio =
                    |a: Duration, b: Duration| (a.as_secs_f64() / b.as_secs_f64() - 1.0) * 100.0;
                println!(
                    "{:>5} {name:>16} {pass:>4} {:>9.1} {:>12} {:>8.1}% {:>8.1}%",
                    format!("{dtype:?}").to_lowercase(),
                    med(i).as_secs_f64() * 1e3,
                    names[baseline[i]],
                    ratio(med(i), med(baseline[i])),
                    ratio(min(i), min(baseline[i])),
                );
            }
        }
    }
    Ok(())
}

/// A pass's name, and its time in a run's (forward, backward).
type Pass = (&'static str, fn(&(Duration, Duration)) -> Duration);

/// q, k, v and dout of one run.
struct Inputs {
    q: T,
    k: T,
    v: T,
    dout: T,
}

impl Inputs {
    fn new(s: usize, dtype: DType) -> BoxResult<Self> {
        let device = CpuDevice::new();
        let mut rng = Rng::new(7, s as u64);
        let mut draw = || -> BoxResult<T> {
            let t = T::from_slice(&rng.normal_f32(H * s * D, 1.0), &[1, H, s, D], &device)?;
            Ok(t.to_dtype(dtype)?)
        };
        Ok(Self {
            q: draw()?,
            k: draw()?,
            v: draw()?,
            dout: draw()?,
        })
    }
}

/// The forward's and the backward's times of one call of `variant`.
fn time<V: Variant>(
    variant: &V,
    x: &Inputs,
    opts: &AttentionOptions,
) -> BoxResult<(Duration, Duration)> {
    let t0 = Instant::now();
    let keys = Keys::dense(&x.k, &x.v);
    let y = attention(variant, &x.q, keys, opts)?;
    let fwd = t0.elapsed();
    let t1 = Instant::now();
    let grads = attention_backward(variant, &x.q, keys, Backward::new(&y, &x.dout), opts)?;
    let bwd = t1.elapsed();
    drop(grads);
    Ok((fwd, bwd))
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs.get(xs.len() / 2).copied().unwrap_or_default()
}
