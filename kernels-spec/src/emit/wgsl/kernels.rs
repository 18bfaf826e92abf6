//! The attention kernels: one [`Module`] description each (bindings, entry
//! points, launch geometry) and its templates, WGSL text around the lowered
//! variant functions. Each template uses only the WGSL constants `D`, `DV`,
//! `BQ`, `BKV`, `WG`, the tile classes and the flags that [`header`] writes from a
//! [`WgslTiles`] (sizes derived from them are WGSL `const` expressions
//! inside the templates), and the bindings by the names the description
//! gives them.
//!
//! Layout (all contiguous, f32): `q`, `dq`: `[B, Hq, Sq, D]`; `out`,
//! `dout`: `[B, Hq, Sq, DV]`; `k`, `dk`: `[B, Hkv, Sk, D]`; `v`, `dv`:
//! `[B, Hkv, Sk, DV]`; `lse`: `[B, Hq, Sq]`; the
//! backward's `rows`: `[B, Hq, Sq, 4]` (two running sums, lse, `D_i`). Every
//! module also binds the call's capture arena, `captures` (`u32` words, see
//! [`crate::params`]), which the variant functions read.
//! Query row `i` sits at position `i + Sk - Sq` (bottom-right alignment);
//! query head `h` reads key/value head `h / (Hq / Hkv)`.
//!
//! # Schedule: one row per invocation
//!
//! Each invocation owns one row — a query row in the forward, `D_i` and dQ
//! kernels, a key row in the dK/dV kernel — and keeps that row's vectors
//! (`q`, the output accumulator, ...) in private arrays. The workgroup stages
//! tiles of the *other* side in `var<workgroup>` memory, and every invocation
//! walks the staged rows in the same order. So in every inner product one
//! operand is a private array indexed by the loop counter and the other a
//! workgroup element whose address is the same in every invocation: no
//! invocation-dependent (gathered) workgroup loads in the inner loops, no
//! workgroup reductions, and the online softmax needs no barriers. (On
//! software adapters, which run invocations as SIMD lanes, the uniform load is
//! a broadcast; on GPUs it is a shared-memory broadcast.)
//!
//! Those loads also stay out of per-invocation (divergent) branches: masked
//! pairs and rows past the sequence compute their products anyway and are
//! discarded with `select`. llvmpipe takes its scalar-load fast path only
//! where it knows every lane is active; inside a divergent branch it loads
//! lane by lane, an order of magnitude slower.
//!
//! # Loop budget
//!
//! Mesa llvmpipe (lavapipe) counts every iteration of every loop of an
//! invocation against one limit of 65,535 and then silently leaves the loop.
//! So the loops over tiles run over a range `[tile_begin, tile_end)` from the
//! `shape` uniform, and the runtime may split a kernel into several
//! dispatches over consecutive ranges, bounded by
//! [`WgslTiles::loop_iterations_per_tile`]. Between them the partial state
//! lives in the output buffers, `stats` and `rows`; `flags` says whether a dispatch is
//! the first (start from zero) and the last (finish: normalise, scale).

use super::interface::{Binding, Entry, Module, Size};
use super::template::Piece;
use super::{FLAG_FIRST, FLAG_LAST, Wgsl, WgslTiles};
use crate::emit::gpu::tile_class_constants;
use crate::emit::interface::{Access, Buffer, Dim, Extent, NO_WORD};

/// The constants a template is written against.
pub fn header(cfg: &WgslTiles) -> String {
    let mut s = String::from("// ---- tile configuration ----\n");
    for (name, value, why) in [
        ("D", cfg.head_dim, "query/key head dim"),
        ("DV", cfg.value_dim, "value head dim"),
        ("BQ", cfg.block_q, "query rows staged per tile (dK/dV)"),
        (
            "BKV",
            cfg.block_kv,
            "key rows staged per tile (forward, D_i, dQ)",
        ),
        ("WG", cfg.workgroup_size, "invocations (rows) per workgroup"),
    ] {
        s.push_str(&format!("const {name}: u32 = {value}u; // {why}\n"));
    }
    s.push_str("// ---- tile classes (the classifier's codes) ----\n");
    s.push_str(&tile_class_constants::<Wgsl>());
    s.push_str(&format!(
        "// ---- shape.flags of a dispatch ----\n\
         const FIRST: u32 = {FLAG_FIRST}u; // its range starts the tile loop\n\
         const LAST: u32 = {FLAG_LAST}u; // its range ends it\n\
         const NO_WORD: u32 = {NO_WORD}u; // shape.kv_lens / kv_pages: none\n"
    ));
    s
}

/// Helpers shared by all kernels: the dispatch range, GQA, and where a key
/// row lives (a contiguous `[B, Hkv, Sk, D]`, a KV cache with per-sequence
/// lengths, or pages).
pub const COMMON: &str = r#"
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

