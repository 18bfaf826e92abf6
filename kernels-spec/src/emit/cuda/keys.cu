// Where key j of sequence b lives, for every kernel: the one place a key
// layout is written (in place, a cache's slots, pages; fp8 scales).
//@@ keys

// ---- keys: where key j of sequence b lives ----
// The keys of sequence b: its KV cache length (arena word kv_lens + b, at
// most seq_k; its spare slots are never read), or seq_k without a cache
// (kv_lens < 0).
__device__ __forceinline__ int bx_seq_keys(const unsigned* __restrict__ captures, int kv_lens, int b, int seq_k) {
    return kv_lens < 0 ? seq_k : min((int)captures[kv_lens + b], seq_k);
}

// The query rows of sequence b: a padded batch's (arena word q_lens + b, at
// most seq_q; its rows from there on see nothing, and its row i sits at
// position i + keys − rows), or seq_q without one (q_lens < 0).
__device__ __forceinline__ int bx_seq_queries(const unsigned* __restrict__ captures, int q_lens, int b,
                                              int seq_q) {
    return q_lens < 0 ? seq_q : min((int)captures[q_lens + b], seq_q);
}

// The keys of (batch b, kv head hk) as a launch lays them out: in place,
// k [B, Hkv, Sk, D] and v [B, Hkv, Sk, DV]; or, with page_size > 0, in
// pages, k [pages, Hkv, page_size, D] and v [.., DV], logical key j in
// slot j % page_size of page captures[table + j / page_size] (the
// sequence's row of the [B, max_pages] page table at arena word
// kv_pages).
struct BxKeys {
    const unsigned* __restrict__ captures;
    unsigned table;
    int page_size;
    int heads_kv;
    int hk;
    size_t head_row0; // in place: the head's first row
};

__device__ __forceinline__ BxKeys bx_keys(const unsigned* __restrict__ captures, int kv_pages, int page_size,
                                          int max_pages, int heads_kv, int seq_k, int b, int hk) {
    BxKeys keys;
    keys.captures = captures;
    keys.table = (unsigned)kv_pages + (unsigned)b * (unsigned)max_pages;
    keys.page_size = page_size;
    keys.heads_kv = heads_kv;
    keys.hk = hk;
    keys.head_row0 = ((size_t)b * heads_kv + hk) * (size_t)seq_k;
    return keys;
}

// The row of key j in k (times D) and in v (times DV).
__device__ __forceinline__ size_t bx_key_row(const BxKeys& keys, int j) {
    if (keys.page_size == 0) return keys.head_row0 + (size_t)j;
    const size_t page = keys.captures[keys.table + (unsigned)(j / keys.page_size)];
    return (page * keys.heads_kv + keys.hk) * (size_t)keys.page_size + (size_t)(j % keys.page_size);
}

// Where key j's fp8 scales are in k_scale and v_scale: its kv head's
// ([Hkv], keys in place), or its page's ([pages, Hkv], page · Hkv + hk).
__device__ __forceinline__ size_t bx_key_scale(const BxKeys& keys, int j) {
    if (keys.page_size == 0) return (size_t)keys.hk;
    return (size_t)keys.captures[keys.table + (unsigned)(j / keys.page_size)] * keys.heads_kv + keys.hk;
}

// Key rows k0 .. k0 + ROWS of src (k or v) into a tile, as bx_load_rows
// loads a contiguous block: a row lies in one page, so rows are staged in
// whole chunks; zeros past rows_valid (whose rows are never located).
template <int ROWS, int NT, typename R, typename S>
__device__ __forceinline__ void bx_load_keys(elem_t* dst, const S* __restrict__ src, const BxKeys& keys, int k0,
                                             int rows_valid) {
    bx_stage_rows<ROWS, NT, R>(dst, src, rows_valid, [&](int r) { return bx_key_row(keys, k0 + r); });
}
