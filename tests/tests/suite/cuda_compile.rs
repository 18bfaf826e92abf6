//! Every CUDA kernel source compiles with NVRTC and assembles with ptxas
//! without spills or local memory, for the default tile configurations.
//!
//! Needs `libnvrtc` where the dynamic loader finds it (`LD_LIBRARY_PATH`) and
//! `ptxas` in `BOOSTR_PTXAS` or on `PATH`; without them the test prints why it
//! skips and passes, unless `BOOSTR_TEST_REQUIRE_NVRTC` is set. No GPU is
//! needed.
//!
//! The default matrix keeps the test near three minutes on two cores (one
//! NVRTC compilation takes 0.5–3.5 s, a backward the most). The variant
//! functions are the same code in every configuration, and the kernels
//! differ per (dtype, head dims), so: every variant (the stock ones and the
//! three test fixtures), its backward (whose kernels call every function of
//! the variant's section, the same text in the forward), at one (dtype,
//! head dim) each, cycling so that every dtype meets every head dim across
//! the variants; and the variant that uses every language feature, forward
//! and backward, at every dtype × head dim 40, 64, 128 and the value head
//! dims of their own `D/Dv` 192/128, 128/64, 64/32 (compute_90 → sm_90),
//! 80, 96, 256 and 576/512 (MLA's absorbed decode; compute_80 PTX assembled
//! for sm_80 and sm_90), and forwards over fp8 KV caches (E4M3 and E5M2
//! under each dtype, for sm_90; absorbed MLA's 576/512 also for sm_80).
//! `BOOSTR_CUDA_FULL=1` compiles every variant at every dtype × 40, 64,
//! 128.
//!
//! A second test runs the kernels on a host emulation against the f64
//! reference (needs a C++20 compiler: `BOOSTR_CXX`, or `c++`/`g++` on PATH);
//! over an fp8 cache, the reference of its dequantized values.

use crate::fixtures;
use crate::tool_cache;

use boostr_runtime::stock::{
    AlibiSlopes, Causal, CausalDocuments, CausalDropout, CausalSigmoid, CausalSlidingWindow,
    CausalSlidingWindowSinks, CausalSoftcap, Documents, KvLengths, PrefixLm, RelativeBias,
    SlidingWindow, Softcap, T5Bias,
};
use boostr_runtime::testing::{
    CpuRuntime, Rng, TestData, reference_backward_lse, reference_forward, ring_call, seen_keys,
};
use boostr_runtime::variant::{ParamWords, Target};
use boostr_runtime::{HostVariant, Problem, Variant};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use fixtures::{Declared, Everything, ThirtyTwoWords, declared};
use kernels_spec::emit::choose_tiles;
use kernels_spec::emit::cuda::interface::{Kernel, Module};
use kernels_spec::emit::cuda::{CudaDType, CudaKv, CudaTiles, kernels, source};
use kernels_spec::emit::interface::{Arg, Elem, Scalar};
use kernels_spec::params::PARAM_WORDS;
use kernels_spec::params::{Arena, SummaryJob};
use numr::runtime::cpu::CpuDevice;
use numr::tensor::Tensor;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The variant's CUDA section.
fn section(d: &Declared) -> &'static str {
    d.compiled
        .lowering(Target::Cuda)
        .expect("a declared variant has a CUDA lowering")
}

/// Index of `Everything` in [`fixtures::all`].
fn everything_index(all: &[Declared]) -> usize {
    all.iter()
        .position(|d| d.compiled.name == <Everything as Variant>::NAME)
        .expect("the fixtures include Everything")
}

const DTYPES: [CudaDType; 3] = [CudaDType::F32, CudaDType::F16, CudaDType::Bf16];
const HEAD_DIMS: [u32; 3] = [40, 64, 128];
/// Head dims the full-language variant is also compiled for, on both archs
/// (from one compute_80 PTX).
const EXTRA_HEAD_DIMS: [u32; 3] = [80, 96, 256];
/// `(D, Dv)` pairs with values of their own head dim the full-language
/// variant is compiled for: DeepSeek MLA's prefill and absorbed decode, and
/// two halved pairs; for sm_90, and the widest (576/512, its own tier) on
/// both archs.
const VALUE_DIM_PAIRS: [(u32, u32); 4] = [(192, 128), (576, 512), (128, 64), (64, 32)];
/// Forwards over fp8 and int8 caches the full-language variant is compiled
/// for, on sm_90 (the first, absorbed MLA decode, also on sm_80): absorbed
/// MLA decode and 128 on tensor cores, every format on CUDA cores (the
/// widest tiles too) and in f16.
const QUANTISED_FORWARDS: [(CudaDType, CudaKv, (u32, u32)); 8] = [
    (CudaDType::Bf16, CudaKv::E4m3, (576, 512)),
    (CudaDType::Bf16, CudaKv::E4m3, (128, 128)),
    (CudaDType::F16, CudaKv::E4m3, (128, 128)),
    (CudaDType::F16, CudaKv::E5m2, (64, 32)),
    (CudaDType::F32, CudaKv::E4m3, (128, 128)),
    (CudaDType::F32, CudaKv::E5m2, (576, 512)),
    (CudaDType::Bf16, CudaKv::I8, (128, 128)),
    (CudaDType::F32, CudaKv::I8, (64, 32)),
];

/// One NVRTC compilation, assembled for some architectures.
#[derive(Clone)]
struct Job {
    variant: usize,
    dtype: CudaDType,
    /// How the forward's K and V are stored.
    kv: CudaKv,
    /// `(D, Dv)`.
    dims: (u32, u32),
    backward: bool,
    /// `(NVRTC --gpu-architecture, ptxas -arch)` pairs.
    archs: Vec<(&'static str, &'static str)>,
}

/// What ptxas reported for one kernel.
#[derive(Clone, Debug, Default)]
pub(crate) struct KernelReport {
    registers: u32,
    static_smem: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
}

fn jobs(n_variants: usize, everything: usize, full: bool) -> Vec<Job> {
    let mut jobs = Vec::new();
    // The variants' own code (score, mask, sink and their derivatives and
    // summaries) is one section, the same text in every module; the
    // backward modules call all of it. So a variant is compiled once, in
    // its backward; the forward kernels, at every configuration, with the
    // variant that uses every feature.
    let mut push = |variant, dtype, dims, archs: &[(&'static str, &'static str)]| {
        let directions: &[bool] = if variant == everything {
            &[false, true]
        } else {
            &[true]
        };
        for &backward in directions {
            jobs.push(Job {
                variant,
                dtype,
                kv: CudaKv::Elem,
                dims,
                backward,
                archs: archs.to_vec(),
            });
        }
    };
    let sm90: &[_] = &[("compute_90", "sm_90")];
    // compute_80 PTX runs on sm_90 too (JIT-assembled there).
    let both: &[_] = &[("compute_80", "sm_80"), ("compute_80", "sm_90")];
    for variant in 0..n_variants {
        if full {
            for dtype in DTYPES {
                for d in HEAD_DIMS {
                    push(variant, dtype, (d, d), sm90);
                }
            }
        } else if variant != everything {
            // The variant functions are the same code for every dtype and
            // head dim: one configuration each, cycling so that every dtype
            // meets every head dim across the variants.
            let dtype = DTYPES[variant % DTYPES.len()];
            let d = HEAD_DIMS[(variant / DTYPES.len()) % HEAD_DIMS.len()];
            push(variant, dtype, (d, d), sm90);
        }
    }
    // Every kernel configuration, with the variant that uses every feature.
    for dtype in DTYPES {
        if !full {
            for d in HEAD_DIMS {
                push(everything, dtype, (d, d), sm90);
            }
        }
        for d in EXTRA_HEAD_DIMS {
            push(everything, dtype, (d, d), both);
        }
        for dims in VALUE_DIM_PAIRS {
            push(
                everything,
                dtype,
                dims,
                if dims.0 > 256 { both } else { sm90 },
            );
        }
    }
    // Quantised caches: the forward only (their backward is an error).
    for (i, (dtype, kv, dims)) in QUANTISED_FORWARDS.into_iter().enumerate() {
        jobs.push(Job {
            variant: everything,
            dtype,
            kv,
            dims,
            backward: false,
            archs: if i == 0 { both } else { sm90 }.to_vec(),
        });
    }
    jobs
}

pub(crate) fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("BOOSTR_PTXAS") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("ptxas"))
        .find(|p| p.is_file())
}

pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The tile configuration the runtime picks for head dims `(D, Dv)`.
fn tiles(d: &Declared, (head_dim, value_dim): (u32, u32), dtype: CudaDType) -> CudaTiles {
    choose_tiles(
        CudaTiles::for_problem(head_dim, value_dim, dtype),
        d.tile.0,
        d.tile.1,
    )
    .expect("every head dim of the matrix has a tiling")
}

