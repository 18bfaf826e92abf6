//! Every CUDA kernel source compiles with NVRTC and assembles with ptxas
//! without spills or local memory, for the default tile configurations.
//!
//! Needs `libnvrtc` where the dynamic loader finds it (`LD_LIBRARY_PATH`) and
//! `ptxas` in `BOOSTR_PTXAS` or on `PATH`; without them the test prints why it
//! skips and passes, unless `BOOSTR_TEST_REQUIRE_NVRTC` is set. No GPU is
//! needed.
//!
//! The default matrix keeps the test near a minute on two cores (one NVRTC
//! compilation takes 0.3–1.3 s): every variant (the stock ones and three
//! declared here) × every dtype, forward and backward, each at one of the
//! head dims 40, 64, 128, rotated so that every variant meets every head dim
//! across the dtypes and every dtype every head dim across the variants
//! (compute_90 → sm_90); plus the full-language variant at D = 80, 96, 256 for
//! every dtype, compute_80 PTX assembled for sm_80 and sm_90.
//! `BOOSTR_CUDA_FULL=1` compiles every variant at every one of 40, 64, 128.

use boostr_runtime::stock::{
    Alibi, Causal, CausalSlidingWindow, CausalSoftcap, FlashMask, Full, PrefixLm, SlidingWindow,
    Softcap,
};
use boostr_runtime::{Variant, attention};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use kernels_spec::emit::cuda::{
    self, CudaDType, CudaTiles, DELTA_KERNEL, DKDV_KERNEL, DQ_KERNEL, FORWARD_KERNEL, PARAM_WORDS,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Every construct of the language (as in `ui/pass_full_language.rs`).
#[attention(
    score = |s, b, h, q, kv| {
        let cap: f32 = self.cap;
        let t = cap * tanh(s / cap);
        let dist = abs(q - kv) as f32;
        let bias = if self.alibi { -self.slope * (h + 1) as f32 * dist } else { 0.0 };
        let smooth = log(1.0 + exp(t)) - log2(1.0 + exp2(-abs(t)));
        let gate = sigmoid(sqrt(1.0 + t * t)) * floor(s) - ceil(s) * 0.0;
        let lo = min(b, 0) as f32;
        max(clamp(t + bias + 0.5 * smooth + gate * 0.0, -cap, cap), lo - cap)
    },
    mask = |_b, _h, q, kv| {
        let window = self.window as i32;
        let causal = if self.causal { kv <= q } else { true };
        causal && (q - kv < window || self.window == 0u32) && !(kv < 0)
    },
    tile(q = 32, kv = 64),
)]
#[derive(Clone, Debug)]
struct Everything {
    cap: f32,
    slope: f32,
    window: u32,
    causal: bool,
    alibi: bool,
}

/// Integer corner cases: division and remainder by parameters (possibly 0
/// or -1), u32 arithmetic, casts both ways, a document mask.
#[attention(
    score = |s, _b, h, q, kv| s + ((q / self.div) % 3) as f32 * 0.5 - ((kv as u32) % self.m) as f32 + (h as f32) * self.f,
    mask = |_b, _h, q, kv| (q / self.doc == kv / self.doc) && (((q - kv) as f32) * self.f) as i32 >= -1000,
)]
#[derive(Clone, Debug)]
struct Integers {
    div: i32,
    m: u32,
    f: f32,
    doc: i32,
}

/// Exactly [`PARAM_WORDS`] parameter words: `Params` has no padding.
#[attention(mask = |_b, _h, q, kv| kv <= q + self.w0 - self.w31 && kv >= self.w16)]
#[derive(Clone, Debug)]
#[rustfmt::skip]
struct ThirtyTwoWords {
    w0: i32, w1: i32, w2: i32, w3: i32, w4: i32, w5: i32, w6: i32, w7: i32,
    w8: i32, w9: i32, w10: i32, w11: i32, w12: i32, w13: i32, w14: i32, w15: i32,
    w16: i32, w17: i32, w18: i32, w19: i32, w20: i32, w21: i32, w22: i32, w23: i32,
    w24: i32, w25: i32, w26: i32, w27: i32, w28: i32, w29: i32, w30: i32, w31: i32,
}

/// A variant's name, CUDA section and tile override.
struct Spec {
    name: &'static str,
    functions: &'static str,
    tile: (Option<u32>, Option<u32>),
}

fn spec<V: Variant>() -> Spec {
    Spec {
        name: V::NAME,
        functions: V::cuda_variant_functions().expect("a macro-declared variant has CUDA"),
        tile: (V::TILE_Q, V::TILE_KV),
    }
}

