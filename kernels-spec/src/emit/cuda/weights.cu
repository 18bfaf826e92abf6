// The row normalisation as the kernels use it: the template functions
// around the `weights_*` functions that the compiler lowers from the
// variant's weights (kernels_spec::emit::gpu::weights).
//@@ forward

// ---- weights: a tile of scores into weights ----
// One tile of scores becomes weights, one warp per row (the normalisation's
// functions, `weights_*`): each row's running max moves to the tile's, the
// scores become unnormalised weights (in S, and as 16-bit in P on tensor
// cores), the running sum takes them, row_a gets the factor the output
// accumulator is rescaled by and row_x the row's largest score so far. Column j of P (the operand of P·V, never the
// sum) carries its pair's dropout factor and, over an fp8 cache, its key's
// V factor vf[j]. Row i is packed row r0 + i: query head h0 + (r0 + i) /
// seq_q at position (r0 + i) % seq_q + offset; column j is key k0 + j.
__device__ __forceinline__ void bx_tile_weights(float* S, elem_t* P, float* row_m, float* row_l, float* row_a,
                                                float* row_x, const float* vf, const Params& params, int b, int h0,
                                                int r0, int seq_q, int offset, int k0) {
    (void)vf;
    const int lane = threadIdx.x & 31;
    for (int i = threadIdx.x >> 5; i < BQ; i += FWD_THREADS / 32) {
        float* s = S + i * FWD_LDS;
        const int h = h0 + (r0 + i) / seq_q;
        const int qp = (r0 + i) % seq_q + offset;
        float mx = bx_neg_inf();
        for (int j = lane; j < BKV; j += 32) mx = fmaxf(mx, s[j]);
        mx = bx_warp_max(mx);
        const float m_old = row_m[i];
        const float m_new = fmaxf(m_old, mx);
        const float alpha = weights_rescale(m_old, m_new);
        float sum = 0.0f;
        for (int j = lane; j < BKV; j += 32) {
            const float p = weights_pair(s[j], m_new);
            sum += p;
            float pv = p * variant_dropout(params, b, h, qp, k0 + j);
#if BX_KV_BYTES
            pv *= vf[j];
#endif
            s[j] = pv;
            if (BX_MMA) P[i * FWD_LDP + j] = bx_from_f32(pv);
        }
        sum = bx_warp_sum(sum);
        if (lane == 0) {
            row_m[i] = m_new;
            row_l[i] = row_l[i] * alpha + sum;
            row_a[i] = alpha;
            row_x[i] = fmaxf(row_x[i], mx);
        }
    }
}
//@@ backward

// ---- weights: a pair's gradient ----
// d loss / d score of a visible pair (b, h, qp, kp) with score sc in a row
// with lse L and D_i delta, given dp = (dO·Vᵀ) at the pair (the
// normalisation's `weights_prob` and `weights_dz`, the pair's dropout
// factor z on dP). w gets the pair's weight in P·V, P z.
__device__ __forceinline__ float bx_pair_grad(const Params& params, float sc, float L, float dp, float delta, int b,
                                              int h, int qp, int kp, float& w) {
    const float z = variant_dropout(params, b, h, qp, kp);
    const float p = weights_prob(sc, L);
    w = p * z;
    return weights_dz(p, dp * z, delta);
}
