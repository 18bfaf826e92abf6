//! An AVX-512 register-blocked f32 GEMM for attention tiles, with no packing.
//!
//! Every tile product of the attention kernels has a right-hand side whose
//! rows are contiguous (`Kᵀ` and `Vᵀ` tiles laid out `D × Bk`, and `V`, `K`,
//! `Q`, `dO` tiles `rows × D`), and a left-hand side of at most a few hundred
//! rows that is read one element at a time. So neither operand needs the
//! packing a general GEMM does (with the `gemm` crate, `perf` put 8–11% of
//! the forward's time in its panel copies for these small products): the kernel
//! broadcasts `A[i][p]` straight from memory, whatever `A`'s strides are (a
//! transposed `P` or `dS` is just another stride), and streams row `p` of
//! `B` in 16-wide vectors.
//!
//! Blocking: `MR = 6` rows × `NR = 64` columns of `C` live in 24 zmm
//! accumulators; each step of the reduction loads four vectors of `B` and
//! does 24 FMAs, with the six broadcasts of `A` as their memory operands.
//! Twenty-four independent accumulators cover the FMA latency (4 cycles × 2
//! ports) with room to spare, and 24 FMAs per step amortise the loop's
//! address arithmetic. Column tails use masked loads and stores and run only
//! their live vectors (the last 16 columns of a head dim of 80 cost one
//! vector's FMAs, not four), row tails a smaller `MR`; both are const
//! parameters. A product one vector wide (`n ≤ 16`: a decode block's
//! `Sᵀ = K Qᵀ` for 16 query rows) runs blocks of 12 rows instead, so that
//! twelve accumulators, not six, cover the FMA latency. Columns are the outer loop, so one
//! `k × 64` panel of `B` stays in L1 while every row block passes over it.
//!
//! Measured single-threaded on a 2-core AVX-512 Xeon, best of 5 × 20 000
//! calls, over three runs of `python3 bench/cpu_vs_torch.py --section gemm`
//! (its `tile` rows), in GFLOP/s, the `gemm` crate in brackets: 64×64×64
//! 152–196 (130–180), with `A` transposed 180–193 (152–171), 64×128×64
//! 181–192 (153–155), 64×64×128 194–200 (165–171).
//!
//! Arithmetic: each element of `C` is `fma`-accumulated over `p = 0, 1, …`
//! in order from zero, then `C = beta·acc` or `C = fma(beta, acc, C)`: the
//! same bits on every run, whatever the threads.

use std::arch::x86_64::*;

/// Rows of `C` per microkernel call.
const MR: usize = 6;
/// 16-lane vectors of `C` per row per microkernel call.
const NV: usize = 4;
/// Columns of `C` per microkernel call.
const NR: usize = 16 * NV;

/// Operands of one product, as raw parts; see [`matmul`].
#[derive(Clone, Copy)]
pub(in crate::cpu) struct Operands {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// `C[i][j]` at `c + i·ldc + j`.
    pub c: *mut f32,
    pub ldc: usize,
    /// `A[i][p]` at `a + i·a_rs + p·a_cs`.
    pub a: *const f32,
    pub a_rs: usize,
    pub a_cs: usize,
    /// `B[p][j]` at `b + p·ldb + j`.
    pub b: *const f32,
    pub ldb: usize,
    pub beta: f32,
    pub accumulate: bool,
}

/// `C (=|+=) beta · A · B`.
///
/// # Safety
/// The CPU supports AVX-512F; every `C[i][j]`, `A[i][p]`,
/// `B[p][j]` with `i < m`, `j < n`, `p < k` addressed as documented on
/// [`Operands`] is in bounds of its allocation; `C` overlaps neither `A`
/// nor `B`. With `accumulate == false`, `C` is only written.
#[target_feature(enable = "avx512f")]
pub(in crate::cpu) unsafe fn matmul(o: Operands) {
    if o.n <= 16 {
        // One vector per row (a decode block's `Sᵀ = K Qᵀ` for 16 query
        // rows): taller blocks, so that twelve accumulators, not six,
        // cover the FMA latency.
        let cols = o.n;
        // SAFETY: as this function's.
        unsafe { tall_block(o, cols) };
        return;
    }
    let mut j0 = 0;
    while j0 < o.n {
        let cols = NR.min(o.n - j0);
        // SAFETY: columns `j0 .. j0 + cols` lie inside `n`.
        unsafe {
            let o = Operands {
                c: o.c.add(j0),
                b: o.b.add(j0),
                ..o
            };
            // A narrow last block (a head dim of 80 leaves 16 columns)
            // runs only the vectors it has live, not all four.
            match cols.div_ceil(16) {
                4 => column_block::<4>(o, cols),
                3 => column_block::<3>(o, cols),
                2 => column_block::<2>(o, cols),
                _ => column_block::<1>(o, cols),
            }
        }
        j0 += NR;
    }
}

