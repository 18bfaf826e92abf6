//! Seeds and random inputs for the checks.
//!
//! A tiny SplitMix64 generator rather than `rand`: its stream is fixed by this
//! file, so a seed printed in a failure reproduces the same inputs on every
//! version of every dependency.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Environment variable that fixes the seed of [`check_variant`] and
/// [`check_reference_gradients`] (decimal or `0x`-prefixed hex).
///
/// [`check_variant`]: super::check_variant
/// [`check_reference_gradients`]: super::check_reference_gradients
pub const SEED_ENV: &str = "BOOSTR_TEST_SEED";

/// The seed of one check: `BOOSTR_TEST_SEED` when set, otherwise fresh from the
/// clock (and a per-process counter, so checks started in the same nanosecond
/// still differ).
///
/// # Panics
///
/// When `BOOSTR_TEST_SEED` is set but is not a `u64`.
pub fn choose_seed() -> u64 {
    if let Ok(text) = std::env::var(SEED_ENV) {
        return parse_seed(&text).unwrap_or_else(|| {
            panic!("{SEED_ENV}={text:?} is not a u64 (decimal, or hex with a 0x prefix)")
        });
    }
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    // Mixed so that consecutive seeds are not consecutive numbers; the printed
    // seed is what reproduces the run, whatever its value.
    splitmix64(&mut (nanos ^ count.rotate_left(32))) >> 1
}

fn parse_seed(text: &str) -> Option<u64> {
    let text = text.trim();
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64 with Box–Muller normals.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// The generator of stream `stream` (e.g. a case's index) under `seed`.
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut state = seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03);
        // Decorrelate nearby (seed, stream) pairs.
        splitmix64(&mut state);
        Self { state }
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        splitmix64(&mut self.state)
    }

    /// Uniform in `(0, 1]`.
    fn uniform_open0(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `(0, 1]`, public to the kit.
    pub fn uniform(&mut self) -> f64 {
        self.uniform_open0()
    }

    /// Standard normal (Box–Muller, one value per call).
    pub(crate) fn normal(&mut self) -> f64 {
        let u1 = self.uniform_open0();
        let u2 = self.uniform_open0();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// `len` normals with standard deviation `std`, rounded to f32.
    pub fn normal_f32(&mut self, len: usize, std: f32) -> Vec<f32> {
        (0..len)
            .map(|_| (self.normal() * f64::from(std)) as f32)
            .collect()
    }

    /// `len` normals with standard deviation `std`, in f64.
    pub(crate) fn normal_f64(&mut self, len: usize, std: f64) -> Vec<f64> {
        (0..len).map(|_| self.normal() * std).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_parse_in_decimal_and_hex() {
        assert_eq!(parse_seed("42"), Some(42));
        assert_eq!(parse_seed(" 0x2a "), Some(42));
        assert_eq!(parse_seed("nope"), None);
    }

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<f64> = (0..4).map(|_| Rng::new(7, 1).normal()).collect();
        let mut r = Rng::new(7, 1);
        let b: Vec<f64> = (0..4).map(|_| r.normal()).collect();
        assert_eq!(a[0], b[0]);
        assert_ne!(Rng::new(7, 1).normal(), Rng::new(7, 2).normal());
        let mut r = Rng::new(3, 0);
        let xs: Vec<f64> = (0..20_000).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / xs.len() as f64;
        assert!(
            mean.abs() < 0.05 && (var - 1.0).abs() < 0.05,
            "mean {mean} var {var}"
        );
    }
}
