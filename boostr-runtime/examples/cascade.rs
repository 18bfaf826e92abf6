//! Cascade attention with `merge_states`: sequences that share a prompt
//! prefix in their pages decode one token each; the prefix is attended once
//! for all of them, as one problem whose query rows are the sequences, each
//! suffix on its own, and the two merged by their lse. Checked against the
//! plain paged decode of the same pages, and both timed.
//!
//! ```text
//! cargo run --release -p boostr-runtime --example cascade [-- <sequences> <prefix> <suffix> <runs>]
//! ```
//!
//! Defaults: 16 sequences sharing a 4,096-token prefix, each with a
//! 256-token suffix; 32 query heads, 8 KV heads, D = 128, f32, pages of 16.

use boostr_runtime::stock::{Causal, Full};
use boostr_runtime::testing::Rng;
use boostr_runtime::{AttentionOptions, Keys, attention, merge_states};
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
    "usage: cascade [<sequences> <prefix> <suffix> <runs>] (defaults 16 4096 256 9)";

fn main() -> Result<()> {
    let args = Args::parse(USAGE, &["sequences", "prefix", "suffix", "runs"]);
    let (n, prefix, suffix, runs): (usize, usize, usize, usize) = (
        args.get(0, "sequences", 16),
        args.get(1, "prefix", 4096),
        args.get(2, "suffix", 256),
        args.get(3, "runs", 9),
    );
    if prefix % PAGE != 0 || suffix == 0 || n == 0 {
        return Err(
            format!("the prefix must fill whole pages of {PAGE}; n and the suffix ≥ 1").into(),
        );
    }
    let device = CpuDevice::new();
    let mut rng = Rng::new(7, 0);
    let (prefix_pages, suffix_pages) = (prefix / PAGE, suffix.div_ceil(PAGE));
    let pages = prefix_pages + n * suffix_pages;
    let mut tensor = |shape: &[usize]| -> Result<T> {
        let len = shape.iter().product();
        Ok(Tensor::from_slice(
            &rng.normal_f32(len, 1.0),
            shape,
            &device,
        )?)
    };
    // Pages 0.. hold the shared prefix; each sequence's suffix follows.
    let k_pages = tensor(&[pages, HKV, PAGE, D])?;
    let v_pages = tensor(&[pages, HKV, PAGE, D])?;
    let q = tensor(&[n, HQ, 1, D])?;
    let opts = AttentionOptions::default();
    let i32s = |v: Vec<i32>, shape: &[usize]| Tensor::<CpuRuntime>::from_slice(&v, shape, &device);

    // Plain: every sequence's table lists the shared pages, then its own.
    let width = prefix_pages + suffix_pages;
    let mut table = Vec::with_capacity(n * width);
    let mut suffix_table = Vec::with_capacity(n * suffix_pages);
    for s in 0..n {
        table.extend(0..prefix_pages as i32);
        let own = (0..suffix_pages).map(|p| (prefix_pages + s * suffix_pages + p) as i32);
        table.extend(own.clone());
        suffix_table.extend(own);
    }
    let table = i32s(table, &[n, width])?;
    let lengths = i32s(vec![(prefix + suffix) as i32; n], &[n])?;
    let plain = || {
        attention(
            &Causal,
            &q,
            Keys::paged(&k_pages, &v_pages, &table, &lengths),
            &opts,
        )
    };

    // Cascade: the prefix once, as one problem per KV head whose query rows
    // are every sequence's rows of that head's group (every prefix key is
    // before every query: no mask), so that each prefix key is read once
    // for all of them; each suffix causally at its end; merged.
    let prefix_table = i32s((0..prefix_pages as i32).collect(), &[1, prefix_pages])?;
    let prefix_len = i32s(vec![prefix as i32], &[1])?;
    let suffix_table = i32s(suffix_table, &[n, suffix_pages])?;
    let suffix_len = i32s(vec![suffix as i32; n], &[n])?;
    let cascade = || -> Result<T> {
        let rows = q.permute(&[2, 1, 0, 3])?; // [1, Hq, n, D]: the sequences as rows
        let keys = Keys::paged(&k_pages, &v_pages, &prefix_table, &prefix_len);
        let shared = attention(&Full, &rows, keys, &opts)?;
        let shared_out = shared.out.permute(&[2, 1, 0, 3])?.contiguous()?;
        let shared_lse = shared
            .lse
            .permute(&[2, 1, 0])?
            .contiguous()?
            .reshape(&[n, HQ, 1])?;
        let keys = Keys::paged(&k_pages, &v_pages, &suffix_table, &suffix_len);
        let own = attention(&Causal, &q, keys, &opts)?;
        Ok(merge_states(&[(&shared_out, &shared_lse), (&own.out, &own.lse)])?.out)
    };

    let want = plain()?.out.to_vec::<f32>();
    let got = cascade()?.to_vec::<f32>();
    let err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let (mut t_plain, mut t_cascade) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let started = Instant::now();
        plain()?;
        t_plain.push(started.elapsed().as_secs_f64());
        let started = Instant::now();
        cascade()?;
        t_cascade.push(started.elapsed().as_secs_f64());
    }
    let (p, c) = (median(&t_plain), median(&t_cascade));
    println!(
        "{n} sequences sharing a {prefix}-token prefix, {suffix}-token suffixes, one decode \
         step ({HQ} query heads, {HKV} KV heads, D = {D}, f32, pages of {PAGE}):"
    );
    println!(
        "plain paged decode {:.2} ms, cascade {:.2} ms: {:.1}x; outputs differ by at most {err:.1e}",
        p * 1e3,
        c * 1e3,
        p / c
    );
    if err > 1e-5 {
        return Err(format!("the cascade differs from the plain decode by {err:e}").into());
    }
    Ok(())
}
