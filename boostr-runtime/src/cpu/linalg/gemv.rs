//! The decode kernel's two products for a few query rows, reading keys and
//! values as stored (f32, or bf16/f16 widened in registers): `S = scale ·
//! Q Kᵀ` and `O += P V`, each with `K` and `V` row-major, as a cache holds
//! them. Nothing is transposed or widened into memory first.
//!
//! Why: decode reads every key once per kv head for only `R = G · Sq` query
//! rows (4 for Llama's 32/8 heads), so its time should be the time to read
//! K and V. Through the tile products it was not: transposing each key block
//! (and widening a 16-bit cache) into scratch, then a 6-row GEMM kernel
//! running 4 rows, cost about 130–180 cycles per key on a 2-core AVX-512
//! Xeon even with the cache in L2, more than reading a bf16 key from
//! memory takes (512 bytes of K and V at 8 GB/s per core: 64 ns).
//!
//! `scores`: dims across lanes. Per key, each row's 16-lane partial dot
//! product accumulates over the head dim; four keys' partials are folded
//! into one vector (`unpack`, then 64-bit `unpack`: lane group `g` holds
//! the four keys' sums over lanes `4g..4g+4`), two such into one (128-bit
//! lane shuffles), and two of those into the 16 keys' dot products in key
//! order: 45 shuffles and adds per 16 keys and row, against 64 for a
//! 16 × 16 transpose. Query rows stay in L1 and are loaded once per chunk
//! of 16 dims for each group of 4 keys.
//!
//! `accumulate`: the output rows as registers, 4 vectors (64 dims) per row
//! at a time for up to 4 rows, across all of the block's keys; each key's V
//! row chunk is loaded (and widened) once for them all.
//!
//! Rows are taken 4 at a time (a fifth row would leave too few registers);
//! more rows read the block again from L1. Sums run in a fixed order: the
//! same bits on every run and thread count.

use crate::cpu::elem::Stored;
#[cfg(target_arch = "x86_64")]
use crate::cpu::microkernel::{Bf16s, E4m3s, E5m2s, F16s, F32s, I8s, Load16};
use crate::cpu::operand::Rows;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Rows per pass of either product.
const ROWS: usize = 4;

/// Whether [`scores`] and [`accumulate`] run here (AVX-512F/BW/VL).
pub(in crate::cpu) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::cpu::simd::avx512()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// One run of a block's rows: its first element, its rows, and the
/// elements from one row to the next.
#[cfg(target_arch = "x86_64")]
pub(in crate::cpu) struct Run<E> {
    pub(in crate::cpu) at: *const E,
    pub(in crate::cpu) rows: usize,
    pub(in crate::cpu) stride: usize,
    /// What each stored value is worth (a quantised cache's scale; else 1).
    pub(in crate::cpu) scale: f32,
}

#[cfg(target_arch = "x86_64")]
impl<E> Clone for Run<E> {
    fn clone(&self) -> Self {
        *self
    }
}

#[cfg(target_arch = "x86_64")]
impl<E> Copy for Run<E> {}

/// The most runs a block may have.
pub(in crate::cpu) const MAX_RUNS: usize = 64;