/// The first `cols ≤ 16·V` columns of `C`, every row, in blocks of `MR`
/// rows and `V` vectors.
///
/// # Safety
/// As [`matmul`], for those columns.
#[inline(always)]
unsafe fn column_block<const V: usize>(o: Operands, cols: usize) {
    let masks: [__mmask16; V] = std::array::from_fn(|v| tail_mask(cols, 16 * v));
    for (block, rows) in RowBlocks::new(o, MR) {
        // SAFETY: the block `rows × cols` lies inside the columns'
        // `m × cols`; masked lanes are neither loaded nor stored.
        unsafe {
            match rows {
                6 => block_kernel::<6, V>(block, masks),
                5 => block_kernel::<5, V>(block, masks),
                4 => block_kernel::<4, V>(block, masks),
                3 => block_kernel::<3, V>(block, masks),
                2 => block_kernel::<2, V>(block, masks),
                _ => block_kernel::<1, V>(block, masks),
            }
        }
    }
}

/// Rows of `C` per call of [`tall_block`]'s kernel.
const MR_TALL: usize = 12;

/// [`column_block::<1>`] in blocks of [`MR_TALL`] rows.
///
/// # Safety
/// As [`matmul`], for `cols ≤ 16` columns.
#[inline(always)]
unsafe fn tall_block(o: Operands, cols: usize) {
    let masks = [tail_mask(cols, 0)];
    for (block, rows) in RowBlocks::new(o, MR_TALL) {
        // SAFETY: as in `column_block`.
        unsafe {
            match rows {
                12 => block_kernel::<12, 1>(block, masks),
                11 => block_kernel::<11, 1>(block, masks),
                10 => block_kernel::<10, 1>(block, masks),
                9 => block_kernel::<9, 1>(block, masks),
                8 => block_kernel::<8, 1>(block, masks),
                7 => block_kernel::<7, 1>(block, masks),
                6 => block_kernel::<6, 1>(block, masks),
                5 => block_kernel::<5, 1>(block, masks),
                4 => block_kernel::<4, 1>(block, masks),
                3 => block_kernel::<3, 1>(block, masks),
                2 => block_kernel::<2, 1>(block, masks),
                _ => block_kernel::<1, 1>(block, masks),
            }
        }
    }
}

/// The blocks of `mr` rows of `C` (the last one shorter): the operands
/// from each block's first row on, and its rows.
struct RowBlocks {
    o: Operands,
    mr: usize,
    i0: usize,
}

impl RowBlocks {
    #[inline(always)]
    fn new(o: Operands, mr: usize) -> Self {
        Self { o, mr, i0: 0 }
    }
}

impl Iterator for RowBlocks {
    type Item = (Operands, usize);

    #[inline(always)]
    fn next(&mut self) -> Option<(Operands, usize)> {
        let (o, i0) = (self.o, self.i0);
        if i0 >= o.m {
            return None;
        }
        self.i0 += self.mr;
        let block = Operands {
            c: o.c.wrapping_add(i0 * o.ldc),
            a: o.a.wrapping_add(i0 * o.a_rs),
            ..o
        };
        Some((block, self.mr.min(o.m - i0)))
    }
}

/// The lanes of vector `v0 / 16` that hold one of the first `cols` columns.
#[inline(always)]
fn tail_mask(cols: usize, v0: usize) -> __mmask16 {
    let live = cols.saturating_sub(v0).min(16);
    ((1u32 << live) - 1) as __mmask16
}

