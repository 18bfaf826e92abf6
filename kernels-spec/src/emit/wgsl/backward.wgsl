// The backward: D_i and dQ over query rows, dK/dV over key rows, the
// learnable tensors' gradients (templates as in `common.wgsl`).
//@@ query_rows

// ---- backward: D_i and dQ (one query row per invocation) ----
// The workgroup's query tile: its (batch, head), kv rows and positions.
struct QueryTile {
    ib: i32,
    ih: i32,
    b: u32,
    h_kv: u32,
    q_lo: i32,
    q_hi: i32,
    sk: u32,        // the sequence's keys (a KV cache's length)
    n_tiles: u32,   // key tiles of BKV rows (none for a tile of spare rows)
}

fn query_tile(wid: vec3<u32>) -> QueryTile {
    let b = wid.y / shape.heads_q;
    let sk = seq_keys(b);
    let sq = seq_queries(b);
    let h = wid.y % shape.heads_q;
    let q0 = wid.x * WG;
    let offset = i32(sk) - i32(sq);
    var t: QueryTile;
    t.ib = i32(b);
    t.ih = i32(h);
    t.b = b;
    t.h_kv = h / gqa_group();
    t.q_lo = i32(q0) + offset;
    t.q_hi = i32(min(q0 + WG, sq)) - 1i + offset;
    t.sk = sk;
    t.n_tiles = select(0u, (sk + BKV - 1u) / BKV, q0 < sq);
    return t;
}

// The class of the key tile at k0 for the query tile.
fn key_tile_class(t: QueryTile, k0: u32) -> i32 {
    let kv_hi = i32(min(k0 + BKV, t.sk)) - 1i;
    return variant_classify(t.ib, t.ih, t.q_lo, t.q_hi, i32(k0), kv_hi);
}

// One query row: its q and dO, lse, and where it sits.
struct QueryRow {
    live: bool, // a row of the tensors (its results are written)
    own: bool,  // a row of its sequence's (else it sees nothing)
    row: u32,   // flat index into lse/rows; times D into q/dq, DV into dout
    qp: i32,
    lse: f32,
    sk: u32,    // the sequence's keys
}

fn query_row(wid: vec3<u32>, lid: u32) -> QueryRow {
    let b = wid.y / shape.heads_q;
    let h = wid.y % shape.heads_q;
    let r = wid.x * WG + lid;
    let sq = seq_queries(b);
    var out: QueryRow;
    out.live = r < shape.seq_q;
    out.own = r < sq;
    out.row = (b * shape.heads_q + h) * shape.seq_q + r;
    out.sk = seq_keys(b);
    out.qp = i32(r) + i32(out.sk) - i32(sq);
    out.lse = -bx_inf();
    if out.own { out.lse = lse[out.row]; }
    return out;
}

// (s, P, dP) of the query row against staged key j: P = 0 for masked pairs,
// keys past Sk, and rows with no visible key.
fn pair_terms(qr: ptr<function, array<f32, D>>, dor: ptr<function, array<f32, DV>>,
              r: QueryRow, j: u32, k0: u32, cls: i32, ib: i32, ih: i32) -> vec3<f32> {
    let kp = i32(k0 + j);
    var dot = 0.0f;
    var dp = 0.0f;
    @loop(D, DV) { dot += (*qr)[d] * k_tile[j * D + d]; } { dp += (*dor)[d] * v_tile[j * DV + d]; }
    let s = dot * shape.scale;
    let seen = r.own && !bx_is_neg_inf(r.lse) && k0 + j < r.sk
        && (cls == TILE_FULL || variant_mask(ib, ih, r.qp, kp));
    let p = pair_prob(variant_score(s, ib, ih, r.qp, kp, seen), r.lse, seen);
    // dp of a key the row does not see is never used: it may be NaN. With
    // dropout it carries the pair's factor: d loss / d P.
    let z = variant_dropout(ib, ih, r.qp, kp);
    return vec3<f32>(s, p, select(0.0f, dp * z, p != 0.0f));
}


// Only its sequence's own rows are read (zeros past them).
fn load_row(qr: ptr<function, array<f32, D>>, dor: ptr<function, array<f32, DV>>, r: QueryRow) {
    @loop(D, DV) {
        var x = 0.0f;
        if r.own { x = q[r.row * D + d]; }
        (*qr)[d] = x;
    } {
        var y = 0.0f;
        if r.own { y = dout[r.row * DV + d]; }
        (*dor)[d] = y;
    }
}
//@@ dq

