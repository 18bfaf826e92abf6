//! The CUDA kernels on numr's [`CudaRuntime`].
//!
//! Per (variant, device, head dims `D` and `Dv`, dtype, module) the source is assembled
//! from the variant's CUDA lowering ([`Variant::compiled`]) and the modules
//! of `kernels_spec::emit::cuda::kernels`, compiled with NVRTC for the
//! device's compute capability on first use, loaded into numr's CUDA
//! context, and cached. Each kernel is launched from its description: its
//! geometry from the tiles and the problem, its arguments in the described
//! order, each looked up by role. Launches go on numr's compute stream; the
//! variant's fields travel as one by-value parameter block, so a new
//! parameter value never recompiles. f32, f16 and bf16 inputs; f32
//! accumulation, lse and `D_i`. The forward also reads quantised KV caches
//! (`FP8E4M3`, `FP8E5M2` or `I8` keys and values, one format for both) in
//! place, converting them per tile, with their scales per kv head or per
//! page.
//!
//! The backward is deterministic: a `D_i = rowsum(dO ∘ O)` pre-pass, then a
//! dQ kernel over query tiles and a dK/dV kernel over key tiles, each
//! recomputing `P` from the lse (no float atomics).

use crate::backend::{
    AttentionGrads, AttentionRuntime, BackwardTensors, CacheScales, CallKeys, KeyLayout,
};
use crate::error::{BackendError, Error, Result};
use crate::gpu::{self, ArenaPlan, KernelCache, KeyWords};
use crate::op::Output;
use crate::problem::Problem;
use crate::validate;
use crate::variant::Variant;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use kernels_spec::emit::Target;
use kernels_spec::emit::cuda::interface::{Kernel, Module};
use kernels_spec::emit::cuda::{CudaDType, CudaKv, CudaTiles, kernels, source};
use kernels_spec::emit::interface::{Arg, Buffer, NO_WORD, Scalar};
use kernels_spec::params::{ERROR_WORDS, ParamWords};
use numr::dtype::DType;
use numr::ops::UnaryOps as _;
use numr::runtime::cuda::{CudaClient, CudaRuntime};
use numr::runtime::{Device as _, Runtime};
use numr::tensor::Tensor;
use std::any::TypeId;
use std::sync::{Arc, LazyLock};

mod append;

const CUDA: &str = "cuda";
const CUDA_DTYPES: &str = "f32, f16, bf16";
const TARGET: Target = Target::Cuda;

/// The parameter block as the kernels' by-value `Params` argument.
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
struct Params(ParamWords);

// SAFETY: a plain array of u32, the layout of the kernels' `struct Params`
// (32 four-byte words, `static_assert`ed in every source).
unsafe impl DeviceRepr for Params {}

/// A loaded module and its kernels, in the module's order.
struct Compiled {
    _module: Arc<CudaModule>,
    functions: Vec<CudaFunction>,
    tiles: CudaTiles,
}

/// (variant, device, head dims `(D, Dv)`, dtype, how K and V are stored,
/// compute capability, module).
type Key = (
    TypeId,
    usize,
    (u32, u32),
    CudaDType,
    CudaKv,
    (u32, u32),
    &'static str,
);

static CACHE: LazyLock<KernelCache<Key, Compiled>> = LazyLock::new(KernelCache::default);

fn cuda_dtype(dtype: DType) -> Option<CudaDType> {
    match dtype {
        DType::F32 => Some(CudaDType::F32),
        DType::F16 => Some(CudaDType::F16),
        DType::BF16 => Some(CudaDType::Bf16),
        _ => None,
    }
}

