//! The forward kernel: FlashAttention-2 on the CPU.
//!
//! Schedule: one rayon task per (batch, query head, group of up to four
//! consecutive query tiles; see [`MAX_GROUP`]). The task's query tiles stay
//! resident; key/value tiles stream through them, each visiting every query
//! tile of the group before the next is loaded. Per (query tile, key tile):
//! classify it (skip `Empty`), `S = scale · Q Kᵀ` (GEMM), score and mask in
//! place, online softmax (running row max `m`, running sum `l`, rescale of
//! the output accumulator by `e^(m_old − m_new)` when the max grows), then
//! `O += P V` (GEMM). On a `Partial` tile all of that runs band by band (16
//! rows), over only the chunks of keys that classification does not prove
//! empty for the band. The accumulator is the tile's own slice of `out`,
//! overwritten by the first visible key tile rather than zeroed first.
//!
//! Guarantees: every element of `out` and `lse` is written; memory beyond
//! the outputs is one transposed copy of K plus, per task, one `Bq × Bk`
//! score tile and statistics for its `G·Bq` rows (nothing of size
//! `Sq × Sk`); a row with no visible key gets `out = 0`, `lse = -inf` and
//! never NaN; logits of any finite magnitude are safe because every `exp`
//! argument is `≤ 0`.

use crate::cpu::aligned::Aligned;
use crate::cpu::dropout::Draw;
use crate::cpu::elem::Stored;
use crate::cpu::gemm::{MatMut, MatRef, Write, matmul};
use crate::cpu::keys::KeyRows;
use crate::cpu::math;
use crate::cpu::operand::{Operand, Rows};
use crate::cpu::par::ForEachDyn as _;
use crate::cpu::simd::{self, Elementwise};
use crate::cpu::tile::CpuTiles;
use crate::cpu::weights::{self, RowWeights as _, Weights};
use crate::cpu::{
    Axis, Band, L2_BUDGET, Positions, band_products, class_bands, mean_visits, tile_class,
    zero_unused_rows,
};
use crate::problem::Problem;
use crate::variant::{HostVariant, TileClass};
use rayon::prelude::*;

/// Query tiles per task, at most: they share one pass over the keys, each
/// key/value tile visiting all of them in turn before the next is loaded.
///
/// Why: one query tile alone streams its head's whole K and V per tile of
/// 64 rows. At S = 4096, D = 128 those are 4 MiB, twice a core's L2, so every
/// query tile fetches them again from the L3 that the cores share (on a
/// virtual machine, with other tenants). Four tiles per pass fetch them a
/// quarter as often, and need `4 · (Q + O)` tiles resident: 256 KiB at
/// D = 128. Each tile keeps its own classification, statistics and output
/// rows, so masks skip at the same 64-row granularity as ungrouped.
///
/// Measured with `bench/ab_cpu.py` (2 threads, Hq = 8, forward; above 1 is
/// faster grouped), two runs each: full 4096 × 128 1.05 and 1.09, causal
/// 4096 × 128 1.12 and 1.08, full 2048 × 128 1.03 and 1.06; at Hkv = 2, full
/// 4096 × 64 1.04, causal 4096 × 128 1.07, full 2048 × 128 1.05. Where K and
/// V stay in L2 anyway grouping only costs (fewer tasks, and each query
/// tile's Q and O leave L1 between its key tiles): 0.96 at S = 1024, 0.91
/// for a causal mask at S = 4096, D = 64 (about 1 MiB per query tile);
/// hence [`L2_BUDGET`].
const MAX_GROUP: usize = 4;

/// Query tiles per task: 1 while a query tile reads at most
/// [`L2_BUDGET`] of K and V (short sequences; sliding windows, whose
/// consecutive query tiles read nearly the same keys), else [`MAX_GROUP`],
/// or fewer where that would leave under four tasks per thread (a causal
/// mask makes tasks uneven, and work stealing needs spare ones to even them
/// out).
pub(in crate::cpu) fn group_size<V: HostVariant>(
    variant: &V,
    p: &Problem,
    tiles: CpuTiles,
    threads: usize,
) -> usize {
    let q_tiles = p.seq_q.div_ceil(tiles.q);
    let kv_tile_bytes = tiles.kv * (p.head_dim + p.head_dim_v) * std::mem::size_of::<f32>();
    if mean_visits(variant, p, tiles, Axis::Query) * kv_tile_bytes as f64 <= L2_BUDGET as f64 {
        return 1;
    }
    let heads = p.batch * p.heads_q;
    let mut g = MAX_GROUP;
    while g > 1 && heads * q_tiles.div_ceil(g) < 4 * threads.max(1) {
        g /= 2;
    }
    g
}

