//! The WGSL kernels on numr's [`WgpuRuntime`].
//!
//! Per (variant, device, head dim) the kernel modules are assembled from the
//! variant's WGSL section ([`Variant::wgsl_variant_functions`]) and the
//! templates of `kernels_spec::emit::wgsl`, compiled once, and cached. Every
//! launch binds `params` (the variant's fields) and `shape` as uniforms, then
//! numr's tensor buffers in the order the templates declare. f32 only.

use crate::backend::AttentionRuntime;
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::validate;
use crate::variant::Variant;
use kernels_spec::emit::wgsl::{WgslTiles, backward_modules_from, forward_module_from};
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::runtime::wgpu::{WgpuClient, WgpuRuntime, get_buffer};
use numr::tensor::Tensor;
use std::any::TypeId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use wgpu::util::DeviceExt as _;

const WGPU: &str = "wgpu";
const WGPU_DTYPES: &str = "f32";
/// `maxComputeWorkgroupsPerDimension` that WebGPU guarantees.
const MAX_WORKGROUPS: usize = 65535;

/// A backend failure (shader compilation, validation, missing buffer).
/// The text of a backend error without its prefix, for cached failures.
fn message(e: Error) -> String {
    match e {
        Error::Numr(numr::error::Error::Backend(m)) => m,
        other => other.to_string(),
    }
}

fn backend(msg: String) -> Error {
    Error::Numr(numr::error::Error::Backend(format!("boostr wgpu: {msg}")))
}

/// The kernels of one pass: a pipeline per entry point, and their shared
/// bind group layout.
#[derive(Debug)]
struct Pass {
    layout: wgpu::BindGroupLayout,
    pipelines: Vec<wgpu::ComputePipeline>,
}

/// Forward, or one of the two backward modules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Module {
    Forward,
    BackwardDq,
    BackwardDkDv,
}

impl Module {
    /// Entry points, and (read-only, read-write) storage buffers after the
    /// two uniforms.
    fn entries(self) -> (&'static [&'static str], u32, u32) {
        match self {
            Module::Forward => (&["attn_fwd"], 3, 3),
            Module::BackwardDq => (&["attn_bwd_delta", "attn_bwd_dq"], 5, 3),
            Module::BackwardDkDv => (&["attn_bwd_dkdv"], 6, 2),
        }
    }
}

/// (variant, device, head dim, module).
type Key = (TypeId, usize, usize, Module);
/// One cache entry: built once by the first caller, waited for by others; a
/// failed build is kept as its error.
type Slot = Arc<OnceLock<std::result::Result<Arc<Pass>, String>>>;

fn cache() -> &'static Mutex<HashMap<Key, Slot>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Slot>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The tiles for `head_dim`: the variant's `tile(..)` overrides when they fit
/// WebGPU's limits, else the emitter's default.
fn tiles<V: Variant>(head_dim: usize) -> Result<WgslTiles> {
    let d = u32::try_from(head_dim).map_err(|_| backend(format!("head dim {head_dim}")))?;
    let base = WgslTiles::for_head_dim(d);
    let wanted = WgslTiles {
        block_q: V::TILE_Q.unwrap_or(base.block_q),
        block_kv: V::TILE_KV.unwrap_or(base.block_kv),
        ..base
    };
    let tiles = if wanted.validate().is_ok() {
        wanted
    } else {
        base
    };
    tiles.validate().map_err(|e| {
        backend(format!(
            "head dim {head_dim} has no WGSL tiling within WebGPU limits: {e}"
        ))
    })?;
    Ok(tiles)
}

/// Runs `f` inside a validation error scope; a validation error becomes `Err`.
fn scoped<T>(device: &wgpu::Device, what: &str, f: impl FnOnce() -> T) -> Result<T> {
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let value = f();
    match pollster::block_on(scope.pop()) {
        None => Ok(value),
        Some(e) => Err(backend(format!("{what}: {e}"))),
    }
}