/// `runs` (rows of `d` elements each, one element type) as raw runs of
/// `E`, and their total rows.
///
/// # Panics
/// If the runs mix element types, a run's rows are not of `d` elements,
/// or there are more than [`MAX_RUNS`].
#[cfg(target_arch = "x86_64")]
pub(in crate::cpu) fn raw_runs<E>(runs: &[Rows<'_>], d: usize) -> ([Run<E>; MAX_RUNS], usize) {
    assert!(runs.len() <= MAX_RUNS, "at most {MAX_RUNS} runs per block");
    let mut raw = [Run {
        at: std::ptr::null(),
        rows: 0,
        stride: 0,
        scale: 1.0,
    }; MAX_RUNS];
    let mut total = 0;
    for (r, run) in raw.iter_mut().zip(runs) {
        assert_eq!(
            run.elem_bytes(),
            std::mem::size_of::<E>(),
            "one element type"
        );
        assert_eq!(run.dim(), d, "rows of d elements");
        *r = Run {
            at: run.span_bytes().as_ptr().cast(),
            rows: run.len(),
            stride: run.stride(),
            scale: run.scale(),
        };
        total += r.rows;
    }
    (raw, total)
}

/// `s[r·cols + j] = scale · Σ_d q[r·d + dd]·k_j[dd]` for the `rows =
/// q.len() / d` rows and the `cols` keys of `keys`: consecutive runs of
/// key rows (`d` elements each, one element type, each run's rows any
/// distance apart), such as the pages a block spans.
///
/// `ahead`: the next block's runs of keys and of values, whose cache lines
/// are asked for (prefetched) a key row at a time as this block's keys
/// are read, so that they arrive while this block computes. One prefetch
/// burst per block instead fills the core's line-fill buffers and stalls
/// it: with a whole block asked for at once, a bf16 decode read its keys
/// at 45–50% of the machine's read bandwidth, with this 75–95%.
///
/// # Panics
/// Unless [`available`], if `s` is too short, or as [`MAX_RUNS`] says.
pub(in crate::cpu) fn scores(
    q: &[f32],
    d: usize,
    keys: &[Rows<'_>],
    scale: f32,
    s: &mut [f32],
    ahead: [&[Rows<'_>]; 2],
) {
    let rows = q.len() / d.max(1);
    assert!(available(), "AVX-512 for the decode products");
    let Some(first) = keys.first() else { return };
    #[cfg(target_arch = "x86_64")]
    {
        fn run<L: Load16>(
            q: &[f32],
            rows: usize,
            d: usize,
            keys: &[Rows<'_>],
            scale: f32,
            s: &mut [f32],
            ahead: [&[Rows<'_>]; 2],
        ) {
            let (runs, cols) = raw_runs::<L::Elem>(keys, d);
            assert!(s.len() >= rows * cols, "scores bounds");
            let o = Scores {
                q: q.as_ptr(),
                d,
                cols,
                scale,
                s: s.as_mut_ptr(),
                ahead: Ahead::new(ahead, std::mem::size_of::<L::Elem>()),
            };
            // SAFETY: AVX-512F/BW/VL checked by the caller; the runs are
            // whole rows of live slices and `s` holds rows × cols.
            unsafe { scores_rows::<L>(o, rows, &runs[..keys.len()]) };
        }
        match first.data() {
            Stored::F32(_) => run::<F32s>(q, rows, d, keys, scale, s, ahead),
            Stored::Bf16(_) => run::<Bf16s>(q, rows, d, keys, scale, s, ahead),
            Stored::F16(_) => run::<F16s>(q, rows, d, keys, scale, s, ahead),
            Stored::E4m3(_) => run::<E4m3s>(q, rows, d, keys, scale, s, ahead),
            Stored::E5m2(_) => run::<E5m2s>(q, rows, d, keys, scale, s, ahead),
            Stored::I8(_) => run::<I8s>(q, rows, d, keys, scale, s, ahead),
        }
    }
}

/// `acc[r·d + dd] += Σ_j p[r·cols + j]·v_j[dd]` for the `rows = acc.len() /
/// d` rows and the `cols` value rows of `values` (runs as in [`scores`]).
///
/// # Panics
/// Unless [`available`], if `p` is too short, or as [`MAX_RUNS`] says.
pub(in crate::cpu) fn accumulate(p: &[f32], values: &[Rows<'_>], d: usize, acc: &mut [f32]) {
    let rows = acc.len() / d.max(1);
    assert!(available(), "AVX-512 for the decode products");
    let Some(first) = values.first() else { return };
    #[cfg(target_arch = "x86_64")]
    {
        fn run<L: Load16>(p: &[f32], rows: usize, values: &[Rows<'_>], d: usize, acc: &mut [f32]) {
            let (runs, cols) = raw_runs::<L::Elem>(values, d);
            assert!(p.len() >= rows * cols, "accumulate bounds");
            let o = Accumulate {
                p: p.as_ptr(),
                cols,
                d,
                acc: acc.as_mut_ptr(),
            };
            // SAFETY: AVX-512F/BW/VL checked by the caller; the runs are
            // whole rows of live slices, `p` holds rows × cols and `acc`
            // rows × d.
            unsafe { accumulate_rows::<L>(o, rows, &runs[..values.len()]) };
        }
        match first.data() {
            Stored::F32(_) => run::<F32s>(p, rows, values, d, acc),
            Stored::Bf16(_) => run::<Bf16s>(p, rows, values, d, acc),
            Stored::F16(_) => run::<F16s>(p, rows, values, d, acc),
            Stored::E4m3(_) => run::<E4m3s>(p, rows, values, d, acc),
            Stored::E5m2(_) => run::<E5m2s>(p, rows, values, d, acc),
            Stored::I8(_) => run::<I8s>(p, rows, values, d, acc),
        }
    }
}

/// The lanes of the 16-wide chunk at `at` that lie below `len`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(in crate::cpu) fn mask(len: usize, at: usize) -> __mmask16 {
    let live = len.saturating_sub(at).min(16);
    ((1u32 << live) - 1) as __mmask16
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Scores<'a> {
    q: *const f32,
    d: usize,
    /// Keys of the block: the row stride of `s`.
    cols: usize,
    scale: f32,
    s: *mut f32,
    ahead: Ahead<'a>,
}

/// The next block's runs of keys and of values, `elem` bytes per element.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(in crate::cpu) struct Ahead<'a> {
    runs: [&'a [Rows<'a>]; 2],
    elem: usize,
}

#[cfg(target_arch = "x86_64")]
impl<'a> Ahead<'a> {
    /// Nothing to ask for.
    pub(in crate::cpu) const NONE: Self = Ahead {
        runs: [&[], &[]],
        elem: 1,
    };

    /// The runs of keys and of values, `elem` bytes per element.
    pub(in crate::cpu) fn new(runs: [&'a [Rows<'a>]; 2], elem: usize) -> Self {
        Ahead { runs, elem }
    }

    /// Prefetch key `j`'s rows of K and V (nothing past their ends).
    #[inline(always)]
    pub(in crate::cpu) fn key(&self, j: usize) {
        for runs in self.runs {
            let mut j = j;
            for run in runs {
                if j < run.len() {
                    let bytes = run.span_bytes();
                    let (at, row) = (j * run.stride() * self.elem, run.dim() * self.elem);
                    for line in bytes[at..at + row].chunks(64) {
                        // SAFETY: a prefetch is a hint that never faults,
                        // of an address inside the run.
                        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
                    }
                    break;
                }
                j -= run.len();
            }
        }
    }
}

/// [`scores`] over every row, `ROWS` at a time.
///
/// # Safety
/// As [`scores`], AVX-512F/BW/VL present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn scores_rows<L: Load16>(o: Scores<'_>, rows: usize, runs: &[Run<L::Elem>]) {
    let mut r0 = 0;
    while r0 < rows {
        let mut j0 = 0;
        for run in runs {
            // SAFETY: rows r0 .. r0 + n of q and s, columns j0 .. j0 +
            // run.rows of s, are in bounds.
            unsafe {
                let o = Scores {
                    q: o.q.add(r0 * o.d),
                    s: o.s.add(r0 * o.cols + j0),
                    scale: o.scale * run.scale,
                    // The first pass over the keys asks for the next block.
                    ahead: if r0 == 0 { o.ahead } else { Ahead::NONE },
                    ..o
                };
                let run = *run;
                match (rows - r0).min(ROWS) {
                    4 => score_run::<L, 4>(o, run, j0),
                    3 => score_run::<L, 3>(o, run, j0),
                    2 => score_run::<L, 2>(o, run, j0),
                    _ => score_run::<L, 1>(o, run, j0),
                }
            }
            j0 += run.rows;
        }
        r0 += ROWS;
    }
}

/// A vector of 16 lane sums: f32 (`gemv`) or 32-bit integers (`gemv_i8`).
/// The folds below move lanes as bits and add them in the lane type.
#[cfg(target_arch = "x86_64")]
pub(in crate::cpu) trait LaneSums: Copy {
    /// Lane-wise `a + b`.
    fn add(a: Self, b: Self) -> Self;
    /// The lanes' bits as f32 lanes.
    fn bits(self) -> __m512;
    /// f32 lanes' bits as `Self`.
    fn from_bits(x: __m512) -> Self;
}

#[cfg(target_arch = "x86_64")]
impl LaneSums for __m512 {
    #[inline(always)]
    fn add(a: Self, b: Self) -> Self {
        // SAFETY: register-only; AVX-512F enabled by every caller.
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    fn bits(self) -> __m512 {
        self
    }
    #[inline(always)]
    fn from_bits(x: __m512) -> Self {
        x
    }
}

#[cfg(target_arch = "x86_64")]
impl LaneSums for __m512i {
    #[inline(always)]
    fn add(a: Self, b: Self) -> Self {
        // SAFETY: register-only; AVX-512F enabled by every caller.
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    fn bits(self) -> __m512 {
        // SAFETY: a cast of bits.
        unsafe { _mm512_castsi512_ps(self) }
    }
    #[inline(always)]
    fn from_bits(x: __m512) -> Self {
        // SAFETY: a cast of bits.
        unsafe { _mm512_castps_si512(x) }
    }
}

/// Four keys' 16-lane partial sums folded into one vector whose lane group
/// `g` (lanes `4g..4g+4`) holds each key's sum over lanes `4g..4g+4`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(in crate::cpu) fn fold4<L: LaneSums>(x: [L; 4]) -> L {
    // (No closure: it would not inherit the callers' target features.)
    let x = [x[0].bits(), x[1].bits(), x[2].bits(), x[3].bits()];
    // SAFETY: register-only; AVX-512F enabled by every caller.
    unsafe {
        // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3].
        let ab = L::add(
            L::from_bits(_mm512_unpacklo_ps(x[0], x[1])),
            L::from_bits(_mm512_unpackhi_ps(x[0], x[1])),
        );
        let cd = L::add(
            L::from_bits(_mm512_unpacklo_ps(x[2], x[3])),
            L::from_bits(_mm512_unpackhi_ps(x[2], x[3])),
        );
        // Per 128-bit lane: [Σa, Σb, Σc, Σd] over its four lanes.
        let (ab, cd) = (_mm512_castps_pd(ab.bits()), _mm512_castps_pd(cd.bits()));
        L::add(
            L::from_bits(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd))),
            L::from_bits(_mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd))),
        )
    }
}

/// Two folded vectors (of keys `0..4` and `4..8` of a group, or of keys
/// `0..8` and `8..16` once folded again) into one: by 128-bit lane
/// `[u₀+u₁, u₂+u₃, w₀+w₁, w₂+w₃]`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(in crate::cpu) fn fold2<L: LaneSums>(u: L, w: L) -> L {
    let (u, w) = (u.bits(), w.bits());
    // SAFETY: register-only; AVX-512F enabled by every caller.
    unsafe {
        let x = _mm512_shuffle_f32x4::<0b10_00_10_00>(u, w);
        let y = _mm512_shuffle_f32x4::<0b11_01_11_01>(u, w);
        L::add(L::from_bits(x), L::from_bits(y))
    }
}

