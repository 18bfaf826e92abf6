//! Packed causal documents from a tensor of ids (`stock::CausalDocuments`)
//! against the closed form of equal documents (`q / L == kv / L && kv <= q`,
//! a scalar parameter), forward, in one run: per attended pair, how much
//! reading the ids (and classifying tiles from their summaries) costs.
//!
//! ```text
//! cargo bench -p boostr-runtime --bench documents                            # CPU, S = 8192, Hq = 8, D = 128
//! cargo bench -p boostr-runtime --features wgpu --bench documents -- --wgpu  # wgpu, S = 1024, D = 64
//! ```
//!
//! Options: `--seq S`, `--dim D`, `--heads H`, `--docs N` (documents per
//! sequence, default 8), `--reps N` (default 7; each configuration's time is
//! the median of its runs, the configurations taking turns), `--seed N` (the
//! random document lengths).
//!
//! Rows: the closed form over `N` documents of `S / N` positions; the tensor
//! variant over the same ids; the tensor variant over `N` documents of random
//! lengths (cut points uniform over the sequence, every document at least one
//! position). GFLOP/s count `4·H·D·(attended pairs)`. On the CPU it also
//! times what the tensor variant adds before the kernels run: checking the
//! ids and computing their per-block summaries (`Variant::host`).

use boostr_runtime::stock::CausalDocuments;
use boostr_runtime::testing::Rng;
use boostr_runtime::{AttentionOptions, AttentionRuntime, Keys, Problem, Variant, attention};
use numr::runtime::RuntimeClient;
use numr::tensor::Tensor;
use std::error::Error;
use std::process::ExitCode;
use std::time::Instant;

type BoxResult<T> = Result<T, Box<dyn Error>>;

/// Documents of `len` positions each, in closed form.
#[attention(mask = |_b, _h, q, kv| q / self.len == kv / self.len && kv <= q)]
#[derive(Clone, Debug)]
struct EqualDocuments {
    len: i32,
}

struct Args {
    wgpu: bool,
    seq: usize,
    dim: usize,
    heads: usize,
    docs: usize,
    reps: usize,
    seed: u64,
}

fn parse() -> BoxResult<Args> {
    let mut a = Args {
        wgpu: false,
        seq: 0,
        dim: 0,
        heads: 8,
        docs: 8,
        reps: 7,
        seed: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || -> BoxResult<usize> {
            let v = it.next().ok_or(format!("{flag} needs a value"))?;
            Ok(v.parse()
                .map_err(|_| format!("{flag} {v:?}: not a number"))?)
        };
        match flag.as_str() {
            "--wgpu" => a.wgpu = true,
            "--seq" => a.seq = value()?,
            "--dim" => a.dim = value()?,
            "--heads" => a.heads = value()?,
            "--docs" => a.docs = value()?,
            "--reps" => a.reps = value()?,
            "--seed" => a.seed = value()? as u64,
            // cargo bench passes --bench
            "--bench" => {}
            other => return Err(format!("unknown option {other:?}").into()),
        }
    }
    if a.seq == 0 {
        a.seq = if a.wgpu { 1024 } else { 8192 };
    }
    if a.dim == 0 {
        a.dim = if a.wgpu { 64 } else { 128 };
    }
    if a.docs == 0 || a.docs > a.seq || !a.seq.is_multiple_of(a.docs) {
        return Err(format!("--docs {} must divide --seq {}", a.docs, a.seq).into());
    }
    Ok(a)
}

