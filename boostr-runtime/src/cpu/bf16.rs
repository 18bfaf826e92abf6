//! bf16 tile products for the attention kernels: `dst (=|+=) beta · A · B`
//! with bf16 operands and f32 sums, on AVX512-BF16 (`vdpbf16ps`) where the
//! CPU has it and on a portable loop that computes the same sums elsewhere.
//!
//! bf16 values are raw `u16` bits (the upper half of an f32). Operands are
//! held in the *pair layout* that `vdpbf16ps` consumes: each `u32` holds two
//! bf16 that are adjacent along the reduction dimension `k`, the even `k` in
//! the low half. One instruction multiplies, in each of 16 f32 lanes, the two
//! pairs of its `u32` lanes and adds both products to the lane — 32 multiply-
//! adds, twice the work of an f32 FMA (see *Speed* for what that buys). `A` is an `m × kp` view of pairs with
//! any strides (its pairs are broadcast one at a time); `B` is `kp × n` pairs
//! with unit column stride (it is loaded 16 columns at a time). `kp = ⌈k/2⌉`;
//! an odd `k` is padded with a bf16 zero.
//!
//! The packers turn row-major tiles (bf16 bits, or f32 rounded on the way)
//! into that layout:
//!
//! | operand          | packer                      | packed shape      | view                   |
//! |------------------|-----------------------------|-------------------|------------------------|
//! | `A = X` (`m×k`)  | [`pack_a_pairs`]`(X)`       | `[m][kp]`         | [`PairRef::strided`]   |
//! | `A = Xᵀ` (`k×m`) | [`pack_row_pairs`]`(X)`     | `[kp][m]`         | `PairRef::strided(..).t()` |
//! | `B = X` (`k×n`)  | [`pack_row_pairs`]`(X)`     | `[kp][n]`         | `PairRef::strided`     |
//! | `B = Xᵀ` (`n×k`) | [`pack_col_pairs`]`(X)`     | `[kp][n]`         | `PairRef::strided`     |
//!
//! Rounding: f32 → bf16 is round-to-nearest-even; NaN stays NaN (made
//! quiet, sign kept); subnormals become a zero of the same sign. That is
//! exactly what `vcvtneps2bf16` does, so the vector and scalar conversions
//! give the same bits, and packed operands never hold bf16 subnormals.
//!
//! Paths: [`matmul_pairs`] runs the AVX512-BF16 microkernel when the CPU has
//! `avx512f` and `avx512bf16`, and the portable loop otherwise. The portable
//! loop evaluates each lane the way Intel specifies `vdpbf16ps`: the odd
//! product is added, then the even one (a product of two bf16 is exact in
//! f32, so fused and unfused adds agree), and the result is scaled and
//! stored with a separate multiply and add. On this basis the two paths give
//! the same bits (tested on Intel) as long as no input is a bf16 subnormal
//! and no product or partial sum falls below the f32 normal range, where the
//! instruction flushes to zero and the loop does not.
//!
//! Speed: on the development machine (a Sapphire-Rapids-class Xeon without
//! AMX) `vdpbf16ps` issues once every two cycles, with a latency of about 7,
//! against two f32 FMAs per cycle: its peak is *half* the f32 peak. The
//! microkernel runs at that peak (≈ 95–100 GFLOP/s on one core for 64-wide
//! tiles, `gemm::gemm` on f32 ≈ 180), so there the bf16 path halves the
//! bytes of the operands, not the time of the arithmetic. CPUs that issue it
//! at the FMA rate would see twice the f32 throughput.
//!
//! Guarantees: a [`PairRef`] can only be built over a slice that holds every
//! element it addresses, the packers check their slices, and
//! [`matmul_pairs`] checks shapes and the extent of `dst`, so the `unsafe`
//! microkernel reads and writes in bounds. With [`Write::Overwrite`] `dst` is
//! never read (it may hold NaN); only its `m × n` elements are written, never
//! the gaps between rows. Single-threaded and deterministic.

use super::gemm::Write;

/// A value the packers accept: bf16 bits (`u16`, kept as they are) or an
/// `f32` (rounded with [`bf16_from_f32`]).
pub trait Bf16Source: Copy {
    /// The bf16 bits of the value.
    fn bf16_bits(self) -> u16;
}

impl Bf16Source for u16 {
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        self
    }
}

impl Bf16Source for f32 {
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        bf16_from_f32(self)
    }
}

/// `x` rounded to bf16 (nearest, ties to even), as `vcvtneps2bf16` does it:
/// NaN stays NaN with its quiet bit set, subnormals flush to a signed zero,
/// values beyond the bf16 range round to infinity.
#[inline(always)]
pub fn bf16_from_f32(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return (bits >> 16) as u16 | 0x0040;
    }
    if bits & 0x7f80_0000 == 0 {
        return (bits >> 16) as u16 & 0x8000;
    }
    // Adding just under half an ulp of bf16 (plus one when the kept last bit
    // is odd) carries into the kept bits exactly when rounding goes up. No
    // overflow of u32: the largest non-NaN pattern is 0xff80_0000.
    let bias = 0x7fff + ((bits >> 16) & 1);
    ((bits + bias) >> 16) as u16
}

