//! The CUDA kernels on numr's [`CudaRuntime`].
//!
//! Per (variant, device, head dim, dtype) the kernel sources are assembled
//! from the variant's CUDA section ([`Variant::cuda_variant_functions`]) and
//! the templates of `kernels_spec::emit::cuda`, compiled with NVRTC for the
//! device's compute capability on first use, loaded into numr's CUDA context,
//! and cached. Launches go on numr's compute stream with the tensors' device
//! pointers; the variant's fields travel as one by-value `Params` argument, so
//! a new parameter value never recompiles. f32, f16 and bf16 inputs; f32
//! accumulation, lse and `D_i`.
//!
//! The backward is deterministic: a `D_i = rowsum(dO ∘ O)` pre-pass, then a
//! dQ kernel over query tiles and a dK/dV kernel over key tiles, each
//! recomputing `P` from the lse (no float atomics).

use crate::backend::AttentionRuntime;
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::validate;
use crate::variant::Variant;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use kernels_spec::emit::cuda::{
    self as emit, CudaDType, CudaTiles, DELTA_KERNEL, DELTA_ROWS_PER_BLOCK, DELTA_THREADS,
    DKDV_KERNEL, DQ_KERNEL, FORWARD_KERNEL, PARAM_WORDS,
};
use numr::dtype::DType;
use numr::runtime::cuda::{CudaClient, CudaRuntime};
use numr::runtime::{Device as _, Runtime};
use numr::tensor::Tensor;
use std::any::TypeId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

const CUDA: &str = "cuda";
const CUDA_DTYPES: &str = "f32, f16, bf16";

/// The text of a backend error without its prefix, for cached failures.
fn message(e: Error) -> String {
    match e {
        Error::Numr(numr::error::Error::Backend(m)) => m,
        other => other.to_string(),
    }
}

fn backend(msg: String) -> Error {
    Error::Numr(numr::error::Error::Backend(format!("boostr cuda: {msg}")))
}

/// The variant's fields as the kernels' by-value `Params` (32 words).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Params([u32; PARAM_WORDS]);

// SAFETY: a plain array of u32, the layout of the kernels' `struct Params`
// (32 four-byte words).
unsafe impl DeviceRepr for Params {}

fn params<V: Variant>(variant: &V) -> Result<Params> {
    let words = variant.wgsl_params();
    let mut p = [0u32; PARAM_WORDS];
    if words.len() > PARAM_WORDS {
        return Err(backend(format!(
            "variant `{}` has {} parameter words; the CUDA kernels take at most {PARAM_WORDS}",
            V::NAME,
            words.len()
        )));
    }
    p[..words.len()].copy_from_slice(&words);
    Ok(Params(p))
}

/// Forward, or the backward (three kernels in one module).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Module {
    Forward,
    Backward,
}

impl Module {
    fn entries(self) -> &'static [&'static str] {
        match self {
            Module::Forward => &[FORWARD_KERNEL],
            Module::Backward => &[DELTA_KERNEL, DQ_KERNEL, DKDV_KERNEL],
        }
    }
}

/// A loaded module and its kernels, in [`Module::entries`] order.
struct Kernels {
    _module: Arc<CudaModule>,
    functions: Vec<CudaFunction>,
    tiles: CudaTiles,
}

/// (variant, device, head dim, dtype, compute capability, module).
type Key = (TypeId, usize, usize, CudaDType, (u32, u32), Module);
type Slot = Arc<OnceLock<std::result::Result<Arc<Kernels>, String>>>;

fn cache() -> &'static Mutex<HashMap<Key, Slot>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Slot>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

fn cuda_dtype(dtype: DType) -> Option<CudaDType> {
    match dtype {
        DType::F32 => Some(CudaDType::F32),
        DType::F16 => Some(CudaDType::F16),
        DType::BF16 => Some(CudaDType::Bf16),
        _ => None,
    }
}

/// The tiles for (`V`, head dim, dtype): the variant's `tile(..)` overrides
/// when they validate, else the emitter's defaults.
fn tiles<V: Variant>(head_dim: usize, dtype: CudaDType) -> Result<CudaTiles> {
    let d = u32::try_from(head_dim).map_err(|_| backend(format!("head dim {head_dim}")))?;
    let cfg = CudaTiles::for_problem(d, dtype).with_tile_override(V::TILE_Q, V::TILE_KV);
    cfg.validate().map_err(|e| {
        backend(format!(
            "head dim {head_dim} ({}) has no CUDA tiling: {e}",
            dtype.name()
        ))
    })?;
    Ok(cfg)
}

