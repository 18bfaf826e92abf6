//! The attention kernels: WGSL text templates around the lowered variant
//! functions. Each template uses only the WGSL constants `D`, `BQ`, `BKV` and
//! `WG` that [`header`] writes from a [`WgslTiles`]; sizes derived from them
//! are WGSL `const` expressions inside the templates.
//!
//! Layout (all contiguous, f32): `q`, `attn_out` (the output), `dout`, `dq`: `[B, Hq, Sq, D]`;
//! `k`, `v`, `dk`, `dv`: `[B, Hkv, Sk, D]`; `lse`, `delta`: `[B, Hq, Sq]`.
//! Query row `i` sits at position `i + Sk - Sq` (bottom-right alignment);
//! query head `h` reads key/value head `h / (Hq / Hkv)`.
//!
//! Per-invocation loops are over tiles, or bounded by the tile constants. Mesa
//! llvmpipe (lavapipe) counts every iteration of every loop of an invocation
//! against one limit of 65,535 and then silently leaves the loop. So the
//! loops over tiles run over a range `[tile_begin, tile_end)` from the
//! `shape` uniform, and the runtime may split a kernel into several
//! dispatches over consecutive ranges (bounded by
//! [`WgslTiles::loop_iterations_per_tile`]). Between them the partial state
//! lives in the output buffers and `stats`; `flags` says whether a dispatch
//! is the first (start from zero) and the last (finish: normalise, scale).

use super::WgslTiles;

/// The constants a template is written against.
pub fn header(cfg: &WgslTiles) -> String {
    let mut s = String::from("// ---- tile configuration ----\n");
    for (name, value, why) in [
        ("D", cfg.head_dim, "head dim"),
        ("BQ", cfg.block_q, "query rows per tile"),
        ("BKV", cfg.block_kv, "key rows per tile"),
        ("WG", cfg.workgroup_size, "invocations per workgroup"),
    ] {
        s.push_str(&format!("const {name}: u32 = {value}u; // {why}\n"));
    }
    s
}

/// Shapes and the workgroup-size-derived trip counts, shared by all kernels.
pub const COMMON: &str = r#"
// ---- shapes ----
struct Shape {
    batch: u32,
    heads_q: u32,
    heads_kv: u32,
    seq_q: u32,
    seq_k: u32,
    scale: f32,
    // This dispatch's range of the tile loop, and FIRST | LAST.
    tile_begin: u32,
    tile_end: u32,
    flags: u32,
    pad_0: u32,
    pad_1: u32,
    pad_2: u32,
}
@group(0) @binding(1) var<uniform> shape: Shape;
const FIRST: u32 = 1u;
const LAST: u32 = 2u;

fn is_first() -> bool {
    return (shape.flags & FIRST) != 0u;
}
fn is_last() -> bool {
    return (shape.flags & LAST) != 0u;
}

// Per-invocation trip counts of the strided tile loops.
const N_Q: u32 = (BQ * D + WG - 1u) / WG;
const N_KV: u32 = (BKV * D + WG - 1u) / WG;
const N_PAIRS: u32 = (BQ * BKV + WG - 1u) / WG;

fn gqa_group() -> u32 {
    return max(shape.heads_q / max(shape.heads_kv, 1u), 1u);
}
"#;

/// Forward: one workgroup per (query tile, b·Hq + h); dispatch
/// `(ceil(Sq / BQ), B·Hq, 1)` per range of key tiles. Writes `attn_out` and
/// `lse`; between dispatches `attn_out` holds the unnormalised accumulator
/// and `stats` the running (max, sum) of each row.
pub const FORWARD: &str = r#"
// ---- forward (FlashAttention-2 schedule) ----
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read> k: array<f32>;
@group(0) @binding(4) var<storage, read> v: array<f32>;
@group(0) @binding(5) var<storage, read_write> attn_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> lse: array<f32>;
@group(0) @binding(7) var<storage, read_write> stats: array<vec2<f32>>;

var<workgroup> q_tile: array<f32, BQ * D>;
// K, then V of the same key tile (the scores are done before V is loaded).
var<workgroup> kv_tile: array<f32, BKV * D>;
// Scores (-inf where masked), then probabilities.
var<workgroup> p_tile: array<f32, BQ * BKV>;
var<workgroup> row_m: array<f32, BQ>;
var<workgroup> row_l: array<f32, BQ>;
var<workgroup> row_alpha: array<f32, BQ>;