/// The f32 with the value of the bf16 `x` (exact).
#[inline(always)]
pub fn f32_from_bf16(x: u16) -> f32 {
    f32::from_bits(u32::from(x) << 16)
}

/// Round every element of `src` to bf16 with [`bf16_from_f32`].
///
/// Panics if the lengths differ.
pub fn f32_to_bf16(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_bf16 lengths differ");
    #[cfg(target_arch = "x86_64")]
    if native_available() {
        // SAFETY: `native_available` checked that the CPU has AVX-512F and
        // AVX512-BF16, the only requirement of `native::f32_to_bf16`.
        return unsafe { native::f32_to_bf16(src, dst) };
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16_from_f32(s);
    }
}

/// Widen every bf16 of `src` to f32 (exact).
///
/// Panics if the lengths differ.
pub fn bf16_to_f32(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "bf16_to_f32 lengths differ");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32_from_bf16(s);
    }
}

/// Two bf16 as one pair: `lo` at the even `k`, `hi` at the odd one.
#[inline(always)]
fn pair(lo: u16, hi: u16) -> u32 {
    u32::from(lo) | u32::from(hi) << 16
}

/// The bf16 of a pair at the even `k` and at the odd `k`, widened to f32.
#[inline(always)]
fn unpair(x: u32) -> (f32, f32) {
    (f32::from_bits(x << 16), f32::from_bits(x & 0xffff_0000))
}

/// Check that a `rows × cols` matrix with row stride `rs` fits in `len`.
#[track_caller]
fn check_extent(len: usize, rows: usize, cols: usize, rs: usize, what: &str) {
    assert!(
        cols <= rs || rows <= 1,
        "{what}: rows overlap (cols {cols} > row stride {rs})"
    );
    assert!(
        rows == 0 || cols == 0 || len >= (rows - 1) * rs + cols,
        "{what}: {rows} × {cols} with row stride {rs} does not fit in {len} elements"
    );
}

/// Pack pairs of rows: `dst[p][j] = (src[2p][j], src[2p+1][j])` for
/// `p < ⌈rows/2⌉`, `j < cols`, a missing last row read as zero.
///
/// `src` is `rows × cols` with row stride `src_rs`, `dst` has row stride
/// `dst_rs`. As `B`, the result is `src` (`k = rows`); through
/// [`PairRef::t`] as `A`, it is `srcᵀ`.
pub fn pack_row_pairs<T: Bf16Source>(
    src: &[T],
    rows: usize,
    cols: usize,
    src_rs: usize,
    dst: &mut [u32],
    dst_rs: usize,
) {
    let kp = rows.div_ceil(2);
    check_extent(src.len(), rows, cols, src_rs, "pack_row_pairs source");
    check_extent(dst.len(), kp, cols, dst_rs, "pack_row_pairs destination");
    for p in 0..kp {
        let out = &mut dst[p * dst_rs..][..cols];
        let even = &src[2 * p * src_rs..][..cols];
        if 2 * p + 1 < rows {
            let odd = &src[(2 * p + 1) * src_rs..][..cols];
            for ((o, &lo), &hi) in out.iter_mut().zip(even).zip(odd) {
                *o = pair(lo.bf16_bits(), hi.bf16_bits());
            }
        } else {
            for (o, &lo) in out.iter_mut().zip(even) {
                *o = pair(lo.bf16_bits(), 0);
            }
        }
    }
}

/// Pack pairs of columns, transposed: `dst[p][i] = (src[i][2p], src[i][2p+1])`
/// for `p < ⌈cols/2⌉`, `i < rows`, a missing last column read as zero.
///
/// `src` is `rows × cols` with row stride `src_rs`, `dst` has row stride
/// `dst_rs`. As `B`, the result is `srcᵀ` (`k = cols`), e.g. `Kᵀ` for
/// `S = Q Kᵀ`.
pub fn pack_col_pairs<T: Bf16Source>(
    src: &[T],
    rows: usize,
    cols: usize,
    src_rs: usize,
    dst: &mut [u32],
    dst_rs: usize,
) {
    let kp = cols.div_ceil(2);
    check_extent(src.len(), rows, cols, src_rs, "pack_col_pairs source");
    check_extent(dst.len(), kp, rows, dst_rs, "pack_col_pairs destination");
    for i in 0..rows {
        let row = &src[i * src_rs..][..cols];
        let (pairs, last) = row.as_chunks::<2>();
        for (p, &[lo, hi]) in pairs.iter().enumerate() {
            dst[p * dst_rs + i] = pair(lo.bf16_bits(), hi.bf16_bits());
        }
        if let [lo] = *last {
            dst[pairs.len() * dst_rs + i] = pair(lo.bf16_bits(), 0);
        }
    }
}

