// The backward modules: their preamble, then each kernel's body; the
// signatures are written from the descriptions in `kernels.rs`.
//@@ preamble

// ---- backward ----
static_assert(!BX_KV_BYTES, "the backward reads K and V in the element type (fp8 caches are for inference)");

// The gradient tile of one (query tile, key tile), shared by dQ and dK/dV:
// recompute each score with the forward's code (bx_dot_tile + bx_score_at),
// then P (for a softmax exp(score - lse)) and dS = d loss / d score ·
// score'(x) (bx_pair_grad). Invisible pairs,
// rows with lse = -inf and rows/keys out of range give P = dS = 0. In: S the
// raw Q·Kᵀ, dP the raw dO·Vᵀ. Out: P in S, dS in dP, and their 16-bit
// copies in Pe, dSe on tensor cores.
__device__ __forceinline__ void bx_grad_tile(float* S, float* dP, elem_t* Pe, elem_t* dSe, const float* s_lse,
                                             const float* s_delta, int* s_seen, const Params& params,
                                             unsigned* __restrict__ captures, int cls, int b, int h, int q0,
                                             int k0, int sq, int sk, int offset, float scale) {
    for (int e = threadIdx.x; e < BBQ * BBKV; e += BWD_THREADS) {
        const int i = e / BBKV;
        const int j = e - i * BBKV;
        const int qp = q0 + i + offset;
        const int kp = k0 + j;
        const bool vis = bx_visible(params, captures, cls, b, h, q0 + i < sq, kp < sk, qp, kp);
        if (vis) s_seen[j] = 1;
        float x;
        const float sc = bx_score_at(params, captures, S[i * BWD_LDS + j], scale, vis, b, h, qp, kp, x);
        const float L = s_lse[i];
        float p = 0.0f;
        float ds = 0.0f;
        if (vis && L != bx_neg_inf() && sc != bx_neg_inf()) {
            const float dz = bx_pair_grad(params, sc, L, dP[i * BWD_LDS + j], s_delta[i], b, h, qp, kp, p);
            ds = dz * variant_score_grad(params, captures, x, b, h, qp, kp, true);
        }
        S[i * BWD_LDS + j] = p;
        dP[i * BWD_LDS + j] = ds;
#if BX_MMA
        Pe[i * BWD_LDP + j] = bx_from_f32(p);
        dSe[i * BWD_LDP + j] = bx_from_f32(ds);
#else
        (void)Pe;
        (void)dSe;
#endif
    }
}

#define BX_BWD_SMEM                                                                 \
    extern __shared__ __align__(16) unsigned char bx_smem[];                        \
    elem_t* sQ = reinterpret_cast<elem_t*>(bx_smem + BWD_Q);                        \
    elem_t* sdO = reinterpret_cast<elem_t*>(bx_smem + BWD_DO);                      \
    elem_t* sK = reinterpret_cast<elem_t*>(bx_smem + BWD_K);                        \
    elem_t* sV = reinterpret_cast<elem_t*>(bx_smem + BWD_V);                        \
    float* sS = reinterpret_cast<float*>(bx_smem + BWD_S);                          \
    float* sdP = reinterpret_cast<float*>(bx_smem + BWD_DP);                        \
    float* s_lse = reinterpret_cast<float*>(bx_smem + BWD_LSE);                     \
    float* s_delta = reinterpret_cast<float*>(bx_smem + BWD_DELTA);                 \
    int* s_seen = reinterpret_cast<int*>(bx_smem + BWD_SEEN);

#if BX_MMA
#define BX_BWD_OPERANDS                                                             \
    elem_t* sPe = reinterpret_cast<elem_t*>(bx_smem + BWD_PE);                      \
    elem_t* sdSe = reinterpret_cast<elem_t*>(bx_smem + BWD_DSE);                    \
    constexpr int LDA = BWD_LDP;