/// NVRTC's target for compute capability `(major, minor)`: real code for
/// the architectures this NVRTC knows, else PTX for the newest it does.
fn arch(cc: (u32, u32)) -> &'static str {
    match cc {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        _ => "compute_80",
    }
}

/// The compiled `module` of `V` for (head dim, dtype) on `client`'s device:
/// compiled by the first caller for that key, waited for by concurrent ones.
/// A failed compilation is cached as its error.
fn kernels<V: Variant>(
    client: &CudaClient,
    device: usize,
    head_dim: usize,
    dtype: CudaDType,
    module: Module,
) -> Result<Arc<Kernels>> {
    let cc = numr::runtime::cuda::cuda_device_id(device)
        .compute_capability()
        .map_err(|e| backend(format!("compute capability of device {device}: {e}")))?;
    if cc.0 < 8 {
        return Err(backend(format!(
            "device {device} has compute capability {}.{}; the kernels need 8.0 or newer \
             (mma.sync m16n8k16, cp.async)",
            cc.0, cc.1
        )));
    }
    let key = (TypeId::of::<V>(), device, head_dim, dtype, cc, module);
    // Only the slot lookup holds the map's lock; compilation holds the slot.
    let slot = {
        let mut map = cache().lock().unwrap_or_else(|e| e.into_inner());
        map.entry(key).or_default().clone()
    };
    let prefixed = |m: String| {
        if m.starts_with("boostr cuda:") {
            m
        } else {
            format!("boostr cuda: {m}")
        }
    };
    slot.get_or_init(|| {
        build::<V>(client, head_dim, dtype, cc, module)
            .map(Arc::new)
            .map_err(prefixed)
    })
    .clone()
    .map_err(|msg| Error::Numr(numr::error::Error::Backend(msg)))
}

fn build<V: Variant>(
    client: &CudaClient,
    head_dim: usize,
    dtype: CudaDType,
    cc: (u32, u32),
    module: Module,
) -> std::result::Result<Kernels, String> {
    let fns = V::cuda_variant_functions().ok_or_else(|| {
        format!(
            "variant `{}` has no CUDA lowering (implement Variant with #[attention])",
            V::NAME
        )
    })?;
    let cfg = tiles::<V>(head_dim, dtype).map_err(message)?;
    let (source, part) = match module {
        Module::Forward => (emit::forward_source(fns, &cfg, dtype), "fwd"),
        Module::Backward => (emit::backward_source(fns, &cfg, dtype), "bwd"),
    };
    let name = format!("boostr_{}_{part}_d{head_dim}_{}.cu", V::NAME, dtype.name());
    let opts = CompileOptions {
        arch: Some(arch(cc)),
        options: vec!["-std=c++17".into()],
        name: Some(name.clone()),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(&source, opts)
        .map_err(|e| format!("NVRTC failed to compile {name}: {e}"))?;
    let loaded = client
        .context()
        .load_module(ptx)
        .map_err(|e| format!("loading {name}: {e}"))?;
    let smem = |entry: &str| match entry {
        FORWARD_KERNEL => cfg.forward_smem_bytes(),
        DQ_KERNEL => cfg.dq_smem_bytes(),
        DKDV_KERNEL => cfg.dkdv_smem_bytes(),
        _ => 0,
    };
    let mut functions = Vec::new();
    for &entry in module.entries() {
        let f = loaded
            .load_function(entry)
            .map_err(|e| format!("{name}: no kernel {entry}: {e}"))?;
        let bytes = smem(entry);
        if bytes > 48 * 1024 {
            let bytes = i32::try_from(bytes).map_err(|_| format!("{entry}: {bytes} B"))?;
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes,
            )
            .map_err(|e| format!("{name}: {entry} cannot use {bytes} B of shared memory: {e}"))?;
        }
        functions.push(f);
    }
    Ok(Kernels {
        _module: loaded,
        functions,
        tiles: cfg,
    })
}

