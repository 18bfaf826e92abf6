//! The decode kernel: a few query rows against long keys, split across
//! workers (split-KV) and packed by GQA group.
//!
//! Decode is bandwidth-bound: each query row meets every key once, so the
//! time is the time to read K and V. The tile kernel ([`crate::cpu::forward`])
//! streams a head's K and V once per query head and first copies K
//! transposed; here one task owns a (batch, kv head, chunk of keys) and all
//! `G = Hq / Hkv` query heads of the group together: their `R = G · Sq` rows
//! are one packed block (row `r = hh · Sq + i` is query row `i` of head
//! `hkv · G + hh`; they are consecutive in `q`), so each key block of K and
//! V is read from memory once for the whole group. Per key block (the
//! variant's key tile): `Sᵀ = scale · K Qᵀ` for all `R` rows (one tile
//! product over K's rows where they lie, widened row by row first where the
//! cache is 16-bit or fp8, against `Qᵀ` transposed once per task), `S` its
//! small `R × Bk` transpose, `score` and `mask` at the rows' true positions
//! (each head classified on its own: an empty head gets no arithmetic but
//! the product), the online softmax per row, then `O += P V`. V as a view
//! of K (absorbed MLA: its leading columns) is read from K's widened block.
//! Each score is the same fused sum over `d` in order as `Q Kᵀ` would
//! make it: the layout of the product changes no bit.
//!
//! Split-KV: when `B · Hkv` tasks cannot keep the threads busy, each (batch,
//! kv head)'s keys are cut into chunks of whole key blocks ([`chunks`]),
//! each chunk a task with its own running max, sum and unnormalised
//! output. They are merged per row by their log-sum-exp, in chunk order,
//! with the sink (if any) as one more partial: `M = max_c m_c`,
//! `L = Σ_c e^(m_c − M) l_c`, `out = Σ_c e^(m_c − M) acc_c / L`,
//! `lse = M + ln L`. The chunking depends only on the shape and the thread
//! count, and no sum's order on scheduling: the same bits from run to run.
//!
//! Guarantees as for the tile kernel: every output element written, a row
//! with no visible key gets `out = 0` and `lse = -inf` (its sink, with
//! one), a key no row of the block sees never brings a NaN of its V row
//! into a result. Memory: per task `R · D` floats of output and `R` of
//! statistics (the partials, `chunks` times the output in all), plus a key
//! block's `Kᵀ` and `R ×` block scores.

use crate::cpu::aligned::Aligned;
use crate::cpu::dropout::Draw;
use crate::cpu::elem::Stored;
use crate::cpu::gemm::{MatMut, MatRef, Write, matmul, transpose};
use crate::cpu::gemv;
use crate::cpu::gemv_i8;
use crate::cpu::keys::KeyRows;
use crate::cpu::math;
use crate::cpu::operand::Rows;
use crate::cpu::par::ForEachDyn as _;
use crate::cpu::simd::{self, Elementwise};
use crate::cpu::tile::CpuTiles;
use crate::cpu::weights::{self, RowWeights as _};
use crate::cpu::{Band, Positions, tile_class, zero_unused_rows};
use crate::problem::Problem;
use crate::variant::{HostVariant, TileClass};
use rayon::prelude::*;

/// Query rows per head up to which [`crate::cpu::forward_tiled`] takes this
/// kernel: decode (one row), speculative decoding and short appends.
pub(in crate::cpu) const MAX_ROWS: usize = 32;

/// Packed rows up to which a task runs its products as [`gemv`]'s
/// matrix-vector kernels (two passes of four rows over each key block, in
/// L1); more rows amortise a transposed key block over a GEMM.
const GEMV_ROWS: usize = 8;

/// Keys a chunk holds at least: below this a task's fixed costs (the
/// partial's merge, scheduling) outweigh the spread.
const MIN_CHUNK_KEYS: usize = 512;

/// Tasks per thread that splitting aims at, so that work stealing can even
/// out chunks a mask makes uneven.
const TASKS_PER_THREAD: usize = 4;

/// Whether the problem is a decode shape (see [`MAX_ROWS`]).
pub(in crate::cpu) fn applies(p: &Problem) -> bool {
    p.seq_q <= MAX_ROWS
}