/// [`scores`] for `R ≤ ROWS` rows and one run of keys (the block's keys
/// `j0 ..`; `o.s` at the run's first column), 16 keys at a time. Asks for
/// the next block's keys `j0 ..` as it goes (`o.ahead`).
///
/// # Safety
/// As [`scores`] for those rows and keys.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn score_run<L: Load16, const R: usize>(o: Scores<'_>, run: Run<L::Elem>, j0: usize) {
    let (k, n, ks) = (run.at, run.rows, run.stride);
    // SAFETY (whole body): AVX-512F/BW/VL are enabled by the caller's
    // `target_feature`; every access is inside the rows, keys and (masked)
    // dims the caller vouches for.
    unsafe {
        let chunks = o.d.div_ceil(16);
        let scale = _mm512_set1_ps(o.scale);
        let mut g0 = 0;
        while g0 < n {
            let keys = (n - g0).min(16);
            // Per row: the folded quads of keys 0..8 (`half`), then all 16.
            let mut half = [_mm512_setzero_ps(); R];
            let mut full = [_mm512_setzero_ps(); R];
            for quad in 0..4 {
                let mut acc = [[_mm512_setzero_ps(); 4]; R];
                for key in quad * 4..(quad * 4 + 4).min(keys) {
                    o.ahead.key(j0 + g0 + key);
                }
                if quad * 4 < keys {
                    for c in 0..chunks {
                        let m = mask(o.d, 16 * c);
                        let qc: [__m512; R] = std::array::from_fn(|r| {
                            _mm512_maskz_loadu_ps(m, o.q.add(r * o.d + 16 * c))
                        });
                        for (i, key) in (quad * 4..quad * 4 + 4).enumerate() {
                            if key < keys {
                                let kc = L::load16(k.add((g0 + key) * ks + 16 * c), m);
                                for r in 0..R {
                                    acc[r][i] = _mm512_fmadd_ps(qc[r], kc, acc[r][i]);
                                }
                            }
                        }
                    }
                }
                for r in 0..R {
                    let folded = fold4(acc[r]);
                    match quad {
                        0 => half[r] = folded,
                        1 => half[r] = fold2(half[r], folded),
                        2 => full[r] = folded,
                        _ => full[r] = fold2(half[r], fold2(full[r], folded)),
                    }
                }
            }
            let m = mask(keys, 0);
            for (r, &sum) in full.iter().enumerate() {
                _mm512_mask_storeu_ps(o.s.add(r * o.cols + g0), m, _mm512_mul_ps(sum, scale));
            }
            g0 += 16;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Accumulate {
    p: *const f32,
    cols: usize,
    d: usize,
    acc: *mut f32,
}

/// [`accumulate`] over every row, `ROWS` at a time.
///
/// # Safety
/// As [`accumulate`], AVX-512F/BW/VL present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn accumulate_rows<L: Load16>(o: Accumulate, rows: usize, v: &[Run<L::Elem>]) {
    let mut r0 = 0;
    while r0 < rows {
        // SAFETY: rows r0 .. r0 + n of p and acc are in bounds.
        unsafe {
            let o = Accumulate {
                p: o.p.add(r0 * o.cols),
                acc: o.acc.add(r0 * o.d),
                ..o
            };
            match (rows - r0).min(ROWS) {
                4 => accumulate_block::<L, 4>(o, v),
                3 => accumulate_block::<L, 3>(o, v),
                2 => accumulate_block::<L, 2>(o, v),
                _ => accumulate_block::<L, 1>(o, v),
            }
        }
        r0 += ROWS;
    }
}

/// Vectors of 16 dims per row that [`accumulate_block`] keeps in registers.
const DIM_VECTORS: usize = 4;

/// [`accumulate`] for `R ≤ ROWS` rows: `DIM_VECTORS` vectors of dims at a
/// time (fewer for the last), each pass through all keys.
///
/// # Safety
/// As [`accumulate`] for those rows.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn accumulate_block<L: Load16, const R: usize>(o: Accumulate, v: &[Run<L::Elem>]) {
    let mut d0 = 0;
    while d0 < o.d {
        // SAFETY: dims d0 .. min(d0 + 64, d) of the rows.
        unsafe {
            match o.d.saturating_sub(d0).div_ceil(16).min(DIM_VECTORS) {
                4 => accumulate_pass::<L, R, 4>(o, v, d0),
                3 => accumulate_pass::<L, R, 3>(o, v, d0),
                2 => accumulate_pass::<L, R, 2>(o, v, d0),
                _ => accumulate_pass::<L, R, 1>(o, v, d0),
            }
        }
        d0 += 16 * DIM_VECTORS;
    }
}