/// Per-task scratch: the task's query rows widened from 16 bits (empty
/// for f32), and the rest of its work tiles.
struct Scratch {
    q: Aligned<f32>,
    work: Work,
}

impl Scratch {
    fn new(t: CpuTiles, group: usize, d: usize, widen_q: bool) -> Self {
        Self {
            q: Aligned::scratch(if widen_q { group * t.q * d } else { 0 }),
            work: Work::new(t, group),
        }
    }
}

/// A task's score tile and the running softmax statistics of every row of
/// its query tiles.
struct Work {
    /// `Bq × Bk` scores, then probabilities, row-major with stride = tile width.
    s: Aligned<f32>,
    /// Running row max of the (masked, modified) logits.
    m: Vec<f32>,
    /// Running row sum of `e^(x − m)`, per lane (reduced once per row at
    /// the end, not once per key tile).
    l: Vec<math::Lanes>,
    /// Per-row rescale factor of the current key tile.
    alpha: Vec<f32>,
    /// Running row max of the (masked, modified) scores alone, without
    /// the sink, where the call returns it.
    mx: Vec<f32>,
    /// The task's query tiles.
    q_tiles: Vec<QueryTile>,
    /// The current tile pair's bands (see `class_bands`).
    bands: Vec<Band>,
    /// A band's V rows with the unused ones zeroed (see
    /// [`zero_unused_rows`]).
    v_guarded: Vec<f32>,
}

impl Work {
    fn new(t: CpuTiles, group: usize) -> Self {
        let rows = group * t.q;
        Self {
            s: Aligned::scratch(t.q * t.kv),
            m: vec![0.0; rows],
            l: vec![[0.0; math::LANES]; rows],
            alpha: vec![0.0; rows],
            mx: vec![0.0; rows],
            q_tiles: Vec::with_capacity(group),
            bands: Vec::with_capacity(t.q.div_ceil(crate::cpu::BAND_ROWS)),
            v_guarded: Vec::new(),
        }
    }
}

/// One query tile of a task.
struct QueryTile {
    /// Its rows, relative to the task's first.
    rows: std::ops::Range<usize>,
    /// Their positions, first and last.
    pos: (i32, i32),
    /// No key tile has been accumulated into its output rows yet.
    first: bool,
}

/// The inputs shared by every query tile of one (batch, query head).
pub(in crate::cpu) struct Head<'a, V> {
    pub(in crate::cpu) variant: &'a V,
    pub(in crate::cpu) p: &'a Problem,
    pub(in crate::cpu) pos: Positions,
    /// Batch and query head, as passed to the variant.
    pub(in crate::cpu) b: i32,
    pub(in crate::cpu) h: i32,
    /// This head's K transposed tile by tile (the `D × cols` block of the
    /// tile at key `kv0` starts at `kv0·D`), and V (`Sk` rows of `Dv`,
    /// `v_rs` apart).
    pub(in crate::cpu) kt: &'a [f32],
    pub(in crate::cpu) v: &'a [f32],
    pub(in crate::cpu) v_rs: usize,
    /// Per key tile of V: it holds a NaN or an infinity (see
    /// [`zero_unused_rows`]).
    pub(in crate::cpu) v_nonfinite: &'a [bool],
}

