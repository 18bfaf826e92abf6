// The tile building blocks every kernel uses, each with one job.
//@@ common

// ---- tile building blocks ----
__device__ __forceinline__ float bx_neg_inf() { return __int_as_float(0xff800000); }
// *p = x in p's type: f32, or rounded to the 16-bit element type.
__device__ __forceinline__ void bx_put(float* p, float x) { *p = x; }

// Query heads per kv head (GQA group), never 0.
__device__ __forceinline__ int bx_group(int heads_q, int heads_kv) {
    const int g = heads_kv > 0 ? heads_q / heads_kv : 1;
    return g > 0 ? g : 1;
}

// The two row widths a tile can have: W elements a row in global memory,
// WP as stored (zero-padded to whole MMA k-steps), LD apart in shared
// memory. q, k, dq, dk rows are BxRowD; v, out, dout, dv rows BxRowDV.
struct BxRowD {
    static constexpr int W = D;
    static constexpr int WP = DP;
    static constexpr int LD = LDE;
};
struct BxRowDV {
    static constexpr int W = DV;
    static constexpr int WP = DVP;
    static constexpr int LD = LDV;
};

// An element as a tile holds it (fp8 K/V bytes have their own overload).
__device__ __forceinline__ elem_t bx_staged(elem_t x) { return x; }

// Rows [0, ROWS) of a tile from rows of R::W elements of type S (elem_t,
// or an fp8 cache's bytes, converted as they are staged), tile row r being
// row row(r) of src, into a [ROWS][R::LD] tile, zero-filled past rows_valid
// and in the padding columns [W, WP); row(r) is asked only below
// rows_valid. In chunks of 16 bytes (elem_t) or 8 (fp8: 8 elements) when
// src is so aligned (W is a multiple of 8, so every row and every chunk
// is, and a chunk is all data or all padding); element by element
// otherwise.
template <int ROWS, int NT, typename R, typename S, typename Row>
__device__ __forceinline__ void bx_stage_rows(elem_t* dst, const S* __restrict__ src, int rows_valid, Row row) {
    constexpr bool BYTES = sizeof(S) == 1;
    constexpr int VEC = BYTES ? 8 : 16 / (int)sizeof(elem_t);
    constexpr int CHUNKS = R::WP / VEC;
    static_assert(R::W % VEC == 0 && R::WP % VEC == 0, "rows are whole chunks");
    if ((reinterpret_cast<size_t>(src) & (VEC * sizeof(S) - 1)) == 0) {
        for (int e = threadIdx.x; e < ROWS * CHUNKS; e += NT) {
            const int r = e / CHUNKS;
            const int c = (e - r * CHUNKS) * VEC;
            const bool live = r < rows_valid && c < R::W;
#if BX_KV_BYTES
            if constexpr (BYTES) {
                uint2 x = make_uint2(0u, 0u);
                if (live) x = *reinterpret_cast<const uint2*>(src + row(r) * R::W + c);
                bx_stage8(dst + r * R::LD + c, x);
            } else
#endif
            {
                uint4 x = make_uint4(0u, 0u, 0u, 0u);
                if (live) x = *reinterpret_cast<const uint4*>(src + row(r) * R::W + c);
#if BX_MMA
                *reinterpret_cast<uint4*>(dst + r * R::LD + c) = x; // rows are 16-byte aligned (LD % 8 == 0)
#else
                dst[r * R::LD + c] = __uint_as_float(x.x); // LD is odd: no vector store
                dst[r * R::LD + c + 1] = __uint_as_float(x.y);
                dst[r * R::LD + c + 2] = __uint_as_float(x.z);
                dst[r * R::LD + c + 3] = __uint_as_float(x.w);
#endif
            }
        }
    } else {
        for (int e = threadIdx.x; e < ROWS * R::WP; e += NT) {
            const int r = e / R::WP;
            const int c = e - r * R::WP;
            elem_t x = (elem_t)0;
            if (r < rows_valid && c < R::W) x = bx_staged(src[row(r) * R::W + c]);
            dst[r * R::LD + c] = x;
        }
    }
}

// Rows [0, ROWS) of a contiguous [rows_valid, R::W] block at src.
template <int ROWS, int NT, typename R, typename S>
__device__ __forceinline__ void bx_load_rows(elem_t* dst, const S* __restrict__ src, int rows_valid) {
    bx_stage_rows<ROWS, NT, R>(dst, src, rows_valid, [](int r) { return (size_t)r; });
}

// ROWS floats from src (valid ones) into dst, `fill` past rows_valid.
template <int ROWS, int NT>
__device__ __forceinline__ void bx_load_vec(float* dst, const float* __restrict__ src, int rows_valid, float fill) {
    for (int i = threadIdx.x; i < ROWS; i += NT) dst[i] = i < rows_valid ? src[i] : fill;
}

__device__ __forceinline__ float bx_warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float bx_warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

