//! The WGSL kernels on numr's [`WgpuRuntime`].
//!
//! Per (variant, device, head dim, module) the module source is assembled
//! from the variant's WGSL lowering ([`Variant::compiled`]) and the modules
//! of `kernels_spec::emit::wgsl::kernels`, compiled once, and cached. Each
//! module is bound and dispatched from its description: the bind group
//! layout and the bind group from its bindings, each looked up by role (the
//! parameter block and the `shape` uniform, then numr's tensor buffers),
//! and each entry point's workgroups and tile loop from the tiles and the
//! problem. f32 only.

use crate::backend::{AttentionGrads, AttentionRuntime, BackwardTensors, CallKeys, KeyLayout};
use crate::error::{BackendError, Result};
use crate::gpu::{self, ArenaPlan, KernelCache, KeyWords};
use crate::op::Output;
use crate::problem::Problem;
use crate::validate;
use crate::variant::Variant;
use kernels_spec::emit::Target;
use kernels_spec::emit::interface::{Access, Buffer, Dim, Scalar};
use kernels_spec::emit::wgsl::interface::{Binding, MAX_WORKGROUPS, Module, SHAPE, SHAPE_WORDS};
use kernels_spec::emit::wgsl::{FLAG_FIRST, FLAG_LAST, WgslTiles, kernels, module_source};
use kernels_spec::params::ERROR_WORDS;
use numr::dtype::DType;
use numr::ops::ShapeOps as _;
use numr::runtime::wgpu::{WgpuClient, WgpuDevice, WgpuRuntime, get_buffer};
use numr::runtime::{Runtime, RuntimeClient};
use numr::tensor::Tensor;
use std::any::TypeId;
use std::sync::{Arc, LazyLock};
use wgpu::util::DeviceExt as _;

const WGPU: &str = "wgpu";
const WGPU_DTYPES: &str = "f32";
const TARGET: Target = Target::Wgsl;

/// The kernels of one module: a pipeline per entry point, in the module's
/// order, and their shared bind group layout.
#[derive(Debug)]
struct Pass {
    layout: wgpu::BindGroupLayout,
    pipelines: Vec<wgpu::ComputePipeline>,
}

/// (variant, device, (head dim, value head dim), module).
type Key = (TypeId, usize, (usize, usize), &'static str);

static CACHE: LazyLock<KernelCache<Key, Pass>> = LazyLock::new(KernelCache::default);

/// The tiles for `V` at the problem's head dim.
fn tiles<V: Variant>(p: &Problem) -> std::result::Result<WgslTiles, BackendError> {
    let (d, dv) = gpu::head_dims(p);
    let default = WgslTiles::for_head_dims(d, dv);
    gpu::tiles::<V, _>(TARGET, default, p, DType::F32)
}

/// Runs `f` inside a validation error scope; a validation error is `error`
/// of its message.
fn scoped<T>(
    device: &wgpu::Device,
    f: impl FnOnce() -> T,
    error: impl FnOnce(String) -> BackendError,
) -> std::result::Result<T, BackendError> {
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let value = f();
    match pollster::block_on(scope.pop()) {
        None => Ok(value),
        Some(e) => Err(error(e.to_string())),
    }
}

fn layout_entry(binding: u32, b: &Binding) -> wgpu::BindGroupLayoutEntry {
    buffer_entry(
        binding,
        match b {
            Binding::Params | Binding::Shape => wgpu::BufferBindingType::Uniform,
            Binding::Captures => wgpu::BufferBindingType::Storage { read_only: false },
            Binding::Storage(_, access) => wgpu::BufferBindingType::Storage {
                read_only: *access == Access::Read,
            },
        },
    )
}

/// A compute-stage buffer binding of type `ty`.
fn buffer_entry(binding: u32, ty: wgpu::BufferBindingType) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty,
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}

fn build_pass(
    device: &wgpu::Device,
    name: &str,
    source: &str,
    module: &Module,
) -> std::result::Result<Pass, BackendError> {
    let compile_error = |log: String| BackendError::Compile {
        target: TARGET,
        source_name: name.to_string(),
        log,
    };
    scoped(
        device,
        || {
            let shader = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(name),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
            let entries: Vec<_> = (0u32..)
                .zip(module.bindings)
                .map(|(i, b)| layout_entry(i, b))
                .collect();
            let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(name),
                entries: &entries,
            });
            let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(name),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
            let pipelines = module
                .entries
                .iter()
                .map(|entry| {
                    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                        label: Some(entry.name),
                        layout: Some(&pipeline_layout),
                        module: &shader,
                        entry_point: Some(entry.name),
                        compilation_options: Default::default(),
                        cache: None,
                    })
                })
                .collect();
            Pass { layout, pipelines }
        },
        compile_error,
    )
}

