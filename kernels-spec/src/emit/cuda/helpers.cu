// ---- IR semantics helpers ----
__device__ __forceinline__ float bx_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float bx_nan() { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ bool bx_is_neg_inf(float x) { return x == __int_as_float(0xff800000); }
__device__ __forceinline__ int bx_add_i32(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
__device__ __forceinline__ int bx_sub_i32(int a, int b) { return (int)((unsigned)a - (unsigned)b); }
__device__ __forceinline__ int bx_mul_i32(int a, int b) { return (int)((unsigned)a * (unsigned)b); }
__device__ __forceinline__ int bx_neg_i32(int a) { return (int)(0u - (unsigned)a); }
__device__ __forceinline__ int bx_abs_i32(int a) { return a < 0 ? bx_neg_i32(a) : a; }
__device__ __forceinline__ int bx_div_i32(int a, int b) {
    if (b == 0) return 0;
    if (b == -1) return bx_neg_i32(a); // INT_MIN / -1 wraps
    return a / b;
}
__device__ __forceinline__ int bx_rem_i32(int a, int b) {
    if (b == 0 || b == -1) return 0;
    return a % b;
}
__device__ __forceinline__ unsigned bx_div_u32(unsigned a, unsigned b) { return b == 0u ? 0u : a / b; }
__device__ __forceinline__ unsigned bx_rem_u32(unsigned a, unsigned b) { return b == 0u ? 0u : a % b; }
__device__ __forceinline__ int bx_min_i32(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int bx_max_i32(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ unsigned bx_min_u32(unsigned a, unsigned b) { return a < b ? a : b; }
__device__ __forceinline__ unsigned bx_max_u32(unsigned a, unsigned b) { return a > b ? a : b; }
__device__ __forceinline__ int bx_f32_to_i32(float x) {
    if (x != x) return 0;
    if (x >= 2147483648.0f) return 2147483647;
    if (x < -2147483648.0f) return -2147483647 - 1;
    return (int)x;
}
__device__ __forceinline__ unsigned bx_f32_to_u32(float x) {
    if (x != x || x < 1.0f) return 0u;
    if (x >= 4294967296.0f) return 4294967295u;
    return (unsigned)x;
}
__device__ __forceinline__ float bx_tanh(float x) {
    // Below |x| = 0.625 an odd polynomial (Cephes tanhf), above (1 - t)/(1 + t)
    // with t = e^(-2|x|) <= 0.29 (exactly 1 once t underflows): exact near 0,
    // never inf/inf. The same form as the WGSL target's.
    if (x != x) return x;
    const float a = fabsf(x);
    const float z = __fmul_rn(x, x);
    float p = -5.70498872745e-3f;
    p = __fadd_rn(__fmul_rn(p, z), 2.06390887954e-2f);
    p = __fadd_rn(__fmul_rn(p, z), -5.37397155531e-2f);
    p = __fadd_rn(__fmul_rn(p, z), 1.33314422036e-1f);
    p = __fadd_rn(__fmul_rn(p, z), -3.33332819422e-1f);
    if (a < 0.625f) return __fadd_rn(x, __fmul_rn(__fmul_rn(x, z), p));
    const float t = expf(__fmul_rn(-2.0f, a));
    const float r = __fdiv_rn(__fsub_rn(1.0f, t), __fadd_rn(1.0f, t));
    return x < 0.0f ? -r : r;
}
// sin, cos and tan as the WGSL target computes them (not sinf: its
// large-argument path keeps a local array, which the kernels never use):
// k = round(x * 2/pi), y = x - k * pi/2 with pi/2 in three parts (the first
// exact in 8 bits), Cephes' polynomials on [-pi/4, pi/4] by quadrant.
// Within 2 ulp for |x| < 1e5.
__device__ __forceinline__ float bx_trig_reduce(float x, float* q) {
    const float k = rintf(__fmul_rn(x, 0.636619772f));
    *q = __fsub_rn(k, __fmul_rn(4.0f, floorf(__fmul_rn(k, 0.25f))));
    float y = __fsub_rn(x, __fmul_rn(k, 1.5703125f));
    y = __fsub_rn(y, __fmul_rn(k, 4.837512969970703125e-4f));
    return __fsub_rn(y, __fmul_rn(k, 7.54978995489188216e-8f));
}
__device__ __forceinline__ float bx_sin_poly(float y) {
    const float z = __fmul_rn(y, y);
    float p = -1.9515295891e-4f;
    p = __fadd_rn(__fmul_rn(p, z), 8.3321608736e-3f);
    p = __fadd_rn(__fmul_rn(p, z), -1.6666654611e-1f);
    return __fadd_rn(y, __fmul_rn(__fmul_rn(y, z), p));
}
__device__ __forceinline__ float bx_cos_poly(float y) {
    const float z = __fmul_rn(y, y);
    float p = 2.443315711809948e-5f;
    p = __fadd_rn(__fmul_rn(p, z), -1.388731625493765e-3f);
    p = __fadd_rn(__fmul_rn(p, z), 4.166664568298827e-2f);
    return __fadd_rn(__fsub_rn(1.0f, __fmul_rn(0.5f, z)), __fmul_rn(__fmul_rn(z, z), p));
}
__device__ __forceinline__ float bx_sin(float x) {
    float q;
    const float y = bx_trig_reduce(x, &q);
    const float v = (q == 1.0f || q == 3.0f) ? bx_cos_poly(y) : bx_sin_poly(y);
    return q >= 2.0f ? -v : v;
}
__device__ __forceinline__ float bx_cos(float x) {
    float q;
    const float y = bx_trig_reduce(x, &q);
    const float v = (q == 1.0f || q == 3.0f) ? bx_sin_poly(y) : bx_cos_poly(y);
    return (q == 1.0f || q == 2.0f) ? -v : v;
}
__device__ __forceinline__ float bx_tan(float x) {
    float q;
    const float y = bx_trig_reduce(x, &q);
    const float s = bx_sin_poly(y), c = bx_cos_poly(y);
    return (q == 1.0f || q == 3.0f) ? -__fdiv_rn(c, s) : __fdiv_rn(s, c);
}
__device__ __forceinline__ float bx_sigmoid(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
}
__device__ __forceinline__ int bx_sat_i32(long long v) {
    return v > 2147483647LL ? 2147483647 : (v < -2147483648LL ? (-2147483647 - 1) : (int)v);
}
__device__ __forceinline__ int bx_sat_add(int a, int b) { return bx_sat_i32((long long)a + (long long)b); }
__device__ __forceinline__ int bx_sat_sub(int a, int b) { return bx_sat_i32((long long)a - (long long)b); }
__device__ __forceinline__ int bx_sat_mul(int a, int b) { return bx_sat_i32((long long)a * (long long)b); }