/// A contiguous tensor at offset 0 of a supported dtype, and that dtype.
fn input(name: &'static str, t: &Tensor<CudaRuntime>) -> Result<Tensor<CudaRuntime>> {
    validate::check_dtype(
        name,
        t,
        CUDA,
        &[DType::F32, DType::F16, DType::BF16],
        CUDA_DTYPES,
    )?;
    Ok(t.contiguous()?)
}

fn same_dtype(tensors: &[(&'static str, &Tensor<CudaRuntime>)]) -> Result<CudaDType> {
    let (_, t0) = tensors[0];
    for &(name, t) in &tensors[1..] {
        if t.dtype() != t0.dtype() {
            return Err(Error::DType {
                name,
                dtype: t.dtype(),
                backend: CUDA,
                supported: "the dtype of q (all inputs share one dtype)",
            });
        }
    }
    cuda_dtype(t0.dtype()).ok_or_else(|| backend(format!("dtype {:?}", t0.dtype())))
}

fn alloc(shape: &[usize], dtype: DType, like: &Tensor<CudaRuntime>) -> Result<Tensor<CudaRuntime>> {
    Ok(Tensor::<CudaRuntime>::empty(shape, dtype, like.device())?)
}

fn dim(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n)
        .ok()
        .filter(|&x| x <= 65535 || what == "grid x")
        .ok_or_else(|| backend(format!("{what} = {n} exceeds CUDA's grid limit")))
}

fn int(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| backend(format!("{what} = {n} does not fit in i32")))
}

fn config(grid: (u32, u32, u32), block: u32, smem: u64) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: u32::try_from(smem).map_err(|_| backend(format!("{smem} B smem")))?,
    })
}

/// The problem's integer arguments, in the kernels' order.
struct Dims {
    batch: i32,
    heads_q: i32,
    heads_kv: i32,
    seq_q: i32,
    seq_k: i32,
}

impl Dims {
    fn of(p: &Problem) -> Result<Dims> {
        Ok(Dims {
            batch: int(p.batch, "batch")?,
            heads_q: int(p.heads_q, "heads_q")?,
            heads_kv: int(p.heads_kv, "heads_kv")?,
            seq_q: int(p.seq_q, "seq_q")?,
            seq_k: int(p.seq_k, "seq_k")?,
        })
    }
}

fn launch_error(kernel: &str, e: impl std::fmt::Display) -> Error {
    backend(format!("launching {kernel}: {e}"))
}

impl AttentionRuntime for CudaRuntime {
    fn attention_forward<V: Variant>(
        variant: &V,
        p: &Problem,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        let (q, k, v) = (input("q", q)?, input("k", k)?, input("v", v)?);
        let dtype = same_dtype(&[("q", &q), ("k", &k), ("v", &v)])?;
        let client = CudaRuntime::default_client(q.device());
        let kernels = kernels::<V>(&client, q.device().id(), p.head_dim, dtype, Module::Forward)?;
        let cfg = kernels.tiles;
        let out = alloc(q.shape(), q.dtype(), &q)?;
        let lse = alloc(&[p.batch, p.heads_q, p.seq_q], DType::F32, &q)?;
        let dims = Dims::of(p)?;
        let params = params(variant)?;
        let grid = (
            dim(p.seq_q.div_ceil(cfg.block_q as usize), "grid x")?,
            dim(p.heads_q, "heads_q")?,
            dim(p.batch, "batch")?,
        );
        let lc = config(grid, cfg.threads(), cfg.forward_smem_bytes())?;
        let (qp, kp, vp, op, lp) = (q.ptr(), k.ptr(), v.ptr(), out.ptr(), lse.ptr());
        let mut b = client.stream().launch_builder(&kernels.functions[0]);
        b.arg(&qp).arg(&kp).arg(&vp).arg(&op).arg(&lp);
        b.arg(&dims.batch).arg(&dims.heads_q).arg(&dims.heads_kv);
        b.arg(&dims.seq_q)
            .arg(&dims.seq_k)
            .arg(&p.scale)
            .arg(&params);
        // SAFETY: the arguments follow the forward kernel's documented
        // signature; every pointer is a live, contiguous numr allocation of
        // the documented shape and dtype, kept alive past the launch by
        // numr's stream-ordered allocator.
        unsafe { b.launch(lc) }.map_err(|e| launch_error(FORWARD_KERNEL, e))?;
        Ok((out, lse))
    }

