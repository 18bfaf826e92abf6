//! The element types the CPU kernels read as stored: f32, and bf16 and f16
//! widened to f32 in registers on the way into a tile (exactly: every bf16
//! and f16 value is an f32), so that a 16-bit tensor is never copied whole.
//!
//! A kernel sees its operands as [`Stored`] slices and moves them into its
//! f32 tiles through [`transpose`] (keys into `Kᵀ` tiles) and [`widen`]
//! (rows as they are). On CPUs with AVX-512 both run in registers (16-bit
//! loads widened by a shift for bf16, `vcvtph2ps` for f16); elsewhere
//! through the `half` crate's conversions.

use crate::cpu::gemm;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// An element type the CPU kernels read as stored: `f32`, `half::bf16` or
/// `half::f16`.
pub trait KvElem: Copy + Send + Sync + 'static + sealed::Sealed {
    /// The slice as the kernels read it.
    #[doc(hidden)]
    fn stored(x: &[Self]) -> Stored<'_>;
}

impl KvElem for f32 {
    fn stored(x: &[f32]) -> Stored<'_> {
        Stored::F32(x)
    }
}

impl KvElem for half::bf16 {
    fn stored(x: &[Self]) -> Stored<'_> {
        use half::slice::HalfFloatSliceExt as _;
        Stored::Bf16(x.reinterpret_cast())
    }
}

impl KvElem for half::f16 {
    fn stored(x: &[Self]) -> Stored<'_> {
        use half::slice::HalfFloatSliceExt as _;
        Stored::F16(x.reinterpret_cast())
    }
}

/// The value of fp8 E4M3 bits (exact; `0x7f`/`0xff` are NaN, there is no
/// infinity): its magnitude bits read as an f16's upper bits lack only the
/// exponent bias difference, 2^8.
pub(crate) fn e4m3_to_f32(b: u8) -> f32 {
    if b & 0x7f == 0x7f {
        return f32::NAN;
    }
    let bits = (u16::from(b & 0x80) << 8) | (u16::from(b & 0x7f) << 7);
    half::f16::from_bits(bits).to_f32() * 256.0
}

/// The value of fp8 E5M2 bits: the upper byte of an f16 (exact).
pub(crate) fn e5m2_to_f32(b: u8) -> f32 {
    half::f16::from_bits(u16::from(b) << 8).to_f32()
}

