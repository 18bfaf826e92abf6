//! bf16 tile products on AVX512-BF16's `vdpbf16ps`, for CPUs without AMX:
//! the operands of [`crate::cpu::amx::product`], in the same layouts, so the
//! bf16 kernels run either unchanged (see [`crate::cpu::amx::Products`]).
//!
//! `vdpbf16ps` adds, per f32 lane, the two products of a pair of bf16
//! lanes; a row of `A` is broadcast one pair at a time against 16 columns'
//! pairs of `B`. Register blocking: 4 rows × 64 columns (16 accumulators),
//! or 4 × 32 for the last 32 columns.
//!
//! When it runs: on AMD CPUs with AVX512-BF16 and no AMX (Zen 4 and 5),
//! where `vdpbf16ps` issues at the rate of an f32 FMA and so doubles the
//! products per cycle. Intel's (Cooper Lake, Sapphire Rapids) issues it at
//! half that rate, no faster than the f32 kernels, and those CPUs keep the
//! widened f32 path unless they have AMX (see [`pays`]).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Whether the CPU has AVX-512F, AVX-512BW (the kernels' bf16 rounding)
/// and AVX512-BF16.
pub(in crate::cpu) fn present() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether `vdpbf16ps` beats the f32 kernels here: it is present and the
/// CPU is AMD's (CPUID vendor "AuthenticAMD"), whose cores issue it at the
/// f32 FMA rate.
pub(in crate::cpu) fn pays() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| present() && vendor() == *b"AuthenticAMD")
}

/// The CPUID vendor string.
fn vendor() -> [u8; 12] {
    #[cfg(target_arch = "x86_64")]
    {
        let r = __cpuid(0);
        let mut v = [0u8; 12];
        v[..4].copy_from_slice(&r.ebx.to_le_bytes());
        v[4..8].copy_from_slice(&r.edx.to_le_bytes());
        v[8..].copy_from_slice(&r.ecx.to_le_bytes());
        v
    }
    #[cfg(not(target_arch = "x86_64"))]
    [0; 12]
}

/// [`crate::cpu::amx::product`] on `vdpbf16ps`: `C (=|+=) A · B`, `A` `m × k`
/// bf16 row-major, `B` `k/2` rows of `n` bf16 pairs, `C` `m × n` f32.
///
/// # Safety
/// [`present`]; `m` a multiple of 4, `n` of 32, `k` of 2; every element
/// named is in bounds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(in crate::cpu) unsafe fn product(
    a: (*const u16, usize),
    b: (*const u32, usize),
    c: (*mut f32, usize),
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    for i in (0..m).step_by(ROWS) {
        let mut j = 0;
        while j + 64 <= n {
            // SAFETY: rows i..i+4, columns j..j+64 are in bounds.
            unsafe { block::<4>(a, b, c, (i, j, k), accumulate) };
            j += 64;
        }
        if j < n {
            // SAFETY: as above, columns j..j+32.
            unsafe { block::<2>(a, b, c, (i, j, k), accumulate) };
        }
    }
}

/// `dst[i]` = `src[i]` rounded to bf16 bits, to nearest even, 32 at a
/// time by `vcvtne2ps2bf16` (see [`crate::cpu::math::round_bf16`]).
///
/// # Safety
/// [`present`]; `dst.len() == src.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(in crate::cpu) unsafe fn round(src: &[f32], dst: &mut [u16]) {
    let n = src.len();
    let mut i = 0;
    // SAFETY (whole body): every access is below `n`, in both slices.
    unsafe {
        while i + 32 <= n {
            let lo = _mm512_loadu_ps(src.as_ptr().add(i));
            let hi = _mm512_loadu_ps(src.as_ptr().add(i + 16));
            let pair = _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_si512(
                dst.as_mut_ptr().add(i).cast(),
                std::mem::transmute::<__m512bh, __m512i>(pair),
            );
            i += 32;
        }
        if i < n {
            let rest = n - i;
            let mask = if rest >= 16 {
                u16::MAX
            } else {
                (1u16 << rest) - 1
            };
            let lo = _mm512_maskz_loadu_ps(mask, src.as_ptr().add(i));
            let hi_mask = if rest > 16 {
                (1u16 << (rest - 16)) - 1
            } else {
                0
            };
            let hi = _mm512_maskz_loadu_ps(hi_mask, src.as_ptr().add(i + 16.min(rest)));
            let pair = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
            let words = (1u32 << rest).wrapping_sub(1);
            _mm512_mask_storeu_epi16(dst.as_mut_ptr().add(i).cast(), words, pair);
        }
    }
}

/// Seconds for `iters` rounds of 24 independent `vdpbf16ps` on registers
/// only, on the calling thread (`None` without AVX512-BF16): `iters · 24 ·
/// 64` flops at the core's bf16 dot-product peak.
pub(in crate::cpu) fn time_peak(iters: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if present() {
        let start = std::time::Instant::now();
        // SAFETY: AVX512-BF16 and F were just detected.
        let sum = unsafe { peak_loop(iters) };
        let seconds = start.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        return Some(seconds);
    }
    let _ = iters;
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
fn peak_loop(iters: usize) -> f32 {
    // Opaque operands, so that the loop is not folded.
    let mut acc = std::hint::black_box([_mm512_set1_ps(0.0); 24]);
    let (a, b) = std::hint::black_box((
        _mm512_set1_epi32(0x3f80_3f80),
        _mm512_set1_epi32(0x3380_3380),
    ));
    // SAFETY: the transmutes reinterpret 512 bits as 32 bf16 lanes.
    let (a, b) = unsafe {
        (
            std::mem::transmute::<__m512i, __m512bh>(a),
            std::mem::transmute::<__m512i, __m512bh>(b),
        )
    };
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_dpbf16_ps(*x, a, b);
        }
    }
    acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
}

