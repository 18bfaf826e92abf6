//! Tiles of the CPU kernels: their sizes, in one place, with the
//! reasoning; their classification by the variant; and the bands of rows
//! whose products a partial tile computes.
//!
//! A tile is the unit of both scheduling and masking: the forward keeps one
//! query tile resident while key/value tiles stream past it, the backward
//! keeps one key/value tile (and its dK/dV rows) resident while query tiles
//! stream past it, and `classify_tile` is asked once per (query tile, key
//! tile) pair.

use crate::cpu::{gemm, math};
use crate::problem::Problem;
use crate::variant::{HostVariant, TileClass};

/// Rows per query tile (`q`) and keys per key/value tile (`kv`).
///
/// Working set per rayon task, f32, with the defaults and head dim `D = 64`
/// (each `64 × 64` tile is 16 KiB):
/// - forward: Q tile, Kᵀ and V tiles, the score tile and the output
///   accumulator — 80 KiB. That sits in L2 (1–2 MiB per core on current
///   x86) with room for `gemm`'s packed panels, and one score row (256 B)
///   plus the running max/sum stay in L1 during the softmax pass.
/// - backward: K, Kᵀ, Vᵀ, dK and dV tiles resident, three score-sized tiles
///   (S/P, dP/dS, score_grad), Q and dO tiles streaming — about 160 KiB.
///
/// Why not smaller: each key tile costs every query row a pass of the
/// online softmax's bookkeeping (row max, rescale of `D` accumulators), and
/// the tile kernel keeps `6 × 64` blocks of the product in registers, so
/// fewer rows or keys per tile leave more of it in remainders. Why not
/// larger: fewer parallel tasks for short sequences, and coarser tiles skip
/// less of a causal or sliding-window mask (only whole tiles are skipped)
/// while evaluating the mask on bigger diagonal tiles.
///
/// Measured on a 2-core AVX-512 Xeon (B=1, H=8, S=1024, D=64, and
/// S=2048, D=128), sweeping q ∈ {32, 64, 128} × kv ∈ {64, 128, 256}: every
/// choice from 32×64 to 128×128 is within ~10% (run-to-run noise on that
/// machine); 64×64 was at or near the best for causal forward and backward,
/// which is the common case, and has the smallest working set for larger
/// head dims. kv = 256 was slower for causal masks. Measured again with the
/// AVX-512 tile kernel (`bench/ab_cpu.py`, paired): q = 32 ran the full
/// forward at 8 8 2048 128 0.87× as fast, and a causal sliding window of
/// 256 (whose 64-wide tiles are at best 80% useful) no faster (0.97–0.99×).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpuTiles {
    /// Query rows per tile (`Bq`).
    pub q: usize,
    /// Keys per key/value tile (`Bk`).
    pub kv: usize,
}

impl CpuTiles {
    /// The defaults used by [`forward`](crate::cpu::forward()) and
    /// [`backward`](crate::cpu::backward()); see the type's docs for why.
    pub const DEFAULT: Self = Self { q: 64, kv: 64 };

    /// Tiles of `q` query rows and `kv` keys. Panics if either is zero.
    pub fn new(q: usize, kv: usize) -> Self {
        assert!(q > 0 && kv > 0, "tile sizes must be non-zero");
        Self { q, kv }
    }
}

impl CpuTiles {
    /// The tiles for variant `V`: its `tile(q = .., kv = ..)` overrides, else
    /// the defaults.
    pub fn for_variant<V: crate::Variant>() -> Self {
        let pick = |size: Option<u32>, default: usize| size.map_or(default, |s| s as usize);
        Self::new(
            pick(V::TILE_Q, Self::DEFAULT.q),
            pick(V::TILE_KV, Self::DEFAULT.kv),
        )
    }
}

impl Default for CpuTiles {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Positions of rows and keys as the variant sees them (bottom-right aligned).
#[derive(Clone, Copy, Debug)]
pub(in crate::cpu) struct Positions {
    /// `Sk − Sq`: query row `i` is at position `i + q_offset`.
    pub(in crate::cpu) q_offset: i32,
}

impl Positions {
    #[inline]
    pub(in crate::cpu) fn new(p: &Problem) -> Self {
        // Positions are i32 in the variant's signature; sequences beyond
        // 2^31 would not fit any of its index arguments.
        Self::to_i32(p.seq_q.max(p.seq_k));
        let q_offset = i32::try_from(p.q_offset()).expect("sequence length fits i32");
        Self { q_offset }
    }

    /// An index (batch, head, position) as the variant's `i32`.
    #[inline]
    pub(in crate::cpu) fn to_i32(x: usize) -> i32 {
        i32::try_from(x).expect("index fits i32")
    }