@compute @workgroup_size(WG)
fn attn_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let sq = shape.seq_q;
    let sk = shape.seq_k;
    let b = wid.y / shape.heads_q;
    let h = wid.y % shape.heads_q;
    let h_kv = h / gqa_group();
    let q0 = wid.x * BQ;
    let q_base = (b * shape.heads_q + h) * sq;
    let kv_base = (b * shape.heads_kv + h_kv) * sk;
    let offset = i32(sk) - i32(sq);
    let ib = i32(b);
    let ih = i32(h);

    for (var t = 0u; t < N_Q; t++) {
        let e = lid + t * WG;
        if e < BQ * D {
            let r = q0 + e / D;
            var x = 0.0f;
            if r < sq { x = q[(q_base + r) * D + e % D]; }
            q_tile[e] = x;
        }
    }
    if lid < BQ {
        var ml = vec2<f32>(-bx_inf(), 0.0f);
        if !is_first() && q0 + lid < sq { ml = stats[q_base + q0 + lid]; }
        row_m[lid] = ml.x;
        row_l[lid] = ml.y;
    }
    var acc: array<f32, N_Q>;
    for (var t = 0u; t < N_Q; t++) {
        let e = lid + t * WG;
        let r = q0 + e / D;
        var a = 0.0f;
        if !is_first() && e < BQ * D && r < sq { a = attn_out[(q_base + r) * D + e % D]; }
        acc[t] = a;
    }

    let q_lo = i32(q0) + offset;
    let q_hi = i32(min(q0 + BQ, sq)) - 1i + offset;
    let n_tiles = (sk + BKV - 1u) / BKV;
    for (var kt = shape.tile_begin; kt < min(shape.tile_end, n_tiles); kt++) {
        let k0 = kt * BKV;
        let kv_hi = i32(min(k0 + BKV, sk)) - 1i;
        let cls = variant_classify(ib, ih, q_lo, q_hi, i32(k0), kv_hi);
        if cls == 0i { continue; } // EMPTY: nothing visible
        workgroupBarrier(); // the previous tile's readers are done
        for (var t = 0u; t < N_KV; t++) {
            let e = lid + t * WG;
            if e < BKV * D {
                let r = k0 + e / D;
                var x = 0.0f;
                if r < sk { x = k[(kv_base + r) * D + e % D]; }
                kv_tile[e] = x;
            }
        }
        workgroupBarrier();
        for (var t = 0u; t < N_PAIRS; t++) {
            let e = lid + t * WG;
            if e < BQ * BKV {
                let i = e / BKV;
                let j = e % BKV;
                var s = -bx_inf();
                if q0 + i < sq && k0 + j < sk {
                    let qp = i32(q0 + i) + offset;
                    let kp = i32(k0 + j);
                    // FULL tiles skip the mask.
                    if cls == 2i || variant_mask(ib, ih, qp, kp) {
                        var qk = 0.0f;
                        for (var d = 0u; d < D; d++) { qk += q_tile[i * D + d] * kv_tile[j * D + d]; }
                        s = variant_score(qk * shape.scale, ib, ih, qp, kp);
                    }
                }
                p_tile[e] = s;
            }
        }
        workgroupBarrier();
        // Online softmax, one invocation per row.
        if lid < BQ {
            let m_old = row_m[lid];
            var m_new = m_old;
            for (var j = 0u; j < BKV; j++) {
                let s = p_tile[lid * BKV + j];
                if s > m_new { m_new = s; }
            }
            var alpha = 1.0f;
            var l = row_l[lid];
            if bx_is_neg_inf(m_new) {
                for (var j = 0u; j < BKV; j++) { p_tile[lid * BKV + j] = 0.0f; }
            } else {
                alpha = exp(m_old - m_new);
                var sum = 0.0f;
                for (var j = 0u; j < BKV; j++) {
                    let p = exp(p_tile[lid * BKV + j] - m_new);
                    p_tile[lid * BKV + j] = p;
                    sum += p;
                }
                l = l * alpha + sum;
            }
            row_m[lid] = m_new;
            row_l[lid] = l;
            row_alpha[lid] = alpha;
        }
        workgroupBarrier();
        for (var t = 0u; t < N_KV; t++) {
            let e = lid + t * WG;
            if e < BKV * D {
                let r = k0 + e / D;
                var x = 0.0f;
                if r < sk { x = v[(kv_base + r) * D + e % D]; }
                kv_tile[e] = x;
            }
        }
        workgroupBarrier();
        for (var t = 0u; t < N_Q; t++) {
            let e = lid + t * WG;
            if e < BQ * D {
                let i = e / D;
                let d = e % D;
                var a = acc[t] * row_alpha[i];
                for (var j = 0u; j < BKV; j++) { a += p_tile[i * BKV + j] * kv_tile[j * D + d]; }
                acc[t] = a;
            }
        }
    }
    workgroupBarrier();
    if !is_last() {
        for (var t = 0u; t < N_Q; t++) {
            let e = lid + t * WG;
            let r = q0 + e / D;
            if e < BQ * D && r < sq { attn_out[(q_base + r) * D + e % D] = acc[t]; }
        }
        if lid < BQ && q0 + lid < sq { stats[q_base + q0 + lid] = vec2<f32>(row_m[lid], row_l[lid]); }
        return;
    }
    // Rows with no visible key: attn_out 0, lse -inf.
    for (var t = 0u; t < N_Q; t++) {
        let e = lid + t * WG;
        if e < BQ * D {
            let i = e / D;
            let r = q0 + i;
            let l = row_l[i];
            var o = 0.0f;
            if l > 0.0f { o = acc[t] / l; }
            if r < sq { attn_out[(q_base + r) * D + e % D] = o; }
        }
    }
    if lid < BQ && q0 + lid < sq {
        let l = row_l[lid];
        var x = -bx_inf();
        if l > 0.0f { x = row_m[lid] + log(l); }
        lse[q_base + q0 + lid] = x;
    }
}
"#;

