//! The bf16 backward on AMX tiles: the schedule of [`super::backward`]
//! (tasks per (batch, kv head, chunk of key tiles), key tiles resident
//! while every query tile of the GQA group streams past, dQ partials added
//! in chunk order), with its five products on `tdpbf16ps` (see
//! [`super::amx`]; or `vdpbf16ps` as the forward, [`amx::Products`]) and
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
//! Scope: as the AMX forward (head dims that are multiples of 32 up to
//! 256), and no learnable tensor read by `score` whose gradient is wanted
//! (those run the f32 kernel on widened inputs); sinks' gradients come from
//! the same row pass as in f32. Partial tiles run the mask over the whole
//! tile (one band).

use super::aligned::Aligned;
use super::amx::{self, Kind, Products};
use super::amx_forward::{round_bf16, zero_unseen_keys};
use super::backward::{
    KeyChunk, Probabilities, ScoreGrads, add_partials, carve, chunk_keys, deltas, dq_partials,
    sinks,
};
use super::tile::CpuTiles;
use super::{Band, Positions, all_finite_bits, gemm, simd, tile_class};
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
pub(super) const TILES: CpuTiles = CpuTiles { q: BQ, kv: BK };

/// Whether the bf16 backward runs `p`: the bf16 forward does, and no
/// learnable tensor read by `score` wants its gradient (`learn`).
pub(super) fn applies<V: HostVariant>(_: &V, p: &Problem, learn: bool) -> bool {
    super::amx_forward::applies(p) && !(V::SCORE_READS_LEARNABLE && learn)
}

/// The backward's bf16 inputs (bits), in the layout of [`Problem`], and the
/// forward's f32 lse.
#[derive(Clone, Copy)]
pub(super) struct Inputs<'a> {
    pub(super) q: &'a [u16],
    pub(super) k: &'a [u16],
    pub(super) v: &'a [u16],
    pub(super) out: &'a [u16],
    pub(super) dout: &'a [u16],
    pub(super) lse: &'a [f32],
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

/// One query head's Q or dO, as the products read it.
struct RowPack {
    /// `sq_pad × D` bf16, zero past the last row.
    rows: Aligned<u16>,
    /// `D × sq_pad` bf16 (the transpose), zero past the last row: `D` rows
    /// of `sq_pad / 2` query pairs.
    cols: Aligned<u32>,
}

/// `sq × d` bf16 rows packed for a tile size of [`BQ`].
fn pack_rows(src: &[u16], sq: usize, d: usize) -> RowPack {
    let sq_pad = sq.next_multiple_of(BQ);
    let mut rows = Aligned::zeroed(sq_pad * d);
    rows[..sq * d].copy_from_slice(src);
    let mut pairs = Aligned::zeroed(sq_pad / 2 * d);
    pair_rows(src, d, &mut pairs);
    let mut cols = Aligned::zeroed(d * sq_pad / 2);
    transpose_u32(&pairs, sq_pad / 2, d, &mut cols, sq_pad / 2);
    RowPack { rows, cols }
}

/// One kv head's K and V, as the products read them (`sk_pad` keys, zero
/// past the last).
struct KvPack {
    /// `D/2` rows of `sk_pad` u32: `(K[key][2c], K[key][2c + 1])`.
    k_dims: Aligned<u32>,
    /// `sk_pad / 2` rows of `D` u32: `(K[2r][c], K[2r + 1][c])`.
    k_keys: Aligned<u32>,
    /// As `k_dims`, for V.
    v_dims: Aligned<u32>,
    /// Per key tile: K holds a NaN or an infinity.
    k_nonfinite: Vec<bool>,
}