@compute @workgroup_size(WG)
fn attn_bwd_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = query_tile(wid);
    let r = query_row(wid, lid);
    var qr: array<f32, D>;
    var dor: array<f32, DV>;
    load_row(&qr, &dor, r);
    var sums = vec2<f32>(0.0f);
    // z: dlse (the caller's, or 0), held until the last dispatch.
    var dlse = 0.0f;
    if r.live {
        dlse = rows[r.row].z;
        if !is_first() { sums = rows[r.row].xy; }
    }

    for (var kt = shape.tile_begin; kt < min(shape.tile_end, t.n_tiles); kt++) {
        let k0 = kt * BKV;
        let cls = key_tile_class(t, k0);
        if cls == TILE_EMPTY { continue; }
        workgroupBarrier();
        stage_kv(lid, t.b, t.h_kv, k0, t.sk);
        workgroupBarrier();
        for (var j = 0u; j < BKV; j++) {
            let pt = pair_terms(&qr, &dor, r, j, k0, cls, t.ib, t.ih);
            sums += vec2<f32>(pt.y, pt.y * pt.z);
        }
    }
    if !r.live { return; }
    if !is_last() {
        rows[r.row] = vec4<f32>(sums, dlse, 0.0f);
    } else {
        // The sink's probability joins the normalisation (its dP is 0).
        var sink = -bx_inf();
        if r.own { sink = variant_sink(t.ib, t.ih, r.qp, true); }
        let p_sink = select(exp(sink - r.lse), 0.0f, bx_is_neg_inf(sink) || bx_is_neg_inf(r.lse));
        // dlse over the same sum: the row's dS then adds up to dlse times
        // its weights' share (1 less the sink's) in f32 as well, whatever
        // the rounding of the lse the weights were recomputed from.
        var dl = -dlse;
        if sums.x + p_sink > 0.0f { dl = (sums.y - dlse) / (sums.x + p_sink); }
        rows[r.row] = vec4<f32>(sums, r.lse, dl);
    }
}

@compute @workgroup_size(WG)
fn attn_bwd_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = query_tile(wid);
    let r = query_row(wid, lid);
    var qr: array<f32, D>;
    var dor: array<f32, DV>;
    load_row(&qr, &dor, r);
    var acc: array<f32, D>;
    var delta_i = 0.0f;
    if r.live { delta_i = rows[r.row].w; }
    @loop(D) {
        var a = 0.0f;
        if r.live && !is_first() { a = dq[r.row * D + d]; }
        acc[d] = a;
    }

    for (var kt = shape.tile_begin; kt < min(shape.tile_end, t.n_tiles); kt++) {
        let k0 = kt * BKV;
        let cls = key_tile_class(t, k0);
        if cls == TILE_EMPTY { continue; }
        workgroupBarrier();
        stage_kv(lid, t.b, t.h_kv, k0, t.sk);
        workgroupBarrier();
        for (var j = 0u; j < BKV; j++) {
            let pt = pair_terms(&qr, &dor, r, j, k0, cls, t.ib, t.ih);
            let g = variant_score_grad(pt.x, t.ib, t.ih, r.qp, i32(k0 + j), pt.y != 0.0f);
            let ds = select(0.0f, weights_dz(pt.y, pt.z, delta_i) * g, pt.y != 0.0f);
            // A key the row does not see stays out even where its K row is
            // NaN or Inf; only a Partial tile has such keys.
            if cls == TILE_FULL {
                @loop(D) { acc[d] += ds * k_tile[j * D + d]; }
            } else {
                @loop(D) { acc[d] += select(0.0f, ds * k_tile[j * D + d], ds != 0.0f); }
            }
        }
    }
    if !r.live { return; }
    let f = select(1.0f, shape.scale, is_last());
    @loop(D) { dq[r.row * D + d] = acc[d] * f; }
}
//@@ dkdv

// ---- backward: dK and dV (one key row per invocation) ----

// Q and dO rows q0 .. q0 + BQ of one query head, their lse and D_i (lse
// -inf past the sequence's `sq` rows: such rows see nothing), from `rows`
// (.z lse, .w D_i).
var<workgroup> q_tile: array<f32, BQ * D>;
var<workgroup> do_tile: array<f32, BQ * DV>;
var<workgroup> lse_tile: array<f32, BQ>;
var<workgroup> delta_tile: array<f32, BQ>;

fn stage_q(lid: u32, q_base: u32, q0: u32, sq: u32) {
    for (var t = 0u; t < N_Q; t++) {
        let e = lid + t * WG;
        if e < BQ * D {
            let r = q0 + e / D;
            var x = 0.0f;
            if r < sq { x = q[(q_base + r) * D + e % D]; }
            q_tile[e] = x;
        }
    }
    for (var t = 0u; t < N_O; t++) {
        let e = lid + t * WG;
        if e < BQ * DV {
            let r = q0 + e / DV;
            var y = 0.0f;
            if r < sq { y = dout[(q_base + r) * DV + e % DV]; }
            do_tile[e] = y;
        }
    }
    for (var i = lid; i < BQ; i += WG) {
        var l = -bx_inf();
        var dl = 0.0f;
        if q0 + i < sq {
            let rw = rows[q_base + q0 + i];
            l = rw.z;
            dl = rw.w;
        }
        lse_tile[i] = l;
        delta_tile[i] = dl;
    }
}

