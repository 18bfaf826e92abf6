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
//! target-feature wrappers of the crate's `cpu::simd` module at their vector width.

/// Independent accumulators per reduction: 16 f32 fill one AVX-512, two AVX
/// or four SSE registers, enough to hide most of the latency of a dependent
/// `add`/`max` chain without spilling on SSE.
pub const LANES: usize = 16;

/// One partial sum per lane (see [`exp_sub_lanes`]).
pub type Lanes = [f32; LANES];

/// [`exp_softmax`] is exactly `0.0` below this, `−64·ln 2`: probabilities
/// under `2^-64` of the row's maximum are flushed to zero.
///
/// Why: they change no result (next to the maximum's `1`, even `2^31` of
/// them sum to under `2^-33`, a thousandth of an ulp of the denominator),
/// but they cost a lot. The products that follow the softmax (`P V`, and
/// `dS K`, `dSᵀ Q` in the backward) multiply them by values of order one,
/// and a probability near the f32 limit `2^-126` gives a subnormal product;
/// every vector FMA that produces one takes a microcode assist of some
/// hundred cycles. With a flush at `2^-126`, a handful of such keys per row
/// (an ALiBi head with a steep slope has them on every row) made the tile
/// products measurably slower. From `2^-64` on, `|v| ≥ 2^-62` keeps every
/// product normal.
pub const SOFTMAX_FLUSH: f32 = -64.0 * std::f32::consts::LN_2;

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
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Comparisons rather than `f32::max/min`: these lower to one `maxps`/`minps`
    // each and let NaN through (NaN in, NaN out).
    let xc = if x < EXP_LO { EXP_LO } else { x };
    let xc = if xc > EXP_HI { EXP_HI } else { xc };
    let (r, n) = reduce(xc);
    // n ∈ [-150, 128]: scaled in two halves.
    let e = scale_pow2(exp_poly(r), n);
    if x < EXP_LO { 0.0 } else { e }
}

/// `e^x` for the softmax, where `x = logit − max ≤ 0` (or `-inf` for a
/// hidden pair): [`exp`]'s reduction, a degree-5 polynomial instead of
/// degree 7, and none of its overflow and gradual-underflow handling.
/// Within 2.5 ulp of `e^x` for `SOFTMAX_FLUSH ≤ x ≤ 0` (a test checks
/// this), exactly `1.0` at `0` (the row's maximum), exactly `0.0` below
/// [`SOFTMAX_FLUSH`] and for `x = -inf`. About half of [`exp`]'s
/// instructions: the softmax's one transcendental per score.
#[inline(always)]
pub fn exp_softmax(x: f32) -> f32 {
    const LO: f32 = SOFTMAX_FLUSH;
    // Clamped from below so that `n ≥ -64` and `2^n` is one normal power of
    // two; the result there is replaced by 0 at the end.
    let xc = if x < LO { LO } else { x };
    let (r, n) = reduce(xc);
    let e = exp_poly_softmax(r) * f32::from_bits(((n + 127) as u32) << 23);
    if x < LO { 0.0 } else { e }
}

/// `(r, n)` with `e^x = e^r · 2^n`, `n = round(x·log2 e)` and
/// `|r| ≤ ln2/2`, for a finite, clamped `x` (Cody–Waite reduction with
/// fused steps, one rounding each). The rounding uses the `1.5·2^23` trick
/// instead of `floor`, which on baseline x86-64 (no SSE4.1) would be
/// another libm call.
#[inline(always)]
#[allow(clippy::excessive_precision)]
fn reduce(x: f32) -> (f32, i32) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln2 split so that `n * LN2_HI` is exact (LN2_HI has 9 significant bits).
    const LN2_HI: f32 = 0.693_359_375;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5·2^23 rounds to the nearest integer and leaves it in the low
    // mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let t = x.mul_add(LOG2E, ROUND);
    let n = t - ROUND;
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let n = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    (r, n)
}

