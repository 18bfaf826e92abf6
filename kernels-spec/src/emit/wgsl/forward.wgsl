// The forward: FlashAttention-2's online softmax, one query row per
// invocation (templates as in `common.wgsl`).
//@@ forward

// ---- forward (FlashAttention-2 online softmax, one query row per invocation) ----
// The class of key tile [k0, kv_hi] for packed rows of query heads h_lo ..= h_hi
// at positions q_lo ..= q_hi: the classes agree, or Partial.
fn rows_class(ib: i32, h_lo: u32, h_hi: u32, q_lo: i32, q_hi: i32, k0: i32, kv_hi: i32) -> i32 {
    var cls = variant_classify(ib, i32(h_lo), q_lo, q_hi, k0, kv_hi);
    for (var hh = h_lo + 1u; hh <= h_hi; hh++) {
        if variant_classify(ib, i32(hh), q_lo, q_hi, k0, kv_hi) != cls { cls = TILE_PARTIAL; }
    }
    return cls;
}

@compute @workgroup_size(WG)
fn attn_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let sq = max(shape.seq_q, 1u);
    let g = gqa_group();
    let splits = max(shape.splits, 1u);
    let split = wid.x % splits;
    let b = wid.y / shape.heads_kv;
    let h_kv = wid.y % shape.heads_kv;
    let sk = seq_keys(b);
    let sq_b = seq_queries(b); // rows past them see nothing
    // The workgroup's rows: packed row r is row r % sq of query head
    // h_kv·g + r / sq, so one pass over the kv head's keys serves its group.
    let packed = g * sq;
    let r0 = (wid.x / splits) * WG;
    let r = r0 + lid;
    let live = r < packed;
    let h = h_kv * g + min(r, packed - 1u) / sq;
    let row = min(r, packed - 1u) % sq;
    let own = live && row < sq_b; // a row of its sequence's
    let flat = (b * shape.heads_q + h_kv * g) * sq + r; // q, lse row
    // Where this split writes: split_out/split_lse rows when split, else out/lse.
    let at = split * (shape.batch * shape.heads_q * sq) + flat;
    let offset = i32(sk) - i32(sq_b);
    let ib = i32(b);
    let ih = i32(h);
    let qp = i32(row) + offset;

    var qr: array<f32, D>;
    var acc: array<f32, DV>;
    // The sink is one more logit with no value: the running max and sum of
    // split 0 start from it (-inf and 0 without one).
    var m = -bx_inf();
    if own && split == 0u { m = variant_sink(ib, ih, qp, true); }
    var l = weights_start(m);
    var top = -bx_inf(); // the largest score, the sink apart
    @loop(D, DV) {
        var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x;
    } {
        var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a;
    }
    if live && !is_first() {
        let ml = stats[at];
        m = ml.x;
        l = ml.y;
        top = ml.z;
    }

    // The heads and positions the workgroup's rows span.
    let r_hi = min(r0 + WG, packed) - 1u;
    let h_lo = h_kv * g + r0 / sq;
    let h_hi = h_kv * g + r_hi / sq;
    var q_lo = i32(r0 % sq) + offset;
    var q_hi = i32(r_hi % sq) + offset;
    if h_hi != h_lo {
        q_lo = offset;
        q_hi = i32(sq) - 1i + offset;
    }
    // Of a padded batch's sequence, its own rows: a workgroup of spare rows
    // visits no key tile.
    q_hi = min(q_hi, i32(sq_b) - 1i + offset);
    var n_tiles = (sk + BKV - 1u) / BKV;
    if q_lo > q_hi { n_tiles = 0u; }
    // This split's share of the sequence's key tiles.
    let per = (n_tiles + splits - 1u) / splits;
    let t_lo = split * per;
    let t_hi = min(t_lo + per, n_tiles);
    var s_row: array<f32, BKV>;
    for (var kt = t_lo + shape.tile_begin; kt < min(t_lo + shape.tile_end, t_hi); kt++) {
        let k0 = kt * BKV;
        let kv_hi = i32(min(k0 + BKV, sk)) - 1i;
        let cls = rows_class(ib, h_lo, h_hi, q_lo, q_hi, i32(k0), kv_hi);
        if cls == TILE_EMPTY { continue; } // nothing visible
        workgroupBarrier(); // the previous tile's readers are done
        stage_kv(lid, b, h_kv, k0, sk);
        workgroupBarrier();
        var m_new = m;
        for (var j = 0u; j < BKV; j++) {
            let kp = i32(k0 + j);
            var dot = 0.0f;
            @loop(D) { dot += qr[d] * k_tile[j * D + d]; }
            // FULL tiles skip the mask.
            let seen = own && k0 + j < sk && (cls == TILE_FULL || variant_mask(ib, ih, qp, kp));
            let s = select(-bx_inf(), variant_score(dot * shape.scale, ib, ih, qp, kp, seen), seen);
            s_row[j] = s;
            if s > m_new { m_new = s; }
            if s > top { top = s; }
        }
        // The normalisation's rescale of the running sum and output.
        let alpha = weights_rescale(m, m_new);
        l *= alpha;
        @loop(DV) { acc[d] *= alpha; }
        if cls == TILE_FULL {
            for (var j = 0u; j < BKV; j++) {
                let p = pair_weight(s_row[j], m_new, &l, ib, ih, qp, i32(k0 + j));
                @loop(DV) { acc[d] += p * v_tile[j * DV + d]; }
            }
        } else {
            // A key this row does not see has p = 0 and stays out of its
            // sums even where its V row holds NaN or Inf (0·NaN is NaN).
            for (var j = 0u; j < BKV; j++) {
                let p = pair_weight(s_row[j], m_new, &l, ib, ih, qp, i32(k0 + j));
                @loop(DV) { acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); }
            }
        }
        m = m_new;
    }
    if !live { return; }
    stats[at] = vec4<f32>(m, l, top, 0.0f);
    if !is_last() {
        @loop(DV) { out[at * DV + d] = acc[d]; }
        return;
    }
    // The normalisation's finish (a softmax: out / l and m + log(l); a row
    // with no visible key in this split: out 0, lse -inf).
    let inv = weights_scale(l);
    @loop(DV) { out[at * DV + d] = acc[d] * inv; }
    lse[at] = weights_lse(m, l);
}