/// Chunks of keys per (batch, kv head) for `threads` threads: enough that
/// `B · Hkv · chunks` reaches [`TASKS_PER_THREAD`] tasks per thread, each
/// chunk at least [`MIN_CHUNK_KEYS`] keys (one chunk when the heads alone
/// fill the machine).
pub(in crate::cpu) fn chunks(p: &Problem, tiles: CpuTiles, threads: usize) -> usize {
    let heads = p.batch * p.heads_kv;
    let wanted = (TASKS_PER_THREAD * threads.max(1)).div_ceil(heads.max(1));
    let most = p.seq_k.div_ceil(MIN_CHUNK_KEYS.max(tiles.kv)).max(1);
    wanted.clamp(1, most)
}

/// One task's partial result: per packed row its running max and sum, and
/// its unnormalised output row.
struct Partial<'a> {
    m: &'a mut [f32],
    l: &'a mut [f32],
    acc: &'a mut [f32],
    /// Each row's largest score, where the call returns it.
    best: Option<&'a mut [f32]>,
}

/// The forward for decode shapes, with the keys of each (batch, kv head)
/// cut into `chunks` chunks of whole key tiles. Sequence `b` has the keys
/// `keys` gives it (a KV cache's spare slots are never read), and its
/// query row `i` sits at position `i + len[b] − Sq`.
#[allow(clippy::too_many_arguments)]
pub(in crate::cpu) fn forward<V: HostVariant>(
    variant: &V,
    p: &Problem,
    tiles: CpuTiles,
    chunks: usize,
    q: &[f32],
    keys: KeyRows<'_>,
    (out, lse, max): (&mut [f32], &mut [f32], Option<&mut [f32]>),
) {
    let (sq, sk, g) = (p.seq_q, p.seq_k, p.group());
    let (d, dv) = (p.head_dim, p.head_dim_v);
    let rows = g * sq;
    Positions::new(p);
    let len = |b: usize| keys.len(b);
    let pos = |b: usize| Positions {
        q_offset: Positions::to_i32(len(b)) - Positions::to_i32(sq),
    };
    // Chunks are whole key tiles; recount after rounding up the chunk size.
    let key_tiles = sk.div_ceil(tiles.kv);
    let chunk_keys = key_tiles.div_ceil(chunks.clamp(1, key_tiles.max(1))) * tiles.kv;
    let chunks = sk.div_ceil(chunk_keys.max(1)).max(1);
    let tasks = p.batch * p.heads_kv * chunks;

    let mut m = vec![f32::NEG_INFINITY; tasks * rows];
    let mut l = vec![0.0f32; tasks * rows];
    let mut acc = Aligned::<f32>::zeroed(tasks * rows * dv);
    let mut best = vec![f32::NEG_INFINITY; if max.is_some() { tasks * rows } else { 0 }];
    let mut best_t =
        crate::cpu::forward::pieces(max.is_some().then_some(&mut best[..]), rows, tasks);
    m.par_chunks_mut(rows)
        .zip(l.par_chunks_mut(rows))
        .zip(acc.par_chunks_mut(rows * dv))
        .zip(best_t.par_iter_mut())
        .enumerate()
        .for_each_init_dyn(&|| Scratch::new(tiles, rows, (d, dv)), &|sc,
                                                                     (
            t,
            (((m, l), acc), best),
        )| {
            let (bkv, c) = (t / chunks, t % chunks);
            let b = bkv / p.heads_kv;
            let end = len(b);
            let range = (c * chunk_keys).min(end)..end.min((c + 1) * chunk_keys);
            let task = Task {
                variant,
                p,
                pos: pos(b),
                tiles,
                b,
                hkv: bkv % p.heads_kv,
                q: &q[bkv * rows * d..(bkv + 1) * rows * d],
                keys,
            };
            let best = best.take();
            task.run(range, Partial { m, l, acc, best }, sc);
        });

    // Merge each row's chunks in chunk order (the sink first), each
    // partial rescaled to the row's largest max, then finish the row.
    let w = V::WEIGHTS;
    let keep = if w.dropout { p.dropout.scale() } else { 1.0 };
    let mut max_g = crate::cpu::forward::pieces(max, rows, p.batch * p.heads_kv);
    out.par_chunks_mut(rows * dv)
        .zip(lse.par_chunks_mut(rows))
        .zip(max_g.par_iter_mut())
        .enumerate()
        .for_each_dyn(&|(bkv, ((out_g, lse_g), max_g))| {
            // Each row's largest score: the largest of its chunks'.
            if let Some(max_g) = max_g.take() {
                for (r, x) in max_g.iter_mut().enumerate() {
                    let at = |c: usize| (bkv * chunks + c) * rows + r;
                    *x = (0..chunks)
                        .map(|c| best[at(c)])
                        .fold(f32::NEG_INFINITY, f32::max);
                }
            }
            let pos = pos(bkv / p.heads_kv);
            let b = Positions::to_i32(bkv / p.heads_kv);
            for (r, (out_r, lse_r)) in out_g.chunks_mut(dv).zip(lse_g.iter_mut()).enumerate() {
                let h = Positions::to_i32((bkv % p.heads_kv) * g + r / sq);
                let (qi, _) = pos.query_range(r % sq, 1);
                let sink = if w.sink {
                    variant.sink(b, h, qi)
                } else {
                    f32::NEG_INFINITY
                };
                let at = |c: usize| (bkv * chunks + c) * rows + r;
                let mx = (0..chunks).map(|c| m[at(c)]).fold(sink, f32::max);
                let mut total = w.start(sink) * w.rescale(sink, mx);
                out_r.fill(0.0);
                for c in 0..chunks {
                    let i = at(c);
                    let a = w.rescale(m[i], mx);
                    total += a * l[i];
                    math::axpy(out_r, a, &acc[i * dv..(i + 1) * dv]);
                }
                *lse_r = weights::finish_row(w, (mx, total), out_r, keep);
            }
        });
}