/// One `R × 16·V` block of `C` (fewer columns where `masks` say so).
///
/// # Safety
/// As [`matmul`], for the block: rows `0..R`, the columns enabled in `masks`.
#[inline(always)]
unsafe fn block_kernel<const R: usize, const V: usize>(o: Operands, masks: [__mmask16; V]) {
    // SAFETY (whole body): AVX-512F is enabled by the caller's
    // `target_feature`; every pointer formed addresses an element of the
    // block (see the function's contract), and masked lanes are not touched.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        if masks[V - 1] == 0xffff {
            for p in 0..o.k {
                let b = o.b.add(p * o.ldb);
                let bv: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(b.add(16 * v)));
                let a = o.a.add(p * o.a_cs);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let ar = _mm512_set1_ps(*a.add(r * o.a_rs));
                    for v in 0..V {
                        acc[v] = _mm512_fmadd_ps(ar, bv[v], acc[v]);
                    }
                }
            }
        } else {
            for p in 0..o.k {
                let b = o.b.add(p * o.ldb);
                let bv: [__m512; V] =
                    std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], b.add(16 * v)));
                let a = o.a.add(p * o.a_cs);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let ar = _mm512_set1_ps(*a.add(r * o.a_rs));
                    for v in 0..V {
                        acc[v] = _mm512_fmadd_ps(ar, bv[v], acc[v]);
                    }
                }
            }
        }
        let beta = _mm512_set1_ps(o.beta);
        for (r, acc) in acc.iter().enumerate() {
            let c = o.c.add(r * o.ldc);
            for (v, &acc) in acc.iter().enumerate() {
                let (cv, mask) = (c.add(16 * v), masks[v]);
                let out = if o.accumulate {
                    _mm512_fmadd_ps(acc, beta, _mm512_maskz_loadu_ps(mask, cv))
                } else {
                    _mm512_mul_ps(acc, beta)
                };
                _mm512_mask_storeu_ps(cv, mask, out);
            }
        }
    }
}

/// `iters` rounds of 24 independent 16-lane FMAs on registers only, the
/// blocking of [`matmul`] without its loads: the FMA throughput of one
/// core, the ceiling of every tile product. Returns a value computed from
/// every accumulator, so that none of the work can be optimised away.
#[target_feature(enable = "avx512f")]
pub(in crate::cpu) fn fma_loop(iters: usize) -> f32 {
    // Opaque starting values: folded constants would let the compiler
    // rearrange the loop.
    let mut acc = std::hint::black_box([_mm512_set1_ps(1.0); MR * NV]);
    let (b, c) = std::hint::black_box((_mm512_set1_ps(0.999_999_9), _mm512_set1_ps(1e-7)));
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, b, c);
        }
    }
    acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
}

/// How [`transpose`] and [`widen`] read 16 source elements into f32 lanes:
/// f32 as stored, bf16 and f16 (their bits, `u16`) widened in registers.
pub(in crate::cpu) trait Load16 {
    /// The stored element.
    type Elem: Copy;
    /// `p[i]` as f32 in lane `i` of the lanes set in `mask`, 0 elsewhere.
    ///
    /// # Safety
    /// AVX-512F, BW and VL are enabled in the caller; the elements of the
    /// lanes in `mask` are readable.
    unsafe fn load16(p: *const Self::Elem, mask: __mmask16) -> __m512;
}

/// f32 elements, read as stored.
pub(in crate::cpu) struct F32s;
/// bf16 bits, widened by a shift (exact).
pub(in crate::cpu) struct Bf16s;
/// f16 bits, widened by `vcvtph2ps` (exact).
pub(in crate::cpu) struct F16s;

impl Load16 for F32s {
    type Elem = f32;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    unsafe fn load16(p: *const f32, mask: __mmask16) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe { _mm512_maskz_loadu_ps(mask, p) }
    }
}

impl Load16 for Bf16s {
    type Elem = u16;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    unsafe fn load16(p: *const u16, mask: __mmask16) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            let bits = _mm256_maskz_loadu_epi16(mask, p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
        }
    }
}

