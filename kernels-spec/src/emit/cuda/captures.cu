// ---- the capture arena (see kernels_spec::params) ----
__device__ __forceinline__ unsigned bx_capture(const unsigned* __restrict__ captures, unsigned word) {
    return captures[word];
}
// The word when ok, else 0 without reading it; the first read out of range
// of a launch that reports records its site and indices in words 0..4
// (word 7 elects it).
__device__ __forceinline__ unsigned bx_capture_checked(unsigned* __restrict__ captures, unsigned word, bool ok,
                                                       bool report, unsigned site, unsigned i0, unsigned i1,
                                                       unsigned i2, unsigned i3) {
    if (ok) return captures[word];
    if (report && atomicMax(&captures[7], 1u) == 0u) {
        captures[1] = i0;
        captures[2] = i1;
        captures[3] = i2;
        captures[4] = i3;
        __threadfence();
        atomicExch(&captures[0], site + 1u);
    }
    return 0u;
}
// The least (or greatest) of `count` summary entries `stride` words apart.
__device__ __forceinline__ int bx_summary(const unsigned* __restrict__ captures, unsigned first, unsigned stride,
                                          unsigned count, bool greatest) {
    if (count == 0u) return greatest ? 2147483647 : (-2147483647 - 1);
    int best = (int)captures[first];
    for (unsigned i = 1u; i < count; ++i) {
        const int v = (int)captures[first + i * stride];
        best = greatest ? (v > best ? v : best) : (v < best ? v : best);
    }
    return best;
}
// Adds x to the 64-bit fixed-point gradient accumulator at `word` (even;
// u32 max: the read was outside its tensor): x·2^32 rounded to nearest, an
// integer atomic, so the sum is the same bits in any order. A non-finite x,
// or one of 2^24 or more, is dropped and flagged in word 5.
__device__ __forceinline__ void bx_grad_add(unsigned* __restrict__ captures, unsigned word, float x) {
    if (word == 0xffffffffu || x == 0.0f) return;
    if (!(fabsf(x) < 16777216.0f)) {
        const bool finite = (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
        atomicOr(&captures[5], finite ? 2u : 1u);
        return;
    }
    const long long fixed = __float2ll_rn(x * 4294967296.0f);
    atomicAdd(reinterpret_cast<unsigned long long*>(captures + word), (unsigned long long)fixed);
}
