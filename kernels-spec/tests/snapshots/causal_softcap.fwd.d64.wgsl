// ---- tile configuration ----
const D: u32 = 64u; // head dim
const BQ: u32 = 16u; // query rows per tile
const BKV: u32 = 8u; // key rows per tile
const WG: u32 = 64u; // invocations per workgroup

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

// ---- IR semantics helpers ----
fn bx_inf() -> f32 {
    var bits: u32 = 0x7f800000u; // a var: never constant-folded
    return bitcast<f32>(bits);
}
fn bx_nan() -> f32 {
    var bits: u32 = 0x7fc00000u;
    return bitcast<f32>(bits);
}
fn bx_is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}
fn bx_is_neg_inf(x: f32) -> bool {
    return bitcast<u32>(x) == 0xff800000u;
}
fn bx_div_i32(a: i32, b: i32) -> i32 {
    if b == 0i { return 0i; }
    if b == -1i { return bitcast<i32>(0u - bitcast<u32>(a)); } // i32::MIN / -1 wraps
    return a / b;
}
fn bx_rem_i32(a: i32, b: i32) -> i32 {
    if b == 0i || b == -1i { return 0i; }
    return a % b;
}
fn bx_div_u32(a: u32, b: u32) -> u32 {
    if b == 0u { return 0u; }
    return a / b;
}
fn bx_rem_u32(a: u32, b: u32) -> u32 {
    if b == 0u { return 0u; }
    return a % b;
}
fn bx_f32_to_i32(x: f32) -> i32 {
    if bx_is_nan(x) { return 0i; }
    if x >= 2147483648.0f { return 2147483647i; }
    if x < -2147483648.0f { return -2147483647i - 1i; }
    return i32(x);
}
fn bx_f32_to_u32(x: f32) -> u32 {
    if bx_is_nan(x) || x < 1.0f { return 0u; }
    if x >= 4294967296.0f { return 4294967295u; }
    return u32(x);
}
fn bx_min_f32(a: f32, b: f32) -> f32 {
    if bx_is_nan(a) { return b; }
    if bx_is_nan(b) { return a; }
    return min(a, b);
}
fn bx_max_f32(a: f32, b: f32) -> f32 {
    if bx_is_nan(a) { return b; }
    if bx_is_nan(b) { return a; }
    return max(a, b);
}
fn bx_tanh(x: f32) -> f32 {
    // Not the builtin: implementations may form it as (e^2x - 1)/(e^2x + 1),
    // which loses all relative precision near 0 and overflows to NaN for
    // large |x|. Below |x| = 0.625 an odd polynomial (Cephes tanhf), above
    // (1 - t)/(1 + t) with t = e^(-2|x|) <= 0.29 (exactly 1 once t underflows).
    if bx_is_nan(x) { return x; }
    let a = abs(x);
    let z = x * x;
    var p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    if a < 0.625f { return x + x * z * p; }
    let t = exp(-2.0f * a);
    return sign(x) * ((1.0f - t) / (1.0f + t));
}
fn bx_sat_add(a: i32, b: i32) -> i32 {
    let r = bitcast<i32>(bitcast<u32>(a) + bitcast<u32>(b));
    if (a >= 0i) == (b >= 0i) && (r >= 0i) != (a >= 0i) {
        return select(-2147483647i - 1i, 2147483647i, a >= 0i);
    }
    return r;
}
fn bx_sat_sub(a: i32, b: i32) -> i32 {
    let r = bitcast<i32>(bitcast<u32>(a) - bitcast<u32>(b));
    if (a >= 0i) != (b >= 0i) && (r >= 0i) != (a >= 0i) {
        return select(-2147483647i - 1i, 2147483647i, a >= 0i);
    }
    return r;
}
fn bx_sat_mul(a: i32, b: i32) -> i32 {
    if a == 0i || b == 0i { return 0i; }
    let neg = (a < 0i) != (b < 0i);
    // Magnitudes in u32 (|i32::MIN| = 2^31 fits); overflow iff |a|·|b| > limit.
    let ua = select(bitcast<u32>(a), 0u - bitcast<u32>(a), a < 0i);
    let ub = select(bitcast<u32>(b), 0u - bitcast<u32>(b), b < 0i);
    let limit = select(2147483647u, 2147483648u, neg);
    if ua > limit / ub {
        return select(2147483647i, -2147483647i - 1i, neg);
    }
    let p = ua * ub;
    return bitcast<i32>(select(p, 0u - p, neg));
}

// ---- variant CausalSoftcap ----
struct Params {
    p_cap: f32,
    pad_0: u32,
    pad_1: u32,
    pad_2: u32,
}
@group(0) @binding(0) var<uniform> params: Params;

fn variant_score(s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 {
    return (params.p_cap * bx_tanh((s / params.p_cap)));
}

fn variant_score_grad(s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 {
    let l0: f32 = bx_tanh((s / params.p_cap));
    return (params.p_cap * ((1.0f - (l0 * l0)) * (1.0f / params.p_cap)));
}

fn variant_mask(b: i32, h: i32, q: i32, kv: i32) -> bool {
    return (kv <= q);
}

fn variant_classify(b: i32, h: i32, q_lo: i32, q_hi: i32, kv_lo: i32, kv_hi: i32) -> i32 {
    return select(select(1i, 2i, (q_lo >= kv_hi)), 0i, (kv_lo > q_hi));
}


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