/// Shared by the backward kernels: the per-pair recomputation of
/// `P = exp(score(s) - lse)`, `dP = dO_i · v_j` and
/// `dS = P ∘ (dP - D_i) ∘ score'(s)`, with `q_tile`/`do_tile` rows `i` and
/// `k_tile`/`v_tile` rows `j`.
pub const BACKWARD_PAIR: &str = r#"
// (s, P, dP) of one pair. Rows/columns past the sequence and masked pairs
// give P = 0; so do rows whose lse is -inf (no visible key).
fn pair_terms(i: u32, j: u32, q0: u32, k0: u32, cls: i32, ib: i32, ih: i32) -> vec3<f32> {
    let sq = shape.seq_q;
    let sk = shape.seq_k;
    let none = vec3<f32>(0.0f, 0.0f, 0.0f);
    if q0 + i >= sq || k0 + j >= sk { return none; }
    let lse_i = row_lse[i];
    if bx_is_neg_inf(lse_i) { return none; }
    let qp = i32(q0 + i) + i32(sk) - i32(sq);
    let kp = i32(k0 + j);
    if cls != 2i && !variant_mask(ib, ih, qp, kp) { return none; }
    var qk = 0.0f;
    var dp = 0.0f;
    for (var d = 0u; d < D; d++) {
        qk += q_tile[i * D + d] * k_tile[j * D + d];
        dp += do_tile[i * D + d] * v_tile[j * D + d];
    }
    let s = qk * shape.scale;
    return vec3<f32>(s, exp(variant_score(s, ib, ih, qp, kp) - lse_i), dp);
}

// (P, dS) of one pair.
fn pair_grad(i: u32, j: u32, q0: u32, k0: u32, cls: i32, ib: i32, ih: i32) -> vec2<f32> {
    let t = pair_terms(i, j, q0, k0, cls, ib, ih);
    if t.y == 0.0f { return vec2<f32>(0.0f, 0.0f); }
    let qp = i32(q0 + i) + i32(shape.seq_k) - i32(shape.seq_q);
    let kp = i32(k0 + j);
    let ds = t.y * (t.z - row_delta[i]) * variant_score_grad(t.x, ib, ih, qp, kp);
    return vec2<f32>(t.y, ds);
}

