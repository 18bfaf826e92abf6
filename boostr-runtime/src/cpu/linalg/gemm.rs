//! Safe, bounds-checked matrix views over f32 slices, and the one GEMM entry
//! point the kernels use: our AVX-512 tile kernel (`microkernel`) when the
//! CPU has AVX-512 and the right-hand side has contiguous rows, otherwise
//! the `gemm` crate's f32 kernels, single-threaded.
//!
//! Every tile product of the attention kernels is `dst (=|+=) beta · lhs · rhs`
//! on row-major tiles, some of them transposed. A transpose is a view (swap
//! the strides), never a copy: `gemm` takes arbitrary row/column strides and
//! packs its operands itself.
//!
//! Guarantees: a [`MatRef`]/[`MatMut`] can only be built over a slice that
//! holds every element it addresses (checked on construction), and
//! [`matmul`] checks that the shapes agree, so the `unsafe` call into `gemm`
//! reads and writes in bounds. `dst` is a `&mut` borrow, so it cannot alias an
//! operand. Threading is left to the caller (tile-level rayon tasks):
//! `gemm` runs with `Parallelism::None`, and is deterministic for fixed
//! inputs and shapes.

use std::mem::MaybeUninit;

/// A read-only `rows × cols` view: element `(i, j)` is `data[i*rs + j*cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> MatRef<'a> {
    /// The row-major `rows × cols` matrix at the start of `data`.
    #[inline]
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        assert!(data.len() >= rows * cols, "matrix view out of bounds");
        Self {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The `rows × cols` matrix at the start of `data` whose rows lie `rs`
    /// elements apart (a column block of a wider row-major matrix).
    #[inline]
    pub fn strided(data: &'a [f32], rows: usize, cols: usize, rs: usize) -> Self {
        check_strided(data.len(), rows, cols, rs);
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
}

/// Panics unless `rows` rows of `cols` elements, `rs` apart, neither
/// overlap nor reach past `len` elements.
#[inline]
fn check_strided(len: usize, rows: usize, cols: usize, rs: usize) {
    assert!(cols <= rs || rows <= 1, "rows overlap");
    assert!(
        rows == 0 || len >= (rows - 1) * rs + cols,
        "matrix view out of bounds"
    );
}

/// A writable row-major `rows × cols` view at the start of a slice, rows
/// `rs` elements apart.
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    rs: usize,
}

impl<'a> MatMut<'a> {
    /// The row-major `rows × cols` matrix at the start of `data`.
    #[inline]
    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        assert!(data.len() >= rows * cols, "matrix view out of bounds");
        Self {
            data,
            rows,
            cols,
            rs: cols,
        }
    }

    /// The `rows × cols` matrix at the start of `data` whose rows lie `rs`
    /// elements apart (a column block of a wider row-major matrix).
    #[inline]
    pub fn strided(data: &'a mut [f32], rows: usize, cols: usize, rs: usize) -> Self {
        check_strided(data.len(), rows, cols, rs);
        Self {
            data,
            rows,
            cols,
            rs,
        }
    }
}

/// Whether [`matmul`] replaces `dst` or adds to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// `dst = beta · lhs · rhs`; the old contents of `dst` are never read
    /// (they may be NaN).
    Overwrite,
    /// `dst += beta · lhs · rhs`.
    Accumulate,
}

/// `dst (=|+=) beta · lhs · rhs`, single-threaded: the AVX-512 tile kernel
/// where it applies, else the `gemm` crate's f32 kernels.
///
/// Panics if the shapes disagree.
#[inline]
pub fn matmul(mut dst: MatMut<'_>, write: Write, lhs: MatRef<'_>, rhs: MatRef<'_>, beta: f32) {
    assert_eq!(lhs.cols, rhs.rows, "inner dimensions differ");
    assert_eq!((dst.rows, dst.cols), (lhs.rows, rhs.cols), "output shape");
    if dst.rows == 0 || dst.cols == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd::avx512() && tile_kernel(&mut dst, write, lhs, rhs, beta) {
        return;
    }
    crate_gemm(&mut dst, write, lhs, rhs, beta);
}

