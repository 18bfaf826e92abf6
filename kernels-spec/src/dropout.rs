//! Attention dropout: which pairs a call drops, the same bits on every
//! target.
//!
//! A variant declared with `dropout = p` keeps each visible (query, key)
//! pair of a call with probability `1 − p` and scales what it keeps by
//! `1/(1 − p)`, after normalisation: `out = Σ_kv P · Z / (1 − p) · v`, with
//! `Z ∈ {0, 1}` the pair's draw. Nothing is stored between the forward and
//! the backward: both draw `Z` again from the same counter.
//!
//! # The draw
//!
//! Philox 4×32-10 (Salmon et al., SC 2011; the Random123 definition, as
//! `curand` and PyTorch use it) maps a 128-bit counter and a 64-bit key to
//! 128 random bits. The pair `(b, h, q, kv)` of a call with seed `seed`
//! and offset `offset` draws
//!
//! ```text
//! counter = [kv >> 2, q, (b << 16) | h, offset]     (as u32, wrapping)
//! key     = [seed as u32, (seed >> 32) as u32]
//! r       = philox4x32_10(counter, key)[kv & 3]
//! Z       = r >= threshold(p)
//! ```
//!
//! so four consecutive keys share one evaluation. `q` and `kv` are the
//! positions the variant sees (bottom-right aligned), `b < 2^16` and
//! `h < 2^16` (the runtimes check). `threshold(p) = round(p · 2^32)`:
//! a pair is kept with probability `1 − threshold/2^32`, within `2^-33` of
//! `1 − p`. The offset separates the calls of one seed (a training step's
//! layers, say).
//!
//! On the GPU the call's state travels in the last [`DROPOUT_WORDS`] words
//! of the parameter block's fields ([`Word`]); the CPU kernels and the test kit's
//! reference implement the same draw independently.

pub use crate::params::DROPOUT_WORDS;

/// Philox's first round multiplier.
pub const M0: u32 = 0xD251_1F53;
/// Philox's second round multiplier.
pub const M1: u32 = 0xCD9E_8D57;
/// The Weyl increment of the key's first word, added after each round.
pub const W0: u32 = 0x9E37_79B9;
/// The Weyl increment of the key's second word.
pub const W1: u32 = 0xBB67_AE85;
/// Rounds.
pub const ROUNDS: usize = 10;

/// The call's state in the parameter block: word `FIELD_WORDS −
/// DROPOUT_WORDS + w as usize` (just before the call's window).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Word {
    /// `threshold(p)`: a pair whose draw is below it is dropped.
    Threshold = 0,
    /// `1/(1 − p)` (f32 bits): what a kept pair's weight is multiplied by.
    Scale = 1,
    /// The seed's low 32 bits.
    SeedLo = 2,
    /// The seed's high 32 bits.
    SeedHi = 3,
    /// The call's offset.
    Offset = 4,
}

impl Word {
    /// Every word, in block order.
    pub const ALL: [Word; DROPOUT_WORDS] = [
        Word::Threshold,
        Word::Scale,
        Word::SeedLo,
        Word::SeedHi,
        Word::Offset,
    ];

    /// The member's name in the kernels' `Params` struct.
    pub const fn member(self) -> &'static str {
        match self {
            Word::Threshold => "drop_threshold",
            Word::Scale => "drop_scale",
            Word::SeedLo => "drop_seed_lo",
            Word::SeedHi => "drop_seed_hi",
            Word::Offset => "drop_offset",
        }
    }

    /// Its index in the block.
    pub const fn index(self) -> usize {
        crate::params::FIELD_WORDS - DROPOUT_WORDS + self as usize
    }
}

/// `round(p · 2^32)`, for `p ∈ [0, 1)`: a draw below it drops its pair.
/// `None` for a `p` outside `[0, 1)` (NaN included).
pub fn threshold(p: f32) -> Option<u32> {
    if !(0.0..1.0).contains(&p) {
        return None;
    }
    let t = (f64::from(p) * 4_294_967_296.0).round();
    // `p < 1` as an f32 is at most `1 − 2^-24`: `t < 2^32`.
    Some(t as u32)
}

/// What a kept pair's weight is multiplied by: `1/(1 − p)`, in f32.
pub fn keep_scale(p: f32) -> f32 {
    (1.0 / (1.0 - f64::from(p))) as f32
}

/// The per-call state of a dropout variant: the words the GPU kernels read
/// at [`Word`]'s places.
pub fn words(p: f32, seed: u64, offset: u32) -> Option<[u32; DROPOUT_WORDS]> {
    Some([
        threshold(p)?,
        keep_scale(p).to_bits(),
        seed as u32,
        (seed >> 32) as u32,
        offset,
    ])
}