fn load_rows(lid: u32, q_base: u32, q0: u32) {
    let sq = shape.seq_q;
    for (var t = 0u; t < N_Q; t++) {
        let e = lid + t * WG;
        if e < BQ * D {
            let r = q0 + e / D;
            var x = 0.0f;
            var y = 0.0f;
            if r < sq {
                x = q[(q_base + r) * D + e % D];
                y = dout[(q_base + r) * D + e % D];
            }
            q_tile[e] = x;
            do_tile[e] = y;
        }
    }
    if lid < BQ {
        var l = -bx_inf();
        if q0 + lid < sq { l = lse[q_base + q0 + lid]; }
        row_lse[lid] = l;
    }
}

fn load_delta(lid: u32, q_base: u32, q0: u32) {
    if lid < BQ {
        var dl = 0.0f;
        if q0 + lid < shape.seq_q { dl = delta[q_base + q0 + lid]; }
        row_delta[lid] = dl;
    }
}

fn load_cols(lid: u32, kv_base: u32, k0: u32) {
    let sk = shape.seq_k;
    for (var t = 0u; t < N_KV; t++) {
        let e = lid + t * WG;
        if e < BKV * D {
            let r = k0 + e / D;
            var x = 0.0f;
            var y = 0.0f;
            if r < sk {
                x = k[(kv_base + r) * D + e % D];
                y = v[(kv_base + r) * D + e % D];
            }
            k_tile[e] = x;
            v_tile[e] = y;
        }
    }
}

var<workgroup> q_tile: array<f32, BQ * D>;
var<workgroup> do_tile: array<f32, BQ * D>;
var<workgroup> k_tile: array<f32, BKV * D>;
var<workgroup> v_tile: array<f32, BKV * D>;
var<workgroup> p_tile: array<f32, BQ * BKV>;
var<workgroup> ds_tile: array<f32, BQ * BKV>;
var<workgroup> row_lse: array<f32, BQ>;
var<workgroup> row_delta: array<f32, BQ>;
"#;

/// The dQ module. `attn_bwd_delta` computes `D_i = Σ_j P_ij dP_ij / Σ_j P_ij`
/// from the recomputed `P`, and `attn_bwd_dq` then the dQ rows; both one
/// workgroup per (query tile, b·Hq + h), dispatch `(ceil(Sq / BQ), B·Hq, 1)`
/// per range of key tiles. Between dispatches `stats` holds the two sums of
/// each row, and `dq` the unscaled accumulator.
///
/// `D_i` is `rowsum(dO ∘ O)` in exact arithmetic, but taking it from the
/// same recomputed `P` that forms `dS` makes every row of `dS` sum to zero
/// in f32 as well. `O` comes from another kernel, whose logits a GPU
/// compiler may round differently (FMA contraction); at logits ~1e4 one
/// ulp is 1e-3, and `Σ_j dS_ij ≠ 0` then leaks into dQ along the mean of
/// the keys. The cost is one more pass of the `QKᵀ` and `dO·Vᵀ` products.
pub const BACKWARD_DQ: &str = r#"
// ---- backward: D_i and dQ ----
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read> k: array<f32>;
@group(0) @binding(4) var<storage, read> v: array<f32>;
@group(0) @binding(5) var<storage, read> dout: array<f32>;
@group(0) @binding(6) var<storage, read> lse: array<f32>;
@group(0) @binding(7) var<storage, read_write> delta: array<f32>;
@group(0) @binding(8) var<storage, read_write> dq: array<f32>;
@group(0) @binding(9) var<storage, read_write> stats: array<vec2<f32>>;

var<workgroup> row_p: array<f32, BQ>;

