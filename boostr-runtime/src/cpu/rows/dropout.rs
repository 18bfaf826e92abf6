//! The dropout draw on the CPU: Philox 4×32-10 over sixteen counters at a
//! time, written so that each round is a handful of vector instructions
//! (two 32×32→64 products per lane and their halves), compiled inside the
//! kernels' elementwise passes at their instruction set.
//!
//! The draw is [`kernels_spec::dropout`]'s: pair `(b, h, q, kv)` keeps its
//! weight when word `kv & 3` of `philox([kv >> 2, q, b << 16 | h,
//! offset], seed)` is at least the call's threshold.

use crate::problem::Problem;
use crate::variant::HostVariant;
use kernels_spec::dropout::{M0, M1, ROUNDS, W0, W1};

/// Counters per block: sixteen lanes, 64 keys.
const LANES: usize = 16;
/// Keys one block draws for.
pub(in crate::cpu) const BLOCK_KEYS: usize = 4 * LANES;

/// The generator of one call with dropout, keyed for one (batch, query
/// head) of the variant.
#[derive(Clone, Copy, Debug)]
struct Philox {
    key: [u32; 2],
    /// The counter's third word, `b << 16 | h`.
    bh: u32,
    offset: u32,
    threshold: u32,
}

/// One (batch, query head)'s draw of a call with dropout: each row's
/// pairs keyed where the variant sees them
/// ([`HostVariant::dropout_site`]).
#[derive(Clone, Copy, Debug)]
pub(in crate::cpu) struct Draw<'v, V> {
    philox: Philox,
    variant: &'v V,
    b: i32,
    h: u32,
    /// `1/(1 − p)`.
    pub(in crate::cpu) scale: f32,
}

impl<'v, V: HostVariant> Draw<'v, V> {
    /// The draw of `(b, h)` of `variant` under `p`'s dropout; `None` where
    /// it keeps every pair (no dropout, or `p = 0`).
    #[inline(always)]
    pub(in crate::cpu) fn new(p: &Problem, variant: &'v V, b: i32, h: i32) -> Option<Self> {
        let d = p.dropout;
        d.active().then(|| Draw {
            philox: Philox {
                key: [d.seed as u32, (d.seed >> 32) as u32],
                bh: 0,
                offset: d.offset,
                threshold: d.threshold,
            },
            variant,
            b,
            h: h as u32,
            scale: d.scale(),
        })
    }

    /// Call `f(j)` for each key `kv_lo + j` of `0 .. n` of query `q` that
    /// is dropped, the row keyed where the variant sees it. Keys that land
    /// before the variant's first (another packed sequence's, which the
    /// window hides) are never dropped.
    #[inline(always)]
    fn each_dropped(&self, q: i32, kv_lo: i32, n: usize, f: impl FnMut(usize)) {
        let (b, q, shift) = self.variant.dropout_site(self.b, q);
        let philox = Philox {
            bh: ((b as u32) << 16) | self.h,
            ..self.philox
        };
        let kv_lo = kv_lo + shift;
        let skip = usize::try_from(-kv_lo).unwrap_or(0).min(n);
        let mut f = f;
        philox.each_dropped(q, kv_lo + skip as i32, n - skip, |j| f(j + skip));
    }

    /// Zero the entries of `row` (keys `kv_lo ..` of query `q`) whose pair
    /// is dropped.
    #[inline(always)]
    pub(in crate::cpu) fn drop_row<T: Copy + Default>(&self, q: i32, kv_lo: i32, row: &mut [T]) {
        let n = row.len();
        self.each_dropped(q, kv_lo, n, |j| row[j] = T::default());
    }

    /// `dst[j] = src[j] / (1 − p)` where pair `(q, kv_lo + j)` is kept, else 0.
    #[inline(always)]
    pub(in crate::cpu) fn keep_scaled(&self, q: i32, kv_lo: i32, src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
        self.scale_kept(q, kv_lo, dst);
    }

    /// `row[j]` times `1/(1 − p)` where pair `(q, kv_lo + j)` is kept, else
    /// 0, in place: the pairs' factors on a tile row.
    #[inline(always)]
    pub(in crate::cpu) fn scale_kept(&self, q: i32, kv_lo: i32, row: &mut [f32]) {
        crate::cpu::math::scale(row, self.scale);
        self.drop_row(q, kv_lo, row);
    }

    /// Whether pair `(q, kv)` is kept (one pair; for tests).
    #[cfg(test)]
    pub(in crate::cpu) fn keeps(&self, q: i32, kv: i32) -> bool {
        let mut out = true;
        self.each_dropped(q, kv, 1, |_| out = false);
        out
    }
}

