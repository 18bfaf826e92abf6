//! The decode kernel's two products over an int8 cache, in integers:
//! `S = scale · Q Kᵀ` and `O += P V` as [`crate::cpu::gemv`] computes them for
//! float caches, with the same folds, runs (pages) and prefetches.
//!
//! Why: widened to f32, each 16 int8 values cost a sign extension and a
//! conversion, then one f32 FMA per value and query row. For Llama's 4
//! query rows per kv head that ran a decode at 28–39% of the read
//! bandwidth on a Zen 4: bound by arithmetic, not by memory. Sixteen-bit
//! integer dot products take two values per lane and need no conversion.
//!
//! `scores`: the query rows are rounded once per task to int16, each to its
//! own largest magnitude ([`Queries`]); a key row is sign-extended to int16
//! 32 dims at a time (`vpmovsxbw`) and multiplied into 32-bit lane sums by
//! `vpdpwssd` (AVX512-VNNI; `vpmaddwd` and `vpaddd` without it): 32 dims of
//! a row per instruction, exact. The lane sums of 16 keys fold into one
//! vector in integers as `gemv`'s do in floats; one conversion per 16 keys
//! and row, times `scale · key scale · query step`.
//!
//! `accumulate`: for up to [`KEYS`] keys at a time, each row's weights
//! times its key's V scale are rounded to int16 against their largest
//! (`p16 = round(p · s · 32767 / max)`). Two keys' V rows, sign-extended and
//! interleaved by dim (`vpunpck{l,h}wd`), meet the two keys' weights as one
//! 32-bit pair: one `vpdpwssd` adds both keys' products for 16 dims of a
//! row. The unpacks order dims by 128-bit lane; once per [`KEYS`] keys the
//! sums are put back in dim order (`vpermt2d`), converted and added to the
//! f32 rows times `max / 32767`.
//!
//! Exactness: every integer sum is exact (bounds at [`Queries::round`] and
//! [`KEYS`]); the one rounding either product adds is that of q or of the
//! weights to 16 bits, half a step of 2^-15 of the row's largest value:
//! 2^7 times finer than the cache's own int8 step, and finer than a bf16
//! (2^-8) or f16 (2^-11) query. Sums run in a fixed order: the same bits on
//! every run and thread count.

