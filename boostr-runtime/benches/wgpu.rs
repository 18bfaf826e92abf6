//! wgpu benchmark: boostr's WGSL kernels against the same attention composed
//! from numr's wgpu ops, forward and forward+backward (see `common` for what
//! is measured and how), on numr's default wgpu adapter.
//!
//! ```text
//! cargo bench -p boostr-runtime --features wgpu --bench wgpu              # S = 256, 512, 1024, D = 64
//! cargo bench -p boostr-runtime --features wgpu --bench wgpu -- --quick   # S = 256 only
//! ```

mod common;

use common::{BoxResult, Target};
use numr::runtime::Runtime;
use numr::runtime::wgpu::{WgpuDevice, WgpuRuntime, is_wgpu_available, wgpu_device};
use std::process::ExitCode;

struct Wgpu;

impl Target for Wgpu {
    type R = WgpuRuntime;
    const NAME: &'static str = "wgpu";
    const SEQS: &'static [usize] = &[256, 512, 1024];
    const DIMS: &'static [usize] = &[64];
    const CPU_BOUND: bool = false;
    fn device() -> BoxResult<WgpuDevice> {
        if !is_wgpu_available() {
            return Err("no wgpu adapter (on Linux without a GPU: install Mesa's \
                        lavapipe, `apt-get install mesa-vulkan-drivers libvulkan1`)"
                .into());
        }
        Ok(wgpu_device())
    }
    fn describe(device: &WgpuDevice) -> String {
        let info = WgpuRuntime::default_client(device)
            .wgpu_device()
            .adapter_info();
        format!(
            "adapter {} ({:?}, {:?})",
            info.name, info.device_type, info.backend
        )
    }
}

fn main() -> ExitCode {
    common::main::<Wgpu>()
}
