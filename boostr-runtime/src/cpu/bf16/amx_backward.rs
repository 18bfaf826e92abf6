//! The bf16 backward on AMX tiles: the schedule of [`crate::cpu::backward`]
//! (tasks per (batch, kv head, chunk of key tiles), key tiles resident
//! while every query tile of the GQA group streams past, dQ partials added
//! in chunk order), with its five products on `tdpbf16ps` (see
//! [`crate::cpu::amx`]; or `vdpbf16ps` as the forward, [`amx::Products`]) and
//! everything between them the f32 kernel's own code
//! ([`Probabilities`], [`ScoreGrads`], the tile classifier).
//!
//! Roundings, where a GPU FlashAttention makes them: `Q`, `K`, `V`, `O`
//! and `dO` are bf16 already (the call's inputs, read as stored). `P`,
//! recomputed in f32 from the saved lse, is rounded to bf16 before
//! `dV += Pᵀ dO`; `dS` (times the softmax scale) is rounded to bf16 before
//! `dK += dSᵀ Q` and `dQ += dS K`, as the GPU kernels round them for their
//! tensor-core products. Everything else stays f32: the products
//! accumulate in f32, and so do the scores, `P` itself where `dS` is
//! formed, `dP`, `D_i = rowsum(dO ∘ O)`, the lse, and the dQ, dK and dV
//! accumulators.
//!
//! Layout, packed once per call so that no tile is copied per product:
//! - per query head, `Q` and `dO` row-major (the left operands of
//!   `S = Q Kᵀ` and `dP = dO Vᵀ`) and transposed (the left operands of
//!   `dKᵀ += Qᵀ dS` and `dVᵀ += dOᵀ P`), zero-padded to whole tiles;
//! - per kv head, `K` and `V` as pairs of dims per key (the right operands
//!   of `S` and `dP`), and `K` as pairs of keys per dim (that of `dQ`).
//!
//! So dK and dV are accumulated transposed (`D × BK` per key tile, rows of
//! dims), and `P` and `dS` go into the right operands as pairs of query
//! rows (two rows interleaved, no transpose); `dS` goes row-major into
//! `dQ`. A task transposes its dK and dV once per key tile at the end.
//!
//! Scope: as the AMX forward (head dims up to 256, padded inside to a
//! multiple of 32: the pad columns of Q, dO, K and V are zeros, and only
//! the first `D` columns of dQ, dK and dV are kept); any variant the tile
//! kernels run, a KV cache's lengths included (through `shifted::Cached`).
//! Learnable tensors read by `score` get their gradients pair by pair (or
//! by diagonal) from the tile's f32 `P` and `dP`, exactly as in the f32
//! backward, grouped into partial sums in a fixed order (see
//! `backward::learnable_tasks`); sinks' gradients come from the same row
//! pass as in f32. Partial tiles run the mask over the whole tile (one
//! band).

use crate::cpu::aligned::Aligned;
use crate::cpu::amx::{self, Kind, Products};
use crate::cpu::amx_forward::{Dims, dims, zero_unseen_keys};
use crate::cpu::backward::{
    KeyChunk, add_partials, carve, chunk_keys, deltas, dq_partials, learnable_tasks, sinks,
};
use crate::cpu::grads::{Probabilities, ScoreGrads, dropped, learnable_terms};
use crate::cpu::par::ForEachDyn as _;
use crate::cpu::tile::CpuTiles;
use crate::cpu::{Band, Positions, all_finite_bits, gemm, math, simd, tile_class};
use crate::problem::Problem;
use crate::variant::{HostVariant, TileClass};
use rayon::prelude::*;
use std::marker::PhantomData;

/// Query rows and keys per tile.
const BQ: usize = 64;
const BK: usize = 64;
/// Rows of a tile register.
const T: usize = amx::TILE;

/// The tiles the schedule (chunks, kv groups) is planned with.
pub(in crate::cpu) const TILES: CpuTiles = CpuTiles { q: BQ, kv: BK };

/// Whether the bf16 backward runs `p`: where the bf16 forward does (both
/// head dims at most 256).
pub(in crate::cpu) fn applies(p: &Problem) -> bool {
    crate::cpu::amx_forward::applies(p)
}

