// ---- the summaries of captured tensors (see kernels_spec::params) ----
struct Job {
    source: u32,
    dest: u32,
    outer: u32,
    len: u32,
    inner: u32,
    blocks: u32,
    entries: u32,
    pad: u32,
}
@group(0) @binding(0) var<uniform> job: Job;
@group(0) @binding(1) var<storage, read_write> arena: array<u32>;

const BLOCK: u32 = 16u; // kernels_spec::params::SUMMARY_BLOCK

@compute @workgroup_size(64)
fn summarize(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>) {
    let e = gid.x + gid.y * n.x * 64u;
    if e >= job.entries { return; }
    let i = e % job.inner;
    let blk = (e / job.inner) % job.blocks;
    let o = e / (job.inner * job.blocks);
    let first = blk * BLOCK;
    let last = min(first + BLOCK, job.len);
    var lo = 2147483647i;
    var hi = -2147483647i - 1i;
    for (var x = first; x < last; x++) {
        let v = bitcast<i32>(arena[job.source + (o * job.len + x) * job.inner + i]);
        lo = min(lo, v);
        hi = max(hi, v);
    }
    arena[job.dest + e] = bitcast<u32>(lo);
    arena[job.dest + job.entries + e] = bitcast<u32>(hi);
}