/// f32 to fp8 E4M3 bits: round to nearest even, saturating at ±448 (the
/// format has no infinity), NaN kept. The CUDA cache writer's encoding,
/// step for step (`emit/cuda/append.cu`).
pub(crate) fn f32_to_e4m3(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a < 0.015625 {
        // Subnormal: a multiple of 2^-9 (8 rounds up to the least normal).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let b = a.min(448.0).to_bits();
    let r = b + 0x7_ffff + ((b >> 20) & 1);
    let code = (((r >> 23) - 120) << 3) | ((r >> 20) & 7);
    sign | code.min(0x7e) as u8
}

/// f32 to fp8 E5M2 bits: round to nearest even, saturating at ±57344, NaN
/// kept (as [`f32_to_e4m3`]).
pub(crate) fn f32_to_e5m2(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a < 6.103_515_6e-5 {
        return sign | (a * 65536.0).round_ties_even() as u8;
    }
    let b = a.min(57344.0).to_bits();
    let r = b + 0xf_ffff + ((b >> 21) & 1);
    let code = (((r >> 23) - 112) << 2) | ((r >> 21) & 3);
    sign | code.min(0x7b) as u8
}

/// Elements as stored: f32, or the bits of bf16, f16, or fp8 (E4M3,
/// E5M2; KV caches, with their scales).
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub enum Stored<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
    E4m3(&'a [u8]),
    E5m2(&'a [u8]),
    /// int8 values as bytes (a quantised cache's).
    I8(&'a [u8]),
}

impl<'a> Stored<'a> {
    /// Elements held.
    pub(in crate::cpu) fn len(self) -> usize {
        match self {
            Stored::F32(x) => x.len(),
            Stored::Bf16(x) | Stored::F16(x) => x.len(),
            Stored::E4m3(x) | Stored::E5m2(x) | Stored::I8(x) => x.len(),
        }
    }

    /// Elements `r`.
    pub(in crate::cpu) fn slice(self, r: std::ops::Range<usize>) -> Stored<'a> {
        match self {
            Stored::F32(x) => Stored::F32(&x[r]),
            Stored::Bf16(x) => Stored::Bf16(&x[r]),
            Stored::F16(x) => Stored::F16(&x[r]),
            Stored::E4m3(x) => Stored::E4m3(&x[r]),
            Stored::E5m2(x) => Stored::E5m2(&x[r]),
            Stored::I8(x) => Stored::I8(&x[r]),
        }
    }

    /// The elements, where they are f32 already.
    pub(in crate::cpu) fn as_f32(self) -> Option<&'a [f32]> {
        match self {
            Stored::F32(x) => Some(x),
            _ => None,
        }
    }

    /// Bytes per element.
    pub(in crate::cpu) fn elem_bytes(self) -> usize {
        match self {
            Stored::F32(_) => 4,
            Stored::Bf16(_) | Stored::F16(_) => 2,
            Stored::E4m3(_) | Stored::E5m2(_) | Stored::I8(_) => 1,
        }
    }

    /// The elements' bytes.
    pub(in crate::cpu) fn as_bytes(self) -> &'a [u8] {
        // SAFETY: any initialised memory may be read as bytes, and u8 has
        // alignment 1.
        unsafe {
            match self {
                Stored::F32(x) => std::slice::from_raw_parts(x.as_ptr().cast(), 4 * x.len()),
                Stored::Bf16(x) | Stored::F16(x) => {
                    std::slice::from_raw_parts(x.as_ptr().cast(), 2 * x.len())
                }
                Stored::E4m3(x) | Stored::E5m2(x) | Stored::I8(x) => x,
            }
        }
    }

    /// Whether every element is finite (no NaN, no infinity).
    pub(in crate::cpu) fn all_finite(self) -> bool {
        match self {
            Stored::F32(x) => crate::cpu::all_finite(x),
            Stored::Bf16(x) => crate::cpu::all_finite_bits(x),
            // An exponent of all ones: infinity or NaN.
            Stored::F16(x) => {
                x.iter()
                    .fold(0u16, |acc, v| acc | u16::from(v & 0x7c00 == 0x7c00))
                    == 0
            }
            // E4M3 has no infinity; its NaN is all ones but the sign.
            Stored::E4m3(x) => {
                x.iter()
                    .fold(0u8, |acc, v| acc | u8::from(v & 0x7f == 0x7f))
                    == 0
            }
            Stored::E5m2(x) => {
                x.iter()
                    .fold(0u8, |acc, v| acc | u8::from(v & 0x7c == 0x7c))
                    == 0
            }
            Stored::I8(_) => true,
        }
    }
}