/// How a forward's keys and values of dtypes `k` and `v` are stored, for
/// a query of dtype `q`: in `q`'s dtype, or, over a cache with scales
/// (`scaled`), both in one fp8 or int8 format.
fn kv_storage(q: DType, k: DType, v: DType, scaled: bool) -> Result<CudaKv> {
    let bytes = |dtype| match dtype {
        DType::FP8E4M3 => Some(CudaKv::E4m3),
        DType::FP8E5M2 => Some(CudaKv::E5m2),
        DType::I8 => Some(CudaKv::I8),
        _ => None,
    };
    let kv = bytes(k).filter(|_| scaled);
    for (name, dtype) in [("k", k), ("v", v)] {
        let ok = match kv {
            Some(kv) => bytes(dtype) == Some(kv),
            None => dtype == q,
        };
        if !ok {
            return Err(Error::DType {
                name,
                dtype,
                backend: CUDA,
                supported: match kv {
                    Some(_) => "the format of k (k and v both FP8E4M3, both FP8E5M2 or both I8)",
                    None => {
                        "the dtype of q (all inputs share one dtype, or k and v are an fp8 cache)"
                    }
                },
            });
        }
    }
    Ok(kv.unwrap_or(CudaKv::Elem))
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

/// The compute capability of `device`, 8.0 or newer.
fn compute_capability(device: usize) -> Result<(u32, u32)> {
    let device_error = |reason: String| BackendError::Device {
        target: TARGET,
        reason,
    };
    let cc = numr::runtime::cuda::cuda_device_id(device)
        .compute_capability()
        .map_err(|e| device_error(format!("compute capability of device {device}: {e}")))?;
    if cc.0 < 8 {
        return Err(device_error(format!(
            "device {device} has compute capability {}.{}; the kernels need 8.0 or newer \
             (mma.sync m16n8k16 and bf16 conversions)",
            cc.0, cc.1
        ))
        .into());
    }
    Ok(cc)
}

/// The compiled `module` of `V` for the problem's head dims, `dtype` and
/// K and V stored as `kv` on `client`'s device.
fn compiled<V: Variant>(
    client: &CudaClient,
    device: usize,
    p: &Problem,
    (dtype, kv): (DType, CudaKv),
    module: &'static Module,
) -> Result<Arc<Compiled>> {
    let cc = compute_capability(device)?;
    let cuda = cuda_dtype(dtype).ok_or(Error::DType {
        name: "q",
        dtype,
        backend: CUDA,
        supported: CUDA_DTYPES,
    })?;
    let key = (
        V::kernels(),
        device,
        gpu::head_dims(p),
        cuda,
        kv,
        cc,
        module.name,
    );
    Ok(CACHE.get_or_build(key, || build::<V>(client, p, dtype, (cuda, kv), cc, module))?)
}

fn build<V: Variant>(
    client: &CudaClient,
    p: &Problem,
    dtype: DType,
    (cuda, kv): (CudaDType, CudaKv),
    cc: (u32, u32),
    module: &'static Module,
) -> std::result::Result<Compiled, BackendError> {
    let section = gpu::lowering::<V>(TARGET)?;
    let (d, dv) = gpu::head_dims(p);
    let default = CudaTiles::for_problem(d, dv, cuda).with_kv(kv);
    let cfg = gpu::tiles::<V, _>(TARGET, default, p, dtype)?;
    let tiling = |error| gpu::tiling(TARGET, p, dtype, error);
    let text = source(section, &[module], &cfg).map_err(tiling)?;
    let stored = match kv {
        CudaKv::Elem => String::new(),
        kv => format!("_kv{}", kv.name()),
    };
    let name = format!(
        "boostr_{}_{}_d{d}_dv{dv}_{}{stored}.cu",
        V::NAME,
        module.name,
        cuda.name()
    );
    let compile_error = |log: String| BackendError::Compile {
        target: TARGET,
        source_name: name.clone(),
        log,
    };
    let loaded = load(client, &text, &name, cc)?;
    let mut functions = Vec::new();
    for kernel in module.interfaces() {
        let launch_error = |reason: String| BackendError::Launch {
            target: TARGET,
            kernel: kernel.entry,
            reason,
        };
        let f = loaded
            .load_function(kernel.entry)
            .map_err(|e| compile_error(format!("no kernel {}: {e}", kernel.entry)))?;
        let bytes = kernel.smem_bytes(&cfg);
        if bytes > 48 * 1024 {
            let bytes = i32::try_from(bytes)
                .map_err(|_| launch_error(format!("{bytes} bytes of shared memory")))?;
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes,
            )
            .map_err(|e| launch_error(format!("cannot use {bytes} B of shared memory: {e}")))?;
        }
        functions.push(f);
    }
    Ok(Compiled {
        _module: loaded,
        functions,
        tiles: cfg,
    })
}

