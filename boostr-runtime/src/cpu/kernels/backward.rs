//! The backward kernel: FlashAttention-2 backward on the CPU, parallel over
//! key tiles, with a deterministic dQ.
//!
//! Schedule:
//! 1. `D_i = rowsum(dO_i ∘ O_i)` for every query row (parallel, `O(Sq)` memory).
//! 2. One rayon task per (batch, kv head, chunk of consecutive key tiles).
//!    The task owns its rows of dK and dV outright (no races, no atomics) and
//!    keeps each key/value tile resident while it streams the query tiles of
//!    every query head of the GQA group past it; where those outgrow L2, up
//!    to four key tiles share one such pass (see [`MAX_KV_GROUP`]). Per (key
//!    tile, query tile),
//!    `Empty` tiles are skipped and only `Partial` ones evaluate the mask:
//!    - `S = scale · Q Kᵀ`, `P = e^(score(S) − lse)` (0 where hidden),
//!    - `dV += Pᵀ dO`, `dP = dO Vᵀ`,
//!    - `dS = P ∘ (dP − D) ∘ score_grad(S)`,
//!    - `dK += scale · dSᵀ Q`, `dQ += scale · dS K`;
//!
//!    on a `Partial` tile all of it band by band (16 rows), over only the
//!    chunks of keys that classification does not prove empty for the band
//!    (see `BAND_ROWS`).
//! 3. dQ: the first chunk of each (batch, kv head) accumulates straight into
//!    `dq`, each other chunk into a private partial buffer; the partials are
//!    then added into `dq` in chunk order. The order of every floating-point
//!    sum is therefore fixed by the chunking alone, not by thread scheduling,
//!    and the result is bitwise identical from run to run.
//!
//! 4. Learnable tensors (when their gradients are wanted): every visible
//!    pair adds `dz · ∂score/∂read` (`dz = P ∘ (dP − D)`, from the same tile)
//!    into a partial gradient, and every row adds its sink's
//!    `−e^(sink − lse) · D_i`. The tasks are cut into at most
//!    [`MAX_GRAD_PARTIALS`] contiguous groups, each run in task order into its
//!    own partial; the partials are added in group order, and the sinks' terms
//!    after them in row order. The key chunking is then fixed by the shape
//!    ([`GRAD_CHUNK_THREADS`]), not by the thread count, so every gradient
//!    (dq, dk, dv included) has the same bits for any number of threads.
//!    Memory: `groups · numel` floats per learnable tensor, with `groups ≤
//!    64` and `groups · numel ≤ 2^26` (256 MiB) unless one partial alone is
//!    larger. Reads whose element and derivative depend on the pair only
//!    through `kv − q` sum `dz` along each diagonal of a tile first and are
//!    evaluated once per diagonal. Where only `sink` reads learnable
//!    tensors, the pairs add nothing: the backward runs as without them,
//!    and the row pass alone (in row order, on one thread) gives the
//!    gradients.
//!
//! Memory: the partials hold `(chunks − 1) · group · Sq · D` floats per
//! (batch, kv head), where `chunks ≤ ⌈2 · threads / (B · Hkv)⌉` (see
//! [`key_chunks`]): at most about `2 · threads · group · Sq · D` floats in
//! all, and none when `B · Hkv ≥ 2 · threads`. Plus `D` per query row and
//! per-task tile scratch (the transposes of up to four key tiles and three
//! score-sized tiles); never anything of size `Sq × Sk`.

use crate::cpu::aligned::Aligned;
use crate::cpu::gemm::{self, MatMut, MatRef, Write, matmul};
use crate::cpu::grads::{Probabilities, ScoreGrads, dropped, learnable_terms};
use crate::cpu::math;
use crate::cpu::par::ForEachDyn as _;
use crate::cpu::simd;
use crate::cpu::tile::CpuTiles;
use crate::cpu::{
    Axis, BackwardInputs, Band, L2_BUDGET, Positions, all_finite, band_products, class_bands,
    mean_visits, tile_class, zero_unused_rows,
};
use crate::problem::Problem;
use crate::variant::{HostVariant, TileClass};
use rayon::prelude::*;
use std::marker::PhantomData;
use std::ops::Range;

