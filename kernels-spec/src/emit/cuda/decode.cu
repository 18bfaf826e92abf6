// Split-KV decode: the merge of the splits' partial rows.
//@@ boostr_attn_fwd_merge
    const long long rows = (long long)batch * heads_q * seq_q;
    const long long row = (long long)blockIdx.x * (DELTA_THREADS / 32) + (threadIdx.x >> 5);
    if (row >= rows) return; // whole warps leave together
    const int lane = threadIdx.x & 31;
    const int n = splits > 1 ? splits : 1;
    // out = Σ_s out_s·w_s · weights_scale(Σ_s w_s), w_s = weights_merge(lse_s, m)
    // (a softmax: e^(lse_s − m), m the largest lse), lse = weights_lse(m, Σ_s w_s),
    // in split order (the same bits on every run). A split that sees nothing
    // has out 0 (and, a softmax, lse -inf: weight 0).
    float m = bx_neg_inf();
    for (int s = 0; s < n; ++s) m = fmaxf(m, split_lse[(size_t)s * rows + row]);
    float l = 0.0f;
    for (int s = 0; s < n; ++s) l += weights_merge(split_lse[(size_t)s * rows + row], m);
    const float inv = weights_scale(l);
    for (int d = lane; d < DV; d += 32) {
        float acc = 0.0f;
        for (int s = 0; s < n; ++s) {
            const size_t at = (size_t)s * rows + row;
            acc = fmaf(weights_merge(split_lse[at], m), split_out[at * DV + d], acc);
        }
        bx_put(out + (size_t)row * DV + d, acc * inv);
    }
    if (lane == 0) lse[row] = weights_lse(m, l);
    // The row's largest score over every split, into split 0's.
    if (lane == 0 && max_scores) {
        float top = bx_neg_inf();
        for (int s = 0; s < n; ++s) top = fmaxf(top, max_scores[(size_t)s * rows + row]);
        max_scores[row] = top;
    }
}
