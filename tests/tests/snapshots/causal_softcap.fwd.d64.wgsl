// ---- tile configuration ----
const D: u32 = 64u; // query/key head dim
const DV: u32 = 64u; // value head dim
const BQ: u32 = 31u; // query rows staged per tile (dK/dV)
const BKV: u32 = 32u; // key rows staged per tile (forward, D_i, dQ)
const WG: u32 = 64u; // invocations (rows) per workgroup
// ---- tile classes (the classifier's codes) ----
const TILE_EMPTY: i32 = 0i;
const TILE_PARTIAL: i32 = 1i;
const TILE_FULL: i32 = 2i;
// ---- shape.flags of a dispatch ----
const FIRST: u32 = 1u; // its range starts the tile loop
const LAST: u32 = 2u; // its range ends it
const NO_WORD: u32 = 4294967295u; // shape.kv_lens / kv_pages: none
// ---- bindings ----
struct Shape {
    batch: u32,
    heads_q: u32,
    heads_kv: u32,
    seq_q: u32,
    seq_k: u32,
    scale: f32,
    tile_begin: u32,
    tile_end: u32,
    flags: u32,
    kv_lens: u32,
    q_lens: u32,
    kv_pages: u32,
    page_size: u32,
    max_pages: u32,
    splits: u32,
    pad_0: u32,
}
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<uniform> shape: Shape;
@group(0) @binding(2) var<storage, read_write> captures: array<atomic<u32>>;
@group(0) @binding(3) var<storage, read> q: array<f32>;
@group(0) @binding(4) var<storage, read> k: array<f32>;
@group(0) @binding(5) var<storage, read> v: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;
@group(0) @binding(7) var<storage, read_write> lse: array<f32>;
@group(0) @binding(8) var<storage, read_write> stats: array<vec4<f32>>;

// ---- shared ----
fn is_first() -> bool {
    return (shape.flags & FIRST) != 0u;
}
fn is_last() -> bool {
    return (shape.flags & LAST) != 0u;
}