/// The compiled `module` of `V` for the problem's head dim on `client`'s
/// device.
fn pass<V: Variant>(
    client: &WgpuClient,
    p: &Problem,
    module: &'static Module,
) -> Result<Arc<Pass>> {
    let device = client.wgpu_device_arc();
    let key = (
        V::kernels(),
        Arc::as_ptr(device) as usize,
        (p.head_dim, p.head_dim_v),
        module.name,
    );
    Ok(CACHE.get_or_build(key, || {
        let section = gpu::lowering::<V>(TARGET)?;
        let cfg = tiles::<V>(p)?;
        let source = module_source(section, module, &cfg)
            .map_err(|error| gpu::tiling(TARGET, p, DType::F32, error))?;
        let name = format!(
            "boostr {} {} D={} Dv={}",
            V::NAME,
            module.name,
            p.head_dim,
            p.head_dim_v
        );
        build_pass(device, &name, &source, module)
    })?)
}

/// A contiguous f32 tensor at offset 0, so its storage is exactly the view.
fn input(name: &'static str, t: &Tensor<WgpuRuntime>) -> Result<Tensor<WgpuRuntime>> {
    validate::check_dtype(name, t, WGPU, &[DType::F32], WGPU_DTYPES)?;
    Ok(t.contiguous()?)
}

/// The backward's per-row scratch `[B, Hq, Sq, 4]`. For `attn_bwd_delta`
/// to fill: `dlse` (zero without one) in component `z`, zero elsewhere.
/// For a call whose rows see only part of their keys (one call of a ring,
/// `whole_rows = Some((dout, out, lse))`), already as that kernel would
/// leave it had the call seen every key: `(0, 0, lse, D_i − dlse_i)` with
/// `D_i = rowsum(dO ∘ O)` of the whole row's output.
fn backward_rows(
    client: &WgpuClient,
    p: &Problem,
    dlse: Option<&Tensor<WgpuRuntime>>,
    whole_rows: Option<[&Tensor<WgpuRuntime>; 3]>,
) -> Result<Tensor<WgpuRuntime>> {
    use numr::ops::{BinaryOps as _, ReduceOps as _};
    let column = [p.batch, p.heads_q, p.seq_q, 1];
    let zeros = |n| {
        let shape = [p.batch, p.heads_q, p.seq_q, n];
        Tensor::<WgpuRuntime>::zeros(&shape, DType::F32, client.device())
    };
    let dlse = match dlse {
        Some(g) => {
            validate::check_dtype("dlse", g, WGPU, &[DType::F32], "f32")?;
            Some(g.contiguous()?.reshape(&column)?)
        }
        None => None,
    };
    Ok(match (whole_rows, dlse) {
        (None, None) => zeros(4)?,
        (None, Some(z)) => client.cat(&[&zeros(2)?, &z, &zeros(1)?], -1)?,
        (Some([dout, out, lse]), dlse) => {
            let mut delta = client.sum(&client.mul(dout, out)?, &[3], true)?;
            if let Some(z) = dlse {
                delta = client.sub(&delta, &z)?;
            }
            client.cat(&[&zeros(2)?, &lse.reshape(&column)?, &delta], -1)?
        }
    })
}

fn alloc(shape: &[usize], t: &Tensor<WgpuRuntime>) -> Result<Tensor<WgpuRuntime>> {
    Ok(Tensor::<WgpuRuntime>::empty(shape, DType::F32, t.device())?)
}

/// Loop iterations one invocation may run in one dispatch on Mesa's
/// llvmpipe, which silently leaves a loop once all loops of an invocation
/// together pass 65,535 iterations. A quarter of that: a tile skipped by
/// `continue` counts about three, and the prologue and epilogue loops add
/// a few more.
const LLVMPIPE_LOOP_BUDGET: u64 = 16384;