/// How a task computes its two products per key block.
#[derive(Clone, Copy)]
enum Products {
    /// The tile products ([`matmul`]) over `Kᵀ` and widened blocks.
    Tiles,
    /// [`gemv`]'s matrix-vector kernels, keys read as stored.
    Vector,
    /// [`gemv_i8`]'s integer kernels over an int8 cache.
    Integer,
}

/// Per-task scratch: the rows' `Qᵀ`, the rows rounded to int16 (an int8
/// cache), one key block widened (a 16-bit or fp8 cache), the block's
/// scores and their transpose, the rows' running sums per lane and rescale
/// factors, a guarded V block, and the widened V block of a 16-bit or fp8
/// cache.
struct Scratch {
    qt: Aligned<f32>,
    q16: gemv_i8::Queries,
    k_wide: Aligned<f32>,
    v_wide: Aligned<f32>,
    s: Aligned<f32>,
    st: Aligned<f32>,
    l: Vec<math::Lanes>,
    alpha: Vec<f32>,
    classes: Vec<TileClass>,
    v_guarded: Vec<f32>,
}

impl Scratch {
    fn new(tiles: CpuTiles, rows: usize, (d, dv): (usize, usize)) -> Self {
        Scratch {
            qt: Aligned::zeroed(d * rows),
            q16: gemv_i8::Queries::new(),
            k_wide: Aligned::zeroed(d * tiles.kv),
            v_wide: Aligned::zeroed(dv * tiles.kv),
            s: Aligned::zeroed(rows * tiles.kv),
            st: Aligned::zeroed(rows * tiles.kv),
            l: vec![[0.0; math::LANES]; rows],
            alpha: vec![0.0; rows],
            classes: Vec::new(),
            v_guarded: Vec::new(),
        }
    }
}

/// One (batch, kv head) and its packed query rows.
struct Task<'a, V> {
    variant: &'a V,
    p: &'a Problem,
    pos: Positions,
    tiles: CpuTiles,
    b: usize,
    hkv: usize,
    /// The group's `R × D` query rows.
    q: &'a [f32],
    keys: KeyRows<'a>,
}

