//! Runtime instruction-set dispatch for the elementwise passes.
//!
//! The crate is compiled for baseline x86-64 (SSE2, 4 f32 lanes), while the
//! machines it runs on usually have AVX2 (8 lanes) or AVX-512 (16 lanes). The
//! GEMMs already dispatch at runtime inside `gemm`; this module does the same
//! for the softmax between them, which is otherwise a third of the forward's
//! time. A pass is written once as an [`Elementwise`] whose `run` is
//! `#[inline(always)]`; [`dispatch`] calls it through a wrapper compiled with
//! the best target features the CPU has, so the same source (including the
//! variant's inlined `score`/`mask`) is vectorized at that width.
//!
//! Guarantees: results are the same on every path up to the width of the
//! lanes used for sums, which is fixed by the source (see `math::LANES`), not
//! by the instruction set — so the kernels give the same bits whichever path
//! runs. (No FMA contraction happens: Rust never fuses `a * b + c`.)

/// An elementwise pass over a tile, run by [`dispatch`].
pub(in crate::cpu) trait Elementwise {
    /// What the pass returns (most write their results in place: `()`).
    type Output;
    /// The pass. Implementations must be `#[inline(always)]`, and so must
    /// the helpers they call, so that the body is compiled inside the
    /// target-feature wrappers below rather than called from them.
    fn run(self) -> Self::Output;
}

/// The instruction sets [`dispatch`] chooses from, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(in crate::cpu) enum Level {
    /// Whatever the crate was compiled for (SSE2 on baseline x86-64).
    /// Named only by tests, which cap the level to run every path.
    #[cfg_attr(not(test), allow(dead_code))]
    Baseline,
    Avx2,
    Avx512,
    /// AVX-512 and AVX512-BF16's `vdpbf16ps` for the bf16 kernels, where it
    /// pays (see `bf16_dot::pays`); capped here in tests, wherever present.
    #[cfg_attr(not(test), allow(dead_code))]
    Bf16Dot,
    /// AVX-512 and AMX tiles (bf16 tile products, see `amx`).
    Amx,
}

/// Run `pass` with the widest vector instructions this CPU supports.
#[inline]
pub(in crate::cpu) fn dispatch<E: Elementwise>(pass: E) -> E::Output {
    #[cfg(target_arch = "x86_64")]
    {
        let cap = level_cap();
        // `is_x86_feature_detected!` caches its answer: a load and a test.
        if avx512() {
            // SAFETY: `run_avx512` only requires the CPU to support AVX-512F,
            // which was just checked.
            return unsafe { run_avx512(pass) };
        }
        if cap >= Level::Avx2
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: `run_avx2` only requires AVX2 and FMA, just checked.
            return unsafe { run_avx2(pass) };
        }
    }
    pass.run()
}

/// Whether the AVX-512 code paths may run: the CPU has AVX-512F, BW and
/// VL (every AVX-512 CPU but the Xeon Phi), and tests have not capped the
/// level below it. The tile products use this too, so that capping the
/// level also exercises the `gemm` crate fallback.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(in crate::cpu) fn avx512() -> bool {
    level_cap() >= Level::Avx512
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

/// Whether the AMX paths may run, as far as tests are concerned (the CPU
/// is asked in `amx::available`).
#[inline]
pub(in crate::cpu) fn amx_allowed() -> bool {
    level_cap() >= Level::Amx
}

/// Whether the bf16 kernels may run on `vdpbf16ps` (see [`Level::Bf16Dot`]).
#[inline]
pub(in crate::cpu) fn bf16_dot_allowed() -> bool {
    level_cap() >= Level::Bf16Dot
}

/// Whether AVX512-VNNI's 16-bit dot products (`vpdpwssd`) may run: the
/// CPU has them (every AVX512-BF16 CPU does) and tests have not capped the
/// level below [`Level::Bf16Dot`].
#[cfg(target_arch = "x86_64")]
#[inline]
pub(in crate::cpu) fn vnni() -> bool {
    level_cap() >= Level::Bf16Dot && avx512() && std::arch::is_x86_feature_detected!("avx512vnni")
}

/// Whether a test capped the level at [`Level::Bf16Dot`]: the bf16 kernels
/// then run on `vdpbf16ps` wherever it is present, so that its path is
/// tested on CPUs where it does not pay.
#[inline]
pub(in crate::cpu) fn bf16_dot_forced() -> bool {
    cfg!(test) && level_cap() == Level::Bf16Dot
}

#[cfg(not(test))]
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn level_cap() -> Level {
    Level::Amx
}

#[cfg(test)]
thread_local! {
    /// Tests lower this on a pool's threads to run every path.
    pub(in crate::cpu) static LEVEL_CAP: std::cell::Cell<Level> = const { std::cell::Cell::new(Level::Amx) };
}

#[cfg(test)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn level_cap() -> Level {
    LEVEL_CAP.with(std::cell::Cell::get)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
fn run_avx512<E: Elementwise>(pass: E) -> E::Output {
    pass.run()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn run_avx2<E: Elementwise>(pass: E) -> E::Output {
    pass.run()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::math;

    struct ExpSum<'a>(&'a mut [f32], &'a mut f32);

    impl Elementwise for ExpSum<'_> {
        type Output = ();

        #[inline(always)]
        fn run(self) {
            *self.1 = math::exp_sub_sum(self.0, 1.0);
        }
    }

    #[test]
    fn every_path_gives_the_same_bits() {
        let xs: Vec<f32> = (0..301).map(|i| (i as f32 * 0.37).sin() * 30.0).collect();
        let (mut a, mut b) = (xs.clone(), xs.clone());
        let (mut sa, mut sb) = (0.0, 0.0);
        dispatch(ExpSum(&mut a, &mut sa));
        ExpSum(&mut b, &mut sb).run();
        assert_eq!(sa.to_bits(), sb.to_bits());
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
}