/// Below this many flops per chunk, splitting the keys further costs more in
/// task overhead and dQ partials (zeroing + reduction) than it gains.
const MIN_CHUNK_FLOPS: usize = 1 << 22;
/// Elements per task of the D and dQ-reduction passes (memory-bound).
const ELEMENTWISE_BLOCK: usize = 1 << 14;

/// The thread count the key chunking assumes when learnable tensors'
/// gradients are computed: fixed, so that the chunking (and with it every
/// sum's order) does not depend on the machine's thread count.
pub(in crate::cpu) const GRAD_CHUNK_THREADS: usize = 8;

/// At most this many partial sums of each learnable tensor's gradient.
const MAX_GRAD_PARTIALS: usize = 64;

/// Floats the partial sums of learnable tensors' gradients may hold (256
/// MiB), unless one partial set alone is larger.
const GRAD_PARTIAL_FLOATS: usize = 1 << 26;

/// How many partial gradients the backward's tasks are grouped into: one
/// per task up to [`MAX_GRAD_PARTIALS`] and the memory budget; a function
/// of the shape only.
fn grad_partials(tasks: usize, floats_per_partial: usize) -> usize {
    let affordable = (GRAD_PARTIAL_FLOATS / floats_per_partial.max(1)).max(1);
    tasks.min(MAX_GRAD_PARTIALS).min(affordable).max(1)
}

/// Key tiles, at most, that share one pass over the query tiles within a
/// task: each query tile (with its dO and dQ rows) visits all of them in
/// turn before the next is loaded.
///
/// Why: one key tile alone streams `group` heads' Q, dO and dQ past it. At
/// S = 4096, D = 128 that is 6 MiB per query head, three times a core's
/// L2, so every key tile fetches them again from the shared L3. Four key
/// tiles per pass fetch them a quarter as often, and need four tiles' K,
/// Kᵀ, Vᵀ, dK and dV resident (640 KiB at D = 128).
///
/// Measured with `bench/ab_cpu.py` (2 threads, Hq = 8, forward+backward;
/// above 1 is faster grouped): full 2048 × 128 1.02 and 1.05 in two runs,
/// full 2048 × 64 at Hkv = 2 1.04, full 4096 × 128 at Hkv = 2 1.11, window
/// 2048 × 128 at Hkv = 2 1.06, causal 4096 × 128 1.01 and 1.06 (Hkv = 8, 2);
/// full 4096 × 128 at Hkv = 8 0.98. Quartiles of most cross 1: a modest gain
/// on this noisy machine, not a large one.
const MAX_KV_GROUP: usize = 4;

/// Key tiles per pass over the query tiles: 1 while a key tile's pass
/// reads at most [`L2_BUDGET`] of Q, dO and dQ, else [`MAX_KV_GROUP`].
pub(in crate::cpu) fn kv_group_size<V: HostVariant>(
    variant: &V,
    p: &Problem,
    tiles: CpuTiles,
) -> usize {
    let q_tile_bytes = tiles.q * (2 * p.head_dim + p.head_dim_v) * std::mem::size_of::<f32>();
    let bytes = mean_visits(variant, p, tiles, Axis::Key) * (p.group() * q_tile_bytes) as f64;
    if bytes <= L2_BUDGET as f64 {
        1
    } else {
        MAX_KV_GROUP
    }
}