@compute @workgroup_size(WG)
fn attn_bwd_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let sq = shape.seq_q;
    let sk = shape.seq_k;
    let b = wid.y / shape.heads_q;
    let h = wid.y % shape.heads_q;
    let h_kv = h / gqa_group();
    let q0 = wid.x * BQ;
    let q_base = (b * shape.heads_q + h) * sq;
    let kv_base = (b * shape.heads_kv + h_kv) * sk;
    let offset = i32(sk) - i32(sq);
    let ib = i32(b);
    let ih = i32(h);

    load_rows(lid, q_base, q0);
    if lid < BQ {
        var sums = vec2<f32>(0.0f, 0.0f);
        if !is_first() && q0 + lid < sq { sums = stats[q_base + q0 + lid]; }
        row_p[lid] = sums.x;
        row_delta[lid] = sums.y;
    }
    let q_lo = i32(q0) + offset;
    let q_hi = i32(min(q0 + BQ, sq)) - 1i + offset;
    let n_tiles = (sk + BKV - 1u) / BKV;
    for (var kt = shape.tile_begin; kt < min(shape.tile_end, n_tiles); kt++) {
        let k0 = kt * BKV;
        let kv_hi = i32(min(k0 + BKV, sk)) - 1i;
        let cls = variant_classify(ib, ih, q_lo, q_hi, i32(k0), kv_hi);
        if cls == 0i { continue; }
        workgroupBarrier();
        load_cols(lid, kv_base, k0);
        workgroupBarrier();
        for (var t = 0u; t < N_PAIRS; t++) {
            let e = lid + t * WG;
            if e < BQ * BKV {
                let pt = pair_terms(e / BKV, e % BKV, q0, k0, cls, ib, ih);
                p_tile[e] = pt.y;
                ds_tile[e] = pt.y * pt.z;
            }
        }
        workgroupBarrier();
        if lid < BQ {
            var sp = row_p[lid];
            var spd = row_delta[lid];
            for (var j = 0u; j < BKV; j++) {
                sp += p_tile[lid * BKV + j];
                spd += ds_tile[lid * BKV + j];
            }
            row_p[lid] = sp;
            row_delta[lid] = spd;
        }
    }
    if lid < BQ && q0 + lid < sq {
        let sp = row_p[lid];
        if !is_last() {
            stats[q_base + q0 + lid] = vec2<f32>(sp, row_delta[lid]);
        } else {
            var dl = 0.0f;
            if sp > 0.0f { dl = row_delta[lid] / sp; }
            delta[q_base + q0 + lid] = dl;
        }
    }
}

@compute @workgroup_size(WG)
fn attn_bwd_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let sq = shape.seq_q;
    let sk = shape.seq_k;
    let b = wid.y / shape.heads_q;
    let h = wid.y % shape.heads_q;
    let h_kv = h / gqa_group();
    let q0 = wid.x * BQ;
    let q_base = (b * shape.heads_q + h) * sq;
    let kv_base = (b * shape.heads_kv + h_kv) * sk;
    let offset = i32(sk) - i32(sq);
    let ib = i32(b);
    let ih = i32(h);

    load_rows(lid, q_base, q0);
    load_delta(lid, q_base, q0);
    var acc: array<f32, N_Q>;
    for (var t = 0u; t < N_Q; t++) {
        let e = lid + t * WG;
        let r = q0 + e / D;
        var a = 0.0f;
        if !is_first() && e < BQ * D && r < sq { a = dq[(q_base + r) * D + e % D]; }
        acc[t] = a;
    }
    let q_lo = i32(q0) + offset;
    let q_hi = i32(min(q0 + BQ, sq)) - 1i + offset;
    let n_tiles = (sk + BKV - 1u) / BKV;
    for (var kt = shape.tile_begin; kt < min(shape.tile_end, n_tiles); kt++) {
        let k0 = kt * BKV;
        let kv_hi = i32(min(k0 + BKV, sk)) - 1i;
        let cls = variant_classify(ib, ih, q_lo, q_hi, i32(k0), kv_hi);
        if cls == 0i { continue; }
        workgroupBarrier();
        load_cols(lid, kv_base, k0);
        workgroupBarrier();
        for (var t = 0u; t < N_PAIRS; t++) {
            let e = lid + t * WG;
            if e < BQ * BKV { ds_tile[e] = pair_grad(e / BKV, e % BKV, q0, k0, cls, ib, ih).y; }
        }
        workgroupBarrier();
        for (var t = 0u; t < N_Q; t++) {
            let e = lid + t * WG;
            if e < BQ * D {
                let i = e / D;
                let d = e % D;
                var a = acc[t];
                for (var j = 0u; j < BKV; j++) { a += ds_tile[i * BKV + j] * k_tile[j * D + d]; }
                acc[t] = a;
            }
        }
    }
    for (var t = 0u; t < N_Q; t++) {
        let e = lid + t * WG;
        let r = q0 + e / D;
        if e < BQ * D && r < sq { dq[(q_base + r) * D + e % D] = select(acc[t], acc[t] * shape.scale, is_last()); }
    }
}
"#;