/// The backward's bf16 inputs (bits), in the layout of [`Problem`], and the
/// forward's f32 lse.
#[derive(Clone, Copy)]
pub(in crate::cpu) struct Inputs<'a> {
    pub(in crate::cpu) q: &'a [u16],
    pub(in crate::cpu) k: &'a [u16],
    pub(in crate::cpu) v: &'a [u16],
    pub(in crate::cpu) out: &'a [u16],
    pub(in crate::cpu) dout: &'a [u16],
    pub(in crate::cpu) lse: &'a [f32],
    pub(in crate::cpu) dlse: Option<&'a [f32]>,
}

/// bf16 bits widened to f32.
#[inline(always)]
fn widen(x: u16) -> f32 {
    f32::from_bits(u32::from(x) << 16)
}

/// `rows × d` bf16 rows as VNNI pairs of rows: `dst[r][c] = (src[2r][c],
/// src[2r + 1][c])`, zero past the last row, `dst.len() / d` pair rows.
fn pair_rows(src: &[u16], d: usize, dst: &mut [u32]) {
    for (r, dst) in dst.chunks_exact_mut(d).enumerate() {
        let lo = src.get(2 * r * d..(2 * r + 1) * d);
        let hi = src.get((2 * r + 1) * d..(2 * r + 2) * d);
        match (lo, hi) {
            (Some(lo), Some(hi)) => {
                for ((o, &l), &h) in dst.iter_mut().zip(lo).zip(hi) {
                    *o = u32::from(l) | (u32::from(h) << 16);
                }
            }
            (Some(lo), None) => dst.iter_mut().zip(lo).for_each(|(o, &l)| *o = u32::from(l)),
            _ => dst.fill(0),
        }
    }
}

/// The u32 transpose of `rows × cols` u32 into `dst` with rows `dst_rs`
/// apart (a bit-preserving f32 transpose).
fn transpose_u32(src: &[u32], rows: usize, cols: usize, dst: &mut [u32], dst_rs: usize) {
    // SAFETY: u32 and f32 have the same size and alignment, and any bits
    // are an f32 to move.
    let (src, dst) = unsafe {
        (
            std::slice::from_raw_parts(src.as_ptr().cast::<f32>(), src.len()),
            std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<f32>(), dst.len()),
        )
    };
    gemm::transpose(src, rows, cols, dst, dst_rs);
}

/// `rows × d` bf16 rows as pairs of dims per row, transposed: `dst[c][r] =
/// (src[r][2c], src[r][2c + 1])`, rows `dst_rs` apart (columns past `rows`
/// untouched).
fn dim_pairs(src: &[u16], rows: usize, d: usize, dst: &mut [u32], dst_rs: usize) {
    let pairs: Vec<u32> = src
        .chunks_exact(2)
        .map(|p| u32::from(p[0]) | (u32::from(p[1]) << 16))
        .collect();
    transpose_u32(&pairs, rows, d / 2, dst, dst_rs);
}

/// `rows × d` bf16 rows with each row zero-padded to `dp` (borrowed as
/// they are when `dp == d`).
fn padded(src: &[u16], d: usize, dp: usize) -> std::borrow::Cow<'_, [u16]> {
    if dp == d {
        return std::borrow::Cow::Borrowed(src);
    }
    let mut out = vec![0u16; src.len() / d.max(1) * dp];
    for (dst, row) in out.chunks_exact_mut(dp).zip(src.chunks_exact(d)) {
        dst[..d].copy_from_slice(row);
    }
    std::borrow::Cow::Owned(out)
}

/// One query head's Q or dO, as the products read it (`Dp` the padded
/// head dim, see [`crate::cpu::amx_forward::padded_dim`]: of `D` for Q, of
/// `Dv` for dO).
struct RowPack {
    /// `sq_pad × Dp` bf16, zero past the last row and dim.
    rows: Aligned<u16>,
    /// `Dp × sq_pad` bf16 (the transpose), zero past the last row: `Dp`
    /// rows of `sq_pad / 2` query pairs, [`skewed`] apart.
    cols: Aligned<u32>,
    /// The row stride of `cols`, in bf16.
    cols_stride: usize,
}

/// A row stride of `n` u32 for the products' operands, one cache line
/// longer: rows a multiple of 4 KiB apart would share their L1 sets (and
/// alias each other's loads), and a product reads 4 rows of its left
/// operand, or its right operand's rows one after another, at once.
fn skewed(n: usize) -> usize {
    n + 16
}