/// `text` compiled by NVRTC for compute capability `cc` and loaded into
/// numr's context on `client`'s device.
fn load(
    client: &CudaClient,
    text: &str,
    name: &str,
    cc: (u32, u32),
) -> std::result::Result<Arc<CudaModule>, BackendError> {
    let compile_error = |log: String| BackendError::Compile {
        target: TARGET,
        source_name: name.to_string(),
        log,
    };
    let opts = CompileOptions {
        arch: Some(arch(cc)),
        options: vec!["-std=c++17".into()],
        name: Some(name.to_string()),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(text, opts).map_err(|e| compile_error(e.to_string()))?;
    client
        .context()
        .load_module(ptx)
        .map_err(|e| compile_error(format!("loading the module: {e}")))
}

/// A contiguous tensor at offset 0 of a supported dtype.
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

/// The dtype every tensor shares (that of the first).
fn same_dtype(tensors: &[(&'static str, &Tensor<CudaRuntime>)]) -> Result<DType> {
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
    Ok(t0.dtype())
}

fn alloc(shape: &[usize], dtype: DType, like: &Tensor<CudaRuntime>) -> Result<Tensor<CudaRuntime>> {
    Ok(Tensor::<CudaRuntime>::empty(shape, dtype, like.device())?)
}

/// An argument's value, as the kernel takes it.
enum Value {
    Ptr(u64),
    Int(i32),
    Float(f32),
    Params(Params),
}

/// What one call binds: the problem, the parameter block, the capture
/// arena and its tensors, each looked up by role.
struct Call<'a> {
    problem: &'a Problem,
    params: Params,
    captures: u64,
    buffers: &'a [(Buffer, &'a Tensor<CudaRuntime>)],
    /// Where the keys are (the arena words of a cache's lengths and page
    /// table, `-1` as `i32` where there is none).
    keys: KeyWords,
    /// Key splits of the forward (1: unsplit, and every other kernel).
    splits: u32,
}

impl Call<'_> {
    fn value(&self, kernel: &Kernel, arg: Arg) -> std::result::Result<Value, BackendError> {
        let launch_error = |reason: String| BackendError::Launch {
            target: TARGET,
            kernel: kernel.entry,
            reason,
        };
        match arg {
            Arg::Buffer(b, _) => self
                .buffers
                .iter()
                .find(|(role, _)| *role == b)
                .map(|(_, t)| Value::Ptr(t.ptr()))
                // Unbound where it does not apply: null, never read.
                .or_else(|| b.optional().then_some(Value::Ptr(0)))
                .ok_or_else(|| launch_error(format!("no tensor is bound to `{}`", b.name()))),
            Arg::Scalar(s) => {
                let word =
                    gpu::scalar_word(self.problem, s, self.keys, self.splits).ok_or_else(|| {
                        launch_error(format!("`{}` has no value in a CUDA launch", s.name()))
                    })?;
                match s {
                    Scalar::Scale => Ok(Value::Float(f32::from_bits(word))),
                    // `NO_WORD` is -1 to the kernels.
                    Scalar::KvLens | Scalar::QLens | Scalar::KvPages if word == NO_WORD => {
                        Ok(Value::Int(-1))
                    }
                    _ => i32::try_from(word).map(Value::Int).map_err(|_| {
                        launch_error(format!("{} = {word} does not fit in i32", s.name()))
                    }),
                }
            }
            Arg::Params => Ok(Value::Params(self.params)),
            Arg::Captures => Ok(Value::Ptr(self.captures)),
        }
    }
}

