//! The bf16 forward on AMX tiles: FlashAttention-2 as in [`crate::cpu::forward`],
//! with both tile products (`S = Q Kᵀ` and `O += P V`) on `tdpbf16ps` (see
//! [`crate::cpu::amx`]), or on AVX512-BF16's `vdpbf16ps` where there is no AMX
//! and that pays (`crate::cpu::bf16_dot`: the same operands and layouts), and
//! everything between them in f32.
//!
//! Roundings, where a GPU FlashAttention makes them: `Q`, `K` and `V` are
//! bf16 already (the call's inputs, read as stored); `P = e^(x − m)` is
//! rounded to bf16 (to nearest, ties to even) right before `P V`, as the
//! GPU kernels round it for their tensor-core product. Everything else
//! stays f32: the products accumulate in f32 (each `tdpbf16ps` adds 32
//! products into f32, pairs fused), the scores, the mask, the softmax
//! statistics, the row sums (of the unrounded `P`), the output accumulator
//! and the lse.
//!
//! Layout: every kv head's K is packed once per call, tile by tile, as the
//! right-hand operand of `Q Kᵀ` wants it (`Dp/2` rows of 128 keys' bf16
//! pairs, `Dp` the head dim rounded up to 32, see [`padded_dim`]), and V as
//! that of `P V` wants it (64 rows of key pairs, each `Dvp` pairs, `Dvp`
//! the value head dim rounded up likewise), zero past the last key and
//! dim. A task (batch, query head, up to four tiles
//! of 64 query rows, see [`MAX_GROUP`]) copies each tile's Q rows into a
//! zero-padded 64 × Dp block and then streams the key tiles, each through
//! every query tile in turn: scores into a 64 × 128 f32 block (the softmax
//! scales them there, row by row), `P` rounded into a 64 × 128 bf16 block,
//! and `P V` added into the tile's own 64 × Dvp f32 accumulator, whose
//! first `Dv` columns are normalised into `out` at the end.
//!
//! Scope: head dims (`D` and `Dv`) up to 256, on CPUs with AMX or a `vdpbf16ps` that pays
//! (see [`applies`]); partial tiles run the mask over the whole tile (one
//! band), since a tile product costs less than the bookkeeping of bands.

use crate::cpu::aligned::Aligned;
use crate::cpu::amx::{self, Kind, Products};
use crate::cpu::elem::Stored;
use crate::cpu::forward::{Head, OnlineSoftmax, finish_rows, start_rows};
use crate::cpu::keys::KeyRows;
use crate::cpu::operand::{Operand, Rows};
use crate::cpu::par::ForEachDyn as _;
use crate::cpu::{Band, Positions, math, simd, tile_class};
use crate::problem::Problem;
use crate::variant::{HostVariant, TileClass};
use rayon::prelude::*;

/// Query rows per task, and keys per tile: 128 keys halve the loads and
/// stores of the output tiles per product, and the rescales of the output
/// rows, against 64 (7% faster at S = 4096, D = 128).
const BQ: usize = 64;
const BK: usize = 128;
/// Rows of a tile register.
const T: usize = amx::TILE;

/// Whether the bf16 forward runs `p`: both head dims are at most 256
/// (padded inside to whole `tdpbf16ps` reductions, see [`padded_dim`]),
/// and this thread has bf16 products ([`amx::kind`]).
pub(in crate::cpu) fn applies(p: &Problem) -> bool {
    p.head_dim.max(p.head_dim_v) <= 256 && amx::kind().is_some()
}

/// The head dim the products run over: `d` rounded up to a whole number of
/// `tdpbf16ps` reductions (32). The pad columns of Q, K and V are zeros, so
/// they add nothing to `Q Kᵀ`, and the pad columns of `P V` are dropped:
/// head dims of 40, 80 or 72 cost what 64, 96 or 96 do, not a widening.
pub(in crate::cpu) fn padded_dim(d: usize) -> usize {
    d.next_multiple_of(amx::DEPTH)
}

/// One kv head's K and V as the tile products read them.
struct Packed {
    /// Per key tile: `Dp/2` rows of `BK` u32, each the bf16 pair
    /// `(K[key][2p], K[key][2p + 1])` (`Dp` the padded head dim).
    k: Aligned<u32>,
    /// Per key tile: `BK/2` rows of `Dvp` u32, each `(V[2r][d], V[2r + 1][d])`.
    v: Aligned<u32>,
    /// Per key tile: V holds a NaN or an infinity.
    v_nonfinite: Vec<bool>,
}