/// Pack pairs of columns in place of each row: `dst[i][p] = (src[i][2p],
/// src[i][2p+1])` for `i < rows`, `p < ⌈cols/2⌉`, a missing last column read
/// as zero.
///
/// `src` is `rows × cols` with row stride `src_rs`, `dst` has row stride
/// `dst_rs`. As `A`, the result is `src` (`k = cols`), e.g. `P` for `P V`.
pub fn pack_a_pairs<T: Bf16Source>(
    src: &[T],
    rows: usize,
    cols: usize,
    src_rs: usize,
    dst: &mut [u32],
    dst_rs: usize,
) {
    let kp = cols.div_ceil(2);
    check_extent(src.len(), rows, cols, src_rs, "pack_a_pairs source");
    check_extent(dst.len(), rows, kp, dst_rs, "pack_a_pairs destination");
    for i in 0..rows {
        let row = &src[i * src_rs..][..cols];
        let out = &mut dst[i * dst_rs..][..kp];
        let (pairs, last) = row.as_chunks::<2>();
        for (o, &[lo, hi]) in out.iter_mut().zip(pairs) {
            *o = pair(lo.bf16_bits(), hi.bf16_bits());
        }
        if let [lo] = *last {
            out[kp - 1] = pair(lo.bf16_bits(), 0);
        }
    }
}

/// A read-only `rows × cols` view of bf16 pairs: element `(i, p)` is
/// `data[i*rs + p*cs]`. The pair index runs along the reduction dimension
/// for `A` (`m × kp`) and down the rows for `B` (`kp × n`).
#[derive(Clone, Copy, Debug)]
pub struct PairRef<'a> {
    data: &'a [u32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> PairRef<'a> {
    /// The row-major `rows × cols` pairs at the start of `data`.
    #[inline]
    #[track_caller]
    pub fn row_major(data: &'a [u32], rows: usize, cols: usize) -> Self {
        Self::strided(data, rows, cols, cols)
    }

    /// The `rows × cols` pairs at the start of `data` whose rows lie `rs`
    /// elements apart (what the packers write for a `dst_rs`).
    #[inline]
    #[track_caller]
    pub fn strided(data: &'a [u32], rows: usize, cols: usize, rs: usize) -> Self {
        check_extent(data.len(), rows, cols, rs, "pair view");
        Self {
            data,
            rows,
            cols,
            rs,
            cs: 1,
        }
    }

    /// The transpose, as a view over the same elements.
    #[inline]
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Element `(i, p)`; in bounds by construction when `i < rows`, `p < cols`.
    #[inline(always)]
    fn at(&self, i: usize, p: usize) -> u32 {
        self.data[i * self.rs + p * self.cs]
    }
}

/// Whether this CPU runs [`matmul_pairs`] and [`f32_to_bf16`] on
/// AVX512-BF16. Where it does not, the portable loop is several times slower
/// than an f32 GEMM, so callers should prefer their f32 kernels.
pub fn has_native_bf16() -> bool {
    native_available()
}

#[inline]
fn native_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // The macro caches its answer: a load and a test.
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Which implementation runs a product; tests pick each in turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// The AVX512-BF16 microkernel (x86-64 with the features only).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Native,
    Portable,
}

/// `dst (=|+=) beta · a · b`: `dst[i*dst_rs + j]` for `i < a.rows`,
/// `j < b.cols`, summing `dot2(a[i][p], b[p][j])` over the pairs `p` in f32.
///
/// Panics if `a.cols != b.rows`, if `b` is not unit-stride along its columns
/// (a transposed view), or if `dst` cannot hold the `m × n` output with row
/// stride `dst_rs`. With [`Write::Overwrite`] `dst` is never read.
#[track_caller]
pub fn matmul_pairs(
    dst: &mut [f32],
    dst_rs: usize,
    write: Write,
    a: PairRef<'_>,
    b: PairRef<'_>,
    beta: f32,
) {
    let path = if native_available() {
        Path::Native
    } else {
        Path::Portable
    };
    matmul_on(path, Product::new(dst, dst_rs, write, a, b, beta));
}

/// The arguments of [`matmul_pairs`], checked: `a` is `m × kp`, `b` is
/// `kp × n` with `cs == 1`, `dst` holds `m` rows of `n` at stride `dst_rs`.
/// Only [`Product::new`] builds one, so the kernels may rely on this.
struct Product<'a> {
    dst: &'a mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: PairRef<'a>,
    b: PairRef<'a>,
    beta: f32,
}

impl<'a> Product<'a> {
    #[track_caller]
    fn new(
        dst: &'a mut [f32],
        dst_rs: usize,
        write: Write,
        a: PairRef<'a>,
        b: PairRef<'a>,
        beta: f32,
    ) -> Self {
        assert_eq!(
            a.cols, b.rows,
            "inner dimensions differ: a is {} × {} pairs, b is {} × {}",
            a.rows, a.cols, b.rows, b.cols
        );
        assert!(
            b.cs == 1 || b.cols <= 1,
            "b must have unit column stride (got {}): pack it instead of transposing the view",
            b.cs
        );
        check_extent(
            dst.len(),
            a.rows,
            b.cols,
            dst_rs,
            "matmul_pairs destination",
        );
        Self {
            dst,
            dst_rs,
            accumulate: write == Write::Accumulate,
            a,
            b,
            beta,
        }
    }
}