/// Launch every kernel of `module`, in order, on `client`'s stream (the
/// split-KV merge only after a forward in splits).
fn launch_module(
    client: &CudaClient,
    module: &Module,
    compiled: &Compiled,
    call: &Call<'_>,
) -> Result<()> {
    let sizes = gpu::split_sizes(call.problem, call.splits);
    for (kernel, function) in module.interfaces().zip(&compiled.functions) {
        if *kernel == kernels::MERGE && call.splits <= 1 {
            continue;
        }
        let launch_error = |reason: String| BackendError::Launch {
            target: TARGET,
            kernel: kernel.entry,
            reason,
        };
        let dims = kernel
            .launch_dims(&compiled.tiles, &sizes)
            .map_err(|e| launch_error(e.to_string()))?;
        let values = kernel
            .args
            .iter()
            .map(|a| call.value(kernel, *a))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let stream = client.stream();
        let mut builder = stream.launch_builder(function);
        for v in &values {
            match v {
                Value::Ptr(x) => builder.arg(x),
                Value::Int(x) => builder.arg(x),
                Value::Float(x) => builder.arg(x),
                Value::Params(x) => builder.arg(x),
            };
        }
        let config = LaunchConfig {
            grid_dim: dims.grid,
            block_dim: (dims.block, 1, 1),
            shared_mem_bytes: dims.smem_bytes,
        };
        // SAFETY: the arguments are the kernel's described arguments, in
        // their order and of their types (the source's signature is written
        // from the same description); every pointer is a live, contiguous
        // numr allocation of the described shape and dtype, kept alive past
        // the launch by numr's stream-ordered allocator.
        unsafe { builder.launch(config) }.map_err(|e| launch_error(e.to_string()))?;
    }
    Ok(())
}

/// The summary kernel, loaded on one device.
struct SummaryKernel {
    _module: Arc<CudaModule>,
    function: CudaFunction,
}

/// (device, compute capability).
type SummaryKey = (usize, (u32, u32));

static SUMMARY_CACHE: LazyLock<KernelCache<SummaryKey, SummaryKernel>> =
    LazyLock::new(KernelCache::default);

/// The summary kernel on `client`'s device `device`.
fn summary_kernel(client: &CudaClient, device: usize) -> Result<Arc<SummaryKernel>> {
    let cc = compute_capability(device)?;
    Ok(SUMMARY_CACHE.get_or_build((device, cc), || {
        let name = "boostr_summarize.cu";
        let module = load(client, kernels::SUMMARY_SOURCE, name, cc)?;
        let function = module
            .load_function("bx_summarize")
            .map_err(|e| BackendError::Compile {
                target: TARGET,
                source_name: name.to_string(),
                log: format!("no kernel bx_summarize: {e}"),
            })?;
        Ok(SummaryKernel {
            _module: module,
            function,
        })
    })?)
}

/// A call's capture arena on the device: its plan and its words (`u32`).
struct DeviceArena {
    plan: ArenaPlan<CudaRuntime>,
    words: Tensor<CudaRuntime>,
}

