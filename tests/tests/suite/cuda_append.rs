//! The CUDA cache writer (`bx_append_kv`): every (new rows' dtype, cache
//! format) compiles with NVRTC and assembles without local memory, and, run
//! on the host emulation of `cuda_compile` (every CUDA thread a fiber,
//! `__syncthreads` a barrier), writes the same bytes and scales as the CPU
//! writer, bit for bit: copies, fp8 and int8 with fixed scales per head
//! (saturating), and fp8 and int8 with scales per page that grow (the
//! page's other rows requantised) or start at 0.

use crate::cuda_compile::{
    HOST_HARNESS, assemble_and_check, find_cxx, find_ptxas, nvrtc, nvrtc_present,
};
use crate::tool_cache;
use boostr_runtime::AttentionRuntime;
use boostr_runtime::backend::{KvWrite, WriteScales};
use boostr_runtime::testing::{CpuRuntime, Rng};
use kernels_spec::emit::cuda::kernels;
use numr::dtype::DType;
use numr::runtime::cpu::CpuDevice;
use numr::tensor::Tensor;
use std::path::Path;
use std::process::Command;

/// The C++ program: the harness's fiber prelude, the writer, and a `main`
/// that reads the inputs, launches one block per group and writes the
/// cache and the scales back.
fn program() -> String {
    let prelude = HOST_HARNESS
        .split("// ---- the kernels under test")
        .next()
        .expect("the harness has a prelude");
    format!(
        "{prelude}
#include \"append.cu\"

static std::vector<unsigned char> read_all(const std::string& path) {{
    std::vector<unsigned char> v;
    FILE* f = std::fopen(path.c_str(), \"rb\");
    if (!f) {{ std::fprintf(stderr, \"reading %s\\n\", path.c_str()); std::exit(2); }}
    int c;
    while ((c = std::fgetc(f)) != EOF) v.push_back((unsigned char)c);
    std::fclose(f);
    return v;
}}
static void write_all(const std::string& path, const void* p, size_t n) {{
    FILE* f = std::fopen(path.c_str(), \"wb\");
    std::fwrite(p, 1, n, f);
    std::fclose(f);
}}

// Usage: append DIR dim page_rows grow. Reads src, dst, scales, groups,
// pairs; writes dst and scales over them.
int main(int argc, char** argv) {{
    if (argc != 5) return 2;
    const std::string dir = argv[1];
    const unsigned dim = std::atoi(argv[2]), page_rows = std::atoi(argv[3]), grow = std::atoi(argv[4]);
    auto src = read_all(dir + \"/src\"), dst = read_all(dir + \"/dst\"), scales = read_all(dir + \"/scales\");
    auto groups = read_all(dir + \"/groups\"), pairs = read_all(dir + \"/pairs\");
    const unsigned n_groups = groups.size() / 16;
    launch({{n_groups, 1, 1}}, BX_APPEND_THREADS, [&] {{
        bx_append_kv((const bx_append_src_t*)src.data(), (bx_append_dst_t*)dst.data(), (float*)scales.data(),
                     (const int*)groups.data(), (const int*)pairs.data(), dim, page_rows, grow);
    }});
    write_all(dir + \"/dst\", dst.data(), dst.size());
    write_all(dir + \"/scales\", scales.data(), scales.size());
    return 0;
}}
"
    )
}

/// The source's codes for a dtype pair (see `APPEND_SOURCE`).
fn codes(src: DType, dst: DType) -> (u32, u32) {
    let s = match src {
        DType::F32 => 0,
        DType::F16 => 1,
        _ => 2,
    };
    let d = match dst {
        DType::FP8E4M3 => 1,
        DType::FP8E5M2 => 2,
        DType::I8 => 3,
        _ => 0,
    };
    (s, d)
}

/// One write: `groups` units (pages) of `PAGE` rows per kv head, every
/// third unit's scale 0 (fresh), the others at random below or above what
/// the new rows need.
const PAGE: usize = 16;
const DIM: usize = 40;
const UNITS: usize = 6;

struct Write {
    src: Vec<u8>,
    dst: Vec<u8>,
    scales: Vec<f32>,
    groups: Vec<[i32; 4]>,
    pairs: Vec<[i32; 2]>,
}

fn bytes_of(x: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => x
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        _ => x
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

fn write_case(src_dtype: DType, dst_dtype: DType, grow: bool, rng: &mut Rng) -> Write {
    let quantised = matches!(dst_dtype, DType::FP8E4M3 | DType::FP8E5M2 | DType::I8);
    let elem = dst_dtype.size_in_bytes();
    // Existing rows: random bytes (fp8's NaN patterns included) for the
    // quantised formats, values for the others.
    let dst = if quantised {
        (0..UNITS * PAGE * DIM)
            .map(|_| (rng.normal_f32(1, 1.0)[0].to_bits() >> 7) as u8)
            .collect()
    } else {
        bytes_of(&rng.normal_f32(UNITS * PAGE * DIM, 1.0), dst_dtype)
    };
    debug_assert_eq!(dst.len(), UNITS * PAGE * DIM * elem);
    // Up to 40 new rows per unit (more elements than threads), at
    // distinct rows of the unit; unit 4 gets none.
    let mut groups = Vec::new();
    let mut pairs = Vec::new();
    let mut next_src = 0;
    for unit in 0..UNITS {
        let n = [1, 3, PAGE, 7, 0, 12][unit];
        if n == 0 {
            continue;
        }
        let start = pairs.len() as i32;
        let mut rows: Vec<usize> = (0..PAGE).collect();
        for i in (1..rows.len()).rev() {
            rows.swap(i, (rng.normal_f32(1, 1.0)[0].to_bits() as usize) % (i + 1));
        }
        for &row in &rows[..n] {
            pairs.push([next_src, (unit * PAGE + row) as i32]);
            next_src += 1;
        }
        let scale = if quantised { unit as i32 } else { -1 };
        let page_row = if grow { (unit * PAGE) as i32 } else { -1 };
        groups.push([start, pairs.len() as i32, scale, page_row]);
    }
    let x: Vec<f32> = rng
        .normal_f32(next_src as usize * DIM, 4.0)
        .into_iter()
        .collect();
    let scales = (0..UNITS)
        .map(|u| match u % 3 {
            0 if grow => 0.0,
            1 => 0.002,
            _ => 0.5,
        })
        .collect();
    Write {
        src: bytes_of(&x, src_dtype),
        dst,
        scales,
        groups,
        pairs,
    }
}

/// The CPU writer's result for `w`: the cache's bytes and the scales.
fn on_the_cpu(w: &Write, src_dtype: DType, dst_dtype: DType, grow: bool) -> (Vec<u8>, Vec<f32>) {
    let dev = CpuDevice::new();
    let rows = w.src.len() / DIM / src_dtype.size_in_bytes();
    let src =
        Tensor::<CpuRuntime>::from_bytes(&w.src, &[1, 1, rows, DIM], src_dtype, &dev).unwrap();
    let dst =
        Tensor::<CpuRuntime>::from_bytes(&w.dst, &[UNITS, 1, PAGE, DIM], dst_dtype, &dev).unwrap();
    let scales = Tensor::<CpuRuntime>::from_slice(&w.scales, &[UNITS], &dev).unwrap();
    let quantised = matches!(dst_dtype, DType::FP8E4M3 | DType::FP8E5M2 | DType::I8);
    // The keys and the values are the same write here: run it on two
    // copies and check both.
    let (dst_v, scales_v) = (
        Tensor::<CpuRuntime>::from_bytes(&w.dst, &[UNITS, 1, PAGE, DIM], dst_dtype, &dev).unwrap(),
        Tensor::<CpuRuntime>::from_slice(&w.scales, &[UNITS], &dev).unwrap(),
    );
    let write = KvWrite {
        k: &dst,
        v: &dst_v,
        k_new: &src,
        v_new: &src,
        groups: &w.groups,
        pairs: &w.pairs,
        page_rows: if grow { PAGE } else { 0 },
        scales: quantised.then_some(WriteScales {
            k: &scales,
            v: &scales_v,
            grow,
        }),
    };
    <CpuRuntime as AttentionRuntime>::write_kv(&write).expect("the CPU writes");
    assert_eq!(dst.to_bytes().unwrap(), dst_v.to_bytes().unwrap());
    (dst.to_bytes().unwrap(), scales.to_vec::<f32>())
}

fn on_the_host_emulation(w: &Write, exe: &Path, tag: &str, grow: bool) -> (Vec<u8>, Vec<f32>) {
    let dir = std::env::temp_dir().join(format!("boostr-append-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let flat = |x: &[i32]| -> Vec<u8> { x.iter().flat_map(|v| v.to_le_bytes()).collect() };
    std::fs::write(dir.join("src"), &w.src).unwrap();
    std::fs::write(dir.join("dst"), &w.dst).unwrap();
    std::fs::write(dir.join("scales"), bytes_of(&w.scales, DType::F32)).unwrap();
    std::fs::write(dir.join("groups"), flat(w.groups.as_flattened())).unwrap();
    std::fs::write(dir.join("pairs"), flat(w.pairs.as_flattened())).unwrap();
    let out = Command::new(exe)
        .arg(&dir)
        .arg(DIM.to_string())
        .arg((if grow { PAGE } else { 0 }).to_string())
        .arg(u32::from(grow).to_string())
        .output()
        .expect("the harness runs");
    assert!(
        out.status.success(),
        "{tag}: the harness failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dst = std::fs::read(dir.join("dst")).unwrap();
    let scales = std::fs::read(dir.join("scales"))
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    (dst, scales)
}

/// Every (new rows' dtype, cache format) pair the runtime compiles.
const PAIRS: [(DType, DType); 12] = [
    (DType::F32, DType::F32),
    (DType::F16, DType::F16),
    (DType::BF16, DType::BF16),
    (DType::F32, DType::FP8E4M3),
    (DType::F16, DType::FP8E4M3),
    (DType::BF16, DType::FP8E4M3),
    (DType::F32, DType::FP8E5M2),
    (DType::F16, DType::FP8E5M2),
    (DType::BF16, DType::FP8E5M2),
    (DType::F32, DType::I8),
    (DType::F16, DType::I8),
    (DType::BF16, DType::I8),
];

fn source((s, d): (u32, u32)) -> String {
    format!(
        "#define BX_APPEND_SRC {s}\n#define BX_APPEND_DST {d}\n{}",
        kernels::APPEND_SOURCE
    )
}

#[test]
fn the_cache_writer_compiles_for_every_pair_without_local_memory() {
    let ptxas = find_ptxas();
    if !nvrtc_present() || ptxas.is_none() {
        assert!(
            std::env::var_os("BOOSTR_TEST_REQUIRE_NVRTC").is_none(),
            "BOOSTR_TEST_REQUIRE_NVRTC is set but NVRTC or ptxas was not found"
        );
        eprintln!("SKIPPED the cache writer's compile: no NVRTC or ptxas");
        return;
    }
    let ptxas = ptxas.expect("checked");
    for (src, dst) in PAIRS {
        let tag = format!("append {src:?} → {dst:?}");
        let ptx = nvrtc(&source(codes(src, dst)), "compute_80", &tag).unwrap();
        assemble_and_check(&ptx, "sm_90", &ptxas, &tag, &["bx_append_kv"]).unwrap();
    }
}

#[test]
fn the_cache_writer_writes_the_cpu_writers_bytes_on_the_host_emulation() {
    let Some(cxx) = find_cxx() else {
        eprintln!("SKIPPED the cache writer's host emulation: no C++ compiler");
        return;
    };
    let text = program();
    let mut rng = Rng::new(0xa99e, 0);
    for (src, dst) in PAIRS {
        let (s, d) = codes(src, dst);
        let tag = format!("src{s}-dst{d}");
        let flags = ["-std=c++20", "-O1", "-ffp-contract=off", "-w"];
        let defines = [
            format!("-DBX_APPEND_SRC={s}"),
            format!("-DBX_APPEND_DST={d}"),
        ];
        let (flag_text, define_text) = (flags.join(" "), defines.join(" "));
        let key: [&[u8]; 5] = [
            &tool_cache::tool_identity(&cxx),
            flag_text.as_bytes(),
            define_text.as_bytes(),
            text.as_bytes(),
            kernels::APPEND_SOURCE.as_bytes(),
        ];
        let exe = tool_cache::file("append-harness", &key, |exe| {
            let dir = std::env::temp_dir()
                .join(format!("boostr-append-src-{}-{tag}", std::process::id()));
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            std::fs::write(dir.join("harness.cpp"), &text).map_err(|e| e.to_string())?;
            std::fs::write(dir.join("append.cu"), kernels::APPEND_SOURCE)
                .map_err(|e| e.to_string())?;
            let out = Command::new(&cxx)
                .args(flags)
                .args(&defines)
                .arg(dir.join("harness.cpp"))
                .arg("-o")
                .arg(exe)
                .output()
                .map_err(|e| e.to_string())?;
            let _ = std::fs::remove_dir_all(&dir);
            if out.status.success() {
                Ok(())
            } else {
                Err(format!("{tag}: {}", String::from_utf8_lossy(&out.stderr)))
            }
        })
        .unwrap();
        let quantised = d != 0;
        for grow in if quantised {
            [false, true].as_slice()
        } else {
            &[false]
        } {
            let w = write_case(src, dst, *grow, &mut rng);
            let (want_dst, want_scales) = on_the_cpu(&w, src, dst, *grow);
            let (got_dst, got_scales) = on_the_host_emulation(&w, &exe, &tag, *grow);
            let differ = want_dst.iter().zip(&got_dst).position(|(a, b)| a != b);
            assert!(
                differ.is_none() && want_dst.len() == got_dst.len(),
                "{tag} grow {grow}: the cache differs from the CPU's at byte {differ:?}"
            );
            if quantised {
                assert_eq!(got_scales, want_scales, "{tag} grow {grow}: the scales");
            }
            // The write did something: the cache changed.
            assert_ne!(got_dst, w.dst, "{tag}: nothing written");
        }
    }
}