use crate::cpu::elem::Stored;
#[cfg(target_arch = "x86_64")]
use crate::cpu::gemv::{Ahead, Run, fold2, fold4, mask, raw_runs};
use crate::cpu::operand::Rows;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The largest int16 step count of a rounded row (int16's largest).
const STEPS: f32 = i16::MAX as f32;

/// The largest magnitude of a cache byte (−128 included: a cache written
/// by other code may hold it).
const BYTE_MAX: i64 = 128;

/// Keys per integer pass of [`accumulate`]: `KEYS · 32767 · 128 < 2^31`,
/// so that no lane sum can overflow.
const KEYS: usize = 256;

/// Rows per pass of either product, as in `gemv`.
const ROWS: usize = 4;

/// Query rows rounded to int16 for [`scores`], each against its largest
/// magnitude.
pub(in crate::cpu) struct Queries {
    q: Vec<i16>,
    /// What one int16 step of each row is worth.
    step: Vec<f32>,
    /// Elements from one row to the next: the head dim rounded up to 32,
    /// zeros past it.
    stride: usize,
}

impl Queries {
    pub(in crate::cpu) fn new() -> Self {
        Queries {
            q: Vec::new(),
            step: Vec::new(),
            stride: 0,
        }
    }

    /// Round `q`'s rows of `d` values: `q16 = round(q · n / max|q|)` to
    /// nearest even, `n = 32767`, or fewer steps where a row of `d` int16
    /// times int8 products could overflow 32 bits (`d > 512`). Returns
    /// false where a value is not finite (the rows are then unusable).
    pub(in crate::cpu) fn round(&mut self, q: &[f32], d: usize) -> bool {
        let rows = q.len() / d.max(1);
        let stride = d.div_ceil(32) * 32;
        let most = (i64::from(i32::MAX) / (BYTE_MAX * d.max(1) as i64)) as f32;
        let steps = STEPS.min(most);
        self.stride = stride;
        self.q.clear();
        self.q.resize(rows * stride, 0);
        self.step.clear();
        for (row, out) in q
            .chunks_exact(d.max(1))
            .zip(self.q.chunks_exact_mut(stride))
        {
            let top = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            if !row.iter().all(|x| x.is_finite()) {
                return false;
            }
            let inv = if top > 0.0 { steps / top } else { 0.0 };
            for (o, &x) in out.iter_mut().zip(row) {
                *o = (x * inv).round_ties_even().clamp(-steps, steps) as i16;
            }
            self.step.push(if top > 0.0 { top / steps } else { 0.0 });
        }
        true
    }

    /// Rows held.
    fn rows(&self) -> usize {
        self.step.len()
    }
}

/// Whether the int8 products run here: the AVX-512 of `gemv` (BW for the
/// 16-bit lanes).
pub(in crate::cpu) fn available() -> bool {
    crate::cpu::gemv::available()
}

/// Whether every run holds int8 values.
fn all_i8(runs: &[Rows<'_>]) -> bool {
    runs.iter().all(|r| matches!(r.data(), Stored::I8(_)))
}

/// `s[r·cols + j] = scale · Σ_d q[r][dd]·k_j[dd]` for `q`'s rows (as
/// rounded) and the `cols` keys of `keys` (int8 runs, each with its
/// scale), asking for the `ahead` runs as `gemv::scores` does.
///
/// # Panics
/// Unless [`available`], if a run is not int8 or not of rows of `d`, or if
/// `s` is too short.
pub(in crate::cpu) fn scores(
    q: &Queries,
    d: usize,
    keys: &[Rows<'_>],
    scale: f32,
    s: &mut [f32],
    ahead: [&[Rows<'_>]; 2],
) {
    assert!(available(), "AVX-512 for the decode products");
    assert!(all_i8(keys), "int8 keys");
    assert!(q.stride >= d, "queries rounded for this head dim");
    #[cfg(target_arch = "x86_64")]
    {
        let (runs, cols) = raw_runs::<u8>(keys, d);
        assert!(s.len() >= q.rows() * cols, "scores bounds");
        let o = Scores {
            q: q.q.as_ptr(),
            stride: q.stride,
            step: &q.step,
            d,
            cols,
            scale,
            s: s.as_mut_ptr(),
            ahead: Ahead::new(ahead, 1),
        };
        let runs = &runs[..keys.len()];
        // SAFETY: AVX-512F/BW/VL checked above (and VNNI where taken); the
        // runs are whole rows of live slices, `q` holds its rows × stride
        // and `s` rows × cols.
        unsafe {
            if crate::cpu::simd::vnni() {
                scores_vnni(o, runs)
            } else {
                scores_madd(o, runs)
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (q, d, keys, scale, s, ahead);
}

/// `acc[r·d + dd] += Σ_j p[r·cols + j]·v_j[dd]` for the `rows = acc.len()
/// / d` rows and the `cols` int8 value rows of `values` (runs as in
/// [`scores`], each with its scale).
///
/// # Panics
/// Unless [`available`], if a run is not int8 or not of rows of `d`, or if
/// `p` is too short.
pub(in crate::cpu) fn accumulate(p: &[f32], values: &[Rows<'_>], d: usize, acc: &mut [f32]) {
    assert!(available(), "AVX-512 for the decode products");
    assert!(all_i8(values), "int8 values");
    #[cfg(target_arch = "x86_64")]
    {
        let rows = acc.len() / d.max(1);
        let (runs, cols) = raw_runs::<u8>(values, d);
        assert!(p.len() >= rows * cols, "accumulate bounds");
        let o = Accumulate {
            p: p.as_ptr(),
            cols,
            d,
            acc: acc.as_mut_ptr(),
        };
        let runs = &runs[..values.len()];
        // SAFETY: AVX-512F/BW/VL checked above (and VNNI where taken); the
        // runs are whole rows of live slices, `p` holds rows × cols and
        // `acc` rows × d.
        unsafe {
            if crate::cpu::simd::vnni() {
                accumulate_vnni(o, rows, runs)
            } else {
                accumulate_madd(o, rows, runs)
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, values, d, acc);
}

/// A 32-bit lane's sum of two 16-bit products, added to `acc`.
#[cfg(target_arch = "x86_64")]
trait PairDot {
    /// `acc + a₀b₀ + a₁b₁` per 32-bit lane (wrapping; the callers bound
    /// their sums below 2^31).
    ///
    /// # Safety
    /// The instructions are enabled in the caller.
    unsafe fn dot(acc: __m512i, a: __m512i, b: __m512i) -> __m512i;
}

/// AVX512-VNNI's `vpdpwssd`: one instruction.
#[cfg(target_arch = "x86_64")]
struct Vnni;

/// AVX512-BW's `vpmaddwd` and a `vpaddd`.
#[cfg(target_arch = "x86_64")]
struct Madd;

#[cfg(target_arch = "x86_64")]
impl PairDot for Vnni {
    #[inline(always)]
    unsafe fn dot(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: AVX512-VNNI enabled in the caller.
        unsafe { _mm512_dpwssd_epi32(acc, a, b) }
    }
}

#[cfg(target_arch = "x86_64")]
impl PairDot for Madd {
    #[inline(always)]
    unsafe fn dot(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: AVX-512BW enabled in the caller.
        unsafe { _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)) }
    }
}

/// The lanes of the 32-wide chunk at `at` that lie below `len`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn mask32(len: usize, at: usize) -> __mmask32 {
    let live = len.saturating_sub(at).min(32);
    if live == 32 {
        u32::MAX
    } else {
        (1u32 << live) - 1
    }
}

/// The 32 bytes at `at` (those of `m`'s lanes; 0 elsewhere), sign-extended
/// to int16.
///
/// # Safety
/// AVX-512BW enabled in the caller; the bytes of `m`'s lanes readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load32(at: *const u8, m: __mmask32) -> __m512i {
    // SAFETY: the caller's contract.
    unsafe { _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, at.cast())) }
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Scores<'a> {
    q: *const i16,
    stride: usize,
    step: &'a [f32],
    d: usize,
    cols: usize,
    scale: f32,
    s: *mut f32,
    ahead: Ahead<'a>,
}

/// # Safety
/// As [`scores`]; AVX512-VNNI present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn scores_vnni(o: Scores<'_>, runs: &[Run<u8>]) {
    // SAFETY: the caller's contract.
    unsafe { scores_rows::<Vnni>(o, runs) }
}

/// # Safety
/// As [`scores`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn scores_madd(o: Scores<'_>, runs: &[Run<u8>]) {
    // SAFETY: the caller's contract.
    unsafe { scores_rows::<Madd>(o, runs) }
}

/// [`scores`] over every row, [`ROWS`] at a time, run by run.
///
/// # Safety
/// As [`scores`], with `P`'s instructions enabled.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scores_rows<P: PairDot>(o: Scores<'_>, runs: &[Run<u8>]) {
    let rows = o.step.len();
    let mut r0 = 0;
    while r0 < rows {
        let mut j0 = 0;
        for run in runs {
            // SAFETY: rows r0 .. r0 + n of q and s, columns j0 .. j0 +
            // run.rows of s, are in bounds.
            unsafe {
                let o = Scores {
                    q: o.q.add(r0 * o.stride),
                    step: &o.step[r0..],
                    s: o.s.add(r0 * o.cols + j0),
                    scale: o.scale * run.scale,
                    // The first pass over the keys asks for the next block.
                    ahead: if r0 == 0 { o.ahead } else { Ahead::NONE },
                    ..o
                };
                match (rows - r0).min(ROWS) {
                    4 => score_run::<P, 4>(o, *run, j0),
                    3 => score_run::<P, 3>(o, *run, j0),
                    2 => score_run::<P, 2>(o, *run, j0),
                    _ => score_run::<P, 1>(o, *run, j0),
                }
            }
            j0 += run.rows;
        }
        r0 += ROWS;
    }
}

/// [`scores`] for `R ≤ ROWS` rows and one run of keys (the block's keys
/// `j0 ..`), 16 keys at a time: per quad of keys, 32-lane partial sums
/// over the head dim, folded as `gemv`'s.
///
/// # Safety
/// As [`scores`] for those rows and keys.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn score_run<P: PairDot, const R: usize>(o: Scores<'_>, run: Run<u8>, j0: usize) {
    let (k, n, ks) = (run.at, run.rows, run.stride);
    // SAFETY (whole body): AVX-512F/BW/VL (and P's instructions) are
    // enabled by the caller; every access is inside the rows, keys and
    // (masked) dims the caller vouches for; q's rows hold `stride` values.
    unsafe {
        let chunks = o.d.div_ceil(32);
        let step: [__m512; R] = std::array::from_fn(|r| _mm512_set1_ps(o.scale * o.step[r]));
        let mut g0 = 0;
        while g0 < n {
            let keys = (n - g0).min(16);
            // Per row, each quad of keys' lane sums folded (as `gemv`).
            let mut quads = [[_mm512_setzero_si512(); 4]; R];
            for quad in 0..4 {
                let first = quad * 4;
                if first >= keys {
                    break;
                }
                for key in first..(first + 4).min(keys) {
                    o.ahead.key(j0 + g0 + key);
                }
                let mut acc = [[_mm512_setzero_si512(); 4]; R];
                for c in 0..chunks {
                    let m = mask32(o.d, 32 * c);
                    let qc: [__m512i; R] = std::array::from_fn(|r| {
                        _mm512_loadu_si512(o.q.add(r * o.stride + 32 * c).cast())
                    });
                    for (i, key) in (first..(first + 4).min(keys)).enumerate() {
                        let kc = load32(k.add((g0 + key) * ks + 32 * c), m);
                        for r in 0..R {
                            acc[r][i] = P::dot(acc[r][i], qc[r], kc);
                        }
                    }
                }
                for (quads, acc) in quads.iter_mut().zip(acc) {
                    quads[quad] = fold4(acc);
                }
            }
            let m = mask(keys, 0);
            for r in 0..R {
                let [a, b, c, e] = quads[r];
                let sums = fold2(fold2(a, b), fold2(c, e));
                let x = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), step[r]);
                _mm512_mask_storeu_ps(o.s.add(r * o.cols + g0), m, x);
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

/// # Safety
/// As [`accumulate`]; AVX512-VNNI present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn accumulate_vnni(o: Accumulate, rows: usize, runs: &[Run<u8>]) {
    // SAFETY: the caller's contract.
    unsafe { accumulate_rows::<Vnni>(o, rows, runs) }
}

/// # Safety
/// As [`accumulate`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn accumulate_madd(o: Accumulate, rows: usize, runs: &[Run<u8>]) {
    // SAFETY: the caller's contract.
    unsafe { accumulate_rows::<Madd>(o, rows, runs) }
}

/// [`accumulate`]: [`KEYS`] keys at a time (their row addresses and
/// scales gathered from the runs), [`ROWS`] rows at a time.
///
/// # Safety
/// As [`accumulate`], with `P`'s instructions enabled.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn accumulate_rows<P: PairDot>(o: Accumulate, rows: usize, runs: &[Run<u8>]) {
    let mut at = [std::ptr::null::<u8>(); KEYS];
    let mut scale = [0.0f32; KEYS];
    let mut keys = runs.iter().flat_map(|run| {
        (0..run.rows).map(move |i| (run.at.wrapping_add(i * run.stride), run.scale))
    });
    let mut j0 = 0;
    while j0 < o.cols {
        let n = (o.cols - j0).min(KEYS);
        for (j, (a, s)) in (&mut keys).take(n).enumerate() {
            (at[j], scale[j]) = (a, s);
        }
        let mut r0 = 0;
        while r0 < rows {
            let keys = Keys {
                at: &at[..n],
                scale: &scale[..n],
                j0,
            };
            // SAFETY: rows r0 .. r0 + R of p and acc, keys j0 .. j0 + n.
            unsafe {
                match (rows - r0).min(ROWS) {
                    4 => accumulate_keys::<P, 4>(o, r0, keys),
                    3 => accumulate_keys::<P, 3>(o, r0, keys),
                    2 => accumulate_keys::<P, 2>(o, r0, keys),
                    _ => accumulate_keys::<P, 1>(o, r0, keys),
                }
            }
            r0 += ROWS;
        }
        j0 += n;
    }
}