@compute @workgroup_size(WG)
fn attn_bwd_dkdv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let sq = shape.seq_q;
    let b = wid.y / shape.heads_kv;
    // Keys from the sequence's length on (a KV cache's spare slots) are
    // never read, and get zero gradients.
    let sk = seq_keys(b);
    let sq_b = seq_queries(b); // a padded batch's rows past them: never read
    let h_kv = wid.y % shape.heads_kv;
    let n_group = gqa_group();
    let k0 = wid.x * WG;
    let col = k0 + lid;
    let live = col < sk;
    let kv_base = (b * shape.heads_kv + h_kv) * shape.seq_k;
    let offset = i32(sk) - i32(sq_b);
    let ib = i32(b);
    let kp = i32(col);

    var kr: array<f32, D>;
    var vr: array<f32, DV>;
    var dk_acc: array<f32, D>;
    var dv_acc: array<f32, DV>;
    // The key's row (in place, or in a page); dK and dV go to its
    // sequence's slots (a paged call's are folded into its pages after).
    var row = 0u;
    if live { row = key_row(b, h_kv, col); }
    @loop(D, DV) {
        var x = 0.0f;
        var a = 0.0f;
        if live {
            x = k[row * D + d];
            if !is_first() { a = dk[(kv_base + col) * D + d]; }
        }
        kr[d] = x;
        dk_acc[d] = a;
    } {
        var y = 0.0f;
        var c = 0.0f;
        if live {
            y = v[row * DV + d];
            if !is_first() { c = dv[(kv_base + col) * DV + d]; }
        }
        vr[d] = y;
        dv_acc[d] = c;
    }

    let kv_hi = i32(min(k0 + WG, sk)) - 1i;
    let n_tiles = (sq_b + BQ - 1u) / BQ;
    for (var it = shape.tile_begin; it < min(shape.tile_end, n_group * n_tiles); it++) {
        let h = h_kv * n_group + it / n_tiles;
        let ih = i32(h);
        let q_base = (b * shape.heads_q + h) * sq;
        let q0 = (it % n_tiles) * BQ;
        let q_lo = i32(q0) + offset;
        let q_hi = i32(min(q0 + BQ, sq_b)) - 1i + offset;
        let cls = variant_classify(ib, ih, q_lo, q_hi, i32(k0), kv_hi);
        if cls == TILE_EMPTY { continue; }
        workgroupBarrier();
        stage_q(lid, q_base, q0, sq_b);
        workgroupBarrier();
        for (var i = 0u; i < BQ; i++) {
            let lse_i = lse_tile[i];
            let delta_i = delta_tile[i];
            let qp = i32(q0 + i) + offset;
            var dot = 0.0f;
            var dp = 0.0f;
            @loop(D, DV) { dot += q_tile[i * D + d] * kr[d]; } { dp += do_tile[i * DV + d] * vr[d]; }
            let s = dot * shape.scale;
            let seen = live && !bx_is_neg_inf(lse_i) && (cls == TILE_FULL || variant_mask(ib, ih, qp, kp));
            let p = pair_prob(variant_score(s, ib, ih, qp, kp, seen), lse_i, seen);
            let g = variant_score_grad(s, ib, ih, qp, kp, p != 0.0f);
            let z = variant_dropout(ib, ih, qp, kp);
            let ds = select(0.0f, weights_dz(p, dp * z, delta_i) * g, p != 0.0f);
            let pz = p * z;
            @loop(D, DV) { dk_acc[d] += ds * q_tile[i * D + d]; } { dv_acc[d] += pz * do_tile[i * DV + d]; }
        }
    }
    if col >= shape.seq_k { return; }
    let f = select(1.0f, shape.scale, is_last());
    @loop(D, DV) { dk[(kv_base + col) * D + d] = dk_acc[d] * f; } { dv[(kv_base + col) * DV + d] = dv_acc[d]; }
}
//@@ tensors

// ---- backward: the gradients of learnable tensors (one query row per invocation) ----
@compute @workgroup_size(WG)
fn attn_bwd_tensors(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = query_tile(wid);
    let r = query_row(wid, lid);
    var qr: array<f32, D>;
    var dor: array<f32, DV>;
    load_row(&qr, &dor, r);
    var delta_i = 0.0f;
    if r.live { delta_i = rows[r.row].w; }

    for (var kt = shape.tile_begin; kt < min(shape.tile_end, t.n_tiles); kt++) {
        let k0 = kt * BKV;
        let cls = key_tile_class(t, k0);
        if cls == TILE_EMPTY { continue; }
        workgroupBarrier();
        stage_kv(lid, t.b, t.h_kv, k0, t.sk);
        workgroupBarrier();
        for (var j = 0u; j < BKV; j++) {
            let pt = pair_terms(&qr, &dor, r, j, k0, cls, t.ib, t.ih);
            // d loss / d score = P (dP - D_i), at the pairs the row sees.
            if pt.y != 0.0f {
                bx_learn_score(weights_dz(pt.y, pt.z, delta_i), pt.x, t.ib, t.ih, r.qp, i32(k0 + j));
            }
        }
    }
    // The sink's share, once per row: d loss / d sink = -P_sink D_i.
    if r.own && is_last() {
        let sink = variant_sink(t.ib, t.ih, r.qp, true);
        let p_sink = select(exp(sink - r.lse), 0.0f, bx_is_neg_inf(sink) || bx_is_neg_inf(r.lse));
        bx_learn_sink(-p_sink * delta_i, t.ib, t.ih, r.qp);
    }
}