// Elements each invocation copies when the workgroup stages a tile: BKV
// K rows, BKV V rows, BQ Q rows, BQ dO rows.
const N_K: u32 = (BKV * D + WG - 1u) / WG;
const N_V: u32 = (BKV * DV + WG - 1u) / WG;
const N_Q: u32 = (BQ * D + WG - 1u) / WG;
const N_O: u32 = (BQ * DV + WG - 1u) / WG;

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
// sin, cos and tan, not the builtins: WGSL bounds their error only on
// [-pi, pi] (2^-11 absolute). The argument is reduced by k = round(x * 2/pi)
// with pi/2 in three parts (the first exact in 8 bits, so k * P1 is exact
// for |k| < 2^16), then Cephes' single-precision polynomials on
// [-pi/4, pi/4] for the quadrant k mod 4: within 2 ulp for |x| < 1e5.
fn bx_quadrant(x: f32) -> vec2<f32> {
    let k = round(x * 0.636619772f);
    let y = ((x - k * 1.5703125f) - k * 4.837512969970703125e-4f) - k * 7.54978995489188216e-8f;
    return vec2<f32>(y, k - 4.0f * floor(k * 0.25f));
}
fn bx_sin_poly(y: f32) -> f32 {
    let z = y * y;
    return y + y * z * (-1.6666654611e-1f + z * (8.3321608736e-3f + z * -1.9515295891e-4f));
}
fn bx_cos_poly(y: f32) -> f32 {
    let z = y * y;
    return 1.0f - 0.5f * z
        + z * z * (4.166664568298827e-2f + z * (-1.388731625493765e-3f + z * 2.443315711809948e-5f));
}
fn bx_sin(x: f32) -> f32 {
    let r = bx_quadrant(x);
    let q = r.y;
    let v = select(bx_sin_poly(r.x), bx_cos_poly(r.x), q == 1.0f || q == 3.0f);
    return select(v, -v, q >= 2.0f);
}
fn bx_cos(x: f32) -> f32 {
    let r = bx_quadrant(x);
    let q = r.y;
    let v = select(bx_cos_poly(r.x), bx_sin_poly(r.x), q == 1.0f || q == 3.0f);
    return select(v, -v, q == 1.0f || q == 2.0f);
}
fn bx_tan(x: f32) -> f32 {
    let r = bx_quadrant(x);
    let s = bx_sin_poly(r.x);
    let c = bx_cos_poly(r.x);
    let odd = r.y == 1.0f || r.y == 3.0f;
    return select(s / c, -c / s, odd);
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
fn bx_sigmoid(x: f32) -> f32 {
    return 1.0f / (1.0f + exp(-x));
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
// Positions: the kernels' (query row i at i + Sk - Sq, key j at j) plus the
// call's window (params.win_q, params.win_kv; 0 but in a ring's calls, whose
// rows carry the sink only where params.win_no_sink is 0).
struct Params {
    p_cap: f32,
    pad_0: u32,
    pad_1: u32,
    pad_2: u32,
    pad: array<vec4<u32>, 7>,
    win_q: i32,
    win_kv: i32,
    win_no_sink: u32,
    win_spare: u32,
}

fn variant_score(s: f32, b: i32, h: i32, q: i32, kv: i32, seen: bool) -> f32 {
    return (params.p_cap * bx_tanh((s / params.p_cap)));
}

fn variant_score_grad(s: f32, b: i32, h: i32, q: i32, kv: i32, seen: bool) -> f32 {
    let l0: f32 = bx_tanh((s / params.p_cap));
    return (params.p_cap * ((1.0f - (l0 * l0)) * (1.0f / params.p_cap)));
}

fn variant_mask(b: i32, h: i32, q: i32, kv: i32) -> bool {
    let l0: i32 = (q + params.win_q);
    let l1: i32 = (kv + params.win_kv);
    return (l1 <= l0);
}

fn variant_sink(b: i32, h: i32, q: i32, seen: bool) -> f32 {
    return (- bx_inf());
}

fn variant_classify(b: i32, h: i32, q_lo: i32, q_hi: i32, kv_lo: i32, kv_hi: i32) -> i32 {
    let l0: i32 = (q_lo + params.win_q);
    let l1: i32 = (q_hi + params.win_q);
    let l2: i32 = (kv_lo + params.win_kv);
    let l3: i32 = (kv_hi + params.win_kv);
    return select(select(1i, 2i, (l0 >= l3)), 0i, (l2 > l1));
}

fn bx_learn_score(dz: f32, s: f32, b: i32, h: i32, q: i32, kv: i32) {
}
fn bx_learn_sink(dz: f32, b: i32, h: i32, q: i32) {
}
fn weights_start(sink: f32) -> f32 {
    return select(1.0f, 0.0f, bx_is_neg_inf(sink));
}
fn weights_rescale(m_old: f32, m_new: f32) -> f32 {
    return select(exp((m_old - m_new)), 1.0f, bx_is_neg_inf(m_new));
}
fn weights_pair(s: f32, m: f32) -> f32 {
    return select(exp((s - m)), 0.0f, bx_is_neg_inf(m));
}
fn weights_scale(l: f32) -> f32 {
    return select(0.0f, (1.0f / l), (l > 0.0f));
}
fn weights_lse(m: f32, l: f32) -> f32 {
    return select((- bx_inf()), (m + log(l)), (l > 0.0f));
}
fn weights_merge(lse: f32, m: f32) -> f32 {
    return select(exp((lse - m)), 0.0f, bx_is_neg_inf(m));
}
fn weights_prob(s: f32, lse: f32) -> f32 {
    return exp((s - lse));
}
fn weights_dz(p: f32, dpz: f32, delta: f32) -> f32 {
    return (p * (dpz - delta));
}
fn variant_dropout(b: i32, h: i32, q: i32, kv: i32) -> f32 {
    return 1.0;
}

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
    { { const d = 0u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 1u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 2u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 3u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 4u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 5u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 6u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 7u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 8u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 9u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 10u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 11u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 12u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 13u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 14u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 15u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 16u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 17u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 18u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 19u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 20u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 21u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 22u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 23u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 24u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 25u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 26u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 27u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 28u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 29u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 30u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 31u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 32u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 33u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 34u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 35u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 36u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 37u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 38u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 39u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 40u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 41u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 42u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 43u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 44u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 45u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 46u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 47u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 48u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 49u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 50u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 51u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 52u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 53u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 54u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 55u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 56u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 57u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 58u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 59u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 60u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 61u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 62u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } { const d = 63u; var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x; var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a; } }
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
            { { const d = 0u; dot += qr[d] * k_tile[j * D + d]; } { const d = 1u; dot += qr[d] * k_tile[j * D + d]; } { const d = 2u; dot += qr[d] * k_tile[j * D + d]; } { const d = 3u; dot += qr[d] * k_tile[j * D + d]; } { const d = 4u; dot += qr[d] * k_tile[j * D + d]; } { const d = 5u; dot += qr[d] * k_tile[j * D + d]; } { const d = 6u; dot += qr[d] * k_tile[j * D + d]; } { const d = 7u; dot += qr[d] * k_tile[j * D + d]; } { const d = 8u; dot += qr[d] * k_tile[j * D + d]; } { const d = 9u; dot += qr[d] * k_tile[j * D + d]; } { const d = 10u; dot += qr[d] * k_tile[j * D + d]; } { const d = 11u; dot += qr[d] * k_tile[j * D + d]; } { const d = 12u; dot += qr[d] * k_tile[j * D + d]; } { const d = 13u; dot += qr[d] * k_tile[j * D + d]; } { const d = 14u; dot += qr[d] * k_tile[j * D + d]; } { const d = 15u; dot += qr[d] * k_tile[j * D + d]; } { const d = 16u; dot += qr[d] * k_tile[j * D + d]; } { const d = 17u; dot += qr[d] * k_tile[j * D + d]; } { const d = 18u; dot += qr[d] * k_tile[j * D + d]; } { const d = 19u; dot += qr[d] * k_tile[j * D + d]; } { const d = 20u; dot += qr[d] * k_tile[j * D + d]; } { const d = 21u; dot += qr[d] * k_tile[j * D + d]; } { const d = 22u; dot += qr[d] * k_tile[j * D + d]; } { const d = 23u; dot += qr[d] * k_tile[j * D + d]; } { const d = 24u; dot += qr[d] * k_tile[j * D + d]; } { const d = 25u; dot += qr[d] * k_tile[j * D + d]; } { const d = 26u; dot += qr[d] * k_tile[j * D + d]; } { const d = 27u; dot += qr[d] * k_tile[j * D + d]; } { const d = 28u; dot += qr[d] * k_tile[j * D + d]; } { const d = 29u; dot += qr[d] * k_tile[j * D + d]; } { const d = 30u; dot += qr[d] * k_tile[j * D + d]; } { const d = 31u; dot += qr[d] * k_tile[j * D + d]; } { const d = 32u; dot += qr[d] * k_tile[j * D + d]; } { const d = 33u; dot += qr[d] * k_tile[j * D + d]; } { const d = 34u; dot += qr[d] * k_tile[j * D + d]; } { const d = 35u; dot += qr[d] * k_tile[j * D + d]; } { const d = 36u; dot += qr[d] * k_tile[j * D + d]; } { const d = 37u; dot += qr[d] * k_tile[j * D + d]; } { const d = 38u; dot += qr[d] * k_tile[j * D + d]; } { const d = 39u; dot += qr[d] * k_tile[j * D + d]; } { const d = 40u; dot += qr[d] * k_tile[j * D + d]; } { const d = 41u; dot += qr[d] * k_tile[j * D + d]; } { const d = 42u; dot += qr[d] * k_tile[j * D + d]; } { const d = 43u; dot += qr[d] * k_tile[j * D + d]; } { const d = 44u; dot += qr[d] * k_tile[j * D + d]; } { const d = 45u; dot += qr[d] * k_tile[j * D + d]; } { const d = 46u; dot += qr[d] * k_tile[j * D + d]; } { const d = 47u; dot += qr[d] * k_tile[j * D + d]; } { const d = 48u; dot += qr[d] * k_tile[j * D + d]; } { const d = 49u; dot += qr[d] * k_tile[j * D + d]; } { const d = 50u; dot += qr[d] * k_tile[j * D + d]; } { const d = 51u; dot += qr[d] * k_tile[j * D + d]; } { const d = 52u; dot += qr[d] * k_tile[j * D + d]; } { const d = 53u; dot += qr[d] * k_tile[j * D + d]; } { const d = 54u; dot += qr[d] * k_tile[j * D + d]; } { const d = 55u; dot += qr[d] * k_tile[j * D + d]; } { const d = 56u; dot += qr[d] * k_tile[j * D + d]; } { const d = 57u; dot += qr[d] * k_tile[j * D + d]; } { const d = 58u; dot += qr[d] * k_tile[j * D + d]; } { const d = 59u; dot += qr[d] * k_tile[j * D + d]; } { const d = 60u; dot += qr[d] * k_tile[j * D + d]; } { const d = 61u; dot += qr[d] * k_tile[j * D + d]; } { const d = 62u; dot += qr[d] * k_tile[j * D + d]; } { const d = 63u; dot += qr[d] * k_tile[j * D + d]; } }
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
        { { const d = 0u; acc[d] *= alpha; } { const d = 1u; acc[d] *= alpha; } { const d = 2u; acc[d] *= alpha; } { const d = 3u; acc[d] *= alpha; } { const d = 4u; acc[d] *= alpha; } { const d = 5u; acc[d] *= alpha; } { const d = 6u; acc[d] *= alpha; } { const d = 7u; acc[d] *= alpha; } { const d = 8u; acc[d] *= alpha; } { const d = 9u; acc[d] *= alpha; } { const d = 10u; acc[d] *= alpha; } { const d = 11u; acc[d] *= alpha; } { const d = 12u; acc[d] *= alpha; } { const d = 13u; acc[d] *= alpha; } { const d = 14u; acc[d] *= alpha; } { const d = 15u; acc[d] *= alpha; } { const d = 16u; acc[d] *= alpha; } { const d = 17u; acc[d] *= alpha; } { const d = 18u; acc[d] *= alpha; } { const d = 19u; acc[d] *= alpha; } { const d = 20u; acc[d] *= alpha; } { const d = 21u; acc[d] *= alpha; } { const d = 22u; acc[d] *= alpha; } { const d = 23u; acc[d] *= alpha; } { const d = 24u; acc[d] *= alpha; } { const d = 25u; acc[d] *= alpha; } { const d = 26u; acc[d] *= alpha; } { const d = 27u; acc[d] *= alpha; } { const d = 28u; acc[d] *= alpha; } { const d = 29u; acc[d] *= alpha; } { const d = 30u; acc[d] *= alpha; } { const d = 31u; acc[d] *= alpha; } { const d = 32u; acc[d] *= alpha; } { const d = 33u; acc[d] *= alpha; } { const d = 34u; acc[d] *= alpha; } { const d = 35u; acc[d] *= alpha; } { const d = 36u; acc[d] *= alpha; } { const d = 37u; acc[d] *= alpha; } { const d = 38u; acc[d] *= alpha; } { const d = 39u; acc[d] *= alpha; } { const d = 40u; acc[d] *= alpha; } { const d = 41u; acc[d] *= alpha; } { const d = 42u; acc[d] *= alpha; } { const d = 43u; acc[d] *= alpha; } { const d = 44u; acc[d] *= alpha; } { const d = 45u; acc[d] *= alpha; } { const d = 46u; acc[d] *= alpha; } { const d = 47u; acc[d] *= alpha; } { const d = 48u; acc[d] *= alpha; } { const d = 49u; acc[d] *= alpha; } { const d = 50u; acc[d] *= alpha; } { const d = 51u; acc[d] *= alpha; } { const d = 52u; acc[d] *= alpha; } { const d = 53u; acc[d] *= alpha; } { const d = 54u; acc[d] *= alpha; } { const d = 55u; acc[d] *= alpha; } { const d = 56u; acc[d] *= alpha; } { const d = 57u; acc[d] *= alpha; } { const d = 58u; acc[d] *= alpha; } { const d = 59u; acc[d] *= alpha; } { const d = 60u; acc[d] *= alpha; } { const d = 61u; acc[d] *= alpha; } { const d = 62u; acc[d] *= alpha; } { const d = 63u; acc[d] *= alpha; } }
        if cls == TILE_FULL {
            for (var j = 0u; j < BKV; j++) {
                let p = pair_weight(s_row[j], m_new, &l, ib, ih, qp, i32(k0 + j));
                { { const d = 0u; acc[d] += p * v_tile[j * DV + d]; } { const d = 1u; acc[d] += p * v_tile[j * DV + d]; } { const d = 2u; acc[d] += p * v_tile[j * DV + d]; } { const d = 3u; acc[d] += p * v_tile[j * DV + d]; } { const d = 4u; acc[d] += p * v_tile[j * DV + d]; } { const d = 5u; acc[d] += p * v_tile[j * DV + d]; } { const d = 6u; acc[d] += p * v_tile[j * DV + d]; } { const d = 7u; acc[d] += p * v_tile[j * DV + d]; } { const d = 8u; acc[d] += p * v_tile[j * DV + d]; } { const d = 9u; acc[d] += p * v_tile[j * DV + d]; } { const d = 10u; acc[d] += p * v_tile[j * DV + d]; } { const d = 11u; acc[d] += p * v_tile[j * DV + d]; } { const d = 12u; acc[d] += p * v_tile[j * DV + d]; } { const d = 13u; acc[d] += p * v_tile[j * DV + d]; } { const d = 14u; acc[d] += p * v_tile[j * DV + d]; } { const d = 15u; acc[d] += p * v_tile[j * DV + d]; } { const d = 16u; acc[d] += p * v_tile[j * DV + d]; } { const d = 17u; acc[d] += p * v_tile[j * DV + d]; } { const d = 18u; acc[d] += p * v_tile[j * DV + d]; } { const d = 19u; acc[d] += p * v_tile[j * DV + d]; } { const d = 20u; acc[d] += p * v_tile[j * DV + d]; } { const d = 21u; acc[d] += p * v_tile[j * DV + d]; } { const d = 22u; acc[d] += p * v_tile[j * DV + d]; } { const d = 23u; acc[d] += p * v_tile[j * DV + d]; } { const d = 24u; acc[d] += p * v_tile[j * DV + d]; } { const d = 25u; acc[d] += p * v_tile[j * DV + d]; } { const d = 26u; acc[d] += p * v_tile[j * DV + d]; } { const d = 27u; acc[d] += p * v_tile[j * DV + d]; } { const d = 28u; acc[d] += p * v_tile[j * DV + d]; } { const d = 29u; acc[d] += p * v_tile[j * DV + d]; } { const d = 30u; acc[d] += p * v_tile[j * DV + d]; } { const d = 31u; acc[d] += p * v_tile[j * DV + d]; } { const d = 32u; acc[d] += p * v_tile[j * DV + d]; } { const d = 33u; acc[d] += p * v_tile[j * DV + d]; } { const d = 34u; acc[d] += p * v_tile[j * DV + d]; } { const d = 35u; acc[d] += p * v_tile[j * DV + d]; } { const d = 36u; acc[d] += p * v_tile[j * DV + d]; } { const d = 37u; acc[d] += p * v_tile[j * DV + d]; } { const d = 38u; acc[d] += p * v_tile[j * DV + d]; } { const d = 39u; acc[d] += p * v_tile[j * DV + d]; } { const d = 40u; acc[d] += p * v_tile[j * DV + d]; } { const d = 41u; acc[d] += p * v_tile[j * DV + d]; } { const d = 42u; acc[d] += p * v_tile[j * DV + d]; } { const d = 43u; acc[d] += p * v_tile[j * DV + d]; } { const d = 44u; acc[d] += p * v_tile[j * DV + d]; } { const d = 45u; acc[d] += p * v_tile[j * DV + d]; } { const d = 46u; acc[d] += p * v_tile[j * DV + d]; } { const d = 47u; acc[d] += p * v_tile[j * DV + d]; } { const d = 48u; acc[d] += p * v_tile[j * DV + d]; } { const d = 49u; acc[d] += p * v_tile[j * DV + d]; } { const d = 50u; acc[d] += p * v_tile[j * DV + d]; } { const d = 51u; acc[d] += p * v_tile[j * DV + d]; } { const d = 52u; acc[d] += p * v_tile[j * DV + d]; } { const d = 53u; acc[d] += p * v_tile[j * DV + d]; } { const d = 54u; acc[d] += p * v_tile[j * DV + d]; } { const d = 55u; acc[d] += p * v_tile[j * DV + d]; } { const d = 56u; acc[d] += p * v_tile[j * DV + d]; } { const d = 57u; acc[d] += p * v_tile[j * DV + d]; } { const d = 58u; acc[d] += p * v_tile[j * DV + d]; } { const d = 59u; acc[d] += p * v_tile[j * DV + d]; } { const d = 60u; acc[d] += p * v_tile[j * DV + d]; } { const d = 61u; acc[d] += p * v_tile[j * DV + d]; } { const d = 62u; acc[d] += p * v_tile[j * DV + d]; } { const d = 63u; acc[d] += p * v_tile[j * DV + d]; } }
            }
        } else {
            // A key this row does not see has p = 0 and stays out of its
            // sums even where its V row holds NaN or Inf (0·NaN is NaN).
            for (var j = 0u; j < BKV; j++) {
                let p = pair_weight(s_row[j], m_new, &l, ib, ih, qp, i32(k0 + j));
                { { const d = 0u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 1u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 2u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 3u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 4u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 5u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 6u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 7u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 8u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 9u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 10u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 11u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 12u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 13u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 14u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 15u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 16u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 17u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 18u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 19u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 20u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 21u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 22u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 23u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 24u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 25u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 26u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 27u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 28u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 29u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 30u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 31u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 32u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 33u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 34u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 35u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 36u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 37u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 38u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 39u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 40u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 41u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 42u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 43u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 44u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 45u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 46u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 47u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 48u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 49u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 50u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 51u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 52u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 53u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 54u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 55u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 56u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 57u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 58u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 59u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 60u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 61u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 62u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } { const d = 63u; acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); } }
            }
        }
        m = m_new;
    }
    if !live { return; }
    stats[at] = vec4<f32>(m, l, top, 0.0f);
    if !is_last() {
        { { const d = 0u; out[at * DV + d] = acc[d]; } { const d = 1u; out[at * DV + d] = acc[d]; } { const d = 2u; out[at * DV + d] = acc[d]; } { const d = 3u; out[at * DV + d] = acc[d]; } { const d = 4u; out[at * DV + d] = acc[d]; } { const d = 5u; out[at * DV + d] = acc[d]; } { const d = 6u; out[at * DV + d] = acc[d]; } { const d = 7u; out[at * DV + d] = acc[d]; } { const d = 8u; out[at * DV + d] = acc[d]; } { const d = 9u; out[at * DV + d] = acc[d]; } { const d = 10u; out[at * DV + d] = acc[d]; } { const d = 11u; out[at * DV + d] = acc[d]; } { const d = 12u; out[at * DV + d] = acc[d]; } { const d = 13u; out[at * DV + d] = acc[d]; } { const d = 14u; out[at * DV + d] = acc[d]; } { const d = 15u; out[at * DV + d] = acc[d]; } { const d = 16u; out[at * DV + d] = acc[d]; } { const d = 17u; out[at * DV + d] = acc[d]; } { const d = 18u; out[at * DV + d] = acc[d]; } { const d = 19u; out[at * DV + d] = acc[d]; } { const d = 20u; out[at * DV + d] = acc[d]; } { const d = 21u; out[at * DV + d] = acc[d]; } { const d = 22u; out[at * DV + d] = acc[d]; } { const d = 23u; out[at * DV + d] = acc[d]; } { const d = 24u; out[at * DV + d] = acc[d]; } { const d = 25u; out[at * DV + d] = acc[d]; } { const d = 26u; out[at * DV + d] = acc[d]; } { const d = 27u; out[at * DV + d] = acc[d]; } { const d = 28u; out[at * DV + d] = acc[d]; } { const d = 29u; out[at * DV + d] = acc[d]; } { const d = 30u; out[at * DV + d] = acc[d]; } { const d = 31u; out[at * DV + d] = acc[d]; } { const d = 32u; out[at * DV + d] = acc[d]; } { const d = 33u; out[at * DV + d] = acc[d]; } { const d = 34u; out[at * DV + d] = acc[d]; } { const d = 35u; out[at * DV + d] = acc[d]; } { const d = 36u; out[at * DV + d] = acc[d]; } { const d = 37u; out[at * DV + d] = acc[d]; } { const d = 38u; out[at * DV + d] = acc[d]; } { const d = 39u; out[at * DV + d] = acc[d]; } { const d = 40u; out[at * DV + d] = acc[d]; } { const d = 41u; out[at * DV + d] = acc[d]; } { const d = 42u; out[at * DV + d] = acc[d]; } { const d = 43u; out[at * DV + d] = acc[d]; } { const d = 44u; out[at * DV + d] = acc[d]; } { const d = 45u; out[at * DV + d] = acc[d]; } { const d = 46u; out[at * DV + d] = acc[d]; } { const d = 47u; out[at * DV + d] = acc[d]; } { const d = 48u; out[at * DV + d] = acc[d]; } { const d = 49u; out[at * DV + d] = acc[d]; } { const d = 50u; out[at * DV + d] = acc[d]; } { const d = 51u; out[at * DV + d] = acc[d]; } { const d = 52u; out[at * DV + d] = acc[d]; } { const d = 53u; out[at * DV + d] = acc[d]; } { const d = 54u; out[at * DV + d] = acc[d]; } { const d = 55u; out[at * DV + d] = acc[d]; } { const d = 56u; out[at * DV + d] = acc[d]; } { const d = 57u; out[at * DV + d] = acc[d]; } { const d = 58u; out[at * DV + d] = acc[d]; } { const d = 59u; out[at * DV + d] = acc[d]; } { const d = 60u; out[at * DV + d] = acc[d]; } { const d = 61u; out[at * DV + d] = acc[d]; } { const d = 62u; out[at * DV + d] = acc[d]; } { const d = 63u; out[at * DV + d] = acc[d]; } }
        return;
    }
    // The normalisation's finish (a softmax: out / l and m + log(l); a row
    // with no visible key in this split: out 0, lse -inf).
    let inv = weights_scale(l);
    { { const d = 0u; out[at * DV + d] = acc[d] * inv; } { const d = 1u; out[at * DV + d] = acc[d] * inv; } { const d = 2u; out[at * DV + d] = acc[d] * inv; } { const d = 3u; out[at * DV + d] = acc[d] * inv; } { const d = 4u; out[at * DV + d] = acc[d] * inv; } { const d = 5u; out[at * DV + d] = acc[d] * inv; } { const d = 6u; out[at * DV + d] = acc[d] * inv; } { const d = 7u; out[at * DV + d] = acc[d] * inv; } { const d = 8u; out[at * DV + d] = acc[d] * inv; } { const d = 9u; out[at * DV + d] = acc[d] * inv; } { const d = 10u; out[at * DV + d] = acc[d] * inv; } { const d = 11u; out[at * DV + d] = acc[d] * inv; } { const d = 12u; out[at * DV + d] = acc[d] * inv; } { const d = 13u; out[at * DV + d] = acc[d] * inv; } { const d = 14u; out[at * DV + d] = acc[d] * inv; } { const d = 15u; out[at * DV + d] = acc[d] * inv; } { const d = 16u; out[at * DV + d] = acc[d] * inv; } { const d = 17u; out[at * DV + d] = acc[d] * inv; } { const d = 18u; out[at * DV + d] = acc[d] * inv; } { const d = 19u; out[at * DV + d] = acc[d] * inv; } { const d = 20u; out[at * DV + d] = acc[d] * inv; } { const d = 21u; out[at * DV + d] = acc[d] * inv; } { const d = 22u; out[at * DV + d] = acc[d] * inv; } { const d = 23u; out[at * DV + d] = acc[d] * inv; } { const d = 24u; out[at * DV + d] = acc[d] * inv; } { const d = 25u; out[at * DV + d] = acc[d] * inv; } { const d = 26u; out[at * DV + d] = acc[d] * inv; } { const d = 27u; out[at * DV + d] = acc[d] * inv; } { const d = 28u; out[at * DV + d] = acc[d] * inv; } { const d = 29u; out[at * DV + d] = acc[d] * inv; } { const d = 30u; out[at * DV + d] = acc[d] * inv; } { const d = 31u; out[at * DV + d] = acc[d] * inv; } { const d = 32u; out[at * DV + d] = acc[d] * inv; } { const d = 33u; out[at * DV + d] = acc[d] * inv; } { const d = 34u; out[at * DV + d] = acc[d] * inv; } { const d = 35u; out[at * DV + d] = acc[d] * inv; } { const d = 36u; out[at * DV + d] = acc[d] * inv; } { const d = 37u; out[at * DV + d] = acc[d] * inv; } { const d = 38u; out[at * DV + d] = acc[d] * inv; } { const d = 39u; out[at * DV + d] = acc[d] * inv; } { const d = 40u; out[at * DV + d] = acc[d] * inv; } { const d = 41u; out[at * DV + d] = acc[d] * inv; } { const d = 42u; out[at * DV + d] = acc[d] * inv; } { const d = 43u; out[at * DV + d] = acc[d] * inv; } { const d = 44u; out[at * DV + d] = acc[d] * inv; } { const d = 45u; out[at * DV + d] = acc[d] * inv; } { const d = 46u; out[at * DV + d] = acc[d] * inv; } { const d = 47u; out[at * DV + d] = acc[d] * inv; } { const d = 48u; out[at * DV + d] = acc[d] * inv; } { const d = 49u; out[at * DV + d] = acc[d] * inv; } { const d = 50u; out[at * DV + d] = acc[d] * inv; } { const d = 51u; out[at * DV + d] = acc[d] * inv; } { const d = 52u; out[at * DV + d] = acc[d] * inv; } { const d = 53u; out[at * DV + d] = acc[d] * inv; } { const d = 54u; out[at * DV + d] = acc[d] * inv; } { const d = 55u; out[at * DV + d] = acc[d] * inv; } { const d = 56u; out[at * DV + d] = acc[d] * inv; } { const d = 57u; out[at * DV + d] = acc[d] * inv; } { const d = 58u; out[at * DV + d] = acc[d] * inv; } { const d = 59u; out[at * DV + d] = acc[d] * inv; } { const d = 60u; out[at * DV + d] = acc[d] * inv; } { const d = 61u; out[at * DV + d] = acc[d] * inv; } { const d = 62u; out[at * DV + d] = acc[d] * inv; } { const d = 63u; out[at * DV + d] = acc[d] * inv; } }
    lse[at] = weights_lse(m, l);
}