fn variants() -> Vec<Spec> {
    vec![
        spec::<Full>(),
        spec::<Causal>(),
        spec::<SlidingWindow>(),
        spec::<CausalSlidingWindow>(),
        spec::<Alibi>(),
        spec::<Softcap>(),
        spec::<CausalSoftcap>(),
        spec::<PrefixLm>(),
        spec::<FlashMask>(),
        spec::<Everything>(),
        spec::<Integers>(),
        spec::<ThirtyTwoWords>(),
    ]
}

const DTYPES: [CudaDType; 3] = [CudaDType::F32, CudaDType::F16, CudaDType::Bf16];
const HEAD_DIMS: [u32; 3] = [40, 64, 128];
/// Head dims the full-language variant is also compiled for, on both archs
/// (from one compute_80 PTX).
const EXTRA_HEAD_DIMS: [u32; 3] = [80, 96, 256];

/// One NVRTC compilation, assembled for some architectures.
#[derive(Clone)]
struct Job {
    variant: usize,
    dtype: CudaDType,
    head_dim: u32,
    backward: bool,
    /// `(NVRTC --gpu-architecture, ptxas -arch)` pairs.
    archs: Vec<(&'static str, &'static str)>,
}

/// What ptxas reported for one kernel.
#[derive(Clone, Debug, Default)]
struct KernelReport {
    registers: u32,
    static_smem: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
}

fn jobs(n_variants: usize, full: bool) -> Vec<Job> {
    let sm90 = vec![("compute_90", "sm_90")];
    let mut jobs = Vec::new();
    let everything = 9; // index of `Everything` in `variants()`
    for variant in 0..n_variants {
        for (di, dtype) in DTYPES.into_iter().enumerate() {
            // By default each variant meets every head dim across the three
            // dtypes, and each dtype every head dim across the variants.
            let dims: Vec<u32> = if full {
                HEAD_DIMS.to_vec()
            } else {
                vec![HEAD_DIMS[(variant + di) % HEAD_DIMS.len()]]
            };
            for head_dim in dims {
                for backward in [false, true] {
                    jobs.push(Job {
                        variant,
                        dtype,
                        head_dim,
                        backward,
                        archs: sm90.clone(),
                    });
                }
            }
        }
    }
    for dtype in DTYPES {
        for head_dim in EXTRA_HEAD_DIMS {
            for backward in [false, true] {
                for archs in [vec![("compute_80", "sm_80")], vec![("compute_90", "sm_90")]] {
                    jobs.push(Job {
                        variant: everything,
                        dtype,
                        head_dim,
                        backward,
                        archs,
                    });
                }
            }
        }
    }
    jobs
}

fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("BOOSTR_PTXAS") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("ptxas"))
        .find(|p| p.is_file())
}

fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The tile configuration a runtime would pick: the variant's override when
/// it validates, else the defaults.
fn tiles(spec: &Spec, head_dim: u32, dtype: CudaDType) -> CudaTiles {
    let default = CudaTiles::for_problem(head_dim, dtype);
    let overridden = default.with_tile_override(spec.tile.0, spec.tile.1);
    if overridden.validate().is_ok() {
        overridden
    } else {
        default
    }
}

fn parse_ptxas(output: &str) -> Result<BTreeMap<String, KernelReport>, String> {
    let mut kernels: BTreeMap<String, KernelReport> = BTreeMap::new();
    let mut current: Option<String> = None;
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let end = line.find(unit)?;
        line[..end].split_whitespace().last()?.parse().ok()
    };
    for line in output.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = Some(rest.trim().to_string());
            kernels.entry(rest.trim().to_string()).or_default();
            continue;
        }
        let Some(name) = &current else { continue };
        let k = kernels.get_mut(name).expect("entry inserted above");
        if line.contains("bytes stack frame") {
            k.stack = number_before(line, "bytes stack frame").ok_or(line.to_string())?;
            k.spill_stores = number_before(line, "bytes spill stores").ok_or(line.to_string())?;
            k.spill_loads = number_before(line, "bytes spill loads").ok_or(line.to_string())?;
        }
        if line.contains("Used") && line.contains("registers") {
            k.registers = number_before(line, "registers").ok_or(line.to_string())?;
            k.static_smem = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    Ok(kernels)
}