fn matmul_on(path: Path, p: Product<'_>) {
    if p.a.rows == 0 || p.b.cols == 0 {
        return;
    }
    match path {
        #[cfg(target_arch = "x86_64")]
        Path::Native => {
            assert!(native_available(), "no AVX512-BF16 on this CPU");
            // SAFETY: the CPU has AVX-512F and AVX512-BF16 (just checked),
            // the only requirement of `native::matmul` beyond what
            // `Product` guarantees.
            unsafe { native::matmul(p) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Path::Native => unreachable!("no AVX512-BF16 off x86-64"),
        Path::Portable => super::simd::dispatch(Portable(p)),
    }
}

/// The portable path, compiled by `simd::dispatch` at the widest vector
/// width the CPU has.
struct Portable<'a>(Product<'a>);

impl super::simd::Elementwise for Portable<'_> {
    #[inline(always)]
    fn run(self) {
        // Columns in chunks that fit an accumulator row on the stack.
        const CHUNK: usize = 256;
        let Product {
            dst,
            dst_rs,
            accumulate,
            a,
            b,
            beta,
        } = self.0;
        let (m, n, kp) = (a.rows, b.cols, a.cols);
        let mut acc = [0.0f32; CHUNK];
        for j0 in (0..n).step_by(CHUNK) {
            let nc = CHUNK.min(n - j0);
            let acc = &mut acc[..nc];
            for i in 0..m {
                acc.fill(0.0);
                for p in 0..kp {
                    let (a_even, a_odd) = unpair(a.at(i, p));
                    let row = &b.data[p * b.rs + j0..][..nc];
                    // The order of `vdpbf16ps`: odd product first. Each
                    // product of two bf16 is exact, so no FMA is needed to
                    // match it.
                    for (c, &y) in acc.iter_mut().zip(row) {
                        let (b_even, b_odd) = unpair(y);
                        *c += a_odd * b_odd;
                        *c += a_even * b_even;
                    }
                }
                let out = &mut dst[i * dst_rs + j0..][..nc];
                if accumulate {
                    for (o, &c) in out.iter_mut().zip(acc.iter()) {
                        *o += beta * c;
                    }
                } else {
                    for (o, &c) in out.iter_mut().zip(acc.iter()) {
                        *o = beta * c;
                    }
                }
            }
        }
    }
}

/// The AVX512-BF16 path.
///
/// Register blocking: a block of `MR` rows × `16·NV` columns of `dst` lives
/// in `MR·NV` zmm accumulators for the whole reduction. Per pair `p` it
/// loads `NV` vectors of `B`'s row `p` (contiguous) and, per row, broadcasts
/// one pair of `A` (folded into `vdpbf16ps` as an embedded broadcast) and
/// issues `NV` dot products: `NV + MR` loads per `MR·NV` instructions. 6 × 4
/// uses 24 of the 32 zmm registers, leaves 4 for `B`, and gives 24
/// independent chains: far more than the ~4 that latency × throughput asks
/// for on Sapphire Rapids (7 cycles, one every 2), so CPUs that issue it
/// faster are covered too. `NV = 4` (64 columns) matches the common 64-wide
/// tiles.
/// Column tails use masked loads and stores, row tails blocks of 4, 2, 1.
#[cfg(target_arch = "x86_64")]
mod native {
    use super::Product;
    use std::arch::x86_64::*;

    /// Rows per block.
    const MR: usize = 6;
    /// 16-column vectors per block.
    const NV: usize = 4;
    const _: () = assert!(MR < 8, "row tails are split into blocks of 4, 2, 1");

