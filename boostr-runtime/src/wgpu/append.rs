//! wgpu's cache writer: the new rows copied into the cache's rows by
//! `append_kv` (f32, as every wgpu tensor; an fp8 cache is refused by the
//! dtype check, as its reads are).

use super::{FixedPass, TARGET, WGPU, buffer_of, fixed_pass, scoped};
use crate::backend::KvWrite;
use crate::error::{BackendError, Result};
use crate::gpu::KernelCache;
use crate::validate;
use kernels_spec::emit::wgsl::interface::MAX_WORKGROUPS;
use kernels_spec::emit::wgsl::kernels;
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::runtime::wgpu::{WgpuClient, WgpuRuntime};
use std::sync::{Arc, LazyLock};
use wgpu::util::DeviceExt as _;

static APPEND_CACHE: LazyLock<KernelCache<usize, FixedPass>> = LazyLock::new(KernelCache::default);

const KERNEL: &str = "append_kv";

/// The writer's pipeline on `client`'s device.
fn append_pass(client: &WgpuClient) -> Result<Arc<FixedPass>> {
    let storage = |read_only| wgpu::BufferBindingType::Storage { read_only };
    fixed_pass(
        client,
        &APPEND_CACHE,
        ("boostr append_kv", kernels::APPEND_SOURCE, KERNEL),
        &[
            wgpu::BufferBindingType::Uniform,
            storage(true),
            storage(false),
            storage(true),
        ],
    )
}

/// Run `w` on the device: one dispatch for the keys, one for the values.
pub(super) fn write_kv(w: &KvWrite<'_, WgpuRuntime>) -> Result<()> {
    for (name, t) in [
        ("k", w.k),
        ("v", w.v),
        ("k_new", w.k_new),
        ("v_new", w.v_new),
    ] {
        validate::check_dtype(name, t, WGPU, &[DType::F32], "f32")?;
    }
    let client = WgpuRuntime::default_client(w.k.device());
    let pass = append_pass(&client)?;
    let device = client.wgpu_device_arc();
    let pairs: Vec<u8> = w
        .pairs
        .iter()
        .flatten()
        .flat_map(|p| p.to_le_bytes())
        .collect();
    let launch_error = |reason: String| BackendError::Launch {
        target: TARGET,
        kernel: KERNEL,
        reason,
    };
    let u32_of = |n: usize, what: &str| {
        u32::try_from(n).map_err(|_| launch_error(format!("{what} = {n} exceeds u32")))
    };
    let mut jobs = Vec::new();
    for (dst, src) in [(w.k, w.k_new), (w.v, w.v_new)] {
        let dim = *dst.shape().last().expect("a rank-4 cache");
        let elements = w.pairs.len() * dim;
        let words = [
            u32_of(dim, "the head dim")?,
            u32_of(elements, "elements written")?,
            u32_of(src.offset(), "the new rows' offset")?,
            u32_of(dst.offset(), "the cache's offset")?,
        ];
        let (src_buf, dst_buf) = (
            buffer_of(KERNEL, "the new rows", src)?,
            buffer_of(KERNEL, "the cache", dst)?,
        );
        jobs.push((words, src_buf, dst_buf, elements));
    }
    scoped(
        device,
        || {
            let pairs = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("boostr append pairs"),
                contents: &pairs,
                usage: wgpu::BufferUsages::STORAGE,
            });
            let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some(KERNEL),
            });
            for (words, src, dst, elements) in &jobs {
                let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                let shape = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("boostr append shape"),
                    contents: &bytes,
                    usage: wgpu::BufferUsages::UNIFORM,
                });
                let entries = [
                    shape.as_entire_binding(),
                    src.as_entire_binding(),
                    dst.as_entire_binding(),
                    pairs.as_entire_binding(),
                ];
                let entries: Vec<_> = (0u32..)
                    .zip(entries)
                    .map(|(binding, resource)| wgpu::BindGroupEntry { binding, resource })
                    .collect();
                let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some(KERNEL),
                    layout: &pass.layout,
                    entries: &entries,
                });
                let groups = (*elements as u64).div_ceil(u64::from(kernels::APPEND_WORKGROUP));
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
            client
                .wgpu_queue()
                .submit(std::iter::once(encoder.finish()));
        },
        launch_error,
    )?;
    Ok(())
}
