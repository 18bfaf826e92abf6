//! Decode on wgpu: the split-KV forward against the unsplit kernel on the
//! same inputs, in one run, on numr's default wgpu adapter (Mesa's lavapipe
//! on a machine without a GPU).
//!
//! ```text
//! cargo run --release -p boostr-runtime --features wgpu --example wgpu_decode [-- reps]
//! ```
//!
//! Shapes: `Sq = 1`, `Hq = 8`, `D = 64`, f32, `stock::Causal`, over a KV
//! cache whose every sequence is full, for (B, Hkv, Sk) in (1, 1, 2k),
//! (1, 1, 8k), (1, 2, 8k), (4, 2, 2k). Each call is timed from the launch to its output read
//! back on the host; medians of `reps` (default 5) calls after one warm-up.
//! The split count is what `attention` over `Keys::cache` chooses for the
//! shape on this adapter.

use boostr_runtime::stock::Causal;
use boostr_runtime::testing::{Rng, wgpu_forward_in_splits, wgpu_forward_splits};
use boostr_runtime::{AttentionOptions, Keys, attention};
use numr::runtime::Runtime;
use numr::runtime::wgpu::{WgpuRuntime, is_wgpu_available, wgpu_device};
use numr::tensor::Tensor;
use std::time::Instant;

const HQ: usize = 8;
const D: usize = 64;
/// (B, Hkv, Sk).
const SHAPES: [(usize, usize, usize); 4] = [(1, 1, 2048), (1, 1, 8192), (1, 2, 8192), (4, 2, 2048)];

mod common;

const USAGE: &str = "usage: wgpu_decode [<reps>] (default 5)";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let reps: usize = common::Args::parse(USAGE, &["reps"]).get(0, "reps", 5);
    if !is_wgpu_available() {
        return Err(
            "no wgpu adapter (without a GPU: apt-get install mesa-vulkan-drivers libvulkan1)"
                .into(),
        );
    }
    let device = wgpu_device();
    let info = WgpuRuntime::default_client(&device)
        .wgpu_device()
        .adapter_info();
    println!(
        "wgpu decode, Sq = 1, Hq = {HQ}, D = {D}, f32, causal; adapter {} ({:?}); median of {reps}",
        info.name, info.device_type
    );
    println!(
        "{:>3} {:>3} {:>6} | {:>10} {:>8} | {:>6} {:>10} {:>8} | {:>7}",
        "B", "Hkv", "Sk", "unsplit ms", "GB/s", "splits", "split ms", "GB/s", "speedup"
    );
    let mut rng = Rng::new(29, 0);
    let opts = AttentionOptions::default();
    for (b, hkv, sk) in SHAPES {
        let mut tensor = |shape: &[usize]| -> Tensor<WgpuRuntime> {
            let n = shape.iter().product();
            Tensor::from_slice(&rng.normal_f32(n, 1.0), shape, &device).expect("a device tensor")
        };
        let q = tensor(&[b, HQ, 1, D]);
        let k = tensor(&[b, hkv, sk, D]);
        let v = tensor(&[b, hkv, sk, D]);
        let lengths = Tensor::<WgpuRuntime>::from_slice(&vec![sk as i32; b], &[b], &device)?;
        let cache = Keys::cache(&k, &v, &lengths);
        let chosen = wgpu_forward_splits(&Causal, &q, cache, &opts)?;
        let unsplit = time(reps, || {
            wgpu_forward_in_splits(&Causal, &q, cache, &opts, 1).map(|y| (y.out, y.lse))
        })?;
        let split = time(reps, || {
            attention(&Causal, &q, cache, &opts).map(|y| (y.out, y.lse))
        })?;
        let bytes = (2 * b * hkv * sk * D * 4) as f64;
        println!(
            "{b:>3} {hkv:>3} {sk:>6} | {:>10.2} {:>8.2} | {chosen:>6} {:>10.2} {:>8.2} | {:>6.2}x",
            unsplit * 1e3,
            bytes / unsplit / 1e9,
            split * 1e3,
            bytes / split / 1e9,
            unsplit / split
        );
    }
    Ok(())
}

/// The median seconds of `reps` calls of `f`, each read back to the host,
/// after one warm-up call.
fn time(
    reps: usize,
    f: impl Fn() -> boostr_runtime::Result<(Tensor<WgpuRuntime>, Tensor<WgpuRuntime>)>,
) -> Result<f64, Box<dyn std::error::Error>> {
    f()?.0.to_vec::<f32>();
    let mut times: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let start = Instant::now();
            let (out, _) = f()?;
            out.to_vec::<f32>();
            Ok(start.elapsed().as_secs_f64())
        })
        .collect::<Result<_, boostr_runtime::Error>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