fn pack_kv(k: &[u16], v: &[u16], sk: usize, d: usize) -> KvPack {
    let sk_pad = sk.next_multiple_of(BK);
    let mut k_dims = Aligned::zeroed(d / 2 * sk_pad);
    let mut v_dims = Aligned::zeroed(d / 2 * sk_pad);
    dim_pairs(k, sk, d, &mut k_dims, sk_pad);
    dim_pairs(v, sk, d, &mut v_dims, sk_pad);
    let mut k_keys = Aligned::zeroed(sk_pad / 2 * d);
    pair_rows(k, d, &mut k_keys);
    KvPack {
        k_dims,
        k_keys,
        v_dims,
        k_nonfinite: k.chunks(BK * d).map(|t| !all_finite_bits(t)).collect(),
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
    /// `score_grad` of the logits (empty for identity scores).
    g: Aligned<f32>,
    /// dP, then dS.
    dp: Aligned<f32>,
    /// P as pairs of rows (`BQ/2 × BK`), and `scale · dS` so.
    p_pairs: Aligned<u32>,
    ds_pairs: Aligned<u32>,
    /// `scale · dS` row-major bf16 (`BQ × BK`).
    ds: Aligned<u16>,
    /// dQ rows of a last query tile of fewer than 64 rows.
    dq: Aligned<f32>,
    /// The transposed dK and dV of a pass's key tiles (`D × BK` each).
    dkt: Aligned<f32>,
    dvt: Aligned<f32>,
    /// One key tile's dK or dV rows, transposed back.
    rows: Aligned<f32>,
    /// A key tile's `k_keys` with the keys no row sees zeroed.
    k_guarded: Vec<u32>,
    bands: Vec<Band>,
}

impl Scratch {
    fn new<V: HostVariant>(d: usize, kv_group: usize) -> Self {
        Self {
            s: Aligned::zeroed(BQ * BK),
            g: Aligned::zeroed(if V::SCORE_IS_IDENTITY { 0 } else { BQ * BK }),
            dp: Aligned::zeroed(BQ * BK),
            p_pairs: Aligned::zeroed(BQ / 2 * BK),
            ds_pairs: Aligned::zeroed(BQ / 2 * BK),
            ds: Aligned::zeroed(BQ * BK),
            dq: Aligned::zeroed(BQ * d),
            dkt: Aligned::zeroed(kv_group * d * BK),
            dvt: Aligned::zeroed(kv_group * d * BK),
            rows: Aligned::zeroed(BK * d),
            k_guarded: Vec::new(),
            bands: Vec::with_capacity(1),
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
pub(super) fn backward<V: HostVariant>(
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
    let learn = tensor_grads.iter().any(|g| !g.is_empty());
    assert!(applies(variant, p, learn), "the bf16 backward runs {p:?}");
    let kind = amx::kind().expect("applies");
    let (sq, sk, d) = (p.seq_q, p.seq_k, p.head_dim);
    let delta = deltas(x.dout, x.out, d, |a, b| {
        a.iter().zip(b).map(|(&a, &b)| widen(a) * widen(b)).sum()
    });
    let q: Vec<RowPack> =
        x.q.par_chunks(sq * d)
            .map(|q| pack_rows(q, sq, d))
            .collect();
    let dout: Vec<RowPack> = x
        .dout
        .par_chunks(sq * d)
        .map(|o| pack_rows(o, sq, d))
        .collect();
    let kv: Vec<KvPack> =
        x.k.par_chunks(sk * d)
            .zip(x.v.par_chunks(sk * d))
            .map(|(k, v)| pack_kv(k, v, sk, d))
            .collect();

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
    tasks.into_par_iter().for_each_init(
        || Scratch::new::<V>(d, kv_group),
        |sc, task| key_chunk(&shared, task, sc),
    );
    if V::HAS_SINK {
        sinks(variant, p, x.lse, &delta, tensor_grads);
    }
    add_partials(p, chunks, dq, &partials);
}

/// One task: the chunk's key tiles, `kv_group` at a time, against every
/// query tile of every query head of the group.
fn key_chunk<V: HostVariant>(sh: &Shared<'_, V>, task: KeyChunk<'_>, sc: &mut Scratch) {
    let p = sh.p;
    let (sq, d, group) = (p.seq_q, p.head_dim, p.group());
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
        .zip(dv.chunks_mut(pass_keys * d));
    for (n, (dk, dv)) in per_pass.enumerate() {
        let kv0 = key0 + n * pass_keys;
        let keys = dk.len() / d;
        let n_tiles = keys.div_ceil(BK);
        sc.dkt[..n_tiles * d * BK].fill(0.0);
        sc.dvt[..n_tiles * d * BK].fill(0.0);
        for hl in 0..group {
            let h = kvh * group + hl;
            let bh = b * p.heads_q + h;
            for r0 in (0..sq).step_by(BQ) {
                let rows = BQ.min(sq - r0);
                let dq_t = &mut dq[(hl * sq + r0) * d..(hl * sq + r0 + rows) * d];
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
                    };
                    step(sh, &tiles, kv, at, dq_t, sc);
                }
            }
        }
        // dK and dV rows, transposed back.
        for t in 0..n_tiles {
            let cols = BK.min(keys - t * BK);
            let out = t * BK * d..(t * BK + cols) * d;
            for (acc, dst) in [(&sc.dkt, &mut dk[out.clone()]), (&sc.dvt, &mut dv[out])] {
                gemm::transpose(&acc[t * d * BK..(t + 1) * d * BK], d, BK, &mut sc.rows, d);
                dst.copy_from_slice(&sc.rows[..cols * d]);
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
    /// The key tile's accumulators in the pass.
    acc: usize,
}

/// The contribution of one (query tile × key tile) to dK, dV and dQ.
fn step<V: HostVariant>(
    sh: &Shared<'_, V>,
    tiles: &Products,
    kv: &KvPack,
    at: TileAt,
    dq_t: &mut [f32],
    sc: &mut Scratch,
) {
    let p = sh.p;
    let (sq, d, scale) = (p.seq_q, p.head_dim, p.scale);
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
        return;
    }
    let (sq_pad, sk_pad) = (sq.next_multiple_of(BQ), p.seq_k.next_multiple_of(BK));
    let (qp, dop) = (&sh.q[at.bh], &sh.dout[at.bh]);
    // Rows and keys in whole 32s for the products (zero past the last).
    let m = rows.next_multiple_of(2 * T);
    let n = cols.next_multiple_of(2 * T);
    let (lse, delta) = (
        &sh.lse[at.bh * sq + r0..][..rows],
        &sh.delta[at.bh * sq + r0..][..rows],
    );
    let dkt = sc.dkt[at.acc * d * BK..(at.acc + 1) * d * BK].as_mut_ptr();
    let dvt = sc.dvt[at.acc * d * BK..(at.acc + 1) * d * BK].as_mut_ptr();

    // S = Q Kᵀ, then P = e^(score(scale·S) − lse) in place.
    // SAFETY (every product below): the packs hold whole tiles of 64 rows
    // and keys (zero past the ends), the scratch tiles are 64 × 64, and
    // m, n ≤ 64, the dims d; AMX is configured.
    unsafe {
        tiles.product(
            (qp.rows[r0 * d..].as_ptr(), d),
            (kv.k_dims[kv0..].as_ptr(), sk_pad),
            (sc.s.as_mut_ptr(), BK),
            (m, n, d),
            false,
        );
    }
    let s = &mut sc.s[..rows * BK];
    sc.bands.clear();
    sc.bands.push(Band {
        rows: 0..rows,
        cols: 0..cols,
    });
    let g = &mut sc.g[..if V::SCORE_IS_IDENTITY { 0 } else { rows * BK }];
    simd::dispatch(Probabilities {
        variant: sh.variant,
        b,
        h,
        q_lo,
        kv_lo: Positions::to_i32(kv0),
        class,
        lse,
        s: &mut *s,
        scale,
        g: &mut *g,
        bands: &sc.bands,
    });
    let (s, g) = (&*s, &*g);
    pair_round(s, rows, cols, 1.0, &mut sc.p_pairs, None);

    // dVᵀ += dOᵀ P.
    let kq = rows.next_multiple_of(amx::DEPTH);
    // SAFETY: as above.
    unsafe {
        tiles.product(
            (dop.cols.as_ptr().cast::<u16>().add(r0), sq_pad),
            (sc.p_pairs.as_ptr(), BK),
            (dvt, BK),
            (d, n, kq),
            true,
        );
    }

    // dP = dO Vᵀ, then dS = P ∘ (dP − D) ∘ score_grad in place.
    // SAFETY: as above.
    unsafe {
        tiles.product(
            (dop.rows[r0 * d..].as_ptr(), d),
            (kv.v_dims[kv0..].as_ptr(), sk_pad),
            (sc.dp.as_mut_ptr(), BK),
            (m, n, d),
            false,
        );
    }
    let dp = &mut sc.dp[..rows * BK];
    simd::dispatch(ScoreGrads::<V> {
        p: s,
        g,
        delta,
        dp: &mut *dp,
        bands: &sc.bands,
        partial: class == TileClass::Partial,
        variant: PhantomData,
    });
    pair_round(dp, rows, cols, scale, &mut sc.ds_pairs, Some(&mut sc.ds));

    // dKᵀ += Qᵀ (scale·dS).
    // SAFETY: as above.
    unsafe {
        tiles.product(
            (qp.cols.as_ptr().cast::<u16>().add(r0), sq_pad),
            (sc.ds_pairs.as_ptr(), BK),
            (dkt, BK),
            (d, n, kq),
            true,
        );
    }

    // dQ += (scale·dS) K. On a partial tile a key no row sees has dS = 0
    // in every row, and must not bring a NaN of its K row into the product.
    let mut k_keys = &kv.k_keys[kv0 / 2 * d..(kv0 + BK) / 2 * d];
    if class == TileClass::Partial && kv.k_nonfinite[kv0 / BK] {
        k_keys = zero_unseen_keys(k_keys, d, s, BK, cols, &mut sc.k_guarded);
    }
    let kk = cols.next_multiple_of(amx::DEPTH);
    let direct = rows == m;
    let dq_rows = if direct {
        dq_t.as_mut_ptr()
    } else {
        sc.dq[..rows * d].copy_from_slice(dq_t);
        sc.dq[rows * d..].fill(0.0);
        sc.dq.as_mut_ptr()
    };
    // SAFETY: as above; dq_rows holds m rows of d.
    unsafe {
        tiles.product(
            (sc.ds.as_ptr(), BK),
            (k_keys.as_ptr(), d),
            (dq_rows, d),
            (m, d, kk),
            true,
        );
    }
    if !direct {
        dq_t.copy_from_slice(&sc.dq[..rows * d]);
    }
}

/// `scale · x` (rows of [`BK`], the first `cols` of each of `rows` rows)
/// rounded to bf16 into `pairs` as pairs of rows, and row-major into
/// `plain` if given; zero elsewhere in both, to whole tiles.
fn pair_round(
    x: &[f32],
    rows: usize,
    cols: usize,
    scale: f32,
    pairs: &mut [u32],
    plain: Option<&mut [u16]>,
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
    mut plain: Option<&mut [u16]>,
) {
    const ZERO: [f32; BK] = [0.0; BK];
    let row = |i: usize| -> &[f32; BK] {
        match x.get(i * BK..(i + 1) * BK) {
            Some(r) if i < rows => r.try_into().expect("a row of BK"),
            _ => &ZERO,
        }
    };
    let round = |x: f32| u32::from(round_bf16(scale * x));
    for (r, dst) in pairs.chunks_exact_mut(BK).enumerate() {
        let (lo, hi) = (row(2 * r), row(2 * r + 1));
        let dst: &mut [u32; BK] = dst.try_into().expect("a row of BK");
        for j in 0..BK {
            dst[j] = round(lo[j]) | (round(hi[j]) << 16);
        }
        dst[cols..].fill(0);
        if let Some(plain) = plain.as_deref_mut() {
            for (i, src) in [(2 * r, lo), (2 * r + 1, hi)] {
                let out: &mut [u16; BK] = (&mut plain[i * BK..(i + 1) * BK])
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