/// `y · 2^n` for `n ∈ [-150, 128]`: `2^n` split into two halves in
/// `[-75, 64]`, each a normal power of two, so the only rounding is the
/// final multiply (subnormal results and `n = 128` without branches).
#[inline(always)]
fn scale_pow2(y: f32, n: i32) -> f32 {
    let n1 = n >> 1;
    let n2 = n - n1;
    let p1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let p2 = f32::from_bits(((n2 + 127) as u32) << 23);
    y * p1 * p2
}

/// `2^x` in f32, branch-free: `x = n + r` with `n = round(x)`, `|r| ≤ 1/2`,
/// `2^r = e^(r·ln2)` by the [`exp`] polynomial, `2^n` from exponent bits in
/// two halves (as in [`exp`]). Within 2 ulp for normal results; `0` below
/// `-151` (and for `-inf`), `+inf` from `128` up, NaN only for NaN.
#[inline(always)]
pub fn exp2(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0;
    const LO: f32 = -151.0;
    const HI: f32 = 129.0;
    let xc = if x < LO { LO } else { x };
    let xc = if xc > HI { HI } else { xc };
    let t = xc + ROUND;
    let n = t - ROUND;
    let r = (xc - n) * std::f32::consts::LN_2;
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let e = scale_pow2(exp_poly(r), ni);
    if x < LO { 0.0 } else { e }
}

/// `e^r` for `|r| ≤ ln2/2` with a degree-5 polynomial `1 + r·q(r)`: five
/// FMAs against [`exp_poly`]'s eight operations. `q` was fitted to
/// `(e^r − 1)/r` minimising the relative error of the result (at most
/// 9.2e-8 in exact arithmetic, under one ulp); with the roundings the
/// measured worst case is 2.0 ulp. The constant term makes `e^0` exactly 1.
#[inline(always)]
#[allow(clippy::excessive_precision)]
fn exp_poly_softmax(r: f32) -> f32 {
    const Q: [f32; 5] = [
        8.290_221_914_649e-3,
        4.189_794_510_603e-2,
        1.666_763_722_896_6e-1,
        4.999_915_063_381_2e-1,
        9.999_997_019_767_8e-1,
    ];
    horner(&Q, r).mul_add(r, 1.0)
}

/// `c[0]·r^(n−1) + … + c[n−1]` by Horner's rule, one FMA a step.
#[inline(always)]
fn horner<const N: usize>(c: &[f32; N], r: f32) -> f32 {
    c[1..].iter().fold(c[0], |y, &k| y.mul_add(r, k))
}

/// `e^r` for `|r| ≤ ln2/2` (the Cephes `expf` polynomial shared with [`exp`]).
#[inline(always)]
#[allow(clippy::excessive_precision)]
fn exp_poly(r: f32) -> f32 {
    const P: [f32; 6] = [
        1.987_569_150_0e-4,
        1.398_199_950_7e-3,
        8.333_451_907_3e-3,
        4.166_579_589_4e-2,
        1.666_666_545_9e-1,
        5.000_000_120_1e-1,
    ];
    horner(&P, r).mul_add(r * r, r) + 1.0
}