/// Tiles per dispatch of the tile loops of `V` on `client`'s device:
/// bounded on software adapters such as llvmpipe (see
/// [`LLVMPIPE_LOOP_BUDGET`]; the variant's classifier counts too),
/// unbounded on GPUs.
fn tiles_per_dispatch<V: Variant>(client: &WgpuClient, p: &Problem, cfg: &WgslTiles) -> u32 {
    if client.wgpu_device().adapter_info().device_type == wgpu::DeviceType::Cpu {
        // The forward classifies a tile once per query head its packed
        // rows span (a loop of as many iterations).
        let sq = p.seq_q.max(1) as u64;
        let group = (p.heads_q / p.heads_kv.max(1)).max(1) as u64;
        let heads = group.min(u64::from(cfg.workgroup_size).div_ceil(sq) + 1);
        let classify = (V::compiled().classify_loop_iterations + 1) * heads;
        cfg.tiles_within(LLVMPIPE_LOOP_BUDGET, classify)
    } else {
        u32::MAX
    }
}

/// The ranges `[begin, end)` covering `0..n` tiles, `per` at a time, with
/// the kernels' `FIRST` and `LAST` flags.
fn ranges(n: u64, per: u32) -> Vec<(u32, u32, u32)> {
    let n = u32::try_from(n).unwrap_or(u32::MAX);
    let per = per.max(1);
    let mut out = Vec::new();
    let mut begin = 0u32;
    loop {
        let end = begin.saturating_add(per).min(n);
        let mut flags = 0;
        if begin == 0 {
            flags |= FLAG_FIRST;
        }
        if end >= n {
            flags |= FLAG_LAST;
        }
        out.push((begin, end, flags));
        if end >= n {
            return out;
        }
        begin = end;
    }
}

/// The `shape` uniform of one dispatch, in [`SHAPE`]'s order: the call's
/// scalars, and the dispatch's range of the tile loop with its flags.
fn shape_words(
    p: &Problem,
    (begin, end, flags): (u32, u32, u32),
    keys: KeyWords,
    splits: u32,
) -> [u32; SHAPE_WORDS] {
    let mut words = [0u32; SHAPE_WORDS];
    for (w, &s) in words.iter_mut().zip(SHAPE) {
        *w = gpu::scalar_word(p, s, keys, splits).unwrap_or(match s {
            Scalar::TileBegin => begin,
            Scalar::TileEnd => end,
            _ => flags,
        });
    }
    words
}

/// What a binding of a dispatch gets: the parameter block, this dispatch's
/// `shape`, or a buffer (a tensor's, or the arena).
#[derive(Clone)]
enum Bound {
    Params,
    Shape,
    Buffer(Arc<wgpu::Buffer>),
}

/// The wgpu buffer of a numr tensor.
fn buffer_of(
    kernel: &'static str,
    name: &str,
    t: &Tensor<WgpuRuntime>,
) -> std::result::Result<Arc<wgpu::Buffer>, BackendError> {
    get_buffer(t.storage().ptr()).ok_or_else(|| BackendError::Launch {
        target: TARGET,
        kernel,
        reason: format!("no wgpu buffer for `{name}` {:?}", t.shape()),
    })
}

/// A call's capture arena on the device: its plan, its words (`u32`), and
/// where its error record is copied after the kernels when the call reads
/// it back.
struct DeviceArena {
    plan: ArenaPlan<WgpuRuntime>,
    words: Tensor<WgpuRuntime>,
    record: Option<Tensor<WgpuRuntime>>,
    /// Where a backward that computes tensor gradients reads back the
    /// record and the gradient accumulators (the arena from
    /// `grad_start` on), in that order.
    learned: Option<Tensor<WgpuRuntime>>,
}

impl DeviceArena {
    /// The arena of `plan` on `device`; a call that `learn`s reads its
    /// gradient accumulators back.
    fn new(plan: ArenaPlan<WgpuRuntime>, device: &WgpuDevice, learn: bool) -> Result<Self> {
        let words = Tensor::<WgpuRuntime>::empty(&[plan.words], DType::U32, device)?;
        let record = if plan.report {
            Some(Tensor::<WgpuRuntime>::empty(
                &[ERROR_WORDS],
                DType::U32,
                device,
            )?)
        } else {
            None
        };
        let learned = if learn {
            let grads = plan.arena.words - plan.arena.grad_start;
            Some(Tensor::<WgpuRuntime>::empty(
                &[ERROR_WORDS + grads],
                DType::U32,
                device,
            )?)
        } else {
            None
        };
        Ok(DeviceArena {
            plan,
            words,
            record,
            learned,
        })
    }