fn ptxas(ptxas: &Path, ptx: &str, arch: &str, tag: &str) -> Result<String, String> {
    static SERIAL: AtomicUsize = AtomicUsize::new(0);
    let n = SERIAL.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir();
    let stem = format!("boostr-cuda-{}-{n}", std::process::id());
    let ptx_path = dir.join(format!("{stem}.ptx"));
    let cubin_path = dir.join(format!("{stem}.cubin"));
    std::fs::write(&ptx_path, ptx).map_err(|e| format!("{tag}: writing PTX: {e}"))?;
    let out = Command::new(ptxas)
        .arg("-v")
        .arg(format!("-arch={arch}"))
        .arg(&ptx_path)
        .arg("-o")
        .arg(&cubin_path)
        .output();
    let _ = std::fs::remove_file(&ptx_path);
    let _ = std::fs::remove_file(&cubin_path);
    let out = out.map_err(|e| format!("{tag}: running {}: {e}", ptxas.display()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(format!("{tag}: ptxas failed:\n{text}"));
    }
    Ok(text)
}

/// One row of the summary: the worst case over the variants compiled for a
/// (arch, dtype, head dim, kernel).
#[derive(Default)]
struct Row {
    registers: u32,
    static_smem: u32,
    dynamic_smem: u64,
    stack: u32,
    spills: u32,
    variants: usize,
}

#[test]
fn every_kernel_compiles_without_spills() {
    let require = std::env::var_os("BOOSTR_TEST_REQUIRE_NVRTC").is_some();
    let ptxas_path = find_ptxas();
    let have_nvrtc = nvrtc_present();
    if !have_nvrtc || ptxas_path.is_none() {
        let missing = match (have_nvrtc, &ptxas_path) {
            (false, None) => "libnvrtc (LD_LIBRARY_PATH) and ptxas (BOOSTR_PTXAS or PATH)",
            (false, Some(_)) => "libnvrtc (LD_LIBRARY_PATH)",
            _ => "ptxas (BOOSTR_PTXAS or PATH)",
        };
        assert!(
            !require,
            "BOOSTR_TEST_REQUIRE_NVRTC is set but {missing} was not found"
        );
        eprintln!("SKIPPED cuda_compile: {missing} not found");
        return;
    }
    let ptxas_path = ptxas_path.expect("checked above");
    let specs = variants();
    let full = std::env::var_os("BOOSTR_CUDA_FULL").is_some();
    let jobs = jobs(specs.len(), full);
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::<String>::new());
    let rows = Mutex::new(BTreeMap::<(String, &'static str, u32, String), Row>::new());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let started = std::time::Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { break };
                    let spec = &specs[job.variant];
                    let cfg = tiles(spec, job.head_dim, job.dtype);
                    let (source, entries, dynamic) = if job.backward {
                        (
                            cuda::backward_source(spec.functions, &cfg, job.dtype),
                            vec![DELTA_KERNEL, DQ_KERNEL, DKDV_KERNEL],
                            vec![0, cfg.dq_smem_bytes(), cfg.dkdv_smem_bytes()],
                        )
                    } else {
                        (
                            cuda::forward_source(spec.functions, &cfg, job.dtype),
                            vec![FORWARD_KERNEL],
                            vec![cfg.forward_smem_bytes()],
                        )
                    };
                    let mut ptx_cache: Vec<(&str, Result<String, String>)> = Vec::new();
                    for &(nvrtc_arch, sm) in &job.archs {
                        let tag = format!(
                            "{} {} D={} {} {nvrtc_arch}/{sm}",
                            spec.name,
                            job.dtype.name(),
                            job.head_dim,
                            if job.backward { "backward" } else { "forward" }
                        );
                        if !ptx_cache.iter().any(|(a, _)| *a == nvrtc_arch) {
                            ptx_cache.push((nvrtc_arch, nvrtc(&source, nvrtc_arch, &tag)));
                        }
                        let ptx = &ptx_cache
                            .iter()
                            .find(|(a, _)| *a == nvrtc_arch)
                            .expect("compiled above")
                            .1;
                        let result = ptx.clone().and_then(|ptx| {
                            assemble_and_check(&ptx, sm, &ptxas_path, &tag, &entries)
                        });
                        match result {
                            Err(e) => failures.lock().unwrap().push(e),
                            Ok(reports) => {
                                let mut rows = rows.lock().unwrap();
                                for (entry, dynamic) in entries.iter().zip(&dynamic) {
                                    let r = &reports[*entry];
                                    let key = (
                                        sm.to_string(),
                                        job.dtype.name(),
                                        job.head_dim,
                                        entry.to_string(),
                                    );
                                    let row = rows.entry(key).or_default();
                                    row.registers = row.registers.max(r.registers);
                                    row.static_smem = row.static_smem.max(r.static_smem);
                                    row.dynamic_smem = row.dynamic_smem.max(*dynamic);
                                    row.stack = row.stack.max(r.stack);
                                    row.spills = row.spills.max(r.spill_stores + r.spill_loads);
                                    row.variants += 1;
                                }
                            }
                        }
                    }
                }
            });
        }
    });
    let rows = rows.into_inner().unwrap();
    let mut table = format!(
        "{} jobs in {:.1?} on {threads} threads\n{:<6} {:<5} {:>4} {:<22} {:>5} {:>7} {:>8} {:>6} {:>7} {:>9}\n",
        jobs.len(),
        started.elapsed(),
        "arch",
        "dtype",
        "D",
        "kernel",
        "regs",
        "smem_st",
        "smem_dyn",
        "stack",
        "spills",
        "variants"
    );
    for ((sm, dtype, d, kernel), r) in &rows {
        table.push_str(&format!(
            "{sm:<6} {dtype:<5} {d:>4} {kernel:<22} {:>5} {:>7} {:>8} {:>6} {:>7} {:>9}\n",
            r.registers, r.static_smem, r.dynamic_smem, r.stack, r.spills, r.variants
        ));
    }
    eprintln!("{table}");
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of the CUDA compilations failed:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

