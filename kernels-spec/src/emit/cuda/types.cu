// The element types and how keys and values are stored, one section each;
// `kernels::header` picks the sections of a configuration.
//@@ elem_f32
// ---- element type: f32 ----
typedef float elem_t;
__device__ __forceinline__ float bx_to_f32(float x) { return x; }
__device__ __forceinline__ float bx_from_f32(float x) { return x; }
//@@ elem_f16
// ---- element type: f16 (IEEE half bits, like __half) ----
typedef unsigned short elem_t;
#ifndef BX_HOST_EMULATION
__device__ __forceinline__ float bx_to_f32(unsigned short x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ unsigned short bx_from_f32(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#define BX_MMA_OP "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#endif
__device__ __forceinline__ void bx_put(unsigned short* p, float x) { *p = bx_from_f32(x); }
//@@ elem_bf16
// ---- element type: bf16 (bfloat16 bits, like __nv_bfloat16) ----
typedef unsigned short elem_t;
#ifndef BX_HOST_EMULATION
__device__ __forceinline__ float bx_to_f32(unsigned short x) {
    return __uint_as_float(((unsigned)x) << 16);
}
__device__ __forceinline__ unsigned short bx_from_f32(float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#define BX_MMA_OP "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#endif
__device__ __forceinline__ void bx_put(unsigned short* p, float x) { *p = bx_from_f32(x); }
//@@ kv_elem
// ---- keys and values: stored as the element type ----
#define BX_KV_BYTES 0
typedef elem_t kv_t;
//@@ kv_e4m3
// The byte's value times 2^-8 as f16 bits (sign, then exponent and mantissa
// one bit lower); S.1111.111 is NaN (E4M3 has no infinities).
__device__ __forceinline__ unsigned short bx_fp8_f16_bits(unsigned char b) {
    return (b & 0x7f) == 0x7f ? (unsigned short)0x7e00
                              : (unsigned short)(((b & 0x80) << 8) | ((b & 0x7f) << 7));
}
//@@ kv_e5m2
// The byte's value as f16 bits: its upper byte (infinities and NaN included).
__device__ __forceinline__ unsigned short bx_fp8_f16_bits(unsigned char b) { return (unsigned short)(b << 8); }
//@@ kv_f16_to_f32
#ifndef BX_HOST_EMULATION
__device__ __forceinline__ float bx_f16_bits_to_f32(unsigned short x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
#endif
//@@ kv_fp8
// Eight stored bytes (x, the lowest first) as eight tile elements at dst.
__device__ __forceinline__ void bx_stage8(elem_t* dst, uint2 x) {
#if BX_MMA
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned src = i < 2 ? x.x : x.y;
        const int sh = (i & 1) * 16;
        w[i] = (unsigned)bx_staged((unsigned char)(src >> sh)) | ((unsigned)bx_staged((unsigned char)(src >> (sh + 8))) << 16);
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]); // 16-byte aligned (LD % 8 == 0)
#else
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = bx_staged((unsigned char)((i < 4 ? x.x : x.y) >> (8 * (i & 3))));
#endif
}