    /// Records what fills the arena before the kernels: the error words and
    /// the gradient accumulators zeroed, each tensor copied to its place,
    /// then the summaries.
    fn fill(
        &self,
        device: &wgpu::Device,
        encoder: &mut wgpu::CommandEncoder,
        summaries: Option<&SummaryPass>,
    ) -> std::result::Result<(), BackendError> {
        const KERNEL: &str = "summarize";
        let arena = buffer_of(KERNEL, "the capture arena", &self.words)?;
        encoder.clear_buffer(&arena, 0, Some(4 * ERROR_WORDS as u64));
        let (start, end) = (self.plan.arena.grad_start, self.plan.arena.words);
        if end > start {
            encoder.clear_buffer(&arena, 4 * start as u64, Some(4 * (end - start) as u64));
        }
        for (t, at) in self.plan.copies() {
            let src = buffer_of(KERNEL, "a tensor copied into the arena", t)?;
            encoder.copy_buffer_to_buffer(
                &src,
                4 * t.offset() as u64,
                &arena,
                4 * at as u64,
                Some(4 * t.numel() as u64),
            );
        }
        let Some(pass) = summaries else {
            return Ok(());
        };
        for job in &self.plan.jobs {
            let words = job.words();
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            let uniform = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("boostr summary job"),
                contents: &bytes,
                usage: wgpu::BufferUsages::UNIFORM,
            });
            let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(KERNEL),
                layout: &pass.layout,
                entries: &[
                    wgpu::BindGroupEntry {
                        binding: 0,
                        resource: uniform.as_entire_binding(),
                    },
                    wgpu::BindGroupEntry {
                        binding: 1,
                        resource: arena.as_entire_binding(),
                    },
                ],
            });
            let groups = job
                .entries()
                .div_ceil(u64::from(kernels::SUMMARY_WORKGROUP));
            let x = groups.min(MAX_WORKGROUPS);
            let y = groups.div_ceil(x.max(1));
            let mut cpass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(KERNEL),
                timestamp_writes: None,
            });
            cpass.set_pipeline(&pass.pipeline);
            cpass.set_bind_group(0, &bind_group, &[]);
            cpass.dispatch_workgroups(x as u32, y as u32, 1);
        }
        Ok(())
    }

    /// Records the copy of the error record, when the call reads it back,
    /// and of the record and the gradient accumulators, when it learns.
    fn copy_record(
        &self,
        encoder: &mut wgpu::CommandEncoder,
    ) -> std::result::Result<(), BackendError> {
        let arena = buffer_of("attention", "the capture arena", &self.words)?;
        let record_bytes = 4 * ERROR_WORDS as u64;
        if let Some(record) = &self.record {
            let dst = buffer_of("attention", "the error record", record)?;
            encoder.copy_buffer_to_buffer(&arena, 0, &dst, 0, Some(record_bytes));
        }
        if let Some(learned) = &self.learned {
            let dst = buffer_of("attention", "the gradient read-back", learned)?;
            encoder.copy_buffer_to_buffer(&arena, 0, &dst, 0, Some(record_bytes));
            let (start, end) = (self.plan.arena.grad_start, self.plan.arena.words);
            if end > start {
                encoder.copy_buffer_to_buffer(
                    &arena,
                    4 * start as u64,
                    &dst,
                    record_bytes,
                    Some(4 * (end - start) as u64),
                );
            }
        }
        Ok(())
    }

    /// After a call that learns: the gradients asked for (`wanted`), as
    /// f32 tensors of their tensors' shapes.
    fn grads<V: Variant>(&self, wanted: &[bool]) -> Result<Vec<Option<Tensor<WgpuRuntime>>>> {
        let Some(learned) = &self.learned else {
            return Ok(vec![None; V::LEARNABLE.len()]);
        };
        let words = learned.to_vec::<u32>();
        let (record, grads) = words.split_at(ERROR_WORDS);
        self.plan
            .grads::<V>(WGPU, record, grads, wanted, self.words.device())
    }

    /// After the call: the error of a read out of range, if one was
    /// recorded (a read back from the device, only for calls whose checked
    /// reads may fail).
    fn check<V: Variant>(&self) -> Result<()> {
        match &self.record {
            Some(record) => match self.plan.error::<V>(TARGET, &record.to_vec::<u32>()) {
                Some(e) => Err(e),
                None => Ok(()),
            },
            None => Ok(()),
        }
    }
}