/// The forward over `q`, `k` and `v` as stored (f32, or bf16/f16 read as
/// stored: `K` widened as it is transposed, `V` into an f32 copy per kv head
/// made right before its query tiles, `Q` a task's rows at a time).
#[allow(clippy::too_many_arguments)]
pub(in crate::cpu) fn forward<V: HostVariant>(
    variant: &V,
    p: &Problem,
    tiles: CpuTiles,
    group: usize,
    q: Operand<'_>,
    keys: KeyRows<'_>,
    (out, lse, max): (&mut [f32], &mut [f32], Option<&mut [f32]>),
) {
    let (sq, sk, d, dv) = (p.seq_q, p.seq_k, p.head_dim, p.head_dim_v);
    debug_assert_eq!((q.dim(), keys.k.dim(), keys.v.dim()), (d, d, dv));
    debug_assert_eq!((out.len(), lse.len()), (p.out_len(), p.lse_len()));
    debug_assert!(group > 0);
    let pos = Positions::new(p);

    // K transposed once, key tile by key tile: tile `t` of each kv head is
    // `Kᵀ` of keys `t·Bk .. t·Bk + cols`, a contiguous `D × cols` block at
    // offset `t·Bk·D` of the head's `Sk·D`. So the right-hand side of
    // `S = Q Kᵀ` has contiguous rows `cols` apart — the layout the tile
    // products stream — rather than `Sk` apart, which for long sequences
    // would map every row of the tile to the same L1 set. Costs one copy of
    // K, shared by all query tiles of all query heads of the group.
    //
    // Each kv head's copy is made right before the query tiles that read
    // it start, not all heads' up front: then it is still in the caches
    // when they read it, instead of being written out to memory and read
    // back. Aligned to a cache line, as every tile's rows then are (see
    // `aligned`). A V not in place as f32 (16-bit, far-apart rows, pages)
    // is copied per kv head likewise. Only each sequence's keys are read
    // (a cache's spare slots, or pages past its length, never).
    let mut kt = Aligned::<f32>::scratch(p.k_len());
    let v_f32 = keys.head(0, 0).and_then(|(_, v)| in_place(v)).is_some();
    let mut v_wide = Aligned::<f32>::scratch(if v_f32 { 0 } else { p.v_len() });
    let mut v_heads: Vec<Option<&mut [f32]>> = if v_wide.is_empty() {
        (0..p.batch * p.heads_kv).map(|_| None).collect()
    } else {
        v_wide.chunks_mut(sk * dv).map(Some).collect()
    };
    let g = p.group();

    // Outer: one (batch, kv head) per item; then its query heads; then
    // their groups of query tiles. Rayon flattens the nesting by work
    // stealing, so B = H = 1 still uses every thread when there are enough
    // query tiles.
    let group_rows = group * tiles.q;
    let mut max_g = pieces(max, g * sq, p.batch * p.heads_kv);
    out.par_chunks_mut(g * sq * dv)
        .zip(lse.par_chunks_mut(g * sq))
        .zip(kt.par_chunks_mut(sk * d))
        .zip(v_heads.par_iter_mut())
        .zip(max_g.par_iter_mut())
        .enumerate()
        .for_each_dyn(&|(bkv, ((((out_g, lse_g), kt), v_wide), max_g))| {
            let (b, hkv) = (bkv / p.heads_kv, bkv % p.heads_kv);
            if sees_nothing(variant, p, b, hkv) {
                // A sequence none of whose rows sees a key or has a sink
                // (a padded batch's sequence with no rows: the decodes of a
                // mixed batch in its prefill call): the empty rows'
                // results, without copying its keys.
                out_g.fill(0.0);
                lse_g.fill(V::WEIGHTS.lse(f32::NEG_INFINITY, 0.0));
                if let Some(m) = max_g.take() {
                    m.fill(f32::NEG_INFINITY);
                }
                return;
            }
            let len = keys.len(b);
            kt.par_chunks_mut(tiles.kv * d)
                .enumerate()
                .for_each_dyn(&|(t, kt)| {
                    let cols = kt.len() / d;
                    let at = t * tiles.kv;
                    let end = len.clamp(at, at + cols);
                    keys.each_run(b, hkv, at..end, |k, _, j| {
                        k.transpose(&mut kt[j - at..], cols)
                    });
                    // Keys past the sequence's: zero, never read as data.
                    for row in kt.chunks_mut(cols) {
                        row[end - at..].fill(0.0);
                    }
                });
            let kt = &*kt;
            let in_place_v = keys.head(b, hkv).and_then(|(_, v)| in_place(v));
            let (v, v_rs): (&[f32], usize) = match (in_place_v, v_wide.take()) {
                (Some(v), _) => v,
                (None, Some(wide)) => {
                    wide.par_chunks_mut(tiles.kv * dv)
                        .enumerate()
                        .for_each_dyn(&|(t, w)| {
                            let at = t * tiles.kv;
                            let end = len.clamp(at, at + w.len() / dv);
                            keys.each_run(b, hkv, at..end, |_, v, j| {
                                let n = v.len() * dv;
                                v.widen(&mut w[(j - at) * dv..][..n]);
                            });
                            w[(end - at) * dv..].fill(0.0);
                        });
                    (wide, dv)
                }
                (None, None) => unreachable!("a V not in place has a copy"),
            };
            let v_rows = Rows::new(Stored::F32(v), sk, dv, v_rs);
            let v_nonfinite: Vec<bool> = (0..sk)
                .step_by(tiles.kv)
                .map(|kv0| !v_rows.sub(kv0..sk.min(kv0 + tiles.kv)).all_finite())
                .collect();
            let mut max_h = pieces(max_g.take(), sq, g);
            out_g
                .par_chunks_mut(sq * dv)
                .zip(lse_g.par_chunks_mut(sq))
                .zip(max_h.par_iter_mut())
                .enumerate()
                .for_each_dyn(&|(i, ((out_bh, lse_bh), max_bh))| {
                    let bh = bkv * g + i;
                    let (b, h) = (bh / p.heads_q, bh % p.heads_q);
                    let head = Head {
                        variant,
                        p,
                        pos,
                        b: Positions::to_i32(b),
                        h: Positions::to_i32(h),
                        kt,
                        v,
                        v_rs,
                        v_nonfinite: &v_nonfinite,
                    };
                    let q_bh = q.head(bh);
                    let mut max_t = pieces(max_bh.take(), group_rows, sq.div_ceil(group_rows));
                    out_bh
                        .par_chunks_mut(group_rows * dv)
                        .zip(lse_bh.par_chunks_mut(group_rows))
                        .zip(max_t.par_iter_mut())
                        .enumerate()
                        .for_each_init_dyn(
                            &|| Scratch::new(tiles, group, d, in_place(q_bh).is_none()),
                            &|scratch, (t, ((out_g, lse_g), max_t))| {
                                let (row0, rows) = (t * group_rows, lse_g.len());
                                let q_g = q_bh.sub(row0..row0 + rows);
                                let q_g = match in_place(q_g) {
                                    Some(q) => q,
                                    None => {
                                        let wide = &mut scratch.q[..rows * d];
                                        q_g.widen(wide);
                                        (&*wide, d)
                                    }
                                };
                                query_tiles(
                                    &head,
                                    tiles,
                                    row0,
                                    q_g,
                                    (out_g, lse_g, max_t.take()),
                                    &mut scratch.work,
                                );
                            },
                        );
                });
        });
}