fn build_pass(device: &wgpu::Device, name: &str, source: &str, module: Module) -> Result<Pass> {
    let (entries, n_read, n_rw) = module.entries();
    scoped(device, &format!("compiling {name}"), || {
        let shader = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(name),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        let uniform = |binding| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let storage = |binding, read_only| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let layout_entries: Vec<_> = [uniform(0), uniform(1)]
            .into_iter()
            .chain((0..n_read).map(|i| storage(2 + i, true)))
            .chain((0..n_rw).map(|i| storage(2 + n_read + i, false)))
            .collect();
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(name),
            entries: &layout_entries,
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(name),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipelines = entries
            .iter()
            .map(|entry| {
                device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(entry),
                    layout: Some(&pipeline_layout),
                    module: &shader,
                    entry_point: Some(entry),
                    compilation_options: Default::default(),
                    cache: None,
                })
            })
            .collect();
        Pass { layout, pipelines }
    })
}

/// The compiled `module` of `V` for `head_dim` on `client`'s device.
fn pass<V: Variant>(client: &WgpuClient, head_dim: usize, module: Module) -> Result<Arc<Pass>> {
    let device = client.wgpu_device_arc();
    let key = (
        TypeId::of::<V>(),
        Arc::as_ptr(device) as usize,
        head_dim,
        module,
    );
    // Only the slot lookup holds the map's lock (a poisoned lock only means
    // another launch panicked; the map is intact), so different modules
    // compile in parallel.
    let slot = {
        let mut map = cache().lock().unwrap_or_else(|e| e.into_inner());
        map.entry(key).or_default().clone()
    };
    slot.get_or_init(|| build::<V>(device, head_dim, module).map(Arc::new))
        .clone()
        .map_err(|msg| Error::Numr(numr::error::Error::Backend(msg)))
}

fn build<V: Variant>(
    device: &wgpu::Device,
    head_dim: usize,
    module: Module,
) -> std::result::Result<Pass, String> {
    let variant_fns = V::wgsl_variant_functions().ok_or_else(|| {
        format!(
            "boostr wgpu: variant `{}` has no WGSL lowering (implement Variant with #[attention])",
            V::NAME
        )
    })?;
    let cfg = tiles::<V>(head_dim).map_err(message)?;
    let source = match module {
        Module::Forward => forward_module_from(variant_fns, &cfg),
        Module::BackwardDq => backward_modules_from(variant_fns, &cfg).0,
        Module::BackwardDkDv => backward_modules_from(variant_fns, &cfg).1,
    };
    let name = format!("boostr {} {module:?} D={head_dim}", V::NAME);
    build_pass(device, &name, &source, module).map_err(message)
}

/// A contiguous f32 tensor at offset 0, so its storage is exactly the view.
fn input(name: &'static str, t: &Tensor<WgpuRuntime>) -> Result<Tensor<WgpuRuntime>> {
    validate::check_dtype(name, t, WGPU, &[DType::F32], WGPU_DTYPES)?;
    Ok(t.contiguous()?)
}

fn alloc(shape: &[usize], t: &Tensor<WgpuRuntime>) -> Result<Tensor<WgpuRuntime>> {
    Ok(Tensor::<WgpuRuntime>::empty(shape, DType::F32, t.device())?)
}

fn buffer(t: &Tensor<WgpuRuntime>) -> Result<Arc<wgpu::Buffer>> {
    get_buffer(t.storage().ptr()).ok_or_else(|| {
        backend(format!(
            "no wgpu buffer for a tensor of shape {:?}",
            t.shape()
        ))
    })
}

fn workgroups(n: usize, what: &str) -> Result<u32> {
    if n > MAX_WORKGROUPS {
        return Err(backend(format!(
            "{n} workgroups along {what} exceed WebGPU's {MAX_WORKGROUPS}"
        )));
    }
    Ok(n as u32)
}