/// `sq × d` bf16 rows packed for a tile size of [`BQ`], over `dp` dims.
fn pack_rows(src: &[u16], sq: usize, d: usize, dp: usize) -> RowPack {
    let src = padded(src, d, dp);
    let sq_pad = sq.next_multiple_of(BQ);
    let mut rows = Aligned::zeroed(sq_pad * dp);
    rows[..sq * dp].copy_from_slice(&src);
    let mut pairs = Aligned::zeroed(sq_pad / 2 * dp);
    pair_rows(&src, dp, &mut pairs);
    let stride = skewed(sq_pad / 2);
    let mut cols = Aligned::zeroed(dp * stride);
    transpose_u32(&pairs, sq_pad / 2, dp, &mut cols, stride);
    RowPack {
        rows,
        cols,
        cols_stride: 2 * stride,
    }
}

/// One kv head's K and V, as the products read them (`sk_pad` keys, zero
/// past the last, and `Dp` dims for K, `Dvp` for V, zero past the last).
struct KvPack {
    /// `Dp/2` rows of `sk_pad` u32, `dims_stride` apart: `(K[key][2c],
    /// K[key][2c + 1])`.
    k_dims: Aligned<u32>,
    /// The row stride of `k_dims` and `v_dims` ([`skewed`]).
    dims_stride: usize,
    /// `sk_pad / 2` rows of `Dp` u32: `(K[2r][c], K[2r + 1][c])`.
    k_keys: Aligned<u32>,
    /// As `k_dims`, for V: `Dvp/2` rows.
    v_dims: Aligned<u32>,
    /// Per key tile: K holds a NaN or an infinity.
    k_nonfinite: Vec<bool>,
}

fn pack_kv(k: &[u16], v: &[u16], sk: usize, ((d, dp), (dv, dvp)): Dims) -> KvPack {
    let k_nonfinite = k.chunks(BK * d).map(|t| !all_finite_bits(t)).collect();
    let (k, v) = (padded(k, d, dp), padded(v, dv, dvp));
    let sk_pad = sk.next_multiple_of(BK);
    let stride = skewed(sk_pad);
    let mut k_dims = Aligned::zeroed(dp / 2 * stride);
    let mut v_dims = Aligned::zeroed(dvp / 2 * stride);
    dim_pairs(&k, sk, dp, &mut k_dims, stride);
    dim_pairs(&v, sk, dvp, &mut v_dims, stride);
    let mut k_keys = Aligned::zeroed(sk_pad / 2 * dp);
    pair_rows(&k, dp, &mut k_keys);
    KvPack {
        k_dims,
        dims_stride: stride,
        k_keys,
        v_dims,
        k_nonfinite,
    }
}

/// Everything a task reads.
struct Shared<'a, V> {
    variant: &'a V,
    kind: Kind,
    p: &'a Problem,
    pos: Positions,
    kv_group: usize,
    q: &'a [RowPack],
    dout: &'a [RowPack],
    kv: &'a [KvPack],
    lse: &'a [f32],
    delta: &'a [f32],
}

/// Per-thread scratch.
struct Scratch {
    /// Scores, then P (`BQ × BK` f32).
    s: Aligned<f32>,
    /// `score_grad` of the logits (empty where it is 1).
    g: Aligned<f32>,
    /// With dropout, `P Z` (the weights `P V` used).
    pd: Aligned<f32>,
    /// dP, then dS.
    dp: Aligned<f32>,
    /// P as pairs of rows (`BQ/2 × BK`), and `scale · dS` so.
    p_pairs: Aligned<u32>,
    ds_pairs: Aligned<u32>,
    /// `scale · dS` row-major bf16 of a query tile against the pass's key
    /// tiles side by side (`BQ × kv_group·BK`).
    ds: Aligned<u16>,
    /// dQ rows of a query tile whose rows the product cannot take in
    /// place (fewer than 64, or a padded head dim): `BQ × Dp`.
    dq: Aligned<f32>,
    /// The transposed dK and dV of a pass's key tiles (`Dp × BK` and
    /// `Dvp × BK` each).
    dkt: Aligned<f32>,
    dvt: Aligned<f32>,
    /// One key tile's dK or dV rows, transposed back (`BK × Dp` or `BK ×
    /// Dvp`).
    rows: Aligned<f32>,
    /// A key tile's `k_keys` with the keys no row sees zeroed.
    k_guarded: Vec<u32>,
    bands: Vec<Band>,
    /// The scaled logits before `score`, for the derivatives of learnable
    /// reads (empty without them, or where they go by diagonal).
    raw: Vec<f32>,
    /// Per diagonal of a tile, the sum of its pairs' `dz` (learnable reads
    /// by position difference only).
    diag: Vec<f32>,
}