/// How many chunks to cut each (batch, kv head)'s key tiles into.
///
/// Enough tasks that every thread is busy even for `B = Hkv = 1`, with a 2×
/// margin because chunks are uneven under causal-like masks (early keys are
/// seen by more queries); but no chunk smaller than one key tile or than
/// [`MIN_CHUNK_FLOPS`] of work, since each extra chunk costs a dQ partial.
pub(in crate::cpu) fn key_chunks(p: &Problem, tiles: CpuTiles, threads: usize) -> usize {
    let key_tiles = p.seq_k.div_ceil(tiles.kv);
    let heads = p.batch * p.heads_kv;
    let wanted = (2 * threads.max(1)).div_ceil(heads);
    // Five GEMMs of 2 flops per (query, key, dim) each: three over D
    // (S, dK, dQ), two over Dv (dV, dP).
    let flops = 2 * p.group() * p.seq_q * p.seq_k * (3 * p.head_dim + 2 * p.head_dim_v);
    let affordable = (flops / MIN_CHUNK_FLOPS).max(1);
    wanted.min(key_tiles).min(affordable).max(1)
}

/// One task: the keys `key0 .. key0 + dk.len()/D` of one (batch, kv head).
pub(in crate::cpu) struct KeyChunk<'a> {
    pub(in crate::cpu) b: usize,
    pub(in crate::cpu) kvh: usize,
    pub(in crate::cpu) key0: usize,
    pub(in crate::cpu) dk: &'a mut [f32],
    pub(in crate::cpu) dv: &'a mut [f32],
    /// dQ `[group, Sq, D]` of the group's query heads: the real `dq` for the
    /// first chunk, a private partial for the others.
    pub(in crate::cpu) dq: &'a mut [f32],
}

/// Per-task scratch: the resident K/V tiles transposed, and three
/// `Bq × Bk` work tiles.
struct Scratch {
    /// Kᵀ and Vᵀ of the current key tiles, `D × Bk` each: transposed once
    /// per key tile so that the products `S = Q Kᵀ` and `dP = dO Vᵀ` stream
    /// contiguous rows, instead of transposing them for every query tile.
    kt: Aligned<f32>,
    vt: Aligned<f32>,
    work: Work,
}

/// The `Bq × Bk` tiles of one (query tile × key tile) step.
struct Work {
    /// Scaled logits, then probabilities P.
    s: Aligned<f32>,
    /// dP, then dS.
    dp: Aligned<f32>,
    /// With dropout, `P · Z/(1 − p)`: the weights `P V` used (empty
    /// without dropout).
    pd: Aligned<f32>,
    /// `score_grad` of the logits (empty where it is 1).
    g: Aligned<f32>,
    /// The tile's bands (see [`class_bands`]).
    bands: Vec<Band>,
    /// A band's K rows with the unused ones zeroed (see
    /// [`zero_unused_rows`]).
    k_guarded: Vec<f32>,
    /// The scaled logits before `score`, kept for the derivatives of
    /// learnable reads (empty without them, or where they go by diagonal).
    raw: Vec<f32>,
    /// Per diagonal of a tile, the sum of its pairs' `dz` (learnable reads
    /// by position difference only).
    diag: Vec<f32>,
}

impl Scratch {
    fn new<V: HostVariant>(
        t: CpuTiles,
        (d, dv): (usize, usize),
        kv_group: usize,
        learn: bool,
    ) -> Self {
        let g = if V::SCORE_GRAD_IS_ONE { 0 } else { t.q * t.kv };
        let work = Work {
            s: Aligned::zeroed(t.q * t.kv),
            dp: Aligned::zeroed(t.q * t.kv),
            pd: Aligned::zeroed(if V::WEIGHTS.dropout { t.q * t.kv } else { 0 }),
            g: Aligned::zeroed(g),
            bands: Vec::with_capacity(t.q.div_ceil(crate::cpu::BAND_ROWS)),
            k_guarded: Vec::new(),
            raw: if learn && V::SCORE_READS_LEARNABLE && !V::SCORE_GRADS_BY_DIFFERENCE {
                vec![0.0; t.q * t.kv]
            } else {
                Vec::new()
            },
            diag: if learn && V::SCORE_GRADS_BY_DIFFERENCE {
                vec![0.0; t.q + t.kv]
            } else {
                Vec::new()
            },
        };
        Self {
            kt: Aligned::zeroed(kv_group * d * t.kv),
            vt: Aligned::zeroed(kv_group * dv * t.kv),
            work,
        }
    }
}