/// Whether no row of sequence `b` in the query heads of kv head `hkv` sees
/// a key or carries a sink.
fn sees_nothing<V: HostVariant>(variant: &V, p: &Problem, b: usize, hkv: usize) -> bool {
    if !V::HAS_MASK || p.seq_q == 0 || p.seq_k == 0 {
        return false;
    }
    let g = p.group();
    let (q_lo, q_hi) = Positions::new(p).query_range(0, p.seq_q);
    let kv_hi = Positions::to_i32(p.seq_k) - 1;
    let b = Positions::to_i32(b);
    (hkv * g..(hkv + 1) * g).all(|h| {
        let h = Positions::to_i32(h);
        variant.classify_tile(b, h, q_lo, q_hi, 0, kv_hi) == TileClass::Empty
            && (q_lo..=q_hi).all(|q| variant.sink(b, h, q) == f32::NEG_INFINITY)
    })
}

/// f32 rows the tile products read where they are: contiguous ones. Rows
/// further apart (a permuted `[B, S, H, D]` input: `H·D` apart, 4 KiB for
/// 8 heads of 128) would map a tile's rows to the same few L1 sets, so
/// those are copied per task (Q) or kv head (V), as 16-bit ones are
/// widened.
fn in_place(rows: Rows<'_>) -> Option<(&[f32], usize)> {
    rows.packed_data().and(rows.f32())
}

/// `max` (where a call returns it) cut into `n`-long pieces, one for each
/// of the `count` items of a parallel loop (`None`s where it does not).
pub(in crate::cpu) fn pieces(
    max: Option<&mut [f32]>,
    n: usize,
    count: usize,
) -> Vec<Option<&mut [f32]>> {
    match max {
        Some(m) => m.chunks_mut(n.max(1)).map(Some).collect(),
        None => (0..count).map(|_| None).collect(),
    }
}