impl Philox {
    /// The 64 random words of keys `4·c0 .. 4·c0 + 64` of query `q`, in
    /// key order (the portable draw, and the test of the vector one).
    #[inline(always)]
    fn block(&self, q: u32, c0: u32) -> [u32; BLOCK_KEYS] {
        let mut x0: [u32; LANES] = std::array::from_fn(|i| c0.wrapping_add(i as u32));
        let mut x1 = [q; LANES];
        let mut x2 = [self.bh; LANES];
        let mut x3 = [self.offset; LANES];
        let [mut k0, mut k1] = self.key;
        for _ in 0..ROUNDS {
            for i in 0..LANES {
                let p0 = u64::from(M0) * u64::from(x0[i]);
                let p1 = u64::from(M1) * u64::from(x2[i]);
                let y0 = (p1 >> 32) as u32 ^ x1[i] ^ k0;
                let y2 = (p0 >> 32) as u32 ^ x3[i] ^ k1;
                (x0[i], x1[i], x2[i], x3[i]) = (y0, p1 as u32, y2, p0 as u32);
            }
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        std::array::from_fn(|j| [x0, x1, x2, x3][j % 4][j / 4])
    }

    /// Bit `j` set where key `4·c0 + j` of query `q` is kept, `j < 64`.
    #[inline(always)]
    fn keep_mask(&self, q: u32, c0: u32) -> u64 {
        #[cfg(target_arch = "x86_64")]
        if avx512() {
            // SAFETY: the CPU has AVX-512F and BMI2 (checked once).
            return unsafe { self.keep_mask_avx512(q, c0) };
        }
        self.keep_mask_portable(q, c0)
    }

    fn keep_mask_portable(&self, q: u32, c0: u32) -> u64 {
        let words = self.block(q, c0);
        words
            .iter()
            .enumerate()
            .fold(0u64, |m, (j, &w)| m | (u64::from(w >= self.threshold) << j))
    }

    /// [`keep_mask`](Philox::keep_mask) with sixteen counters in one
    /// register per word: each round is two 32×32→64 products per
    /// multiplier (even and odd lanes), their halves blended back, and
    /// four XORs.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,bmi2")]
    unsafe fn keep_mask_avx512(&self, q: u32, c0: u32) -> u64 {
        use std::arch::x86_64::*;
        const ODD: __mmask16 = 0xAAAA;
        // (hi, lo) of the 32×32 products of `m` (odd lanes in place) and `x`.
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn mulhilo(m: __m512i, m_odd: __m512i, x: __m512i) -> (__m512i, __m512i) {
            let even = _mm512_mul_epu32(m, x);
            let odd = _mm512_mul_epu32(m_odd, _mm512_srli_epi64::<32>(x));
            let hi = _mm512_mask_blend_epi32(ODD, _mm512_srli_epi64::<32>(even), odd);
            let lo = _mm512_mask_blend_epi32(ODD, even, _mm512_slli_epi64::<32>(odd));
            (hi, lo)
        }
        let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let mut x0 = _mm512_add_epi32(_mm512_set1_epi32(c0 as i32), lane);
        let mut x1 = _mm512_set1_epi32(q as i32);
        let mut x2 = _mm512_set1_epi32(self.bh as i32);
        let mut x3 = _mm512_set1_epi32(self.offset as i32);
        let (m0, m1) = (
            _mm512_set1_epi64(i64::from(M0)),
            _mm512_set1_epi64(i64::from(M1)),
        );
        let [mut k0, mut k1] = self.key;
        for _ in 0..ROUNDS {
            let (hi0, lo0) = mulhilo(m0, m0, x0);
            let (hi1, lo1) = mulhilo(m1, m1, x2);
            let y0 = _mm512_xor_si512(_mm512_xor_si512(hi1, x1), _mm512_set1_epi32(k0 as i32));
            let y2 = _mm512_xor_si512(_mm512_xor_si512(hi0, x3), _mm512_set1_epi32(k1 as i32));
            (x0, x1, x2, x3) = (y0, lo1, y2, lo0);
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let t = _mm512_set1_epi32(self.threshold as i32);
        let mut mask = 0u64;
        for (w, x) in [x0, x1, x2, x3].into_iter().enumerate() {
            let kept = _mm512_cmpge_epu32_mask(x, t);
            mask |= _pdep_u64(u64::from(kept), 0x1111_1111_1111_1111 << w);
        }
        mask
    }

    /// Call `f(j)` for each key `kv_lo + j` of `0 .. n` of query `q` that
    /// is dropped (positions as keyed, `kv_lo ≥ 0`).
    #[inline(always)]
    fn each_dropped(&self, q: i32, kv_lo: i32, n: usize, mut f: impl FnMut(usize)) {
        let start = kv_lo as u32;
        // Blocks start at a multiple of four keys: the counter's first word.
        let mut base = start & !3;
        let end = start.wrapping_add(n as u32);
        while base < end {
            let mut dropped = !self.keep_mask(q as u32, base >> 2);
            // Only keys `start .. end` of the block.
            if start > base {
                dropped &= u64::MAX << (start - base);
            }
            if end - base < BLOCK_KEYS as u32 {
                dropped &= (1u64 << (end - base)) - 1;
            }
            while dropped != 0 {
                let j = base + dropped.trailing_zeros();
                f((j - start) as usize);
                dropped &= dropped - 1;
            }
            base += BLOCK_KEYS as u32;
        }
    }
}

/// The CPU has AVX-512 and BMI2, and tests have not capped the level
/// below it (the portable draw then runs).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn avx512() -> bool {
    crate::cpu::simd::avx512() && std::arch::is_x86_feature_detected!("bmi2")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::Dropout;
    use crate::testing::fixtures::Unmasked as Plain;
    use crate::testing::reference::{keeps, philox4x32_10};

    /// Random123's known-answer vectors for Philox 4×32-10.
    #[test]
    fn philox_matches_the_known_answers() {
        let kat = [
            (
                [0u32; 4],
                [0u32; 2],
                [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
            ),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (counter, key, want) in kat {
            assert_eq!(philox4x32_10(counter, key), want, "reference");
            let draw = Philox {
                key,
                bh: counter[2],
                offset: counter[3],
                threshold: 0,
            };
            let block = draw.block(counter[1], counter[0]);
            assert_eq!(block[..4], want, "kernels' draw");
            // The vector draw's keep bits, at thresholds around each word.
            for (w, &word) in want.iter().enumerate() {
                for t in [word, word.wrapping_add(1)] {
                    let d = Philox {
                        threshold: t,
                        ..draw
                    };
                    let bit = d.keep_mask(counter[1], counter[0]) >> w & 1;
                    assert_eq!(bit == 1, word >= t, "word {w}, threshold {t:#x}");
                    assert_eq!(
                        d.keep_mask(counter[1], counter[0]),
                        d.keep_mask_portable(counter[1], counter[0])
                    );
                }
            }
        }
    }

    /// The kernels' blocked draw and the reference's pair-by-pair one agree
    /// on every pair, at any alignment of the row's first key.
    #[test]
    fn blocked_draw_matches_the_reference() {
        let p = Problem::new(3, (5, 5), (7, 300), 8)
            .with_dropout(Dropout::new(0.3, 0xDEAD_BEEF_0123_4567, 9).unwrap());
        for (b, h, q) in [(0, 0, 0), (2, 4, 299), (1, 3, 17)] {
            let draw = Draw::new(&p, &Plain, b, h).unwrap();
            for kv_lo in [0, 1, 3, 61, 64, 130] {
                let mut row = vec![1.0f32; 137];
                draw.drop_row(q, kv_lo, &mut row);
                for (j, &x) in row.iter().enumerate() {
                    let kv = kv_lo + j as i32;
                    assert_eq!(x == 1.0, keeps(&p, b, h, q, kv), "({b}, {h}, {q}, {kv})");
                    assert_eq!(draw.keeps(q, kv), x == 1.0);
                }
            }
        }
    }

    /// The keep rate is `1 − p` within 4σ over 10^6 pairs, for several
    /// `p`; and rows, heads, batches and offsets draw differently.
    #[test]
    fn keep_rate_is_one_minus_p() {
        for prob in [0.1f32, 0.5, 0.9] {
            let p =
                Problem::new(2, (2, 2), (1, 1), 8).with_dropout(Dropout::new(prob, 42, 0).unwrap());
            let (mut kept, mut n) = (0u64, 0u64);
            for (b, h) in [(0, 0), (1, 1)] {
                let draw = Draw::new(&p, &Plain, b, h).unwrap();
                for q in 0..500 {
                    let mut row = vec![1u8; 1000];
                    draw.drop_row(q, 0, &mut row);
                    kept += row.iter().map(|&x| u64::from(x)).sum::<u64>();
                    n += 1000;
                }
            }
            let keep = 1.0 - f64::from(prob);
            let sigma = (keep * (1.0 - keep) / n as f64).sqrt();
            let rate = kept as f64 / n as f64;
            assert!(
                (rate - keep).abs() < 4.0 * sigma,
                "p = {prob}: kept {rate} of {n} pairs, want {keep} ± {}",
                4.0 * sigma
            );
        }
        let p = |offset| {
            Problem::new(2, (2, 2), (1, 1), 8).with_dropout(Dropout::new(0.5, 42, offset).unwrap())
        };
        let row = |p: &Problem, b, h, q| {
            let mut row = vec![1u8; 256];
            Draw::new(p, &Plain, b, h).unwrap().drop_row(q, 0, &mut row);
            row
        };
        let base = row(&p(0), 0, 0, 0);
        for other in [
            row(&p(1), 0, 0, 0),
            row(&p(0), 1, 0, 0),
            row(&p(0), 0, 1, 0),
            row(&p(0), 0, 0, 1),
        ] {
            assert_ne!(base, other);
        }
        assert!(Draw::new(&Problem::new(1, (1, 1), (1, 1), 8), &Plain, 0, 0).is_none());
    }
}