impl Scratch {
    fn new<V: HostVariant>(((_, dp), (_, dvp)): Dims, kv_group: usize, learn: bool) -> Self {
        let learn = learn && V::SCORE_READS_LEARNABLE;
        Self {
            s: Aligned::zeroed(BQ * BK),
            g: Aligned::zeroed(if V::SCORE_GRAD_IS_ONE { 0 } else { BQ * BK }),
            pd: Aligned::zeroed(if V::WEIGHTS.dropout { BQ * BK } else { 0 }),
            dp: Aligned::zeroed(BQ * BK),
            p_pairs: Aligned::zeroed(BQ / 2 * BK),
            ds_pairs: Aligned::zeroed(BQ / 2 * BK),
            ds: Aligned::zeroed(BQ * kv_group * BK),
            dq: Aligned::zeroed(BQ * dp),
            dkt: Aligned::zeroed(kv_group * dp * BK),
            dvt: Aligned::zeroed(kv_group * dvp * BK),
            rows: Aligned::zeroed(BK * dp.max(dvp)),
            k_guarded: Vec::new(),
            bands: Vec::with_capacity(1),
            raw: if learn && !V::SCORE_GRADS_BY_DIFFERENCE {
                vec![0.0; BQ * BK]
            } else {
                Vec::new()
            },
            diag: if learn && V::SCORE_GRADS_BY_DIFFERENCE {
                vec![0.0; BQ + BK]
            } else {
                Vec::new()
            },
        }
    }
}

/// The bf16 backward of `variant`: writes `dq`, `dk`, `dv` (f32) and the
/// sinks' learnable gradients into `tensor_grads` (one zeroed slice per
/// wanted slot, empty for the others); `chunks` and `kv_group` as planned
/// for [`TILES`].
///
/// # Panics
/// Unless [`applies`] to `p`.
#[allow(clippy::too_many_arguments)]
pub(in crate::cpu) fn backward<V: HostVariant>(
    variant: &V,
    p: &Problem,
    chunks: usize,
    kv_group: usize,
    x: Inputs<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    tensor_grads: &mut [Vec<f32>],
) {
    assert!(applies(p), "the bf16 backward runs {p:?}");
    let kind = amx::kind().expect("applies");
    let sizes = dims(p);
    let delta = deltas((x.dout, x.out, x.dlse), p.head_dim_v, |a, b| {
        a.iter().zip(b).map(|(&a, &b)| widen(a) * widen(b)).sum()
    });
    let Packs { q, dout, kv } = Packs::new(p, &x);

    let (chunk_keys, chunks) = chunk_keys(p, TILES, chunks);
    let mut partials = dq_partials(p, chunks);
    let tasks = carve(p, chunk_keys, dq, dk, dv, &mut partials);
    let shared = Shared {
        variant,
        kind,
        p,
        pos: Positions::new(p),
        kv_group,
        q: &q,
        dout: &dout,
        kv: &kv,
        lse: x.lse,
        delta: &delta,
    };
    if V::SCORE_READS_LEARNABLE && tensor_grads.iter().any(|g| !g.is_empty()) {
        learnable_tasks(
            tasks,
            tensor_grads,
            &|| Scratch::new::<V>(sizes, kv_group, true),
            &|task, sc, grads| key_chunk(&shared, task, sc, grads),
        );
    } else {
        tasks.into_par_iter().for_each_init_dyn(
            &|| Scratch::new::<V>(sizes, kv_group, false),
            &|sc, task| key_chunk(&shared, task, sc, &mut []),
        );
    }
    if V::WEIGHTS.sink {
        sinks(variant, p, x.lse, &delta, tensor_grads);
    }
    add_partials(p, chunks, dq, &partials);
}

/// Q, dO, K and V packed for the tile products, per head: made once per
/// call (not generic over the variant, so its parallel loops are compiled
/// once).
struct Packs {
    q: Vec<RowPack>,
    dout: Vec<RowPack>,
    kv: Vec<KvPack>,
}