impl DeviceArena {
    /// The arena of `plan` on `client`'s stream, filled before anything
    /// else runs there: the error words and the gradient accumulators
    /// zeroed, each tensor copied to its place, then the summaries.
    fn new(
        plan: ArenaPlan<CudaRuntime>,
        client: &CudaClient,
        like: &Tensor<CudaRuntime>,
    ) -> Result<Self> {
        let words = Tensor::<CudaRuntime>::empty(&[plan.words], DType::U32, like.device())?;
        let stream = client.stream();
        let fill_error = |reason: String| BackendError::Launch {
            target: TARGET,
            kernel: "bx_summarize",
            reason,
        };
        {
            // Direct driver calls run under the stream's permit (which also
            // makes its context current); the launches below take their own.
            let _permit = stream
                .enqueue_permit()
                .map_err(|e| fill_error(format!("the stream's context: {e}")))?;
            let raw = stream.raw().cu_stream();
            // SAFETY: `words` holds `plan.words` u32 (at least
            // ERROR_WORDS), each copied tensor is a live contiguous numr
            // allocation of `numel` 4-byte elements (dtype checked against
            // its declaration or the cache's rules), and the plan places it
            // inside `words`; all on numr's stream.
            unsafe {
                cudarc::driver::result::memset_d8_async(words.ptr(), 0, 4 * ERROR_WORDS, raw)
                    .map_err(|e| fill_error(format!("zeroing the error record: {e}")))?;
                let (start, end) = (plan.arena.grad_start, plan.arena.words);
                if end > start {
                    cudarc::driver::result::memset_d8_async(
                        words.ptr() + 4 * start as u64,
                        0,
                        4 * (end - start),
                        raw,
                    )
                    .map_err(|e| fill_error(format!("zeroing the gradient accumulators: {e}")))?;
                }
                for (t, at) in plan.copies() {
                    cudarc::driver::result::memcpy_dtod_async(
                        words.ptr() + 4 * at as u64,
                        t.ptr(),
                        4 * t.numel(),
                        raw,
                    )
                    .map_err(|e| fill_error(format!("copying a tensor into the arena: {e}")))?;
                }
            }
        }
        if !plan.jobs.is_empty() {
            let kernel = summary_kernel(client, like.device().id())?;
            for job in &plan.jobs {
                let [source, dest, outer, len, inner, blocks, entries, _] = job.words();
                let arena = words.ptr();
                let mut builder = stream.launch_builder(&kernel.function);
                builder.arg(&arena);
                for w in [&source, &dest, &outer, &len, &inner, &blocks, &entries] {
                    builder.arg(w);
                }
                let threads = kernels::SUMMARY_THREADS;
                let grid = u32::try_from(job.entries().div_ceil(u64::from(threads)))
                    .map_err(|_| fill_error(format!("{} summary entries", job.entries())))?;
                let config = LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: `bx_summarize(unsigned*, unsigned × 7)`, the
                // arguments in that order; the job's words index `words`
                // (the arena placed every summary inside it).
                unsafe { builder.launch(config) }.map_err(|e| fill_error(e.to_string()))?;
            }
        }
        Ok(DeviceArena { plan, words })
    }