/// The head dims of K and of V, each with its padded dim (see
/// [`padded_dim`]): `((D, Dp), (Dv, Dvp))`.
pub(in crate::cpu) type Dims = ((usize, usize), (usize, usize));

/// [`Dims`] of `p`.
pub(in crate::cpu) fn dims(p: &Problem) -> Dims {
    let (d, dv) = (p.head_dim, p.head_dim_v);
    ((d, padded_dim(d)), (dv, padded_dim(dv)))
}

/// [`pack`] for every kv head, in parallel (not generic over the variant,
/// so its loop is compiled once). Pages are gathered into their
/// sequence's slots first (zeros past its length).
fn pack_heads(p: &Problem, keys: KeyRows<'_>, dims: Dims) -> Vec<Packed> {
    let ((d, _), (dv, _)) = dims;
    (0..p.batch * p.heads_kv)
        .into_par_iter()
        .map(|bkv| {
            let (b, hkv) = (bkv / p.heads_kv, bkv % p.heads_kv);
            if let Some((k, v)) = keys.head(b, hkv) {
                return pack(k, v, dims);
            }
            let (mut k, mut v) = (vec![0u16; p.seq_k * d], vec![0u16; p.seq_k * dv]);
            keys.gather_head(b, hkv, (&mut k, &mut v), |x, dst| {
                dst.copy_from_slice(bits(x));
            });
            pack(
                Rows::packed(Stored::Bf16(&k), d),
                Rows::packed(Stored::Bf16(&v), dv),
                dims,
            )
        })
        .collect()
}

/// The bf16 bits of `rows`.
fn bits(x: Stored<'_>) -> &[u16] {
    match x {
        Stored::Bf16(x) => x,
        _ => unreachable!("the bf16 kernels read bf16"),
    }
}

/// The packed K (`sk × d`) and V (`sk × dv`) of one kv head (bf16),
/// over the padded head dims.
fn pack(k: Rows<'_>, v: Rows<'_>, ((d, dp), (_, dvp)): Dims) -> Packed {
    let sk = k.len();
    let tiles = sk.div_ceil(BK);
    let (per_k, per_v) = (BK * dp / 2, BK * dvp / 2);
    let mut kp = Aligned::<u32>::zeroed(tiles * per_k);
    let mut vp = Aligned::<u32>::zeroed(tiles * per_v);
    kp.par_chunks_mut(per_k)
        .zip(vp.par_chunks_mut(per_v))
        .enumerate()
        .for_each(|(t, (kp, vp))| {
            let k0 = t * BK;
            let cols = BK.min(sk - k0);
            let keys = k.sub(k0..k0 + cols);
            // K: pair p of key n at p·BK + n, the transpose of the keys'
            // rows read as u32 pairs (a bit-preserving f32 transpose).
            let aligned_pairs = (d == dp && keys.stride().is_multiple_of(2))
                .then(|| {
                    // SAFETY: u32 and f32 have the same size and alignment,
                    // and any bits are an f32 to move; u16 pairs as u32
                    // where aligned.
                    let (pre, pairs, _) = unsafe { bits(keys.data()).align_to::<f32>() };
                    (pre.is_empty() && pairs.len() >= ((cols - 1) * keys.stride() + d) / 2)
                        .then_some(pairs)
                })
                .flatten();
            if let Some(pairs) = aligned_pairs {
                // SAFETY: as above, the packed tile as f32 bits.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(kp.as_mut_ptr().cast::<f32>(), kp.len())
                };
                let src = Stored::F32(pairs);
                crate::cpu::elem::transpose(src, (cols, d / 2, keys.stride() / 2), dst, BK);
            } else {
                // Odd or padded dims: the pad pairs stay zero.
                for n in 0..cols {
                    let row = bits(keys.row(n));
                    for (p, pair) in row.chunks(2).enumerate() {
                        let hi = pair.get(1).copied().unwrap_or(0);
                        kp[p * BK + n] = u32::from(pair[0]) | (u32::from(hi) << 16);
                    }
                }
            }
            // V: rows 2r and 2r + 1 interleaved, element by element, in
            // rows of `dvp` pairs (the pad pairs zero).
            let values = v.sub(k0..k0 + cols);
            for (r, dst) in (0..cols).step_by(2).zip(vp.chunks_exact_mut(dvp)) {
                let lo = bits(values.row(r));
                if r + 1 == cols {
                    dst.iter_mut().zip(lo).for_each(|(o, &l)| *o = u32::from(l));
                } else {
                    let hi = bits(values.row(r + 1));
                    for ((o, &l), &h) in dst.iter_mut().zip(lo).zip(hi) {
                        *o = u32::from(l) | (u32::from(h) << 16);
                    }
                }
            }
        });
    let v_nonfinite = (0..sk)
        .step_by(BK)
        .map(|k0| !v.sub(k0..sk.min(k0 + BK)).all_finite())
        .collect();
    Packed {
        k: kp,
        v: vp,
        v_nonfinite,
    }
}

