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
            Module::Forward => (&["attn_fwd"], 3, 2),
            Module::BackwardDq => (&["attn_bwd_delta", "attn_bwd_dq"], 5, 2),
            Module::BackwardDkDv => (&["attn_bwd_dkdv"], 6, 2),
        }
    }
}

/// (variant, device, head dim, module).
type Key = (TypeId, usize, usize, Module);

fn cache() -> &'static Mutex<HashMap<Key, Arc<Pass>>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Arc<Pass>>>> = OnceLock::new();
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
    // A poisoned lock only means another launch panicked; the map is intact.
    let mut cache = cache().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = cache.get(&key) {
        return Ok(p.clone());
    }
    let variant_fns = V::wgsl_variant_functions().ok_or_else(|| {
        backend(format!(
            "variant `{}` has no WGSL lowering (implement Variant with #[attention])",
            V::NAME
        ))
    })?;
    let cfg = tiles::<V>(head_dim)?;
    let source = match module {
        Module::Forward => forward_module_from(variant_fns, &cfg),
        Module::BackwardDq => backward_modules_from(variant_fns, &cfg).0,
        Module::BackwardDkDv => backward_modules_from(variant_fns, &cfg).1,
    };
    let name = format!("boostr {} {module:?} D={head_dim}", V::NAME);
    let p = Arc::new(build_pass(device, &name, &source, module)?);
    cache.insert(key, p.clone());
    Ok(p)
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

/// One launch: the kernels' bind group and grid.
struct Launch<'a> {
    pass: &'a Pass,
    entry: usize,
    group: usize,
    grid: (u32, u32),
}

/// Binds `params`, `shape` and `tensors` (in binding order) into one bind
/// group per pass, records `launches` in order, and submits them.
fn run(
    client: &WgpuClient,
    params: &[u32],
    p: &Problem,
    groups: &[(&Pass, &[&Tensor<WgpuRuntime>])],
    launches: &[Launch<'_>],
) -> Result<()> {
    let device = client.wgpu_device();
    let shape = [
        p.batch as u32,
        p.heads_q as u32,
        p.heads_kv as u32,
        p.seq_q as u32,
        p.seq_k as u32,
        p.scale.to_bits(),
        0,
        0,
    ];
    let mut buffers = Vec::new();
    for (_, tensors) in groups {
        buffers.push(
            tensors
                .iter()
                .map(|t| buffer(t))
                .collect::<Result<Vec<_>>>()?,
        );
    }
    scoped(device, "launching attention kernels", || {
        let uniform = |label, words: &[u32]| {
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: &bytes,
                usage: wgpu::BufferUsages::UNIFORM,
            })
        };
        let (params, shape) = (
            uniform("boostr params", params),
            uniform("boostr shape", &shape),
        );
        let bind_groups: Vec<wgpu::BindGroup> = groups
            .iter()
            .zip(&buffers)
            .map(|((pass, _), bufs)| {
                let entries: Vec<_> = [&params, &shape]
                    .into_iter()
                    .chain(bufs.iter().map(|b| &**b))
                    .enumerate()
                    .map(|(i, b)| wgpu::BindGroupEntry {
                        binding: i as u32,
                        resource: b.as_entire_binding(),
                    })
                    .collect();
                device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("boostr attention"),
                    layout: &pass.layout,
                    entries: &entries,
                })
            })
            .collect();
        let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("boostr attention"),
        });
        for l in launches {
            let mut cpass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("boostr attention"),
                timestamp_writes: None,
            });
            cpass.set_pipeline(&l.pass.pipelines[l.entry]);
            cpass.set_bind_group(0, &bind_groups[l.group], &[]);
            cpass.dispatch_workgroups(l.grid.0, l.grid.1, 1);
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
        let grid = (
            workgroups(p.seq_q.div_ceil(cfg.block_q as usize), "Sq")?,
            workgroups(p.batch * p.heads_q, "B·Hq")?,
        );
        run(
            &client,
            &variant.wgsl_params(),
            p,
            &[(&fwd, &[&q, &k, &v, &out, &lse])],
            &[Launch {
                pass: &fwd,
                entry: 0,
                group: 0,
                grid,
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
        let dq = alloc(q.shape(), &q)?;
        let dk = alloc(k.shape(), &k)?;
        let dv = alloc(v.shape(), &v)?;
        let bh = workgroups(p.batch * p.heads_q, "B·Hq")?;
        let dq_grid = (
            workgroups(p.seq_q.div_ceil(cfg.block_q as usize), "Sq")?,
            bh,
        );
        let dkdv_grid = (
            workgroups(p.seq_k.div_ceil(cfg.block_kv as usize), "Sk")?,
            workgroups(p.batch * p.heads_kv, "B·Hkv")?,
        );
        run(
            &client,
            &variant.wgsl_params(),
            p,
            &[
                (&dq_pass, &[&q, &k, &v, &dout, &lse, &delta, &dq]),
                (&dkdv_pass, &[&q, &k, &v, &dout, &lse, &delta, &dk, &dv]),
            ],
            &[
                Launch {
                    pass: &dq_pass,
                    entry: 0,
                    group: 0,
                    grid: dq_grid,
                },
                Launch {
                    pass: &dq_pass,
                    entry: 1,
                    group: 0,
                    grid: dq_grid,
                },
                Launch {
                    pass: &dkdv_pass,
                    entry: 0,
                    group: 1,
                    grid: dkdv_grid,
                },
            ],
        )?;
        Ok((dq, dk, dv))
    }
}

#[cfg(test)]
mod tests {
    use crate::stock::Causal;
    use crate::{AttentionOptions, Error, attention_fwd};
    use numr::dtype::DType;
    use numr::runtime::wgpu::{WgpuRuntime, is_wgpu_available, wgpu_device};
    use numr::tensor::Tensor;

    /// Views at a non-zero offset (here: along the batch) give the same
    /// result as their contiguous copies; non-f32 inputs are refused.
    #[test]
    fn offset_views_and_dtypes() {
        if !is_wgpu_available() {
            assert!(
                std::env::var_os(crate::testing::REQUIRE_DEVICE_ENV).is_none(),
                "no wgpu device"
            );
            eprintln!("boostr: skipping: no wgpu device");
            return;
        }
        let device = wgpu_device();
        let data: Vec<f32> = (0..2 * 2 * 5 * 8)
            .map(|i| ((i * 7 % 13) as f32) * 0.1)
            .collect();
        let t = Tensor::<WgpuRuntime>::from_slice(&data, &[2, 2, 5, 8], &device).unwrap();
        let view = t.narrow(0, 1, 1).unwrap();
        let copy = Tensor::<WgpuRuntime>::from_slice(&data[80..], &[1, 2, 5, 8], &device).unwrap();
        let opts = AttentionOptions::default();
        let (o1, l1) = attention_fwd(&Causal, &view, &view, &view, &opts).unwrap();
        let (o2, l2) = attention_fwd(&Causal, &copy, &copy, &copy, &opts).unwrap();
        assert_eq!(o1.to_vec::<f32>(), o2.to_vec::<f32>());
        assert_eq!(l1.to_vec::<f32>(), l2.to_vec::<f32>());

        let ints = Tensor::<WgpuRuntime>::zeros(&[1, 2, 5, 8], DType::I32, &device).unwrap();
        let err = attention_fwd(&Causal, &ints, &ints, &ints, &opts).unwrap_err();
        assert!(matches!(err, Error::DType { .. }), "{err}");
    }
}