/// fp8 E4M3 bits, widened through f16 (`vcvtph2ps`, then times 2^8 for
/// the exponent bias; exact), NaN where all but the sign bit are set.
pub(in crate::cpu) struct E4m3s;
/// fp8 E5M2 bits: the upper byte of an f16 (`vcvtph2ps`; exact).
pub(in crate::cpu) struct E5m2s;

impl Load16 for E4m3s {
    type Elem = u8;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    unsafe fn load16(p: *const u8, mask: __mmask16) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            let bytes = _mm_maskz_loadu_epi8(mask, p.cast());
            // Sign-extended, shifted left 7: the sign fills bits 14 and 15,
            // the magnitude bits 7..=13; bit 14 cleared, the f16 of the
            // value times 2^-8.
            let x = _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(bytes));
            let h = _mm256_and_si256(x, _mm256_set1_epi16(0xbfff_u16 as i16));
            let f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0));
            let mag = _mm_and_si128(bytes, _mm_set1_epi8(0x7f));
            let nan = _mm_cmpeq_epi8_mask(mag, _mm_set1_epi8(0x7f));
            _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(f32::NAN))
        }
    }
}

impl Load16 for E5m2s {
    type Elem = u8;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    unsafe fn load16(p: *const u8, mask: __mmask16) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            let x = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mask, p.cast()));
            _mm512_cvtph_ps(_mm256_slli_epi16::<8>(x))
        }
    }
}

/// int8 values (a quantised cache, its scales applied by the kernels),
/// sign-extended and converted (exact).
pub(in crate::cpu) struct I8s;

impl Load16 for I8s {
    type Elem = u8;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    unsafe fn load16(p: *const u8, mask: __mmask16) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p.cast()))) }
    }
}

impl Load16 for F16s {
    type Elem = u16;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    unsafe fn load16(p: *const u16, mask: __mmask16) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe { _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.cast())) }
    }
}

/// Write the transpose of the `rows × cols` matrix at `src` (elements of
/// `L`, widened to f32; rows `src_rs` apart) into `dst` (`cols × rows`,
/// row stride `dst_rs`): `dst[c·dst_rs + r] = src[r·src_rs + c]`. Only
/// those elements of `dst` are written, none read.
///
/// In 16 × 16 blocks held in registers: sixteen (masked) row loads (which
/// widen 16-bit elements on the way), the usual four rounds of sixteen
/// shuffles (pairs of rows interleaved by element, then by element pair,
/// then the 128-bit lanes regrouped twice), and sixteen (masked) row
/// stores: about 0.3 cycles per element, against one or more for an
/// element-by-element copy, whose stores also stride `dst_rs` apart.
///
/// # Safety
/// The CPU supports AVX-512F, BW and VL; every `src[r·src_rs + c]` (`r <
/// rows`, `c < cols`) is readable and every `dst[c·dst_rs + r]` (`r < rows`, `c <
/// cols`) is in bounds of `dst`'s allocation; the two do not overlap.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(in crate::cpu) unsafe fn transpose<L: Load16>(
    src: *const L::Elem,
    (rows, cols, src_rs): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
) {
    let mut r0 = 0;
    while r0 < rows {
        let live_rows = 16.min(rows - r0);
        let row_mask = tail_mask(live_rows, 0);
        let mut c0 = 0;
        while c0 < cols {
            let live_cols = 16.min(cols - c0);
            let col_mask = tail_mask(live_cols, 0);
            // SAFETY: rows `r0 .. r0 + live_rows` and columns
            // `c0 .. c0 + live_cols` of `src` are in bounds, and so are the
            // matching `dst` elements; masked lanes are not touched.
            unsafe {
                let x: [__m512; 16] = std::array::from_fn(|i| {
                    if i < live_rows {
                        L::load16(src.add((r0 + i) * src_rs + c0), col_mask)
                    } else {
                        _mm512_setzero_ps()
                    }
                });
                let t = transpose_16x16(x);
                for (c, row) in t.iter().enumerate().take(live_cols) {
                    _mm512_mask_storeu_ps(dst.add((c0 + c) * dst_rs + r0), row_mask, *row);
                }
            }
            c0 += 16;
        }
        r0 += 16;
    }
}

