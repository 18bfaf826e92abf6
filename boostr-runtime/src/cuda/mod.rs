//! The CUDA kernels on numr's [`CudaRuntime`].
//!
//! Per (variant, device, head dim, dtype, module) the source is assembled
//! from the variant's CUDA lowering ([`Variant::compiled`]) and the modules
//! of `kernels_spec::emit::cuda::kernels`, compiled with NVRTC for the
//! device's compute capability on first use, loaded into numr's CUDA
//! context, and cached. Each kernel is launched from its description: its
//! geometry from the tiles and the problem, its arguments in the described
//! order, each looked up by role. Launches go on numr's compute stream; the
//! variant's fields travel as one by-value parameter block, so a new
//! parameter value never recompiles. f32, f16 and bf16 inputs; f32
//! accumulation, lse and `D_i`.
//!
//! The backward is deterministic: a `D_i = rowsum(dO ∘ O)` pre-pass, then a
//! dQ kernel over query tiles and a dK/dV kernel over key tiles, each
//! recomputing `P` from the lse (no float atomics).

use crate::backend::{AttentionRuntime, BackwardTensors};
use crate::error::{BackendError, Error, Result};
use crate::gpu::{self, KernelCache};
use crate::problem::Problem;
use crate::validate;
use crate::variant::Variant;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use kernels_spec::emit::Target;
use kernels_spec::emit::cuda::interface::{Kernel, Module};
use kernels_spec::emit::cuda::{CudaDType, CudaTiles, kernels, source};
use kernels_spec::emit::interface::{Arg, Buffer, Scalar};
use kernels_spec::params::ParamWords;
use numr::dtype::DType;
use numr::runtime::cuda::{CudaClient, CudaRuntime};
use numr::runtime::{Device as _, Runtime};
use numr::tensor::Tensor;
use std::any::TypeId;
use std::sync::{Arc, LazyLock};

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

/// (variant, device, head dim, dtype, compute capability, module).
type Key = (TypeId, usize, usize, CudaDType, (u32, u32), &'static str);

static CACHE: LazyLock<KernelCache<Key, Compiled>> = LazyLock::new(KernelCache::default);

fn cuda_dtype(dtype: DType) -> Option<CudaDType> {
    match dtype {
        DType::F32 => Some(CudaDType::F32),
        DType::F16 => Some(CudaDType::F16),
        DType::BF16 => Some(CudaDType::Bf16),
        _ => None,
    }
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

/// The compiled `module` of `V` for the problem's head dim and `dtype` on
/// `client`'s device.
fn compiled<V: Variant>(
    client: &CudaClient,
    device: usize,
    p: &Problem,
    dtype: DType,
    module: &'static Module,
) -> Result<Arc<Compiled>> {
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
    let cuda = cuda_dtype(dtype).ok_or(Error::DType {
        name: "q",
        dtype,
        backend: CUDA,
        supported: CUDA_DTYPES,
    })?;
    let key = (TypeId::of::<V>(), device, p.head_dim, cuda, cc, module.name);
    Ok(CACHE.get_or_build(key, || build::<V>(client, p, dtype, cuda, cc, module))?)
}

fn build<V: Variant>(
    client: &CudaClient,
    p: &Problem,
    dtype: DType,
    cuda: CudaDType,
    cc: (u32, u32),
    module: &'static Module,
) -> std::result::Result<Compiled, BackendError> {
    let section = gpu::lowering::<V>(TARGET)?;
    let default = CudaTiles::for_problem(gpu::head_dim(p), cuda);
    let cfg = gpu::tiles::<V, _>(TARGET, default, p.head_dim, dtype)?;
    let tiling = |error| BackendError::Tiling {
        target: TARGET,
        head_dim: p.head_dim,
        dtype,
        error,
    };
    let text = source(section, &[module], &cfg).map_err(tiling)?;
    let name = format!(
        "boostr_{}_{}_d{}_{}.cu",
        V::NAME,
        module.name,
        p.head_dim,
        cuda.name()
    );
    let compile_error = |log: String| BackendError::Compile {
        target: TARGET,
        source_name: name.clone(),
        log,
    };
    let opts = CompileOptions {
        arch: Some(arch(cc)),
        options: vec!["-std=c++17".into()],
        name: Some(name.clone()),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(&text, opts).map_err(|e| compile_error(e.to_string()))?;
    let loaded = client
        .context()
        .load_module(ptx)
        .map_err(|e| compile_error(format!("loading the module: {e}")))?;
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

/// What one call binds: the problem, the parameter block and its tensors,
/// each looked up by role.
struct Call<'a> {
    problem: &'a Problem,
    params: Params,
    buffers: &'a [(Buffer, &'a Tensor<CudaRuntime>)],
}

impl Call<'_> {
    fn value(&self, kernel: &Kernel, arg: Arg) -> std::result::Result<Value, BackendError> {
        let launch_error = |reason: String| BackendError::Launch {
            target: TARGET,
            kernel: kernel.entry,
            reason,
        };
        let p = self.problem;
        let int = |n: usize| {
            i32::try_from(n)
                .map(Value::Int)
                .map_err(|_| launch_error(format!("{} = {n} does not fit in i32", arg.name())))
        };
        match arg {
            Arg::Buffer(b, _) => self
                .buffers
                .iter()
                .find(|(role, _)| *role == b)
                .map(|(_, t)| Value::Ptr(t.ptr()))
                .ok_or_else(|| launch_error(format!("no tensor is bound to `{}`", b.name()))),
            Arg::Scalar(Scalar::Batch) => int(p.batch),
            Arg::Scalar(Scalar::HeadsQ) => int(p.heads_q),
            Arg::Scalar(Scalar::HeadsKv) => int(p.heads_kv),
            Arg::Scalar(Scalar::SeqQ) => int(p.seq_q),
            Arg::Scalar(Scalar::SeqK) => int(p.seq_k),
            Arg::Scalar(Scalar::Scale) => Ok(Value::Float(p.scale)),
            Arg::Scalar(s @ (Scalar::TileBegin | Scalar::TileEnd | Scalar::Flags)) => Err(
                launch_error(format!("`{}` has no value in a CUDA launch", s.name())),
            ),
            Arg::Params => Ok(Value::Params(self.params)),
        }
    }
}

