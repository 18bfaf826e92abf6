// ---- tile configuration ----
const D: u32 = 64u; // head dim
const BQ: u32 = 31u; // query rows staged per tile (dK/dV)
const BKV: u32 = 32u; // key rows staged per tile (forward, D_i, dQ)
const WG: u32 = 64u; // invocations (rows) per workgroup

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

// Elements each invocation copies when the workgroup stages `rows` rows.
const N_KV: u32 = (BKV * D + WG - 1u) / WG;
const N_Q: u32 = (BQ * D + WG - 1u) / WG;

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


// ---- forward (FlashAttention-2 online softmax, one query row per invocation) ----
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read> k: array<f32>;
@group(0) @binding(4) var<storage, read> v: array<f32>;
@group(0) @binding(5) var<storage, read_write> attn_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> lse: array<f32>;
@group(0) @binding(7) var<storage, read_write> stats: array<vec2<f32>>;
@compute @workgroup_size(WG)
fn attn_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let sq = shape.seq_q;
    let sk = shape.seq_k;
    let b = wid.y / shape.heads_q;
    let h = wid.y % shape.heads_q;
    let h_kv = h / gqa_group();
    let q0 = wid.x * WG;
    let row = q0 + lid;
    let live = row < sq;
    let q_base = (b * shape.heads_q + h) * sq;
    let kv_base = (b * shape.heads_kv + h_kv) * sk;
    let offset = i32(sk) - i32(sq);
    let ib = i32(b);
    let ih = i32(h);
    let qp = i32(row) + offset;

    var qr: array<f32, D>;
    var acc: array<f32, D>;
    var m = -bx_inf();
    var l = 0.0f;
    { { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 0u];
            if !is_first() { a = attn_out[(q_base + row) * D + 0u]; }
        }
        qr[0u] = x;
        acc[0u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 1u];
            if !is_first() { a = attn_out[(q_base + row) * D + 1u]; }
        }
        qr[1u] = x;
        acc[1u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 2u];
            if !is_first() { a = attn_out[(q_base + row) * D + 2u]; }
        }
        qr[2u] = x;
        acc[2u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 3u];
            if !is_first() { a = attn_out[(q_base + row) * D + 3u]; }
        }
        qr[3u] = x;
        acc[3u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 4u];
            if !is_first() { a = attn_out[(q_base + row) * D + 4u]; }
        }
        qr[4u] = x;
        acc[4u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 5u];
            if !is_first() { a = attn_out[(q_base + row) * D + 5u]; }
        }
        qr[5u] = x;
        acc[5u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 6u];
            if !is_first() { a = attn_out[(q_base + row) * D + 6u]; }
        }
        qr[6u] = x;
        acc[6u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 7u];
            if !is_first() { a = attn_out[(q_base + row) * D + 7u]; }
        }
        qr[7u] = x;
        acc[7u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 8u];
            if !is_first() { a = attn_out[(q_base + row) * D + 8u]; }
        }
        qr[8u] = x;
        acc[8u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 9u];
            if !is_first() { a = attn_out[(q_base + row) * D + 9u]; }
        }
        qr[9u] = x;
        acc[9u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 10u];
            if !is_first() { a = attn_out[(q_base + row) * D + 10u]; }
        }
        qr[10u] = x;
        acc[10u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 11u];
            if !is_first() { a = attn_out[(q_base + row) * D + 11u]; }
        }
        qr[11u] = x;
        acc[11u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 12u];
            if !is_first() { a = attn_out[(q_base + row) * D + 12u]; }
        }
        qr[12u] = x;
        acc[12u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 13u];
            if !is_first() { a = attn_out[(q_base + row) * D + 13u]; }
        }
        qr[13u] = x;
        acc[13u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 14u];
            if !is_first() { a = attn_out[(q_base + row) * D + 14u]; }
        }
        qr[14u] = x;
        acc[14u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 15u];
            if !is_first() { a = attn_out[(q_base + row) * D + 15u]; }
        }
        qr[15u] = x;
        acc[15u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 16u];
            if !is_first() { a = attn_out[(q_base + row) * D + 16u]; }
        }
        qr[16u] = x;
        acc[16u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 17u];
            if !is_first() { a = attn_out[(q_base + row) * D + 17u]; }
        }
        qr[17u] = x;
        acc[17u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 18u];
            if !is_first() { a = attn_out[(q_base + row) * D + 18u]; }
        }
        qr[18u] = x;
        acc[18u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 19u];
            if !is_first() { a = attn_out[(q_base + row) * D + 19u]; }
        }
        qr[19u] = x;
        acc[19u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 20u];
            if !is_first() { a = attn_out[(q_base + row) * D + 20u]; }
        }
        qr[20u] = x;
        acc[20u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 21u];
            if !is_first() { a = attn_out[(q_base + row) * D + 21u]; }
        }
        qr[21u] = x;
        acc[21u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 22u];
            if !is_first() { a = attn_out[(q_base + row) * D + 22u]; }
        }
        qr[22u] = x;
        acc[22u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 23u];
            if !is_first() { a = attn_out[(q_base + row) * D + 23u]; }
        }
        qr[23u] = x;
        acc[23u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 24u];
            if !is_first() { a = attn_out[(q_base + row) * D + 24u]; }
        }
        qr[24u] = x;
        acc[24u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 25u];
            if !is_first() { a = attn_out[(q_base + row) * D + 25u]; }
        }
        qr[25u] = x;
        acc[25u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 26u];
            if !is_first() { a = attn_out[(q_base + row) * D + 26u]; }
        }
        qr[26u] = x;
        acc[26u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 27u];
            if !is_first() { a = attn_out[(q_base + row) * D + 27u]; }
        }
        qr[27u] = x;
        acc[27u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 28u];
            if !is_first() { a = attn_out[(q_base + row) * D + 28u]; }
        }
        qr[28u] = x;
        acc[28u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 29u];
            if !is_first() { a = attn_out[(q_base + row) * D + 29u]; }
        }
        qr[29u] = x;
        acc[29u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 30u];
            if !is_first() { a = attn_out[(q_base + row) * D + 30u]; }
        }
        qr[30u] = x;
        acc[30u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 31u];
            if !is_first() { a = attn_out[(q_base + row) * D + 31u]; }
        }
        qr[31u] = x;
        acc[31u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 32u];
            if !is_first() { a = attn_out[(q_base + row) * D + 32u]; }
        }
        qr[32u] = x;
        acc[32u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 33u];
            if !is_first() { a = attn_out[(q_base + row) * D + 33u]; }
        }
        qr[33u] = x;
        acc[33u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 34u];
            if !is_first() { a = attn_out[(q_base + row) * D + 34u]; }
        }
        qr[34u] = x;
        acc[34u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 35u];
            if !is_first() { a = attn_out[(q_base + row) * D + 35u]; }
        }
        qr[35u] = x;
        acc[35u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 36u];
            if !is_first() { a = attn_out[(q_base + row) * D + 36u]; }
        }
        qr[36u] = x;
        acc[36u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 37u];
            if !is_first() { a = attn_out[(q_base + row) * D + 37u]; }
        }
        qr[37u] = x;
        acc[37u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 38u];
            if !is_first() { a = attn_out[(q_base + row) * D + 38u]; }
        }
        qr[38u] = x;
        acc[38u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 39u];
            if !is_first() { a = attn_out[(q_base + row) * D + 39u]; }
        }
        qr[39u] = x;
        acc[39u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 40u];
            if !is_first() { a = attn_out[(q_base + row) * D + 40u]; }
        }
        qr[40u] = x;
        acc[40u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 41u];
            if !is_first() { a = attn_out[(q_base + row) * D + 41u]; }
        }
        qr[41u] = x;
        acc[41u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 42u];
            if !is_first() { a = attn_out[(q_base + row) * D + 42u]; }
        }
        qr[42u] = x;
        acc[42u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 43u];
            if !is_first() { a = attn_out[(q_base + row) * D + 43u]; }
        }
        qr[43u] = x;
        acc[43u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 44u];
            if !is_first() { a = attn_out[(q_base + row) * D + 44u]; }
        }
        qr[44u] = x;
        acc[44u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 45u];
            if !is_first() { a = attn_out[(q_base + row) * D + 45u]; }
        }
        qr[45u] = x;
        acc[45u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 46u];
            if !is_first() { a = attn_out[(q_base + row) * D + 46u]; }
        }
        qr[46u] = x;
        acc[46u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 47u];
            if !is_first() { a = attn_out[(q_base + row) * D + 47u]; }
        }
        qr[47u] = x;
        acc[47u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 48u];
            if !is_first() { a = attn_out[(q_base + row) * D + 48u]; }
        }
        qr[48u] = x;
        acc[48u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 49u];
            if !is_first() { a = attn_out[(q_base + row) * D + 49u]; }
        }
        qr[49u] = x;
        acc[49u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 50u];
            if !is_first() { a = attn_out[(q_base + row) * D + 50u]; }
        }
        qr[50u] = x;
        acc[50u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 51u];
            if !is_first() { a = attn_out[(q_base + row) * D + 51u]; }
        }
        qr[51u] = x;
        acc[51u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 52u];
            if !is_first() { a = attn_out[(q_base + row) * D + 52u]; }
        }
        qr[52u] = x;
        acc[52u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 53u];
            if !is_first() { a = attn_out[(q_base + row) * D + 53u]; }
        }
        qr[53u] = x;
        acc[53u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 54u];
            if !is_first() { a = attn_out[(q_base + row) * D + 54u]; }
        }
        qr[54u] = x;
        acc[54u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 55u];
            if !is_first() { a = attn_out[(q_base + row) * D + 55u]; }
        }
        qr[55u] = x;
        acc[55u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 56u];
            if !is_first() { a = attn_out[(q_base + row) * D + 56u]; }
        }
        qr[56u] = x;
        acc[56u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 57u];
            if !is_first() { a = attn_out[(q_base + row) * D + 57u]; }
        }
        qr[57u] = x;
        acc[57u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 58u];
            if !is_first() { a = attn_out[(q_base + row) * D + 58u]; }
        }
        qr[58u] = x;
        acc[58u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 59u];
            if !is_first() { a = attn_out[(q_base + row) * D + 59u]; }
        }
        qr[59u] = x;
        acc[59u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 60u];
            if !is_first() { a = attn_out[(q_base + row) * D + 60u]; }
        }
        qr[60u] = x;
        acc[60u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 61u];
            if !is_first() { a = attn_out[(q_base + row) * D + 61u]; }
        }
        qr[61u] = x;
        acc[61u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 62u];
            if !is_first() { a = attn_out[(q_base + row) * D + 62u]; }
        }
        qr[62u] = x;
        acc[62u] = a; } { var x = 0.0f;
        var a = 0.0f;
        if live {
            x = q[(q_base + row) * D + 63u];
            if !is_first() { a = attn_out[(q_base + row) * D + 63u]; }
        }
        qr[63u] = x;
        acc[63u] = a; } }
    if live && !is_first() {
        let ml = stats[q_base + row];
        m = ml.x;
        l = ml.y;
    }

    let q_lo = i32(q0) + offset;
    let q_hi = i32(min(q0 + WG, sq)) - 1i + offset;
    let n_tiles = (sk + BKV - 1u) / BKV;
    var s_row: array<f32, BKV>;
    for (var kt = shape.tile_begin; kt < min(shape.tile_end, n_tiles); kt++) {
        let k0 = kt * BKV;
        let kv_hi = i32(min(k0 + BKV, sk)) - 1i;
        let cls = variant_classify(ib, ih, q_lo, q_hi, i32(k0), kv_hi);
        if cls == 0i { continue; } // EMPTY: nothing visible
        workgroupBarrier(); // the previous tile's readers are done
        stage_kv(lid, kv_base, k0);
        workgroupBarrier();
        var m_new = m;
        for (var j = 0u; j < BKV; j++) {
            let kp = i32(k0 + j);
            var dot = 0.0f;
            { { dot += qr[0u] * k_tile[j * D + 0u]; } { dot += qr[1u] * k_tile[j * D + 1u]; } { dot += qr[2u] * k_tile[j * D + 2u]; } { dot += qr[3u] * k_tile[j * D + 3u]; } { dot += qr[4u] * k_tile[j * D + 4u]; } { dot += qr[5u] * k_tile[j * D + 5u]; } { dot += qr[6u] * k_tile[j * D + 6u]; } { dot += qr[7u] * k_tile[j * D + 7u]; } { dot += qr[8u] * k_tile[j * D + 8u]; } { dot += qr[9u] * k_tile[j * D + 9u]; } { dot += qr[10u] * k_tile[j * D + 10u]; } { dot += qr[11u] * k_tile[j * D + 11u]; } { dot += qr[12u] * k_tile[j * D + 12u]; } { dot += qr[13u] * k_tile[j * D + 13u]; } { dot += qr[14u] * k_tile[j * D + 14u]; } { dot += qr[15u] * k_tile[j * D + 15u]; } { dot += qr[16u] * k_tile[j * D + 16u]; } { dot += qr[17u] * k_tile[j * D + 17u]; } { dot += qr[18u] * k_tile[j * D + 18u]; } { dot += qr[19u] * k_tile[j * D + 19u]; } { dot += qr[20u] * k_tile[j * D + 20u]; } { dot += qr[21u] * k_tile[j * D + 21u]; } { dot += qr[22u] * k_tile[j * D + 22u]; } { dot += qr[23u] * k_tile[j * D + 23u]; } { dot += qr[24u] * k_tile[j * D + 24u]; } { dot += qr[25u] * k_tile[j * D + 25u]; } { dot += qr[26u] * k_tile[j * D + 26u]; } { dot += qr[27u] * k_tile[j * D + 27u]; } { dot += qr[28u] * k_tile[j * D + 28u]; } { dot += qr[29u] * k_tile[j * D + 29u]; } { dot += qr[30u] * k_tile[j * D + 30u]; } { dot += qr[31u] * k_tile[j * D + 31u]; } { dot += qr[32u] * k_tile[j * D + 32u]; } { dot += qr[33u] * k_tile[j * D + 33u]; } { dot += qr[34u] * k_tile[j * D + 34u]; } { dot += qr[35u] * k_tile[j * D + 35u]; } { dot += qr[36u] * k_tile[j * D + 36u]; } { dot += qr[37u] * k_tile[j * D + 37u]; } { dot += qr[38u] * k_tile[j * D + 38u]; } { dot += qr[39u] * k_tile[j * D + 39u]; } { dot += qr[40u] * k_tile[j * D + 40u]; } { dot += qr[41u] * k_tile[j * D + 41u]; } { dot += qr[42u] * k_tile[j * D + 42u]; } { dot += qr[43u] * k_tile[j * D + 43u]; } { dot += qr[44u] * k_tile[j * D + 44u]; } { dot += qr[45u] * k_tile[j * D + 45u]; } { dot += qr[46u] * k_tile[j * D + 46u]; } { dot += qr[47u] * k_tile[j * D + 47u]; } { dot += qr[48u] * k_tile[j * D + 48u]; } { dot += qr[49u] * k_tile[j * D + 49u]; } { dot += qr[50u] * k_tile[j * D + 50u]; } { dot += qr[51u] * k_tile[j * D + 51u]; } { dot += qr[52u] * k_tile[j * D + 52u]; } { dot += qr[53u] * k_tile[j * D + 53u]; } { dot += qr[54u] * k_tile[j * D + 54u]; } { dot += qr[55u] * k_tile[j * D + 55u]; } { dot += qr[56u] * k_tile[j * D + 56u]; } { dot += qr[57u] * k_tile[j * D + 57u]; } { dot += qr[58u] * k_tile[j * D + 58u]; } { dot += qr[59u] * k_tile[j * D + 59u]; } { dot += qr[60u] * k_tile[j * D + 60u]; } { dot += qr[61u] * k_tile[j * D + 61u]; } { dot += qr[62u] * k_tile[j * D + 62u]; } { dot += qr[63u] * k_tile[j * D + 63u]; } }
            // FULL tiles skip the mask.
            let seen = live && k0 + j < sk && (cls == 2i || variant_mask(ib, ih, qp, kp));
            let s = select(-bx_inf(), variant_score(dot * shape.scale, ib, ih, qp, kp), seen);
            s_row[j] = s;
            if s > m_new { m_new = s; }
        }
        // Nothing visible yet: m_new = -inf, and every p and alpha below is 0.
        let m_ref = select(m_new, 0.0f, bx_is_neg_inf(m_new));
        let alpha = exp(m - m_ref);
        l *= alpha;
        { { acc[0u] *= alpha; } { acc[1u] *= alpha; } { acc[2u] *= alpha; } { acc[3u] *= alpha; } { acc[4u] *= alpha; } { acc[5u] *= alpha; } { acc[6u] *= alpha; } { acc[7u] *= alpha; } { acc[8u] *= alpha; } { acc[9u] *= alpha; } { acc[10u] *= alpha; } { acc[11u] *= alpha; } { acc[12u] *= alpha; } { acc[13u] *= alpha; } { acc[14u] *= alpha; } { acc[15u] *= alpha; } { acc[16u] *= alpha; } { acc[17u] *= alpha; } { acc[18u] *= alpha; } { acc[19u] *= alpha; } { acc[20u] *= alpha; } { acc[21u] *= alpha; } { acc[22u] *= alpha; } { acc[23u] *= alpha; } { acc[24u] *= alpha; } { acc[25u] *= alpha; } { acc[26u] *= alpha; } { acc[27u] *= alpha; } { acc[28u] *= alpha; } { acc[29u] *= alpha; } { acc[30u] *= alpha; } { acc[31u] *= alpha; } { acc[32u] *= alpha; } { acc[33u] *= alpha; } { acc[34u] *= alpha; } { acc[35u] *= alpha; } { acc[36u] *= alpha; } { acc[37u] *= alpha; } { acc[38u] *= alpha; } { acc[39u] *= alpha; } { acc[40u] *= alpha; } { acc[41u] *= alpha; } { acc[42u] *= alpha; } { acc[43u] *= alpha; } { acc[44u] *= alpha; } { acc[45u] *= alpha; } { acc[46u] *= alpha; } { acc[47u] *= alpha; } { acc[48u] *= alpha; } { acc[49u] *= alpha; } { acc[50u] *= alpha; } { acc[51u] *= alpha; } { acc[52u] *= alpha; } { acc[53u] *= alpha; } { acc[54u] *= alpha; } { acc[55u] *= alpha; } { acc[56u] *= alpha; } { acc[57u] *= alpha; } { acc[58u] *= alpha; } { acc[59u] *= alpha; } { acc[60u] *= alpha; } { acc[61u] *= alpha; } { acc[62u] *= alpha; } { acc[63u] *= alpha; } }
        for (var j = 0u; j < BKV; j++) {
            let p = exp(s_row[j] - m_ref);
            l += p;
            { { acc[0u] += p * v_tile[j * D + 0u]; } { acc[1u] += p * v_tile[j * D + 1u]; } { acc[2u] += p * v_tile[j * D + 2u]; } { acc[3u] += p * v_tile[j * D + 3u]; } { acc[4u] += p * v_tile[j * D + 4u]; } { acc[5u] += p * v_tile[j * D + 5u]; } { acc[6u] += p * v_tile[j * D + 6u]; } { acc[7u] += p * v_tile[j * D + 7u]; } { acc[8u] += p * v_tile[j * D + 8u]; } { acc[9u] += p * v_tile[j * D + 9u]; } { acc[10u] += p * v_tile[j * D + 10u]; } { acc[11u] += p * v_tile[j * D + 11u]; } { acc[12u] += p * v_tile[j * D + 12u]; } { acc[13u] += p * v_tile[j * D + 13u]; } { acc[14u] += p * v_tile[j * D + 14u]; } { acc[15u] += p * v_tile[j * D + 15u]; } { acc[16u] += p * v_tile[j * D + 16u]; } { acc[17u] += p * v_tile[j * D + 17u]; } { acc[18u] += p * v_tile[j * D + 18u]; } { acc[19u] += p * v_tile[j * D + 19u]; } { acc[20u] += p * v_tile[j * D + 20u]; } { acc[21u] += p * v_tile[j * D + 21u]; } { acc[22u] += p * v_tile[j * D + 22u]; } { acc[23u] += p * v_tile[j * D + 23u]; } { acc[24u] += p * v_tile[j * D + 24u]; } { acc[25u] += p * v_tile[j * D + 25u]; } { acc[26u] += p * v_tile[j * D + 26u]; } { acc[27u] += p * v_tile[j * D + 27u]; } { acc[28u] += p * v_tile[j * D + 28u]; } { acc[29u] += p * v_tile[j * D + 29u]; } { acc[30u] += p * v_tile[j * D + 30u]; } { acc[31u] += p * v_tile[j * D + 31u]; } { acc[32u] += p * v_tile[j * D + 32u]; } { acc[33u] += p * v_tile[j * D + 33u]; } { acc[34u] += p * v_tile[j * D + 34u]; } { acc[35u] += p * v_tile[j * D + 35u]; } { acc[36u] += p * v_tile[j * D + 36u]; } { acc[37u] += p * v_tile[j * D + 37u]; } { acc[38u] += p * v_tile[j * D + 38u]; } { acc[39u] += p * v_tile[j * D + 39u]; } { acc[40u] += p * v_tile[j * D + 40u]; } { acc[41u] += p * v_tile[j * D + 41u]; } { acc[42u] += p * v_tile[j * D + 42u]; } { acc[43u] += p * v_tile[j * D + 43u]; } { acc[44u] += p * v_tile[j * D + 44u]; } { acc[45u] += p * v_tile[j * D + 45u]; } { acc[46u] += p * v_tile[j * D + 46u]; } { acc[47u] += p * v_tile[j * D + 47u]; } { acc[48u] += p * v_tile[j * D + 48u]; } { acc[49u] += p * v_tile[j * D + 49u]; } { acc[50u] += p * v_tile[j * D + 50u]; } { acc[51u] += p * v_tile[j * D + 51u]; } { acc[52u] += p * v_tile[j * D + 52u]; } { acc[53u] += p * v_tile[j * D + 53u]; } { acc[54u] += p * v_tile[j * D + 54u]; } { acc[55u] += p * v_tile[j * D + 55u]; } { acc[56u] += p * v_tile[j * D + 56u]; } { acc[57u] += p * v_tile[j * D + 57u]; } { acc[58u] += p * v_tile[j * D + 58u]; } { acc[59u] += p * v_tile[j * D + 59u]; } { acc[60u] += p * v_tile[j * D + 60u]; } { acc[61u] += p * v_tile[j * D + 61u]; } { acc[62u] += p * v_tile[j * D + 62u]; } { acc[63u] += p * v_tile[j * D + 63u]; } }
        }
        m = m_new;
    }
    if !live { return; }
    if !is_last() {
        { { attn_out[(q_base + row) * D + 0u] = acc[0u]; } { attn_out[(q_base + row) * D + 1u] = acc[1u]; } { attn_out[(q_base + row) * D + 2u] = acc[2u]; } { attn_out[(q_base + row) * D + 3u] = acc[3u]; } { attn_out[(q_base + row) * D + 4u] = acc[4u]; } { attn_out[(q_base + row) * D + 5u] = acc[5u]; } { attn_out[(q_base + row) * D + 6u] = acc[6u]; } { attn_out[(q_base + row) * D + 7u] = acc[7u]; } { attn_out[(q_base + row) * D + 8u] = acc[8u]; } { attn_out[(q_base + row) * D + 9u] = acc[9u]; } { attn_out[(q_base + row) * D + 10u] = acc[10u]; } { attn_out[(q_base + row) * D + 11u] = acc[11u]; } { attn_out[(q_base + row) * D + 12u] = acc[12u]; } { attn_out[(q_base + row) * D + 13u] = acc[13u]; } { attn_out[(q_base + row) * D + 14u] = acc[14u]; } { attn_out[(q_base + row) * D + 15u] = acc[15u]; } { attn_out[(q_base + row) * D + 16u] = acc[16u]; } { attn_out[(q_base + row) * D + 17u] = acc[17u]; } { attn_out[(q_base + row) * D + 18u] = acc[18u]; } { attn_out[(q_base + row) * D + 19u] = acc[19u]; } { attn_out[(q_base + row) * D + 20u] = acc[20u]; } { attn_out[(q_base + row) * D + 21u] = acc[21u]; } { attn_out[(q_base + row) * D + 22u] = acc[22u]; } { attn_out[(q_base + row) * D + 23u] = acc[23u]; } { attn_out[(q_base + row) * D + 24u] = acc[24u]; } { attn_out[(q_base + row) * D + 25u] = acc[25u]; } { attn_out[(q_base + row) * D + 26u] = acc[26u]; } { attn_out[(q_base + row) * D + 27u] = acc[27u]; } { attn_out[(q_base + row) * D + 28u] = acc[28u]; } { attn_out[(q_base + row) * D + 29u] = acc[29u]; } { attn_out[(q_base + row) * D + 30u] = acc[30u]; } { attn_out[(q_base + row) * D + 31u] = acc[31u]; } { attn_out[(q_base + row) * D + 32u] = acc[32u]; } { attn_out[(q_base + row) * D + 33u] = acc[33u]; } { attn_out[(q_base + row) * D + 34u] = acc[34u]; } { attn_out[(q_base + row) * D + 35u] = acc[35u]; } { attn_out[(q_base + row) * D + 36u] = acc[36u]; } { attn_out[(q_base + row) * D + 37u] = acc[37u]; } { attn_out[(q_base + row) * D + 38u] = acc[38u]; } { attn_out[(q_base + row) * D + 39u] = acc[39u]; } { attn_out[(q_base + row) * D + 40u] = acc[40u]; } { attn_out[(q_base + row) * D + 41u] = acc[41u]; } { attn_out[(q_base + row) * D + 42u] = acc[42u]; } { attn_out[(q_base + row) * D + 43u] = acc[43u]; } { attn_out[(q_base + row) * D + 44u] = acc[44u]; } { attn_out[(q_base + row) * D + 45u] = acc[45u]; } { attn_out[(q_base + row) * D + 46u] = acc[46u]; } { attn_out[(q_base + row) * D + 47u] = acc[47u]; } { attn_out[(q_base + row) * D + 48u] = acc[48u]; } { attn_out[(q_base + row) * D + 49u] = acc[49u]; } { attn_out[(q_base + row) * D + 50u] = acc[50u]; } { attn_out[(q_base + row) * D + 51u] = acc[51u]; } { attn_out[(q_base + row) * D + 52u] = acc[52u]; } { attn_out[(q_base + row) * D + 53u] = acc[53u]; } { attn_out[(q_base + row) * D + 54u] = acc[54u]; } { attn_out[(q_base + row) * D + 55u] = acc[55u]; } { attn_out[(q_base + row) * D + 56u] = acc[56u]; } { attn_out[(q_base + row) * D + 57u] = acc[57u]; } { attn_out[(q_base + row) * D + 58u] = acc[58u]; } { attn_out[(q_base + row) * D + 59u] = acc[59u]; } { attn_out[(q_base + row) * D + 60u] = acc[60u]; } { attn_out[(q_base + row) * D + 61u] = acc[61u]; } { attn_out[(q_base + row) * D + 62u] = acc[62u]; } { attn_out[(q_base + row) * D + 63u] = acc[63u]; } }
        stats[q_base + row] = vec2<f32>(m, l);
        return;
    }
    // A row with no visible key: attn_out 0, lse -inf.
    var inv = 0.0f;
    if l > 0.0f { inv = 1.0f / l; }
    { { attn_out[(q_base + row) * D + 0u] = acc[0u] * inv; } { attn_out[(q_base + row) * D + 1u] = acc[1u] * inv; } { attn_out[(q_base + row) * D + 2u] = acc[2u] * inv; } { attn_out[(q_base + row) * D + 3u] = acc[3u] * inv; } { attn_out[(q_base + row) * D + 4u] = acc[4u] * inv; } { attn_out[(q_base + row) * D + 5u] = acc[5u] * inv; } { attn_out[(q_base + row) * D + 6u] = acc[6u] * inv; } { attn_out[(q_base + row) * D + 7u] = acc[7u] * inv; } { attn_out[(q_base + row) * D + 8u] = acc[8u] * inv; } { attn_out[(q_base + row) * D + 9u] = acc[9u] * inv; } { attn_out[(q_base + row) * D + 10u] = acc[10u] * inv; } { attn_out[(q_base + row) * D + 11u] = acc[11u] * inv; } { attn_out[(q_base + row) * D + 12u] = acc[12u] * inv; } { attn_out[(q_base + row) * D + 13u] = acc[13u] * inv; } { attn_out[(q_base + row) * D + 14u] = acc[14u] * inv; } { attn_out[(q_base + row) * D + 15u] = acc[15u] * inv; } { attn_out[(q_base + row) * D + 16u] = acc[16u] * inv; } { attn_out[(q_base + row) * D + 17u] = acc[17u] * inv; } { attn_out[(q_base + row) * D + 18u] = acc[18u] * inv; } { attn_out[(q_base + row) * D + 19u] = acc[19u] * inv; } { attn_out[(q_base + row) * D + 20u] = acc[20u] * inv; } { attn_out[(q_base + row) * D + 21u] = acc[21u] * inv; } { attn_out[(q_base + row) * D + 22u] = acc[22u] * inv; } { attn_out[(q_base + row) * D + 23u] = acc[23u] * inv; } { attn_out[(q_base + row) * D + 24u] = acc[24u] * inv; } { attn_out[(q_base + row) * D + 25u] = acc[25u] * inv; } { attn_out[(q_base + row) * D + 26u] = acc[26u] * inv; } { attn_out[(q_base + row) * D + 27u] = acc[27u] * inv; } { attn_out[(q_base + row) * D + 28u] = acc[28u] * inv; } { attn_out[(q_base + row) * D + 29u] = acc[29u] * inv; } { attn_out[(q_base + row) * D + 30u] = acc[30u] * inv; } { attn_out[(q_base + row) * D + 31u] = acc[31u] * inv; } { attn_out[(q_base + row) * D + 32u] = acc[32u] * inv; } { attn_out[(q_base + row) * D + 33u] = acc[33u] * inv; } { attn_out[(q_base + row) * D + 34u] = acc[34u] * inv; } { attn_out[(q_base + row) * D + 35u] = acc[35u] * inv; } { attn_out[(q_base + row) * D + 36u] = acc[36u] * inv; } { attn_out[(q_base + row) * D + 37u] = acc[37u] * inv; } { attn_out[(q_base + row) * D + 38u] = acc[38u] * inv; } { attn_out[(q_base + row) * D + 39u] = acc[39u] * inv; } { attn_out[(q_base + row) * D + 40u] = acc[40u] * inv; } { attn_out[(q_base + row) * D + 41u] = acc[41u] * inv; } { attn_out[(q_base + row) * D + 42u] = acc[42u] * inv; } { attn_out[(q_base + row) * D + 43u] = acc[43u] * inv; } { attn_out[(q_base + row) * D + 44u] = acc[44u] * inv; } { attn_out[(q_base + row) * D + 45u] = acc[45u] * inv; } { attn_out[(q_base + row) * D + 46u] = acc[46u] * inv; } { attn_out[(q_base + row) * D + 47u] = acc[47u] * inv; } { attn_out[(q_base + row) * D + 48u] = acc[48u] * inv; } { attn_out[(q_base + row) * D + 49u] = acc[49u] * inv; } { attn_out[(q_base + row) * D + 50u] = acc[50u] * inv; } { attn_out[(q_base + row) * D + 51u] = acc[51u] * inv; } { attn_out[(q_base + row) * D + 52u] = acc[52u] * inv; } { attn_out[(q_base + row) * D + 53u] = acc[53u] * inv; } { attn_out[(q_base + row) * D + 54u] = acc[54u] * inv; } { attn_out[(q_base + row) * D + 55u] = acc[55u] * inv; } { attn_out[(q_base + row) * D + 56u] = acc[56u] * inv; } { attn_out[(q_base + row) * D + 57u] = acc[57u] * inv; } { attn_out[(q_base + row) * D + 58u] = acc[58u] * inv; } { attn_out[(q_base + row) * D + 59u] = acc[59u] * inv; } { attn_out[(q_base + row) * D + 60u] = acc[60u] * inv; } { attn_out[(q_base + row) * D + 61u] = acc[61u] * inv; } { attn_out[(q_base + row) * D + 62u] = acc[62u] * inv; } { attn_out[(q_base + row) * D + 63u] = acc[63u] * inv; } }
    var x = -bx_inf();
    if l > 0.0f { x = m + log(l); }
    lse[q_base + row] = x;
}

// K and V rows k0 .. k0 + BKV of one kv head (zeros past Sk).
var<workgroup> k_tile: array<f32, BKV * D>;
var<workgroup> v_tile: array<f32, BKV * D>;

fn stage_kv(lid: u32, kv_base: u32, k0: u32) {
    for (var t = 0u; t < N_KV; t++) {
        let e = lid + t * WG;
        if e < BKV * D {
            let r = k0 + e / D;
            var x = 0.0f;
            var y = 0.0f;
            if r < shape.seq_k {
                x = k[(kv_base + r) * D + e % D];
                y = v[(kv_base + r) * D + e % D];
            }
            k_tile[e] = x;
            v_tile[e] = y;
        }
    }
}
