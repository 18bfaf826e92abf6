//! The contract between a compiled variant and the kernels.
//!
//! `#[attention]` implements [`Variant`] for the annotated struct. Every method
//! is generated from the variant's checked IR, so the kernels of each target
//! see the same score, mask, derivative and tile classifier.

use std::fmt::Debug;

/// What a tile's mask is known to be over a whole (query range × key range).
///
/// Produced by interval analysis of the mask: `Empty` and `Full` are proofs,
/// `Partial` means "evaluate the mask per element" (it is always safe).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TileClass {
    /// No (query, key) pair in the tile is visible: the tile is skipped.
    Empty,
    /// Some pairs may be visible: the mask is evaluated per element.
    Partial,
    /// Every pair is visible: the mask is not evaluated.
    Full,
}

/// The stages of compilation of one variant, as text, for inspection.
#[derive(Clone, Copy, Debug)]
pub struct CompiledStages {
    /// The variant's name.
    pub name: &'static str,
    /// A printout of every stage: IR, derivative, tile classifier, and the
    /// source emitted for each target.
    pub text: &'static str,
}

/// An attention variant: a score modification and a mask over
/// `(batch, head, q_idx, kv_idx)`, with the struct's fields as parameters.
///
/// Implemented by `#[attention]`; implementing it by hand is possible but the
/// methods must agree with each other (e.g. `score_grad` is d`score`/d`s`).
///
/// Index arguments: `b` batch, `h` query head, `q` the query's position
/// (bottom-right aligned: row `i` has `q = i + Sk - Sq`), `kv` the key's
/// position. `s` is the scaled logit `q·k * scale`.
pub trait Variant: Clone + Debug + Send + Sync + 'static {
    /// The variant's name (the struct's name).
    const NAME: &'static str;
    /// `score` is the identity: kernels skip it and its derivative (which is 1).
    const SCORE_IS_IDENTITY: bool;
    /// The variant declares a mask; without one every pair is visible.
    const HAS_MASK: bool;
    /// `tile(q = ..)`: query rows per tile, overriding each target's default.
    const TILE_Q: Option<u32> = None;
    /// `tile(kv = ..)`: keys per tile, overriding each target's default.
    const TILE_KV: Option<u32> = None;

    /// The modified score of one (query, key) pair.
    fn score(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32;
    /// d`score`/d`s`, derived symbolically by the compiler.
    fn score_grad(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32;
    /// Whether key `kv` is visible to query `q`.
    fn mask(&self, b: i32, h: i32, q: i32, kv: i32) -> bool;
    /// Classify the tile `q ∈ [q_lo, q_hi] × kv ∈ [kv_lo, kv_hi]` (inclusive)
    /// for batch `b` and query head `h`. Never wrong: `Empty` and `Full` are
    /// only returned when they hold for every pair.
    fn classify_tile(
        &self,
        b: i32,
        h: i32,
        q_lo: i32,
        q_hi: i32,
        kv_lo: i32,
        kv_hi: i32,
    ) -> TileClass;

    /// `score` evaluated in f64, for the reference implementation.
    fn score_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64;
    /// `score_grad` evaluated in f64, for the reference implementation.
    fn score_grad_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64;
    /// `mask` evaluated with f64 arithmetic, for the reference implementation.
    fn mask_f64(&self, b: i32, h: i32, q: i32, kv: i32) -> bool;

    /// What the compiler made of this variant, stage by stage.
    fn compiled() -> CompiledStages;

    /// The WGSL variant section (helpers, the `Params` uniform and the four
    /// lowered variant functions) that the WGSL kernels are assembled around,
    /// or `None` when the variant has no WGSL lowering (a hand-written impl):
    /// the wgpu backend then returns an error.
    fn wgsl_variant_functions() -> Option<&'static str> {
        None
    }

    /// The CUDA variant section (helpers, the `Params` struct and the four
    /// lowered `__device__` variant functions) that the CUDA kernel sources
    /// are assembled around (`kernels_spec::emit::cuda::forward_source` and
    /// `backward_source`), or `None` when the variant has no CUDA lowering (a
    /// hand-written impl): the CUDA backend then returns an error. The
    /// kernels take the `Params` struct by value: the words of
    /// [`wgsl_params`](Variant::wgsl_params) zero-padded to 32.
    fn cuda_variant_functions() -> Option<&'static str> {
        None
    }

    /// The contents of the WGSL `Params` uniform: one 32-bit word per field
    /// in declaration order (f32 as its bits, i32/u32 as their bits, bool as
    /// 0/1), zero-padded to a non-empty multiple of four words.
    fn wgsl_params(&self) -> Vec<u32> {
        vec![0; 4]
    }
}