/// Up to [`KEYS`] value rows: each one's first byte and scale, the first
/// one's column in `p`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Keys<'a> {
    at: &'a [*const u8],
    scale: &'a [f32],
    j0: usize,
}

/// Each row's weights of `keys`, times their scales, rounded to int16
/// against the row's largest, with one more 0 (the pair of an odd last
/// key); and what one step is worth (NaN where a weight is not finite, so
/// that the row's output carries it as the f32 products would).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn round_weights<const R: usize>(
    o: Accumulate,
    r0: usize,
    keys: Keys<'_>,
    p16: &mut [[i16; KEYS + 16]; R],
) -> [f32; R] {
    let n = keys.at.len();
    let mut step = [0.0f32; R];
    // SAFETY (whole body): AVX-512F/BW enabled in the caller; weights of
    // rows r0 .. r0 + R, columns j0 .. j0 + n, masked past n. (Loops, not
    // closures: a closure would not inherit the caller's target features,
    // and each intrinsic in it would become a call.)
    unsafe {
        for r in 0..R {
            let p = o.p.add((r0 + r) * o.cols + keys.j0);
            let (mut top, mut odd) = (_mm512_setzero_ps(), 0u16);
            let mut j = 0;
            while j < n {
                let m = mask(n, j);
                let x = _mm512_mul_ps(
                    _mm512_maskz_loadu_ps(m, p.add(j)),
                    _mm512_maskz_loadu_ps(m, keys.scale.as_ptr().add(j)),
                );
                top = _mm512_max_ps(top, _mm512_abs_ps(x));
                odd |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
                j += 16;
            }
            let top = _mm512_reduce_max_ps(top);
            if odd != 0 || !top.is_finite() {
                step[r] = f32::NAN;
                continue;
            }
            let inv = _mm512_set1_ps(if top > 0.0 { STEPS / top } else { 0.0 });
            let mut j = 0;
            while j < n {
                let m = mask(n, j);
                let x = _mm512_mul_ps(
                    _mm512_maskz_loadu_ps(m, p.add(j)),
                    _mm512_maskz_loadu_ps(m, keys.scale.as_ptr().add(j)),
                );
                // Rounded to nearest even (the default rounding mode).
                let x = _mm512_cvtps_epi32(_mm512_mul_ps(x, inv));
                _mm256_storeu_si256(p16[r].as_mut_ptr().add(j).cast(), _mm512_cvtepi32_epi16(x));
                j += 16;
            }
            p16[r][n] = 0;
            step[r] = top / STEPS;
        }
    }
    step
}