    /// Inclusive positions of `rows` query rows starting at row `row0`.
    #[inline]
    pub(in crate::cpu) fn query_range(self, row0: usize, rows: usize) -> (i32, i32) {
        let lo = Self::to_i32(row0) + self.q_offset;
        (lo, lo + Self::to_i32(rows) - 1)
    }
}

/// The class of the tile (query positions `q_lo..=q_hi`) × (`cols` keys from
/// `kv0`). Without a mask every tile is `Full` and `classify_tile` is not called.
#[inline]
pub(in crate::cpu) fn tile_class<V: HostVariant>(
    variant: &V,
    b: i32,
    h: i32,
    (q_lo, q_hi): (i32, i32),
    kv0: usize,
    cols: usize,
) -> TileClass {
    if !V::HAS_MASK {
        return TileClass::Full;
    }
    let kv_lo = Positions::to_i32(kv0);
    variant.classify_tile(b, h, q_lo, q_hi, kv_lo, kv_lo + Positions::to_i32(cols) - 1)
}

/// Bytes of a tile's partners (K and V for a query tile in the forward;
/// Q, dO and dQ for a key tile in the backward) that one tile's pass may
/// read before tiles are grouped to share passes: up to this much stays in a
/// core's L2 from one tile to the next. Three quarters of the 2 MiB L2 of
/// recent Xeons, leaving room for everything else.
pub(in crate::cpu) const L2_BUDGET: usize = 3 << 19;

/// Tiles sampled by [`mean_visits`].
pub(in crate::cpu) const SAMPLED_TILES: usize = 8;

/// Which tiles [`mean_visits`] samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::cpu) enum Axis {
    /// Query tiles, counting the key tiles each visits.
    Query,
    /// Key tiles, counting the query tiles that visit each.
    Key,
}

/// How many tiles of the other axis a tile of `axis` meets that are not
/// `Empty`, averaged over up to [`SAMPLED_TILES`] evenly spaced tiles of
/// batch 0, head 0. It only sizes groups of tiles (any grouping gives the
/// same results), so an estimate is enough.
pub(in crate::cpu) fn mean_visits<V: HostVariant>(
    variant: &V,
    p: &Problem,
    tiles: CpuTiles,
    axis: Axis,
) -> f64 {
    let pos = Positions::new(p);
    let (q_tiles, kv_tiles) = (p.seq_q.div_ceil(tiles.q), p.seq_k.div_ceil(tiles.kv));
    let visible = |qt: usize, kt: usize| {
        let (row0, kv0) = (qt * tiles.q, kt * tiles.kv);
        let range = pos.query_range(row0, tiles.q.min(p.seq_q - row0));
        let cols = tiles.kv.min(p.seq_k - kv0);
        tile_class(variant, 0, 0, range, kv0, cols) != TileClass::Empty
    };
    let (n, others) = match axis {
        Axis::Query => (q_tiles, kv_tiles),
        Axis::Key => (kv_tiles, q_tiles),
    };
    if n == 0 {
        return 0.0;
    }
    let samples = n.min(SAMPLED_TILES);
    let mut visits = 0;
    for i in 0..samples {
        let t = i * (n - 1) / (samples - 1).max(1);
        visits += (0..others)
            .filter(|&o| match axis {
                Axis::Query => visible(t, o),
                Axis::Key => visible(o, t),
            })
            .count();
    }
    visits as f64 / samples as f64
}

/// Query rows per band when the products of a `Partial` tile are trimmed
/// to the keys its rows can see.
///
/// A diagonal causal tile computed whole wastes half of its products, and so
/// do both edge tiles of a sliding window. Cut into bands of 16 rows, and
/// each band's keys trimmed to the chunks classification does not prove
/// empty ([`class_bands`]), the forward's and the backward's products and
/// elementwise passes cover about 60% of a causal diagonal tile. Measured
/// on the forward (`bench/ab_cpu.py`, one thread), against trimming only
/// `P V` to each band's nonzero probabilities: 1.07× as fast for causal at
/// S = 1024, 1.08× for a sliding window at S = 4096.
pub(in crate::cpu) const BAND_ROWS: usize = 16;

/// Rows `rows` of a tile and the columns `cols` (relative to the tile)
/// outside which every pair of those rows is hidden.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::cpu) struct Band {
    pub(in crate::cpu) rows: std::ops::Range<usize>,
    pub(in crate::cpu) cols: std::ops::Range<usize>,
}