// The keys of sequence b: its KV cache length (arena word shape.kv_lens + b,
// at most Sk), or Sk without a cache.
fn seq_keys(b: u32) -> u32 {
    if shape.kv_lens == NO_WORD { return shape.seq_k; }
    return min(atomicLoad(&captures[shape.kv_lens + b]), shape.seq_k);
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
"#;

/// The key/value staging shared by the forward, `D_i` and dQ kernels.
const STAGE_KV: &[Piece] = &[Piece::Text(
    r#"
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
"#,
)];

// The code of `FORWARD`.
const FORWARD_CODE: &[Piece] = &[
    Piece::Text(
        r#"
// ---- forward (FlashAttention-2 online softmax, one query row per invocation) ----
// The class of key tile [k0, kv_hi] for packed rows of query heads h_lo ..= h_hi
// at positions q_lo ..= q_hi: the classes agree, or Partial.
fn rows_class(ib: i32, h_lo: u32, h_hi: u32, q_lo: i32, q_hi: i32, k0: i32, kv_hi: i32) -> i32 {
    var cls = variant_classify(ib, i32(h_lo), q_lo, q_hi, k0, kv_hi);
    for (var hh = h_lo + 1u; hh <= h_hi; hh++) {
        if variant_classify(ib, i32(hh), q_lo, q_hi, k0, kv_hi) != cls { cls = TILE_PARTIAL; }
    }
    return cls;
}

@compute @workgroup_size(WG)
fn attn_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let sq = max(shape.seq_q, 1u);
    let g = gqa_group();
    let splits = max(shape.splits, 1u);
    let split = wid.x % splits;
    let b = wid.y / shape.heads_kv;
    let h_kv = wid.y % shape.heads_kv;
    let sk = seq_keys(b);
    // The workgroup's rows: packed row r is row r % sq of query head
    // h_kv·g + r / sq, so one pass over the kv head's keys serves its group.
    let packed = g * sq;
    let r0 = (wid.x / splits) * WG;
    let r = r0 + lid;
    let live = r < packed;
    let h = h_kv * g + min(r, packed - 1u) / sq;
    let row = min(r, packed - 1u) % sq;
    let flat = (b * shape.heads_q + h_kv * g) * sq + r; // q, lse row
    // Where this split writes: split_out/split_lse rows when split, else out/lse.
    let at = split * (shape.batch * shape.heads_q * sq) + flat;
    let offset = i32(sk) - i32(sq);
    let ib = i32(b);
    let ih = i32(h);
    let qp = i32(row) + offset;

    var qr: array<f32, D>;
    var acc: array<f32, DV>;
    // The sink is one more logit with no value: the running max and sum of
    // split 0 start from it (-inf and 0 without one).
    var m = variant_sink(ib, ih, qp, live);
    if split != 0u { m = -bx_inf(); }
    var l = select(1.0f, 0.0f, bx_is_neg_inf(m));
    "#,
    ),
    Piece::BothDimsLoop(
        r#"
        var x = 0.0f;
        if live { x = q[flat * D + d]; }
        qr[d] = x;
    "#,
        r#"
        var a = 0.0f;
        if live && !is_first() { a = out[at * DV + d]; }
        acc[d] = a;
    "#,
    ),
    Piece::Text(
        r#"
    if live && !is_first() {
        let ml = stats[at];
        m = ml.x;
        l = ml.y;
    }

    // The heads and positions the workgroup's rows span.
    let r_hi = min(r0 + WG, packed) - 1u;
    let h_lo = h_kv * g + r0 / sq;
    let h_hi = h_kv * g + r_hi / sq;
    var q_lo = i32(r0 % sq) + offset;
    var q_hi = i32(r_hi % sq) + offset;
    if h_hi != h_lo {
        q_lo = offset;
        q_hi = i32(sq) - 1i + offset;
    }
    // This split's share of the sequence's key tiles.
    let n_tiles = (sk + BKV - 1u) / BKV;
    let per = (n_tiles + splits - 1u) / splits;
    let t_lo = split * per;
    let t_hi = min(t_lo + per, n_tiles);
    var s_row: array<f32, BKV>;
    for (var kt = t_lo + shape.tile_begin; kt < min(t_lo + shape.tile_end, t_hi); kt++) {
        let k0 = kt * BKV;
        let kv_hi = i32(min(k0 + BKV, sk)) - 1i;
        let cls = rows_class(ib, h_lo, h_hi, q_lo, q_hi, i32(k0), kv_hi);
        if cls == TILE_EMPTY { continue; } // nothing visible
        workgroupBarrier(); // the previous tile's readers are done
        stage_kv(lid, b, h_kv, k0, sk);
        workgroupBarrier();
        var m_new = m;
        for (var j = 0u; j < BKV; j++) {
            let kp = i32(k0 + j);
            var dot = 0.0f;
            "#,
    ),
    Piece::HeadDimLoop(r#" dot += qr[d] * k_tile[j * D + d]; "#),
    Piece::Text(
        r#"
            // FULL tiles skip the mask.
            let seen = live && k0 + j < sk && (cls == TILE_FULL || variant_mask(ib, ih, qp, kp));
            let s = select(-bx_inf(), variant_score(dot * shape.scale, ib, ih, qp, kp, seen), seen);
            s_row[j] = s;
            if s > m_new { m_new = s; }
        }
        // Nothing visible yet: m_new = -inf, and every p and alpha below is 0.
        let m_ref = select(m_new, 0.0f, bx_is_neg_inf(m_new));
        // Sigmoid weights keep no running max: the accumulator is never
        // rescaled.
        let alpha = select(exp(m - m_ref), 1.0f, VARIANT_SIGMOID);
        l *= alpha;
        "#,
    ),
    Piece::ValueDimLoop(r#" acc[d] *= alpha; "#),
    Piece::Text(
        r#"
        if cls == TILE_FULL {
            for (var j = 0u; j < BKV; j++) {
                let p = pair_weight(s_row[j], m_ref, &l, ib, ih, qp, i32(k0 + j));
                "#,
    ),
    Piece::ValueDimLoop(r#" acc[d] += p * v_tile[j * DV + d]; "#),
    Piece::Text(
        r#"
            }
        } else {
            // A key this row does not see has p = 0 and stays out of its
            // sums even where its V row holds NaN or Inf (0·NaN is NaN).
            for (var j = 0u; j < BKV; j++) {
                let p = pair_weight(s_row[j], m_ref, &l, ib, ih, qp, i32(k0 + j));
                "#,
    ),
    Piece::ValueDimLoop(r#" acc[d] += select(0.0f, p * v_tile[j * DV + d], p != 0.0f); "#),
    Piece::Text(
        r#"
            }
        }
        m = m_new;
    }
    if !live { return; }
    if !is_last() {
        "#,
    ),
    Piece::ValueDimLoop(r#" out[at * DV + d] = acc[d]; "#),
    Piece::Text(
        r#"
        stats[at] = vec2<f32>(m, l);
        return;
    }
    // A row with no visible key (in this split): out 0, lse -inf. Sigmoid
    // weights are not normalised, and have no lse (0).
    var inv = 0.0f;
    if l > 0.0f { inv = 1.0f / l; }
    if VARIANT_SIGMOID { inv = 1.0f; }
    "#,
    ),
    Piece::ValueDimLoop(r#" out[at * DV + d] = acc[d] * inv; "#),
    Piece::Text(
        r#"
    var x = -bx_inf();
    if l > 0.0f { x = m + log(l); }
    if VARIANT_SIGMOID { x = 0.0f; }
    lse[at] = x;
}

// The weight in P·V of a pair with score s (-inf where hidden) in a row
// whose running max is m_ref: e^(s - m_ref), added to the row's sum l, or
// sigmoid(s); times the pair's dropout factor (0 or 1/(1 - p)).
fn pair_weight(s: f32, m_ref: f32, l: ptr<function, f32>, ib: i32, ih: i32, qp: i32, kp: i32) -> f32 {
    var p = exp(s - m_ref);
    if VARIANT_SIGMOID { p = select(1.0f / (1.0f + exp(-s)), 0.0f, bx_is_neg_inf(s)); }
    *l += p;
    if VARIANT_DROPOUT { p *= variant_dropout(ib, ih, qp, kp); }
    return p;
}
"#,
    ),
];

// The code of `MERGE`.
const MERGE_CODE: &[Piece] = &[
    Piece::Text(
        r#"
// ---- split-KV merge: out = Σ_s out_s·e^(lse_s − lse), lse = log Σ_s e^(lse_s) ----
@compute @workgroup_size(WG)
fn attn_merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let sq = max(shape.seq_q, 1u);
    let g = gqa_group();
    let b = wid.y / shape.heads_kv;
    let h_kv = wid.y % shape.heads_kv;
    let r = wid.x * WG + lid;
    if r >= g * sq { return; }
    let flat = (b * shape.heads_q + h_kv * g) * sq + r;
    let rows = shape.batch * shape.heads_q * sq;
    let splits = max(shape.splits, 1u);
    var m = -bx_inf();
    for (var s = 0u; s < splits; s++) { m = max(m, split_lse[s * rows + flat]); }
    var acc: array<f32, DV>;
    "#,
    ),
    Piece::ValueDimLoop(r#" acc[d] = 0.0f; "#),
    Piece::Text(
        r#"
    var l = 0.0f;
    // In split order: the same bits run to run. A split that sees nothing
    // has lse -inf (weight 0) and out 0.
    if !bx_is_neg_inf(m) {
        for (var s = 0u; s < splits; s++) {
            let w = exp(split_lse[s * rows + flat] - m);
            let base = (s * rows + flat) * DV;
            l += w;
            "#,
    ),
    Piece::ValueDimLoop(r#" acc[d] += w * split_out[base + d]; "#),
    Piece::Text(
        r#"
        }
    }
    var inv = 0.0f;
    if l > 0.0f { inv = 1.0f / l; }
    "#,
    ),
    Piece::ValueDimLoop(r#" out[flat * DV + d] = acc[d] * inv; "#),
    Piece::Text(
        r#"
    var x = -bx_inf();
    if l > 0.0f { x = m + log(l); }
    lse[flat] = x;
}
"#,
    ),
];

// What `BACKWARD_DQ` and `BACKWARD_TENSORS` share: the query tile and row,
// and the terms of one (query row, staged key) pair.
const QUERY_ROWS: &[Piece] = &[
    Piece::Text(
        r#"
// ---- backward: D_i and dQ (one query row per invocation) ----
// The workgroup's query tile: its (batch, head), kv rows and positions.
struct QueryTile {
    ib: i32,
    ih: i32,
    b: u32,
    h_kv: u32,
    q_lo: i32,
    q_hi: i32,
    sk: u32,        // the sequence's keys (a KV cache's length)
    n_tiles: u32,   // key tiles of BKV rows
}

fn query_tile(wid: vec3<u32>) -> QueryTile {
    let sq = shape.seq_q;
    let b = wid.y / shape.heads_q;
    let sk = seq_keys(b);
    let h = wid.y % shape.heads_q;
    let q0 = wid.x * WG;
    let offset = i32(sk) - i32(sq);
    var t: QueryTile;
    t.ib = i32(b);
    t.ih = i32(h);
    t.b = b;
    t.h_kv = h / gqa_group();
    t.q_lo = i32(q0) + offset;
    t.q_hi = i32(min(q0 + WG, sq)) - 1i + offset;
    t.sk = sk;
    t.n_tiles = (sk + BKV - 1u) / BKV;
    return t;
}

// The class of the key tile at k0 for the query tile.
fn key_tile_class(t: QueryTile, k0: u32) -> i32 {
    let kv_hi = i32(min(k0 + BKV, t.sk)) - 1i;
    return variant_classify(t.ib, t.ih, t.q_lo, t.q_hi, i32(k0), kv_hi);
}

// One query row: its q and dO, lse, and where it sits.
struct QueryRow {
    live: bool,
    row: u32,   // flat index into lse/rows; times D into q/dq, DV into dout
    qp: i32,
    lse: f32,
    sk: u32,    // the sequence's keys
}

fn query_row(wid: vec3<u32>, lid: u32) -> QueryRow {
    let b = wid.y / shape.heads_q;
    let h = wid.y % shape.heads_q;
    let r = wid.x * WG + lid;
    var out: QueryRow;
    out.live = r < shape.seq_q;
    out.row = (b * shape.heads_q + h) * shape.seq_q + r;
    out.sk = seq_keys(b);
    out.qp = i32(r) + i32(out.sk) - i32(shape.seq_q);
    out.lse = -bx_inf();
    if out.live { out.lse = lse[out.row]; }
    return out;
}

// (s, P, dP) of the query row against staged key j: P = 0 for masked pairs,
// keys past Sk, and rows with no visible key.
fn pair_terms(qr: ptr<function, array<f32, D>>, dor: ptr<function, array<f32, DV>>,
              r: QueryRow, j: u32, k0: u32, cls: i32, ib: i32, ih: i32) -> vec3<f32> {
    let kp = i32(k0 + j);
    var dot = 0.0f;
    var dp = 0.0f;
    "#,
    ),
    Piece::BothDimsLoop(
        r#" dot += (*qr)[d] * k_tile[j * D + d]; "#,
        r#" dp += (*dor)[d] * v_tile[j * DV + d]; "#,
    ),
    Piece::Text(
        r#"
    let s = dot * shape.scale;
    let seen = r.live && !bx_is_neg_inf(r.lse) && k0 + j < r.sk
        && (cls == TILE_FULL || variant_mask(ib, ih, r.qp, kp));
    let p = pair_prob(variant_score(s, ib, ih, r.qp, kp, seen), r.lse, seen);
    // dp of a key the row does not see is never used: it may be NaN. With
    // dropout it carries the pair's factor: d loss / d P.
    var z = 1.0f;
    if VARIANT_DROPOUT { z = variant_dropout(ib, ih, r.qp, kp); }
    return vec3<f32>(s, p, select(0.0f, dp * z, p != 0.0f));
}


fn load_row(qr: ptr<function, array<f32, D>>, dor: ptr<function, array<f32, DV>>, r: QueryRow) {
    "#,
    ),
    Piece::BothDimsLoop(
        r#"
        var x = 0.0f;
        if r.live { x = q[r.row * D + d]; }
        (*qr)[d] = x;
    "#,
        r#"
        var y = 0.0f;
        if r.live { y = dout[r.row * DV + d]; }
        (*dor)[d] = y;
    "#,
    ),
    Piece::Text(
        r#"
}
"#,
    ),
];

// The backward's weights of a pair and their derivative, for every
// normalisation.
const PAIR_WEIGHTS: &[Piece] = &[Piece::Text(
    r#"
// The weight of a pair with score sc in a row with lse `lse`, 0 unless
// seen: e^(sc - lse), or sigmoid(sc).
fn pair_prob(sc: f32, lse: f32, seen: bool) -> f32 {
    if VARIANT_SIGMOID { return select(0.0f, 1.0f / (1.0f + exp(-sc)), seen); }
    return select(0.0f, exp(sc - lse), seen);
}

// d loss / d score of a pair with weight p, dpz = d loss / d P (dropout's
// factor included) and its row's D_i: P (dP - D_i), or σ(1 - σ) dP.
fn pair_dz(p: f32, dpz: f32, delta: f32) -> f32 {
    if VARIANT_SIGMOID { return p * (1.0f - p) * dpz; }
    return p * (dpz - delta);
}
"#,
)];

// The code of `BACKWARD_DQ`'s entry points.
const DQ_CODE: &[Piece] = &[
    Piece::Text(
        r#"
@compute @workgroup_size(WG)
fn attn_bwd_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = query_tile(wid);
    let r = query_row(wid, lid);
    var qr: array<f32, D>;
    var dor: array<f32, DV>;
    load_row(&qr, &dor, r);
    var sums = vec2<f32>(0.0f);
    if r.live && !is_first() { sums = rows[r.row].xy; }

    for (var kt = shape.tile_begin; kt < min(shape.tile_end, t.n_tiles); kt++) {
        let k0 = kt * BKV;
        let cls = key_tile_class(t, k0);
        if cls == TILE_EMPTY { continue; }
        workgroupBarrier();
        stage_kv(lid, t.b, t.h_kv, k0, t.sk);
        workgroupBarrier();
        for (var j = 0u; j < BKV; j++) {
            let pt = pair_terms(&qr, &dor, r, j, k0, cls, t.ib, t.ih);
            sums += vec2<f32>(pt.y, pt.y * pt.z);
        }
    }
    if !r.live { return; }
    if !is_last() {
        rows[r.row] = vec4<f32>(sums, 0.0f, 0.0f);
    } else {
        // The sink's probability joins the normalisation (its dP is 0).
        let sink = variant_sink(t.ib, t.ih, r.qp, r.live);
        let p_sink = select(exp(sink - r.lse), 0.0f, bx_is_neg_inf(sink) || bx_is_neg_inf(r.lse));
        var dl = 0.0f;
        if sums.x + p_sink > 0.0f { dl = sums.y / (sums.x + p_sink); }
        rows[r.row] = vec4<f32>(sums, r.lse, dl);
    }
}

@compute @workgroup_size(WG)
fn attn_bwd_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = query_tile(wid);
    let r = query_row(wid, lid);
    var qr: array<f32, D>;
    var dor: array<f32, DV>;
    load_row(&qr, &dor, r);
    var acc: array<f32, D>;
    var delta_i = 0.0f;
    if r.live { delta_i = rows[r.row].w; }
    "#,
    ),
    Piece::HeadDimLoop(
        r#"
        var a = 0.0f;
        if r.live && !is_first() { a = dq[r.row * D + d]; }
        acc[d] = a;
    "#,
    ),
    Piece::Text(
        r#"

    for (var kt = shape.tile_begin; kt < min(shape.tile_end, t.n_tiles); kt++) {
        let k0 = kt * BKV;
        let cls = key_tile_class(t, k0);
        if cls == TILE_EMPTY { continue; }
        workgroupBarrier();
        stage_kv(lid, t.b, t.h_kv, k0, t.sk);
        workgroupBarrier();
        for (var j = 0u; j < BKV; j++) {
            let pt = pair_terms(&qr, &dor, r, j, k0, cls, t.ib, t.ih);
            let g = variant_score_grad(pt.x, t.ib, t.ih, r.qp, i32(k0 + j), pt.y != 0.0f);
            let ds = select(0.0f, pair_dz(pt.y, pt.z, delta_i) * g, pt.y != 0.0f);
            // A key the row does not see stays out even where its K row is
            // NaN or Inf; only a Partial tile has such keys.
            if cls == TILE_FULL {
                "#,
    ),
    Piece::HeadDimLoop(r#" acc[d] += ds * k_tile[j * D + d]; "#),
    Piece::Text(
        r#"
            } else {
                "#,
    ),
    Piece::HeadDimLoop(r#" acc[d] += select(0.0f, ds * k_tile[j * D + d], ds != 0.0f); "#),
    Piece::Text(
        r#"
            }
        }
    }
    if !r.live { return; }
    let f = select(1.0f, shape.scale, is_last());
    "#,
    ),
    Piece::HeadDimLoop(r#" dq[r.row * D + d] = acc[d] * f; "#),
    Piece::Text(
        r#"
}
"#,
    ),
];

// The code of `BACKWARD_DKDV`.
const DKDV_CODE: &[Piece] = &[
    Piece::Text(
        r#"
// ---- backward: dK and dV (one key row per invocation) ----

// Q and dO rows q0 .. q0 + BQ of one query head, their lse and D_i (lse
// -inf past Sq: such rows see nothing), from `rows` (.z lse, .w D_i).
var<workgroup> q_tile: array<f32, BQ * D>;
var<workgroup> do_tile: array<f32, BQ * DV>;
var<workgroup> lse_tile: array<f32, BQ>;
var<workgroup> delta_tile: array<f32, BQ>;

fn stage_q(lid: u32, q_base: u32, q0: u32) {
    for (var t = 0u; t < N_Q; t++) {
        let e = lid + t * WG;
        if e < BQ * D {
            let r = q0 + e / D;
            var x = 0.0f;
            if r < shape.seq_q { x = q[(q_base + r) * D + e % D]; }
            q_tile[e] = x;
        }
    }
    for (var t = 0u; t < N_O; t++) {
        let e = lid + t * WG;
        if e < BQ * DV {
            let r = q0 + e / DV;
            var y = 0.0f;
            if r < shape.seq_q { y = dout[(q_base + r) * DV + e % DV]; }
            do_tile[e] = y;
        }
    }
    for (var i = lid; i < BQ; i += WG) {
        var l = -bx_inf();
        var dl = 0.0f;
        if q0 + i < shape.seq_q {
            let rw = rows[q_base + q0 + i];
            l = rw.z;
            dl = rw.w;
        }
        lse_tile[i] = l;
        delta_tile[i] = dl;
    }
}

@compute @workgroup_size(WG)
fn attn_bwd_dkdv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let sq = shape.seq_q;
    let b = wid.y / shape.heads_kv;
    // Keys from the sequence's length on (a KV cache's spare slots) are
    // never read, and get zero gradients.
    let sk = seq_keys(b);
    let h_kv = wid.y % shape.heads_kv;
    let n_group = gqa_group();
    let k0 = wid.x * WG;
    let col = k0 + lid;
    let live = col < sk;
    let kv_base = (b * shape.heads_kv + h_kv) * shape.seq_k;
    let offset = i32(sk) - i32(sq);
    let ib = i32(b);
    let kp = i32(col);

    var kr: array<f32, D>;
    var vr: array<f32, DV>;
    var dk_acc: array<f32, D>;
    var dv_acc: array<f32, DV>;
    "#,
    ),
    Piece::BothDimsLoop(
        r#"
        var x = 0.0f;
        var a = 0.0f;
        if live {
            x = k[(kv_base + col) * D + d];
            if !is_first() { a = dk[(kv_base + col) * D + d]; }
        }
        kr[d] = x;
        dk_acc[d] = a;
    "#,
        r#"
        var y = 0.0f;
        var c = 0.0f;
        if live {
            y = v[(kv_base + col) * DV + d];
            if !is_first() { c = dv[(kv_base + col) * DV + d]; }
        }
        vr[d] = y;
        dv_acc[d] = c;
    "#,
    ),
    Piece::Text(
        r#"

    let kv_hi = i32(min(k0 + WG, sk)) - 1i;
    let n_tiles = (sq + BQ - 1u) / BQ;
    for (var it = shape.tile_begin; it < min(shape.tile_end, n_group * n_tiles); it++) {
        let h = h_kv * n_group + it / n_tiles;
        let ih = i32(h);
        let q_base = (b * shape.heads_q + h) * sq;
        let q0 = (it % n_tiles) * BQ;
        let q_lo = i32(q0) + offset;
        let q_hi = i32(min(q0 + BQ, sq)) - 1i + offset;
        let cls = variant_classify(ib, ih, q_lo, q_hi, i32(k0), kv_hi);
        if cls == TILE_EMPTY { continue; }
        workgroupBarrier();
        stage_q(lid, q_base, q0);
        workgroupBarrier();
        for (var i = 0u; i < BQ; i++) {
            let lse_i = lse_tile[i];
            let delta_i = delta_tile[i];
            let qp = i32(q0 + i) + offset;
            var dot = 0.0f;
            var dp = 0.0f;
            "#,
    ),
    Piece::BothDimsLoop(
        r#" dot += q_tile[i * D + d] * kr[d]; "#,
        r#" dp += do_tile[i * DV + d] * vr[d]; "#,
    ),
    Piece::Text(
        r#"
            let s = dot * shape.scale;
            let seen = live && !bx_is_neg_inf(lse_i) && (cls == TILE_FULL || variant_mask(ib, ih, qp, kp));
            let p = pair_prob(variant_score(s, ib, ih, qp, kp, seen), lse_i, seen);
            let g = variant_score_grad(s, ib, ih, qp, kp, p != 0.0f);
            var z = 1.0f;
            if VARIANT_DROPOUT { z = variant_dropout(ib, ih, qp, kp); }
            let ds = select(0.0f, pair_dz(p, dp * z, delta_i) * g, p != 0.0f);
            let pz = p * z;
            "#,
    ),
    Piece::BothDimsLoop(
        r#" dk_acc[d] += ds * q_tile[i * D + d]; "#,
        r#" dv_acc[d] += pz * do_tile[i * DV + d]; "#,
    ),
    Piece::Text(
        r#"
        }
    }
    if col >= shape.seq_k { return; }
    let f = select(1.0f, shape.scale, is_last());
    "#,
    ),
    Piece::BothDimsLoop(
        r#" dk[(kv_base + col) * D + d] = dk_acc[d] * f; "#,
        r#" dv[(kv_base + col) * DV + d] = dv_acc[d]; "#,
    ),
    Piece::Text(
        r#"
}
"#,
    ),
];

// The code of `BACKWARD_TENSORS`.
const TENSORS_CODE: &[Piece] = &[Piece::Text(
    r#"
// ---- backward: the gradients of learnable tensors (one query row per invocation) ----
@compute @workgroup_size(WG)
fn attn_bwd_tensors(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = query_tile(wid);
    let r = query_row(wid, lid);
    var qr: array<f32, D>;
    var dor: array<f32, DV>;
    load_row(&qr, &dor, r);
    var delta_i = 0.0f;
    if r.live { delta_i = rows[r.row].w; }

    for (var kt = shape.tile_begin; kt < min(shape.tile_end, t.n_tiles); kt++) {
        let k0 = kt * BKV;
        let cls = key_tile_class(t, k0);
        if cls == TILE_EMPTY { continue; }
        workgroupBarrier();
        stage_kv(lid, t.b, t.h_kv, k0, t.sk);
        workgroupBarrier();
        for (var j = 0u; j < BKV; j++) {
            let pt = pair_terms(&qr, &dor, r, j, k0, cls, t.ib, t.ih);
            // d loss / d score = P (dP - D_i), at the pairs the row sees.
            if pt.y != 0.0f {
                bx_learn_score(pair_dz(pt.y, pt.z, delta_i), pt.x, t.ib, t.ih, r.qp, i32(k0 + j));
            }
        }
    }
    // The sink's share, once per row: d loss / d sink = -P_sink D_i.
    if r.live && is_last() {
        let sink = variant_sink(t.ib, t.ih, r.qp, true);
        let p_sink = select(exp(sink - r.lse), 0.0f, bx_is_neg_inf(sink) || bx_is_neg_inf(r.lse));
        bx_learn_sink(-p_sink * delta_i, t.ib, t.ih, r.qp);
    }
}
"#,
)];

/// The forward module, `attn_fwd`: one workgroup per (WG packed query
/// rows, key split, b·Hkv + h_kv), one invocation per query row,
/// dispatched per range of key tiles. A workgroup's rows are the query
/// rows of the kv head's whole GQA group, packed (`(Hq/Hkv)·Sq` of them;
/// for decode, one workgroup serves every query head of a kv head). With
/// `splits` > 1 the split-KV forward binds `split_out`, `split_lse` (and
/// their stats) as `out`, `lse`, `stats`: split `s` covers its share of
/// each sequence's key tiles and writes rows `s·B·Hq·Sq + row`, which
/// [`MERGE`] combines. Writes `out` and `lse`; between dispatches `out`
/// holds the unnormalised accumulator and `stats` the running (max, sum)
/// of each row.
pub const FORWARD: Module = Module {
    name: "fwd",
    bindings: &[
        Binding::Params,
        Binding::Shape,
        Binding::Captures,
        Binding::Storage(Buffer::Q, Access::Read),
        Binding::Storage(Buffer::K, Access::Read),
        Binding::Storage(Buffer::V, Access::Read),
        Binding::Storage(Buffer::Out, Access::ReadWrite),
        Binding::Storage(Buffer::Lse, Access::ReadWrite),
        Binding::Storage(Buffer::Stats, Access::ReadWrite),
    ],
    entries: &[Entry {
        name: "attn_fwd",
        grid: [
            Extent::Product(&[
                Extent::Tiles(Dim::GroupRows, Size::Workgroup),
                Extent::Dim(Dim::Splits),
            ]),
            Extent::Dim(Dim::BatchHeadsKv),
        ],
        tiles: Extent::PerSplit(&Extent::Tiles(Dim::SeqK, Size::BlockKv)),
    }],
    templates: &[FORWARD_CODE, STAGE_KV],
};

/// The split-KV forward's merge, `attn_merge`, after [`FORWARD`] with
/// `splits` > 1: one invocation per query row (packed as the forward packs
/// them) combines the splits' outputs by their lse, in split order.
pub const MERGE: Module = Module {
    name: "merge",
    bindings: &[
        Binding::Params,
        Binding::Shape,
        Binding::Captures,
        Binding::Storage(Buffer::SplitOut, Access::Read),
        Binding::Storage(Buffer::SplitLse, Access::Read),
        Binding::Storage(Buffer::Out, Access::ReadWrite),
        Binding::Storage(Buffer::Lse, Access::ReadWrite),
    ],
    entries: &[Entry {
        name: "attn_merge",
        grid: [
            Extent::Tiles(Dim::GroupRows, Size::Workgroup),
            Extent::Dim(Dim::BatchHeadsKv),
        ],
        tiles: Extent::One,
    }],
    templates: &[MERGE_CODE],
};

/// An entry point with one invocation per query row (workgroups along x
/// over the rows, along y over (batch, query head)) whose tile loop runs
/// over the key tiles.
const fn over_key_tiles(name: &'static str) -> Entry {
    Entry {
        name,
        grid: [
            Extent::Tiles(Dim::SeqQ, Size::Workgroup),
            Extent::Dim(Dim::BatchHeadsQ),
        ],
        tiles: Extent::Tiles(Dim::SeqK, Size::BlockKv),
    }
}

/// The backward's first module: `attn_bwd_delta` computes
/// `D_i = Σ_j P_ij dP_ij / (Σ_j P_ij + P_sink,i)` from the recomputed `P`
/// (`P_sink = e^(sink − lse)`, 0 without a sink), then
/// `attn_bwd_dq` the dQ rows. Both: one workgroup per (WG query rows,
/// b·Hq + h), one invocation per query row, dispatched per range of key
/// tiles. `rows` holds per query row the two sums (between dispatches),
/// then lse and `D_i` for the dK/dV kernel; `dq` holds the unscaled
/// accumulator between dispatches.
///
/// `D_i` is `rowsum(dO ∘ O)` in exact arithmetic, but taking it from the
/// same recomputed `P` that forms `dS` makes every row of `dS` sum to zero
/// (less the sink's share) in f32 as well. `O` comes from another kernel, whose logits a GPU
/// compiler may round differently (FMA contraction); at logits ~1e4 one
/// ulp is 1e-3, and `Σ_j dS_ij ≠ 0` then leaks into dQ along the mean of
/// the keys. The cost is one more pass of the `QKᵀ` and `dO·Vᵀ` products.
pub const BACKWARD_DQ: Module = Module {
    name: "bwd_dq",
    bindings: &[
        Binding::Params,
        Binding::Shape,
        Binding::Captures,
        Binding::Storage(Buffer::Q, Access::Read),
        Binding::Storage(Buffer::K, Access::Read),
        Binding::Storage(Buffer::V, Access::Read),
        Binding::Storage(Buffer::Dout, Access::Read),
        Binding::Storage(Buffer::Lse, Access::Read),
        Binding::Storage(Buffer::Rows, Access::ReadWrite),
        Binding::Storage(Buffer::Dq, Access::ReadWrite),
    ],
    entries: &[
        over_key_tiles("attn_bwd_delta"),
        over_key_tiles("attn_bwd_dq"),
    ],
    templates: &[QUERY_ROWS, PAIR_WEIGHTS, DQ_CODE, STAGE_KV],
};

/// The backward's second module, `attn_bwd_dkdv`: one workgroup per (WG key rows, b·Hkv + h_kv),
/// one invocation per key row, summing over every query head of its GQA
/// group (no float atomics in WGSL), dispatched per range of the (GQA head,
/// query tile) pairs, flattened. Reads lse and `D_i` from `rows`, which
/// `attn_bwd_delta` wrote;
/// between dispatches `dk`, `dv` hold the accumulators (`dk` unscaled).
pub const BACKWARD_DKDV: Module = Module {
    name: "bwd_dkdv",
    bindings: &[
        Binding::Params,
        Binding::Shape,
        Binding::Captures,
        Binding::Storage(Buffer::Q, Access::Read),
        Binding::Storage(Buffer::K, Access::Read),
        Binding::Storage(Buffer::V, Access::Read),
        Binding::Storage(Buffer::Dout, Access::Read),
        Binding::Storage(Buffer::Rows, Access::Read),
        Binding::Storage(Buffer::Dk, Access::ReadWrite),
        Binding::Storage(Buffer::Dv, Access::ReadWrite),
    ],
    entries: &[Entry {
        name: "attn_bwd_dkdv",
        grid: [
            Extent::Tiles(Dim::SeqK, Size::Workgroup),
            Extent::Dim(Dim::BatchHeadsKv),
        ],
        // (query head of the GQA group, query tile) pairs.
        tiles: Extent::Product(&[
            Extent::Dim(Dim::Group),
            Extent::Tiles(Dim::SeqQ, Size::BlockQ),
        ]),
    }],
    templates: &[PAIR_WEIGHTS, DKDV_CODE],
};

/// The backward's gradients of learnable tensors, `attn_bwd_tensors`, run
/// after [`BACKWARD_DQ`] (it reads `D_i` from `rows`) where a call wants
/// them: one workgroup per (WG query rows, b·Hq + h), one invocation per
/// query row, dispatched per range of key tiles. It recomputes `P` and
/// `dP` of every visible pair and adds `P (dP − D_i) · ∂score/∂read` into
/// the read element's fixed-point accumulator in the capture arena, and
/// once per row `−P_sink D_i · ∂sink/∂read` (see
/// [`crate::params`], "Gradient accumulators": integer atomics, the same
/// bits in any order). The cost: one more pass of the `QKᵀ` and `dO·Vᵀ`
/// products, and one 64-bit add (two atomics) per pair and read.
pub const BACKWARD_TENSORS: Module = Module {
    name: "bwd_tensors",
    bindings: &[
        Binding::Params,
        Binding::Shape,
        Binding::Captures,
        Binding::Storage(Buffer::Q, Access::Read),
        Binding::Storage(Buffer::K, Access::Read),
        Binding::Storage(Buffer::V, Access::Read),
        Binding::Storage(Buffer::Dout, Access::Read),
        Binding::Storage(Buffer::Lse, Access::Read),
        Binding::Storage(Buffer::Rows, Access::Read),
    ],
    entries: &[over_key_tiles("attn_bwd_tensors")],
    templates: &[QUERY_ROWS, PAIR_WEIGHTS, TENSORS_CODE, STAGE_KV],
};

/// The backward's modules, in the order they run.
pub const BACKWARD: [&Module; 2] = [&BACKWARD_DQ, &BACKWARD_DKDV];

/// Invocations per workgroup of [`SUMMARY_SOURCE`].
pub const SUMMARY_WORKGROUP: u32 = 64;

/// The summary kernel `summarize`, one module for every variant: one
/// invocation per entry of one summary ([`SummaryJob`](crate::params::SummaryJob),
/// the uniform `job`), over workgroups `(x, y)` of [`SUMMARY_WORKGROUP`]
/// invocations, entry `gid.x + gid.y · x · SUMMARY_WORKGROUP`. It runs
/// before the attention kernels of a call, on the same arena, so the
/// classifiers read summaries made on the device.
pub const SUMMARY_SOURCE: &str = r#"// ---- the summaries of captured tensors (see kernels_spec::params) ----
struct Job {
    source: u32,
    dest: u32,
    outer: u32,
    len: u32,
    inner: u32,
    blocks: u32,
    entries: u32,
    pad: u32,
}
@group(0) @binding(0) var<uniform> job: Job;
@group(0) @binding(1) var<storage, read_write> arena: array<u32>;

const BLOCK: u32 = 16u; // kernels_spec::params::SUMMARY_BLOCK

@compute @workgroup_size(64)
fn summarize(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>) {
    let e = gid.x + gid.y * n.x * 64u;
    if e >= job.entries { return; }
    let i = e % job.inner;
    let blk = (e / job.inner) % job.blocks;
    let o = e / (job.inner * job.blocks);
    let first = blk * BLOCK;
    let last = min(first + BLOCK, job.len);
    var lo = 2147483647i;
    var hi = -2147483647i - 1i;
    for (var x = first; x < last; x++) {
        let v = bitcast<i32>(arena[job.source + (o * job.len + x) * job.inner + i]);
        lo = min(lo, v);
        hi = max(hi, v);
    }
    arena[job.dest + e] = bitcast<u32>(lo);
    arena[job.dest + job.entries + e] = bitcast<u32>(hi);
}
"#;