/// A task's resident key tile: its K rows (`cols × D`), Kᵀ (`D × cols`)
/// and Vᵀ (`Dv × cols`), and its rows of dK (`cols × D`) and dV (`cols ×
/// Dv`).
struct KvTile<'a> {
    kv0: usize,
    cols: usize,
    k: &'a [f32],
    /// K holds a NaN or an infinity (see [`zero_unused_rows`]).
    k_nonfinite: bool,
    kt: &'a [f32],
    vt: &'a [f32],
    dk: &'a mut [f32],
    dv: &'a mut [f32],
}

/// Everything a task reads.
struct Shared<'a, V> {
    variant: &'a V,
    p: &'a Problem,
    tiles: CpuTiles,
    /// Key tiles per pass over the query tiles (see [`MAX_KV_GROUP`]).
    kv_group: usize,
    pos: Positions,
    x: BackwardInputs<'a>,
    /// `D_i = rowsum(dO_i ∘ O_i) − dlse_i`, `[B, Hq, Sq]`.
    delta: &'a [f32],
}

#[allow(clippy::too_many_arguments)]
pub(in crate::cpu) fn backward<V: HostVariant>(
    variant: &V,
    p: &Problem,
    tiles: CpuTiles,
    chunks: usize,
    kv_group: usize,
    x: BackwardInputs<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    tensor_grads: &mut [Vec<f32>],
) {
    let dims = (p.head_dim, p.head_dim_v);
    let learn = tensor_grads.iter().any(|g| !g.is_empty());

    let delta = deltas((x.dout, x.out, x.dlse), p.head_dim_v, math::dot);
    let (chunk_keys, chunks) = chunk_keys(p, tiles, chunks);
    let mut partials = dq_partials(p, chunks);
    let tasks = carve(p, chunk_keys, dq, dk, dv, &mut partials);

    let shared = Shared {
        variant,
        p,
        tiles,
        kv_group,
        pos: Positions::new(p),
        x,
        delta: &delta,
    };
    if learn && V::SCORE_READS_LEARNABLE {
        learnable_tasks(
            tasks,
            tensor_grads,
            &|| Scratch::new::<V>(tiles, dims, kv_group, true),
            &|task, sc, grads| key_chunk(&shared, task, sc, grads),
        );
    } else {
        tasks.into_par_iter().for_each_init_dyn(
            &|| Scratch::new::<V>(tiles, dims, kv_group, false),
            &|sc, task| key_chunk(&shared, task, sc, &mut []),
        );
    }
    if V::WEIGHTS.sink {
        sinks(variant, p, x.lse, &delta, tensor_grads);
    }

    add_partials(p, chunks, dq, &partials);
}

/// `D_i = rowsum(dO_i ∘ O_i) − dlse_i` for every row of `d` (the value
/// head dim; `dot` reads the elements as stored; no `dlse`: zero).
pub(in crate::cpu) fn deltas<E: Sync>(
    (dout, out, dlse): (&[E], &[E], Option<&[f32]>),
    d: usize,
    dot: fn(&[E], &[E]) -> f32,
) -> Aligned<f32> {
    // Every element is written below.
    let mut delta = Aligned::scratch(out.len() / d.max(1));
    delta
        .par_chunks_mut(ELEMENTWISE_BLOCK)
        .enumerate()
        .for_each(|(c, block)| {
            for (i, di) in block.iter_mut().enumerate() {
                let row = c * ELEMENTWISE_BLOCK + i;
                let r = row * d;
                *di = dot(&dout[r..r + d], &out[r..r + d]) - dlse.map_or(0.0, |g| g[row]);
            }
        });
    delta
}

/// Keys per chunk (whole key tiles), and the chunk count after rounding the
/// chunk size up.
pub(in crate::cpu) fn chunk_keys(p: &Problem, tiles: CpuTiles, chunks: usize) -> (usize, usize) {
    let key_tiles = p.seq_k.div_ceil(tiles.kv);
    let chunk_keys = key_tiles.div_ceil(chunks.clamp(1, key_tiles)) * tiles.kv;
    (chunk_keys, p.seq_k.div_ceil(chunk_keys))
}

