//! Forward + backward with learnable tensors on the CPU, timed against the
//! same variant with the tensors read-only, in one run:
//!
//! - T5's causal relative position bias (`stock::CausalT5Bias`): the
//!   `[Hq, 32]` bucket table as a `Var` that requires grad (its gradient
//!   computed by the same fused backward) against a `Var` that does not;
//! - gpt-oss attention (`stock::CausalSlidingWindowSinks`) with learnable
//!   sinks, against the same window without a sink (`CausalSlidingWindow`).
//!
//! ```text
//! cargo run --release -p boostr-runtime --example learnable [-- S [reps]]
//! ```
//!
//! Prints the median time of each (interleaved runs), their ratio, and the
//! process's peak resident memory. `bench/learnable.py` times PyTorch on
//! the same shapes.

use boostr_runtime::stock::{CausalSlidingWindow, CausalSlidingWindowSinks, CausalT5Bias};
use boostr_runtime::testing::Rng;
use boostr_runtime::{AttentionOptions, Backward, Keys, Variant, attention, attention_backward};
use numr::autograd::Var;
use numr::prelude::{CpuDevice, CpuRuntime, Tensor};
use std::time::Instant;

const HQ: usize = 8;
const D: usize = 128;
const WINDOW: i32 = 128;

mod common;

const USAGE: &str = "usage: learnable [<seq> <reps>] (defaults 4096 5)";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = common::Args::parse(USAGE, &["seq", "reps"]);
    let s: usize = args.get(0, "seq", 4096);
    let reps: usize = args.get(1, "reps", 5);
    let device = CpuDevice::new();
    let mut rng = Rng::new(17, 0);
    let mut tensor = |shape: &[usize], std: f32| -> Tensor<CpuRuntime> {
        let n = shape.iter().product();
        let values = rng.normal_f32(n, std);
        Tensor::from_slice(&values, shape, &device).expect("a host tensor")
    };
    let shape = [1, HQ, s, D];
    let (q, k, v, dout) = (
        tensor(&shape, 1.0),
        tensor(&shape, 1.0),
        tensor(&shape, 1.0),
        tensor(&shape, 1.0),
    );
    let table = tensor(&[HQ, 32], 0.5);
    let sinks = tensor(&[HQ], 1.0);
    println!(
        "CPU forward + backward, B = 1, Hq = Hkv = {HQ}, S = {s}, D = {D}, f32, {} threads, \
         median of {reps}",
        rayon::current_num_threads()
    );

    let learnable = CausalT5Bias {
        buckets: Var::new(table.clone(), true),
    };
    let read_only = CausalT5Bias {
        buckets: Var::new(table, false),
    };
    let (t_learn, t_read) = interleaved(
        reps,
        &mut [
            &mut || step(&learnable, [&q, &k, &v, &dout], true),
            &mut || step(&read_only, [&q, &k, &v, &dout], false),
        ],
    )?;
    report(
        "causal T5 bias",
        "learnable table",
        t_learn,
        "read-only table",
        t_read,
    );

    let with_sinks = CausalSlidingWindowSinks {
        window: WINDOW,
        sinks: Var::new(sinks, true),
    };
    let without = CausalSlidingWindow { window: WINDOW };
    let (t_sink, t_none) = interleaved(
        reps,
        &mut [
            &mut || step(&with_sinks, [&q, &k, &v, &dout], true),
            &mut || step(&without, [&q, &k, &v, &dout], false),
        ],
    )?;
    report(
        &format!("causal window {WINDOW}"),
        "learnable sinks",
        t_sink,
        "no sink",
        t_none,
    );
    println!("peak resident memory: {} MiB", peak_rss_mib());
    Ok(())
}

type Step<'a> = &'a mut dyn FnMut() -> Result<(), boostr_runtime::Error>;

/// Median seconds of each step, run in turn `reps` times after a warm-up.
fn interleaved(
    reps: usize,
    steps: &mut [Step<'_>; 2],
) -> Result<(f64, f64), boostr_runtime::Error> {
    let mut times = [Vec::new(), Vec::new()];
    for rep in 0..=reps {
        for (i, step) in steps.iter_mut().enumerate() {
            let start = Instant::now();
            step()?;
            if rep > 0 {
                times[i].push(start.elapsed().as_secs_f64());
            }
        }
    }
    let median = |t: &mut Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    Ok((median(&mut times[0]), median(&mut times[1])))
}

/// One forward and backward; `tensors`: whether the variant's learnable
/// tensors require grad (their gradients then come from the same backward).
fn step<V: Variant>(
    variant: &V,
    [q, k, v, dout]: [&Tensor<CpuRuntime>; 4],
    tensors: bool,
) -> Result<(), boostr_runtime::Error> {
    let opts = AttentionOptions::default();
    let y = attention(variant, q, Keys::dense(k, v), &opts)?;
    // The backward computes the gradient of every learnable tensor whose
    // `Var` requires grad, and of no other.
    let g = attention_backward(
        variant,
        q,
        Keys::dense(k, v),
        Backward::new(&y, dout),
        &opts,
    )?;
    assert!(g.tensors.iter().all(|t| t.is_some() == tensors));
    Ok(())
}

fn report(what: &str, a: &str, ta: f64, b: &str, tb: f64) {
    println!(
        "{what}: {a} {:.1} ms, {b} {:.1} ms, ratio {:.3}",
        ta * 1e3,
        tb * 1e3,
        ta / tb
    );
}

/// `VmHWM` of `/proc/self/status` (0 where unavailable).
fn peak_rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb / 1024)
}
