// What every module shares: its dispatch's place in the tile loop, the
// staging counts, GQA. (Templates: text, and `@loop(D) { .. }`,
// `@loop(DV) { .. }` and `@loop(D, DV) { .. } { .. }`, the loops over the
// head dims that `template::render` writes rolled or unrolled.)
//@@ common

// ---- shared ----
fn is_first() -> bool {
    return (shape.flags & FIRST) != 0u;
}
fn is_last() -> bool {
    return (shape.flags & LAST) != 0u;
}

// Elements each invocation copies when the workgroup stages a tile: BKV
// K rows, BKV V rows, BQ Q rows, BQ dO rows.
const N_K: u32 = (BKV * D + WG - 1u) / WG;
const N_V: u32 = (BKV * DV + WG - 1u) / WG;
const N_Q: u32 = (BQ * D + WG - 1u) / WG;
const N_O: u32 = (BQ * DV + WG - 1u) / WG;

fn gqa_group() -> u32 {
    return max(shape.heads_q / max(shape.heads_kv, 1u), 1u);
}