/// The draw in CUDA C: `bx_philox(counter, key)` and
/// `variant_dropout(params, b, h, q, kv)`, which returns the pair's weight
/// factor (`0` or `1/(1 − p)`; 1 for a call with `p = 0`). Without
/// `dropout`, a `variant_dropout` that returns 1, which the kernels call
/// all the same (the compiler folds the product away).
pub fn cuda_helpers(dropout: bool) -> String {
    if !dropout {
        return "__device__ __forceinline__ float variant_dropout(const Params& params, int b, int h, int q, int kv) {\n    \
                (void)params; (void)b; (void)h; (void)q; (void)kv;\n    return 1.0f;\n}\n"
            .to_string();
    }
    let mut rounds = String::new();
    for _ in 0..ROUNDS {
        rounds.push_str(&format!(
            "    {{ const unsigned lo0 = 0x{M0:08X}u * c.x, hi0 = __umulhi(0x{M0:08X}u, c.x);\n      \
             const unsigned lo1 = 0x{M1:08X}u * c.z, hi1 = __umulhi(0x{M1:08X}u, c.z);\n      \
             c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);\n      \
             k.x += 0x{W0:08X}u; k.y += 0x{W1:08X}u; }}\n"
        ));
    }
    format!(
        "\n// ---- dropout: Philox 4x32-10 keyed by (seed, b, h, q, kv) ----\n\
         __device__ __forceinline__ uint4 bx_philox(uint4 c, uint2 k) {{\n{rounds}    return c;\n}}\n\
         __device__ __forceinline__ float variant_dropout(const Params& params, int b, int h, int q, int kv) {{\n    \
         if (params.{t} == 0u) return 1.0f;\n    \
         const unsigned qg = (unsigned)(q + params.{wq}), kg = (unsigned)(kv + params.{wkv}); // the window's positions\n    \
         const uint4 r = bx_philox(make_uint4(kg >> 2, qg, ((unsigned)b << 16) | (unsigned)h, params.{off}),\n                              \
         make_uint2(params.{lo}, params.{hi}));\n    \
         const unsigned j = kg & 3u;\n    \
         const unsigned w = j == 0u ? r.x : j == 1u ? r.y : j == 2u ? r.z : r.w;\n    \
         return w >= params.{t} ? __int_as_float((int)params.{s}) : 0.0f;\n}}\n",
        off = Word::Offset.member(),
        lo = Word::SeedLo.member(),
        hi = Word::SeedHi.member(),
        t = Word::Threshold.member(),
        s = Word::Scale.member(),
        wq = crate::params::WindowWord::Q.member(),
        wkv = crate::params::WindowWord::Kv.member(),
    )
}

/// The draw in WGSL: `bx_mulhi`, `bx_philox(counter, key)` and
/// `variant_dropout(b, h, q, kv)`, as [`cuda_helpers`]. The rounds are
/// written out: a loop's iterations count against a software adapter's
/// per-invocation budget.
pub fn wgsl_helpers(dropout: bool) -> String {
    if !dropout {
        return "fn variant_dropout(b: i32, h: i32, q: i32, kv: i32) -> f32 {\n    return 1.0;\n}\n"
            .to_string();
    }
    let mut rounds = String::new();
    for _ in 0..ROUNDS {
        rounds.push_str(&format!(
            "    {{ let hi0 = bx_mulhi(0x{M0:08X}u, c.x); let lo0 = 0x{M0:08X}u * c.x;\n      \
             let hi1 = bx_mulhi(0x{M1:08X}u, c.z); let lo1 = 0x{M1:08X}u * c.z;\n      \
             c = vec4<u32>(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);\n      \
             k = k + vec2<u32>(0x{W0:08X}u, 0x{W1:08X}u); }}\n"
        ));
    }
    format!(
        "\n// ---- dropout: Philox 4x32-10 keyed by (seed, b, h, q, kv) ----\n\
         fn bx_mulhi(a: u32, b: u32) -> u32 {{\n    \
         let al = a & 0xffffu; let ah = a >> 16u; let bl = b & 0xffffu; let bh = b >> 16u;\n    \
         let t = ah * bl + ((al * bl) >> 16u);\n    \
         let u = al * bh + (t & 0xffffu);\n    \
         return ah * bh + (t >> 16u) + (u >> 16u);\n}}\n\
         fn bx_philox(c0: vec4<u32>, k0: vec2<u32>) -> vec4<u32> {{\n    \
         var c = c0;\n    var k = k0;\n{rounds}    return c;\n}}\n\
         fn variant_dropout(b: i32, h: i32, q: i32, kv: i32) -> f32 {{\n    \
         if (params.{t} == 0u) {{ return 1.0; }}\n    \
         let qg = u32(q + params.{wq}); // the window's positions\n    \
         let kg = u32(kv + params.{wkv});\n    \
         let r = bx_philox(vec4<u32>(kg >> 2u, qg, (u32(b) << 16u) | u32(h), params.{off}),\n                      \
         vec2<u32>(params.{lo}, params.{hi}));\n    \
         let w = r[kg & 3u];\n    \
         return select(0.0, bitcast<f32>(params.{s}), w >= params.{t});\n}}\n",
        off = Word::Offset.member(),
        lo = Word::SeedLo.member(),
        hi = Word::SeedHi.member(),
        t = Word::Threshold.member(),
        s = Word::Scale.member(),
        wq = crate::params::WindowWord::Q.member(),
        wkv = crate::params::WindowWord::Kv.member(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_cover_the_unit_interval() {
        assert_eq!(threshold(0.0), Some(0));
        assert_eq!(threshold(0.5), Some(1 << 31));
        assert_eq!(threshold(0.25), Some(1 << 30));
        let below_one = f32::from_bits(1.0f32.to_bits() - 1);
        assert_eq!(threshold(below_one), Some(u32::MAX - 255));
        for bad in [1.0, 1.5, -0.0001, f32::NAN, f32::INFINITY] {
            assert_eq!(threshold(bad), None, "{bad}");
        }
        assert_eq!(keep_scale(0.0), 1.0);
        assert_eq!(keep_scale(0.5), 2.0);
    }

    #[test]
    fn the_words_are_in_block_order() {
        let w = words(0.5, 0x0123_4567_89AB_CDEF, 7).unwrap();
        assert_eq!(w, [1 << 31, 2.0f32.to_bits(), 0x89AB_CDEF, 0x0123_4567, 7]);
        assert_eq!(Word::Offset.index(), crate::params::FIELD_WORDS - 1);
        for (i, w) in Word::ALL.iter().enumerate() {
            assert_eq!(*w as usize, i);
        }
    }
}