/// Consecutive query tiles, `rows = lse.len()` rows from row `row0` in
/// all: stream every key tile through each of them in turn, then normalise
/// (and, where asked, write each row's largest score into `max`).
fn query_tiles<V: HostVariant>(
    head: &Head<'_, V>,
    tiles: CpuTiles,
    row0: usize,
    (q, q_rs): (&[f32], usize),
    (out, lse, max): (&mut [f32], &mut [f32], Option<&mut [f32]>),
    sc: &mut Work,
) {
    let (d, dv) = (head.p.head_dim, head.p.head_dim_v);
    let (sk, scale) = (head.p.seq_k, head.p.scale);
    let rows = lse.len();
    start_rows(head, row0, &mut sc.m[..rows], &mut sc.l[..rows]);
    sc.mx[..rows].fill(f32::NEG_INFINITY);
    // Each tile's output rows are neither zeroed nor rescaled before its
    // first visible key tile: that tile's `P V` overwrites them. (Rows no
    // tile reaches are zeroed at the end.)
    sc.q_tiles.clear();
    sc.q_tiles.extend((0..rows).step_by(tiles.q).map(|r0| {
        let r = r0..rows.min(r0 + tiles.q);
        QueryTile {
            pos: head.pos.query_range(row0 + r.start, r.len()),
            rows: r,
            first: true,
        }
    }));

    for kv0 in (0..sk).step_by(tiles.kv) {
        let cols = tiles.kv.min(sk - kv0);
        let kv_lo = Positions::to_i32(kv0);
        for qt in sc.q_tiles.iter_mut() {
            let (r, (q_lo, q_hi)) = (qt.rows.clone(), qt.pos);
            let class = tile_class(head.variant, head.b, head.h, (q_lo, q_hi), kv0, cols);
            if class == TileClass::Empty {
                continue;
            }
            let first = std::mem::replace(&mut qt.first, false);
            // The bands of query rows and the keys each must compute: the
            // whole tile, or on a partial tile per `BAND_ROWS` rows the
            // chunks of keys that classification does not prove empty.
            let (variant, b, h) = (head.variant, head.b, head.h);
            class_bands(
                variant,
                (b, h),
                class,
                (q_lo, kv0),
                (r.len(), cols),
                &mut sc.bands,
            );
            let s = &mut sc.s[..r.len() * cols];
            let kt_t = &head.kt[kv0 * d..(kv0 + cols) * d];
            band_products(
                s,
                cols,
                &sc.bands,
                (&q[r.start * q_rs..], q_rs),
                kt_t,
                d,
                scale,
            );
            let out_t = &mut out[r.start * dv..r.end * dv];
            simd::dispatch(OnlineSoftmax {
                head,
                class,
                q_lo,
                kv_lo,
                s: &mut *s,
                scale: 1.0,
                m: &mut sc.m[r.clone()],
                l: &mut sc.l[r.clone()],
                alpha: &mut sc.alpha[r.clone()],
                out: (!first).then_some(&mut *out_t),
                mx: max.is_some().then_some(&mut sc.mx[r.clone()]),
                bands: &sc.bands,
            });

            // O += P V, band by band over the keys computed (the others'
            // probabilities are 0). On a partial tile, keys the band does
            // not see must not bring a NaN of their V rows with them.
            let v_rs = head.v_rs;
            let v_t = &head.v[kv0 * v_rs..];
            let guard = class == TileClass::Partial && head.v_nonfinite[kv0 / tiles.kv];
            for band in sc.bands.iter() {
                let Band { rows: br, cols: c } = band.clone();
                let out_b = &mut out_t[br.start * dv..br.end * dv];
                if c.is_empty() {
                    if first {
                        out_b.fill(0.0);
                    }
                    continue;
                }
                let v_b = &v_t[c.start * v_rs..];
                let (v_b, v_b_rs) = if guard {
                    let rows = (v_b, v_rs);
                    (
                        zero_unused_rows(s, cols, band, rows, dv, &mut sc.v_guarded),
                        dv,
                    )
                } else {
                    (v_b, v_rs)
                };
                matmul(
                    MatMut::row_major(out_b, br.len(), dv),
                    if first {
                        Write::Overwrite
                    } else {
                        Write::Accumulate
                    },
                    MatRef::strided(&s[br.start * cols + c.start..], br.len(), c.len(), cols),
                    MatRef::strided(v_b, c.len(), dv, v_b_rs),
                    1.0,
                );
            }
        }
    }

    // Rows of a tile that no key tile reached were never written.
    for qt in sc.q_tiles.iter().filter(|t| t.first) {
        out[qt.rows.start * dv..qt.rows.end * dv].fill(0.0);
    }
    finish_rows(head.p, (&sc.m[..rows], &sc.l[..rows]), out, lse, V::WEIGHTS);
    if let Some(max) = max {
        max.copy_from_slice(&sc.mx[..rows]);
    }
}