/// `pairs` (rows of key pairs, `d` u32 each, as [`crate::cpu::amx::product`]'s
/// right operand) with the keys `0..cols` that no row of `p` (rows of
/// `p_stride`; f32, or bf16 bits) sees, `P = 0` in every row, zeroed, in
/// `guarded`: on a partial tile such a key's row must not bring a NaN into
/// the product (0·NaN).
pub(in crate::cpu) fn zero_unseen_keys<'a, T: Copy + PartialEq + Default>(
    pairs: &[u32],
    d: usize,
    p: &[T],
    p_stride: usize,
    cols: usize,
    guarded: &'a mut Vec<u32>,
) -> &'a [u32] {
    guarded.clear();
    guarded.extend_from_slice(pairs);
    for key in 0..cols {
        if p.chunks(p_stride).all(|row| row[key] == T::default()) {
            let (r, shift) = (key / 2, 16 * (key % 2));
            for x in &mut guarded[r * d..(r + 1) * d] {
                *x &= !(0xffff << shift);
            }
        }
    }
    guarded
}

/// Query tiles per task, at most, where a kv head's packed K and V outgrow
/// L2: each key tile then visits them all in turn before the next is
/// loaded, as in the f32 forward (see `forward::MAX_GROUP`). Measured at
/// S = 4096, Hq = Hkv = 8, 2 threads, through the `cpu_vs_torch` example's
/// server, four calls each: full, D = 128, 97–105 ms grouped against
/// 107–113 ungrouped; causal, D = 64, no difference (36–39 ms).
const MAX_GROUP: usize = 4;

/// Packed K and V bytes of one kv head up to which a task has one query
/// tile: they stay in a core's L2 from one query tile to the next.
const GROUP_BYTES: usize = 1 << 20;

/// One query tile of a task: its rows, its Q rows zero-padded to 64 × Dp,
/// its output accumulator (64 × Dvp f32) and its softmax statistics.
struct QueryTile {
    rows: usize,
    pos: (i32, i32),
    q: Aligned<u16>,
    o: Aligned<f32>,
    m: Vec<f32>,
    l: Vec<math::Lanes>,
    alpha: Vec<f32>,
    /// Each row's largest score, where the call returns it.
    mx: Vec<f32>,
    /// No key tile has been accumulated into `o` yet.
    first: bool,
}

/// Per-task scratch: the query tiles, and the work tiles they share.
struct Scratch {
    tiles: Vec<QueryTile>,
    s64: Aligned<f32>,
    p: Aligned<u16>,
    bands: Vec<Band>,
    v_guarded: Vec<u32>,
}

impl Scratch {
    fn new(((_, dp), (_, dvp)): Dims) -> Self {
        Self {
            tiles: (0..MAX_GROUP)
                .map(|_| QueryTile {
                    rows: 0,
                    pos: (0, 0),
                    q: Aligned::zeroed(BQ * dp),
                    o: Aligned::zeroed(BQ * dvp),
                    m: vec![0.0; BQ],
                    l: vec![[0.0; math::LANES]; BQ],
                    alpha: vec![0.0; BQ],
                    mx: vec![0.0; BQ],
                    first: true,
                })
                .collect(),
            s64: Aligned::zeroed(BQ * BK),
            p: Aligned::zeroed(BQ * BK),
            bands: Vec::with_capacity(1),
            v_guarded: Vec::new(),
        }
    }
}