/// `n` document lengths summing to `s`, each at least 1: cut points drawn
/// uniformly.
fn random_lengths(s: usize, n: usize, seed: u64) -> Vec<usize> {
    use rand::{Rng as _, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut cuts: Vec<usize> = Vec::with_capacity(n - 1);
    while cuts.len() < n - 1 {
        let c = rng.random_range(1..s);
        if !cuts.contains(&c) {
            cuts.push(c);
        }
    }
    cuts.sort_unstable();
    let mut lens = Vec::with_capacity(n);
    let mut last = 0;
    for c in cuts.into_iter().chain([s]) {
        lens.push(c - last);
        last = c;
    }
    lens
}

fn ids(lens: &[usize]) -> Vec<i32> {
    lens.iter()
        .enumerate()
        .flat_map(|(d, &l)| std::iter::repeat_n(d as i32, l))
        .collect()
}

/// Causal pairs within the documents.
fn pairs(lens: &[usize]) -> u64 {
    lens.iter().map(|&l| (l * (l + 1) / 2) as u64).sum()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// One forward, finished on the device.
fn forward<R: AttentionRuntime, V: Variant>(v: &V, x: &Tensor<R>) -> BoxResult<f64> {
    let client = R::default_client(x.device());
    let start = Instant::now();
    let y = attention(v, x, Keys::dense(x, x), &AttentionOptions::default())?;
    client.synchronize();
    let t = start.elapsed().as_secs_f64();
    drop(y);
    Ok(t)
}

fn run<R: AttentionRuntime>(a: &Args, device: &R::Device, what: &str) -> BoxResult<()> {
    let (s, d, h) = (a.seq, a.dim, a.heads);
    let mut rng = Rng::new(0x5eed, 1);
    let x = Tensor::<R>::from_slice(&rng.normal_f32(h * s * d, 1.0), &[1, h, s, d], device)?;
    let equal = vec![s / a.docs; a.docs];
    let random = random_lengths(s, a.docs, a.seed);
    let tensor = |lens: &[usize]| -> BoxResult<CausalDocuments<R>> {
        Ok(CausalDocuments {
            doc: Tensor::<R>::from_slice(&ids(lens), &[1, s], device)?,
        })
    };
    let closed = EqualDocuments {
        len: (s / a.docs) as i32,
    };
    let (docs_equal, docs_random) = (tensor(&equal)?, tensor(&random)?);
    let p = Problem::new(1, (h, h), (s, s), d);
    // Warm up (compiles the GPU kernels), then take turns.
    forward(&closed, &x)?;
    forward(&docs_equal, &x)?;
    forward(&docs_random, &x)?;
    let mut times = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..a.reps {
        times[0].push(forward(&closed, &x)?);
        times[1].push(forward(&docs_equal, &x)?);
        times[2].push(forward(&docs_random, &x)?);
        if !a.wgpu {
            let start = Instant::now();
            let host = docs_random.host(&p)?;
            times[3].push(start.elapsed().as_secs_f64());
            drop(host);
        }
    }
    let flops = |lens: &[usize]| 4.0 * (h * d) as f64 * pairs(lens) as f64;
    let t: Vec<f64> = times[..3].iter().map(|t| median(t.clone())).collect();
    let gf = [
        flops(&equal) / t[0] / 1e9,
        flops(&equal) / t[1] / 1e9,
        flops(&random) / t[2] / 1e9,
    ];
    println!(
        "{what}: causal documents, forward, B = 1, Hq = Hkv = {h}, S = {s}, D = {d}, f32, \
         median of {} runs each",
        a.reps
    );
    println!("| mask | documents | attended pairs | ms | GFLOP/s | per pair vs closed form |");
    println!("| --- | --- | ---: | ---: | ---: | ---: |");
    let rows = [
        ("closed form `q / L == kv / L && kv <= q`", &equal, "equal"),
        ("ids from a `[B, Sk]` tensor", &equal, "equal"),
        ("ids from a `[B, Sk]` tensor", &random, "random lengths"),
    ];
    for (i, (mask, lens, kind)) in rows.iter().enumerate() {
        println!(
            "| {mask} | {} {kind} | {} | {:.1} | {:.1} | {:.2} |",
            a.docs,
            pairs(lens),
            t[i] * 1e3,
            gf[i],
            gf[i] / gf[0]
        );
    }
    println!("random lengths: {random:?}");
    if !a.wgpu {
        let host = median(times[3].clone());
        println!(
            "checking the ids and summarising them (Variant::host): {:.3} ms, {:.2}% of the \
             tensor variant's forward",
            host * 1e3,
            100.0 * host / t[2]
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let result = parse().and_then(|a| {
        if a.wgpu {
            #[cfg(feature = "wgpu")]
            {
                use numr::runtime::Runtime;
                use numr::runtime::wgpu::{WgpuRuntime, is_wgpu_available, wgpu_device};
                if !is_wgpu_available() {
                    return Err("no wgpu adapter".into());
                }
                let device = wgpu_device();
                let info = WgpuRuntime::default_client(&device)
                    .wgpu_device()
                    .adapter_info();
                let what = format!("wgpu ({}, {:?})", info.name, info.device_type);
                return run::<WgpuRuntime>(&a, &device, &what);
            }
            #[cfg(not(feature = "wgpu"))]
            return Err("built without the wgpu feature (--features wgpu)".into());
        }
        let device = numr::runtime::cpu::CpuDevice::new();
        let what = format!("cpu ({} rayon threads)", rayon::current_num_threads());
        run::<numr::runtime::cpu::CpuRuntime>(&a, &device, &what)
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