/// The running max `m` and sum `l` of rows `row0 ..` before any key: the
/// sink's (one more logit of the row, with no value), `-inf` without one,
/// and the sum the normalisation starts from.
pub(in crate::cpu) fn start_rows<V: HostVariant>(
    head: &Head<'_, V>,
    row0: usize,
    m: &mut [f32],
    l: &mut [math::Lanes],
) {
    m.fill(f32::NEG_INFINITY);
    l.fill([0.0; math::LANES]);
    if V::WEIGHTS.sink {
        let (q0, _) = head.pos.query_range(row0, m.len());
        for (i, (m, l)) in m.iter_mut().zip(l.iter_mut()).enumerate() {
            *m = head.variant.sink(head.b, head.h, q0 + i as i32);
            l[0] = V::WEIGHTS.start(*m);
        }
    }
}

/// Each row of `out` (`lse.len()` rows) finished by `weights`
/// ([`weights::finish_row`]): a softmax row divided by its sum, with its
/// lse; every row times a dropout call's `1/(1 − p)`.
pub(in crate::cpu) fn finish_rows(
    p: &Problem,
    (m, l): (&[f32], &[math::Lanes]),
    out: &mut [f32],
    lse: &mut [f32],
    weights: Weights,
) {
    let d = out.len() / lse.len().max(1);
    let keep = if weights.dropout {
        p.dropout.scale()
    } else {
        1.0
    };
    for (i, ((m, l), lse)) in m.iter().zip(l).zip(lse.iter_mut()).enumerate() {
        let row = &mut out[i * d..(i + 1) * d];
        *lse = weights::finish_row(weights, (*m, math::sum_lanes(l)), row, keep);
    }
}

/// The elementwise step of the online softmax for one key tile: turns the
/// tile's scaled logits `s` into unnormalised probabilities
/// `P = e^(x − m_new)` in place, and updates the running `m`, `l` and the
/// output accumulator rows (rescaled by `e^(m_old − m_new)` where the max grew).
pub(in crate::cpu) struct OnlineSoftmax<'a, 'h, V> {
    pub(in crate::cpu) head: &'a Head<'h, V>,
    pub(in crate::cpu) class: TileClass,
    /// Position of the tile's first query row and first key.
    pub(in crate::cpu) q_lo: i32,
    pub(in crate::cpu) kv_lo: i32,
    /// `rows × cols` logits, row-major, times `scale` (applied here: 1
    /// where the product scaled them already).
    pub(in crate::cpu) s: &'a mut [f32],
    pub(in crate::cpu) scale: f32,
    pub(in crate::cpu) m: &'a mut [f32],
    pub(in crate::cpu) l: &'a mut [math::Lanes],
    pub(in crate::cpu) alpha: &'a mut [f32],
    /// The `rows × D` accumulator to rescale (rows may be padded past
    /// `D`); `None` on the first visible tile, before anything has been
    /// accumulated.
    pub(in crate::cpu) out: Option<&'a mut [f32]>,
    /// Each row's largest score so far, where the call returns it.
    pub(in crate::cpu) mx: Option<&'a mut [f32]>,
    /// The tile's bands (see [`class_bands`]): each row's logits are those of
    /// its band's keys; the rest of the row is neither read nor written.
    pub(in crate::cpu) bands: &'a [Band],
}

