// ---- new keys (or values) written into a KV cache's rows, in place ----
struct Shape {
    dim: u32,
    elements: u32,
    src_offset: u32,
    dst_offset: u32,
}
@group(0) @binding(0) var<uniform> shape: Shape;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
// (source row, destination row) per pair.
@group(0) @binding(3) var<storage, read> pairs: array<u32>;

@compute @workgroup_size(64)
fn append_kv(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>) {
    let e = gid.x + gid.y * n.x * 64u;
    if e >= shape.elements { return; }
    let p = e / shape.dim;
    let d = e % shape.dim;
    dst[shape.dst_offset + pairs[2u * p + 1u] * shape.dim + d] = src[shape.src_offset + pairs[2u * p] * shape.dim + d];
}