/// The dK/dV module: one workgroup per (key tile, b·Hkv + h_kv), summing
/// over every query head of its GQA group (no float atomics in WGSL);
/// dispatch `(ceil(Sk / BKV), B·Hkv, 1)` per range of the (GQA head, query
/// tile) pairs, flattened. Reads `delta` from `attn_bwd_delta`; between
/// dispatches `dk` holds the unscaled accumulator.
pub const BACKWARD_DKDV: &str = r#"
// ---- backward: dK and dV ----
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read> k: array<f32>;
@group(0) @binding(4) var<storage, read> v: array<f32>;
@group(0) @binding(5) var<storage, read> dout: array<f32>;
@group(0) @binding(6) var<storage, read> lse: array<f32>;
@group(0) @binding(7) var<storage, read> delta: array<f32>;
@group(0) @binding(8) var<storage, read_write> dk: array<f32>;
@group(0) @binding(9) var<storage, read_write> dv: array<f32>;

@compute @workgroup_size(WG)
fn attn_bwd_dkdv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let sq = shape.seq_q;
    let sk = shape.seq_k;
    let b = wid.y / shape.heads_kv;
    let h_kv = wid.y % shape.heads_kv;
    let n_group = gqa_group();
    let k0 = wid.x * BKV;
    let kv_base = (b * shape.heads_kv + h_kv) * sk;
    let offset = i32(sk) - i32(sq);
    let ib = i32(b);

    load_cols(lid, kv_base, k0);
    var dk_acc: array<f32, N_KV>;
    var dv_acc: array<f32, N_KV>;
    for (var t = 0u; t < N_KV; t++) {
        let e = lid + t * WG;
        let r = k0 + e / D;
        var a = 0.0f;
        var c = 0.0f;
        if !is_first() && e < BKV * D && r < sk {
            a = dk[(kv_base + r) * D + e % D];
            c = dv[(kv_base + r) * D + e % D];
        }
        dk_acc[t] = a;
        dv_acc[t] = c;
    }
    let kv_hi = i32(min(k0 + BKV, sk)) - 1i;
    let n_tiles = (sq + BQ - 1u) / BQ;
    for (var it = shape.tile_begin; it < min(shape.tile_end, n_group * n_tiles); it++) {
        let h = h_kv * n_group + it / n_tiles;
        let ih = i32(h);
        let q_base = (b * shape.heads_q + h) * sq;
        {
            let q0 = (it % n_tiles) * BQ;
            let q_lo = i32(q0) + offset;
            let q_hi = i32(min(q0 + BQ, sq)) - 1i + offset;
            let cls = variant_classify(ib, ih, q_lo, q_hi, i32(k0), kv_hi);
            if cls == 0i { continue; }
            workgroupBarrier();
            load_rows(lid, q_base, q0);
            load_delta(lid, q_base, q0);
            workgroupBarrier();
            for (var t = 0u; t < N_PAIRS; t++) {
                let e = lid + t * WG;
                if e < BQ * BKV {
                    let pd = pair_grad(e / BKV, e % BKV, q0, k0, cls, ib, ih);
                    p_tile[e] = pd.x;
                    ds_tile[e] = pd.y;
                }
            }
            workgroupBarrier();
            for (var t = 0u; t < N_KV; t++) {
                let e = lid + t * WG;
                if e < BKV * D {
                    let j = e / D;
                    let d = e % D;
                    var a = dk_acc[t];
                    var c = dv_acc[t];
                    for (var i = 0u; i < BQ; i++) {
                        a += ds_tile[i * BKV + j] * q_tile[i * D + d];
                        c += p_tile[i * BKV + j] * do_tile[i * D + d];
                    }
                    dk_acc[t] = a;
                    dv_acc[t] = c;
                }
            }
        }
    }
    for (var t = 0u; t < N_KV; t++) {
        let e = lid + t * WG;
        let r = k0 + e / D;
        if e < BKV * D && r < sk {
            dk[(kv_base + r) * D + e % D] = select(dk_acc[t], dk_acc[t] * shape.scale, is_last());
            dv[(kv_base + r) * D + e % D] = dv_acc[t];
        }
    }
}
"#;