/// The summary kernel of one device.
/// A fixed-function kernel (one for every variant): its bind group layout
/// (buffers only) and pipeline.
#[derive(Debug)]
struct FixedPass {
    layout: wgpu::BindGroupLayout,
    pipeline: wgpu::ComputePipeline,
}

/// The summary kernel's pipeline.
type SummaryPass = FixedPass;

/// The fixed kernel `entry_point` of `source`, its buffers bound as
/// `bindings` (in binding order), built once per device in `cache`.
fn fixed_pass(
    client: &WgpuClient,
    cache: &KernelCache<usize, FixedPass>,
    (name, source, entry_point): (&'static str, &'static str, &'static str),
    bindings: &[wgpu::BufferBindingType],
) -> Result<Arc<FixedPass>> {
    let device = client.wgpu_device_arc();
    let key = Arc::as_ptr(device) as usize;
    Ok(cache.get_or_build(key, || {
        scoped(
            device,
            || {
                let shader = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(name),
                    source: wgpu::ShaderSource::Wgsl(source.into()),
                });
                let entries: Vec<_> = (0u32..)
                    .zip(bindings)
                    .map(|(binding, &ty)| buffer_entry(binding, ty))
                    .collect();
                let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some(name),
                    entries: &entries,
                });
                let pipeline_layout =
                    device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                        label: Some(name),
                        bind_group_layouts: &[Some(&layout)],
                        immediate_size: 0,
                    });
                let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(name),
                    layout: Some(&pipeline_layout),
                    module: &shader,
                    entry_point: Some(entry_point),
                    compilation_options: Default::default(),
                    cache: None,
                });
                FixedPass { layout, pipeline }
            },
            |log| BackendError::Compile {
                target: TARGET,
                source_name: name.to_string(),
                log,
            },
        )
    })?)
}

static SUMMARY_CACHE: LazyLock<KernelCache<usize, FixedPass>> = LazyLock::new(KernelCache::default);

/// The summary kernel on `client`'s device.
fn summary_pass(client: &WgpuClient) -> Result<Arc<SummaryPass>> {
    fixed_pass(
        client,
        &SUMMARY_CACHE,
        ("boostr summarize", kernels::SUMMARY_SOURCE, "summarize"),
        &[
            wgpu::BufferBindingType::Uniform,
            wgpu::BufferBindingType::Storage { read_only: false },
        ],
    )
}

/// One module of a call: its pipelines, and the tensors its bindings get,
/// by role.
struct Step<'a> {
    module: &'a Module,
    pass: &'a Pass,
    tensors: &'a [(Buffer, &'a Tensor<WgpuRuntime>)],
    /// An entry point of the module not to run.
    skip: Option<&'static str>,
}