// The weight in P·V of a pair with score s (-inf where hidden) in a row
// whose running max is m (weights_pair), added to the row's sum l, then
// times the pair's dropout factor (0 or 1/(1 - p); 1 without dropout).
fn pair_weight(s: f32, m: f32, l: ptr<function, f32>, ib: i32, ih: i32, qp: i32, kp: i32) -> f32 {
    let p = weights_pair(s, m);
    *l += p;
    return p * variant_dropout(ib, ih, qp, kp);
}

// ---- keys: where key r of sequence b lives ----
// The keys of sequence b: its KV cache length (arena word shape.kv_lens + b,
// at most Sk), or Sk without a cache.
fn seq_keys(b: u32) -> u32 {
    if shape.kv_lens == NO_WORD { return shape.seq_k; }
    return min(atomicLoad(&captures[shape.kv_lens + b]), shape.seq_k);
}

// The query rows of sequence b: a padded batch's (arena word shape.q_lens +
// b, at most Sq; its rows from there on see nothing, and its row i sits at
// position i + keys − rows), or Sq without one.
fn seq_queries(b: u32) -> u32 {
    if shape.q_lens == NO_WORD { return shape.seq_q; }
    return min(atomicLoad(&captures[shape.q_lens + b]), shape.seq_q);
}