/// `dst[i] = src[i]` widened to f32, for `i < n`.
///
/// # Safety
/// The CPU supports AVX-512F, BW and VL; `src` and `dst` address `n`
/// elements each and do not overlap.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(in crate::cpu) unsafe fn widen<L: Load16>(src: *const L::Elem, dst: *mut f32, n: usize) {
    let mut i = 0;
    while i < n {
        let mask = tail_mask(n - i, 0);
        // SAFETY: elements `i .. min(i + 16, n)` are in bounds of both.
        unsafe { _mm512_mask_storeu_ps(dst.add(i), mask, L::load16(src.add(i), mask)) };
        i += 16;
    }
}

/// The transpose of a 16 × 16 block given as its rows: row `c` of the
/// result is column `c` of `x`.
#[inline(always)]
fn transpose_16x16(x: [__m512; 16]) -> [__m512; 16] {
    // SAFETY: register-only shuffles; AVX-512F is enabled by every caller.
    unsafe {
        // Within each 128-bit lane `l`, `t[2i]` = x[2i][4l], x[2i+1][4l],
        // x[2i][4l+1], x[2i+1][4l+1]; `t[2i+1]` the same for 4l+2, 4l+3.
        let t: [__m512; 16] = std::array::from_fn(|n| {
            let (a, b) = (x[n & !1], x[n | 1]);
            if n % 2 == 0 {
                _mm512_unpacklo_ps(a, b)
            } else {
                _mm512_unpackhi_ps(a, b)
            }
        });
        // Lane `l` of `u[4i + j]` is column `4l + j` of rows `4i .. 4i + 4`.
        let u: [__m512; 16] = std::array::from_fn(|n| {
            let (i4, j) = (n & !3, n & 3);
            let a = _mm512_castps_pd(t[i4 + (j >> 1)]);
            let b = _mm512_castps_pd(t[i4 + 2 + (j >> 1)]);
            _mm512_castpd_ps(if j % 2 == 0 {
                _mm512_unpacklo_pd(a, b)
            } else {
                _mm512_unpackhi_pd(a, b)
            })
        });
        // Column `4l + j` is lane `l` of u[j], u[4 + j], u[8 + j], u[12 + j].
        let mut out = [_mm512_setzero_ps(); 16];
        for j in 0..4 {
            let x0 = _mm512_shuffle_f32x4::<0x44>(u[j], u[4 + j]);
            let x1 = _mm512_shuffle_f32x4::<0xee>(u[j], u[4 + j]);
            let y0 = _mm512_shuffle_f32x4::<0x44>(u[8 + j], u[12 + j]);
            let y1 = _mm512_shuffle_f32x4::<0xee>(u[8 + j], u[12 + j]);
            out[j] = _mm512_shuffle_f32x4::<0x88>(x0, y0);
            out[4 + j] = _mm512_shuffle_f32x4::<0xdd>(x0, y0);
            out[8 + j] = _mm512_shuffle_f32x4::<0x88>(x1, y1);
            out[12 + j] = _mm512_shuffle_f32x4::<0xdd>(x1, y1);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// `C (=|+=) beta·A·B` through the kernel against an f64 reference, with
    /// `A` stored row-major or transposed, `B` with padded rows, `C` poisoned
    /// (NaN) in overwrite mode so an unwritten element fails, and guard
    /// elements after `C` that must stay untouched.
    fn check(m: usize, n: usize, k: usize, a_transposed: bool, accumulate: bool, rng: &mut Rng) {
        let ldb = n + 3;
        let a = rng.normal_f32(m * k, 1.0);
        let b = rng.normal_f32(k * ldb, 1.0);
        let (a_rs, a_cs) = if a_transposed { (1, m) } else { (k, 1) };
        let c0 = if accumulate {
            rng.normal_f32(m * n, 1.0)
        } else {
            vec![f32::NAN; m * n]
        };
        let guard = 7;
        let mut c = c0.clone();
        c.extend(std::iter::repeat_n(-1234.5f32, guard));
        let beta = 0.37f32;
        // SAFETY: the test runs only where AVX-512F exists; every index the
        // kernel forms is inside `a` (m·k), `b` (k·ldb) and `c` (m·n).
        unsafe {
            matmul(Operands {
                m,
                n,
                k,
                c: c.as_mut_ptr(),
                ldc: n,
                a: a.as_ptr(),
                a_rs,
                a_cs,
                b: b.as_ptr(),
                ldb,
                beta,
                accumulate,
            })
        };
        for i in 0..m {
            for j in 0..n {
                let (mut want, mut mag) = (0.0f64, 0.0f64);
                for p in 0..k {
                    let x = a[i * a_rs + p * a_cs] as f64 * b[p * ldb + j] as f64;
                    want += x;
                    mag += x.abs();
                }
                want *= beta as f64;
                let base = if accumulate {
                    c0[i * n + j] as f64
                } else {
                    0.0
                };
                let got = c[i * n + j] as f64;
                let tol = 1e-6 * (mag * beta as f64 + base.abs()) + 1e-30;
                assert!(
                    (got - want - base).abs() <= tol,
                    "m={m} n={n} k={k} at ({i},{j}): {got} vs {}",
                    want + base
                );
            }
        }
        assert!(c[m * n..].iter().all(|&x| x == -1234.5), "wrote past C");
    }

    #[test]
    fn odd_shapes_strides_and_modes_match_f64() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        let mut rng = Rng::new(0x6e44, 1);
        let sizes = [1, 7, 8, 9, 16, 17, 31, 32, 33, 40, 64, 65];
        // Columns: every count of live vectors in the first block of 64 and
        // in a second one (head dims 80, 96, 112).
        let cols = [1, 7, 16, 17, 32, 33, 40, 49, 64, 65, 80, 96, 112, 128];
        for &m in &sizes {
            for &n in &cols {
                for &k in &[0, 1, 5, 64, 129] {
                    for (t, acc) in [(false, false), (true, true), (false, true), (true, false)] {
                        check(m, n, k, t, acc, &mut rng);
                    }
                }
            }
        }
    }

    #[test]
    fn transpose_writes_every_element_and_nothing_else() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        let mut rng = Rng::new(0x6e46, 1);
        let sizes = [1, 3, 15, 16, 17, 31, 32, 33, 64, 70];
        for &rows in &sizes {
            for &cols in &sizes {
                let src = rng.normal_f32(rows * cols, 1.0);
                // Padded destination rows; the padding and a guard after the
                // last row must keep their poison.
                let dst_rs = rows + 5;
                let poison = -1234.5f32;
                let mut dst = vec![poison; cols * dst_rs + 7];
                // SAFETY: AVX-512F checked above; `dst` holds
                // `(cols − 1)·dst_rs + rows` elements and more.
                unsafe {
                    transpose::<F32s>(src.as_ptr(), (rows, cols, cols), dst.as_mut_ptr(), dst_rs)
                };
                for (i, &x) in dst.iter().enumerate() {
                    let (c, r) = (i / dst_rs, i % dst_rs);
                    let want = if c < cols && r < rows {
                        src[r * cols + c]
                    } else {
                        poison
                    };
                    assert_eq!(x.to_bits(), want.to_bits(), "{rows}×{cols} at ({c},{r})");
                }
            }
        }
    }

    #[test]
    fn same_bits_every_run() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut rng = Rng::new(0x6e45, 1);
        let (m, n, k) = (37, 45, 96);
        let a = rng.normal_f32(m * k, 1.0);
        let b = rng.normal_f32(k * n, 1.0);
        let run = || {
            let mut c = vec![0.0f32; m * n];
            // SAFETY: AVX-512F checked above; shapes match the buffers.
            unsafe {
                matmul(Operands {
                    m,
                    n,
                    k,
                    c: c.as_mut_ptr(),
                    ldc: n,
                    a: a.as_ptr(),
                    a_rs: k,
                    a_cs: 1,
                    b: b.as_ptr(),
                    ldb: n,
                    beta: 1.0,
                    accumulate: false,
                })
            };
            c
        };
        let first = run();
        assert!((0..4).all(|_| run() == first));
    }
}