/// Fills the arena, then binds and dispatches every entry point of
/// `steps`, in order, over consecutive ranges of its tile loop, and
/// submits it all as one command buffer; then reports a read out of range,
/// if the call may have one. Returns the arena, whose gradient
/// accumulators a call that `learn`s reads back; a call over a KV cache
/// copies the words of its `layout` in; a split-KV forward runs in `splits`.
#[allow(clippy::too_many_arguments)]
fn run<V: Variant>(
    client: &WgpuClient,
    variant: &V,
    p: &Problem,
    cfg: &WgslTiles,
    steps: &[Step<'_>],
    learn: bool,
    layout: &KeyLayout<'_, WgpuRuntime>,
    splits: u32,
) -> Result<DeviceArena> {
    let arena = DeviceArena::new(ArenaPlan::new(variant, p, layout)?, client.device(), learn)?;
    let keys = arena.plan.keys;
    let summaries = if arena.plan.jobs.is_empty() {
        None
    } else {
        Some(summary_pass(client)?)
    };
    let params = gpu::param_words(variant, p);
    let captures = buffer_of("attention", "the capture arena", &arena.words)?;
    let device = client.wgpu_device();
    let sizes = gpu::split_sizes(p, splits);
    let per_dispatch = tiles_per_dispatch::<V>(client, p, cfg);
    let launch_error = |kernel: &'static str, reason: String| BackendError::Launch {
        target: TARGET,
        kernel,
        reason,
    };
    // What each binding gets, and every entry's workgroups, before anything
    // is recorded.
    let mut plans = Vec::new();
    for Step {
        module,
        pass,
        tensors,
        skip,
    } in steps
    {
        let kernel = module.entries.first().map_or(module.name, |e| e.name);
        let bound = module
            .bindings
            .iter()
            .map(|b| match b {
                Binding::Storage(buf, _) => {
                    let tensor = tensors
                        .iter()
                        .find(|(role, _)| role == buf)
                        .map(|(_, t)| t)
                        .ok_or_else(|| {
                            launch_error(kernel, format!("no tensor is bound to `{}`", buf.name()))
                        })?;
                    buffer_of(kernel, buf.name(), tensor).map(Bound::Buffer)
                }
                Binding::Params => Ok(Bound::Params),
                Binding::Shape => Ok(Bound::Shape),
                Binding::Captures => Ok(Bound::Buffer(captures.clone())),
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for (i, entry) in module.entries.iter().enumerate() {
            if *skip == Some(entry.name) {
                continue;
            }
            let grid = entry
                .workgroups(cfg, &sizes)
                .map_err(|e| launch_error(entry.name, e.to_string()))?;
            let ranges = ranges(entry.tile_count(cfg, &sizes), per_dispatch);
            plans.push((module, pass, bound.clone(), i, grid, ranges));
        }
    }
    scoped(
        device,
        || {
            let uniform = |label, bytes: &[u8]| {
                device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(label),
                    contents: bytes,
                    usage: wgpu::BufferUsages::UNIFORM,
                })
            };
            let params = uniform("boostr params", &params.to_le_bytes());
            let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("boostr attention"),
            });
            arena.fill(device, &mut encoder, summaries.as_deref())?;
            let mut cpass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("boostr attention"),
                timestamp_writes: None,
            });
            for (module, pass, bound, entry, grid, ranges) in &plans {
                for &range in ranges {
                    let words = shape_words(p, range, keys, splits);
                    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                    let shape = uniform("boostr shape", &bytes);
                    let entries: Vec<_> = (0u32..)
                        .zip(bound)
                        .map(|(binding, b)| wgpu::BindGroupEntry {
                            binding,
                            resource: match b {
                                Bound::Params => params.as_entire_binding(),
                                Bound::Shape => shape.as_entire_binding(),
                                Bound::Buffer(buffer) => buffer.as_entire_binding(),
                            },
                        })
                        .collect();
                    let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some(module.name),
                        layout: &pass.layout,
                        entries: &entries,
                    });
                    cpass.set_pipeline(&pass.pipelines[*entry]);
                    cpass.set_bind_group(0, &bind_group, &[]);
                    cpass.dispatch_workgroups(grid.0, grid.1, 1);
                }
            }
            drop(cpass);
            arena.copy_record(&mut encoder)?;
            client
                .wgpu_queue()
                .submit(std::iter::once(encoder.finish()));
            Ok::<(), BackendError>(())
        },
        |reason| {
            let kernel = steps.first().map_or("attention", |s| s.module.name);
            launch_error(kernel, reason)
        },
    )??;
    arena.check::<V>()?;
    Ok(arena)
}

/// Workgroups that keep the device busy, which a split-KV forward splits
/// the keys to reach: on a software adapter (llvmpipe, one workgroup at a
/// time per thread) two per CPU thread, on a GPU a few per compute unit
/// of a large one.
fn target_workgroups(client: &WgpuClient) -> u64 {
    if client.wgpu_device().adapter_info().device_type == wgpu::DeviceType::Cpu {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        2 * threads as u64
    } else {
        512
    }
}

/// The key splits of the forward of `p` on `client`'s device (see
/// [`gpu::split_count`]), at most what the merge's loops allow per
/// invocation on llvmpipe (see [`LLVMPIPE_LOOP_BUDGET`]).
fn forward_splits(client: &WgpuClient, p: &Problem, cfg: &WgslTiles) -> u32 {
    let sizes = gpu::sizes(p);
    let blocks = sizes
        .dim(Dim::GroupRows)
        .div_ceil(cfg.workgroup_size.into())
        * sizes.dim(Dim::BatchHeadsKv);
    let most = LLVMPIPE_LOOP_BUDGET / (u64::from(cfg.value_dim) + 2);
    gpu::split_count(
        blocks,
        sizes.seq_k,
        cfg.block_kv.into(),
        target_workgroups(client),
        most.clamp(1, 64),
    )
}

