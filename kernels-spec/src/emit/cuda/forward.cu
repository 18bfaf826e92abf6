// The forward module: its preamble, then each kernel's body; the
// signatures are written from the descriptions in `kernels.rs`.
//@@ preamble

// ---- forward (FlashAttention-2 schedule) ----
//@@ boostr_attn_fwd
    extern __shared__ __align__(16) unsigned char bx_smem[];
    elem_t* sQ = reinterpret_cast<elem_t*>(bx_smem + FWD_Q);
    elem_t* sK = reinterpret_cast<elem_t*>(bx_smem + FWD_K);
    elem_t* sV = reinterpret_cast<elem_t*>(bx_smem + FWD_V);
    float* sS = reinterpret_cast<float*>(bx_smem + FWD_S);
#if BX_MMA
    elem_t* sP = reinterpret_cast<elem_t*>(bx_smem + FWD_P);
    constexpr int LDPA = FWD_LDP;
#else
    elem_t* sP = sS; // f32: P is read from the score tile itself
    constexpr int LDPA = FWD_LDS;
#endif
    float* row_m = reinterpret_cast<float*>(bx_smem + FWD_ROW_M);
    float* row_l = reinterpret_cast<float*>(bx_smem + FWD_ROW_L);
    float* row_a = reinterpret_cast<float*>(bx_smem + FWD_ROW_A);
    float* row_x = reinterpret_cast<float*>(bx_smem + FWD_ROW_X);
    int* s_seen = reinterpret_cast<int*>(bx_smem + FWD_SEEN);
#if BX_KV_BYTES
    float* s_kf = reinterpret_cast<float*>(bx_smem + FWD_KF); // per key: K scale · KV_UNIT
    float* s_vf = reinterpret_cast<float*>(bx_smem + FWD_VF); // per key: V scale / v_ref
#else
    const float* s_vf = nullptr;
#endif

    // The block's rows: packed row r is row r % seq_q of query head
    // hk·g + r / seq_q (the kv head's whole GQA group, so one pass over its
    // keys serves every query head of it), rows r0 .. r0 + BQ. With
    // n_split > 1, split `split` covers its share of the key tiles.
    const int g = bx_group(heads_q, heads_kv);
    const int n_split = splits > 1 ? splits : 1;
    const int split = (int)(blockIdx.x % (unsigned)n_split);
    const int r0 = (int)(blockIdx.x / (unsigned)n_split) * BQ;
    const int hk = blockIdx.y;
    const int b = blockIdx.z;
    const int packed = g * seq_q;
    const int sk = bx_seq_keys(captures, kv_lens, b, seq_k); // rows aligned to them
    const int sq = bx_seq_queries(captures, q_lens, b, seq_q); // rows past them see nothing
    const int offset = sk - sq;
    const size_t q_row0 = ((size_t)b * heads_q + (size_t)hk * g) * (size_t)seq_q + r0;
    const BxKeys keys = bx_keys(captures, kv_pages, page_size, max_pages, heads_kv, seq_k, b, hk);
#if BX_KV_BYTES
    // The V scale of the sequence's first key: P's columns carry each key's
    // V scale relative to it (1 where they are equal: P keeps its range in
    // f16), the output the rest. Not read without keys.
    const float v_ref = sk > 0 ? v_scale[bx_key_scale(keys, 0)] : 1.0f;
    const float out_factor = v_ref * KV_UNIT;
#else
    const float out_factor = 1.0f;
