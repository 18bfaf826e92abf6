//! CUDA's cache writer: `bx_append_kv` (`emit/cuda/append.cu`), compiled
//! once per (new rows' dtype, cache format) and device, one block per
//! group of rows that share a scale.

use super::{TARGET, compute_capability, load};
use crate::backend::KvWrite;
use crate::error::{BackendError, Error, Result};
use crate::gpu::KernelCache;
use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use kernels_spec::emit::cuda::kernels;
use numr::dtype::DType;
use numr::runtime::cuda::{CudaClient, CudaRuntime};
use numr::runtime::{Device as _, Runtime};
use numr::tensor::Tensor;
use std::sync::{Arc, LazyLock};

struct AppendKernel {
    _module: Arc<CudaModule>,
    function: CudaFunction,
}

/// (device, compute capability, `BX_APPEND_SRC`, `BX_APPEND_DST`).
type AppendKey = (usize, (u32, u32), u32, u32);

static APPEND_CACHE: LazyLock<KernelCache<AppendKey, AppendKernel>> =
    LazyLock::new(KernelCache::default);

const KERNEL: &str = "bx_append_kv";

/// The source's `BX_APPEND_SRC` for the new rows' dtype and `BX_APPEND_DST`
/// for the cache's.
fn codes(src: DType, dst: DType) -> Result<(u32, u32)> {
    let bad = |name, dtype, supported| Error::DType {
        name,
        dtype,
        backend: "cuda",
        supported,
    };
    let s = match src {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        other => return Err(bad("k_new", other, "f32, f16, bf16")),
    };
    let d = match dst {
        DType::FP8E4M3 => 1,
        DType::FP8E5M2 => 2,
        DType::I8 => 3,
        d if d == src => 0,
        other => return Err(bad("the cache", other, "the new rows' dtype, fp8 or int8")),
    };
    Ok((s, d))
}

fn kernel(client: &CudaClient, device: usize, (s, d): (u32, u32)) -> Result<Arc<AppendKernel>> {
    let cc = compute_capability(device)?;
    Ok(APPEND_CACHE.get_or_build((device, cc, s, d), || {
        let name = format!("boostr_append_kv_src{s}_dst{d}.cu");
        let text = format!(
            "#define BX_APPEND_SRC {s}\n#define BX_APPEND_DST {d}\n{}",
            kernels::APPEND_SOURCE
        );
        let module = load(client, &text, &name, cc)?;
        let function = module
            .load_function(KERNEL)
            .map_err(|e| BackendError::Compile {
                target: TARGET,
                source_name: name.clone(),
                log: format!("no kernel {KERNEL}: {e}"),
            })?;
        Ok(AppendKernel {
            _module: module,
            function,
        })
    })?)
}

/// Run `w` on the device, on numr's stream: one launch for the keys, one
/// for the values.
pub(super) fn write_kv(w: &KvWrite<'_, CudaRuntime>) -> Result<()> {
    let device = w.k.device();
    let client = CudaRuntime::default_client(device);
    let kernel = kernel(&client, device.id(), codes(w.k_new.dtype(), w.k.dtype())?)?;
    let launch_error = |reason: String| BackendError::Launch {
        target: TARGET,
        kernel: KERNEL,
        reason,
    };
    let flat = |x: &[i32], n: usize| Tensor::<CudaRuntime>::from_slice(x, &[n], device);
    let groups = flat(w.groups.as_flattened(), 4 * w.groups.len())?;
    let pairs = flat(w.pairs.as_flattened(), 2 * w.pairs.len())?;
    let grid = u32::try_from(w.groups.len())
        .map_err(|_| launch_error(format!("{} groups", w.groups.len())))?;
    let page_rows = u32::try_from(w.page_rows)
        .map_err(|_| launch_error(format!("{} rows per page", w.page_rows)))?;
    let stream = client.stream();
    let jobs = [
        (w.k, w.k_new, w.scales.map(|s| s.k)),
        (w.v, w.v_new, w.scales.map(|s| s.v)),
    ];
    let grow = u32::from(w.scales.is_some_and(|s| s.grow));
    for (dst, src, scales) in jobs {
        let dim = *dst.shape().last().expect("a rank-4 cache");
        let dim = u32::try_from(dim).map_err(|_| launch_error(format!("head dim {dim}")))?;
        let (src_ptr, dst_ptr) = (src.ptr(), dst.ptr());
        let scales_ptr = scales.map_or(0u64, |s| s.ptr());
        let (groups_ptr, pairs_ptr) = (groups.ptr(), pairs.ptr());
        let mut builder = stream.launch_builder(&kernel.function);
        for p in [&src_ptr, &dst_ptr, &scales_ptr, &groups_ptr, &pairs_ptr] {
            builder.arg(p);
        }
        for x in [&dim, &page_rows, &grow] {
            builder.arg(x);
        }
        let config = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (kernels::APPEND_THREADS, 1, 1),
            // The amax reduction's floats (dynamic shared memory).
            shared_mem_bytes: 4 * kernels::APPEND_THREADS,
        };
        // SAFETY: `bx_append_kv(src, dst, scales, groups, pairs, dim,
        // page_rows, grow)`, in that order and of those types; `src` and
        // `dst` are contiguous numr allocations of rows of `dim` (their
        // dtypes the compiled pair's), every pair's rows inside them and
        // every scale index inside `scales` (checked by the plan on the
        // host), `groups` and `pairs` live until the stream passes them
        // (numr's stream-ordered allocator).
        unsafe { builder.launch(config) }.map_err(|e| launch_error(e.to_string()))?;
    }
    Ok(())
}