/// Launch every kernel of `module`, in order, on `client`'s stream.
fn launch_module(
    client: &CudaClient,
    module: &Module,
    compiled: &Compiled,
    call: &Call<'_>,
) -> Result<()> {
    let sizes = gpu::sizes(call.problem);
    for (kernel, function) in module.interfaces().zip(&compiled.functions) {
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
        let module = &kernels::FORWARD_MODULE;
        let compiled = compiled::<V>(&client, q.device().id(), p, dtype, module)?;
        let out = alloc(q.shape(), dtype, &q)?;
        let lse = alloc(&[p.batch, p.heads_q, p.seq_q], DType::F32, &q)?;
        let call = Call {
            problem: p,
            params: Params(variant.param_words()),
            buffers: &[
                (Buffer::Q, &q),
                (Buffer::K, &k),
                (Buffer::V, &v),
                (Buffer::Out, &out),
                (Buffer::Lse, &lse),
            ],
        };
        launch_module(&client, module, &compiled, &call)?;
        Ok((out, lse))
    }

    fn attention_backward<V: Variant>(
        variant: &V,
        p: &Problem,
        t: BackwardTensors<'_, Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        let (q, k, v) = (input("q", t.q)?, input("k", t.k)?, input("v", t.v)?);
        let (out, dout) = (input("out", t.out)?, input("dout", t.dout)?);
        validate::check_dtype("lse", t.lse, CUDA, &[DType::F32], "f32")?;
        let lse = t.lse.contiguous()?;
        let dtype = same_dtype(&[
            ("q", &q),
            ("k", &k),
            ("v", &v),
            ("out", &out),
            ("dout", &dout),
        ])?;
        let client = CudaRuntime::default_client(q.device());
        let module = &kernels::BACKWARD_MODULE;
        let compiled = compiled::<V>(&client, q.device().id(), p, dtype, module)?;
        let delta = alloc(&[p.batch, p.heads_q, p.seq_q], DType::F32, &q)?;
        let dq = alloc(q.shape(), dtype, &q)?;
        let dk = alloc(k.shape(), dtype, &k)?;
        let dv = alloc(v.shape(), dtype, &v)?;
        let call = Call {
            problem: p,
            params: Params(variant.param_words()),
            buffers: &[
                (Buffer::Q, &q),
                (Buffer::K, &k),
                (Buffer::V, &v),
                (Buffer::Out, &out),
                (Buffer::Dout, &dout),
                (Buffer::Lse, &lse),
                (Buffer::Delta, &delta),
                (Buffer::Dq, &dq),
                (Buffer::Dk, &dk),
                (Buffer::Dv, &dv),
            ],
        };
        launch_module(&client, module, &compiled, &call)?;
        Ok((dq, dk, dv))
    }
}