#if BX_MMA
#ifndef BX_HOST_EMULATION
// c += A·B for one m16n8k16 tile, operands in this lane's fragment registers.
__device__ __forceinline__ void bx_mma_sync(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                            unsigned b0, unsigned b1) {
    asm(BX_MMA_OP " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

// Two 16-bit elements p[0], p[STRIDE] packed as the f16x2/bf16x2 register an
// MMA fragment wants (the lower index in the low half).
template <int STRIDE>
__device__ __forceinline__ unsigned bx_pair(const elem_t* p) {
    if constexpr (STRIDE == 1) {
        return *reinterpret_cast<const unsigned*>(p); // 4-byte aligned: even strides, even columns
    } else {
        return (unsigned)p[0] | ((unsigned)p[STRIDE] << 16);
    }
}

// c (a 16×8 f32 tile, this lane's four values) += A(16×16)·B(16×8), where
// A(r, k) = a[r·ARS + k·ACS] and B(k, n) = b[k·BRS + n·BCS] in shared memory.
// Fragment layout of mma.m16n8k16 (g = lane / 4, t = lane % 4): A holds
// (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..); B holds
// (2t..2t+1, g), (2t+8.., g); C holds (g, 2t..2t+1), (g+8, 2t..2t+1).
template <int ARS, int ACS, int BRS, int BCS>
__device__ __forceinline__ void bx_mma(float (&c)[4], const elem_t* a, const elem_t* b) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t2 = (lane & 3) * 2;
    const unsigned a0 = bx_pair<ACS>(a + g * ARS + t2 * ACS);
    const unsigned a1 = bx_pair<ACS>(a + (g + 8) * ARS + t2 * ACS);
    const unsigned a2 = bx_pair<ACS>(a + g * ARS + (t2 + 8) * ACS);
    const unsigned a3 = bx_pair<ACS>(a + (g + 8) * ARS + (t2 + 8) * ACS);
    const unsigned b0 = bx_pair<BRS>(b + t2 * BRS + g * BCS);
    const unsigned b1 = bx_pair<BRS>(b + (t2 + 8) * BRS + g * BCS);
    bx_mma_sync(c, a0, a1, a2, a3, b0, b1);
}
#endif

// S[i][j] = Σ_d A[i][d]·B[j][d] (raw, unscaled) for a ROWS×COLS tile of two
// [·][R::LD] tiles, d < R::W. Each element is one chain over d ascending
// from zero — an fmaf chain, or MMA k-steps of 16 — whatever ROWS and COLS
// are, so a (query, key) pair gets bitwise the same value in every kernel.
template <int ROWS, int COLS, int LDS_, int NT, typename R>
__device__ __forceinline__ void bx_dot_tile(const elem_t* A, const elem_t* B, float* S) {
#if BX_MMA
    constexpr int NB = (ROWS / 16) * (COLS / 8);
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t2 = (lane & 3) * 2;
    for (int blk = threadIdx.x >> 5; blk < NB; blk += NT / 32) {
        const int i0 = (blk / (COLS / 8)) * 16;
        const int j0 = (blk % (COLS / 8)) * 8;
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
        for (int k = 0; k < R::WP; k += 16) bx_mma<R::LD, 1, 1, R::LD>(c, A + i0 * R::LD + k, B + j0 * R::LD + k);
        S[(i0 + g) * LDS_ + j0 + t2] = c[0];
        S[(i0 + g) * LDS_ + j0 + t2 + 1] = c[1];
        S[(i0 + g + 8) * LDS_ + j0 + t2] = c[2];
        S[(i0 + g + 8) * LDS_ + j0 + t2 + 1] = c[3];
    }
#else
    for (int e = threadIdx.x; e < ROWS * COLS; e += NT) {
        const int i = e / COLS;
        const int j = e - i * COLS;
        const float* a = A + i * R::LD;
        const float* b = B + j * R::LD;
        float acc = 0.0f;
#pragma unroll 8
        for (int d = 0; d < R::W; ++d) acc = fmaf(a[d], b[d], acc);
        S[i * LDS_ + j] = acc;
    }
#endif
}

// Whether a pair of a query row of its sequence (`row`) and a key of it
// (`key`), at positions qp and kp, is visible. Full tiles (TILE_FULL) skip
// the mask.
__device__ __forceinline__ bool bx_visible(const Params& params, unsigned* __restrict__ captures, int cls, int b,
                                           int h, bool row, bool key, int qp, int kp) {
    return row && key && (cls == TILE_FULL || variant_mask(params, captures, b, h, qp, kp));
}

// The one place a raw dot product becomes a score, in every kernel: x = the
// scaled logit (rounded on its own, never fused), then the variant's score;
// -inf when the pair is not visible.
__device__ __forceinline__ float bx_score_at(const Params& params, unsigned* __restrict__ captures, float raw,
                                             float scale, bool visible, int b, int h, int qp, int kp, float& x) {
    x = 0.0f;
    if (!visible) return bx_neg_inf();
    x = __fmul_rn(raw, scale);
    return variant_score(params, captures, x, b, h, qp, kp, true);
}

// Keys of a tile that no row of it sees (flag 0 in `seen`) get zero rows
// in `tile`, so that whatever their K or V rows hold (NaN, Inf: a cache's
// unwritten slots) never meets a zero probability in a product (0·NaN).
// Only a Partial tile can have such keys.
template <int ROWS, int NT, typename R>
__device__ __forceinline__ void bx_zero_unseen(elem_t* tile, const int* seen) {
    for (int e = threadIdx.x; e < ROWS * R::WP; e += NT) {
        const int r = e / R::WP;
        if (!seen[r]) tile[r * R::LD + (e - r * R::WP)] = (elem_t)0;
    }
}

// An f32 accumulator tile [ROWS][R::WP] in registers, spread over NT
// threads, for C += A·B with B a [·][R::LD] tile in shared memory; stored
// as [rows][R::W].
#if BX_MMA
// Warp w owns the 16×8 MMA tiles blk = w + n·(NT/32), n < NB, blk < TOTAL
// (the guard is uniform over the warp, as mma.sync requires).
template <int ROWS, int NT, typename R>
struct BxAcc {
    static constexpr int W = NT / 32;
    static constexpr int CB = R::WP / 8; // 16×8 tiles across a row
    static constexpr int TOTAL = (ROWS / 16) * CB;
    static constexpr int NB = (TOTAL + W - 1) / W;
    float c[NB][4];

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int n = 0; n < NB; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
    }
    // Row r of C *= f[r].
    __device__ __forceinline__ void scale_rows(const float* f) {
#pragma unroll
        for (int n = 0; n < NB; ++n) {
            const int blk = (int)(threadIdx.x >> 5) + n * W;
            if (blk < TOTAL) {
                const int r = (blk / CB) * 16 + ((threadIdx.x & 31) >> 2);
                const float f0 = f[r];
                const float f1 = f[r + 8];
                c[n][0] *= f0;
                c[n][1] *= f0;
                c[n][2] *= f1;
                c[n][3] *= f1;
            }
        }
    }
    // C += A·B, A(r, k) = a[r·ARS + k·ACS] (16-bit), B(k, n) = b[k·R::LD + n], k < INNER.
    template <int INNER, int ARS, int ACS>
    __device__ __forceinline__ void add(const elem_t* a, const elem_t* b) {
#pragma unroll
        for (int n = 0; n < NB; ++n) {
            const int blk = (int)(threadIdx.x >> 5) + n * W;
            if (blk < TOTAL) {
                const int i0 = (blk / CB) * 16;
                const int n0 = (blk % CB) * 8;
#pragma unroll
                for (int k = 0; k < INNER; k += 16)
                    bx_mma<ARS, ACS, R::LD, 1>(c[n], a + i0 * ARS + k * ACS, b + k * R::LD + n0);
            }
        }
    }
    // dst[r·R::W + col] = C[r][col]·f·rf[r] (rf may be null) for r < rows_valid,
    // col < R::W; dst is elem_t or f32.
    template <typename T>
    __device__ __forceinline__ void store(T* __restrict__ dst, int rows_valid, const float* rf, float f) {
#pragma unroll
        for (int n = 0; n < NB; ++n) {
            const int blk = (int)(threadIdx.x >> 5) + n * W;
            if (blk < TOTAL) {
                const int r = (blk / CB) * 16 + ((threadIdx.x & 31) >> 2);
                const int col = (blk % CB) * 8 + (threadIdx.x & 3) * 2;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int rr = r + 8 * half;
                    const float fr = rf ? f * rf[rr] : f;
                    if (rr < rows_valid) {
                        if (col < R::W) bx_put(dst + (size_t)rr * R::W + col, c[n][2 * half] * fr);
                        if (col + 1 < R::W) bx_put(dst + (size_t)rr * R::W + col + 1, c[n][2 * half + 1] * fr);
                    }
                }
            }
        }
    }
};
#else
// Thread t owns elements e = t + n·NT < ROWS·W, n < N (row e / W, column
// e % W; W = WP on CUDA cores).
template <int ROWS, int NT, typename R>
struct BxAcc {
    static constexpr int TOTAL = ROWS * R::W;
    static constexpr int N = (TOTAL + NT - 1) / NT;
    float c[N];

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int n = 0; n < N; ++n) c[n] = 0.0f;
    }
    __device__ __forceinline__ void scale_rows(const float* f) {
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const int e = (int)threadIdx.x + n * NT;
            if (e < TOTAL) c[n] *= f[e / R::W];
        }
    }
    template <int INNER, int ARS, int ACS>
    __device__ __forceinline__ void add(const float* a, const float* b) {
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const int e = (int)threadIdx.x + n * NT;
            if (e < TOTAL) {
                const int r = e / R::W;
                const int col = e - r * R::W;
                float s = c[n];
#pragma unroll 8
                for (int k = 0; k < INNER; ++k) s = fmaf(a[r * ARS + k * ACS], b[k * R::LD + col], s);
                c[n] = s;
            }
        }
    }
    __device__ __forceinline__ void store(float* __restrict__ dst, int rows_valid, const float* rf, float f) {
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const int e = (int)threadIdx.x + n * NT;
            const int r = e / R::W;
            const int col = e - r * R::W;
            if (e < TOTAL && r < rows_valid) dst[(size_t)r * R::W + col] = c[n] * (rf ? f * rf[r] : f);
        }
    }
};
#endif