/// Rows of `C` per register block.
const ROWS: usize = 4;

/// Rows `i .. i + 4` and columns `j .. j + 16·NB` of [`product`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn block<const NB: usize>(
    (a, a_stride): (*const u16, usize),
    (b, b_stride): (*const u32, usize),
    (c, c_stride): (*mut f32, usize),
    (i, j, k): (usize, usize, usize),
    accumulate: bool,
) {
    // SAFETY (whole body): the caller vouches for rows i..i+4 of A and C,
    // pair rows 0..k/2 and columns j..j+16·NB of B and C.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NB]; ROWS];
        if accumulate {
            for (r, row) in acc.iter_mut().enumerate() {
                for (t, x) in row.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(c.add((i + r) * c_stride + j + 16 * t));
                }
            }
        }
        for p in 0..k / 2 {
            let bv: [__m512bh; NB] = std::array::from_fn(|t| {
                let v = _mm512_loadu_si512(b.add(p * b_stride + j + 16 * t).cast());
                std::mem::transmute::<__m512i, __m512bh>(v)
            });
            for (r, row) in acc.iter_mut().enumerate() {
                let pair = a
                    .add((i + r) * a_stride + 2 * p)
                    .cast::<u32>()
                    .read_unaligned();
                let av = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair as i32));
                for (x, &bt) in row.iter_mut().zip(&bv) {
                    *x = _mm512_dpbf16_ps(*x, av, bt);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (t, x) in row.iter().enumerate() {
                _mm512_storeu_ps(c.add((i + r) * c_stride + j + 16 * t), *x);
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use half::bf16;

    /// `vcvtne2ps2bf16` rounds as `math::bf16_bits` does, whole vectors
    /// and every tail length, and writes nothing past the end.
    #[test]
    fn rounding_to_bf16_matches_the_integer_rounding() {
        if !present() {
            eprintln!("boostr: skipping: no AVX512-BF16 on this CPU");
            return;
        }
        let mut rng = crate::testing::Rng::new(9, 0);
        for n in 0..70 {
            // Magnitudes from 2^-60 to 2^4, and ties to even.
            let mut src: Vec<f32> = rng
                .normal_f32(n, 1.0)
                .into_iter()
                .enumerate()
                .map(|(i, x)| x * (2f32).powi(i as i32 % 64 - 60))
                .collect();
            if n > 3 {
                src[1] = f32::from_bits(0x3f80_8000); // a tie, rounds down to even
                src[2] = f32::from_bits(0x3f81_8000); // a tie, rounds up to even
                src[3] = 0.0;
            }
            let mut got = vec![0xdeadu16; n + 1];
            // SAFETY: present; equal lengths.
            unsafe { round(&src, &mut got[..n]) };
            for (i, &x) in src.iter().enumerate() {
                assert_eq!(got[i], crate::cpu::math::bf16_bits(x), "n {n}, [{i}] = {x}");
            }
            assert_eq!(got[n], 0xdead, "n {n}: written past the end");
        }
    }

    /// `C += A · B` on `vdpbf16ps` (96 × 64 of C, both column blocks, k =
    /// 64) against the f64 sums of the same bf16 products.
    #[test]
    fn a_dot_product_is_the_sum_of_its_products() {
        if !present() {
            eprintln!("boostr: skipping: no AVX512-BF16 on this CPU");
            return;
        }
        let (m, n, k) = (96, 96, 64);
        let mut rng = crate::testing::Rng::new(5, 0);
        let mut draw = |len| -> Vec<bf16> {
            rng.normal_f32(len, 1.0)
                .into_iter()
                .map(bf16::from_f32)
                .collect()
        };
        let (a, b) = (draw(m * k), draw(k * n));
        let c0: Vec<f32> = draw(m * n).iter().map(|x| x.to_f32()).collect();
        // B as pairs of rows: (B[2r][j], B[2r + 1][j]).
        let bp: Vec<u32> = (0..k / 2 * n)
            .map(|at| {
                let (r, j) = (at / n, at % n);
                u32::from(b[2 * r * n + j].to_bits())
                    | (u32::from(b[(2 * r + 1) * n + j].to_bits()) << 16)
            })
            .collect();
        let mut c = c0.clone();
        let a_bits: Vec<u16> = a.iter().map(|x| x.to_bits()).collect();
        // SAFETY: present; m, n, k multiples of 4, 32 and 2; all in bounds.
        unsafe {
            product(
                (a_bits.as_ptr(), k),
                (bp.as_ptr(), n),
                (c.as_mut_ptr(), n),
                (m, n, k),
                true,
            )
        };
        for i in 0..m {
            for j in 0..n {
                let want: f64 = f64::from(c0[i * n + j])
                    + (0..k)
                        .map(|l| {
                            f64::from(a[i * k + l].to_f32()) * f64::from(b[l * n + j].to_f32())
                        })
                        .sum::<f64>();
                let got = f64::from(c[i * n + j]);
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "c[{i}][{j}] = {got}, want {want}"
                );
            }
        }
    }
}