/// The bf16 forward of `variant` (bf16 bits `q`, `k`, `v`; f32 `out`,
/// `lse`).
///
/// # Panics
/// Unless [`applies`] to `p`.
pub(in crate::cpu) fn forward<V: HostVariant>(
    variant: &V,
    p: &Problem,
    q: Operand<'_>,
    keys: KeyRows<'_>,
    (out, lse, max): (&mut [f32], &mut [f32], Option<&mut [f32]>),
) {
    assert!(applies(p), "the bf16 forward runs {p:?}");
    let kind = amx::kind().expect("applies");
    let (sq, sk, g) = (p.seq_q, p.seq_k, p.group());
    let sizes @ ((_, dp), (dv, dvp)) = dims(p);
    let pos = Positions::new(p);
    let packed = pack_heads(p, keys, sizes);
    let heads: Vec<Head<'_, V>> = (0..p.batch * p.heads_q)
        .map(|bh| Head {
            variant,
            p,
            pos,
            b: Positions::to_i32(bh / p.heads_q),
            h: Positions::to_i32(bh % p.heads_q),
            kt: &[],
            v: &[],
            v_rs: 0,
            v_nonfinite: &[],
        })
        .collect();
    // One task per (batch, query head, tile of query rows), in one flat
    // list: each thread makes its scratch once, not once per head.
    let group = if 2 * sk * (dp + dvp) > GROUP_BYTES {
        MAX_GROUP
    } else {
        1
    };
    let rows = group * BQ;
    let mut tasks = Vec::with_capacity(heads.len() * sq.div_ceil(rows));
    let n_heads = p.batch * p.heads_q;
    let max_bh = crate::cpu::forward::pieces(max, sq, n_heads);
    let heads_out = out.chunks_mut(sq * dv).zip(lse.chunks_mut(sq)).zip(max_bh);
    for (bh, ((out_bh, lse_bh), max_bh)) in heads_out.enumerate() {
        let max_t = crate::cpu::forward::pieces(max_bh, rows, sq.div_ceil(rows));
        let tiles = out_bh.chunks_mut(rows * dv).zip(lse_bh.chunks_mut(rows));
        for (t, ((out_t, lse_t), max_t)) in tiles.zip(max_t).enumerate() {
            tasks.push((bh, t * rows, (out_t, lse_t, max_t)));
        }
    }
    tasks
        .into_par_iter()
        .for_each_init_dyn(&|| Scratch::new(sizes), &|sc, (bh, row0, outputs)| {
            let (b, h) = (bh / p.heads_q, bh % p.heads_q);
            let kv = &packed[b * p.heads_kv + h / g];
            let q_t = q.head(bh).sub(row0..row0 + outputs.1.len());
            query_tiles(&heads[bh], kind, kv, row0, q_t, outputs, sc);
        });
}

/// Consecutive query tiles, `lse.len()` rows from row `row0` in all: start
/// each, stream every key tile through each of them in turn, finish each.
fn query_tiles<V: HostVariant>(
    head: &Head<'_, V>,
    kind: Kind,
    kv: &Packed,
    row0: usize,
    q: Rows<'_>,
    (out, lse, mut max): (&mut [f32], &mut [f32], Option<&mut [f32]>),
    sc: &mut Scratch,
) {
    let (dv, sk) = (head.p.head_dim_v, head.p.seq_k);
    let n = lse.len().div_ceil(BQ);
    for (t, qt) in sc.tiles[..n].iter_mut().enumerate() {
        let r0 = t * BQ;
        let rows = BQ.min(lse.len() - r0);
        start(head, qt, row0 + r0, q.sub(r0..r0 + rows));
    }
    // SAFETY: `kind` came from `amx::kind()` on the calling thread, whose
    // pool's threads are capped alike.
    let tiles = unsafe { Products::start(kind) };
    let Scratch { tiles: qts, .. } = sc;
    let qts = &mut qts[..n];
    let mut work = Work {
        s64: &mut sc.s64,
        p: &mut sc.p,
        bands: &mut sc.bands,
        v_guarded: &mut sc.v_guarded,
    };
    let want_max = max.is_some();
    for (tile, kv0) in (0..sk).step_by(BK).enumerate() {
        for qt in qts.iter_mut() {
            step(head, kv, &tiles, qt, (tile, kv0), &mut work, want_max);
        }
    }
    drop(tiles);
    for (t, qt) in qts.iter().enumerate() {
        let r = t * BQ..t * BQ + qt.rows;
        if let Some(max) = max.as_deref_mut() {
            max[r.clone()].copy_from_slice(&qt.mx[..qt.rows]);
        }
        finish(head, qt, &mut out[r.start * dv..r.end * dv], &mut lse[r]);
    }
}

/// The work tiles a task's query tiles share.
struct Work<'a> {
    s64: &'a mut [f32],
    p: &'a mut [u16],
    bands: &'a mut Vec<Band>,
    v_guarded: &'a mut Vec<u32>,
}