/// [`matmul`] on the AVX-512 tile kernel (`microkernel`); does nothing and
/// returns `false` when the CPU lacks AVX-512F or `rhs` has non-contiguous
/// rows. Shapes already checked by the caller.
#[cfg(target_arch = "x86_64")]
#[inline]
fn tile_kernel(
    dst: &mut MatMut<'_>,
    write: Write,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    beta: f32,
) -> bool {
    if rhs.cs != 1 || !std::arch::is_x86_feature_detected!("avx512f") {
        return false;
    }
    let o = crate::cpu::microkernel::Operands {
        m: dst.rows,
        n: dst.cols,
        k: lhs.cols,
        c: dst.data.as_mut_ptr(),
        ldc: dst.rs,
        a: lhs.data.as_ptr(),
        a_rs: lhs.rs,
        a_cs: lhs.cs,
        b: rhs.data.as_ptr(),
        ldb: rhs.rs,
        beta,
        accumulate: write == Write::Accumulate,
    };
    // SAFETY: AVX-512F was just detected. The views' constructors checked
    // that every `(i, j)` inside their shape lies in their slice for their
    // strides (`t()` only swaps them), and the caller checked that the shapes
    // agree, so every `C[i][j]`, `A[i][p]`, `B[p][j]` the kernel forms is in
    // bounds; `dst` is a unique borrow, so it overlaps no operand.
    unsafe { crate::cpu::microkernel::matmul(o) };
    true
}

/// [`matmul`] on the `gemm` crate's f32 kernels. Shapes already checked by
/// the caller.
fn crate_gemm(dst: &mut MatMut<'_>, write: Write, lhs: MatRef<'_>, rhs: MatRef<'_>, beta: f32) {
    let (m, n, k) = (dst.rows, dst.cols, lhs.cols);
    let s = |x: usize| x as isize;
    // As `gemm::gemm` does for f32: the kernels want a column-major
    // destination, so a row-major product is computed transposed, `Cᵀ =
    // Bᵀ Aᵀ` (every stride here is non-negative).
    let (dst_rs, dst_ptr) = (s(dst.rs), dst.data.as_mut_ptr());
    let transposed = 1 < dst_rs;
    let (m, n, lhs, rhs) = if transposed {
        (n, m, rhs.t(), lhs.t())
    } else {
        (m, n, lhs, rhs)
    };
    let (dst_cs, dst_rs) = if transposed { (dst_rs, 1) } else { (1, dst_rs) };
    // SAFETY: the constructors of `MatRef`/`MatMut` checked that every
    // `(i, j)` with `i < rows`, `j < cols` lies inside the viewed slice for
    // their strides, and `t()` only permutes (rows, rs) with (cols, cs), so
    // the extent `(rows-1)*rs + (cols-1)*cs` is unchanged; the transposed
    // call reads the same elements. The caller checked the shapes, so the
    // kernel accesses `dst` at `m × n`, `lhs` at `m × k`, `rhs` at `k × n`
    // (after the swap), all in bounds. `dst` is borrowed mutably, so it
    // does not overlap `lhs` or `rhs` (shared borrows). With `read_dst =
    // false` the kernel sets alpha to zero and never reads `dst`.
    unsafe {
        gemm_f32::gemm::f32::get_gemm_fn()(
            m,
            n,
            k,
            dst_ptr,
            dst_cs,
            dst_rs,
            write == Write::Accumulate,
            lhs.data.as_ptr(),
            s(lhs.cs),
            s(lhs.rs),
            rhs.data.as_ptr(),
            s(rhs.cs),
            s(rhs.rs),
            1.0,
            beta,
            false,
            false,
            false,
            gemm_common::Parallelism::None,
        );
    }
}

/// Seconds for `iters` rounds of [`time_fma_peak`]'s loop on every rayon
/// thread at once, the slowest thread's own time (`threads · iters · 24 ·
/// 32` flops at the FMA peak of all threads, under the clock they run at
/// together; a thread's wake-up is not counted); `None` without AVX-512F.
/// For the examples' peak shares; not part of the API.
#[doc(hidden)]
pub fn time_fma_peak_all(iters: usize) -> Option<f64> {
    let done = rayon::broadcast(|_| time_fma_peak(iters));
    done.into_iter()
        .try_fold(0.0, |slowest, t| t.map(|t| f64::max(slowest, t)))
}

/// Seconds for `iters` rounds of 24 independent `vdpbf16ps` on registers
/// on every rayon thread at once, the slowest thread's own time
/// (`threads · iters · 24 · 64` flops at the bf16 dot-product peak of all
/// threads); `None` without AVX512-BF16. The ceiling of the bf16 kernels
/// where they run on `vdpbf16ps`. For the examples' peak shares; not part
/// of the API.
#[doc(hidden)]
pub fn time_bf16_dot_peak_all(iters: usize) -> Option<f64> {
    let done = rayon::broadcast(|_| crate::cpu::bf16_dot::time_peak(iters));
    done.into_iter()
        .try_fold(0.0, |slowest, t| t.map(|t| f64::max(slowest, t)))
}