/// The dQ partial sums of every (batch, kv head)'s chunks after its first.
pub(in crate::cpu) fn dq_partials(p: &Problem, chunks: usize) -> Aligned<f32> {
    // Each partial goes to one task, which zeroes it first (`key_chunk`).
    Aligned::scratch(p.batch * p.heads_kv * (chunks - 1) * p.group() * p.seq_q * p.head_dim)
}

/// The outputs carved into disjoint per-task slices, in (b, kv head,
/// chunk) order; partial `c ≥ 1` of head `bg` is `partials[bg][c - 1]`.
pub(in crate::cpu) fn carve<'a>(
    p: &Problem,
    chunk_keys: usize,
    dq: &'a mut [f32],
    dk: &'a mut [f32],
    dv: &'a mut [f32],
    partials: &'a mut [f32],
) -> Vec<KeyChunk<'a>> {
    let (sk, d, d_v) = (p.seq_k, p.head_dim, p.head_dim_v);
    let dq_group = p.group() * p.seq_q * d;
    let mut partial_slots = partials.chunks_mut(dq_group.max(1));
    let mut tasks = Vec::with_capacity(p.batch * p.heads_kv * sk.div_ceil(chunk_keys));
    let per_head = dk
        .chunks_mut(sk * d)
        .zip(dv.chunks_mut(sk * d_v))
        .zip(dq.chunks_mut(dq_group));
    for (bg, ((dk_bg, dv_bg), dq_bg)) in per_head.enumerate() {
        let mut dq_first = Some(dq_bg);
        let per_chunk = dk_bg
            .chunks_mut(chunk_keys * d)
            .zip(dv_bg.chunks_mut(chunk_keys * d_v));
        for (c, (dk, dv)) in per_chunk.enumerate() {
            let dq = match dq_first.take() {
                Some(dq_bg) => dq_bg,
                None => partial_slots.next().expect("one partial per extra chunk"),
            };
            let (b, kvh) = (bg / p.heads_kv, bg % p.heads_kv);
            tasks.push(KeyChunk {
                b,
                kvh,
                key0: c * chunk_keys,
                dk,
                dv,
                dq,
            });
        }
    }
    tasks
}

/// `dq += partial_1 + partial_2 + ...` in that order, element by element.
pub(in crate::cpu) fn add_partials(p: &Problem, chunks: usize, dq: &mut [f32], partials: &[f32]) {
    if chunks <= 1 {
        return;
    }
    let dq_group = p.group() * p.seq_q * p.head_dim;
    dq.par_chunks_mut(dq_group)
        .zip(partials.par_chunks(dq_group * (chunks - 1)))
        .for_each(|(dq_bg, parts)| {
            dq_bg
                .par_chunks_mut(ELEMENTWISE_BLOCK)
                .enumerate()
                .for_each(|(blk, dst)| {
                    let at = blk * ELEMENTWISE_BLOCK;
                    for part in parts.chunks_exact(dq_group) {
                        math::add_assign(dst, &part[at..at + dst.len()]);
                    }
                });
        });
}