/// Readies query tile `qt` of `q.len()` rows from row `row0`: its Q rows
/// into the zero-padded 64 × Dp block.
fn start<V: HostVariant>(head: &Head<'_, V>, qt: &mut QueryTile, row0: usize, q: Rows<'_>) {
    let d = head.p.head_dim;
    let dp = padded_dim(d);
    let rows = q.len();
    qt.q.fill(0);
    for (i, dst) in qt.q.chunks_exact_mut(dp).take(rows).enumerate() {
        dst[..d].copy_from_slice(bits(q.row(i)));
    }
    qt.rows = rows;
    qt.first = true;
    qt.pos = head.pos.query_range(row0, rows);
    start_rows(head, row0, &mut qt.m[..rows], &mut qt.l[..rows]);
    qt.mx[..rows].fill(f32::NEG_INFINITY);
}

/// Key tile `tile` (keys from `kv0`) through query tile `qt`.
fn step<V: HostVariant>(
    head: &Head<'_, V>,
    kv: &Packed,
    tiles: &Products,
    qt: &mut QueryTile,
    (tile, kv0): (usize, usize),
    w: &mut Work<'_>,
    want_max: bool,
) {
    let (sk, scale) = (head.p.seq_k, head.p.scale);
    let ((_, dp), (_, dvp)) = dims(head.p);
    let rows = qt.rows;
    let cols = BK.min(sk - kv0);
    let class = tile_class(head.variant, head.b, head.h, qt.pos, kv0, cols);
    if class == TileClass::Empty {
        return;
    }
    let row_groups = rows.div_ceil(T).next_multiple_of(2);
    let k_t = &kv.k[tile * BK * dp / 2..(tile + 1) * BK * dp / 2];
    let v_t = &kv.v[tile * BK * dvp / 2..(tile + 1) * BK * dvp / 2];
    // SAFETY: qt.q holds 64 rows of dp, k_t a packed tile (dp/2 rows of
    // BK), s64 64 × BK; row_groups ≤ 4 and the columns ≤ BK.
    unsafe {
        tiles.product(
            (qt.q.as_ptr(), dp),
            (k_t.as_ptr(), BK),
            (w.s64.as_mut_ptr(), BK),
            (row_groups * T, cols.div_ceil(2 * T) * 2 * T, dp),
            false,
        );
    }
    // The scores in place, rows of BK: the softmax scales them.
    let s = &mut w.s64[..rows * BK];
    w.bands.clear();
    w.bands.push(Band {
        rows: 0..rows,
        cols: 0..cols,
    });
    let first = qt.first;
    simd::dispatch(OnlineSoftmax {
        head,
        class,
        q_lo: qt.pos.0,
        kv_lo: Positions::to_i32(kv0),
        s: &mut *s,
        scale,
        m: &mut qt.m[..rows],
        l: &mut qt.l[..rows],
        alpha: &mut qt.alpha[..rows],
        out: (!first).then_some(&mut qt.o[..rows * dvp]),
        mx: want_max.then_some(&mut qt.mx[..rows]),
        bands: w.bands,
    });
    // P to bf16 for its product, zero past the tile's keys.
    for (src, dst) in s.chunks_exact(BK).zip(w.p.chunks_exact_mut(BK)) {
        math::round_bf16(&src[..cols], &mut dst[..cols]);
        dst[cols..].fill(0);
    }
    let chunks = cols.div_ceil(amx::DEPTH);
    let p = &w.p[..rows * BK];
    // On a partial tile, keys no row sees must not bring a NaN of their V
    // rows into the product.
    let v_t = if class == TileClass::Partial && kv.v_nonfinite[tile] {
        zero_unseen_keys(v_t, dvp, p, BK, cols, w.v_guarded)
    } else {
        v_t
    };
    // SAFETY: qt.o holds 64 rows of dvp; p 64 × BK; v_t a packed tile
    // (BK/2 rows of dvp); the keys ≤ BK.
    unsafe {
        tiles.product(
            (w.p.as_ptr(), BK),
            (v_t.as_ptr(), dvp),
            (qt.o.as_mut_ptr(), dvp),
            (row_groups * T, dvp, chunks * amx::DEPTH),
            !first,
        )
    };
    qt.first = false;
}

/// Query tile `qt`'s output rows (the first `dv` columns of its
/// accumulator), normalised, and its lse.
fn finish<V: HostVariant>(head: &Head<'_, V>, qt: &QueryTile, out: &mut [f32], lse: &mut [f32]) {
    let dv = head.p.head_dim_v;
    let dvp = padded_dim(dv);
    if qt.first {
        out.fill(0.0);
    } else {
        for (dst, src) in out.chunks_exact_mut(dv).zip(qt.o.chunks_exact(dvp)) {
            dst.copy_from_slice(&src[..dv]);
        }
    }
    let rows = (&qt.m[..qt.rows], &qt.l[..qt.rows]);
    finish_rows(head.p, rows, out, lse, V::WEIGHTS);
}