/// `tanh(x)` in f32, branch-free, from one `expm1`: with
/// `u = e^(−2|x|) − 1 ∈ (−1, 0]`, `tanh|x| = −u / (2 + u)`, the sign
/// copied from `x`. Within 2.5 ulp; `tanh(±0) = ±0`, exactly `±1` from
/// `|x| ≈ 9` on (and for `±inf`); NaN only for NaN.
///
/// `expm1` keeps the relative precision near 0 that `(1 − t)/(1 + t)`
/// with `t = e^(−2|x|)` loses, so no second, polynomial branch for small
/// `|x|` is needed: about 22 vector operations and one division against
/// 34 operations for both branches (the softcap score's whole cost).
#[inline(always)]
#[allow(clippy::excessive_precision)]
pub fn tanh(x: f32) -> f32 {
    // Past 10, `u + 1 < 2^-28` and the quotient rounds to 1; the clamp
    // keeps `2^n` a normal power of two. A comparison, so NaN passes.
    let a = f32::from_bits(x.to_bits() & 0x7fff_ffff);
    let a = if a > 10.0 { 10.0 } else { a };
    let (r, n) = reduce(-2.0 * a);
    // `e^r − 1` for `|r| ≤ ln2/2`: `r + r²·q(r)`, `q` fitted to
    // `(e^r − 1 − r)/r²` for the relative error of the result (1.3e-8).
    let mut q = 1.388_248_172_588_646_4e-3f32;
    q = q.mul_add(r, 8.366_514_928_638_935e-3);
    q = q.mul_add(r, 4.166_720_062_494_278e-2);
    q = q.mul_add(r, 1.666_654_348_373_413e-1);
    q = q.mul_add(r, 4.999_999_701_976_776e-1);
    let em1 = (r * r).mul_add(q, r);
    // `e^y − 1 = 2^n·(e^r − 1) + (2^n − 1)`, with `n ∈ [−29, 0]`: `2^n − 1`
    // is exact and at `n = 0` (|x| < 0.18) this is `e^r − 1` itself.
    let p = f32::from_bits(((n + 127) as u32) << 23);
    let u = p.mul_add(em1, p - 1.0);
    let t = u / (2.0 + u);
    // `t ≤ 0`: its magnitude, with the sign of `x`.
    f32::from_bits((t.to_bits() & 0x7fff_ffff) | (x.to_bits() & 0x8000_0000))
}

/// The logistic function `1/(1 + e^−x)` in f32, branch-free, via
/// `t = e^(−|x|)`: `1/(1 + t)` for `x ≥ 0`, `t/(1 + t)` below (so very
/// negative `x` gives the small, possibly subnormal, result rather than an
/// overflow). Within a few ulp; `0` at `-inf`, `1` at `+inf`, NaN only for NaN.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    let a = f32::from_bits(x.to_bits() & 0x7fff_ffff);
    let t = exp(-a);
    let num = if x < 0.0 { t } else { 1.0 };
    num / (1.0 + t)
}

/// `xs[i] = sigmoid(xs[i])` in place (`-inf`, a hidden pair, becomes 0).
#[inline(always)]
pub fn sigmoid_in_place(xs: &mut [f32]) {
    for x in xs {
        *x = sigmoid(*x);
    }
}

/// `(m − 1, e)` with `x = m·2^e`, `m ∈ [√½, √2)`, for positive finite `x`
/// (subnormals are scaled up first; other inputs give garbage that
/// [`log_special`] replaces).
#[inline(always)]
fn log_reduce(x: f32) -> (f32, f32) {
    const TWO23: f32 = 8_388_608.0;
    let sub = x < f32::MIN_POSITIVE;
    let xs = if sub { x * TWO23 } else { x };
    let bits = xs.to_bits() as i32;
    let mut e = ((bits >> 23) & 0xff) - 126;
    if sub {
        e -= 23;
    }
    // Mantissa in [0.5, 1).
    let m = f32::from_bits(((bits & 0x007f_ffff) | 0x3f00_0000) as u32);
    let low = m < std::f32::consts::FRAC_1_SQRT_2;
    let e = if low { e - 1 } else { e };
    let f = if low { m + m - 1.0 } else { m - 1.0 };
    (f, e as f32)
}

/// The Cephes `logf` polynomial: `ln(1 + f) − f + f²/2` for `f ∈ [√½−1, √2−1)`.
#[inline(always)]
#[allow(clippy::excessive_precision)]
fn log_poly(f: f32) -> f32 {
    let z = f * f;
    let mut y = 7.037_683_629_2e-2f32;
    y = y * f - 1.151_461_031_0e-1;
    y = y * f + 1.167_699_874_0e-1;
    y = y * f - 1.242_014_084_6e-1;
    y = y * f + 1.424_932_278_7e-1;
    y = y * f - 1.666_805_766_5e-1;
    y = y * f + 2.000_071_476_5e-1;
    y = y * f - 2.499_999_399_3e-1;
    y = y * f + 3.333_333_117_4e-1;
    y * f * z - 0.5 * z
}