impl Packs {
    fn new(p: &Problem, x: &Inputs<'_>) -> Self {
        let (sq, sk) = (p.seq_q, p.seq_k);
        let sizes @ ((d, dp), (dv, dvp)) = dims(p);
        let rows = |t: &[u16], d: usize, dp: usize| -> Vec<RowPack> {
            t.par_chunks(sq * d)
                .map(|h| pack_rows(h, sq, d, dp))
                .collect()
        };
        let kv =
            x.k.par_chunks(sk * d)
                .zip(x.v.par_chunks(sk * dv))
                .map(|(k, v)| pack_kv(k, v, sk, sizes))
                .collect();
        Self {
            q: rows(x.q, d, dp),
            dout: rows(x.dout, dv, dvp),
            kv,
        }
    }
}

/// One task: the chunk's key tiles, `kv_group` at a time, against every
/// query tile of every query head of the group.
fn key_chunk<V: HostVariant>(
    sh: &Shared<'_, V>,
    task: KeyChunk<'_>,
    sc: &mut Scratch,
    grads: &mut [&mut [f32]],
) {
    let p = sh.p;
    let (sq, group) = (p.seq_q, p.group());
    let ((d, dp), (d_v, dvp)) = dims(p);
    let KeyChunk {
        b,
        kvh,
        key0,
        dk,
        dv,
        dq,
    } = task;
    dq.fill(0.0);
    let kv = &sh.kv[b * p.heads_kv + kvh];
    // SAFETY: `sh.kind` came from `amx::kind()` on the calling thread,
    // whose pool's threads are capped alike.
    let tiles = unsafe { Products::start(sh.kind) };
    let pass_keys = sh.kv_group * BK;
    let per_pass = dk
        .chunks_mut(pass_keys * d)
        .zip(dv.chunks_mut(pass_keys * d_v));
    for (n, (dk, dv)) in per_pass.enumerate() {
        let kv0 = key0 + n * pass_keys;
        let keys = dk.len() / d;
        let n_tiles = keys.div_ceil(BK);
        sc.dkt[..n_tiles * dp * BK].fill(0.0);
        sc.dvt[..n_tiles * dvp * BK].fill(0.0);
        for hl in 0..group {
            let h = kvh * group + hl;
            let bh = b * p.heads_q + h;
            for r0 in (0..sq).step_by(BQ) {
                let rows = BQ.min(sq - r0);
                let dq_t = &mut dq[(hl * sq + r0) * d..(hl * sq + r0 + rows) * d];
                // The key tiles this query tile computed, first to last.
                let mut done = (n_tiles, 0);
                for t in 0..n_tiles {
                    let k0 = kv0 + t * BK;
                    let at = TileAt {
                        b,
                        h,
                        bh,
                        r0,
                        rows,
                        kv0: k0,
                        cols: BK.min(kv0 + keys - k0),
                        acc: t,
                        wide: n_tiles * BK,
                    };
                    if step(sh, &tiles, kv, at, sc, grads) {
                        done = (done.0.min(t), t + 1);
                    }
                }
                if done.0 < done.1 {
                    let pass = (kv0, keys, n_tiles);
                    dq_tiles(sh, &tiles, kv, pass, done, rows, dq_t, sc);
                }
            }
        }
        // dK and dV rows, transposed back, their first `d` (`dv`) dims.
        for t in 0..n_tiles {
            let keys = t * BK..t * BK + BK.min(keys - t * BK);
            let dk = &mut dk[keys.start * d..keys.end * d];
            let dv = &mut dv[keys.start * d_v..keys.end * d_v];
            for (acc, dst, (d, dp)) in [(&sc.dkt, dk, (d, dp)), (&sc.dvt, dv, (d_v, dvp))] {
                let rows = &mut sc.rows[..BK * dp];
                gemm::transpose(&acc[t * dp * BK..(t + 1) * dp * BK], dp, BK, rows, dp);
                for (dst, src) in dst.chunks_exact_mut(d).zip(rows.chunks_exact(dp)) {
                    dst.copy_from_slice(&src[..d]);
                }
            }
        }
    }
}

/// One (query tile, key tile) step of a task.
#[derive(Clone, Copy)]
struct TileAt {
    b: usize,
    h: usize,
    /// Flat (batch, query head) index.
    bh: usize,
    /// Query rows `r0 .. r0 + rows` and keys `kv0 .. kv0 + cols`.
    r0: usize,
    rows: usize,
    kv0: usize,
    cols: usize,
    /// The key tile's accumulators in the pass, and its columns of the
    /// query tile's `scale · dS` rows (of `wide` keys: the pass's).
    acc: usize,
    wide: usize,
}