fn nvrtc(source: &str, nvrtc_arch: &'static str, tag: &str) -> Result<String, String> {
    let opts = CompileOptions {
        arch: Some(nvrtc_arch),
        options: vec!["-std=c++17".into()],
        ..Default::default()
    };
    compile_ptx_with_opts(source, opts)
        .map(|ptx| ptx.to_src())
        .map_err(|e| format!("{tag}: NVRTC failed: {e:?}\n---- source ----\n{source}"))
}

fn assemble_and_check(
    ptx: &str,
    sm: &str,
    ptxas_path: &Path,
    tag: &str,
    entries: &[&str],
) -> Result<BTreeMap<String, KernelReport>, String> {
    let text = ptxas(ptxas_path, ptx, sm, tag)?;
    let reports = parse_ptxas(&text).map_err(|l| format!("{tag}: unparsed ptxas line {l}"))?;
    for entry in entries {
        let Some(r) = reports.get(*entry) else {
            return Err(format!("{tag}: no kernel {entry} in ptxas output:\n{text}"));
        };
        // Local memory of any kind (a stack frame is where spills and
        // non-register arrays live) means an accumulator left registers.
        if r.spill_stores + r.spill_loads + r.stack > 0 {
            return Err(format!("{tag}: {entry} uses local memory: {r:?}\n{text}"));
        }
    }
    Ok(reports)
}

#[test]
fn params_are_the_wgsl_words_padded_to_32() {
    let checks: [(&str, Vec<u32>); 4] = [
        (
            Everything::NAME,
            Everything {
                cap: 30.0,
                slope: 0.25,
                window: 4,
                causal: true,
                alibi: false,
            }
            .wgsl_params(),
        ),
        (Alibi::NAME, Alibi { heads: 4 }.wgsl_params()),
        (Full::NAME, Full.wgsl_params()),
        (
            ThirtyTwoWords::NAME,
            ThirtyTwoWords {
                w0: 1,
                w1: 0,
                w2: 0,
                w3: 0,
                w4: 0,
                w5: 0,
                w6: 0,
                w7: 0,
                w8: 0,
                w9: 0,
                w10: 0,
                w11: 0,
                w12: 0,
                w13: 0,
                w14: 0,
                w15: 0,
                w16: 0,
                w17: 0,
                w18: 0,
                w19: 0,
                w20: 0,
                w21: 0,
                w22: 0,
                w23: 0,
                w24: 0,
                w25: 0,
                w26: 0,
                w27: 0,
                w28: 0,
                w29: 0,
                w30: 0,
                w31: 7,
            }
            .wgsl_params(),
        ),
    ];
    for (name, words) in checks {
        assert!(words.len() <= PARAM_WORDS, "{name}: {} words", words.len());
    }
    let everything = Everything::cuda_variant_functions().unwrap();
    assert!(everything.contains(
        "struct Params {\n    float p_cap;\n    float p_slope;\n    unsigned p_window;\n    \
         unsigned p_causal;\n    unsigned p_alibi;\n    unsigned _pad[27];\n};"
    ));
    let full = Full::cuda_variant_functions().unwrap();
    assert!(full.contains("struct Params {\n    unsigned _pad[32];\n};"));
    let words = ThirtyTwoWords::cuda_variant_functions().unwrap();
    assert!(
        words.contains("    int p_w31;\n};"),
        "no padding after 32 words"
    );
}