#else
// f32: the MMA operands are the f32 tiles themselves.
#define BX_BWD_OPERANDS                                                             \
    elem_t* sPe = sS;                                                               \
    elem_t* sdSe = sdP;                                                             \
    constexpr int LDA = BWD_LDS;
#endif
//@@ boostr_attn_bwd_delta
    const long long rows = (long long)batch * heads_q * seq_q;
    const long long row = (long long)blockIdx.x * (DELTA_THREADS / 32) + (threadIdx.x >> 5);
    if (row >= rows) return; // whole warps leave together
    const int lane = threadIdx.x & 31;
    const size_t base = (size_t)row * DV;
    float s = 0.0f;
    for (int d = lane; d < DV; d += 32) s = fmaf(bx_to_f32(dout[base + d]), bx_to_f32(out[base + d]), s);
    s = bx_warp_sum(s);
    if (lane == 0) delta[row] += s; // delta holds -dlse on entry
}
//@@ boostr_attn_bwd_dq
    BX_BWD_SMEM
    BX_BWD_OPERANDS
    (void)batch;
    const int q0 = blockIdx.x * BBQ;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int hk = h / bx_group(heads_q, heads_kv);
    const int sk = bx_seq_keys(captures, kv_lens, b, seq_k); // spare slots: zero gradients
    const int sq = bx_seq_queries(captures, q_lens, b, seq_q); // spare rows: zero gradients
    const int offset = sk - sq;
    const size_t q_row0 = ((size_t)b * heads_q + h) * (size_t)seq_q + q0;
    const BxKeys keys = bx_keys(captures, kv_pages, page_size, max_pages, heads_kv, seq_k, b, hk);

    // Only the sequence's own rows are read (zeros past them).
    bx_load_rows<BBQ, BWD_THREADS, BxRowD>(sQ, q + q_row0 * D, sq - q0);
    bx_load_rows<BBQ, BWD_THREADS, BxRowDV>(sdO, dout + q_row0 * DV, sq - q0);
    bx_load_vec<BBQ, BWD_THREADS>(s_lse, lse + q_row0, sq - q0, bx_neg_inf());
    bx_load_vec<BBQ, BWD_THREADS>(s_delta, delta + q_row0, sq - q0, 0.0f);
    BxAcc<BBQ, BWD_THREADS, BxRowD> acc; // dQ, D wide
    acc.zero();

    const int q_lo = q0 + offset;
    const int q_hi = min(q0 + BBQ, sq) - 1 + offset;
    const int n_kt = q0 < sq ? (sk + BBKV - 1) / BBKV : 0;
    for (int kt = 0; kt < n_kt; ++kt) {
        const int k0 = kt * BBKV;
        const int cls = variant_classify(params, captures, b, h, q_lo, q_hi, k0, min(k0 + BBKV, sk) - 1);
        if (cls == TILE_EMPTY) continue;
        __syncthreads();
        bx_load_keys<BBKV, BWD_THREADS, BxRowD>(sK, k, keys, k0, sk - k0);
        bx_load_keys<BBKV, BWD_THREADS, BxRowDV>(sV, v, keys, k0, sk - k0);
        for (int j = threadIdx.x; j < BBKV; j += BWD_THREADS) s_seen[j] = 0;
        __syncthreads();
        bx_dot_tile<BBQ, BBKV, BWD_LDS, BWD_THREADS, BxRowD>(sQ, sK, sS);
        bx_dot_tile<BBQ, BBKV, BWD_LDS, BWD_THREADS, BxRowDV>(sdO, sV, sdP);
        __syncthreads();
        bx_grad_tile(sS, sdP, sPe, sdSe, s_lse, s_delta, s_seen, params, captures, cls, b, h, q0, k0, sq, sk,
                     offset, scale);
        __syncthreads();
        if (cls != TILE_FULL) { // dS = 0 at unseen keys, but 0·NaN is not 0
            bx_zero_unseen<BBKV, BWD_THREADS, BxRowD>(sK, s_seen);
            __syncthreads();
        }
        acc.template add<BBKV, LDA, 1>(sdSe, sK);
    }
    acc.store(dq + q_row0 * D, seq_q - q0, nullptr, scale);
}
//@@ boostr_attn_bwd_dkdv
    BX_BWD_SMEM
    BX_BWD_OPERANDS
    (void)batch;
    const int k0 = blockIdx.x * BBKV;
    const int hk = blockIdx.y;
    const int b = blockIdx.z;
    const int group = bx_group(heads_q, heads_kv);
    const int sk = bx_seq_keys(captures, kv_lens, b, seq_k); // spare slots: zero gradients
    const int sq = bx_seq_queries(captures, q_lens, b, seq_q); // spare rows: never read
    const int offset = sk - sq;
    // dK and dV rows of the sequence's slots (a paged call's are folded
    // into its pages after).
    const size_t kv_row0 = ((size_t)b * heads_kv + hk) * (size_t)seq_k + k0;
    const int kv_hi = min(k0 + BBKV, sk) - 1;
    const BxKeys keys = bx_keys(captures, kv_pages, page_size, max_pages, heads_kv, seq_k, b, hk);

    bx_load_keys<BBKV, BWD_THREADS, BxRowD>(sK, k, keys, k0, sk - k0);
    bx_load_keys<BBKV, BWD_THREADS, BxRowDV>(sV, v, keys, k0, sk - k0);
    BxAcc<BBKV, BWD_THREADS, BxRowD> acc_k;  // dK, D wide
    BxAcc<BBKV, BWD_THREADS, BxRowDV> acc_v; // dV, DV wide
    acc_k.zero();
    acc_v.zero();

    const int n_qt = k0 < sk ? (sq + BBQ - 1) / BBQ : 0; // a tile of spare slots: zeros
    for (int hh = 0; hh < group; ++hh) {
        const int h = hk * group + hh;
        const size_t q_head0 = ((size_t)b * heads_q + h) * (size_t)seq_q;
        for (int qt = 0; qt < n_qt; ++qt) {
            const int q0 = qt * BBQ;
            const int q_lo = q0 + offset;
            const int q_hi = min(q0 + BBQ, sq) - 1 + offset;
            const int cls = variant_classify(params, captures, b, h, q_lo, q_hi, k0, kv_hi);
            if (cls == TILE_EMPTY) continue;
            __syncthreads(); // K/V loaded; the previous tile's readers are done
            bx_load_rows<BBQ, BWD_THREADS, BxRowD>(sQ, q + (q_head0 + q0) * D, sq - q0);
            bx_load_rows<BBQ, BWD_THREADS, BxRowDV>(sdO, dout + (q_head0 + q0) * DV, sq - q0);
            bx_load_vec<BBQ, BWD_THREADS>(s_lse, lse + q_head0 + q0, sq - q0, bx_neg_inf());
            bx_load_vec<BBQ, BWD_THREADS>(s_delta, delta + q_head0 + q0, sq - q0, 0.0f);
            __syncthreads();
            bx_dot_tile<BBQ, BBKV, BWD_LDS, BWD_THREADS, BxRowD>(sQ, sK, sS);
            bx_dot_tile<BBQ, BBKV, BWD_LDS, BWD_THREADS, BxRowDV>(sdO, sV, sdP);
            __syncthreads();
            bx_grad_tile(sS, sdP, sPe, sdSe, s_lse, s_delta, s_seen, params, captures, cls, b, h, q0, k0, sq,
                         sk, offset, scale);
            __syncthreads();
            // Pᵀ and dSᵀ: A(key j, query i) = P[i][j].
            acc_v.template add<BBQ, 1, LDA>(sPe, sdO);
            acc_k.template add<BBQ, 1, LDA>(sdSe, sQ);
        }
    }
    acc_k.store(dk + kv_row0 * D, seq_k - k0, nullptr, scale);
    acc_v.store(dv + kv_row0 * DV, seq_k - k0, nullptr, 1.0f);
}
//@@ boostr_attn_bwd_tensors
    BX_BWD_SMEM
    (void)batch;
    (void)s_seen;
    const int q0 = blockIdx.x * BBQ;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int hk = h / bx_group(heads_q, heads_kv);
    const int sk = bx_seq_keys(captures, kv_lens, b, seq_k); // spare slots: zero gradients
    const int sq = bx_seq_queries(captures, q_lens, b, seq_q); // spare rows: none
    const int offset = sk - sq;
    const size_t q_row0 = ((size_t)b * heads_q + h) * (size_t)seq_q + q0;
    const BxKeys keys = bx_keys(captures, kv_pages, page_size, max_pages, heads_kv, seq_k, b, hk);

    bx_load_rows<BBQ, BWD_THREADS, BxRowD>(sQ, q + q_row0 * D, sq - q0);
    bx_load_rows<BBQ, BWD_THREADS, BxRowDV>(sdO, dout + q_row0 * DV, sq - q0);
    bx_load_vec<BBQ, BWD_THREADS>(s_lse, lse + q_row0, sq - q0, bx_neg_inf());
    bx_load_vec<BBQ, BWD_THREADS>(s_delta, delta + q_row0, sq - q0, 0.0f);

    const int q_lo = q0 + offset;
    const int q_hi = min(q0 + BBQ, sq) - 1 + offset;
    const int n_kt = q0 < sq ? (sk + BBKV - 1) / BBKV : 0;
    for (int kt = 0; kt < n_kt; ++kt) {
        const int k0 = kt * BBKV;
        const int cls = variant_classify(params, captures, b, h, q_lo, q_hi, k0, min(k0 + BBKV, sk) - 1);
        if (cls == TILE_EMPTY) continue;
        __syncthreads(); // the previous tile's readers are done
        bx_load_keys<BBKV, BWD_THREADS, BxRowD>(sK, k, keys, k0, sk - k0);
        bx_load_keys<BBKV, BWD_THREADS, BxRowDV>(sV, v, keys, k0, sk - k0);
        __syncthreads();
        bx_dot_tile<BBQ, BBKV, BWD_LDS, BWD_THREADS, BxRowD>(sQ, sK, sS);
        bx_dot_tile<BBQ, BBKV, BWD_LDS, BWD_THREADS, BxRowDV>(sdO, sV, sdP);
        __syncthreads();
        // d loss / d score at each visible pair, as bx_grad_tile has it.
        for (int e = threadIdx.x; e < BBQ * BBKV; e += BWD_THREADS) {
            const int i = e / BBKV;
            const int j = e - i * BBKV;
            const int qp = q0 + i + offset;
            const int kp = k0 + j;
            const bool vis = bx_visible(params, captures, cls, b, h, q0 + i < sq, kp < sk, qp, kp);
            float x;
            const float sc = bx_score_at(params, captures, sS[i * BWD_LDS + j], scale, vis, b, h, qp, kp, x);
            const float L = s_lse[i];
            if (vis && L != bx_neg_inf() && sc != bx_neg_inf()) {
                float w;
                const float dz = bx_pair_grad(params, sc, L, sdP[i * BWD_LDS + j], s_delta[i], b, h, qp, kp, w);
                if (dz != 0.0f) bx_learn_score(params, captures, dz, x, b, h, qp, kp);
            }
        }
    }
    __syncthreads(); // s_lse and s_delta, where no tile was visited
    // The sink's share, once per row: d loss / d sink = -P_sink D_i.
    for (int i = threadIdx.x; i < BBQ; i += BWD_THREADS) {
        if (q0 + i < sq) {
            const int qp = q0 + i + offset;
            const float L = s_lse[i];
            const float sink = variant_sink(params, captures, b, h, qp, true);
            const float p_sink = (sink == bx_neg_inf() || L == bx_neg_inf()) ? 0.0f : expf(sink - L);
            bx_learn_sink(params, captures, -p_sink * s_delta[i], b, h, qp);
        }
    }
}