/// The contribution of one (query tile × key tile) to dK and dV and to
/// the learnable tensors' gradients in `grads` (empty: none wanted), and
/// its `scale · dS` for the query tile's dQ (see [`dq_tiles`]). Returns
/// whether the tile was computed (else its `dS` columns are zero).
fn step<V: HostVariant>(
    sh: &Shared<'_, V>,
    tiles: &Products,
    kv: &KvPack,
    at: TileAt,
    sc: &mut Scratch,
    grads: &mut [&mut [f32]],
) -> bool {
    let p = sh.p;
    let (sq, scale) = (p.seq_q, p.scale);
    let ((_, dp), (_, dvp)) = dims(p);
    let TileAt {
        rows,
        cols,
        kv0,
        r0,
        ..
    } = at;
    let (b, h) = (Positions::to_i32(at.b), Positions::to_i32(at.h));
    let (q_lo, q_hi) = sh.pos.query_range(r0, rows);
    let class = tile_class(sh.variant, b, h, (q_lo, q_hi), kv0, cols);
    if class == TileClass::Empty {
        for row in sc.ds.chunks_exact_mut(at.wide).take(BQ) {
            row[at.acc * BK..(at.acc + 1) * BK].fill(0);
        }
        return false;
    }
    let (qp, dop) = (&sh.q[at.bh], &sh.dout[at.bh]);
    // Rows and keys in whole 32s for the products (zero past the last).
    let m = rows.next_multiple_of(2 * T);
    let n = cols.next_multiple_of(2 * T);
    let (lse, delta) = (
        &sh.lse[at.bh * sq + r0..][..rows],
        &sh.delta[at.bh * sq + r0..][..rows],
    );
    let dkt = sc.dkt[at.acc * dp * BK..(at.acc + 1) * dp * BK].as_mut_ptr();
    let dvt = sc.dvt[at.acc * dvp * BK..(at.acc + 1) * dvp * BK].as_mut_ptr();
    let kv_lo = Positions::to_i32(kv0);

    // S = Q Kᵀ, then P = e^(score(scale·S) − lse) in place.
    // SAFETY (every product below): the packs hold whole tiles of 64 rows
    // and keys (zero past the ends) over dp (dvp for dO and V) dims, the
    // scratch tiles are 64 × 64, and m, n ≤ 64; AMX is configured.
    unsafe {
        tiles.product(
            (qp.rows[r0 * dp..].as_ptr(), dp),
            (kv.k_dims[kv0..].as_ptr(), kv.dims_stride),
            (sc.s.as_mut_ptr(), BK),
            (m, n, dp),
            false,
        );
    }
    let s = &mut sc.s[..rows * BK];
    sc.bands.clear();
    sc.bands.push(Band {
        rows: 0..rows,
        cols: 0..cols,
    });
    let learn = V::SCORE_READS_LEARNABLE && !grads.is_empty();
    if learn && !V::SCORE_GRADS_BY_DIFFERENCE {
        // The raw logits, scaled as `score` sees them.
        for (raw, &x) in sc.raw[..rows * BK].iter_mut().zip(s.iter()) {
            *raw = x * scale;
        }
    }
    let g = &mut sc.g[..if V::SCORE_GRAD_IS_ONE { 0 } else { rows * BK }];
    simd::dispatch(Probabilities {
        variant: sh.variant,
        b,
        h,
        q_lo,
        kv_lo,
        class,
        lse,
        s: &mut *s,
        scale,
        g: &mut *g,
        bands: &sc.bands,
    });
    let s = &*s;

    // dP = dO Vᵀ; with dropout, `P Z` and `dP Z` (as in the f32 backward).
    // SAFETY: as above.
    unsafe {
        tiles.product(
            (dop.rows[r0 * dvp..].as_ptr(), dvp),
            (kv.v_dims[kv0..].as_ptr(), kv.dims_stride),
            (sc.dp.as_mut_ptr(), BK),
            (m, n, dvp),
            false,
        );
    }
    let dp_t = &mut sc.dp[..rows * BK];
    let pd = &mut sc.pd[..if V::WEIGHTS.dropout { rows * BK } else { 0 }];
    let pd = dropped(
        p,
        sh.variant,
        (b, h),
        (q_lo, kv_lo),
        &sc.bands,
        BK,
        (s, pd, dp_t),
    );
    pair_round(pd.unwrap_or(s), rows, cols, 1.0, &mut sc.p_pairs, None);

    // dVᵀ += dOᵀ (P Z).
    let kq = rows.next_multiple_of(amx::DEPTH);
    // SAFETY: as above.
    unsafe {
        tiles.product(
            (dop.cols.as_ptr().cast::<u16>().add(r0), dop.cols_stride),
            (sc.p_pairs.as_ptr(), BK),
            (dvt, BK),
            (dvp, n, kq),
            true,
        );
    }

    // dS = d loss / d score ∘ score_grad in place over dP.
    let ds_at = (at.acc * BK, at.wide);
    let at = (b, h, q_lo, kv_lo);
    score_grads(sh, sc, at, (rows, cols, class), delta, grads, ds_at);

    // dKᵀ += Qᵀ (scale·dS).
    // SAFETY: as above.
    unsafe {
        tiles.product(
            (qp.cols.as_ptr().cast::<u16>().add(r0), qp.cols_stride),
            (sc.ds_pairs.as_ptr(), BK),
            (dkt, BK),
            (dp, n, kq),
            true,
        );
    }
    true
}