/// The f32 transpose of the `rows × cols` elements `src` (rows `src_rs`
/// apart) into `dst` (`cols × rows`, row stride `dst_rs`), as
/// [`gemm::transpose`].
///
/// # Panics
/// If either slice is too short or the source rows overlap.
pub(in crate::cpu) fn transpose(
    src: Stored<'_>,
    (rows, cols, src_rs): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
) {
    if !gemm::transpose_bounds(src.len(), (rows, cols, src_rs), dst.len(), dst_rs) {
        return;
    }
    if let Some(x) = src.as_f32() {
        // SAFETY: `f32` and `MaybeUninit<f32>` have the same layout, and
        // `transpose_uninit` only writes initialised floats.
        let dst = unsafe { &mut *(dst as *mut [f32] as *mut [std::mem::MaybeUninit<f32>]) };
        return gemm::transpose_uninit(x, (rows, cols, src_rs), dst, dst_rs);
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd::avx512() {
        use crate::cpu::microkernel::{Bf16s, E4m3s, E5m2s, F16s, I8s, transpose};
        let out = dst.as_mut_ptr();
        // SAFETY: AVX-512F/BW/VL detected; `transpose_bounds` bounds every
        // element read and written; `dst` is a unique borrow.
        unsafe {
            match src {
                Stored::Bf16(x) => {
                    transpose::<Bf16s>(x.as_ptr(), (rows, cols, src_rs), out, dst_rs)
                }
                Stored::F16(x) => transpose::<F16s>(x.as_ptr(), (rows, cols, src_rs), out, dst_rs),
                Stored::E4m3(x) => {
                    transpose::<E4m3s>(x.as_ptr(), (rows, cols, src_rs), out, dst_rs)
                }
                Stored::E5m2(x) => {
                    transpose::<E5m2s>(x.as_ptr(), (rows, cols, src_rs), out, dst_rs)
                }
                Stored::I8(x) => transpose::<I8s>(x.as_ptr(), (rows, cols, src_rs), out, dst_rs),
                Stored::F32(_) => unreachable!("f32 returned above"),
            }
        }
        return;
    }
    let mut wide = vec![0.0f32; rows * cols];
    for (r, row) in wide.chunks_exact_mut(cols).enumerate() {
        widen(src.slice(r * src_rs..r * src_rs + cols), row);
    }
    gemm::transpose(&wide, rows, cols, dst, dst_rs);
}

/// `dst[i] = src[i]` as f32.
///
/// # Panics
/// If the lengths differ.
pub(in crate::cpu) fn widen(src: Stored<'_>, dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen lengths");
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd::avx512() {
        use crate::cpu::microkernel::{Bf16s, E4m3s, E5m2s, F16s, F32s, I8s, widen};
        let (out, n) = (dst.as_mut_ptr(), dst.len());
        // SAFETY: AVX-512F/BW/VL detected; both hold `n` elements, and
        // `dst` is a unique borrow.
        unsafe {
            match src {
                Stored::F32(x) => widen::<F32s>(x.as_ptr(), out, n),
                Stored::Bf16(x) => widen::<Bf16s>(x.as_ptr(), out, n),
                Stored::F16(x) => widen::<F16s>(x.as_ptr(), out, n),
                Stored::E4m3(x) => widen::<E4m3s>(x.as_ptr(), out, n),
                Stored::E5m2(x) => widen::<E5m2s>(x.as_ptr(), out, n),
                Stored::I8(x) => widen::<I8s>(x.as_ptr(), out, n),
            }
        }
        return;
    }
    use half::slice::{HalfBitsSliceExt as _, HalfFloatSliceExt as _};
    match src {
        Stored::F32(x) => dst.copy_from_slice(x),
        Stored::Bf16(x) => x.reinterpret_cast::<half::bf16>().convert_to_f32_slice(dst),
        Stored::F16(x) => x.reinterpret_cast::<half::f16>().convert_to_f32_slice(dst),
        Stored::E4m3(x) => dst
            .iter_mut()
            .zip(x)
            .for_each(|(o, &b)| *o = e4m3_to_f32(b)),
        Stored::E5m2(x) => dst
            .iter_mut()
            .zip(x)
            .for_each(|(o, &b)| *o = e5m2_to_f32(b)),
        Stored::I8(x) => dst
            .iter_mut()
            .zip(x)
            .for_each(|(o, &b)| *o = f32::from(b as i8)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// Every fp8 value, the midpoints between neighbours (ties go to the
    /// even code), just off them, past the largest value, subnormals,
    /// infinities and random values at every scale: the encoders agree
    /// with numr's conversions (an independent implementation), and
    /// saturate past the largest value.
    #[test]
    fn fp8_encoders_round_to_nearest_even_and_saturate() {
        use numr::dtype::{FP8E4M3, FP8E5M2};
        let mut rng = Rng::new(0xf8, 0);
        let e4: Vec<f32> = (0u8..=0x7e).map(e4m3_to_f32).collect();
        let e5: Vec<f32> = (0u8..=0x7b).map(e5m2_to_f32).collect();
        for (values, most, ours, numr) in [
            (
                e4,
                448.0f32,
                f32_to_e4m3 as fn(f32) -> u8,
                (|x| FP8E4M3::from_f32(x).to_bits()) as fn(f32) -> u8,
            ),
            (e5, 57344.0, f32_to_e5m2, |x| FP8E5M2::from_f32(x).to_bits()),
        ] {
            let mut xs = values.clone();
            for w in values.windows(2) {
                let mid = 0.5 * (w[0] + w[1]);
                xs.extend([
                    mid,
                    f32::from_bits(mid.to_bits() + 1),
                    f32::from_bits(mid.to_bits() - 1),
                ]);
            }
            xs.extend([
                most * 1.03,
                most * 1.1,
                1e30,
                f32::INFINITY,
                f32::MIN_POSITIVE,
                1e-45,
            ]);
            for e in -24..20 {
                xs.extend(rng.normal_f32(64, 2f32.powi(e)));
            }
            for x in xs {
                for x in [x, -x] {
                    let want = if x.abs() > most {
                        // Saturated (numr's E5M2 overflows to infinity).
                        ours(most) | ((x < 0.0) as u8) << 7
                    } else {
                        numr(x)
                    };
                    assert_eq!(ours(x), want, "{x:e} ({:#010x})", x.to_bits());
                }
            }
            assert_eq!(ours(f32::NAN) & 0x7f, 0x7f, "NaN stays NaN");
        }
    }

    /// Values every format holds exactly, and their bits in each.
    fn values(n: usize, rng: &mut Rng) -> (Vec<f32>, Vec<half::bf16>, Vec<half::f16>) {
        let x: Vec<f32> = rng
            .normal_f32(n, 3.0)
            .into_iter()
            .map(|v| half::f16::from_f32(half::bf16::from_f32(v).to_f32()).to_f32())
            .collect();
        let b = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let h = x.iter().map(|&v| half::f16::from_f32(v)).collect();
        (x, b, h)
    }

    fn every_level(f: impl Fn() + Sync) {
        use crate::cpu::simd::{LEVEL_CAP, Level};
        for level in [Level::Baseline, Level::Amx] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .start_handler(move |_| LEVEL_CAP.with(|c| c.set(level)))
                .build()
                .expect("a pool");
            pool.install(&f);
        }
    }

    /// Every fp8 bit pattern widens to numr's value of it (an independent
    /// conversion), NaN to NaN, and every int8 to its integer, at every
    /// level, row by row and transposed with rows apart.
    #[test]
    fn every_fp8_and_int8_value_widens_exactly_at_every_level() {
        use numr::dtype::{FP8E4M3, FP8E5M2};
        let bytes: Vec<u8> = (0..=255).collect();
        let e4m3: Vec<f32> = bytes.iter().map(|&b| FP8E4M3(b).to_f32()).collect();
        let e5m2: Vec<f32> = bytes.iter().map(|&b| FP8E5M2(b).to_f32()).collect();
        let int8: Vec<f32> = bytes.iter().map(|&b| f32::from(b as i8)).collect();
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        every_level(|| {
            for (stored, want) in [
                (Stored::E4m3(&bytes), &e4m3),
                (Stored::E5m2(&bytes), &e5m2),
                (Stored::I8(&bytes), &int8),
            ] {
                let mut w = vec![0.0f32; 256];
                widen(stored, &mut w);
                for (b, (&got, &want)) in w.iter().zip(want.iter()).enumerate() {
                    assert!(same(got, want), "{stored:?} byte {b:#x}: {got} vs {want}");
                }
                // 16 rows of 13, 16 apart (the last 3 of each row unread).
                let mut t = vec![f32::NAN; 13 * 16];
                transpose(stored, (16, 13, 16), &mut t, 16);
                for r in 0..16 {
                    for c in 0..13 {
                        assert!(
                            same(t[c * 16 + r], want[r * 16 + c]),
                            "{stored:?} ({r}, {c})"
                        );
                    }
                }
            }
        });
    }

    #[test]
    fn widening_transposes_and_copies_are_exact_at_every_level() {
        every_level(|| {
            let mut rng = Rng::new(0x3e1e, 0);
            for (rows, cols) in [(1, 1), (5, 17), (16, 16), (64, 128), (37, 40), (70, 33)] {
                let (x, b, h) = values(rows * cols, &mut rng);
                let dst_rs = rows + 3;
                for stored in [
                    KvElem::stored(&x[..]),
                    KvElem::stored(&b[..]),
                    KvElem::stored(&h[..]),
                ] {
                    let mut t = vec![f32::NAN; cols * dst_rs];
                    transpose(stored, (rows, cols, cols), &mut t, dst_rs);
                    for r in 0..rows {
                        for c in 0..cols {
                            let (got, want) = (t[c * dst_rs + r], x[r * cols + c]);
                            assert_eq!(got.to_bits(), want.to_bits(), "{stored:?} ({r}, {c})");
                        }
                    }
                    // Padding between the rows of `t` is untouched.
                    assert!((0..cols).all(|c| t[c * dst_rs + rows].is_nan()));
                    let mut w = vec![f32::NAN; rows * cols];
                    widen(stored, &mut w);
                    assert!(w.iter().zip(&x).all(|(a, b)| a.to_bits() == b.to_bits()));
                }
            }
        });
    }
}