/// The forward, over keys of any layout (a cache's lengths and page table
/// copied into the arena), in `splits` key splits (chosen from the shape
/// and the device if `None`).
fn forward_split<V: Variant>(
    variant: &V,
    p: &Problem,
    q: &Tensor<WgpuRuntime>,
    keys: CallKeys<'_, WgpuRuntime>,
    splits: Option<u32>,
) -> Result<Output<WgpuRuntime>> {
    let (q, k, v) = (input("q", q)?, input("k", keys.k)?, input("v", keys.v)?);
    let client = WgpuRuntime::default_client(q.device());
    let fwd = pass::<V>(&client, p, &kernels::FORWARD)?;
    let cfg = tiles::<V>(p)?;
    let splits = splits
        .unwrap_or_else(|| forward_splits(&client, p, &cfg))
        .max(1);
    let out = alloc(&[p.batch, p.heads_q, p.seq_q, p.head_dim_v], &q)?;
    let lse = alloc(&[p.batch, p.heads_q, p.seq_q], &q)?;
    let rows = p.batch * p.heads_q * p.seq_q;
    let split = splits as usize;
    if split == 1 {
        let stats = alloc(&[rows, 4], &q)?;
        let tensors = [
            (Buffer::Q, &q),
            (Buffer::K, &k),
            (Buffer::V, &v),
            (Buffer::Out, &out),
            (Buffer::Lse, &lse),
            (Buffer::Stats, &stats),
        ];
        let steps = [Step {
            module: &kernels::FORWARD,
            pass: &fwd,
            tensors: &tensors,
            skip: None,
        }];
        run(&client, variant, p, &cfg, &steps, false, &keys.layout, 1)?;
        return forward_output(p, out, lse, &stats);
    }
    let merge = pass::<V>(&client, p, &kernels::MERGE)?;
    let split_out = alloc(&[split, rows, p.head_dim_v], &q)?;
    let split_lse = alloc(&[split, rows], &q)?;
    let stats = alloc(&[split * rows, 4], &q)?;
    let forward = [
        (Buffer::Q, &q),
        (Buffer::K, &k),
        (Buffer::V, &v),
        (Buffer::Out, &split_out),
        (Buffer::Lse, &split_lse),
        (Buffer::Stats, &stats),
    ];
    let merged = [
        (Buffer::SplitOut, &split_out),
        (Buffer::SplitLse, &split_lse),
        (Buffer::Out, &out),
        (Buffer::Lse, &lse),
        (Buffer::Stats, &stats),
    ];
    let steps = [
        Step {
            module: &kernels::FORWARD,
            pass: &fwd,
            tensors: &forward,
            skip: None,
        },
        Step {
            module: &kernels::MERGE,
            pass: &merge,
            tensors: &merged,
            skip: None,
        },
    ];
    run(
        &client,
        variant,
        p,
        &cfg,
        &steps,
        false,
        &keys.layout,
        splits,
    )?;
    forward_output(p, out, lse, &stats)
}

/// The forward's result: `out`, `lse` and, where `p` asks for them, the
/// rows' largest scores, component `z` of the first `[B, Hq, Sq]` rows of
/// `stats` (split 0's, where the merge leaves them).
fn forward_output(
    p: &Problem,
    out: Tensor<WgpuRuntime>,
    lse: Tensor<WgpuRuntime>,
    stats: &Tensor<WgpuRuntime>,
) -> Result<Output<WgpuRuntime>> {
    let max_scores = if p.max_scores {
        let rows = lse.numel();
        let top = stats.narrow(0, 0, rows)?.narrow(1, 2, 1)?.contiguous()?;
        Some(top.reshape(lse.shape())?)
    } else {
        None
    };
    Ok(Output {
        out,
        lse,
        max_scores,
    })
}

