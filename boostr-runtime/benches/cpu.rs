//! CPU benchmark: boostr's fused attention against the same attention composed
//! from numr ops, forward and forward+backward (see `common` for what is
//! measured and how).
//!
//! ```text
//! cargo bench -p boostr-runtime --bench cpu                  # S = 1024, 2048, 4096
//! cargo bench -p boostr-runtime --bench cpu -- --quick       # S = 1024 only (CI smoke)
//! cargo bench -p boostr-runtime --bench cpu -- --seq 2048 --dim 128 --variant causal
//! BOOSTR_BENCH_REPS=9 cargo bench -p boostr-runtime --bench cpu
//! ```

mod common;

use common::{BoxResult, Target};
use numr::prelude::{CpuDevice, CpuRuntime};
use std::process::ExitCode;

struct Cpu;

impl Target for Cpu {
    type R = CpuRuntime;
    const NAME: &'static str = "CPU";
    const SEQS: &'static [usize] = &[1024, 2048, 4096];
    const DIMS: &'static [usize] = &[64, 128];
    const CPU_BOUND: bool = true;
    fn device() -> BoxResult<CpuDevice> {
        Ok(CpuDevice::new())
    }
    fn describe(_: &CpuDevice) -> String {
        format!("{} rayon threads", rayon::current_num_threads())
    }
}

fn main() -> ExitCode {
    common::main::<Cpu>()
}