    /// After the call's kernels: the error of a read out of range, if one
    /// was recorded. Only a call whose checked reads may fail reads the
    /// record back (and waits for the stream).
    fn check<V: Variant>(&self) -> Result<()> {
        if !self.plan.report {
            return Ok(());
        }
        let record = self.words.narrow(0, 0, ERROR_WORDS)?.contiguous()?;
        match self.plan.error::<V>(TARGET, &record.to_vec::<u32>()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// After a backward's kernels: the gradients asked for (`wanted`), as
    /// f32 tensors of their tensors' shapes (reads back and waits for the
    /// stream).
    fn grads<V: Variant>(&self, wanted: &[bool]) -> Result<Vec<Option<Tensor<CudaRuntime>>>> {
        if !gpu::learns::<V>(wanted) {
            return Ok(vec![None; V::LEARNABLE.len()]);
        }
        let record = self.words.narrow(0, 0, ERROR_WORDS)?.contiguous()?;
        let (start, end) = (self.plan.arena.grad_start, self.plan.arena.words);
        let grads = self.words.narrow(0, start, end - start)?.contiguous()?;
        self.plan.grads::<V>(
            CUDA,
            &record.to_vec::<u32>(),
            &grads.to_vec::<u32>(),
            wanted,
            self.words.device(),
        )
    }
}

/// Fills the arena of `variant` for `p` (its captures, and the cache
/// words of `layout`) and launches `modules` in order on `like`'s stream
/// with `buffers` bound, the forward in `splits` key splits; then reports
/// a read out of range, if the call may have one. Returns the arena, whose
/// gradient accumulators a backward reads back.
#[allow(clippy::too_many_arguments)]
fn launch<V: Variant>(
    variant: &V,
    p: &Problem,
    like: &Tensor<CudaRuntime>,
    dtype: (DType, CudaKv),
    layout: &KeyLayout<'_, CudaRuntime>,
    modules: &[&'static Module],
    buffers: &[(Buffer, &Tensor<CudaRuntime>)],
    splits: u32,
) -> Result<DeviceArena> {
    let client = CudaRuntime::default_client(like.device());
    let arena = DeviceArena::new(ArenaPlan::new(variant, p, layout)?, &client, like)?;
    let call = Call {
        problem: p,
        params: Params(gpu::param_words(variant, p)),
        captures: arena.words.ptr(),
        buffers,
        keys: arena.plan.keys,
        splits,
    };
    for module in modules {
        let compiled = compiled::<V>(&client, like.device().id(), p, dtype, module)?;
        launch_module(&client, module, &compiled, &call)?;
    }
    arena.check::<V>()?;
    Ok(arena)
}

/// An fp8 cache's scales on the device, as the forward reads them: `[Hkv]`
/// for keys in place, `[pages, Hkv]` for pages (per-head scales repeated
/// for each of the `pages` pages).
fn scale_tensors(
    scales: CacheScales<'_>,
    layout: &KeyLayout<'_, CudaRuntime>,
    heads_kv: usize,
    pages: usize,
    like: &Tensor<CudaRuntime>,
) -> Result<[Tensor<CudaRuntime>; 2]> {
    let upload = |s: &[f32]| -> Result<Tensor<CudaRuntime>> {
        let per_head_over_pages = layout.pages().is_some() && s.len() == heads_kv;
        let values = if per_head_over_pages {
            s.repeat(pages)
        } else {
            s.to_vec()
        };
        Ok(Tensor::<CudaRuntime>::from_slice(
            &values,
            &[values.len()],
            like.device(),
        )?)
    };
    Ok([upload(scales.k)?, upload(scales.v)?])
}

/// The forward kernel, over keys of any layout (a cache's lengths and
/// page table copied into the arena), in the element type or an fp8
/// cache's.
fn forward_over<V: Variant>(
    variant: &V,
    p: &Problem,
    q: &Tensor<CudaRuntime>,
    keys: CallKeys<'_, CudaRuntime>,
) -> Result<Output<CudaRuntime>> {
    let q = input("q", q)?;
    let dtype = q.dtype();
    let kv = kv_storage(dtype, keys.k.dtype(), keys.v.dtype(), keys.scales.is_some())?;
    let (k, v) = if kv.bytes() {
        (keys.k.contiguous()?, keys.v.contiguous()?)
    } else {
        (input("k", keys.k)?, input("v", keys.v)?)
    };
    let scales = match keys.scales {
        Some(s) => Some(scale_tensors(
            s,
            &keys.layout,
            p.heads_kv,
            k.shape()[0],
            &q,
        )?),
        None => None,
    };
    let client = CudaRuntime::default_client(q.device());
    let module = &kernels::FORWARD_MODULE;
    let tiles = compiled::<V>(&client, q.device().id(), p, (dtype, kv), module)?.tiles;
    let splits = forward_splits(&client, p, &tiles);
    let out = alloc(&p.out_shape(), dtype, &q)?;
    let lse = alloc(&p.lse_shape(), DType::F32, &q)?;
    // The splits' rows of `Dv` values (f32), or, unsplit, `lse` in their
    // place (not read).
    let (split_out, split_lse) = if splits > 1 {
        let rows = p.batch * p.heads_q * p.seq_q;
        let n = splits as usize;
        (
            alloc(&[n, rows, p.head_dim_v], DType::F32, &q)?,
            alloc(&[n, rows], DType::F32, &q)?,
        )
    } else {
        (lse.clone(), lse.clone())
    };
    // Each split's rows' largest scores, their largest in split 0's.
    let max_scores = if p.max_scores {
        let rows = p.batch * p.heads_q * p.seq_q;
        Some(alloc(&[splits as usize * rows], DType::F32, &q)?)
    } else {
        None
    };
    let mut buffers = vec![
        (Buffer::Q, &q),
        (Buffer::K, &k),
        (Buffer::V, &v),
        (Buffer::Out, &out),
        (Buffer::Lse, &lse),
        (Buffer::SplitOut, &split_out),
        (Buffer::SplitLse, &split_lse),
    ];
    if let Some([k_scale, v_scale]) = &scales {
        buffers.extend([(Buffer::KScale, k_scale), (Buffer::VScale, v_scale)]);
    }
    if let Some(max) = &max_scores {
        buffers.push((Buffer::MaxScores, max));
    }
    launch(
        variant,
        p,
        &q,
        (dtype, kv),
        &keys.layout,
        &[module],
        &buffers,
        splits,
    )?;
    let max_scores = match max_scores {
        Some(max) => Some(max.narrow(0, 0, lse.numel())?.reshape(lse.shape())?),
        None => None,
    };
    Ok(Output {
        out,
        lse,
        max_scores,
    })
}

/// The key splits of the forward of `p` on `client`'s device (see
/// [`gpu::split_count`]): enough blocks for two per multiprocessor, at
/// most 64 (the merge reads every split per row).
fn forward_splits(client: &CudaClient, p: &Problem, cfg: &CudaTiles) -> u32 {
    use cudarc::driver::sys::CUdevice_attribute;
    let sms = client
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_or(132, |n| n.max(1) as u64);
    let sizes = gpu::sizes(p);
    let blocks = sizes
        .dim(kernels_spec::emit::interface::Dim::GroupRows)
        .div_ceil(cfg.block_q.into())
        * sizes.dim(kernels_spec::emit::interface::Dim::BatchHeadsKv);
    gpu::split_count(blocks, sizes.seq_k, cfg.block_kv.into(), 2 * sms, 64)
}

impl AttentionRuntime for CudaRuntime {
    /// NCCL moves device memory (it is the communicator that synchronises
    /// with streams); a host communicator (nexar) does not.
    fn communicator_reads_tensors(comm: &dyn numr::runtime::Communicator) -> bool {
        comm.as_stream_sync().is_some()
    }

    fn attention_forward<V: Variant>(
        variant: &V,
        p: &Problem,
        q: &Tensor<Self>,
        keys: CallKeys<'_, Self>,
    ) -> Result<Output<Self>> {
        forward_over(variant, p, q, keys)
    }

    fn write_kv(write: &crate::backend::KvWrite<'_, Self>) -> Result<()> {
        append::write_kv(write)
    }

    fn attention_backward<V: Variant>(
        variant: &V,
        p: &Problem,
        t: BackwardTensors<'_, Self>,
    ) -> Result<AttentionGrads<Self>> {
        let x = gpu::BackwardOperands::new(&t, CUDA, input)?;
        let (q, k, v) = (&x.q, &x.k, &x.v);
        let out = input("out", t.out)?;
        let dtype = same_dtype(&[
            ("q", q),
            ("k", k),
            ("v", v),
            ("out", &out),
            ("dout", &x.dout),
        ])?;
        // `D_i − dlse_i`: the pre-pass adds each row's `rowsum(dO ∘ O)` to
        // what `delta` holds.
        let delta = match t.dlse {
            Some(g) => {
                validate::check_dtype("dlse", g, CUDA, &[DType::F32], "f32")?;
                CudaRuntime::default_client(q.device()).neg(&g.contiguous()?)?
            }
            None => Tensor::<CudaRuntime>::zeros(&p.lse_shape(), DType::F32, q.device())?,
        };
        let dq = alloc(q.shape(), dtype, q)?;
        // dK and dV of each sequence's slots; a paged call's are folded
        // into its pages at the end.
        let dk = alloc(&p.k_shape(), dtype, k)?;
        let dv = alloc(&p.v_shape(), dtype, v)?;
        let buffers = [
            (Buffer::Q, q),
            (Buffer::K, k),
            (Buffer::V, v),
            (Buffer::Out, &out),
            (Buffer::Dout, &x.dout),
            (Buffer::Lse, &x.lse),
            (Buffer::Delta, &delta),
            (Buffer::Dq, &dq),
            (Buffer::Dk, &dk),
            (Buffer::Dv, &dv),
        ];
        // The tensor gradients after `delta`, on the same stream.
        let modules: &[&'static Module] = if gpu::learns::<V>(t.tensor_grads) {
            &[&kernels::BACKWARD_MODULE, &kernels::TENSORS_MODULE]
        } else {
            &[&kernels::BACKWARD_MODULE]
        };
        let arena = launch(
            variant,
            p,
            q,
            (dtype, CudaKv::Elem),
            &t.keys.layout,
            modules,
            &buffers,
            1,
        )?;
        let tensors = arena.grads::<V>(t.tensor_grads)?;
        gpu::backward_grads(p, &t.keys.layout, [dq, dk, dv], k.shape()[0], tensors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// K and V are in q's dtype, or a quantised cache's one format;
    /// anything else is a dtype error naming the tensor.
    #[test]
    fn keys_and_values_are_q_dtype_or_one_quantised_format() {
        use DType::{BF16, F16, F32, FP8E4M3 as E4, FP8E5M2 as E5, I8};
        for q in [F32, F16, BF16] {
            assert!(matches!(kv_storage(q, q, q, false), Ok(CudaKv::Elem)));
            assert!(matches!(kv_storage(q, E4, E4, true), Ok(CudaKv::E4m3)));
            assert!(matches!(kv_storage(q, E5, E5, true), Ok(CudaKv::E5m2)));
            assert!(matches!(kv_storage(q, I8, I8, true), Ok(CudaKv::I8)));
        }
        let name = |r: Result<CudaKv>| match r {
            Err(Error::DType { name, .. }) => name,
            other => panic!("{other:?}"),
        };
        assert_eq!(name(kv_storage(BF16, E4, E5, true)), "v");
        assert_eq!(name(kv_storage(F16, I8, E4, true)), "v");
        assert_eq!(name(kv_storage(F32, I8, I8, false)), "k");
        assert_eq!(name(kv_storage(F16, E5, F16, true)), "v");
        // fp8 without scales (dense keys): not a cache.
        assert_eq!(name(kv_storage(F16, E4, E4, false)), "k");
        assert_eq!(name(kv_storage(F32, F16, F16, false)), "k");
        assert_eq!(name(kv_storage(F16, F16, BF16, false)), "v");
    }

    /// Ring attention on one GPU: ranks as threads over the in-process
    /// communicator (a host communicator, so the blocks are staged),
    /// against single-device attention on the same GPU; worlds 1 to 3,
    /// both layouts. Needs a GPU (run by `bench/gpu.sh`).
    mod ring {
        use crate::Schedule;
        use crate::ring::tests::{
            a_failing_kernel_fails_every_rank_on, documents_on, each_layout_on, learnable_on,
        };
        use crate::stock::{AlibiSlopes, Causal, CausalSlidingWindowSinks};
        use crate::testing::{Cuda, device_or_skip};
        use numr::runtime::cuda::CudaRuntime;

        #[test]
        fn the_stock_families_match_one_device() {
            let Some(device) = device_or_skip::<Cuda>("ring attention on CUDA") else {
                return;
            };
            each_layout_on::<_, CudaRuntime>(&device, 40, &[1, 2, 3], Schedule::Ring, |_, _, _| {
                Causal
            });
            each_layout_on::<_, CudaRuntime>(&device, 41, &[2, 3], Schedule::Ring, |_, w, d| {
                documents_on::<CudaRuntime>(w, d)
            });
            each_layout_on::<_, CudaRuntime>(&device, 42, &[3], Schedule::Ring, |rng, _, d| {
                AlibiSlopes {
                    slopes: learnable_on::<CudaRuntime>(rng, 0.2, d),
                }
            });
            each_layout_on::<_, CudaRuntime>(
                &device,
                43,
                &[2],
                Schedule::AllGather,
                |rng, _, d| CausalSlidingWindowSinks {
                    window: 3,
                    sinks: learnable_on::<CudaRuntime>(rng, 1.0, d),
                },
            );
        }

        #[test]
        fn a_failing_kernel_fails_every_rank() {
            if let Some(device) = device_or_skip::<Cuda>("ring faults on CUDA") {
                a_failing_kernel_fails_every_rank_on::<CudaRuntime>(&device);
            }
        }
    }
}