/// [`accumulate`] for `R ≤ ROWS` rows from `r0` and up to [`KEYS`] keys:
/// the weights rounded, then 64 dims at a time.
///
/// # Safety
/// As [`accumulate`] for those rows and keys.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn accumulate_keys<P: PairDot, const R: usize>(o: Accumulate, r0: usize, keys: Keys<'_>) {
    let mut p16 = [[0i16; KEYS + 16]; R];
    // SAFETY: the caller's contract, passed on.
    unsafe {
        let step = round_weights::<R>(o, r0, keys, &mut p16);
        let mut d0 = 0;
        while d0 < o.d {
            match (o.d - d0).div_ceil(32) {
                1 => accumulate_pass::<P, R, 1>(o, r0, keys, (&p16, step), d0),
                _ => accumulate_pass::<P, R, 2>(o, r0, keys, (&p16, step), d0),
            }
            d0 += 64;
        }
    }
}

/// One pass of [`accumulate_keys`]: dims `d0 .. d0 + 32·C` (masked at
/// `d`) of `R` rows as 32-bit sums in registers through the keys, two keys
/// at a time; then back in dim order, converted, and added to `acc`.
///
/// # Safety
/// As [`accumulate`] for those rows, keys and dims.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn accumulate_pass<P: PairDot, const R: usize, const C: usize>(
    o: Accumulate,
    r0: usize,
    keys: Keys<'_>,
    (p16, step): (&[[i16; KEYS + 16]; R], [f32; R]),
    d0: usize,
) {
    // SAFETY (whole body): AVX-512F/BW/VL (and P's instructions) enabled
    // by the caller; every load and store is inside the rows, keys and
    // (masked) dims the caller vouches for; `p16` rows hold n + 1 values.
    unsafe {
        let masks: [__mmask32; C] = std::array::from_fn(|c| mask32(o.d, d0 + 32 * c));
        // Per row and 32 dims: the sums of dims `8l + 0..4` (`[0]`) and
        // `8l + 4..8` (`[1]`) of each 128-bit lane `l`, as the unpacks
        // leave them.
        let mut sums = [[[_mm512_setzero_si512(); 2]; C]; R];
        let n = keys.at.len();
        let mut j = 0;
        while j < n {
            let pairs: [[__m512i; 2]; C] = std::array::from_fn(|c| {
                let a = load32(keys.at[j].add(d0 + 32 * c), masks[c]);
                let b = match keys.at.get(j + 1) {
                    Some(&next) => load32(next.add(d0 + 32 * c), masks[c]),
                    None => _mm512_setzero_si512(),
                };
                [_mm512_unpacklo_epi16(a, b), _mm512_unpackhi_epi16(a, b)]
            });
            for r in 0..R {
                let w = _mm512_set1_epi32(p16[r].as_ptr().add(j).cast::<i32>().read_unaligned());
                for c in 0..C {
                    sums[r][c][0] = P::dot(sums[r][c][0], pairs[c][0], w);
                    sums[r][c][1] = P::dot(sums[r][c][1], pairs[c][1], w);
                }
            }
            j += 2;
        }
        // Dims 0..16 of 32: lanes 0..4 of each half, then 4..8; 16..32:
        // lanes 8..12, then 12..16.
        let order = [
            _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
            _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31),
        ];
        for (r, sums) in sums.iter().enumerate() {
            let st = _mm512_set1_ps(step[r]);
            for (c, &[lo, hi]) in sums.iter().enumerate() {
                for (h, order) in order.iter().enumerate() {
                    let x = _mm512_permutex2var_epi32(lo, *order, hi);
                    let at = d0 + 32 * c + 16 * h;
                    let m = mask(o.d, at);
                    let dst = o.acc.add((r0 + r) * o.d + at);
                    let y =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(x), st, _mm512_maskz_loadu_ps(m, dst));
                    _mm512_mask_storeu_ps(dst, m, y);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::simd::{LEVEL_CAP, Level};
    use crate::testing::Rng;

    /// Both products against f64 sums of the int8 values, for row counts
    /// past two passes, key counts past one integer pass with odd tails,
    /// head dims with partial chunks, runs (pages) of their own scales,
    /// with and without VNNI: within the bound the rounding of q or of the
    /// weights to int16 allows (half a step per value), and nothing
    /// written past the outputs.
    #[test]
    fn products_match_f64_within_the_int16_rounding() {
        if !available() {
            eprintln!("boostr: skipping: no AVX-512 on this CPU");
            return;
        }
        let mut rng = Rng::new(0x18d, 0);
        for level in [Level::Avx512, Level::Amx] {
            LEVEL_CAP.with(|c| c.set(level));
            for &rows in &[1, 3, 4, 5, 9] {
                for &cols in &[1, 17, 64, 301] {
                    for &d in &[8, 40, 64, 128, 576] {
                        check(&mut rng, rows, cols, d);
                    }
                }
            }
        }
        LEVEL_CAP.with(|c| c.set(Level::Amx));
    }

    fn check(rng: &mut Rng, rows: usize, cols: usize, d: usize) {
        let q = rng.normal_f32(rows * d, 1.0);
        let p: Vec<f32> = (0..rows * cols)
            .map(|_| rng.uniform().powi(2) as f32)
            .collect();
        // Rows `d + 5` apart, the gaps poisoned with 0x80 bytes no product
        // may read; bytes over the whole range, −128 included.
        let ks = d + 5;
        let mut bytes = vec![0x80u8; cols * ks];
        for j in 0..cols {
            for x in 0..d {
                bytes[j * ks + x] = (rng.uniform() * 256.0) as u8;
            }
        }
        let value = |j: usize, x: usize| f64::from(bytes[j * ks + x] as i8);
        // Runs of 1, 5, 11 and the rest, each with a scale of its own.
        let all = Rows::new(Stored::I8(&bytes), cols, d, ks);
        let (mut runs, mut scale_of) = (Vec::new(), vec![0.0f32; cols]);
        let mut at = 0;
        for n in [1, 5, 11, cols].into_iter().cycle() {
            let n = n.min(cols - at);
            let s = 0.01 + 0.02 * runs.len() as f32;
            runs.push(all.sub(at..at + n).scaled(s));
            scale_of[at..at + n].fill(s);
            at += n;
            if at == cols {
                break;
            }
        }
        let mut queries = Queries::new();
        assert!(queries.round(&q, d));
        let scale = 0.3;
        let mut s = vec![f32::NAN; rows * cols + 3];
        scores(&queries, d, &runs, scale, &mut s, [&runs, &[]]);
        for r in 0..rows {
            let row = &q[r * d..(r + 1) * d];
            let top = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let steps = STEPS.min((i64::from(i32::MAX) / (128 * d as i64)) as f32);
            let half = f64::from(top) / f64::from(steps) / 2.0;
            for j in 0..cols {
                let ksc = f64::from(scale_of[j]) * f64::from(scale);
                let (mut want, mut bound) = (0.0f64, 0.0f64);
                for (x, &qx) in row.iter().enumerate() {
                    want += f64::from(qx) * value(j, x) * ksc;
                    bound += half * value(j, x).abs() * ksc;
                }
                let got = f64::from(s[r * cols + j]);
                let tol = bound * 1.0001 + 1e-6 * want.abs() + 1e-30;
                assert!(
                    (got - want).abs() <= tol,
                    "scores rows {rows} cols {cols} d {d} ({r},{j}): {got} vs {want} (bound {bound})"
                );
            }
        }
        assert!(s[rows * cols..].iter().all(|x| x.is_nan()), "wrote past s");

        let acc0 = rng.normal_f32(rows * d, 1.0);
        let mut acc = acc0.clone();
        acc.extend([f32::NAN; 3]);
        accumulate(&p, &runs, d, &mut acc[..rows * d]);
        for r in 0..rows {
            let weight = |j: usize| f64::from(p[r * cols + j]) * f64::from(scale_of[j]);
            for x in 0..d {
                let (mut want, mut bound) = (f64::from(acc0[r * d + x]), 0.0f64);
                for j0 in (0..cols).step_by(KEYS) {
                    let keys = j0..(j0 + KEYS).min(cols);
                    let top = keys.clone().map(weight).fold(0.0, f64::max);
                    let half = top / f64::from(STEPS) / 2.0;
                    for j in keys {
                        want += weight(j) * value(j, x);
                        bound += half * value(j, x).abs();
                    }
                }
                let got = f64::from(acc[r * d + x]);
                let tol = bound * 1.0001 + 1e-6 * want.abs() + 1e-6;
                assert!(
                    (got - want).abs() <= tol,
                    "accumulate rows {rows} cols {cols} d {d} ({r},{x}): {got} vs {want}"
                );
            }
        }
        assert!(acc[rows * d..].iter().all(|x| x.is_nan()), "wrote past acc");
    }

    /// Queries with a value that is not finite are refused (the caller
    /// then takes the f32 products, which carry it).
    #[test]
    fn queries_that_are_not_finite_are_refused() {
        let mut queries = Queries::new();
        assert!(queries.round(&[1.0, -2.0, 0.5, 0.0], 2));
        assert_eq!(queries.q[..2], [16384, -32767]);
        assert!(queries.q[2..32].iter().all(|&x| x == 0), "padding");
        assert_eq!(queries.q[32..34], [32767, 0]);
        for bad in [f32::NAN, f32::INFINITY] {
            assert!(!queries.round(&[1.0, bad], 2));
        }
    }
}