impl<V: HostVariant> Task<'_, V> {
    /// The block of keys from `kv0` (at most a key tile, none past `end`)
    /// as runs of rows into `k` and `v`: for the matrix-vector products
    /// (`gemv`) across pages, else within one. Returns its keys.
    fn gather<'s>(
        &'s self,
        kv0: usize,
        end: usize,
        gemv: bool,
        k: &mut Vec<Rows<'s>>,
        v: &mut Vec<Rows<'s>>,
    ) -> usize {
        k.clear();
        v.clear();
        let want = self.tiles.kv.min(end.saturating_sub(kv0));
        let mut cols = 0;
        while cols < want && k.len() < gemv::MAX_RUNS {
            let (kr, vr) = self.keys.run(self.b, self.hkv, kv0 + cols, want - cols);
            cols += kr.len();
            k.push(kr);
            v.push(vr);
            if !gemv {
                break;
            }
        }
        cols
    }

    /// One block that some head sees: keys `kv0 .. kv0 + cols` as runs
    /// `k` and `v` (one run for the tile products), the next block's runs
    /// `ahead`.
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        k: &[Rows<'_>],
        v: &[Rows<'_>],
        (kv0, cols): (usize, usize),
        ahead: [&[Rows<'_>]; 2],
        products: Products,
        (m, best, acc): (&mut [f32], Option<&mut [f32]>, &mut [f32]),
        sc: &mut Scratch,
    ) {
        let (p, d, g, sq) = (self.p, self.p.head_dim, self.p.group(), self.p.seq_q);
        let dv = p.head_dim_v;
        let rows = g * sq;
        let s = &mut sc.s[..rows * cols];
        // Where K's block was widened into `k_wide`.
        let mut widened = false;
        match products {
            Products::Integer => gemv_i8::scores(&sc.q16, d, k, p.scale, s, ahead),
            Products::Vector => gemv::scores(self.q, d, k, p.scale, s, ahead),
            Products::Tiles => {
                let (kf, k_rs) = match k[0].f32() {
                    Some(kf) => kf,
                    None => {
                        k[0].widen(&mut sc.k_wide[..cols * d]);
                        widened = true;
                        (&sc.k_wide[..cols * d], d)
                    }
                };
                let st = &mut sc.st[..cols * rows];
                matmul(
                    MatMut::row_major(st, cols, rows),
                    Write::Overwrite,
                    MatRef::strided(kf, cols, d, k_rs),
                    MatRef::row_major(&sc.qt[..d * rows], d, rows),
                    p.scale,
                );
                transpose(st, cols, rows, s, cols);
            }
        }
        simd::dispatch(BlockSoftmax {
            task: self,
            classes: &sc.classes,
            kv_lo: Positions::to_i32(kv0),
            s: &mut *s,
            m,
            l: &mut sc.l[..rows],
            alpha: &mut sc.alpha[..rows],
            acc: &mut *acc,
            best,
        });
        // O += P V. Where some row hides some key, that key must not bring
        // a NaN of its V row with it (0 · NaN): such keys' rows are zeroed
        // in an f32 copy of the block.
        let hides = sc.classes.iter().any(|&c| c != TileClass::Full);
        let guarded;
        let v = if hides && !v.iter().all(|run| run.all_finite()) {
            let wide = &mut sc.v_wide[..cols * dv];
            let mut at = 0;
            for run in v {
                run.widen(&mut wide[at..at + run.len() * dv]);
                at += run.len() * dv;
            }
            let band = Band {
                rows: 0..rows,
                cols: 0..cols,
            };
            let guarded_rows = zero_unused_rows(s, cols, &band, (wide, dv), dv, &mut sc.v_guarded);
            guarded = [Rows::packed(Stored::F32(guarded_rows), dv)];
            &guarded[..]
        } else {
            v
        };
        match products {
            Products::Integer => gemv_i8::accumulate(s, v, dv, acc),
            Products::Vector => gemv::accumulate(s, v, dv, acc),
            Products::Tiles => {
                let (v, v_rs) = match v[0].f32() {
                    Some(v) => v,
                    // V as a view of K: its leading columns, widened already.
                    None if widened && v[0].leads(k[0]) => (&sc.k_wide[..cols * d], d),
                    None => {
                        v[0].widen(&mut sc.v_wide[..cols * dv]);
                        (&sc.v_wide[..cols * dv], dv)
                    }
                };
                matmul(
                    MatMut::row_major(acc, rows, dv),
                    Write::Accumulate,
                    MatRef::row_major(s, rows, cols),
                    MatRef::strided(v, cols, dv, v_rs),
                    1.0,
                );
            }
        }
    }

    /// Stream the key blocks of `keys` through the packed rows into `part`
    /// (statistics and unnormalised output of this chunk).
    fn run(&self, keys: std::ops::Range<usize>, part: Partial<'_>, sc: &mut Scratch) {
        let (g, sq) = (self.p.group(), self.p.seq_q);
        let rows = g * sq;
        let b = Positions::to_i32(self.b);
        let (q_lo, q_hi) = self.pos.query_range(0, sq);
        let Partial {
            m,
            l,
            acc,
            mut best,
        } = part;
        sc.l[..rows].fill([0.0; math::LANES]);
        let gemv = rows <= GEMV_ROWS && gemv::available();
        if !gemv {
            let d = self.p.head_dim;
            transpose(self.q, rows, d, &mut sc.qt[..d * rows], rows);
        }
        // The current and the next block, as runs of rows (pages).
        let (mut k_runs, mut v_runs) = (Vec::new(), Vec::new());
        let (mut k_next, mut v_next) = (Vec::new(), Vec::new());
        let mut kv0 = keys.start;
        let mut cols = self.gather(kv0, keys.end, gemv, &mut k_runs, &mut v_runs);
        // An int8 cache's products in integers, the rows rounded once.
        let int8 = |k: &[Rows<'_>]| k.first().is_some_and(|r| matches!(r.data(), Stored::I8(_)));
        let products = match gemv {
            false => Products::Tiles,
            true if gemv_i8::available()
                && int8(&k_runs)
                && sc.q16.round(self.q, self.p.head_dim) =>
            {
                Products::Integer
            }
            true => Products::Vector,
        };
        while kv0 < keys.end {
            let next = kv0 + cols;
            let next_cols = self.gather(next, keys.end, gemv, &mut k_next, &mut v_next);
            if !gemv {
                // The next block may be on another page, where the hardware
                // prefetcher has no stream yet: start its loads now. (The
                // matrix-vector products ask for it a key at a time.)
                for run in k_next.iter().chain(&v_next) {
                    prefetch(run.span_bytes());
                }
            }
            sc.classes.clear();
            sc.classes.extend((0..g).map(|hh| {
                let h = Positions::to_i32(self.hkv * g + hh);
                tile_class(self.variant, b, h, (q_lo, q_hi), kv0, cols)
            }));
            if !sc.classes.iter().all(|&c| c == TileClass::Empty) {
                let next = [&k_next[..], &v_next[..]];
                let state = (&mut *m, best.as_deref_mut(), &mut *acc);
                self.block(&k_runs, &v_runs, (kv0, cols), next, products, state, sc);
            }
            std::mem::swap(&mut k_runs, &mut k_next);
            std::mem::swap(&mut v_runs, &mut v_next);
            (kv0, cols) = (next, next_cols);
        }
        for (l, lanes) in l.iter_mut().zip(&sc.l[..rows]) {
            *l = math::sum_lanes(lanes);
        }
    }
}

/// The elementwise step of one key block for all packed rows: `score` and
/// `mask` in place (an empty head's rows become `-inf` unevaluated), then
/// per row the online softmax: `P = e^(x − m_new)` in place, the running
/// max and per-lane sums, and the output row rescaled where the max grew.
struct BlockSoftmax<'a, 't, V> {
    task: &'a Task<'t, V>,
    classes: &'a [TileClass],
    kv_lo: i32,
    s: &'a mut [f32],
    m: &'a mut [f32],
    l: &'a mut [math::Lanes],
    alpha: &'a mut [f32],
    acc: &'a mut [f32],
    /// Each row's largest score so far, where the call returns it.
    best: Option<&'a mut [f32]>,
}

impl<V: HostVariant> Elementwise for BlockSoftmax<'_, '_, V> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let Self {
            task,
            classes,
            kv_lo,
            s,
            m,
            l,
            alpha,
            acc,
            mut best,
        } = self;
        let (dv, g, sq) = (task.p.head_dim_v, task.p.group(), task.p.seq_q);
        let rows = g * sq;
        let cols = s.len() / rows;
        let b = Positions::to_i32(task.b);
        let w = V::WEIGHTS;
        // Each row's scores, and its new running max (in `alpha` for now).
        for (r, row) in s.chunks_mut(cols).enumerate() {
            let hh = r / sq;
            let h = Positions::to_i32(task.hkv * g + hh);
            let (qi, _) = task.pos.query_range(r % sq, 1);
            match classes[hh] {
                TileClass::Empty => row.fill(f32::NEG_INFINITY),
                class => {
                    crate::cpu::forward::score_and_mask(task.variant, b, h, qi, kv_lo, class, row)
                }
            }
            alpha[r] = w.row_max(m[r], row, 1.0);
            if let Some(best) = best.as_deref_mut() {
                best[r] = best[r].max(math::max(row));
            }
        }
        w.rescale_rows(m, alpha);
        for (r, row) in s.chunks_mut(cols).enumerate() {
            if alpha[r] != 1.0 {
                l[r].iter_mut().for_each(|x| *x *= alpha[r]);
                math::scale(&mut acc[r * dv..(r + 1) * dv], alpha[r]);
            }
            l[r] = w.weigh_row(row, (m[r], 1.0), l[r]);
            if w.dropout {
                let h = Positions::to_i32(task.hkv * g + r / sq);
                if let Some(draw) = Draw::new(task.p, task.variant, b, h) {
                    let (qi, _) = task.pos.query_range(r % sq, 1);
                    draw.drop_row(qi, kv_lo, row);
                }
            }
        }
    }
}

/// Ask for every cache line of `x` ahead of its use (nothing off x86-64).
#[inline(always)]
fn prefetch(x: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in x.chunks(64) {
        // SAFETY: a prefetch is only a hint; it never faults, and the
        // address is in `x`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}