/// Seconds for `iters` rounds of 24 16-lane FMAs on registers only, on the
/// calling thread (`None` without AVX-512F): `iters · 24 · 32` flops at the
/// core's FMA peak, against which the tile kernel's rate can be read. For
/// the `peak` command of the `cpu_vs_torch` example; not part of the API.
#[doc(hidden)]
pub fn time_fma_peak(iters: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        let start = std::time::Instant::now();
        // SAFETY: AVX-512F was just detected.
        let sum = unsafe { crate::cpu::microkernel::fma_loop(iters) };
        let seconds = start.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        return Some(seconds);
    }
    let _ = iters;
    None
}

/// Seconds for `iters` rounds of four independent AMX `tdpbf16ps` on tile
/// registers only, on the calling thread (`None` without AMX-BF16):
/// `iters · 4 · 16384` flops at the core's bf16 tile peak, against which
/// the bf16 forward's rate can be read. For the `amxpeak` command of the
/// `cpu_vs_torch` example; not part of the API.
#[doc(hidden)]
pub fn time_amx_peak(iters: usize) -> Option<f64> {
    crate::cpu::amx::time_peak(iters)
}

/// Seconds for `iters` single-threaded tile products `C += A·B` of
/// `m × n × k` (`A` stored transposed when `a_transposed`, as the backward's
/// `Pᵀ dO` and `dSᵀ Q` are): through the AVX-512 tile kernel (`None` without
/// AVX-512F) and through the `gemm` crate. For the `tile` command of the
/// `cpu_vs_torch` example; not part of the API.
#[doc(hidden)]
pub fn time_tile_products(
    m: usize,
    n: usize,
    k: usize,
    a_transposed: bool,
    iters: usize,
) -> (Option<f64>, f64) {
    let fill = |len: usize, seed: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed) % 1021) as f32 / 1021.0 - 0.5)
            .collect()
    };
    let (a, b) = (fill(m * k, 1), fill(k * n, 2));
    let mut c = vec![0.0f32; m * n];
    let lhs = if a_transposed {
        MatRef::row_major(&a, k, m).t()
    } else {
        MatRef::row_major(&a, m, k)
    };
    let rhs = MatRef::row_major(&b, k, n);
    let time = |run: &mut dyn FnMut()| {
        let start = std::time::Instant::now();
        for _ in 0..iters {
            run();
        }
        start.elapsed().as_secs_f64()
    };
    #[cfg(target_arch = "x86_64")]
    let ours = std::arch::is_x86_feature_detected!("avx512f").then(|| {
        time(&mut || {
            tile_kernel(
                &mut MatMut::row_major(&mut c, m, n),
                Write::Accumulate,
                lhs,
                rhs,
                1.0,
            );
        })
    });
    #[cfg(not(target_arch = "x86_64"))]
    let ours = None;
    let theirs = time(&mut || {
        crate_gemm(
            &mut MatMut::row_major(&mut c, m, n),
            Write::Accumulate,
            lhs,
            rhs,
            1.0,
        );
    });
    (ours, theirs)
}

/// Write the transpose of the row-major `rows × cols` matrix `src` into
/// `dst` (`cols × rows`, row stride `dst_rs`).
///
/// Used for the K and V tiles of the tile products, whose right-hand sides
/// must have contiguous rows (see [`matmul`]). Panics if either slice is
/// too short.
pub fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32], dst_rs: usize) {
    // SAFETY: `f32` and `MaybeUninit<f32>` have the same layout, and
    // `transpose_uninit` only writes initialised floats.
    let dst = unsafe { &mut *(dst as *mut [f32] as *mut [MaybeUninit<f32>]) };
    transpose_uninit(src, (rows, cols, cols), dst, dst_rs);
}

/// Check a transpose's bounds: `src` holds `rows` rows of `cols`, `src_rs`
/// apart, and `dst` (`dst_len` long) its `cols` rows of `rows`, `dst_rs`
/// apart. Returns whether there is anything to move.
///
/// # Panics
/// If either slice is too short or the source rows overlap.
pub(in crate::cpu) fn transpose_bounds(
    src_len: usize,
    (rows, cols, src_rs): (usize, usize, usize),
    dst_len: usize,
    dst_rs: usize,
) -> bool {
    assert!(src_rs >= cols, "transpose source rows overlap");
    let empty = rows == 0 || cols == 0;
    assert!(
        empty || src_len >= (rows - 1) * src_rs + cols,
        "transpose source out of bounds"
    );
    assert!(
        empty || dst_len >= (cols - 1) * dst_rs + rows,
        "transpose destination out of bounds"
    );
    !empty
}

