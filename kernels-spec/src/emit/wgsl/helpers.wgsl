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