/// `D`, or `D/Dv` where they differ.
fn dims_name((d, dv): (u32, u32)) -> String {
    if d == dv {
        d.to_string()
    } else {
        format!("{d}/{dv}")
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
    let tool = tool_cache::tool_identity(ptxas);
    let key: [&[u8]; 3] = [&tool, ptx.as_bytes(), arch.as_bytes()];
    tool_cache::text("ptxas", &key, || run_ptxas(ptxas, ptx, arch, tag))
}

/// `ptxas -v` on `ptx` for `arch`: its report.
fn run_ptxas(ptxas: &Path, ptx: &str, arch: &str, tag: &str) -> Result<String, String> {
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
    // The summary kernel, shared by every variant with tensors.
    for (nvrtc_arch, sm) in [("compute_90", "sm_90"), ("compute_80", "sm_80")] {
        let tag = format!("bx_summarize {nvrtc_arch}/{sm}");
        nvrtc(kernels::SUMMARY_SOURCE, nvrtc_arch, &tag)
            .and_then(|ptx| assemble_and_check(&ptx, sm, &ptxas_path, &tag, &["bx_summarize"]))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let specs = fixtures::all();
    let full = std::env::var_os("BOOSTR_CUDA_FULL").is_some();
    let jobs = jobs(specs.len(), everything_index(&specs), full);
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::<String>::new());
    type RowKey = (String, String, (u32, u32), String);
    let rows = Mutex::new(BTreeMap::<RowKey, Row>::new());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let started = std::time::Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { break };
                    let spec = &specs[job.variant];
                    let cfg = tiles(spec, job.dims, job.dtype).with_kv(job.kv);
                    let modules: &[&Module] = if job.backward {
                        &[&kernels::BACKWARD_MODULE, &kernels::TENSORS_MODULE]
                    } else {
                        &[&kernels::FORWARD_MODULE]
                    };
                    let source =
                        source(section(spec), modules, &cfg).expect("the chosen tiles validate");
                    let kernels = || modules.iter().flat_map(|m| m.interfaces());
                    let entries: Vec<&str> = kernels().map(|k| k.entry).collect();
                    let dynamic: Vec<u64> = kernels().map(|k| k.smem_bytes(&cfg)).collect();
                    let mut ptx_cache: Vec<(&str, Result<String, String>)> = Vec::new();
                    let dtype = match job.kv {
                        CudaKv::Elem => job.dtype.name().to_string(),
                        kv => format!("{}/{}", job.dtype.name(), kv.name()),
                    };
                    for &(nvrtc_arch, sm) in &job.archs {
                        let tag = format!(
                            "{} {dtype} D={} {} {nvrtc_arch}/{sm}",
                            spec.compiled.name,
                            dims_name(job.dims),
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
                                        dtype.clone(),
                                        job.dims,
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
        "{} jobs in {:.1?} on {threads} threads\n{:<6} {:<9} {:>7} {:<22} {:>5} {:>7} {:>8} {:>6} {:>7} {:>9}\n",
        jobs.len(),
        started.elapsed(),
        "arch",
        "dtype",
        "D/Dv",
        "kernel",
        "regs",
        "smem_st",
        "smem_dyn",
        "stack",
        "spills",
        "variants"
    );
    for ((sm, dtype, dims, kernel), r) in &rows {
        table.push_str(&format!(
            "{sm:<6} {dtype:<9} {:>7} {kernel:<22} {:>5} {:>7} {:>8} {:>6} {:>7} {:>9}\n",
            dims_name(*dims),
            r.registers,
            r.static_smem,
            r.dynamic_smem,
            r.stack,
            r.spills,
            r.variants
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

pub(crate) fn nvrtc(source: &str, nvrtc_arch: &'static str, tag: &str) -> Result<String, String> {
    let version = nvrtc_version();
    let key: [&[u8]; 4] = [
        source.as_bytes(),
        nvrtc_arch.as_bytes(),
        b"-std=c++17",
        &version,
    ];
    tool_cache::text("ptx", &key, || {
        let opts = CompileOptions {
            arch: Some(nvrtc_arch),
            options: vec!["-std=c++17".into()],
            ..Default::default()
        };
        compile_ptx_with_opts(source, opts)
            .map(|ptx| ptx.to_src())
            .map_err(|e| format!("{tag}: NVRTC failed: {e:?}\n---- source ----\n{source}"))
    })
}

/// NVRTC's version (major, minor), which the PTX it makes depends on.
fn nvrtc_version() -> Vec<u8> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers; NVRTC is loaded (checked by the
    // callers), and the call only writes them.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    format!("{major}.{minor}").into_bytes()
}

pub(crate) fn assemble_and_check(
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

/// Every construct of the variant language at once (`let` blocks, typed
/// and untyped, `if`/`else`, `as` casts, every function, f32, i32, u32 and
/// bool parameters) expands, and its host functions mean what they say.
#[test]
fn the_full_language_runs_on_the_host() {
    use boostr_runtime::HostVariant;
    let v = Everything {
        cap: 30.0,
        slope: 0.25,
        window: 4,
        causal: true,
        alibi: true,
    };
    assert!(v.mask(0, 0, 5, 5));
    assert!(v.mask(0, 0, 5, 2));
    assert!(!v.mask(0, 0, 5, 1));
    assert!(!v.mask(0, 0, 5, 6));
    let s = v.score(1.5, 0, 1, 3, 1);
    assert!(s.is_finite() && s.abs() <= 30.0, "{s}");
    assert!(Everything::compiled().text.contains("score"));
}

#[test]
fn param_words_follow_the_layout() {
    let everything = Everything {
        cap: 30.0,
        slope: 0.25,
        window: 4,
        causal: true,
        alibi: false,
    };
    let mut want = [0u32; PARAM_WORDS];
    want[..5].copy_from_slice(&[30f32.to_bits(), 0.25f32.to_bits(), 4, 1, 0]);
    assert_eq!(everything.param_words(), ParamWords(want));
    let words = ThirtyTwoWords {
        w0: 1,
        w31: -7,
        ..Default::default()
    }
    .param_words();
    assert_eq!((words.0[0], words.0[31]), (1, (-7i32) as u32));
    assert!(words.0[1..31].iter().all(|&w| w == 0));
    assert_eq!(boostr_runtime::stock::Full.param_words(), ParamWords::ZERO);

    // The CUDA struct declares the same words, padded to the block's size.
    assert!(section(&declared::<Everything>()).contains(
        "struct Params {\n    float p_cap;\n    float p_slope;\n    unsigned p_window;\n    \
         unsigned p_causal;\n    unsigned p_alibi;\n    unsigned _pad[27];\n    int win_q;\n"
    ));
    assert!(
        section(&declared::<boostr_runtime::stock::Full>())
            .contains("struct Params {\n    unsigned _pad[32];\n    int win_q;\n")
    );
    assert!(
        section(&declared::<ThirtyTwoWords>()).contains("    int p_w31;\n    int win_q;\n"),
        "no padding after 32 words of fields: the window follows"
    );
}

/// Host emulation of the kernels (compiled as C++ with a host compiler, see
/// `BX_HOST_EMULATION` in the kernel templates): every CUDA thread of a block
/// is a fiber (ucontext) on one OS thread, `__syncthreads` and the warp
/// shuffles are barriers that yield to a round-robin scheduler, and
/// `mma.sync` is computed from the fragments of the 32 lanes. It checks the
/// kernels' logic (tiling, indexing, masking, online softmax, the backward's
/// algebra, the MMA fragment layouts) against the f64 reference without a
/// GPU.
pub(crate) const HOST_HARNESS: &str = r#"// Host emulation of the CUDA kernels: every CUDA thread of a block is a
// fiber on one OS thread; blocks run one after another; __syncthreads and
// warp shuffles are barriers that yield to a round-robin scheduler; mma.sync
// is computed from the fragments of all 32 lanes.
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>
#include <algorithm>

struct bx_dim3 { unsigned x = 0, y = 0, z = 0; };
static bx_dim3 threadIdx, blockIdx, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n)
#define __restrict__
#define BX_HOST_EMULATION 1
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct uint2 { unsigned x, y; };
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
alignas(16) unsigned char bx_smem[1 << 20];

constexpr unsigned BX_MAX_THREADS = 1024;
constexpr size_t BX_STACK = 256 * 1024;
struct bx_fiber { ucontext_t ctx; bool done; };
static ucontext_t bx_main;
static bx_fiber bx_fibers[BX_MAX_THREADS];
static unsigned bx_current;
static const std::function<void()>* bx_body;
struct bx_barrier { unsigned n = 0, count = 0, generation = 0; };
static bx_barrier bx_block_barrier, bx_warp_barrier[BX_MAX_THREADS / 32];
static void bx_wait(bx_barrier& b) {
    const unsigned g = b.generation;
    if (++b.count == b.n) {
        b.count = 0;
        ++b.generation;
        return;
    }
    while (b.generation == g) swapcontext(&bx_fibers[bx_current].ctx, &bx_main);
}
inline void __syncthreads() { bx_wait(bx_block_barrier); }
inline void bx_warp_sync() { bx_wait(bx_warp_barrier[bx_current / 32]); }
static float bx_xchg[BX_MAX_THREADS];
inline float __shfl_xor_sync(unsigned, float x, int o) {
    bx_xchg[bx_current] = x;
    bx_warp_sync();
    const float r = bx_xchg[bx_current ^ (unsigned)o];
    bx_warp_sync();
    return r;
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned bx_bits(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
using std::min;
using std::max;
// Fibers switch only at barriers, so a read-modify-write is atomic.
inline unsigned atomicMax(unsigned* p, unsigned v) { const unsigned o = *p; if (v > o) *p = v; return o; }
inline unsigned atomicExch(unsigned* p, unsigned v) { const unsigned o = *p; *p = v; return o; }
inline unsigned atomicOr(unsigned* p, unsigned v) { const unsigned o = *p; *p = o | v; return o; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    const unsigned long long o = *p;
    *p = o + v;
    return o;
}
inline unsigned __float_as_uint(float f) { return bx_bits(f); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline long long __float2ll_rn(float x) { return (long long)std::nearbyint((double)x); } // ties to even
inline void __threadfence() {}
inline float bx_f16_bits_to_f32(unsigned short x) { _Float16 h; std::memcpy(&h, &x, 2); return (float)h; }

#if BX_HOST_DTYPE == 1 // f16
inline float bx_to_f32(unsigned short x) { _Float16 h; std::memcpy(&h, &x, 2); return (float)h; }
inline unsigned short bx_from_f32(float x) { _Float16 h = (_Float16)x; unsigned short r; std::memcpy(&r, &h, 2); return r; }
#elif BX_HOST_DTYPE == 2 // bf16
inline float bx_to_f32(unsigned short x) { return __uint_as_float(((unsigned)x) << 16); }
inline unsigned short bx_from_f32(float x) {
    unsigned u = bx_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
#endif

#if BX_HOST_DTYPE != 0
static float bx_mA[32][16][16];
static float bx_mB[32][16][8];
inline void bx_mma_sync(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t2 = (lane & 3) * 2;
    auto lo = [](unsigned x) { return bx_to_f32((unsigned short)(x & 0xffffu)); };
    auto hi = [](unsigned x) { return bx_to_f32((unsigned short)(x >> 16)); };
    float (&A)[16][16] = bx_mA[w];
    float (&B)[16][8] = bx_mB[w];
    A[g][t2] = lo(a0); A[g][t2 + 1] = hi(a0);
    A[g + 8][t2] = lo(a1); A[g + 8][t2 + 1] = hi(a1);
    A[g][t2 + 8] = lo(a2); A[g][t2 + 9] = hi(a2);
    A[g + 8][t2 + 8] = lo(a3); A[g + 8][t2 + 9] = hi(a3);
    B[t2][g] = lo(b0); B[t2 + 1][g] = hi(b0);
    B[t2 + 8][g] = lo(b1); B[t2 + 9][g] = hi(b1);
    bx_warp_sync();
    for (int q = 0; q < 4; ++q) {
        const int r = g + 8 * (q >> 1), n = t2 + (q & 1);
        float s = 0.0f;
        for (int k = 0; k < 16; ++k) s += A[r][k] * B[k][n];
        c[q] += s;
    }
    bx_warp_sync();
}
#endif

static void bx_entry() {
    (*bx_body)();
    bx_fibers[bx_current].done = true; // returns to bx_main through uc_link
}

static void launch(bx_dim3 grid, unsigned threads, const std::function<void()>& body) {
    static std::unique_ptr<char[]> stacks(new char[BX_STACK * BX_MAX_THREADS]);
    bx_body = &body;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                blockDim = {threads, 1, 1};
                bx_block_barrier = {threads, 0, 0};
                for (unsigned w = 0; w < threads / 32; ++w) bx_warp_barrier[w] = {32, 0, 0};
                std::memset(bx_smem, 0xff, sizeof bx_smem); // garbage: nothing may read unwritten shared memory
                for (unsigned t = 0; t < threads; ++t) {
                    bx_fiber& f = bx_fibers[t];
                    f.done = false;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = stacks.get() + BX_STACK * t;
                    f.ctx.uc_stack.ss_size = BX_STACK;
                    f.ctx.uc_link = &bx_main;
                    makecontext(&f.ctx, bx_entry, 0);
                }
                for (unsigned left = threads; left > 0;) {
                    left = 0;
                    for (unsigned t = 0; t < threads; ++t) {
                        if (bx_fibers[t].done) continue;
                        bx_current = t;
                        threadIdx = {t, 0, 0};
                        swapcontext(&bx_main, &bx_fibers[t].ctx);
                        left += !bx_fibers[t].done;
                    }
                }
            }
}

// ---- the kernels under test (the prelude above ends here) ----
#include "kernel.cu"
#include "summary.cu"

static std::vector<float> read_f32(const char* path, size_t n) {
    std::vector<float> v(n);
    FILE* f = std::fopen(path, "rb");
    if (!f || std::fread(v.data(), 4, n, f) != n) { std::fprintf(stderr, "reading %s\n", path); std::exit(2); }
    std::fclose(f);
    return v;
}
static void write_f32(const char* path, const std::vector<float>& v) {
    FILE* f = std::fopen(path, "wb");
    std::fwrite(v.data(), 4, v.size(), f);
    std::fclose(f);
}
static std::vector<unsigned> read_words(const char* path) {
    std::vector<unsigned> v;
    FILE* f = std::fopen(path, "rb");
    if (!f) { std::fprintf(stderr, "reading %s\n", path); std::exit(2); }
    unsigned w;
    while (std::fread(&w, 4, 1, f) == 1) v.push_back(w);
    std::fclose(f);
    return v;
}
static void write_words(const char* path, const unsigned* v, size_t n) {
    FILE* f = std::fopen(path, "wb");
    std::fwrite(v, 4, n, f);
    std::fclose(f);
}
static std::vector<unsigned char> read_bytes(const char* path, size_t n) {
    std::vector<unsigned char> v(n);
    FILE* f = std::fopen(path, "rb");
    if (!f || std::fread(v.data(), 1, n, f) != n) { std::fprintf(stderr, "reading %s\n", path); std::exit(2); }
    std::fclose(f);
    return v;
}
static std::vector<float> read_f32s(const char* path) {
    const auto w = read_words(path);
    std::vector<float> v(w.size());
    std::memcpy(v.data(), w.data(), 4 * w.size());
    return v;
}
static std::vector<elem_t> to_elem(const std::vector<float>& v) {
    std::vector<elem_t> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = bx_from_f32(v[i]);
    return r;
}
static std::vector<float> to_f32(const std::vector<elem_t>& v) {
    std::vector<float> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = bx_to_f32(v[i]);
    return r;
}

// Usage: harness DIR batch heads_q heads_kv seq_q seq_k scale misalign. With
// misalign = 1 every element tensor starts one element past an aligned
// address (the kernels' element-by-element load path). Reads q, k, v,
// dout, params and the capture arena (its tensors placed, summaries to be
// made) from DIR; writes the rounded inputs and every result as f32, and
// the arena's error record.
int main(int argc, char** argv) {
    // Optional: the key layout (kv_lens, kv_pages, page_size, max_pages,
    // and a padded batch's q_lens).
    int kv_lens = -1, q_lens = -1, kv_pages = -1, page_size = 0, max_pages = 0;
    if (argc == 14) q_lens = std::atoi(argv[13]);
    if (argc == 13 || argc == 14) {
        kv_lens = std::atoi(argv[9]);
        kv_pages = std::atoi(argv[10]);
        page_size = std::atoi(argv[11]);
        max_pages = std::atoi(argv[12]);
    } else if (argc != 9) {
        return 2;
    }
    const int off = argv[8][0] == '1';
    const std::string dir = argv[1];
    const int B = std::atoi(argv[2]), Hq = std::atoi(argv[3]), Hkv = std::atoi(argv[4]);
    const int Sq = std::atoi(argv[5]), Sk = std::atoi(argv[6]);
    const float scale = std::strtof(argv[7], nullptr);
    auto path = [&](const char* n) { return dir + "/" + n; };
    // q, dq: D wide; out, dout: DV; k, dk: D; v, dv: DV.
    const size_t nr = (size_t)B * Hq * Sq, nq = nr * D, no = nr * DV;
    const size_t nk = (size_t)B * Hkv * Sk * D, nv = (size_t)B * Hkv * Sk * DV;
    auto q = to_elem(read_f32(path("q").c_str(), nq));
#if BX_KV_BYTES
    // An fp8 cache's bytes and scales, as stored.
    auto k = read_bytes(path("k").c_str(), nk);
    auto v = read_bytes(path("v").c_str(), nv);
    auto k_scale = read_f32s(path("k_scale").c_str());
    auto v_scale = read_f32s(path("v_scale").c_str());
#else
    auto k = to_elem(read_f32(path("k").c_str(), nk));
    auto v = to_elem(read_f32(path("v").c_str(), nv));
    std::vector<float> k_scale, v_scale; // none: null
#endif
    auto dout = to_elem(read_f32(path("dout").c_str(), no));
    Params params;
    {
        auto words = read_words(path("params").c_str());
        if (words.size() * 4 != sizeof params) { std::fprintf(stderr, "params: %zu words\n", words.size()); return 2; }
        std::memcpy(&params, words.data(), sizeof params);
    }
    std::vector<elem_t> out(no), dq(nq), dk(nk), dv(nv);
    for (auto* t : {&q, &dout, &out, &dq, &dk, &dv})
        if (off) t->insert(t->begin(), (elem_t)0);
    for (auto* t : {&k, &v})
        if (off) t->insert(t->begin(), (kv_t)0);
    std::vector<float> lse(nr), delta(nr);
    {
        // The backward's pre-pass adds each row's rowsum(dO ∘ O) to -dlse.
        const auto dlse = read_f32s(path("dlse").c_str());
        for (size_t i = 0; i < nr && i < dlse.size(); ++i) delta[i] = -dlse[i];
    }
    auto captures = read_words(path("captures").c_str());
    // The summaries, then the launches of every kernel, written from their
    // descriptions.
#include "launches.inc"
    write_words(path("record").c_str(), captures.data(), 8);
    write_words(path("arena").c_str(), captures.data(), captures.size());
    for (auto* t : {&q, &dout, &out, &dq, &dk, &dv})
        if (off) t->erase(t->begin());
    for (auto* t : {&k, &v})
        if (off) t->erase(t->begin());
    write_f32(path("q.rounded").c_str(), to_f32(q));
#if !BX_KV_BYTES
    write_f32(path("k.rounded").c_str(), to_f32(k));
    write_f32(path("v.rounded").c_str(), to_f32(v));
#endif
    write_f32(path("dout.rounded").c_str(), to_f32(dout));
    write_f32(path("out").c_str(), to_f32(out));
    write_f32(path("lse").c_str(), lse);
    write_f32(path("max_scores").c_str(), std::vector<float>(max_scores.begin(), max_scores.begin() + nr));
    write_f32(path("dq").c_str(), to_f32(dq));
    write_f32(path("dk").c_str(), to_f32(dk));
    write_f32(path("dv").c_str(), to_f32(dv));
    return 0;
}
"#;

pub(crate) fn find_cxx() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("BOOSTR_CXX") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| [d.join("c++"), d.join("g++")])
        .find(|p| p.is_file())
}

fn write_f32(path: &Path, v: &[f32]) {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// Largest `|got - want|` over the largest `|want|` (1 if all are 0); −inf
/// must match −inf exactly.
fn relative_error(name: &str, got: &[f32], want: &[f64]) -> Result<f64, String> {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let mut err = 0.0f64;
    let mut max = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w == f64::NEG_INFINITY || g == f32::NEG_INFINITY {
            if f64::from(g) != w {
                return Err(format!("{name}[{i}] = {g}, want {w}"));
            }
            continue;
        }
        if !g.is_finite() {
            return Err(format!("{name}[{i}] = {g}, want {w}"));
        }
        err = err.max((f64::from(g) - w).abs());
        max = max.max(w.abs());
    }
    Ok(err / if max > 0.0 { max } else { 1.0 })
}

/// The f64 reference of one case: `(problem, [q, k, v, dout, dlse])` →
/// [`RESULTS`] (the gradients of a loss that reads out and lse), the
/// learnable tensors' gradients, and the field of a read out of range, if
/// the reference made one.
type Reference = Box<
    dyn Fn(&Problem, [&[f64]; 5]) -> ([Vec<f64>; 6], Vec<Vec<f64>>, Option<&'static str>)
        + Send
        + Sync,
>;

/// The results the harness writes and every case compares, in order.
const RESULTS: [&str; 6] = ["out", "lse", "max_scores", "dq", "dk", "dv"];

struct HostCase {
    tag: String,
    /// Element tensors start 1 element past an aligned address.
    misalign: bool,
    declared: Declared,
    dtype: CudaDType,
    problem: Problem,
    params: ParamWords,
    /// The capture arena before the kernels: error words and gradient
    /// accumulators zeroed, tensors placed; the summaries are the kernels'
    /// to make, by `jobs`.
    arena: Vec<u32>,
    /// Each learnable tensor's name and its accumulators' first word.
    grads: Vec<(&'static str, usize)>,
    /// A forward over a KV cache: the inputs as the kernels see them (k, v
    /// as the cache holds them, spare slots NaN), the forward's key layout
    /// arguments, and the expected [`RESULTS`] (the CPU's, itself checked
    /// against the f64 reference).
    cache: Option<CacheCase>,
    /// A forward over an fp8 cache (its backward is an error): run and
    /// compared on its own.
    fp8: Option<Fp8Case>,
    /// Key splits of the forward (1: unsplit).
    splits: u32,
    jobs: Vec<SummaryJob>,
    /// Per `(b·Hkv + hk)·Sk + j`: no query sees the key (its K and V rows
    /// get NaN and infinities).
    hidden: Vec<bool>,
    reference: Reference,
}

fn host_case<V: Variant>(variant: V, dtype: CudaDType, problem: Problem) -> HostCase
where
    V::Host: 'static,
{
    let tag = format!(
        "{} {} D={} B={} H={}/{} S={}/{}",
        <V as Variant>::NAME,
        dtype.name(),
        dims_name((problem.head_dim as u32, problem.head_dim_v as u32)),
        problem.batch,
        problem.heads_q,
        problem.heads_kv,
        problem.seq_q,
        problem.seq_k
    );
    // A dropout variant draws from a fixed seed: the call's state in the
    // block's last words, as the runtime writes it.
    let problem = if <V::Host as HostVariant>::WEIGHTS.dropout {
        let dropout = boostr_runtime::Dropout::new(variant.dropout(), 0x5eed_d0d0, 7);
        problem.with_dropout(dropout.expect("p in [0, 1)"))
    } else {
        problem
    };
    // The call's window (a ring's call: positions shifted, the sink in
    // one call per row), as the runtime writes it.
    let window = variant.window();
    let tag = match window.whole {
        Some(_) => format!(
            "{tag} window q{:+} kv{:+}{}",
            window.q_shift,
            window.kv_shift,
            if window.sink { " with the sink" } else { "" }
        ),
        None => tag,
    };
    let mut params =
        variant
            .param_words()
            .with_window(window.q_shift, window.kv_shift, window.sink);
    if <V::Host as HostVariant>::WEIGHTS.dropout {
        let at = kernels_spec::dropout::Word::Threshold.index();
        params.0[at..at + kernels_spec::dropout::DROPOUT_WORDS]
            .copy_from_slice(&problem.dropout.words());
    }
    let captured = window.captured(&problem);
    let tensors: Vec<Tensor<CpuRuntime>> = variant
        .captures()
        .iter()
        .map(|c| {
            c.on::<CpuRuntime>(&captured)
                .expect("the case's tensors fit")
        })
        .collect();
    let shapes: Vec<&[usize]> = tensors.iter().map(|t| t.shape()).collect();
    let layout = Arena::new(&shapes, V::SUMMARIES, V::LEARNABLE);
    let mut arena = vec![0u32; layout.words];
    for (t, &at) in tensors.iter().zip(&layout.tensors) {
        let words: Vec<u32> = t.to_vec();
        arena[at..at + words.len()].copy_from_slice(&words);
    }
    // Poison the summaries: the kernels must make them.
    if let Some(&first) = layout.summaries.first() {
        arena[first..layout.grad_start].fill(0xdead_beef);
    }
    let grads = V::LEARNABLE
        .iter()
        .zip(&layout.grads)
        .map(|(&t, &at)| (V::TENSORS[t].name, at))
        .collect();
    let jobs = (0..V::SUMMARIES.len())
        .map(|s| layout.job(s, &shapes, V::SUMMARIES))
        .collect();
    let host = variant.host(&problem).expect("the case's tensors fit");
    let hidden = seen_keys(&host, &problem).iter().map(|s| !s).collect();
    HostCase {
        tag,
        misalign: false,
        declared: declared::<V>(),
        dtype,
        problem,
        params,
        arena,
        grads,
        cache: None,
        fp8: None,
        splits: 1,
        jobs,
        hidden,
        reference: Box::new(move |p, [q, k, v, dout, dlse]| {
            let f = reference_forward::<f64, _>(&host, p, q, k, v);
            let g = reference_backward_lse::<f64, _>(&host, p, [q, k, v], (dout, dlse));
            let oob = host.out_of_range().map(|e| match e {
                boostr_runtime::Error::IndexOutOfRange { field, .. } => field,
                _ => "?",
            });
            (
                [f.out, f.lse, f.max_scores, g.dq, g.dk, g.dv],
                g.tensors,
                oob,
            )
        }),
    }
}

struct CacheCase {
    inputs: [Vec<f32>; 4],
    kv: [i32; 4],
    /// A padded batch's query lengths' arena word (the harness's last
    /// argument), or none.
    q_lens: Option<i32>,
    /// [`RESULTS`], `dk` and `dv` in each sequence's slots.
    want: Vec<Vec<f64>>,
    /// The gradient of the loss with respect to `lse` (zero where none).
    dlse: Option<Vec<f32>>,
    /// The learnable tensors' gradients (the CPU's), where compared.
    tensors: Vec<Vec<f64>>,
}

/// A forward and backward over a KV cache of `lens` (f32): contiguous, or
/// with `page_size`, in `B · max_pages` pages in shuffled order; lengths
/// and page table after the arena's words.
fn host_cache_case<V: Variant>(
    variant: V,
    problem: Problem,
    lens: &[i32],
    page_size: Option<usize>,
) -> HostCase
where
    V::Host: 'static,
{
    let mut case = host_case(variant.clone(), CudaDType::F32, problem);
    let p = case.problem;
    let (d, dv, cap) = (p.head_dim, p.head_dim_v, p.seq_k);
    let mut rng = Rng::new(0xcac4e, lens.len() as u64);
    let q = rng.normal_f32(p.q_len(), 1.0);
    let mut k = rng.normal_f32(p.k_len(), 1.0);
    let mut v = rng.normal_f32(p.v_len(), 1.0);
    for (row, (kr, vr)) in k.chunks_mut(d).zip(v.chunks_mut(dv)).enumerate() {
        if row % cap >= lens[row / (p.heads_kv * cap)] as usize {
            kr.fill(f32::NAN);
            vr.fill(f32::INFINITY);
        }
    }
    let host_lens: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
    let host = variant.host(&p).expect("the case's tensors fit");
    let (mut out, mut lse) = (vec![0.0f32; p.out_len()], vec![0.0f32; p.lse_len()]);
    boostr_runtime::cpu::forward_cache_tiled(
        &host,
        &p,
        boostr_runtime::cpu::CpuTiles::DEFAULT,
        boostr_runtime::cpu::CacheLayout::lengths(&host_lens),
        &q,
        &k,
        &v,
        &mut out,
        &mut lse,
    );
    let lens_word = case.arena.len();
    case.arena.extend(lens.iter().map(|&l| l as u32));
    let kv = [lens_word as i32, -1, 0, 0];
    let dout = rng.normal_f32(p.out_len(), 1.0);
    // The backward over the contiguous cache: the kernels read the keys in
    // place or through the pages, and write dK and dV into each sequence's
    // slots either way (the runtime folds a paged call's into its pages).
    let mut want = vec![
        out.clone(),
        lse.clone(),
        cpu_max_scores(&variant, &p, [&q, &k, &v], lens),
    ];
    let (mut dq, mut dk, mut dv) = (
        vec![0.0f32; p.q_len()],
        vec![0.0f32; p.k_len()],
        vec![0.0f32; p.v_len()],
    );
    let inputs = boostr_runtime::cpu::BackwardInputs {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        lse: &lse,
        dout: &dout,
        dlse: None,
    };
    boostr_runtime::cpu::backward(
        &variant,
        &p,
        Some(boostr_runtime::cpu::CacheLayout::lengths(&host_lens)),
        inputs,
        &mut dq,
        &mut dk,
        &mut dv,
        &[],
    )
    .expect("the case's tensors fit");
    want.extend([dq, dk, dv]);
    case.tag.push_str(&format!(" cache {lens:?}"));
    case.hidden.iter_mut().for_each(|h| *h = false);
    case.cache = Some(CacheCase {
        inputs: [q, k, v, dout],
        kv,
        q_lens: None,
        want: want
            .iter()
            .map(|t| t.iter().map(|&x| f64::from(x)).collect())
            .collect(),
        dlse: None,
        tensors: Vec::new(),
    });
    match page_size {
        Some(ps) => in_pages(case, ps),
        None => case,
    }
}

/// The rows' largest scores of the CPU's forward over a cache of `lens`.
fn cpu_max_scores<V: Variant>(
    variant: &V,
    p: &Problem,
    [q, k, v]: [&[f32]; 3],
    lens: &[i32],
) -> Vec<f32> {
    use boostr_runtime::{AttentionOptions, Keys, attention};
    let device = CpuDevice::new();
    let t = |x: &[f32], shape: [usize; 4]| {
        Tensor::<CpuRuntime>::from_slice(x, &shape, &device).expect("a CPU tensor")
    };
    let (qt, kt, vt) = (t(q, p.q_shape()), t(k, p.k_shape()), t(v, p.v_shape()));
    let lt = Tensor::<CpuRuntime>::from_slice(lens, &[lens.len()], &device).expect("lengths");
    let opts = AttentionOptions::default().with_max_scores();
    let y = attention(variant, &qt, Keys::cache(&kt, &vt, &lt), &opts).expect("the CPU's forward");
    y.max_scores.expect("asked for").to_vec()
}

/// A forward and backward of a right-padded batch (f32): sequence `b` has
/// `q_lens[b]` of the query rows and `kv_lens[b]` of the keys, the rest
/// garbage (finite past the rows, NaN and infinities past the keys); both
/// lengths after the arena's words. The loss reads `out` and `lse`. The
/// reference is the CPU's, through the same public op, learnable tensors'
/// gradients included.
fn host_padded_case<V: Variant>(
    variant: V,
    problem: Problem,
    q_lens: &[i32],
    kv_lens: &[i32],
) -> HostCase
where
    V::Host: 'static,
{
    use boostr_runtime::{AttentionOptions, Backward, Keys, attention, attention_backward};
    let mut case = host_case(variant.clone(), CudaDType::F32, problem);
    let p = case.problem;
    let (d, dv, cap) = (p.head_dim, p.head_dim_v, p.seq_k);
    let mut rng = Rng::new(0x9add, q_lens.len() as u64);
    let q = rng.normal_f32(p.q_len(), 1.0);
    let mut k = rng.normal_f32(p.k_len(), 1.0);
    let mut v = rng.normal_f32(p.v_len(), 1.0);
    for (row, (kr, vr)) in k.chunks_mut(d).zip(v.chunks_mut(dv)).enumerate() {
        if row % cap >= kv_lens[row / (p.heads_kv * cap)] as usize {
            kr.fill(f32::NAN);
            vr.fill(f32::INFINITY);
        }
    }
    let dout = rng.normal_f32(p.out_len(), 1.0);
    let dlse = rng.normal_f32(p.lse_len(), 1.0);
    let device = CpuDevice::new();
    let t = |x: &[f32], shape: [usize; 4]| Tensor::<CpuRuntime>::from_slice(x, &shape, &device);
    let dl = Tensor::<CpuRuntime>::from_slice(&dlse, &p.lse_shape(), &device).expect("dlse");
    let lens = |x: &[i32]| Tensor::<CpuRuntime>::from_slice(x, &[x.len()], &device);
    let (qt, kt, vt, dt) = (
        t(&q, p.q_shape()).expect("q"),
        t(&k, p.k_shape()).expect("k"),
        t(&v, p.v_shape()).expect("v"),
        t(&dout, p.out_shape()).expect("dout"),
    );
    let (ql, kl) = (
        lens(q_lens).expect("q_lens"),
        lens(kv_lens).expect("kv_lens"),
    );
    let keys = Keys::padded(&kt, &vt, &ql, &kl);
    let opts = AttentionOptions::default().with_max_scores();
    let y = attention(&variant, &qt, keys, &opts).expect("the CPU's forward");
    let grads = Backward::new(&y, &dt).with_dlse(&dl);
    let g = attention_backward(&variant, &qt, keys, grads, &opts).expect("the CPU's backward");
    let max = y.max_scores.as_ref().expect("asked for");
    let want = [&y.out, &y.lse, max, &g.dq, &g.dk, &g.dv]
        .map(|t| t.to_vec::<f32>().iter().map(|&x| f64::from(x)).collect())
        .to_vec();
    let kv_word = case.arena.len();
    case.arena.extend(kv_lens.iter().map(|&l| l as u32));
    let q_word = case.arena.len();
    case.arena.extend(q_lens.iter().map(|&l| l as u32));
    case.tag
        .push_str(&format!(" padded rows {q_lens:?} keys {kv_lens:?}"));
    case.hidden.iter_mut().for_each(|h| *h = false);
    let wide = |t: &Tensor<CpuRuntime>| t.to_vec::<f32>().iter().map(|&x| f64::from(x)).collect();
    let tensors = g.tensors.iter().flatten().map(wide).collect();
    case.cache = Some(CacheCase {
        inputs: [q, k, v, dout],
        kv: [kv_word as i32, -1, 0, 0],
        q_lens: Some(q_word as i32),
        want,
        dlse: Some(dlse),
        tensors,
    });
    case
}

/// Where logical page `n` of `pages` lies: `(n·m + 2) mod pages`, `m` the
/// first stride from 5 coprime to `pages`, so that every page has its own
/// place (a permutation).
fn shuffled(pages: usize) -> impl Fn(usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let m = (5..)
        .find(|&m| gcd(m, pages) == 1)
        .expect("a coprime stride");
    move |n| (n * m + 2) % pages
}

/// `case` (over a cache or a padded batch) with its keys moved into
/// `B · max_pages` pages of `ps` in shuffled order, the page table after
/// the arena's words (a batch of mixed decodes and prefills reading pages,
/// when the case has query lengths); its results stay in each sequence's
/// slots, as the kernels write them (the runtime folds a paged call's dK
/// and dV into its pages).
fn in_pages(mut case: HostCase, ps: usize) -> HostCase {
    let p = case.problem;
    let (d, dv, cap) = (p.head_dim, p.head_dim_v, p.seq_k);
    let max_pages = cap / ps;
    let pages = p.batch * max_pages;
    let place = shuffled(pages);
    let table_word = case.arena.len() as i32;
    let c = case.cache.as_mut().expect("a cache or padded case");
    let (k, v) = (&c.inputs[1], &c.inputs[2]);
    let (mut kp, mut vp) = (vec![0.0f32; k.len()], vec![0.0f32; v.len()]);
    let mut table = vec![0u32; pages];
    for (n, entry) in table.iter_mut().enumerate() {
        let (b, lp) = (n / max_pages, n % max_pages);
        *entry = place(n) as u32;
        for h in 0..p.heads_kv {
            let from = (b * p.heads_kv + h) * cap + lp * ps;
            let to = (place(n) * p.heads_kv + h) * ps;
            kp[to * d..(to + ps) * d].copy_from_slice(&k[from * d..(from + ps) * d]);
            vp[to * dv..(to + ps) * dv].copy_from_slice(&v[from * dv..(from + ps) * dv]);
        }
    }
    c.inputs[1] = kp;
    c.inputs[2] = vp;
    c.kv[1..].copy_from_slice(&[table_word, ps as i32, max_pages as i32]);
    case.arena.extend(table);
    case.tag.push_str(&format!(" in pages of {ps}"));
    case
}

/// An fp8 KV cache as the forward reads it, and the f64 reference on its
/// dequantized values.
struct Fp8Case {
    kv: CudaKv,
    /// `k`, `v` as stored (one byte an element) and their scales (`[Hkv]`,
    /// or `[pages, Hkv]` with pages).
    k: Vec<u8>,
    v: Vec<u8>,
    k_scale: Vec<f32>,
    v_scale: Vec<f32>,
    q: Vec<f32>,
    /// The forward's key layout arguments (kv_lens, kv_pages, page_size,
    /// max_pages).
    kv_words: [i32; 4],
    /// `out`, `lse` and `max_scores` of the f64 reference over the dequantized cache (fp8
    /// value × scale, exact in f64) for `q` as the kernels rounded it.
    reference: ByteReference,
}

/// The f64 `out`, `lse` and `max_scores` of an fp8 case for the rounded
/// `q`.
type ByteReference = Box<dyn Fn(&[f64]) -> [Vec<f64>; 3] + Send + Sync>;

/// SplitMix64: the bytes of the fp8 cases.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The value of fp8 byte `b` (`None`: NaN or infinite), exactly.
fn byte_value(kv: CudaKv, b: u8) -> Option<f64> {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m, bias, mbits) = match kv {
        CudaKv::E4m3 if b & 0x7f == 0x7f => return None,
        CudaKv::E4m3 => (i32::from((b >> 3) & 0xf), f64::from(b & 7), 7, 8.0),
        CudaKv::E5m2 if (b >> 2) & 0x1f == 0x1f => return None,
        CudaKv::E5m2 => (i32::from((b >> 2) & 0x1f), f64::from(b & 3), 15, 4.0),
        CudaKv::I8 => return Some(f64::from(b as i8)),
        CudaKv::Elem => unreachable!("byte formats only"),
    };
    Some(if e == 0 {
        sign * m / mbits * 2f64.powi(1 - bias)
    } else {
        sign * (1.0 + m / mbits) * 2f64.powi(e - bias)
    })
}

/// A random finite fp8 byte of magnitude 2^-3 .. 2^4, or (one in eight)
/// a zero or subnormal.
fn random_byte(kv: CudaKv, state: &mut u64) -> u8 {
    let r = splitmix(state);
    let sign = ((r & 1) as u8) << 7;
    let low = ((r >> 8) & 7) as u8;
    let subnormal = (r >> 16) & 7 == 0;
    let step = ((r >> 24) % 7) as u8;
    match kv {
        CudaKv::E4m3 => sign | (if subnormal { 0 } else { 4 + step } << 3) | low,
        CudaKv::E5m2 => sign | (if subnormal { 0 } else { 12 + step } << 2) | (low & 3),
        // −20 ..= 20, or (one in eight) an end of the range: −128 or 127.
        CudaKv::I8 if subnormal => [0x80, 0x7f][(r & 1) as usize],
        CudaKv::I8 => (((r >> 24) % 41) as i8 - 20) as u8,
        CudaKv::Elem => unreachable!("byte formats only"),
    }
}

/// A forward with q in `dtype` over an fp8 cache (`kv`) holding `lens`
/// keys: contiguous with per-kv-head scales, or with `page_size` in `B ·
/// max_pages` pages in shuffled order with per-page scales. Live bytes are
/// random finite values (zeros and subnormals included); spare slots hold
/// NaN bytes (int8: −128) and pages wholly past a length NaN scales, which must never
/// be read. The reference runs per sequence over its own keys.
fn host_quantised_case<V: Variant>(
    variant: V,
    dtype: CudaDType,
    problem: Problem,
    kv: CudaKv,
    lens: &[i32],
    page_size: Option<usize>,
) -> HostCase
where
    V::Host: 'static,
{
    let mut case = host_case(variant.clone(), dtype, problem);
    let p = problem;
    let (d, dv, cap, hkv) = (p.head_dim, p.head_dim_v, p.seq_k, p.heads_kv);
    let mut state = 0xf8ca_c4e5 ^ (lens.len() as u64) << 32 ^ d as u64;
    let q = Rng::new(0xf8, d as u64).normal_f32(p.q_len(), 1.0);
    // Logical rows (b, h, j) of [B, Hkv, cap, ·]; spare slots NaN.
    // int8 has no NaN: its spare slots hold −128, which changes the
    // result wherever it is read.
    let nan = match kv {
        CudaKv::E4m3 => 0x7f,
        CudaKv::I8 => 0x80,
        _ => 0xff,
    };
    let mut fill = |width: usize| -> Vec<u8> {
        (0..p.batch * hkv * cap * width)
            .map(|i| {
                let row = i / width;
                if row % cap < lens[row / (hkv * cap)] as usize {
                    random_byte(kv, &mut state)
                } else {
                    nan
                }
            })
            .collect()
    };
    let (k, v) = (fill(d), fill(dv));
    // Scales in 0.02 .. 0.3, per (b, logical page, h) (one page of `cap`
    // slots per sequence when contiguous: then they apply per kv head).
    let ps = page_size.unwrap_or(cap);
    let max_pages = cap / ps;
    let mut scale = || 0.02 * 15f32.powf((splitmix(&mut state) >> 40) as f32 / (1u64 << 24) as f32);
    let n_scales = page_size.map_or(hkv, |_| p.batch * max_pages * hkv);
    let (ks, vs): (Vec<f32>, Vec<f32>) = (0..n_scales).map(|_| (scale(), scale())).unzip();
    let scale_of = |b: usize, lp: usize, h: usize| match page_size {
        None => h,
        Some(_) => (b * max_pages + lp) * hkv + h,
    };
    let deq = |bytes: &[u8], width: usize, scales: &[f32]| -> Vec<f64> {
        bytes
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let row = i / width;
                let (b, h, j) = (row / (hkv * cap), (row / cap) % hkv, row % cap);
                byte_value(kv, x)
                    .map_or(f64::NAN, |x| x * f64::from(scales[scale_of(b, j / ps, h)]))
            })
            .collect()
    };
    let (kd, vd) = (deq(&k, d, &ks), deq(&v, dv, &vs));
    let lens_word = case.arena.len();
    case.arena.extend(lens.iter().map(|&l| l as u32));
    let (kv_words, k, v, k_scale, v_scale) = match page_size {
        None => ([lens_word as i32, -1, 0, 0], k, v, ks, vs),
        Some(ps) => {
            let pages = p.batch * max_pages;
            let place = shuffled(pages);
            let table_word = case.arena.len();
            let (mut kp, mut vp) = (vec![0u8; k.len()], vec![0u8; v.len()]);
            let (mut kps, mut vps) = (vec![0f32; pages * hkv], vec![0f32; pages * hkv]);
            let mut table = vec![0u32; pages];
            for (n, entry) in table.iter_mut().enumerate() {
                let (b, lp) = (n / max_pages, n % max_pages);
                let page = place(n);
                *entry = page as u32;
                let past = lp * ps >= lens[b] as usize;
                for h in 0..hkv {
                    let from = (b * hkv + h) * cap + lp * ps;
                    let to = (page * hkv + h) * ps;
                    kp[to * d..(to + ps) * d].copy_from_slice(&k[from * d..(from + ps) * d]);
                    vp[to * dv..(to + ps) * dv].copy_from_slice(&v[from * dv..(from + ps) * dv]);
                    let (s_k, s_v) = (ks[scale_of(b, lp, h)], vs[scale_of(b, lp, h)]);
                    kps[page * hkv + h] = if past { f32::NAN } else { s_k };
                    vps[page * hkv + h] = if past { f32::NAN } else { s_v };
                }
            }
            case.arena.extend(table);
            let words = [
                lens_word as i32,
                table_word as i32,
                ps as i32,
                max_pages as i32,
            ];
            (words, kp, vp, kps, vps)
        }
    };
    let lens: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
    // Each sequence over its own keys (none: out 0, lse -inf).
    let sequences: Vec<(usize, Problem, V::Host)> = lens
        .iter()
        .enumerate()
        .filter(|(_, l)| **l > 0)
        .map(|(b, &len)| {
            let pb = Problem::new(1, (p.heads_q, hkv), (p.seq_q, len), d)
                .with_head_dim_v(dv)
                .with_scale(p.scale);
            (b, pb, variant.host(&pb).expect("the case's tensors fit"))
        })
        .collect();
    let reference = move |q: &[f64]| -> [Vec<f64>; 3] {
        let (mut out, mut lse) = (vec![0.0; p.out_len()], vec![f64::NEG_INFINITY; p.lse_len()]);
        let mut max = lse.clone();
        let rows = p.heads_q * p.seq_q;
        for (b, pb, host) in &sequences {
            let (b, len) = (*b, pb.seq_k);
            let keys = |x: &[f64], width: usize| -> Vec<f64> {
                (0..hkv)
                    .flat_map(|h| &x[((b * hkv + h) * cap) * width..][..len * width])
                    .copied()
                    .collect()
            };
            let f = reference_forward::<f64, _>(
                host,
                pb,
                &q[b * rows * d..][..rows * d],
                &keys(&kd, d),
                &keys(&vd, dv),
            );
            out[b * rows * dv..][..rows * dv].copy_from_slice(&f.out);
            lse[b * rows..][..rows].copy_from_slice(&f.lse);
            max[b * rows..][..rows].copy_from_slice(&f.max_scores);
        }
        [out, lse, max]
    };
    case.tag = format!(
        "{} {}",
        case.tag
            .replacen(dtype.name(), &format!("{}/{}", dtype.name(), kv.name()), 1),
        match page_size {
            None => format!("cache {lens:?}, per-head scales"),
            Some(ps) => format!("pages of {ps} {lens:?}, per-page scales"),
        }
    );
    case.hidden.iter_mut().for_each(|h| *h = false);
    case.fp8 = Some(Fp8Case {
        kv,
        k,
        v,
        k_scale,
        v_scale,
        q,
        kv_words,
        reference: Box::new(reference),
    });
    case
}

/// `case` with its forward in `splits` key splits, then merged.
fn split(mut case: HostCase, splits: u32) -> HostCase {
    case.splits = splits;
    case.tag.push_str(&format!(" in {splits} splits"));
    case
}

/// `case` with every element tensor one element past an aligned address.
fn misaligned(mut case: HostCase) -> HostCase {
    case.misalign = true;
    case.tag.push_str(" misaligned");
    case
}

/// The harness's launches of every kernel of `modules`, in order, written
/// from their descriptions: each on its described grid and block, with its
/// arguments by role (the harness names its arrays and sizes after them).
/// The forward runs in `splits` key splits, then the merge (as the
/// runtime runs it: the merge only after a split forward).
fn launches(
    modules: &[&Module],
    cfg: &CudaTiles,
    p: &Problem,
    jobs: &[SummaryJob],
    splits: u32,
) -> String {
    let sizes = kernels_spec::emit::interface::Sizes {
        batch: p.batch as u64,
        heads_q: p.heads_q as u64,
        heads_kv: p.heads_kv as u64,
        seq_q: p.seq_q as u64,
        seq_k: p.seq_k as u64,
        splits: splits.into(),
    };
    let mut s = format!(
        "    const int splits = {splits};\n    \
         std::vector<float> split_out((size_t)splits * nr * DV), split_lse((size_t)splits * nr);\n    \
         std::vector<float> max_scores((size_t)splits * nr, NAN);\n"
    );
    for job in jobs {
        let threads = kernels::SUMMARY_THREADS;
        let blocks = job.entries().div_ceil(u64::from(threads));
        let words: Vec<String> = job.words()[..7].iter().map(|w| format!("{w}u")).collect();
        s.push_str(&format!(
            "    launch({{{blocks}u, 1u, 1u}}, {threads}u, [&] {{ bx_summarize(captures.data(), {}); }});\n",
            words.join(", ")
        ));
    }
    for kernel in modules.iter().flat_map(|m| m.interfaces()) {
        if *kernel == kernels::MERGE && splits <= 1 {
            continue;
        }
        let dims = kernel.launch_dims(cfg, &sizes).expect("the grid fits");
        assert!(
            dims.smem_bytes <= 1 << 20,
            "{}: the harness has 1 MiB of shared memory",
            kernel.entry
        );
        let args: Vec<String> = kernel.args.iter().map(|a| host_arg(kernel, *a)).collect();
        let (x, y, z) = dims.grid;
        s.push_str(&format!(
            "    launch({{{x}u, {y}u, {z}u}}, {}u, [&] {{ {}({}); }});\n",
            dims.block,
            kernel.entry,
            args.join(", ")
        ));
    }
    s
}

/// The harness's expression for argument `a` of `kernel`.
fn host_arg(kernel: &Kernel, a: Arg) -> String {
    match a {
        // Element tensors may start `off` elements into their arrays.
        Arg::Buffer(b, _) if b.elem() == Elem::Input => format!("{}.data() + off", b.name()),
        Arg::Buffer(b, _) => format!("{}.data()", b.name()),
        Arg::Scalar(Scalar::Batch) => "B".into(),
        Arg::Scalar(Scalar::HeadsQ) => "Hq".into(),
        Arg::Scalar(Scalar::HeadsKv) => "Hkv".into(),
        Arg::Scalar(Scalar::SeqQ) => "Sq".into(),
        Arg::Scalar(Scalar::SeqK) => "Sk".into(),
        Arg::Scalar(Scalar::Scale) => "scale".into(),
        Arg::Scalar(Scalar::KvLens) => "kv_lens".into(),
        Arg::Scalar(Scalar::QLens) => "q_lens".into(),
        Arg::Scalar(Scalar::KvPages) => "kv_pages".into(),
        Arg::Scalar(Scalar::PageSize) => "page_size".into(),
        Arg::Scalar(Scalar::MaxPages) => "max_pages".into(),
        Arg::Scalar(Scalar::Splits) => "splits".into(),
        Arg::Scalar(s) => panic!("{}: {} has no host value", kernel.entry, s.name()),
        Arg::Params => "params".into(),
        Arg::Captures => "captures.data()".into(),
    }
}

fn run_host_case(case: &HostCase, cxx: &Path, serial: usize) -> Result<String, String> {
    let tag = &case.tag;
    let p = &case.problem;
    let dims = (p.head_dim as u32, p.head_dim_v as u32);
    let kv = case.fp8.as_ref().map_or(CudaKv::Elem, |c| c.kv);
    let cfg = tiles(&case.declared, dims, case.dtype).with_kv(kv);
    // An fp8 cache has a forward only.
    let modules: &[&Module] = if kv.bytes() {
        &[&kernels::FORWARD_MODULE]
    } else {
        &[
            &kernels::FORWARD_MODULE,
            &kernels::BACKWARD_MODULE,
            &kernels::TENSORS_MODULE,
        ]
    };
    let source = source(section(&case.declared), modules, &cfg).expect("the tiles validate");
    let dir =
        std::env::temp_dir().join(format!("boostr-cuda-host-{}-{serial}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{tag}: {e}"))?;
    std::fs::write(dir.join("harness.cpp"), HOST_HARNESS).map_err(|e| format!("{tag}: {e}"))?;
    std::fs::write(dir.join("kernel.cu"), &source).map_err(|e| format!("{tag}: {e}"))?;
    std::fs::write(dir.join("summary.cu"), kernels::SUMMARY_SOURCE)
        .map_err(|e| format!("{tag}: {e}"))?;
    std::fs::write(
        dir.join("launches.inc"),
        launches(modules, &cfg, p, &case.jobs, case.splits),
    )
    .map_err(|e| format!("{tag}: {e}"))?;
    let mut rng = Rng::new(0x5eed, serial as u64);
    let mut inputs = match &case.cache {
        Some(c) => [
            ("q", c.inputs[0].clone()),
            ("k", c.inputs[1].clone()),
            ("v", c.inputs[2].clone()),
            ("dout", c.inputs[3].clone()),
        ],
        None => [
            ("q", rng.normal_f32(p.q_len(), 1.0)),
            ("k", rng.normal_f32(p.k_len(), 1.0)),
            ("v", rng.normal_f32(p.v_len(), 1.0)),
            ("dout", rng.normal_f32(p.out_len(), 1.0)),
        ],
    };
    // Keys no query sees get NaN and infinities in K and V: they must not
    // reach any result.
    for (key, _) in case.hidden.iter().enumerate().filter(|(_, h)| **h) {
        for ((_, t), d) in inputs[1..3].iter_mut().zip([p.head_dim, p.head_dim_v]) {
            for (x, bad) in t[key * d..(key + 1) * d]
                .iter_mut()
                .zip([f32::NAN, f32::INFINITY, f32::NEG_INFINITY].iter().cycle())
            {
                *x = *bad;
            }
        }
    }
    if let Some(c) = &case.fp8 {
        inputs[0].1.clone_from(&c.q);
    }
    for (name, data) in &inputs {
        write_f32(&dir.join(name), data);
    }
    // d loss / d lse: drawn for a dense call (a cache's reference is the
    // CPU's backward of out alone).
    let dlse = match &case.cache {
        Some(c) => c.dlse.clone().unwrap_or_else(|| vec![0.0; p.lse_len()]),
        None => rng.normal_f32(p.lse_len(), 1.0),
    };
    write_f32(&dir.join("dlse"), &dlse);
    if let Some(c) = &case.fp8 {
        let write = |name: &str, bytes: &[u8]| {
            std::fs::write(dir.join(name), bytes).map_err(|e| format!("{tag}: {e}"))
        };
        write("k", &c.k)?;
        write("v", &c.v)?;
        write_f32(&dir.join("k_scale"), &c.k_scale);
        write_f32(&dir.join("v_scale"), &c.v_scale);
    }
    let arena: Vec<u8> = case.arena.iter().flat_map(|w| w.to_le_bytes()).collect();
    std::fs::write(dir.join("captures"), arena).map_err(|e| format!("{tag}: {e}"))?;
    std::fs::write(dir.join("params"), case.params.to_le_bytes())
        .map_err(|e| format!("{tag}: {e}"))?;
    let dtype_code = match case.dtype {
        CudaDType::F32 => 0,
        CudaDType::F16 => 1,
        CudaDType::Bf16 => 2,
    };
    // The harness, built once per (compiler, kernel source, launches).
    let flags = ["-std=c++20", "-O1", "-pthread", "-ffp-contract=off", "-w"];
    let define = format!("-DBX_HOST_DTYPE={dtype_code}");
    let launches = std::fs::read(dir.join("launches.inc")).map_err(|e| format!("{tag}: {e}"))?;
    let compiler = tool_cache::tool_identity(cxx);
    let flag_text = flags.join(" ");
    let key: [&[u8]; 7] = [
        &compiler,
        flag_text.as_bytes(),
        define.as_bytes(),
        HOST_HARNESS.as_bytes(),
        source.as_bytes(),
        kernels::SUMMARY_SOURCE.as_bytes(),
        &launches,
    ];
    let exe = tool_cache::file("harness", &key, |exe| {
        let out = Command::new(cxx)
            .args(flags)
            .arg(&define)
            .arg(dir.join("harness.cpp"))
            .arg("-o")
            .arg(exe)
            .output()
            .map_err(|e| format!("{tag}: running {}: {e}", cxx.display()))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{tag}: host compile failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    })?;
    let out = Command::new(&exe)
        .arg(&dir)
        .args([p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k].map(|x| x.to_string()))
        .arg(p.scale.to_string())
        .arg(if case.misalign { "1" } else { "0" })
        .args(case.cache.iter().flat_map(|c| c.kv.map(|w| w.to_string())))
        .args(
            case.cache
                .iter()
                .filter_map(|c| c.q_lens.map(|w| w.to_string())),
        )
        .args(
            case.fp8
                .iter()
                .flat_map(|c| c.kv_words.map(|w| w.to_string())),
        )
        .output()
        .map_err(|e| format!("{tag}: running the harness: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{tag}: the harness failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    // Bounds well above each dtype's rounding (P and dS are rounded to the
    // dtype for the tensor-core products) and far below what a wrong index,
    // mask or tile gives.
    let tolerance = match case.dtype {
        CudaDType::F32 => 1e-5,
        CudaDType::F16 => 3e-3,
        CudaDType::Bf16 => 2e-2,
    };
    // `label`'s relative error against `want`, on `line`; past the
    // tolerance, an error.
    let check = |line: &mut String, label: &str, got: &[f32], want: &[f64], note: &str| {
        let err = relative_error(label, got, want).map_err(|e| format!("{tag}: {e}"))?;
        line.push_str(&format!(" {label} {err:.1e}{note}"));
        if err > tolerance {
            return Err(format!(
                "{tag}: {label} relative error {err:.3e} > {tolerance:e}"
            ));
        }
        Ok(())
    };
    // An input as the kernels saw it (rounded to the element type).
    let rounded = |n: &str| -> Vec<f64> {
        read_f32(&dir.join(format!("{n}.rounded")))
            .into_iter()
            .map(f64::from)
            .collect()
    };
    let mut line = format!("{tag}:");
    if let Some(c) = &case.fp8 {
        for (name, want) in RESULTS.iter().zip((c.reference)(&rounded("q"))) {
            check(&mut line, name, &read_f32(&dir.join(name)), &want, "")?;
        }
        let _ = std::fs::remove_dir_all(&dir);
        return Ok(line);
    }
    let rounded = ["q", "k", "v", "dout"].map(rounded);
    let dlse: Vec<f64> = dlse.iter().map(|&x| f64::from(x)).collect();
    let (want, want_tensors, oob) = (case.reference)(
        p,
        [&rounded[0], &rounded[1], &rounded[2], &rounded[3], &dlse],
    );
    let record: Vec<u32> = std::fs::read(dir.join("record"))
        .map_err(|e| format!("{tag}: {e}"))?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    match (oob, record[0]) {
        (None, 0) => {}
        (Some(field), 0) => {
            return Err(format!(
                "{tag}: the reference read `{field}` out of range, the kernels recorded nothing"
            ));
        }
        (Some(_), site) => {
            // The result of a call that fails is not compared.
            let _ = std::fs::remove_dir_all(&dir);
            return Ok(format!(
                "{tag}: a read out of range recorded (site {})",
                site - 1
            ));
        }
        (None, site) => {
            return Err(format!(
                "{tag}: the kernels recorded a read out of range (site {}, {:?}) the reference \
                 did not make",
                site - 1,
                &record[1..5]
            ));
        }
    }
    let want_tensors = match &case.cache {
        Some(c) => {
            for (name, want) in RESULTS.iter().zip(&c.want) {
                let got = read_f32(&dir.join(name));
                check(&mut line, name, &got, want, " (vs the CPU)")?;
            }
            &c.tensors
        }
        None => {
            for (name, want) in RESULTS.iter().zip(&want) {
                check(&mut line, name, &read_f32(&dir.join(name)), want, "")?;
            }
            &want_tensors
        }
    };
    // The learnable tensors' gradients, from their fixed-point
    // accumulators, as the runtime decodes them.
    let words: Vec<u32> = std::fs::read(dir.join("arena"))
        .map_err(|e| format!("{tag}: {e}"))?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    if words[kernels_spec::params::GRAD_FLAG_WORD] != 0 {
        return Err(format!(
            "{tag}: gradient accumulators flagged {:#x}",
            words[kernels_spec::params::GRAD_FLAG_WORD]
        ));
    }
    for (&(name, at), want) in case.grads.iter().zip(want_tensors) {
        let got: Vec<f32> = words[at..at + 2 * want.len()]
            .chunks_exact(2)
            .map(|w| kernels_spec::params::grad_value(w[0], w[1]) as f32)
            .collect();
        check(&mut line, &format!("d{name}"), &got, want, "")?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(line)
}

#[test]
fn host_emulation_matches_the_reference() {
    let Some(cxx) = find_cxx() else {
        eprintln!("SKIPPED cuda host emulation: no C++ compiler (BOOSTR_CXX, c++ or g++ on PATH)");
        return;
    };
    let problem = |seq_q, seq_k, head_dim| Problem::new(2, (4, 2), (seq_q, seq_k), head_dim);
    let device = CpuDevice::new();
    let data = |p: Problem, stream| TestData::<CpuRuntime>::new(p, &device, 0x5eed, stream);
    let everything = Everything {
        cap: 20.0,
        slope: 0.25,
        window: 40,
        causal: true,
        alibi: true,
    };
    let everything_dv = everything.clone();
    let cases = [
        // Absorbed MLA decode (the longest case, so first): one token of 16
        // query heads on one latent kv head, D = 576 and Dv = 512, in key
        // splits of 2, 2 and 1 tiles.
        split(
            host_case(
                Softcap { cap: 30.0 },
                CudaDType::Bf16,
                Problem::new(1, (16, 1), (1, 130), 576).with_head_dim_v(512),
            ),
            3,
        ),
        // An fp8 cache of the absorbed decode: E4M3 K and V (V the first
        // 512 columns' width) under a bf16 query, 130 of 160 slots live, in
        // two key splits.
        split(
            host_quantised_case(
                Softcap { cap: 30.0 },
                CudaDType::Bf16,
                Problem::new(1, (16, 1), (1, 160), 576).with_head_dim_v(512),
                CudaKv::E4m3,
                &[130],
                None,
            ),
            2,
        ),
        host_case(everything.clone(), CudaDType::F32, problem(70, 97, 40)),
        host_case(everything.clone(), CudaDType::F16, problem(70, 97, 40)),
        host_case(everything, CudaDType::Bf16, problem(70, 97, 40)),
        // Sq > Sk: the first rows see no key (out 0, lse -inf, no gradient).
        host_case(PrefixLm { prefix: 0 }, CudaDType::F16, problem(97, 70, 64)),
        host_case(Causal, CudaDType::F32, problem(97, 70, 64)),
        // Decode with MQA: one query row, three query heads on one kv head,
        // packed in one block; unsplit and in three key splits.
        host_case(
            CausalSlidingWindow { window: 3 },
            CudaDType::F16,
            Problem::new(1, (3, 1), (1, 129), 128),
        ),
        split(
            host_case(
                Softcap { cap: 4.0 },
                CudaDType::Bf16,
                Problem::new(1, (3, 1), (1, 129), 128),
            ),
            3,
        ),
        host_case(
            SlidingWindow { window: 16 },
            CudaDType::F32,
            Problem::new(2, (4, 4), (77, 77), 96),
        ),
        misaligned(host_case(
            Softcap { cap: 5.0 },
            CudaDType::Bf16,
            problem(33, 33, 80),
        )),
        // Captured tensors: summaries made by the summary kernel, blocks
        // skipped from them, hidden keys full of NaN, a read out of range.
        host_case(
            CausalDocuments {
                doc: data(problem(97, 97, 64), 1).documents(),
            },
            CudaDType::F16,
            problem(97, 97, 64),
        ),
        host_case(
            Documents {
                doc: data(problem(70, 97, 40), 2).documents(),
            },
            CudaDType::F32,
            problem(70, 97, 40),
        ),
        host_case(
            KvLengths {
                len: data(problem(33, 97, 64), 3).lengths(),
            },
            CudaDType::Bf16,
            problem(33, 97, 64),
        ),
        host_case(
            AlibiSlopes {
                slopes: data(problem(40, 40, 64), 4).learnable(&[4], 0.0, 0.5),
            },
            CudaDType::F32,
            problem(40, 40, 64),
        ),
        // Speculative decoding: 9 draft rows of a random tree over 97 keys,
        // each seeing the prefix and its ancestors; whole and in key splits.
        host_case(
            data(problem(9, 97, 64), 5).draft_tree(),
            CudaDType::F16,
            problem(9, 97, 64),
        ),
        split(
            host_case(
                data(problem(9, 97, 64), 6).draft_tree(),
                CudaDType::F32,
                problem(9, 97, 64),
            ),
            2,
        ),
        // KV caches: lengths 0, 1, a key tile, capacity and between; pages
        // of whole and of partial key tiles (BKV is 64 at D = 64).
        host_cache_case(
            CausalSlidingWindow { window: 50 },
            Problem::new(5, (4, 1), (3, 192), 64),
            &[0, 1, 64, 192, 100],
            None,
        ),
        // Split-KV over a cache: some splits past a sequence's end.
        split(
            host_cache_case(
                CausalSlidingWindow { window: 50 },
                Problem::new(5, (4, 1), (3, 192), 64),
                &[0, 1, 64, 192, 100],
                None,
            ),
            2,
        ),
        host_cache_case(
            Softcap { cap: 10.0 },
            Problem::new(3, (4, 2), (17, 192), 64),
            &[192, 37, 130],
            Some(64),
        ),
        host_cache_case(
            Causal,
            Problem::new(3, (4, 2), (4, 192), 64),
            &[5, 192, 77],
            Some(24),
        ),
        split(
            host_cache_case(
                Causal,
                Problem::new(3, (4, 2), (1, 192), 64),
                &[5, 192, 77],
                Some(24),
            ),
            4,
        ),
        // A right-padded batch: a sequence of no rows, one of rows but no
        // keys, one of a partial query tile, one whole; rows of tiles past
        // a sequence's own skipped, and exactly 0.
        // A mixed batch over pages: decodes (1 row), a chunk of prefill,
        // an empty sequence, each at its own keys.
        in_pages(
            host_padded_case(
                CausalSoftcap { cap: 20.0 },
                Problem::new(4, (4, 2), (70, 128), 64),
                &[1, 70, 1, 0],
                &[97, 128, 33, 5],
            ),
            32,
        ),
        host_padded_case(
            CausalSlidingWindowSinks {
                window: 50,
                sinks: data(Problem::new(4, (4, 2), (70, 97), 64), 16).learnable(&[4], -2.0, 2.0),
            },
            Problem::new(4, (4, 2), (70, 97), 64),
            &[0, 5, 33, 70],
            &[40, 0, 97, 70],
        ),
        split(
            host_padded_case(
                Softcap { cap: 8.0 },
                Problem::new(4, (4, 1), (3, 192), 64),
                &[1, 3, 0, 2],
                &[192, 17, 64, 0],
            ),
            2,
        ),
        // Learnable tensors: gradients in the fixed-point accumulators.
        host_case(
            T5Bias {
                buckets: data(problem(45, 61, 32), 6).learnable(&[4, 32], -1.0, 1.0),
            },
            CudaDType::F16,
            problem(45, 61, 32),
        ),
        // Learned sinks; Sq > Sk, so some rows see only their sink. In
        // splits: the sink joins split 0, the later splits see nothing, and
        // the backward reads the merged lse.
        host_case(
            CausalSlidingWindowSinks {
                window: 5,
                sinks: data(problem(50, 37, 64), 7).learnable(&[4], -2.0, 2.0),
            },
            CudaDType::F32,
            problem(50, 37, 64),
        ),
        split(
            host_case(
                CausalSlidingWindowSinks {
                    window: 5,
                    sinks: data(problem(2, 300, 64), 8).learnable(&[4], -2.0, 2.0),
                },
                CudaDType::F16,
                problem(2, 300, 64),
            ),
            3,
        ),
        host_case(
            RelativeBias {
                table: data(problem(20, 20, 64), 5).f32s(&[4, 16], -1.0, 1.0),
                max_distance: 8,
            },
            CudaDType::F32,
            problem(20, 20, 64),
        ),
        // Calls of a ring: windows of a longer sequence at non-zero query
        // and key offsets, the variant at the whole sequence's positions
        // (its captured tensors span the whole sequence); the sink in the
        // calls that carry it only; the dropout draw at global positions.
        host_case(
            ring_call(
                Causal,
                problem(130, 130, 64),
                &problem(33, 70, 64),
                (60, 10),
                false,
            ),
            CudaDType::F32,
            problem(33, 70, 64),
        ),
        host_case(
            ring_call(
                CausalDocuments {
                    doc: data(problem(97, 97, 64), 11).documents(),
                },
                problem(97, 97, 64),
                &problem(33, 40, 64),
                (50, 30),
                false,
            ),
            CudaDType::F16,
            problem(33, 40, 64),
        ),
        host_case(
            ring_call(
                CausalSlidingWindowSinks {
                    window: 25,
                    sinks: data(problem(80, 80, 64), 12).learnable(&[4], -2.0, 2.0),
                },
                problem(80, 80, 64),
                &problem(20, 40, 64),
                (40, 10),
                true,
            ),
            CudaDType::F32,
            problem(20, 40, 64),
        ),
        host_case(
            ring_call(
                CausalSlidingWindowSinks {
                    window: 25,
                    sinks: data(problem(80, 80, 64), 13).learnable(&[4], -2.0, 2.0),
                },
                problem(80, 80, 64),
                &problem(20, 40, 64),
                (40, 10),
                false,
            ),
            CudaDType::F32,
            problem(20, 40, 64),
        ),
        host_case(
            ring_call(
                AlibiSlopes {
                    slopes: data(problem(64, 64, 64), 14).learnable(&[4], 0.0, 0.5),
                },
                problem(64, 64, 64).with_head_dim_v(32),
                &problem(24, 40, 64).with_head_dim_v(32),
                (40, 0),
                false,
            ),
            CudaDType::Bf16,
            problem(24, 40, 64).with_head_dim_v(32),
        ),
        host_case(
            ring_call(
                CausalDropout { p: 0.3 },
                problem(90, 90, 64),
                &problem(30, 30, 64),
                (60, 30),
                false,
            ),
            CudaDType::F16,
            problem(30, 30, 64),
        ),
        // Values of their own head dim (Dv ≠ D): q, k, dq, dk rows of D,
        // v, out, dout, dv rows of Dv, on every dtype, with GQA and Sq ≠ Sk.
        host_case(
            everything_dv.clone(),
            CudaDType::F32,
            problem(70, 97, 40).with_head_dim_v(24),
        ),
        misaligned(host_case(
            everything_dv.clone(),
            CudaDType::F16,
            problem(70, 97, 40).with_head_dim_v(24),
        )),
        host_case(
            everything_dv,
            CudaDType::Bf16,
            problem(70, 97, 40).with_head_dim_v(24),
        ),
        // MLA prefill.
        host_case(
            Causal,
            CudaDType::Bf16,
            problem(33, 80, 192).with_head_dim_v(128),
        ),
        // Values wider than the keys, with a learnable tensor.
        host_case(
            T5Bias {
                buckets: data(problem(45, 61, 32), 9).learnable(&[4, 32], -1.0, 1.0),
            },
            CudaDType::F16,
            problem(45, 61, 32).with_head_dim_v(48),
        ),
        // The widest tiles on CUDA cores (W > 256), values narrower.
        host_case(
            Softcap { cap: 8.0 },
            CudaDType::F32,
            Problem::new(1, (2, 1), (9, 21), 280).with_head_dim_v(40),
        ),
        // Learned sinks over key splits.
        split(
            host_case(
                CausalSlidingWindowSinks {
                    window: 5,
                    sinks: data(problem(2, 300, 64), 10).learnable(&[4], -2.0, 2.0),
                },
                CudaDType::F16,
                problem(2, 300, 64).with_head_dim_v(32),
            ),
            3,
        ),
        // fp8 caches: both formats, per-head scales in place and per-page
        // scales over shuffled pages (partial key tiles, a length of 0,
        // splits), q in every dtype, an unaligned cache (element loads).
        misaligned(host_quantised_case(
            CausalSlidingWindow { window: 50 },
            CudaDType::F16,
            Problem::new(3, (4, 2), (3, 192), 64),
            CudaKv::E5m2,
            &[0, 77, 192],
            None,
        )),
        split(
            host_quantised_case(
                Causal,
                CudaDType::F16,
                Problem::new(3, (4, 2), (4, 192), 64),
                CudaKv::E4m3,
                &[5, 192, 77],
                Some(24),
            ),
            3,
        ),
        host_quantised_case(
            Softcap { cap: 10.0 },
            CudaDType::Bf16,
            Problem::new(2, (4, 1), (17, 192), 128),
            CudaKv::E5m2,
            &[192, 100],
            Some(64),
        ),
        split(
            host_quantised_case(
                Causal,
                CudaDType::F32,
                Problem::new(2, (4, 2), (5, 96), 64).with_head_dim_v(32),
                CudaKv::E4m3,
                &[96, 41],
                Some(16),
            ),
            2,
        ),
        // int8 caches: per-page scales over shuffled pages in bf16 (tensor
        // cores), split; per-head scales in place in f32.
        split(
            host_quantised_case(
                Causal,
                CudaDType::Bf16,
                Problem::new(2, (4, 2), (3, 160), 64),
                CudaKv::I8,
                &[160, 29],
                Some(32),
            ),
            2,
        ),
        host_quantised_case(
            CausalSlidingWindow { window: 40 },
            CudaDType::F32,
            Problem::new(2, (2, 1), (6, 96), 40),
            CudaKv::I8,
            &[96, 0],
            None,
        ),
        // Dropout and sigmoid weights: dense in each element type, over
        // pages (the backward reads them), and sigmoid partials added in
        // splits over a cache.
        host_case(
            CausalDropout { p: 0.3 },
            CudaDType::F32,
            problem(45, 61, 40),
        ),
        host_case(
            CausalDropout { p: 0.3 },
            CudaDType::Bf16,
            problem(33, 64, 64),
        ),
        host_case(
            CausalSigmoid { bias: -1.0 },
            CudaDType::F16,
            problem(33, 40, 64),
        ),
        host_cache_case(
            CausalDropout { p: 0.25 },
            Problem::new(3, (4, 2), (4, 192), 64),
            &[5, 192, 77],
            Some(24),
        ),
        split(
            host_cache_case(
                CausalSigmoid { bias: 0.5 },
                Problem::new(3, (4, 2), (3, 192), 64).with_head_dim_v(32),
                &[0, 150, 77],
                None,
            ),
            3,
        ),
        // A KV cache (the backward too) and pages in splits.
        host_cache_case(
            CausalSlidingWindow { window: 50 },
            Problem::new(5, (4, 1), (3, 192), 64).with_head_dim_v(32),
            &[0, 1, 64, 192, 100],
            None,
        ),
        split(
            host_cache_case(
                Causal,
                Problem::new(3, (4, 2), (4, 192), 64).with_head_dim_v(32),
                &[5, 192, 77],
                Some(24),
            ),
            4,
        ),
    ];
    let next = AtomicUsize::new(0);
    let results = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..std::thread::available_parallelism().map_or(2, |n| n.get()) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(case) = cases.get(i) else { break };
                    let r = run_host_case(case, &cxx, i);
                    results.lock().unwrap().push(r);
                }
            });
        }
    });
    let results = results.into_inner().unwrap();
    let mut failures = Vec::new();
    for r in results {
        match r {
            Ok(line) => eprintln!("{line}"),
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