/// [`transpose`] of rows `src_rs` apart into memory that need not be
/// initialised: afterwards every `dst[c·dst_rs + r]` (`r < rows`, `c <
/// cols`) is, and nothing else is written. Lets a fresh buffer skip being
/// zeroed first.
pub fn transpose_uninit(
    src: &[f32],
    (rows, cols, src_rs): (usize, usize, usize),
    dst: &mut [MaybeUninit<f32>],
    dst_rs: usize,
) {
    if !transpose_bounds(src.len(), (rows, cols, src_rs), dst.len(), dst_rs) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd::avx512() && std::arch::is_x86_feature_detected!("avx512f") {
        let out = dst.as_mut_ptr().cast::<f32>();
        // SAFETY: AVX-512F detected; `transpose_bounds` bounds every element
        // read and written; `dst` is a unique borrow, so it does not
        // overlap `src`.
        unsafe {
            crate::cpu::microkernel::transpose::<crate::cpu::microkernel::F32s>(
                src.as_ptr(),
                (rows, cols, src_rs),
                out,
                dst_rs,
            )
        };
        return;
    }
    // In bands of 16 source rows, so that the 16 source lines being read
    // stay in L1 while each destination row gets a contiguous run of 16.
    const BAND: usize = 16;
    for r0 in (0..rows).step_by(BAND) {
        let band = r0..rows.min(r0 + BAND);
        for c in 0..cols {
            for r in band.clone() {
                dst[c * dst_rs + r].write(src[r * src_rs + c]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: MatRef<'_>, b: MatRef<'_>) -> Vec<f32> {
        let mut c = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                let mut acc = 0.0f64;
                for p in 0..a.cols {
                    acc += a.data[i * a.rs + p * a.cs] as f64 * b.data[p * b.rs + j * b.cs] as f64;
                }
                c[i * b.cols + j] = acc as f32;
            }
        }
        c
    }

    #[test]
    fn transposed_views_overwrite_and_accumulate() {
        let (m, n, k) = (7, 5, 3);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.25 - 2.0).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| 1.0 - i as f32 * 0.125).collect();
        let lhs = MatRef::row_major(&a, m, k);
        let rhs = MatRef::row_major(&bt, n, k).t();
        let want = naive(lhs, rhs);

        let mut c = vec![f32::NAN; m * n];
        for (write, beta, total) in [(Write::Overwrite, 1.0, 1.0), (Write::Accumulate, 0.5, 1.5)] {
            matmul(MatMut::row_major(&mut c, m, n), write, lhs, rhs, beta);
            for (x, y) in c.iter().zip(&want) {
                assert!(
                    (x - total * y).abs() < 1e-5,
                    "{write:?}: {x} vs {}",
                    total * y
                );
            }
        }
    }

    #[test]
    fn strided_views_and_transpose() {
        let (rows, cols) = (19, 37);
        let src: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let mut t = vec![f32::NAN; cols * (rows + 3)];
        transpose(&src, rows, cols, &mut t, rows + 3);
        for (r, c) in (0..rows).flat_map(|r| (0..cols).map(move |c| (r, c))) {
            assert_eq!(t[c * (rows + 3) + r], src[r * cols + c]);
        }
        // A column block of the transpose, through a strided view, equals the
        // transposed view of the matching row block of `src`.
        let block = MatRef::strided(&t[5..], cols, 4, rows + 3);
        let direct = MatRef::row_major(&src[5 * cols..], 4, cols).t();
        let eye: Vec<f32> = (0..16)
            .map(|i| if i % 5 == 0 { 1.0 } else { 0.0 })
            .collect();
        let eye = MatRef::row_major(&eye, 4, 4);
        let (mut a, mut b) = (vec![0.0; cols * 4], vec![0.0; cols * 4]);
        matmul(
            MatMut::row_major(&mut a, cols, 4),
            Write::Overwrite,
            block,
            eye,
            1.0,
        );
        matmul(
            MatMut::row_major(&mut b, cols, 4),
            Write::Overwrite,
            direct,
            eye,
            1.0,
        );
        assert_eq!(a, b);
    }

    #[test]
    #[should_panic(expected = "inner dimensions differ")]
    fn shape_mismatch_panics() {
        let a = [0.0f32; 6];
        let mut c = [0.0f32; 4];
        let lhs = MatRef::row_major(&a, 2, 3);
        matmul(
            MatMut::row_major(&mut c, 2, 2),
            Write::Overwrite,
            lhs,
            lhs,
            1.0,
        );
    }
}