#endif

    bx_load_rows<BQ, FWD_THREADS, BxRowD>(sQ, q + q_row0 * D, packed - r0);
    // The sink is one more logit with no value: the running max and sum of
    // split 0 start from it (-inf and 0 without one).
    for (int i = threadIdx.x; i < BQ; i += FWD_THREADS) {
        const int r = r0 + i;
        const float sink = split == 0 && r < packed && r % seq_q < sq
            ? variant_sink(params, captures, b, hk * g + r / seq_q, r % seq_q + offset, true)
            : bx_neg_inf();
        row_m[i] = sink;
        row_l[i] = weights_start(sink);
        row_x[i] = bx_neg_inf(); // the largest score, the sink apart
    }
    BxAcc<BQ, FWD_THREADS, BxRowDV> acc; // out, DV wide
    acc.zero();

    // The query heads and positions the block's rows span.
    const int r_hi = min(r0 + BQ, packed) - 1;
    const int h_lo = hk * g + r0 / seq_q;
    const int h_hi = hk * g + r_hi / seq_q;
    // (Of a padded batch's sequence, its own rows: a block of spare rows
    // visits no key tile.)
    const int q_lo = h_lo == h_hi ? r0 % seq_q + offset : offset;
    const int q_hi = min(h_lo == h_hi ? r_hi % seq_q : seq_q - 1, sq - 1) + offset;
    const int n_kt = q_lo <= q_hi ? (sk + BKV - 1) / BKV : 0;
    const int per = (n_kt + n_split - 1) / n_split;
    const int kt_lo = split * per;
    const int kt_hi = min(kt_lo + per, n_kt);
    for (int kt = kt_lo; kt < kt_hi; ++kt) {
        const int k0 = kt * BKV;
        const int kv_hi = min(k0 + BKV, sk) - 1;
        // One class for every head of the block's rows: theirs if they
        // agree, else Partial.
        int cls = variant_classify(params, captures, b, h_lo, q_lo, q_hi, k0, kv_hi);
        for (int hh = h_lo + 1; hh <= h_hi; ++hh)
            if (variant_classify(params, captures, b, hh, q_lo, q_hi, k0, kv_hi) != cls) cls = TILE_PARTIAL;
        if (cls == TILE_EMPTY) continue; // nothing visible (uniform over the block)
        __syncthreads(); // the previous tile's readers of K, V, S, P are done
        bx_load_keys<BKV, FWD_THREADS, BxRowD>(sK, k, keys, k0, sk - k0);
        bx_load_keys<BKV, FWD_THREADS, BxRowDV>(sV, v, keys, k0, sk - k0);
        for (int j = threadIdx.x; j < BKV; j += FWD_THREADS) {
            s_seen[j] = 0;
#if BX_KV_BYTES
            float kf = 0.0f;
            float vf = 0.0f;
            if (k0 + j < sk) {
                const size_t at = bx_key_scale(keys, k0 + j);
                kf = k_scale[at] * KV_UNIT;
                vf = __fdiv_rn(v_scale[at], v_ref);
            }
            s_kf[j] = kf;
            s_vf[j] = vf;
#endif
        }
        __syncthreads();
        bx_dot_tile<BQ, BKV, FWD_LDS, FWD_THREADS, BxRowD>(sQ, sK, sS);
        __syncthreads();
        for (int e = threadIdx.x; e < BQ * BKV; e += FWD_THREADS) {
            const int i = e / BKV;
            const int j = e - i * BKV;
            const int r = r0 + i;
            const int h = hk * g + r / seq_q;
            const int qp = r % seq_q + offset;
            const int kp = k0 + j;
            const bool vis = bx_visible(params, captures, cls, b, h, r < packed && r % seq_q < sq, kp < sk, qp, kp);
            if (vis) s_seen[j] = 1;
#if BX_KV_BYTES
            const float raw = __fmul_rn(sS[i * FWD_LDS + j], s_kf[j]); // the key's K scale
#else
            const float raw = sS[i * FWD_LDS + j];
#endif
            float x;
            sS[i * FWD_LDS + j] = bx_score_at(params, captures, raw, scale, vis, b, h, qp, kp, x);
        }
        __syncthreads();
        if (cls != TILE_FULL) bx_zero_unseen<BKV, FWD_THREADS, BxRowDV>(sV, s_seen); // read after the softmax's barrier
        bx_tile_weights(sS, sP, row_m, row_l, row_a, row_x, s_vf, params, b, hk * g, r0, seq_q, offset, k0);
        __syncthreads();
        acc.scale_rows(row_a);
        acc.template add<BKV, LDPA, 1>(sP, sV);
    }
    __syncthreads();
    // out = acc · weights_scale(l) and its lse (a softmax: acc / l, m +
    // log(l); a row with nothing visible in this split: 0 and -inf). Split
    // s writes rows s·B·Hq·Sq + row of split_out and split_lse (f32), for
    // boostr_attn_fwd_merge; max_scores (where asked for) the same rows.
    const size_t at = n_split > 1 ? (size_t)split * ((size_t)batch * heads_q * seq_q) + q_row0 : q_row0;
    float* lse_dst = n_split > 1 ? split_lse : lse;
    for (int i = threadIdx.x; i < BQ; i += FWD_THREADS) {
        const float l = row_l[i];
        row_a[i] = weights_scale(l);
        if (r0 + i < packed) {
            lse_dst[at + i] = weights_lse(row_m[i], l);
            if (max_scores) max_scores[at + i] = row_x[i];
        }
    }
    __syncthreads();
    if (n_split > 1) {
        acc.store(split_out + at * DV, packed - r0, row_a, out_factor);
    } else {
        acc.store(out + at * DV, packed - r0, row_a, out_factor);
    }
}
