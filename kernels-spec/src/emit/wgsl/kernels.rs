//! The attention kernels: one [`Module`] description each (bindings, entry
//! points, launch geometry) and its templates, WGSL text around the lowered
//! variant functions. The templates live in `.wgsl` files beside this one,
//! a section each ([`crate::emit::source`]; `@loop` forms in
//! [`super::template`]), split by job: `common.wgsl`, `keys.wgsl` (where a
//! key lives), `weights.wgsl` (the row normalisation), `forward.wgsl`,
//! `decode.wgsl` (the split-KV merge), `backward.wgsl`, `summary.wgsl`. Each template uses only the WGSL constants `D`, `DV`,
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
use super::{FLAG_FIRST, FLAG_LAST, Wgsl, WgslTiles};
use crate::emit::gpu::tile_class_constants;
use crate::emit::interface::{Access, Buffer, Dim, Extent, NO_WORD, concat};
use crate::emit::source::section;

/// The helpers every module shares (`common.wgsl`).
const COMMON_WGSL: &str = include_str!("common.wgsl");
/// Where each key lives, and the key/value staging (`keys.wgsl`).
const KEYS_WGSL: &str = include_str!("keys.wgsl");
/// The row normalisation around the `weights_*` functions
/// (`weights.wgsl`).
const WEIGHTS_WGSL: &str = include_str!("weights.wgsl");
/// The forward (`forward.wgsl`).
const FORWARD_WGSL: &str = include_str!("forward.wgsl");
/// The split-KV merge (`decode.wgsl`).
const DECODE_WGSL: &str = include_str!("decode.wgsl");
/// The backward's modules (`backward.wgsl`).
const BACKWARD_WGSL: &str = include_str!("backward.wgsl");

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

/// Helpers shared by all kernels: the dispatch range, the staging counts,
/// GQA.
pub const COMMON: &str = section(COMMON_WGSL, "common");

/// Where a key row lives (a contiguous `[B, Hkv, Sk, D]`, a KV cache with
/// per-sequence lengths, or pages): `seq_keys`, `key_row`.
const KEYS: &str = section(KEYS_WGSL, "keys");

/// The key/value staging shared by the forward, `D_i` and dQ kernels.
const STAGE_KV: &str = section(KEYS_WGSL, "stage_kv");

/// A pair's weight in `P·V` (`pair_weight`).
const WEIGHTS_FORWARD: &str = section(WEIGHTS_WGSL, "forward");

/// A visible pair's weight in the backward (`pair_prob`).
const WEIGHTS_BACKWARD: &str = section(WEIGHTS_WGSL, "backward");

// The code of `FORWARD`.
const FORWARD_CODE: &str = section(FORWARD_WGSL, "forward");

// The code of `MERGE`.
const MERGE_CODE: &str = section(DECODE_WGSL, "merge");

// What `BACKWARD_DQ` and `BACKWARD_TENSORS` share: the query tile and row,
// and the terms of one (query row, staged key) pair.
const QUERY_ROWS: &str = section(BACKWARD_WGSL, "query_rows");

// The code of `BACKWARD_DQ`'s entry points.
const DQ_CODE: &str = section(BACKWARD_WGSL, "dq");

// The code of `BACKWARD_DKDV`.
const DKDV_CODE: &str = section(BACKWARD_WGSL, "dkdv");

// The code of `BACKWARD_TENSORS`.
const TENSORS_CODE: &str = section(BACKWARD_WGSL, "tensors");

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
/// of each row; `stats` ends with each row's largest score (the sink
/// apart) in component `z`.
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
    templates: &[FORWARD_CODE, WEIGHTS_FORWARD, KEYS, STAGE_KV],
};

/// The split-KV forward's merge, `attn_merge`, after [`FORWARD`] with
/// `splits` > 1: one invocation per query row (packed as the forward packs
/// them) combines the splits' outputs by their lse, in split order, and
/// leaves the row's largest score over every split in split 0's `stats`.
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
        Binding::Storage(Buffer::Stats, Access::ReadWrite),
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

/// The bindings every backward module starts with: the blocks, then the
/// tensors each of them reads.
const BACKWARD_READS: &[Binding] = &[
    Binding::Params,
    Binding::Shape,
    Binding::Captures,
    Binding::Storage(Buffer::Q, Access::Read),
    Binding::Storage(Buffer::K, Access::Read),
    Binding::Storage(Buffer::V, Access::Read),
    Binding::Storage(Buffer::Dout, Access::Read),
];

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
/// tiles. `rows` holds per query row `dlse` in `z` on entry (zero where
/// the loss does not read lse), the two sums between dispatches, then lse
/// and `D_i − dlse_i` for the dK/dV kernel; `dq` holds the unscaled
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
    bindings: &concat::<_, 10>(&[
        BACKWARD_READS,
        &[
            Binding::Storage(Buffer::Lse, Access::Read),
            Binding::Storage(Buffer::Rows, Access::ReadWrite),
            Binding::Storage(Buffer::Dq, Access::ReadWrite),
        ],
    ]),
    entries: &[
        over_key_tiles("attn_bwd_delta"),
        over_key_tiles("attn_bwd_dq"),
    ],
    templates: &[QUERY_ROWS, WEIGHTS_BACKWARD, DQ_CODE, KEYS, STAGE_KV],
};

/// The backward's second module, `attn_bwd_dkdv`: one workgroup per (WG key rows, b·Hkv + h_kv),
/// one invocation per key row, summing over every query head of its GQA
/// group (no float atomics in WGSL), dispatched per range of the (GQA head,
/// query tile) pairs, flattened. Reads lse and `D_i` from `rows`, which
/// `attn_bwd_delta` wrote;
/// between dispatches `dk`, `dv` hold the accumulators (`dk` unscaled).
pub const BACKWARD_DKDV: Module = Module {
    name: "bwd_dkdv",
    bindings: &concat::<_, 10>(&[
        BACKWARD_READS,
        &[
            Binding::Storage(Buffer::Rows, Access::Read),
            Binding::Storage(Buffer::Dk, Access::ReadWrite),
            Binding::Storage(Buffer::Dv, Access::ReadWrite),
        ],
    ]),
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
    templates: &[WEIGHTS_BACKWARD, DKDV_CODE, KEYS],
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
    bindings: &concat::<_, 9>(&[
        BACKWARD_READS,
        &[
            Binding::Storage(Buffer::Lse, Access::Read),
            Binding::Storage(Buffer::Rows, Access::Read),
        ],
    ]),
    entries: &[over_key_tiles("attn_bwd_tensors")],
    templates: &[QUERY_ROWS, WEIGHTS_BACKWARD, TENSORS_CODE, KEYS, STAGE_KV],
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
pub const SUMMARY_SOURCE: &str = include_str!("summary.wgsl");

/// Invocations per workgroup of [`APPEND_SOURCE`].
pub const APPEND_WORKGROUP: u32 = 64;

/// The cache writer `append_kv` (f32, as every wgpu tensor): element `e`
/// of the new rows' pairs, `gid.x + gid.y · x · APPEND_WORKGROUP`, copied
/// from its source row to its destination row of the cache.
pub const APPEND_SOURCE: &str = include_str!("append.wgsl");