impl<V: HostVariant> Elementwise for OnlineSoftmax<'_, '_, V> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let Self {
            head,
            class,
            q_lo,
            kv_lo,
            s,
            scale,
            m,
            l,
            alpha,
            mut out,
            mut mx,
            bands,
        } = self;
        let rows = m.len();
        let cols = s.len() / rows;
        // The accumulator's row width: the head dim, or a padded one.
        let d = out.as_deref().map_or(0, |o| o.len() / rows);
        let w = V::WEIGHTS;
        let draw = if w.dropout {
            Draw::new(head.p, head.variant, head.b, head.h)
        } else {
            None
        };
        // An identity score leaves the logits unscaled in `s` and the
        // weights scale them as they read them (the same bits, one pass
        // fewer); any other score needs the scaled logit.
        let weigh_scale = if V::SCORE_IS_IDENTITY && scale > 0.0 {
            scale
        } else {
            1.0
        };
        // Logits of every row, and each row's new running max (in `alpha`
        // for now).
        for Band { rows: br, cols: c } in bands.iter().cloned() {
            for i in br {
                let row = &mut s[i * cols + c.start..i * cols + c.end];
                let (qi, kj) = (q_lo + i as i32, kv_lo + c.start as i32);
                if scale != weigh_scale {
                    math::scale(row, scale);
                }
                score_and_mask(head.variant, head.b, head.h, qi, kj, class, row);
                alpha[i] = w.row_max(m[i], row, weigh_scale);
                if let Some(mx) = mx.as_deref_mut() {
                    // The scores as the row sees them (`-inf` hidden; an
                    // identity score's logits scaled by a positive scale).
                    mx[i] = mx[i].max(weigh_scale * math::max(row));
                }
            }
        }
        // Rescale factors across rows at once: one scalar `exp` per row
        // would be a long dependency chain per row.
        w.rescale_rows(m, alpha);
        for Band { rows: br, cols: c } in bands.iter().cloned() {
            for i in br {
                let row = &mut s[i * cols + c.start..i * cols + c.end];
                if alpha[i] != 1.0 {
                    l[i].iter_mut().for_each(|x| *x *= alpha[i]);
                    if let Some(out) = out.as_deref_mut() {
                        math::scale(&mut out[i * d..(i + 1) * d], alpha[i]);
                    }
                }
                let (qi, kj) = (q_lo + i as i32, kv_lo + c.start as i32);
                // The row's sum is of every pair's weight; the dropped ones
                // leave only `P V`.
                l[i] = w.weigh_row(row, (m[i], weigh_scale), l[i]);
                if let Some(draw) = &draw {
                    draw.drop_row(qi, kj, row);
                }
            }
        }
    }
}

/// Apply `score` (unless it is the identity) and, on a `Partial` tile, the
/// mask (`-inf` where hidden) to one row of scaled logits `s`, in place.
/// The backward applies the same two steps, so both see the same logits.
#[inline(always)]
pub(in crate::cpu) fn score_and_mask<V: HostVariant>(
    variant: &V,
    b: i32,
    h: i32,
    qi: i32,
    kv_lo: i32,
    class: TileClass,
    row: &mut [f32],
) {
    if V::SCORE_CHECKS_READS && class == TileClass::Partial {
        // The score reads a tensor with a checked index: evaluate it only
        // where the pair is visible, as the reference does, so that a read
        // out of range there, and only there, is reported.
        for (j, x) in row.iter_mut().enumerate() {
            let kv = kv_lo + j as i32;
            *x = if variant.mask(b, h, qi, kv) {
                variant.score(*x, b, h, qi, kv)
            } else {
                f32::NEG_INFINITY
            };
        }
        return;
    }
    if !V::SCORE_IS_IDENTITY {
        for (j, x) in row.iter_mut().enumerate() {
            *x = variant.score(*x, b, h, qi, kv_lo + j as i32);
        }
    }
    apply_mask(variant, b, h, qi, kv_lo, class, row);
}

/// On a `Partial` tile, set the hidden entries of one row of (modified)
/// logits to `-inf`; on any other tile, nothing.
#[inline(always)]
pub(in crate::cpu) fn apply_mask<V: HostVariant>(
    variant: &V,
    b: i32,
    h: i32,
    qi: i32,
    kv_lo: i32,
    class: TileClass,
    row: &mut [f32],
) {
    if class == TileClass::Partial {
        for (j, x) in row.iter_mut().enumerate() {
            let visible = variant.mask(b, h, qi, kv_lo + j as i32);
            *x = if visible { *x } else { f32::NEG_INFINITY };
        }
    }
}