    /// Round `src` to bf16 into `dst`, 16 lanes at a time.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and AVX512-BF16. (`src` and `dst` have
    /// equal lengths, checked by the caller.)
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn f32_to_bf16(src: &[f32], dst: &mut [u16]) {
        let (chunks, tail) = src.as_chunks::<16>();
        let (out, out_tail) = dst.as_chunks_mut::<16>();
        for (o, s) in out.iter_mut().zip(chunks) {
            // SAFETY: `s` is 16 readable f32 and `o` 16 writable u16 (32
            // bytes); both accesses are unaligned-tolerant.
            unsafe {
                let x = _mm512_loadu_ps(s.as_ptr());
                let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(x));
                _mm256_storeu_si256(o.as_mut_ptr().cast(), h);
            }
        }
        for (o, &s) in out_tail.iter_mut().zip(tail) {
            *o = super::bf16_from_f32(s);
        }
    }

    /// The raw operands of one product, as the microkernel addresses them.
    struct Operands {
        kp: usize,
        a: *const u32,
        a_rs: usize,
        a_cs: usize,
        b: *const u32,
        b_rs: usize,
        dst: *mut f32,
        dst_rs: usize,
        accumulate: bool,
    }

    /// `p.dst (=|+=) p.beta · p.a · p.b` for `m, n ≥ 1`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and AVX512-BF16. (The shapes and
    /// extents were checked when `p` was built.)
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn matmul(p: Product<'_>) {
        let (m, n) = (p.a.rows, p.b.cols);
        let ops = Operands {
            kp: p.a.cols,
            a: p.a.data.as_ptr(),
            a_rs: p.a.rs,
            a_cs: p.a.cs,
            b: p.b.data.as_ptr(),
            b_rs: p.b.rs,
            dst: p.dst.as_mut_ptr(),
            dst_rs: p.dst_rs,
            accumulate: p.accumulate,
        };
        let beta = _mm512_set1_ps(p.beta);
        for j0 in (0..n).step_by(16 * NV) {
            let cols = (n - j0).min(16 * NV);
            // SAFETY (all arms): `Product` guarantees that `a` holds `m × kp`
            // pairs at its strides, `b` `kp × n` at unit column stride and
            // `dst` `m × n` at `dst_rs`; `j0 + cols ≤ n`, and `rows` only
            // visits blocks inside `0..m`.
            unsafe {
                match cols.div_ceil(16) {
                    1 => rows::<1>(&ops, m, j0, cols, beta),
                    2 => rows::<2>(&ops, m, j0, cols, beta),
                    3 => rows::<3>(&ops, m, j0, cols, beta),
                    _ => rows::<NV>(&ops, m, j0, cols, beta),
                }
            }
        }
    }

    /// Every row block of the column block `j0 .. j0 + cols` (`cols ≤ 16·V`,
    /// and more than `16·(V-1)`).
    ///
    /// # Safety
    /// The CPU has the features; `ops` describes in-bounds operands for `m`
    /// rows and columns `j0 .. j0 + cols`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[inline]
    unsafe fn rows<const V: usize>(ops: &Operands, m: usize, j0: usize, cols: usize, beta: __m512) {
        let mut masks = [0 as __mmask16; V];
        for (v, mask) in masks.iter_mut().enumerate() {
            let live = cols.saturating_sub(16 * v).min(16);
            *mask = ((1u32 << live) - 1) as __mmask16;
        }
        let mut i0 = 0;
        // SAFETY (all calls): each block covers rows `i0 .. i0 + R ≤ m` and
        // the columns of `masks`, inside what `ops` may address.
        unsafe {
            while i0 + MR <= m {
                block::<MR, V>(ops, i0, j0, masks, beta);
                i0 += MR;
            }
            let rest = m - i0;
            if rest & 4 != 0 {
                block::<4, V>(ops, i0, j0, masks, beta);
                i0 += 4;
            }
            if rest & 2 != 0 {
                block::<2, V>(ops, i0, j0, masks, beta);
                i0 += 2;
            }
            if rest & 1 != 0 {
                block::<1, V>(ops, i0, j0, masks, beta);
            }
        }
    }

    /// The `R × 16·V` block of `dst` at `(i0, j0)`; lanes outside `masks`
    /// are neither loaded from `b` nor stored to `dst`.
    ///
    /// # Safety
    /// The CPU has the features; rows `i0 .. i0 + R` of `a` (all `kp` pairs)
    /// and of `dst`, and the masked columns from `j0` of `b` (all `kp` rows)
    /// and of `dst`, are in bounds of the slices `ops` points into.
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[inline]
    unsafe fn block<const R: usize, const V: usize>(
        ops: &Operands,
        i0: usize,
        j0: usize,
        masks: [__mmask16; V],
        beta: __m512,
    ) {
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        // Pointers advance with `wrapping_add`: after the last pair they may
        // point past the slice, where they are never dereferenced.
        let mut a = ops.a.wrapping_add(i0 * ops.a_rs);
        let mut b = ops.b.wrapping_add(j0);
        for _ in 0..ops.kp {
            let mut bv = [_mm512_setzero_si512(); V];
            for ((x, &mask), v) in bv.iter_mut().zip(&masks).zip(0..) {
                // SAFETY: columns `j0 + 16v ..` of this row of `b` under
                // `mask` are in bounds; masked-off lanes are not accessed.
                *x = unsafe { _mm512_maskz_loadu_epi32(mask, b.add(16 * v).cast()) };
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row `i0 + r < m` of `a` at the current pair.
                let pair = unsafe { *a.add(r * ops.a_rs) };
                let pair = bh(_mm512_set1_epi32(pair as i32));
                for (c, &x) in acc.iter_mut().zip(&bv) {
                    *c = _mm512_dpbf16_ps(*c, pair, bh(x));
                }
            }
            a = a.wrapping_add(ops.a_cs);
            b = b.wrapping_add(ops.b_rs);
        }
        for (r, acc) in acc.iter().enumerate() {
            // The separate multiply and add (no FMA) match the portable path.
            for ((&c, &mask), v) in acc.iter().zip(&masks).zip(0..) {
                // SAFETY: row `i0 + r`, columns `j0 + 16v ..` under `mask`
                // of `dst` are in bounds; masked-off lanes are not accessed.
                unsafe {
                    let out = ops.dst.add((i0 + r) * ops.dst_rs + j0 + 16 * v);
                    let mut y = _mm512_mul_ps(beta, c);
                    if ops.accumulate {
                        y = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out), y);
                    }
                    _mm512_mask_storeu_ps(out, mask, y);
                }
            }
        }
    }

    /// 32 bf16 as the operand type of `vdpbf16ps`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn bh(x: __m512i) -> __m512bh {
        // SAFETY: both are 64-byte vectors of plain bits; every pattern is
        // valid for either.
        unsafe { std::mem::transmute(x) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The paths this CPU can run.
    fn paths() -> Vec<Path> {
        let mut paths = vec![Path::Portable];
        if native_available() {
            paths.push(Path::Native);
        }
        paths
    }

    /// `len` random bf16 in about `±4`, with varied exponents and signs.
    fn random_bf16(rng: &mut StdRng, len: usize) -> Vec<u16> {
        (0..len)
            .map(|_| {
                let x: f32 = rng.random_range(-1.0..1.0);
                bf16_from_f32(x * (rng.random_range(-6..=2) as f32).exp2())
            })
            .collect()
    }

    /// The transpose of the row-major `rows × cols` matrix `x`.
    fn transposed<T: Copy>(x: &[T], rows: usize, cols: usize) -> Vec<T> {
        (0..cols * rows)
            .map(|t| x[(t % rows) * cols + t / rows])
            .collect()
    }

    /// The f64 product of the row-major bf16 matrices `a` (`m × k`) and `b`
    /// (`k × n`), and `Σ|a||b|` per element for the error bound.
    fn reference(a: &[u16], b: &[u16], m: usize, n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
        let (mut want, mut bound) = (vec![0.0; m * n], vec![0.0; m * n]);
        for i in 0..m {
            for l in 0..k {
                let x = f64::from(f32_from_bf16(a[i * k + l]));
                for j in 0..n {
                    let y = f64::from(f32_from_bf16(b[l * n + j]));
                    want[i * n + j] += x * y;
                    bound[i * n + j] += (x * y).abs();
                }
            }
        }
        (want, bound)
    }

    /// One product through `path` on the `m × n × k` problem `a · b`, for
    /// each of the four operand layouts and both write modes, into a
    /// NaN-poisoned `dst` with gaps between its rows.
    fn check_product(path: Path, rng: &mut StdRng, m: usize, n: usize, k: usize) {
        let kp = k.div_ceil(2);
        let a = random_bf16(rng, m * k);
        let b = random_bf16(rng, k * n);
        let (want, bound) = reference(&a, &b, m, n, k);

        // A = a from rows of pairs, and A = (aᵀ)ᵀ from pairs of rows of aᵀ.
        let (a_rs, at_rs) = (kp + 1, m + 2);
        let mut a_pairs = vec![u32::MAX; m * a_rs];
        pack_a_pairs(&a, m, k, k, &mut a_pairs, a_rs);
        let mut at_pairs = vec![u32::MAX; kp * at_rs];
        pack_row_pairs(&transposed(&a, m, k), k, m, m, &mut at_pairs, at_rs);
        // B = b from pairs of rows, and B = (bᵀ)ᵀ from pairs of columns of bᵀ.
        let (b_rs, bt_rs) = (n + 1, n + 5);
        let mut b_pairs = vec![u32::MAX; kp * b_rs];
        pack_row_pairs(&b, k, n, n, &mut b_pairs, b_rs);
        let mut bt_pairs = vec![u32::MAX; kp * bt_rs];
        pack_col_pairs(&transposed(&b, k, n), n, k, k, &mut bt_pairs, bt_rs);

        let lhs = [
            PairRef::strided(&a_pairs, m, kp, a_rs),
            PairRef::strided(&at_pairs, kp, m, at_rs).t(),
        ];
        let rhs = [
            PairRef::strided(&b_pairs, kp, n, b_rs),
            PairRef::strided(&bt_pairs, kp, n, bt_rs),
        ];
        let dst_rs = n + 3;
        let tol = |bound: f64| (k as f64 + 4.0) * f64::from(f32::EPSILON) * bound;
        for (&lhs, &rhs) in lhs.iter().flat_map(|l| rhs.iter().map(move |r| (l, r))) {
            let mut dst = vec![f32::NAN; m * dst_rs];
            matmul_on(
                path,
                Product::new(&mut dst, dst_rs, Write::Overwrite, lhs, rhs, 0.5),
            );
            for (t, &got) in dst.iter().enumerate() {
                let (i, j) = (t / dst_rs, t % dst_rs);
                if j >= n {
                    assert!(got.is_nan(), "{path:?} {m}×{n}×{k}: gap ({i}, {j}) written");
                    continue;
                }
                let want = 0.5 * want[i * n + j];
                let err = (f64::from(got) - want).abs();
                assert!(
                    err <= tol(0.5 * bound[i * n + j]),
                    "{path:?} {m}×{n}×{k} overwrite ({i}, {j}): {got} vs {want}"
                );
            }

            let old: Vec<f32> = (0..m * dst_rs)
                .map(|_| rng.random_range(-4.0..4.0))
                .collect();
            let mut dst = old.clone();
            matmul_on(
                path,
                Product::new(&mut dst, dst_rs, Write::Accumulate, lhs, rhs, -1.5),
            );
            for (t, (&got, &old)) in dst.iter().zip(&old).enumerate() {
                let (i, j) = (t / dst_rs, t % dst_rs);
                if j >= n {
                    assert_eq!(got.to_bits(), old.to_bits(), "gap ({i}, {j}) written");
                    continue;
                }
                let want = f64::from(old) - 1.5 * want[i * n + j];
                let err = (f64::from(got) - want).abs();
                assert!(
                    err <= tol(1.5 * bound[i * n + j] + f64::from(old.abs())),
                    "{path:?} {m}×{n}×{k} accumulate ({i}, {j}): {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn products_match_f64_on_odd_shapes() {
        const SIZES: [usize; 9] = [1, 7, 16, 17, 33, 64, 65, 127, 128];
        let mut rng = StdRng::seed_from_u64(0xbf16);
        for path in paths() {
            for m in SIZES {
                for n in SIZES {
                    for k in SIZES {
                        check_product(path, &mut rng, m, n, k);
                    }
                }
            }
        }
    }

    #[test]
    fn large_tiles_and_wide_columns() {
        // Up to the largest tiles, and past the portable path's column chunk.
        let mut rng = StdRng::seed_from_u64(7);
        for path in paths() {
            for (m, n, k) in [(256, 256, 256), (3, 300, 5), (200, 257, 255)] {
                check_product(path, &mut rng, m, n, k);
            }
        }
    }

    #[test]
    fn empty_reduction() {
        let b: [u32; 0] = [];
        for path in paths() {
            let mut dst = [f32::NAN; 6];
            let (a, b) = (PairRef::row_major(&b, 2, 0), PairRef::row_major(&b, 0, 3));
            matmul_on(path, Product::new(&mut dst, 3, Write::Overwrite, a, b, 2.0));
            assert_eq!(dst, [0.0; 6]);
            let mut dst = [1.5; 6];
            matmul_on(
                path,
                Product::new(&mut dst, 3, Write::Accumulate, a, b, 2.0),
            );
            assert_eq!(dst, [1.5; 6]);
        }
    }

    /// Whether the CPU is Intel's, whose `vdpbf16ps` follows Intel's
    /// pseudo-code (other implementations may round the two products
    /// together).
    #[cfg(target_arch = "x86_64")]
    fn genuine_intel() -> bool {
        let r = std::arch::x86_64::__cpuid(0);
        [r.ebx, r.edx, r.ecx]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .eq(*b"GenuineIntel")
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn native_and_portable_agree_bit_for_bit() {
        if !native_available() || !genuine_intel() {
            return;
        }
        let mut rng = StdRng::seed_from_u64(42);
        for (m, n, kp) in [(64, 64, 32), (65, 33, 64), (7, 129, 9)] {
            let a: Vec<u32> = (0..m * kp)
                .map(|_| pair(random_bf16(&mut rng, 1)[0], random_bf16(&mut rng, 1)[0]))
                .collect();
            let b: Vec<u32> = (0..kp * n)
                .map(|_| pair(random_bf16(&mut rng, 1)[0], random_bf16(&mut rng, 1)[0]))
                .collect();
            let (a, b) = (PairRef::row_major(&a, m, kp), PairRef::row_major(&b, kp, n));
            let old: Vec<f32> = (0..m * n).map(|_| rng.random_range(-1.0..1.0)).collect();
            for write in [Write::Overwrite, Write::Accumulate] {
                let (mut x, mut y) = (old.clone(), old.clone());
                matmul_on(Path::Native, Product::new(&mut x, n, write, a, b, 0.3));
                matmul_on(Path::Portable, Product::new(&mut y, n, write, a, b, 0.3));
                assert!(x.iter().zip(&y).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
        }
    }

    /// Round-to-nearest-even from the definition: the nearer of the two
    /// neighbouring bf16 (infinity counting as 2^128), the even one on a tie.
    fn reference_round(x: f32) -> u16 {
        let bits = x.to_bits();
        let sign = (bits >> 16) as u16 & 0x8000;
        if x.is_nan() {
            return (bits >> 16) as u16 | 0x0040;
        }
        if x.is_infinite() || x == 0.0 {
            return (bits >> 16) as u16;
        }
        if x.abs() < f32::MIN_POSITIVE {
            return sign;
        }
        let value = |h: u16| {
            if h & 0x7fff == 0x7f80 {
                if sign == 0 {
                    2f64.powi(128)
                } else {
                    -2f64.powi(128)
                }
            } else {
                f64::from(f32_from_bf16(h))
            }
        };
        let down = (bits >> 16) as u16;
        let up = down + 1;
        let (d, u) = (
            (f64::from(x) - value(down)).abs(),
            (f64::from(x) - value(up)).abs(),
        );
        if d < u || (d == u && down & 1 == 0) {
            down
        } else {
            up
        }
    }

    #[test]
    fn rounding_to_bf16() {
        let mut xs: Vec<u32> = vec![
            0x0000_0000,
            0x8000_0000,
            0x3f80_0000,
            0xbf80_0000, // ±0, ±1
            0x7f80_0000,
            0xff80_0000, // ±inf
            0x7fc0_0000,
            0xffc0_0001,
            0x7f80_0001,
            0x7fbf_ffff,
            0xff80_0100, // NaNs
            0x0000_0001,
            0x8000_0001,
            0x007f_ffff,
            0x807f_ffff,
            0x0040_0000, // subnormals
            0x0080_0000,
            0x8080_0000,
            0x0080_8000,
            0x0081_8000, // smallest normals
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x3f80_7fff,
            0xbf81_8000, // ties
            0x7f7f_ffff,
            0x7f7f_8000,
            0x7f7e_8000,
            0x7f7f_7fff,
            0xff7f_ffff, // near MAX
        ];
        // A sweep of the whole bit space, and the neighbourhood of ties.
        xs.extend((0..u32::MAX / 65521).map(|i| i * 65521));
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..20_000 {
            let hi = rng.random::<u32>() & 0xffff_0000;
            xs.extend([
                hi | 0x7fff,
                hi | 0x8000,
                hi | 0x8001,
                hi | rng.random::<u16>() as u32,
            ]);
        }
        let fs: Vec<f32> = xs.iter().map(|&x| f32::from_bits(x)).collect();
        for &x in &fs {
            let (got, want) = (bf16_from_f32(x), reference_round(x));
            assert_eq!(
                got,
                want,
                "{:#010x}: {got:#06x} vs {want:#06x}",
                x.to_bits()
            );
            if x.is_nan() {
                assert!(f32_from_bf16(got).is_nan());
            }
        }
        // The bulk conversion (vectorised where the CPU allows) gives the
        // same bits, on every length of tail.
        for len in [fs.len(), fs.len() - 1, 15, 17, 1, 0] {
            let mut got = vec![0u16; len];
            f32_to_bf16(&fs[..len], &mut got);
            for (i, (&g, &x)) in got.iter().zip(&fs).enumerate() {
                assert_eq!(g, bf16_from_f32(x), "element {i}: {:#010x}", x.to_bits());
            }
        }
        // Widening is exact: every non-NaN bf16 survives the round trip.
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let mut wide = vec![0.0; all.len()];
        bf16_to_f32(&all, &mut wide);
        for (&h, &w) in all.iter().zip(&wide) {
            assert_eq!(w.to_bits(), u32::from(h) << 16);
            let subnormal = h & 0x7f80 == 0 && h & 0x7f != 0;
            if !w.is_nan() && !subnormal {
                assert_eq!(bf16_from_f32(w), h);
            }
        }
    }

    #[test]
    fn packers_follow_their_definitions() {
        let mut rng = StdRng::seed_from_u64(11);
        const GAP: u32 = 0xdead_beef;
        for (rows, cols) in [(1, 1), (2, 3), (7, 16), (17, 33), (64, 65)] {
            let src_rs = cols + 2;
            let f: Vec<f32> = (0..rows * src_rs)
                .map(|_| rng.random_range(-3.0..3.0))
                .collect();
            let h: Vec<u16> = f.iter().map(|&x| bf16_from_f32(x)).collect();
            let at = |i: usize, j: usize| {
                if i < rows && j < cols {
                    h[i * src_rs + j]
                } else {
                    0
                }
            };

            let (kp, rs) = (rows.div_ceil(2), cols + 1);
            let (mut x, mut y) = (vec![GAP; kp * rs], vec![GAP; kp * rs]);
            pack_row_pairs(&h, rows, cols, src_rs, &mut x, rs);
            pack_row_pairs(&f, rows, cols, src_rs, &mut y, rs);
            assert_eq!(x, y);
            for (t, &got) in x.iter().enumerate() {
                let (p, j) = (t / rs, t % rs);
                let want = if j < cols {
                    pair(at(2 * p, j), at(2 * p + 1, j))
                } else {
                    GAP
                };
                assert_eq!(got, want, "pack_row_pairs {rows}×{cols} ({p}, {j})");
            }

            let (kp, rs) = (cols.div_ceil(2), rows + 3);
            let (mut x, mut y) = (vec![GAP; kp * rs], vec![GAP; kp * rs]);
            pack_col_pairs(&h, rows, cols, src_rs, &mut x, rs);
            pack_col_pairs(&f, rows, cols, src_rs, &mut y, rs);
            assert_eq!(x, y);
            for (t, &got) in x.iter().enumerate() {
                let (p, i) = (t / rs, t % rs);
                let want = if i < rows {
                    pair(at(i, 2 * p), at(i, 2 * p + 1))
                } else {
                    GAP
                };
                assert_eq!(got, want, "pack_col_pairs {rows}×{cols} ({p}, {i})");
            }

            let rs = kp + 1;
            let (mut x, mut y) = (vec![GAP; rows * rs], vec![GAP; rows * rs]);
            pack_a_pairs(&h, rows, cols, src_rs, &mut x, rs);
            pack_a_pairs(&f, rows, cols, src_rs, &mut y, rs);
            assert_eq!(x, y);
            for (t, &got) in x.iter().enumerate() {
                let (i, p) = (t / rs, t % rs);
                let want = if p < kp {
                    pair(at(i, 2 * p), at(i, 2 * p + 1))
                } else {
                    GAP
                };
                assert_eq!(got, want, "pack_a_pairs {rows}×{cols} ({i}, {p})");
            }
        }
    }

    #[test]
    #[should_panic(expected = "inner dimensions differ")]
    fn inner_dimension_mismatch_panics() {
        let x = [0u32; 12];
        let mut dst = [0.0f32; 9];
        let v = PairRef::row_major(&x, 3, 4);
        matmul_pairs(&mut dst, 3, Write::Overwrite, v, v, 1.0);
    }

    #[test]
    #[should_panic(expected = "unit column stride")]
    fn transposed_b_panics() {
        let x = [0u32; 9];
        let mut dst = [0.0f32; 9];
        let v = PairRef::row_major(&x, 3, 3);
        matmul_pairs(&mut dst, 3, Write::Overwrite, v, v.t(), 1.0);
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn short_dst_panics() {
        let x = [0u32; 9];
        let mut dst = [0.0f32; 8];
        let v = PairRef::row_major(&x, 3, 3);
        matmul_pairs(&mut dst, 3, Write::Overwrite, v, v, 1.0);
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn view_out_of_bounds_panics() {
        let x = [0u32; 9];
        PairRef::strided(&x, 3, 3, 4);
    }
}