/// Loop iterations one invocation may run in one dispatch on Mesa's
/// llvmpipe, which silently leaves a loop once all loops of an invocation
/// together pass 65,535 iterations. A quarter of that: a tile skipped by
/// `continue` counts about three, and the prologue and epilogue loops add
/// a few more.
const LLVMPIPE_LOOP_BUDGET: u64 = 16384;

/// Tiles per dispatch of the tile loops on `client`'s device: bounded on
/// software adapters such as llvmpipe (see [`LLVMPIPE_LOOP_BUDGET`]),
/// unbounded on GPUs.
fn tiles_per_dispatch(client: &WgpuClient, cfg: &WgslTiles) -> u32 {
    if client.wgpu_device().adapter_info().device_type == wgpu::DeviceType::Cpu {
        cfg.tiles_within(LLVMPIPE_LOOP_BUDGET)
    } else {
        u32::MAX
    }
}

/// The ranges `[begin, end)` covering `0..n` tiles, `per` at a time, with
/// the kernels' FIRST (1) and LAST (2) flags.
fn ranges(n: usize, per: u32) -> Vec<(u32, u32, u32)> {
    let n = u32::try_from(n).unwrap_or(u32::MAX);
    let per = per.max(1);
    let mut out = Vec::new();
    let mut begin = 0u32;
    loop {
        let end = begin.saturating_add(per).min(n);
        let flags = u32::from(begin == 0) | (u32::from(end >= n) << 1);
        out.push((begin, end, flags));
        if end >= n {
            return out;
        }
        begin = end;
    }
}

/// One kernel over the whole problem: dispatches over consecutive tile
/// ranges, each with the same grid.
struct Launch<'a> {
    pass: &'a Pass,
    entry: usize,
    /// Index into the tensor lists of [`run`].
    group: usize,
    grid: (u32, u32),
    /// Tiles the kernel's tile loop covers, and how many per dispatch.
    tiles: usize,
    per_dispatch: u32,
}

/// Binds `params`, `shape` (with each dispatch's tile range) and `tensors`
/// (in binding order), records `launches` in order, and submits them.
fn run(
    client: &WgpuClient,
    params: &[u32],
    p: &Problem,
    groups: &[&[&Tensor<WgpuRuntime>]],
    launches: &[Launch<'_>],
) -> Result<()> {
    let device = client.wgpu_device();
    let shape = |(begin, end, flags): (u32, u32, u32)| {
        [
            p.batch as u32,
            p.heads_q as u32,
            p.heads_kv as u32,
            p.seq_q as u32,
            p.seq_k as u32,
            p.scale.to_bits(),
            begin,
            end,
            flags,
            0,
            0,
            0,
        ]
    };
    let buffers = groups
        .iter()
        .map(|tensors| {
            tensors
                .iter()
                .map(|t| buffer(t))
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    scoped(device, "launching attention kernels", || {
        let uniform = |label, words: &[u32]| {
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: &bytes,
                usage: wgpu::BufferUsages::UNIFORM,
            })
        };
        let params = uniform("boostr params", params);
        let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("boostr attention"),
        });
        for l in launches {
            for range in ranges(l.tiles, l.per_dispatch) {
                let shape = uniform("boostr shape", &shape(range));
                let entries: Vec<_> = [&params, &shape]
                    .into_iter()
                    .chain(buffers[l.group].iter().map(|b| &**b))
                    .enumerate()
                    .map(|(i, b)| wgpu::BindGroupEntry {
                        binding: i as u32,
                        resource: b.as_entire_binding(),
                    })
                    .collect();
                let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("boostr attention"),
                    layout: &l.pass.layout,
                    entries: &entries,
                });
                let mut cpass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("boostr attention"),
                    timestamp_writes: None,
                });
                cpass.set_pipeline(&l.pass.pipelines[l.entry]);
                cpass.set_bind_group(0, &bind_group, &[]);
                cpass.dispatch_workgroups(l.grid.0, l.grid.1, 1);
            }
        }
        client
            .wgpu_queue()
            .submit(std::iter::once(encoder.finish()));
    })
}

