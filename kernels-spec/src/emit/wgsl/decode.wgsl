// Split-KV decode: the merge of the splits' partial rows (templates as in
// `common.wgsl`).
//@@ merge

// ---- split-KV merge: out = Σ_s out_s·w_s · weights_scale(Σ_s w_s), w_s = weights_merge(lse_s, m) ----
@compute @workgroup_size(WG)
fn attn_merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let sq = max(shape.seq_q, 1u);
    let g = gqa_group();
    let b = wid.y / shape.heads_kv;
    let h_kv = wid.y % shape.heads_kv;
    let r = wid.x * WG + lid;
    if r >= g * sq { return; }
    let flat = (b * shape.heads_q + h_kv * g) * sq + r;
    let rows = shape.batch * shape.heads_q * sq;
    let splits = max(shape.splits, 1u);
    var m = -bx_inf();
    var top = -bx_inf();
    for (var s = 0u; s < splits; s++) {
        m = max(m, split_lse[s * rows + flat]);
        top = max(top, stats[s * rows + flat].z);
    }
    var acc: array<f32, DV>;
    @loop(DV) { acc[d] = 0.0f; }
    var l = 0.0f;
    // In split order: the same bits run to run. A split that sees nothing
    // has out 0 (and, a softmax, lse -inf: weight 0).
    for (var s = 0u; s < splits; s++) {
        let w = weights_merge(split_lse[s * rows + flat], m);
        let base = (s * rows + flat) * DV;
        l += w;
        @loop(DV) { acc[d] += w * split_out[base + d]; }
    }
    let inv = weights_scale(l);
    @loop(DV) { out[flat * DV + d] = acc[d] * inv; }
    lse[flat] = weights_lse(m, l);
    // The row's largest score over every split, in split 0's stats.
    stats[flat].z = top;
}