/// The IEEE results of `log`/`log2` outside the positive finite numbers.
#[inline(always)]
fn log_special(x: f32, r: f32) -> f32 {
    let r = if x == f32::INFINITY { f32::INFINITY } else { r };
    let r = if x == 0.0 { f32::NEG_INFINITY } else { r };
    // Negative and NaN inputs: NaN.
    if x >= 0.0 { r } else { f32::NAN }
}

/// Natural logarithm in f32, branch-free (Cephes `logf`: frexp-style range
/// reduction and a degree-9 polynomial). Within 2 ulp; subnormals exact in
/// the reduction; `±0 → -inf`, negative `→ NaN`, `+inf → +inf`, NaN → NaN.
#[inline(always)]
#[allow(clippy::excessive_precision)] // exact split of ln 2, as in `exp`
pub fn log(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_375;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let (f, e) = log_reduce(x);
    let y = log_poly(f) + e * LN2_LO;
    let r = f + y + e * LN2_HI;
    log_special(x, r)
}

/// Base-2 logarithm in f32, branch-free (as [`log`], with the `log2 e`
/// multiply split so the exponent is added exactly). Within 2 ulp; special
/// values as [`log`].
#[inline(always)]
#[allow(clippy::excessive_precision)]
pub fn log2(x: f32) -> f32 {
    // log2(e) − 1.
    const LOG2EA: f32 = 0.442_695_040_888_963_407_36;
    let (f, e) = log_reduce(x);
    let y = log_poly(f);
    let r = y * LOG2EA + f * LOG2EA + y + f + e;
    log_special(x, r)
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

/// `xs[i] = e^(xs[i] - shift)` in place by [`exp_softmax`]; returns the sum
/// of the new values.
///
/// `shift` must be finite (the caller handles rows whose maximum is `-inf`)
/// and at least the largest element up to rounding (a row max or a
/// log-sum-exp), so that every argument is `≤ 0`; `-inf` elements (masked
/// pairs) become exactly `0`, as does anything below `e^SOFTMAX_FLUSH`.
#[inline(always)]
pub fn exp_sub_sum(xs: &mut [f32], shift: f32) -> f32 {
    sum_lanes(&exp_sub_lanes(xs, (1.0, shift), [0.0; LANES]))
}

/// [`exp_sub_sum`] without the final reduction: returns the lane sums
/// `sums` plus the new values (element `j` of `xs` into lane `j % LANES`),
/// so that a running softmax denominator can stay in lanes across key tiles
/// and be reduced once per row ([`sum_lanes`]) instead of once per tile.
/// Each element is first multiplied by `scale` (rounded, then `shift`
/// subtracted: the bits of a row scaled beforehand). Same preconditions as
/// [`exp_sub_sum`], for the scaled elements. (The sums go in and out by value
/// so that they stay in one register across the row: through a reference,
/// LLVM kept them on the stack once the row started at an offset known
/// only at run time.)
#[inline(always)]
pub fn exp_sub_lanes(xs: &mut [f32], (scale, shift): (f32, f32), mut sums: Lanes) -> Lanes {
    let (chunks, tail) = xs.as_chunks_mut::<LANES>();
    for c in chunks {
        // Whole values, not `sums[k] += e`: the sums then stay in a
        // register instead of a stack slot each vector loads and stores.
        let e: Lanes = std::array::from_fn(|k| exp_softmax(c[k] * scale - shift));
        *c = e;
        sums = std::array::from_fn(|k| sums[k] + e[k]);
    }
    for (a, x) in sums.iter_mut().zip(tail) {
        let e = exp_softmax(*x * scale - shift);
        *x = e;
        *a += e;
    }
    sums
}

/// `x` rounded to bf16 bits, to nearest, ties to even (for the finite
/// values the bf16 kernels round: probabilities, `dS`).
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// `dst[i] = bf16_bits(src[i])` for the finite values the bf16 kernels
/// round (`dst.len() == src.len()`): by AVX512-BF16's `vcvtne2ps2bf16`,
/// two vectors an instruction, where the CPU has it (the same bits: it
/// rounds to nearest even, and the kernels' values are never subnormal).
#[inline]
pub fn round_bf16(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len(), "one bf16 per f32");
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::bf16_dot::present() {
        // SAFETY: AVX512-BF16 (and F) present; equal lengths.
        unsafe { crate::cpu::bf16_dot::round(src, dst) };
        return;
    }
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = bf16_bits(x);
    }
}