impl AttentionRuntime for WgpuRuntime {
    fn attention_forward<V: Variant>(
        variant: &V,
        p: &Problem,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        let (q, k, v) = (input("q", q)?, input("k", k)?, input("v", v)?);
        let client = WgpuRuntime::default_client(q.device());
        let fwd = pass::<V>(&client, p.head_dim, Module::Forward)?;
        let cfg = tiles::<V>(p.head_dim)?;
        let out = alloc(q.shape(), &q)?;
        let lse = alloc(&[p.batch, p.heads_q, p.seq_q], &q)?;
        let rows = cfg.workgroup_size as usize;
        // Running (max, sum) per row between dispatches.
        let stats = alloc(&[p.batch, p.heads_q, p.seq_q, 2], &q)?;
        let grid = (
            // One invocation per query row.
            workgroups(p.seq_q.div_ceil(rows), "Sq")?,
            workgroups(p.batch * p.heads_q, "B·Hq")?,
        );
        run(
            &client,
            &variant.wgsl_params(),
            p,
            &[&[&q, &k, &v, &out, &lse, &stats]],
            &[Launch {
                pass: &fwd,
                entry: 0,
                group: 0,
                grid,
                tiles: p.seq_k.div_ceil(cfg.block_kv as usize),
                per_dispatch: tiles_per_dispatch(&client, &cfg),
            }],
        )?;
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
        // `out` is not read: D_i comes from the recomputed P (see
        // `kernels::BACKWARD_DQ`).
        let _ = out;
        let lse = input("lse", lse)?;
        let dout = input("dout", dout)?;
        let client = WgpuRuntime::default_client(q.device());
        let dq_pass = pass::<V>(&client, p.head_dim, Module::BackwardDq)?;
        let dkdv_pass = pass::<V>(&client, p.head_dim, Module::BackwardDkDv)?;
        let cfg = tiles::<V>(p.head_dim)?;
        let delta = alloc(&[p.batch, p.heads_q, p.seq_q], &q)?;
        let stats = alloc(&[p.batch, p.heads_q, p.seq_q, 2], &q)?;
        let dq = alloc(q.shape(), &q)?;
        let dk = alloc(k.shape(), &k)?;
        let dv = alloc(v.shape(), &v)?;
        let per_dispatch = tiles_per_dispatch(&client, &cfg);
        // The dQ-side kernels loop over staged key tiles, the dK/dV kernel
        // over staged query tiles; both run one invocation per row of the
        // other side.
        let key_tiles = p.seq_k.div_ceil(cfg.block_kv as usize);
        let query_tiles = p.seq_q.div_ceil(cfg.block_q as usize);
        let rows = cfg.workgroup_size as usize;
        let dq_grid = (
            workgroups(p.seq_q.div_ceil(rows), "Sq")?,
            workgroups(p.batch * p.heads_q, "B·Hq")?,
        );
        let dkdv_grid = (
            workgroups(p.seq_k.div_ceil(rows), "Sk")?,
            workgroups(p.batch * p.heads_kv, "B·Hkv")?,
        );
        let over_keys = |entry| Launch {
            pass: &dq_pass,
            entry,
            group: 0,
            grid: dq_grid,
            tiles: key_tiles,
            per_dispatch,
        };
        run(
            &client,
            &variant.wgsl_params(),
            p,
            &[
                &[&q, &k, &v, &dout, &lse, &delta, &dq, &stats],
                &[&q, &k, &v, &dout, &lse, &delta, &dk, &dv],
            ],
            &[
                over_keys(0),
                over_keys(1),
                Launch {
                    pass: &dkdv_pass,
                    entry: 0,
                    group: 1,
                    grid: dkdv_grid,
                    // (query head of the GQA group, query tile) pairs.
                    tiles: p.group() * query_tiles,
                    per_dispatch,
                },
            ],
        )?;
        Ok((dq, dk, dv))
    }
}

#[cfg(test)]
mod tests;