/// dQ += (scale·dS) K for one query tile of `rows` rows over the pass's
/// key tiles `t0 .. t1` (`pass`: its first key, keys and tiles), as one
/// product: the query tile's `scale · dS` rows in `sc.ds` hold every key
/// tile of the pass side by side, so dQ is read and written once per pass
/// instead of once per key tile. A key no row sees has dS = 0 in every
/// row, and must not bring a NaN of its K row into the product.
#[allow(clippy::too_many_arguments)]
fn dq_tiles<V: HostVariant>(
    sh: &Shared<'_, V>,
    tiles: &Products,
    kv: &KvPack,
    (kv0, keys, n_tiles): (usize, usize, usize),
    (t0, t1): (usize, usize),
    rows: usize,
    dq_t: &mut [f32],
    sc: &mut Scratch,
) {
    let ((d, dp), _) = dims(sh.p);
    let wide = n_tiles * BK;
    let k_lo = kv0 + t0 * BK;
    let span = (kv0 + keys).min(kv0 + t1 * BK) - k_lo;
    let kk = span.next_multiple_of(amx::DEPTH);
    let mut k_keys = &kv.k_keys[k_lo / 2 * dp..(k_lo + kk) / 2 * dp];
    let ds = &sc.ds[t0 * BK..(BQ - 1) * wide + t0 * BK + span];
    if (t0..t1).any(|t| kv.k_nonfinite[(kv0 + t * BK) / BK]) {
        k_keys = zero_unseen_keys(k_keys, dp, ds, wide, span, &mut sc.k_guarded);
    }
    let m = rows.next_multiple_of(2 * T);
    // SAFETY: the products are configured; `ds` holds m rows of `wide`
    // from its start, k_keys kk / 2 rows of dp pairs, sc.dq BQ rows of dp.
    unsafe {
        dq_product(
            tiles,
            (ds, wide, k_keys),
            (d, dp),
            (m, kk),
            dq_t,
            &mut sc.dq,
        )
    };
}

/// dS = d loss / d score ∘ score_grad in place over the tile's dP (after
/// adding the learnable tensors' terms, where `grads` wants them), then
/// its bf16 pairs scaled by `scale` into `sc.ds_pairs`, and its rows into
/// `sc.ds` from column `ds_col`, `ds_stride` apart.
fn score_grads<V: HostVariant>(
    sh: &Shared<'_, V>,
    sc: &mut Scratch,
    at: (i32, i32, i32, i32),
    (rows, cols, class): (usize, usize, TileClass),
    delta: &[f32],
    grads: &mut [&mut [f32]],
    (ds_col, ds_stride): (usize, usize),
) {
    let learn = V::SCORE_READS_LEARNABLE && !grads.is_empty();
    let s = &sc.s[..rows * BK];
    let g = &sc.g[..if V::SCORE_GRAD_IS_ONE { 0 } else { rows * BK }];
    let dp_t = &mut sc.dp[..rows * BK];
    if learn {
        let raw = &sc.raw[..if V::SCORE_GRADS_BY_DIFFERENCE {
            0
        } else {
            rows * BK
        }];
        learnable_terms(
            sh.variant,
            at,
            &sc.bands,
            (s, raw),
            dp_t,
            delta,
            &mut sc.diag,
            grads,
        );
    }
    simd::dispatch(ScoreGrads::<V> {
        p: s,
        g,
        delta,
        dp: &mut *dp_t,
        bands: &sc.bands,
        partial: class == TileClass::Partial,
        variant: PhantomData,
    });
    let ds = (&mut sc.ds[ds_col..], ds_stride);
    pair_round(dp_t, rows, cols, sh.p.scale, &mut sc.ds_pairs, Some(ds));
}

