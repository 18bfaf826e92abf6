//! Golden snapshots of emitted kernels: the CUDA forward source (f16,
//! D = 64) and the WGSL forward module (D = 64) of the stock Gemma-2 style
//! variant (causal, soft-capped logits). A change to an emitter shows up here
//! as a reviewable diff; after checking it, rewrite the files with
//! `BOOSTR_BLESS=1 cargo test -p boostr-tests --test suite snapshots`.

use boostr_runtime::Variant;
use boostr_runtime::stock::CausalSoftcap;
use boostr_runtime::variant::Target;
use kernels_spec::emit::cuda::{self, CudaDType, CudaTiles};
use kernels_spec::emit::wgsl::{self, WgslTiles};
use std::path::PathBuf;

fn section(target: Target) -> &'static str {
    CausalSoftcap::compiled()
        .lowering(target)
        .expect("a stock variant has every lowering")
}

fn snapshot_path(name: &str) -> PathBuf {
    // Cargo sets the variable when it runs the test, too; that value follows
    // the checkout even where a shared target directory holds a binary
    // built from another one.
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("tests")
        .join("snapshots")
        .join(name)
}

/// Compares `actual` with the stored snapshot `name`, or rewrites it when
/// `BOOSTR_BLESS` is set.
fn check_snapshot(name: &str, actual: &str) {
    let path = snapshot_path(name);
    if std::env::var_os("BOOSTR_BLESS").is_some() {
        std::fs::write(&path, actual).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "reading {}: {e}\nto create it, run BOOSTR_BLESS=1 cargo test -p boostr-tests --test suite snapshots",
            path.display()
        )
    });
    if expected == actual {
        return;
    }
    let (exp, act): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), actual.lines().collect());
    let first = exp
        .iter()
        .zip(&act)
        .position(|(a, b)| a != b)
        .unwrap_or(exp.len().min(act.len()));
    let show = |lines: &[&str]| -> String {
        lines
            .iter()
            .enumerate()
            .skip(first.saturating_sub(2))
            .take(6)
            .map(|(i, l)| format!("{:5} {l}\n", i + 1))
            .collect()
    };
    panic!(
        "{name} differs from the emitted source at line {} ({} lines stored, {} emitted)\n\
         ---- stored ----\n{}---- emitted ----\n{}\
         If the change is intended, run BOOSTR_BLESS=1 cargo test -p boostr-tests --test suite snapshots \
         and review the diff of {}.",
        first + 1,
        exp.len(),
        act.len(),
        show(&exp),
        show(&act),
        path.display()
    );
}

#[test]
fn cuda_forward_f16_d64() {
    let cfg = CudaTiles::for_problem(64, 64, CudaDType::F16);
    let module = &cuda::kernels::FORWARD_MODULE;
    let source = cuda::source(section(Target::Cuda), &[module], &cfg).expect("default tiles");
    check_snapshot("causal_softcap.fwd.f16.d64.cu", &source);
}

#[test]
fn wgsl_forward_d64() {
    let cfg = WgslTiles::for_head_dim(64);
    let module = &wgsl::kernels::FORWARD;
    let source = wgsl::module_source(section(Target::Wgsl), module, &cfg).expect("default tiles");
    check_snapshot("causal_softcap.fwd.d64.wgsl", &source);
}