    fn attention_backward<V: Variant>(
        variant: &V,
        p: &Problem,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        out: &Tensor<Self>,
        lse: &Tensor<Self>,
        dout: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        let (q, k, v) = (input("q", q)?, input("k", k)?, input("v", v)?);
        let (out, dout) = (input("out", out)?, input("dout", dout)?);
        validate::check_dtype("lse", lse, CUDA, &[DType::F32], "f32")?;
        let lse = lse.contiguous()?;
        let dtype = same_dtype(&[
            ("q", &q),
            ("k", &k),
            ("v", &v),
            ("out", &out),
            ("dout", &dout),
        ])?;
        let client = CudaRuntime::default_client(q.device());
        let kernels = kernels::<V>(
            &client,
            q.device().id(),
            p.head_dim,
            dtype,
            Module::Backward,
        )?;
        let cfg = kernels.tiles;
        let delta = alloc(&[p.batch, p.heads_q, p.seq_q], DType::F32, &q)?;
        let dq = alloc(q.shape(), q.dtype(), &q)?;
        let dk = alloc(k.shape(), k.dtype(), &k)?;
        let dv = alloc(v.shape(), v.dtype(), &v)?;
        let dims = Dims::of(p)?;
        let params = params(variant)?;
        let (qp, kp, vp, op, dop) = (q.ptr(), k.ptr(), v.ptr(), out.ptr(), dout.ptr());
        let (lp, dp) = (lse.ptr(), delta.ptr());
        let (dqp, dkp, dvp) = (dq.ptr(), dk.ptr(), dv.ptr());
        let stream = client.stream();

        let rows = p.batch * p.heads_q * p.seq_q;
        let lc = config(
            (
                dim(rows.div_ceil(DELTA_ROWS_PER_BLOCK as usize), "grid x")?,
                1,
                1,
            ),
            DELTA_THREADS,
            0,
        )?;
        let mut b = stream.launch_builder(&kernels.functions[0]);
        b.arg(&op).arg(&dop).arg(&dp);
        b.arg(&dims.batch).arg(&dims.heads_q).arg(&dims.seq_q);
        // SAFETY: as in the forward, for the D_i kernel's signature.
        unsafe { b.launch(lc) }.map_err(|e| launch_error(DELTA_KERNEL, e))?;

        let lc = config(
            (
                dim(p.seq_q.div_ceil(cfg.bwd_block_q as usize), "grid x")?,
                dim(p.heads_q, "heads_q")?,
                dim(p.batch, "batch")?,
            ),
            cfg.bwd_threads(),
            cfg.dq_smem_bytes(),
        )?;
        let mut b = stream.launch_builder(&kernels.functions[1]);
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&dop)
            .arg(&lp)
            .arg(&dp)
            .arg(&dqp);
        b.arg(&dims.batch).arg(&dims.heads_q).arg(&dims.heads_kv);
        b.arg(&dims.seq_q)
            .arg(&dims.seq_k)
            .arg(&p.scale)
            .arg(&params);
        // SAFETY: as in the forward, for the dQ kernel's signature.
        unsafe { b.launch(lc) }.map_err(|e| launch_error(DQ_KERNEL, e))?;

        let lc = config(
            (
                dim(p.seq_k.div_ceil(cfg.bwd_block_kv as usize), "grid x")?,
                dim(p.heads_kv, "heads_kv")?,
                dim(p.batch, "batch")?,
            ),
            cfg.bwd_threads(),
            cfg.dkdv_smem_bytes(),
        )?;
        let mut b = stream.launch_builder(&kernels.functions[2]);
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&dop)
            .arg(&lp)
            .arg(&dp)
            .arg(&dkp)
            .arg(&dvp);
        b.arg(&dims.batch).arg(&dims.heads_q).arg(&dims.heads_kv);
        b.arg(&dims.seq_q)
            .arg(&dims.seq_k)
            .arg(&p.scale)
            .arg(&params);
        // SAFETY: as in the forward, for the dK/dV kernel's signature.
        unsafe { b.launch(lc) }.map_err(|e| launch_error(DKDV_KERNEL, e))?;
        Ok((dq, dk, dv))
    }
}