/// One pass of [`accumulate_block`]: dims `d0 .. d0 + 16·C` (masked at
/// `d`) of `R` rows, in registers through all keys.
///
/// # Safety
/// As [`accumulate`] for those rows and dims.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn accumulate_pass<L: Load16, const R: usize, const C: usize>(
    o: Accumulate,
    v: &[Run<L::Elem>],
    d0: usize,
) {
    // SAFETY (whole body): AVX-512F/BW/VL are enabled by the caller's
    // `target_feature`; every load and store is inside the rows (< R),
    // keys (< cols) and dims (masked to `d`) the caller vouches for.
    unsafe {
        let masks: [__mmask16; C] = std::array::from_fn(|c| mask(o.d, d0 + 16 * c));
        let mut out: [[__m512; C]; R] = std::array::from_fn(|r| {
            std::array::from_fn(|c| {
                _mm512_maskz_loadu_ps(masks[c], o.acc.add(r * o.d + d0 + 16 * c))
            })
        });
        let mut j = 0;
        for run in v {
            for i in 0..run.rows {
                let vj: [__m512; C] = std::array::from_fn(|c| {
                    L::load16(run.at.add(i * run.stride + d0 + 16 * c), masks[c])
                });
                for (r, out) in out.iter_mut().enumerate() {
                    let pj = _mm512_set1_ps(*o.p.add(r * o.cols + j) * run.scale);
                    for c in 0..C {
                        out[c] = _mm512_fmadd_ps(pj, vj[c], out[c]);
                    }
                }
                j += 1;
            }
        }
        for (r, out) in out.iter().enumerate() {
            for (c, &x) in out.iter().enumerate() {
                _mm512_mask_storeu_ps(o.acc.add(r * o.d + d0 + 16 * c), masks[c], x);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    fn bf16s(x: &[f32]) -> Vec<half::bf16> {
        x.iter().map(|&v| half::bf16::from_f32(v)).collect()
    }

    fn f16s(x: &[f32]) -> Vec<half::f16> {
        x.iter().map(|&v| half::f16::from_f32(v)).collect()
    }

    /// Both products against f64 sums, for every row count up to past two
    /// passes, key counts with and without a partial group of 16, head
    /// dims with partial chunks, and each element type; products of the
    /// stored values, so that only the order of the sums differs.
    #[test]
    fn products_match_f64_for_every_shape_and_element() {
        if !available() {
            eprintln!("boostr: skipping: no AVX-512 on this CPU");
            return;
        }
        use crate::cpu::elem::KvElem;
        let mut rng = Rng::new(0x9e3, 0);
        for &rows in &[1, 2, 3, 4, 5, 8, 9] {
            for &cols in &[1, 5, 16, 17, 40, 64] {
                for &d in &[8, 40, 64, 80, 128, 136] {
                    let q = rng.normal_f32(rows * d, 1.0);
                    let k32 = rng.normal_f32(cols * d, 1.0);
                    let p = rng.normal_f32(rows * cols, 1.0);
                    let acc0 = rng.normal_f32(rows * d, 1.0);
                    // Rows `ks` apart (NaN between them, which no product
                    // may read) on odd key counts, else contiguous.
                    let ks = if cols % 2 == 1 { d + 7 } else { d };
                    let spread = |x: &[f32]| -> Vec<f32> {
                        let mut o = vec![f32::NAN; cols * ks];
                        for j in 0..cols {
                            o[j * ks..j * ks + d].copy_from_slice(&x[j * d..(j + 1) * d]);
                        }
                        o
                    };
                    let (kb, kh) = (bf16s(&k32), f16s(&k32));
                    let wide = |x: Vec<f32>| spread(&x);
                    let k_f32 = spread(&k32);
                    let k_bf16 = bf16s(&wide(kb.iter().map(|x| x.to_f32()).collect()));
                    let k_f16 = f16s(&wide(kh.iter().map(|x| x.to_f32()).collect()));
                    let kinds: [(Stored<'_>, Vec<f32>); 3] = [
                        (KvElem::stored(&k_f32[..]), k32.clone()),
                        (
                            KvElem::stored(&k_bf16[..]),
                            kb.iter().map(|x| x.to_f32()).collect(),
                        ),
                        (
                            KvElem::stored(&k_f16[..]),
                            kh.iter().map(|x| x.to_f32()).collect(),
                        ),
                    ];
                    for (stored, k) in kinds {
                        let scale = 0.3;
                        let mut s = vec![f32::NAN; rows * cols + 3];
                        // The keys as one run, or cut into runs of 1, 5 and
                        // 11 rows and the rest (pages).
                        let all = Rows::new(stored, cols, d, ks);
                        let runs: Vec<Rows<'_>> = if rows % 2 == 0 {
                            vec![all]
                        } else {
                            let mut runs = Vec::new();
                            let mut at = 0;
                            for n in [1, 5, 11, cols].into_iter().cycle() {
                                let n = n.min(cols - at);
                                runs.push(all.sub(at..at + n));
                                at += n;
                                if at == cols {
                                    break;
                                }
                            }
                            runs
                        };
                        // Asking for the next block (here: these keys again)
                        // never changes a result.
                        let ahead: [&[Rows<'_>]; 2] = if rows % 3 == 0 {
                            [&runs, &runs]
                        } else {
                            [&[], &[]]
                        };
                        scores(&q, d, &runs, scale, &mut s, ahead);
                        for r in 0..rows {
                            for j in 0..cols {
                                let (mut want, mut mag) = (0.0f64, 0.0f64);
                                for x in 0..d {
                                    let t = f64::from(q[r * d + x]) * f64::from(k[j * d + x]);
                                    want += t;
                                    mag += t.abs();
                                }
                                let got = f64::from(s[r * cols + j]);
                                let want = want * f64::from(scale);
                                let tol = 1e-6 * mag * f64::from(scale) + 1e-30;
                                assert!(
                                    (got - want).abs() <= tol,
                                    "scores {stored:?} rows {rows} cols {cols} d {d} ({r},{j}): {got} vs {want}"
                                );
                            }
                        }
                        assert!(s[rows * cols..].iter().all(|x| x.is_nan()), "wrote past s");
                        // The same values as V.
                        let mut acc = acc0.clone();
                        acc.extend([f32::NAN; 3]);
                        accumulate(&p, &runs, d, &mut acc[..rows * d]);
                        for r in 0..rows {
                            for x in 0..d {
                                let (mut want, mut mag) = (f64::from(acc0[r * d + x]), 0.0f64);
                                for j in 0..cols {
                                    let t = f64::from(p[r * cols + j]) * f64::from(k[j * d + x]);
                                    want += t;
                                    mag += t.abs();
                                }
                                let got = f64::from(acc[r * d + x]);
                                let tol = 1e-6 * (mag + want.abs()) + 1e-30;
                                assert!(
                                    (got - want).abs() <= tol,
                                    "accumulate {stored:?} rows {rows} cols {cols} d {d} ({r},{x})"
                                );
                            }
                        }
                        assert!(acc[rows * d..].iter().all(|x| x.is_nan()), "wrote past acc");
                    }
                }
            }
        }
    }
}