/// What runs one key chunk of a backward with learnable tensors'
/// gradients: the task, its scratch, and the gradient partials it adds to.
pub(in crate::cpu) type ChunkBody<'a, S> =
    dyn Fn(KeyChunk<'_>, &mut S, &mut [&mut [f32]]) + Sync + 'a;

/// The tasks with learnable tensors' gradients: grouped into partial sums,
/// each group run in task order by `run` (with scratch from `scratch`,
/// one per rayon job), the partials then added in group order (see the
/// module docs). Shared by the f32 and the bf16 backward.
pub(in crate::cpu) fn learnable_tasks<S>(
    tasks: Vec<KeyChunk<'_>>,
    tensor_grads: &mut [Vec<f32>],
    scratch: &(dyn Fn() -> S + Sync),
    run: &ChunkBody<'_, S>,
) {
    let floats: usize = tensor_grads.iter().map(Vec::len).sum();
    let n = tasks.len();
    let sets = grad_partials(n, floats);
    let mut groups: Vec<Vec<KeyChunk<'_>>> = (0..sets).map(|_| Vec::new()).collect();
    for (t, task) in tasks.into_iter().enumerate() {
        groups[t * sets / n].push(task);
    }
    let mut partials: Vec<Vec<Vec<f32>>> = (0..sets)
        .map(|_| tensor_grads.iter().map(|g| vec![0.0; g.len()]).collect())
        .collect();
    groups
        .into_par_iter()
        .zip(partials.par_iter_mut())
        .for_each_init_dyn(scratch, &|sc, (group, partial)| {
            let mut views: Vec<&mut [f32]> = partial.iter_mut().map(Vec::as_mut_slice).collect();
            for task in group {
                run(task, sc, &mut views);
            }
        });
    for (k, grad) in tensor_grads.iter_mut().enumerate() {
        grad.par_chunks_mut(ELEMENTWISE_BLOCK)
            .enumerate()
            .for_each(|(blk, dst)| {
                let at = blk * ELEMENTWISE_BLOCK;
                for part in &partials {
                    math::add_assign(dst, &part[k][at..at + dst.len()]);
                }
            });
    }
}

/// Every row's sink, once, in row order: the rest of the backward reads it
/// only through `lse`, so this is where a sink's read out of range becomes
/// the call's `Err`, as in the forward. With learnable gradients wanted,
/// each row adds its sink term `d loss / d sink = −e^(sink − lse) · D_i`
/// times the sink's derivatives, after the partials of the pairs.
pub(in crate::cpu) fn sinks<V: HostVariant>(
    variant: &V,
    p: &Problem,
    lse: &[f32],
    delta: &[f32],
    tensor_grads: &mut [Vec<f32>],
) {
    let pos = Positions::new(p);
    let learn = tensor_grads.iter().any(|g| !g.is_empty());
    let mut views: Vec<&mut [f32]> = tensor_grads.iter_mut().map(Vec::as_mut_slice).collect();
    for bh in 0..p.batch * p.heads_q {
        let (b, h) = (
            Positions::to_i32(bh / p.heads_q),
            Positions::to_i32(bh % p.heads_q),
        );
        for i in 0..p.seq_q {
            let (lse, delta) = (lse[bh * p.seq_q + i], delta[bh * p.seq_q + i]);
            let (q_pos, _) = pos.query_range(i, 1);
            let sink = variant.sink(b, h, q_pos);
            if !learn || sink == f32::NEG_INFINITY || lse == f32::NEG_INFINITY {
                continue;
            }
            let dz = -(sink - lse).exp() * delta;
            variant.sink_tensor_grads(b, h, q_pos, dz, &mut views);
        }
    }
}

/// One task: all query tiles of all query heads of the group, against the
/// key tiles of the chunk, `kv_group` key tiles at a time; learnable
/// tensors' gradients go to `grads` (empty: not wanted).
fn key_chunk<V: HostVariant>(
    sh: &Shared<'_, V>,
    task: KeyChunk<'_>,
    sc: &mut Scratch,
    grads: &mut [&mut [f32]],
) {
    let p = sh.p;
    let (sq, sk, group) = (p.seq_q, p.seq_k, p.group());
    let (d, d_v) = (p.head_dim, p.head_dim_v);
    let KeyChunk {
        b,
        kvh,
        key0,
        dk,
        dv,
        dq,
    } = task;
    dk.fill(0.0);
    dv.fill(0.0);
    dq.fill(0.0);
    let bkv = b * p.heads_kv + kvh;
    let pass_keys = sh.kv_group * sh.tiles.kv;
    let (tile, tile_v) = (sh.tiles.kv * d, sh.tiles.kv * d_v);

    // Passes of up to `kv_group` key tiles: their rows of dK and dV, and
    // scratch for their transposes.
    let per_pass = dk
        .chunks_mut(pass_keys * d)
        .zip(dv.chunks_mut(pass_keys * d_v));
    for (n, (dk, dv)) in per_pass.enumerate() {
        let mut kvs = Vec::with_capacity(sh.kv_group);
        let scratch = sc.kt.chunks_mut(tile).zip(sc.vt.chunks_mut(tile_v));
        let per_tile = dk.chunks_mut(tile).zip(dv.chunks_mut(tile_v));
        for (i, ((dk, dv), (kt, vt))) in per_tile.zip(scratch).enumerate() {
            let cols = dk.len() / d;
            let kv0 = key0 + n * pass_keys + i * sh.tiles.kv;
            let key = bkv * sk + kv0;
            let k = &sh.x.k[key * d..(key + cols) * d];
            let v = &sh.x.v[key * d_v..(key + cols) * d_v];
            let (kt, vt) = (&mut kt[..d * cols], &mut vt[..d_v * cols]);
            gemm::transpose(k, cols, d, kt, cols);
            gemm::transpose(v, cols, d_v, vt, cols);
            kvs.push(KvTile {
                kv0,
                cols,
                k,
                k_nonfinite: !all_finite(k),
                kt,
                vt,
                dk,
                dv,
            });
        }
        for hl in 0..group {
            let h = kvh * group + hl;
            let bh = b * p.heads_q + h;
            let dq_h = &mut dq[hl * sq * d..(hl + 1) * sq * d];
            for r0 in (0..sq).step_by(sh.tiles.q) {
                let rows = sh.tiles.q.min(sq - r0);
                let dq_t = &mut dq_h[r0 * d..(r0 + rows) * d];
                let t = Rows { b, h, bh, r0, rows };
                for kv in kvs.iter_mut() {
                    query_tile(sh, t, kv, dq_t, &mut sc.work, grads);
                }
            }
        }
    }
}

/// The query rows of one tile: batch, query head, and rows `r0 .. r0 + rows`.
#[derive(Clone, Copy)]
struct Rows {
    b: usize,
    h: usize,
    /// Flat (batch, query head) index into q/out/dout/lse.
    bh: usize,
    r0: usize,
    rows: usize,
}

/// The contribution of one (query tile × key tile) to dK, dV and dQ.
fn query_tile<V: HostVariant>(
    sh: &Shared<'_, V>,
    t: Rows,
    kv: &mut KvTile<'_>,
    dq_t: &mut [f32],
    w: &mut Work,
    grads: &mut [&mut [f32]],
) {
    let p = sh.p;
    let (d, d_v, sq, scale) = (p.head_dim, p.head_dim_v, p.seq_q, p.scale);
    let (b, h) = (Positions::to_i32(t.b), Positions::to_i32(t.h));
    let (rows, cols) = (t.rows, kv.cols);
    let (q_lo, q_hi) = sh.pos.query_range(t.r0, rows);
    let class = tile_class(sh.variant, b, h, (q_lo, q_hi), kv.kv0, cols);
    if class == TileClass::Empty {
        return;
    }
    let kv_lo = Positions::to_i32(kv.kv0);
    let row0 = t.bh * sq + t.r0;
    let (q_t, dout_t) = (
        &sh.x.q[row0 * d..(row0 + rows) * d],
        &sh.x.dout[row0 * d_v..(row0 + rows) * d_v],
    );
    let lse = &sh.x.lse[t.bh * sq + t.r0..][..rows];
    let delta = &sh.delta[t.bh * sq + t.r0..][..rows];

    // The bands of query rows and the keys each must compute: the whole
    // tile, or on a partial tile the chunks of keys that classification
    // does not prove empty for each band. Outside them every pair is
    // hidden, so P and dS are 0 there and no product reads them.
    class_bands(
        sh.variant,
        (b, h),
        class,
        (q_lo, kv.kv0),
        (rows, cols),
        &mut w.bands,
    );
    let bands = &w.bands;

    // Recompute P from the saved log-sum-exp.
    let s = &mut w.s[..rows * cols];
    band_products(s, cols, bands, (q_t, d), kv.kt, d, scale);
    let g = &mut w.g[..if V::SCORE_GRAD_IS_ONE { 0 } else { rows * cols }];
    let learn = V::SCORE_READS_LEARNABLE && !grads.is_empty();
    if learn && !V::SCORE_GRADS_BY_DIFFERENCE {
        w.raw[..rows * cols].copy_from_slice(s);
    }
    let variant = sh.variant;
    simd::dispatch(Probabilities {
        variant,
        b,
        h,
        q_lo,
        kv_lo,
        class,
        lse,
        s: &mut *s,
        scale: 1.0,
        g: &mut *g,
        bands,
    });
    let (s, g) = (&*s, &*g);

    // dP = dO Vᵀ; with dropout, `P Z` and `dP Z` (see `dropped`).
    let dp = &mut w.dp[..rows * cols];
    band_products(dp, cols, bands, (dout_t, d_v), kv.vt, d_v, 1.0);
    let pd = &mut w.pd[..if V::WEIGHTS.dropout { rows * cols } else { 0 }];
    let pd = dropped(p, variant, (b, h), (q_lo, kv_lo), bands, cols, (s, pd, dp));

    // dV += (P Z)ᵀ dO.
    for Band { rows: r, cols: c } in bands.iter().filter(|b| !b.cols.is_empty()) {
        matmul(
            MatMut::row_major(&mut kv.dv[c.start * d_v..c.end * d_v], c.len(), d_v),
            Write::Accumulate,
            band_tile(pd.unwrap_or(s), cols, r, c).t(),
            band_rows(dout_t, d_v, r),
            1.0,
        );
    }

    // dS = d loss / d score ∘ score_grad, in place over dP.
    if learn {
        let at = (b, h, q_lo, kv_lo);
        let raw = &w.raw[..if V::SCORE_GRADS_BY_DIFFERENCE {
            0
        } else {
            rows * cols
        }];
        learnable_terms(variant, at, bands, (s, raw), dp, delta, &mut w.diag, grads);
    }
    simd::dispatch(ScoreGrads::<V> {
        p: s,
        g,
        delta,
        dp: &mut *dp,
        bands,
        partial: class == TileClass::Partial,
        variant: PhantomData,
    });
    let ds = &*dp;

    // dK += scale · dSᵀ Q;  dQ += scale · dS K. On a partial tile, keys
    // the band does not see must not bring a NaN of their K rows with them.
    let guard = class == TileClass::Partial && kv.k_nonfinite;
    for band in bands.iter().filter(|b| !b.cols.is_empty()) {
        let Band { rows: r, cols: c } = band;
        matmul(
            MatMut::row_major(&mut kv.dk[c.start * d..c.end * d], c.len(), d),
            Write::Accumulate,
            band_tile(ds, cols, r, c).t(),
            band_rows(q_t, d, r),
            scale,
        );
        let k_b = &kv.k[c.start * d..c.end * d];
        let k_b = if guard {
            zero_unused_rows(ds, cols, band, (k_b, d), d, &mut w.k_guarded)
        } else {
            k_b
        };
        matmul(
            MatMut::row_major(&mut dq_t[r.start * d..r.end * d], r.len(), d),
            Write::Accumulate,
            band_tile(ds, cols, r, c),
            MatRef::row_major(k_b, c.len(), d),
            scale,
        );
    }
}

/// Rows `r` of the row-major matrix `m` with rows of `d`.
fn band_rows<'a>(m: &'a [f32], d: usize, r: &Range<usize>) -> MatRef<'a> {
    MatRef::row_major(&m[r.start * d..r.end * d], r.len(), d)
}

/// Rows `r`, columns `c` of the row-major tile `m` with rows of `cols`.
fn band_tile<'a>(m: &'a [f32], cols: usize, r: &Range<usize>, c: &Range<usize>) -> MatRef<'a> {
    MatRef::strided(&m[r.start * cols + c.start..], r.len(), c.len(), cols)
}