/// `dq_t += ds · k_keys` (`ds` `m` rows of [`BK`] bf16, `k_keys` the key
/// pairs over `dp` dims, `kk` keys): in place where `dq_t`'s rows are whole
/// tiles of the head dim (`m` rows of `d = dp`), else through `scratch`.
///
/// # Safety
/// The products are configured (`tiles`), `ds` holds `m` rows of [`BK`],
/// `k_keys` `kk / 2` rows of `dp` pairs, `scratch` [`BQ`] rows of `dp`.
unsafe fn dq_product(
    tiles: &Products,
    (ds, ds_stride, k_keys): (&[u16], usize, &[u32]),
    (d, dp): (usize, usize),
    (m, kk): (usize, usize),
    dq_t: &mut [f32],
    scratch: &mut [f32],
) {
    let direct = dq_t.len() == m * d && dp == d;
    let dq_rows = if direct {
        dq_t.as_mut_ptr()
    } else {
        scratch.fill(0.0);
        for (dst, src) in scratch.chunks_exact_mut(dp).zip(dq_t.chunks_exact(d)) {
            dst[..d].copy_from_slice(src);
        }
        scratch.as_mut_ptr()
    };
    // SAFETY: the caller's promises; dq_rows holds m rows of dp.
    unsafe {
        tiles.product(
            (ds.as_ptr(), ds_stride),
            (k_keys.as_ptr(), dp),
            (dq_rows, dp),
            (m, dp, kk),
            true,
        );
    }
    if !direct {
        for (dst, src) in dq_t.chunks_exact_mut(d).zip(scratch.chunks_exact(dp)) {
            dst.copy_from_slice(&src[..d]);
        }
    }
}

/// `scale · x` (rows of [`BK`], the first `cols` of each of `rows` rows)
/// rounded to bf16 into `pairs` as pairs of rows, and row-major into
/// `plain` if given (rows `stride` apart, [`BK`] of each); zero elsewhere
/// in both, to whole tiles.
fn pair_round(
    x: &[f32],
    rows: usize,
    cols: usize,
    scale: f32,
    pairs: &mut [u32],
    plain: Option<(&mut [u16], usize)>,
) {
    // SAFETY: every CPU with AMX has AVX-512 (checked by `applies`).
    unsafe { pair_round_avx512(x, rows, cols, scale, pairs, plain) };
}

#[target_feature(enable = "avx512f,avx512bw")]
fn pair_round_avx512(
    x: &[f32],
    rows: usize,
    cols: usize,
    scale: f32,
    pairs: &mut [u32],
    mut plain: Option<(&mut [u16], usize)>,
) {
    const ZERO: [f32; BK] = [0.0; BK];
    let row = |i: usize| -> &[f32; BK] {
        match x.get(i * BK..(i + 1) * BK) {
            Some(r) if i < rows => r.try_into().expect("a row of BK"),
            _ => &ZERO,
        }
    };
    let round = |x: f32| u32::from(math::bf16_bits(scale * x));
    for (r, dst) in pairs.chunks_exact_mut(BK).enumerate() {
        let (lo, hi) = (row(2 * r), row(2 * r + 1));
        let dst: &mut [u32; BK] = dst.try_into().expect("a row of BK");
        for j in 0..BK {
            dst[j] = round(lo[j]) | (round(hi[j]) << 16);
        }
        dst[cols..].fill(0);
        if let Some((plain, stride)) = plain.as_mut() {
            for (i, src) in [(2 * r, lo), (2 * r + 1, hi)] {
                let out: &mut [u16; BK] = (&mut plain[i * *stride..i * *stride + BK])
                    .try_into()
                    .expect("a row of BK");
                for j in 0..BK {
                    out[j] = round(src[j]) as u16;
                }
                out[cols..].fill(0);
            }
        }
    }
}