// The row of k and v (times D and DV: the element offsets) of key r of
// (b, h_kv): contiguous [B, Hkv, Sk, ·], or with pages (page_size > 0) slot
// r % page_size of page pages[b * max_pages + r / page_size] in
// [pages, Hkv, page_size, ·].
fn key_row(b: u32, h_kv: u32, r: u32) -> u32 {
    if shape.page_size == 0u { return (b * shape.heads_kv + h_kv) * shape.seq_k + r; }
    let page = atomicLoad(&captures[shape.kv_pages + b * shape.max_pages + r / shape.page_size]);
    return (page * shape.heads_kv + h_kv) * shape.page_size + r % shape.page_size;
}

// K and V rows k0 .. k0 + BKV of kv head h_kv of sequence b (zeros from its
// sk keys on: a cache's spare slots are never read).
var<workgroup> k_tile: array<f32, BKV * D>;
var<workgroup> v_tile: array<f32, BKV * DV>;

fn stage_kv(lid: u32, b: u32, h_kv: u32, k0: u32, sk: u32) {
    for (var t = 0u; t < N_K; t++) {
        let e = lid + t * WG;
        if e < BKV * D {
            let r = k0 + e / D;
            var x = 0.0f;
            if r < sk { x = k[key_row(b, h_kv, r) * D + e % D]; }
            k_tile[e] = x;
        }
    }
    for (var t = 0u; t < N_V; t++) {
        let e = lid + t * WG;
        if e < BKV * DV {
            let r = k0 + e / DV;
            var y = 0.0f;
            if r < sk { y = v[key_row(b, h_kv, r) * DV + e % DV]; }
            v_tile[e] = y;
        }
    }
}