/// Fill `bands` with the bands of the tile of query rows at positions
/// `q_lo ..` and `cols` keys from `kv0`: one band of the whole tile unless
/// it is `Partial`, else one per [`BAND_ROWS`] rows, each with the keys from
/// the first to the last `LANES`-wide chunk that `classify_tile` does not
/// prove `Empty` for those rows (empty when it proves them all). Computing
/// a tile's products and elementwise passes only there is exact: every
/// pair outside is hidden. (Chunks of `LANES` keys keep the softmax's lane
/// sums aligned with the columns.)
pub(in crate::cpu) fn class_bands<V: HostVariant>(
    variant: &V,
    (b, h): (i32, i32),
    class: TileClass,
    (q_lo, kv0): (i32, usize),
    (rows, cols): (usize, usize),
    bands: &mut Vec<Band>,
) {
    bands.clear();
    if class != TileClass::Partial {
        bands.push(Band {
            rows: 0..rows,
            cols: 0..cols,
        });
        return;
    }
    for r0 in (0..rows).step_by(BAND_ROWS) {
        let r1 = rows.min(r0 + BAND_ROWS);
        let pos = (q_lo + r0 as i32, q_lo + r1 as i32 - 1);
        let (mut lo, mut hi) = (cols, 0);
        for c0 in (0..cols).step_by(math::LANES) {
            let c1 = cols.min(c0 + math::LANES);
            if tile_class(variant, b, h, pos, kv0 + c0, c1 - c0) != TileClass::Empty {
                lo = lo.min(c0);
                hi = c1;
            }
        }
        bands.push(Band {
            rows: r0..r1,
            cols: lo..hi.max(lo),
        });
    }
}

/// `dst = beta · A Bᵀ` on each band of the `rows × cols` tile `dst`: the
/// band's rows of `a` (rows of `d`, `a_rs` apart) against its columns of `bt` (`Bᵀ`,
/// `d × cols`). Elements outside the bands are not written.
#[inline]
pub(in crate::cpu) fn band_products(
    dst: &mut [f32],
    cols: usize,
    bands: &[Band],
    (a, a_rs): (&[f32], usize),
    bt: &[f32],
    d: usize,
    beta: f32,
) {
    for Band { rows: r, cols: c } in bands.iter().filter(|b| !b.cols.is_empty()) {
        gemm::matmul(
            gemm::MatMut::strided(&mut dst[r.start * cols + c.start..], r.len(), c.len(), cols),
            gemm::Write::Overwrite,
            gemm::MatRef::strided(&a[r.start * a_rs..], r.len(), d, a_rs),
            gemm::MatRef::strided(&bt[c.start..], d, c.len(), cols),
            beta,
        );
    }
}

/// Whether every element of `x` is finite (no NaN, no infinity).
/// [`all_finite`] of bf16 bits.
#[inline]
pub(in crate::cpu) fn all_finite_bits(x: &[u16]) -> bool {
    x.iter()
        .fold(0u16, |acc, v| acc | u16::from(v & 0x7f80 == 0x7f80))
        == 0
}

#[inline]
pub(in crate::cpu) fn all_finite(x: &[f32]) -> bool {
    // Branch-free over the bits, so it vectorises: an exponent of all ones
    // is an infinity or a NaN.
    x.iter().fold(0u32, |acc, v| {
        acc | u32::from(v.to_bits() & 0x7f80_0000 == 0x7f80_0000)
    }) == 0
}

/// The right operand `b` of a band's product (`c.len()` rows of `d`, `b_rs`
/// apart, row
/// `j` meeting column `c.start + j` of the band's left operand `a`, a tile
/// of `cols` columns) with every row zeroed whose column of `a` is zero in
/// all of the band's rows, in `scratch` (rows of `d`, contiguous).
///
/// Why: a key that no row of the band sees has probability (and `dS`)
/// exactly 0 in that column, but `0 · NaN` is NaN, so a NaN or infinity
/// in its K or V row (an unwritten cache slot, garbage padding) would
/// reach rows that cannot see it. Taking the key's row as zero instead is
/// exact for finite rows (they contribute 0 either way), so the kernels
/// only do it where the operand has a non-finite element.
pub(in crate::cpu) fn zero_unused_rows<'s>(
    a: &[f32],
    cols: usize,
    band: &Band,
    (b, b_rs): (&[f32], usize),
    d: usize,
    scratch: &'s mut Vec<f32>,
) -> &'s [f32] {
    let c = &band.cols;
    scratch.clear();
    for j in 0..c.len() {
        scratch.extend_from_slice(&b[j * b_rs..j * b_rs + d]);
    }
    for j in 0..c.len() {
        let unused = band.rows.clone().all(|i| a[i * cols + c.start + j] == 0.0);
        if unused {
            scratch[j * d..(j + 1) * d].fill(0.0);
        }
    }
    scratch
}