/// [`attention`](crate::attention()) on wgpu in exactly `splits` key splits
/// (1: the unsplit kernel) where the call itself chooses them from the
/// shape and the device: for comparing the split-KV decode with the
/// unsplit kernel.
pub fn forward_in_splits<V: Variant>(
    variant: &V,
    q: &Tensor<WgpuRuntime>,
    keys: crate::Keys<'_, WgpuRuntime>,
    opts: &crate::AttentionOptions,
    splits: u32,
) -> Result<Output<WgpuRuntime>> {
    let call = crate::keys::Call::new(variant, q, &keys, opts)?;
    let y = forward_split(variant, &call.problem, &call.q, call.keys(), Some(splits))?;
    call.output(y)
}

/// The key splits [`attention`](crate::attention()) chooses on wgpu for `q`
/// over `keys`.
pub fn forward_splits_of<V: Variant>(
    variant: &V,
    q: &Tensor<WgpuRuntime>,
    keys: crate::Keys<'_, WgpuRuntime>,
    opts: &crate::AttentionOptions,
) -> Result<u32> {
    let call = crate::keys::Call::new(variant, q, &keys, opts)?;
    let client = WgpuRuntime::default_client(q.device());
    Ok(forward_splits(
        &client,
        &call.problem,
        &tiles::<V>(&call.problem)?,
    ))
}

impl AttentionRuntime for WgpuRuntime {
    fn write_kv(write: &crate::backend::KvWrite<'_, Self>) -> Result<()> {
        append::write_kv(write)
    }

    fn attention_forward<V: Variant>(
        variant: &V,
        p: &Problem,
        q: &Tensor<Self>,
        keys: CallKeys<'_, Self>,
    ) -> Result<Output<Self>> {
        forward_split(variant, p, q, keys, None)
    }

    fn attention_backward<V: Variant>(
        variant: &V,
        p: &Problem,
        t: BackwardTensors<'_, Self>,
    ) -> Result<AttentionGrads<Self>> {
        // D_i comes from the recomputed P (see `kernels::BACKWARD_DQ`),
        // but for a call whose rows see part of their keys (a ring's):
        // from `rowsum(dO ∘ O)`, of the whole row's `out`.
        let x = gpu::BackwardOperands::new(&t, WGPU, input)?;
        let window = variant.window().whole.is_some();
        let (q, k, v) = (&x.q, &x.k, &x.v);
        let client = WgpuRuntime::default_client(q.device());
        let learn = gpu::learns::<V>(t.tensor_grads);
        let tensors_module: &[&'static Module] = if learn {
            &[&kernels::BACKWARD_TENSORS]
        } else {
            &[]
        };
        let passes = kernels::BACKWARD
            .iter()
            .chain(tensors_module)
            .map(|module| Ok((*module, pass::<V>(&client, p, module)?)))
            .collect::<Result<Vec<_>>>()?;
        let cfg = tiles::<V>(p)?;
        // Per query row: dlse on entry, running sums between dispatches,
        // then lse and D_i − dlse_i; a window's given.
        let out = if window {
            Some(input("out", t.out)?)
        } else {
            None
        };
        let whole_rows = out.as_ref().map(|out| [&x.dout, out, &x.lse]);
        let rows = backward_rows(&client, p, t.dlse, whole_rows)?;
        let dq = alloc(q.shape(), q)?;
        // dK and dV of each sequence's slots; a paged call's are folded
        // into its pages at the end.
        let dk = alloc(&p.k_shape(), k)?;
        let dv = alloc(&p.v_shape(), v)?;
        let tensors = [
            (Buffer::Q, q),
            (Buffer::K, k),
            (Buffer::V, v),
            (Buffer::Dout, &x.dout),
            (Buffer::Lse, &x.lse),
            (Buffer::Rows, &rows),
            (Buffer::Dq, &dq),
            (Buffer::Dk, &dk),
            (Buffer::Dv, &dv),
        ];
        let steps: Vec<Step<'_>> = passes
            .iter()
            .map(|(module, pass)| Step {
                module,
                pass,
                tensors: &tensors,
                skip: window.then_some("attn_bwd_delta"),
            })
            .collect();
        let arena = run(&client, variant, p, &cfg, &steps, learn, &t.keys.layout, 1)?;
        let tensors = arena.grads::<V>(t.tensor_grads)?;
        gpu::backward_grads(p, &t.keys.layout, [dq, dk, dv], k.shape()[0], tensors)
    }
}

mod append;
#[cfg(test)]
mod tests;
