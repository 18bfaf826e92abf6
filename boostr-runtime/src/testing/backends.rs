//! The backends a check runs on: numr runtimes with attention kernels, and
//! how to get one of their devices.

use super::cases::{CASES, Case};
use crate::backend::AttentionRuntime;
use numr::ops::TensorOps;
use numr::runtime::Runtime;
use numr::runtime::cpu::{CpuDevice, CpuRuntime};

/// A backend under test: a numr runtime with attention kernels, and how to get
/// one of its devices.
///
/// [`Cpu`] is always available. GPU backends (wgpu, CUDA) implement this
/// behind their cargo features and return `None` from [`device`] when the
/// machine has no such device; the check is then skipped with a message
/// (or fails, when `BOOSTR_TEST_REQUIRE_DEVICE` is set).
///
/// [`device`]: TestBackend::device
pub trait TestBackend {
    /// The runtime whose kernels are checked.
    type Runtime: AttentionRuntime<Client: TensorOps<Self::Runtime>>;
    /// Short name, printed in every report.
    const NAME: &'static str;
    /// A device to run on, or `None` when this machine has none.
    fn device() -> Option<<Self::Runtime as Runtime>::Device>;
    /// The cases [`check_variant`](super::check_variant) runs: [`CASES`]
    /// unless the backend is too slow for them on the machines it is tested
    /// on.
    fn cases() -> &'static [Case] {
        CASES
    }
    /// The kernels read a broadcast (zero-stride) batch of keys in place,
    /// each kernel its own way: keys shared by a batch are checked on
    /// every case of batch ≥ 2, not only on the first (a backend that
    /// copies them runs one code path for them).
    const READS_STRIDED: bool = false;
}

/// numr's CPU runtime.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl TestBackend for Cpu {
    type Runtime = CpuRuntime;
    const NAME: &'static str = "cpu";
    const READS_STRIDED: bool = true;
    fn device() -> Option<CpuDevice> {
        Some(CpuDevice::new())
    }
    fn cases() -> &'static [Case] {
        super::cases::CPU_CASES
    }
}

/// numr's WebGPU runtime, on its default adapter. Checked on
/// [`SMALL_CASES`](super::SMALL_CASES): software adapters (Mesa lavapipe)
/// run the standard cases' largest shapes for minutes.
#[cfg(feature = "wgpu")]
#[derive(Clone, Copy, Debug, Default)]
pub struct Wgpu;

#[cfg(feature = "wgpu")]
impl TestBackend for Wgpu {
    type Runtime = numr::runtime::wgpu::WgpuRuntime;
    const NAME: &'static str = "wgpu";
    fn device() -> Option<numr::runtime::wgpu::WgpuDevice> {
        numr::runtime::wgpu::is_wgpu_available().then(numr::runtime::wgpu::wgpu_device)
    }
    fn cases() -> &'static [Case] {
        super::cases::SMALL_CASES
    }
}

/// numr's CUDA runtime on device 0, f32 inputs (the f16/bf16 kernels are
/// timed and checked by `bench/gpu.sh`).
#[cfg(feature = "cuda")]
#[derive(Clone, Copy, Debug, Default)]
pub struct Cuda;

#[cfg(feature = "cuda")]
impl TestBackend for Cuda {
    type Runtime = numr::runtime::cuda::CudaRuntime;
    const NAME: &'static str = "cuda";
    fn device() -> Option<numr::runtime::cuda::CudaDevice> {
        numr::runtime::cuda::is_cuda_available().then(numr::runtime::cuda::cuda_device)
    }
}

/// Environment variable: when set, a backend without a device fails
/// [`check_variant`](super::check_variant) instead of skipping it (for CI
/// machines that have one).
pub const REQUIRE_DEVICE_ENV: &str = "BOOSTR_TEST_REQUIRE_DEVICE";

/// `R`'s device, or `None` after saying why `what` is skipped; with
/// [`REQUIRE_DEVICE_ENV`] set, a missing device fails instead.
///
/// # Panics
///
/// When `R` has no device and [`REQUIRE_DEVICE_ENV`] is set.
pub(crate) fn device_or_skip<R: TestBackend>(
    what: &str,
) -> Option<<R::Runtime as Runtime>::Device> {
    let device = R::device();
    if device.is_none() {
        assert!(
            std::env::var_os(REQUIRE_DEVICE_ENV).is_none(),
            "boostr: no {} device, and {REQUIRE_DEVICE_ENV} is set",
            R::NAME
        );
        eprintln!("boostr: skipping {what}: no {} device", R::NAME);
    }
    device
}
