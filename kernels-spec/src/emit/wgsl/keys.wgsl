// Where key r of sequence b lives, for every kernel: the one place a key
// layout is written (in place, a cache's slots, pages).
//@@ keys

// ---- keys: where key r of sequence b lives ----
// The keys of sequence b: its KV cache length (arena word shape.kv_lens + b,
// at most Sk), or Sk without a cache.
fn seq_keys(b: u32) -> u32 {
    if shape.kv_lens == NO_WORD { return shape.seq_k; }
    return min(atomicLoad(&captures[shape.kv_lens + b]), shape.seq_k);
}

// The query rows of sequence b: a padded batch's (arena word shape.q_lens +
// b, at most Sq; its rows from there on see nothing, and its row i sits at
// position i + keys − rows), or Sq without one.
fn seq_queries(b: u32) -> u32 {
    if shape.q_lens == NO_WORD { return shape.seq_q; }
    return min(atomicLoad(&captures[shape.q_lens + b]), shape.seq_q);
}

// The row of k and v (times D and DV: the element offsets) of key r of
// (b, h_kv): contiguous [B, Hkv, Sk, ·], or with pages (page_size > 0) slot
// r % page_size of page pages[b * max_pages + r / page_size] in
// [pages, Hkv, page_size, ·].
fn key_row(b: u32, h_kv: u32, r: u32) -> u32 {
    if shape.page_size == 0u { return (b * shape.heads_kv + h_kv) * shape.seq_k + r; }
    let page = atomicLoad(&captures[shape.kv_pages + b * shape.max_pages + r / shape.page_size]);
    return (page * shape.heads_kv + h_kv) * shape.page_size + r % shape.page_size;
}
//@@ stage_kv

// K and V rows k0 .. k0 + BKV of kv head h_kv of sequence b (zeros from its
// sk keys on: a cache's spare slots are never read).
var<workgroup> k_tile: array<f32, BKV * D>;
var<workgroup> v_tile: array<f32, BKV * DV>;

fn stage_kv(lid: u32, b: u32, h_kv: u32, k0: u32, sk: u32) {
    for (var t = 0u; t < N_K; t++) {
        let e = lid + t * WG;
        if e < BKV * D {
            let r = k0 + e / D;
            var x = 0.0f;
            if r < sk { x = k[key_row(b, h_kv, r) * D + e % D]; }
            k_tile[e] = x;
        }
    }
    for (var t = 0u; t < N_V; t++) {
        let e = lid + t * WG;
        if e < BKV * DV {
            let r = k0 + e / DV;
            var y = 0.0f;
            if r < sk { y = v[key_row(b, h_kv, r) * DV + e % DV]; }
            v_tile[e] = y;
        }
    }
}