/// `xs[i] = e^(scale · xs[i] − shift)` in place (the product rounded first,
/// as in [`exp_sub_lanes`]), `shift` finite (see [`exp_sub_sum`]).
#[inline(always)]
pub fn exp_sub(xs: &mut [f32], (scale, shift): (f32, f32)) {
    for x in xs {
        *x = exp_softmax(*x * scale - shift);
    }
}

/// `xs[i] *= a`.
#[inline(always)]
pub fn scale(xs: &mut [f32], a: f32) {
    for x in xs {
        *x *= a;
    }
}

/// `dst[i] += a · src[i]`.
#[inline(always)]
pub fn axpy(dst: &mut [f32], a: f32, src: &[f32]) {
    for (x, &y) in dst.iter_mut().zip(src) {
        *x += a * y;
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
pub fn sum_lanes(acc: &Lanes) -> f32 {
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
    fn exp_softmax_is_within_two_and_a_half_ulp_below_zero() {
        worst_ulps(
            "exp_softmax",
            sweep(SOFTMAX_FLUSH as f64, 0.0, 2_000_000),
            exp_softmax,
            f64::exp,
            2.5,
        );
        // Every 7th float in [-1, 0), where most softmax arguments fall.
        let near = (0x8000_0001..=(-1.0f32).to_bits())
            .step_by(7)
            .map(f32::from_bits);
        worst_ulps("exp_softmax [-1, 0)", near, exp_softmax, f64::exp, 2.5);
        assert_eq!(exp_softmax(0.0), 1.0);
        assert_eq!(exp_softmax(-0.0), 1.0);
        let below = f32::from_bits(SOFTMAX_FLUSH.to_bits() + 1);
        assert!(exp_softmax(SOFTMAX_FLUSH) > f32::from_bits(0x1f00_0000)); // 2^-65
        for x in [below, -44.5, -87.4, -88.0, -1e4, f32::NEG_INFINITY] {
            assert_eq!(exp_softmax(x).to_bits(), 0, "exp_softmax({x})");
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

    /// Worst ulp error of `f` against the f64 reference `g` over `xs`;
    /// panics (naming the input) past `bound`.
    fn worst_ulps(
        name: &str,
        xs: impl Iterator<Item = f32>,
        f: impl Fn(f32) -> f32,
        g: impl Fn(f64) -> f64,
        bound: f64,
    ) -> f64 {
        let mut worst = (0.0f64, 0.0f32);
        for x in xs {
            let (got, want) = (f(x), g(x as f64));
            let e = ulps(got, want);
            assert!(
                e <= bound,
                "{name}({x:e}) = {got:e}, want {want:e}: {e:.2} ulp (bound {bound})"
            );
            if e > worst.0 {
                worst = (e, x);
            }
        }
        eprintln!("{name}: max {:.3} ulp at {:e}", worst.0, worst.1);
        worst.0
    }

    /// `n + 1` points evenly spaced over `[lo, hi]`.
    fn sweep(lo: f64, hi: f64, n: usize) -> impl Iterator<Item = f32> {
        (0..=n).map(move |i| (lo + (hi - lo) * i as f64 / n as f64) as f32)
    }

    /// Every `step`-th positive finite f32 (subnormals included), both signs.
    fn all_floats(step: u32) -> impl Iterator<Item = f32> {
        (1..0x7f80_0000u32)
            .step_by(step as usize)
            .flat_map(|b| [f32::from_bits(b), -f32::from_bits(b)])
    }

    fn sigmoid64(x: f64) -> f64 {
        1.0 / (1.0 + (-x).exp())
    }

    #[test]
    fn exp2_is_within_two_ulp() {
        let w = worst_ulps(
            "exp2",
            sweep(-126.0, 127.99, 2_000_000),
            exp2,
            f64::exp2,
            2.0,
        );
        assert!(w <= 2.0);
        // Subnormal results: one extra unit.
        worst_ulps(
            "exp2 (subnormal)",
            sweep(-149.5, -126.0, 100_000),
            exp2,
            f64::exp2,
            3.0,
        );
        for n in -149..=127 {
            assert_eq!(exp2(n as f32), (n as f64).exp2() as f32, "exp2({n})");
        }
        assert_eq!(exp2(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2(-151.5), 0.0);
        assert_eq!(exp2(-1e30), 0.0);
        assert_eq!(exp2(128.0), f32::INFINITY);
        assert_eq!(exp2(1e30), f32::INFINITY);
        assert_eq!(exp2(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp2(0.0), 1.0);
        assert_eq!(exp2(-0.0), 1.0);
        assert!(exp2(f32::NAN).is_nan());
    }

    #[test]
    fn tanh_is_within_a_few_ulp() {
        worst_ulps("tanh", sweep(-12.0, 12.0, 2_000_000), tanh, f64::tanh, 2.5);
        // Every 1009th float of both signs: tiny, subnormal, huge.
        worst_ulps("tanh (all)", all_floats(1009), tanh, f64::tanh, 2.5);
        assert_eq!(tanh(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
        for x in [9.1f32, 20.0, 1e10, f32::MAX, f32::INFINITY] {
            assert_eq!(tanh(x), 1.0, "tanh({x})");
            assert_eq!(tanh(-x), -1.0, "tanh(-{x})");
        }
        assert!(tanh(f32::NAN).is_nan());
        let tiny = f32::from_bits(1);
        assert_eq!(tanh(tiny), tiny);
    }

    #[test]
    fn sigmoid_is_within_a_few_ulp() {
        worst_ulps(
            "sigmoid",
            sweep(-87.0, 30.0, 2_000_000),
            sigmoid,
            sigmoid64,
            3.0,
        );
        worst_ulps("sigmoid (all)", all_floats(1009), sigmoid, sigmoid64, 4.0);
        assert_eq!(sigmoid(0.0), 0.5);
        assert_eq!(sigmoid(-0.0), 0.5);
        assert_eq!(sigmoid(f32::INFINITY), 1.0);
        assert_eq!(sigmoid(f32::NEG_INFINITY), 0.0);
        assert_eq!(sigmoid(1e30), 1.0);
        assert_eq!(sigmoid(-1e30), 0.0);
        assert_eq!(sigmoid(-200.0), 0.0);
        assert!(sigmoid(-95.0) > 0.0); // subnormal, not flushed
        assert!(sigmoid(f32::NAN).is_nan());
    }

    #[test]
    fn log_and_log2_are_within_two_ulp() {
        let pos = || (1..0x7f80_0000u32).step_by(211).map(f32::from_bits);
        worst_ulps("log", pos(), log, f64::ln, 2.0);
        worst_ulps("log2", pos(), log2, f64::log2, 2.0);
        // Dense around 1, where the result is small.
        worst_ulps("log near 1", sweep(0.5, 2.0, 2_000_000), log, f64::ln, 2.0);
        worst_ulps(
            "log2 near 1",
            sweep(0.5, 2.0, 2_000_000),
            log2,
            f64::log2,
            2.0,
        );
        for n in -149..=127 {
            assert_eq!(log2((n as f64).exp2() as f32), n as f32, "log2(2^{n})");
        }
        for f in [log, log2] {
            assert_eq!(f(1.0).to_bits(), 0.0f32.to_bits());
            assert_eq!(f(0.0), f32::NEG_INFINITY);
            assert_eq!(f(-0.0), f32::NEG_INFINITY);
            assert_eq!(f(f32::INFINITY), f32::INFINITY);
            assert!(f(-1.0).is_nan());
            assert!(f(-1e-40).is_nan());
            assert!(f(f32::NEG_INFINITY).is_nan());
            assert!(f(f32::NAN).is_nan());
            assert!(f(f32::MAX).is_finite());
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
