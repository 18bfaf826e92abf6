//! The contract between a compiled variant and the kernels.
//!
//! `#[attention]` implements [`Variant`] for the annotated struct, and
//! [`HostVariant`] for it (or, with captured tensors, for its host type).
//! Every method is generated from the variant's checked IR, so the kernels
//! of each target see the same score, mask, derivative and tile classifier.
//! The rest of this module is what the compiler made of a variant
//! ([`CompiledStages`], a target's [`Lowering`], the [`ParamWords`] of its
//! fields) and the vocabulary the kernels share ([`TileClass`],
//! [`Weights`], [`Target`]).

use crate::capture::{Capture, Learnable, ReadCheck, TensorDecl};
use crate::error::{BackendError, Error, Result};
use crate::problem::Problem;
pub use kernels_spec::emit::Target;
pub use kernels_spec::ir::{Normalize, TileClass, Weights};
pub use kernels_spec::params::ParamWords;
use std::fmt::Debug;

/// What the compiler made of one variant: every stage as text, for people,
/// and the variant section of each GPU target, which that target's runtime
/// assembles its kernels around.
#[derive(Clone, Copy, Debug)]
pub struct CompiledStages {
    /// The variant's name.
    pub name: &'static str,
    /// A printout of every stage: IR, derivative, tile classifier, and the
    /// source emitted for each target.
    pub text: &'static str,
    /// The short form of `text`: the declaration, the derived `d score /
    /// d s` and tile classifier on one line each, and the targets emitted.
    pub summary: &'static str,
    /// The lowered variant section of each GPU target it was lowered to.
    pub lowerings: &'static [Lowering],
    /// Loop iterations one evaluation of the tile classifier may run on a
    /// GPU (its reads of summaries), which the loop budget of software
    /// adapters counts.
    pub classify_loop_iterations: u64,
}

/// One GPU target's lowering of a variant: its helpers, parameter block
/// struct and the four variant functions, in the target's language
/// (`kernels_spec::emit::gpu::variant_section`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lowering {
    /// The target.
    pub target: Target,
    /// The section's text.
    pub section: &'static str,
}

impl CompiledStages {
    /// The stages of a variant implemented by hand: no text, no lowering
    /// (it runs on the CPU only).
    pub const fn hand_written(name: &'static str) -> CompiledStages {
        CompiledStages {
            name,
            text: "",
            summary: "",
            lowerings: &[],
            classify_loop_iterations: 0,
        }
    }

    /// The variant section for `target`, or [`BackendError::NoLowering`].
    pub fn lowering(&self, target: Target) -> std::result::Result<&'static str, BackendError> {
        self.lowerings
            .iter()
            .find(|l| l.target == target)
            .map(|l| l.section)
            .ok_or(BackendError::NoLowering {
                variant: self.name,
                target,
            })
    }
}

/// An attention variant: a score modification and a mask over
/// `(batch, head, q_idx, kv_idx)`, with the struct's fields as parameters and
/// captured tensors.
///
/// Implemented by `#[attention]`. A variant is what the ops take; its
/// functions are evaluated by its [`Host`](Variant::Host), the variant with
/// its tensors checked and on the host (a variant without tensors is its own
/// host).
pub trait Variant: Clone + Debug + Send + Sync + 'static {
    /// The variant's name (the struct's name).
    const NAME: &'static str;
    /// `tile(q = ..)`: query rows per tile, overriding each target's default.
    const TILE_Q: Option<u32> = None;
    /// `tile(kv = ..)`: keys per tile, overriding each target's default.
    const TILE_KV: Option<u32> = None;
    /// The captured tensors, in field order.
    const TENSORS: &'static [TensorDecl] = &[];
    /// The `(tensor, axis)` summaries the tile classifier reads, in the
    /// order of the capture arena (`kernels_spec::params::Arena`).
    const SUMMARIES: &'static [(usize, usize)] = &[];
    /// The tensor reads whose indices are checked at run time (the
    /// compiler could not prove them in range), with what makes their
    /// checks hold for one call: the GPU backends read back the arena's
    /// error record after a call only when some may fail.
    const READ_CHECKS: &'static [ReadCheck] = &[];
    /// The learnable tensors (`Var<R>` fields), as indices into
    /// [`TENSORS`](Variant::TENSORS): gradient slot `k` is the tensor
    /// `TENSORS[LEARNABLE[k]]`.
    const LEARNABLE: &'static [usize] = &[];

    /// The variant's functions on the host, for the CPU kernels and the
    /// reference.
    type Host: HostVariant;

    /// `dropout = p`: the probability that a call drops a (query, key)
    /// pair, read from the fields on every call (0 without `dropout`). The
    /// ops refuse a `p` outside `[0, 1)`.
    fn dropout(&self) -> f32 {
        0.0
    }

    /// The variant with its captured tensors checked against problem `p`
    /// (dtype, rank, declared dimensions) and read on the host; an `Err`
    /// naming the field for a tensor that does not match, or that lives on
    /// another runtime.
    fn host(&self, p: &Problem) -> Result<Self::Host>;

    /// [`host`](Variant::host) for a variant on any runtime: its tensors
    /// checked the same way and copied to the host (what the reference
    /// evaluates for a variant whose tensors live on a GPU).
    fn host_copy(&self, p: &Problem) -> Result<Self::Host> {
        self.host(p)
    }

    /// The captured tensors, in field order, for the GPU backends.
    fn captures(&self) -> Vec<Capture<'_>> {
        Vec::new()
    }

    /// The learnable tensors, in slot order (see
    /// [`LEARNABLE`](Variant::LEARNABLE)), for the autograd op.
    fn learnables(&self) -> Vec<Learnable<'_>> {
        Vec::new()
    }

    /// What the compiler made of this variant: its stages, and its
    /// lowering for each GPU target (none for a hand-written impl, which
    /// the GPU backends then refuse with [`BackendError::NoLowering`]).
    fn compiled() -> CompiledStages;

    /// The parameter block every GPU kernel takes: the fields encoded by the
    /// layout the compiler chose (`kernels_spec::params::ParamLayout`), with
    /// each tensor's shape and place in the capture arena. Without fields,
    /// or without a GPU lowering, all zeros.
    fn param_words(&self) -> ParamWords {
        ParamWords::ZERO
    }

    /// Where this variant's calls sit in its sequence: the whole of it
    /// ([`CallWindow::WHOLE`]), but for the variant of one call of a ring
    /// (a window of a longer sequence), which the GPU backends pass on to
    /// the kernels. Not for implementing: the default is every variant's.
    #[doc(hidden)]
    fn window(&self) -> CallWindow {
        CallWindow::WHOLE
    }

    /// The type whose compiled kernels this variant's calls launch (the
    /// GPU backends' cache key): its own, but for a ring call's, which runs
    /// its variant's kernels. Not for implementing.
    #[doc(hidden)]
    fn kernels() -> std::any::TypeId {
        std::any::TypeId::of::<Self>()
    }
}

/// Where a call sits in the variant's sequence, as the GPU kernels take
/// it (the parameter block's window, `kernels_spec::params::WindowWord`):
/// the shifts from the positions the kernels count (query row `i` at `i +
/// Sk − Sq`, key `j` at `j`) to the variant's, whether the call's rows
/// carry the sink, and the problem its captured tensors are checked
/// against.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CallWindow {
    /// What the variant's query positions are ahead of the call's.
    pub q_shift: i32,
    /// What the variant's key positions are ahead of the call's.
    pub kv_shift: i32,
    /// The call's rows carry the variant's sink.
    pub sink: bool,
    /// The whole sequence's problem, which the captured tensors span;
    /// `None`: the call's own.
    pub whole: Option<Problem>,
}

impl CallWindow {
    /// A call that is its whole sequence.
    pub const WHOLE: CallWindow = CallWindow {
        q_shift: 0,
        kv_shift: 0,
        sink: true,
        whole: None,
    };

    /// The problem the captured tensors of call `p` are checked against.
    pub fn captured(&self, p: &Problem) -> Problem {
        self.whole.unwrap_or(*p)
    }
}

/// A variant's functions, as the CPU kernels and the f64 reference evaluate
/// them. Implemented by `#[attention]` (on the variant itself, or on its
/// host type when it captures tensors); implementing it by hand is possible
/// but the methods must agree with each other (e.g. `score_grad` is
/// d`score`/d`s`).
///
/// Index arguments: `b` batch, `h` query head, `q` the query's position
/// (bottom-right aligned: row `i` has `q = i + Sk - Sq`), `kv` the key's
/// position. `s` is the scaled logit `q·k * scale`.
pub trait HostVariant: Send + Sync {
    /// The variant's name.
    const NAME: &'static str;
    /// `score` is the identity: kernels skip it and its derivative (which is 1).
    const SCORE_IS_IDENTITY: bool;
    /// The variant declares a mask; without one every pair is visible.
    const HAS_MASK: bool;
    /// `d score / d s` is the constant 1 (`score` is `s` plus terms that
    /// do not depend on it: a bias, ALiBi): a backward multiplies nothing
    /// by it.
    const SCORE_GRAD_IS_ONE: bool = Self::SCORE_IS_IDENTITY;
    /// `score_grad` is the variant's own (`score_grad = |..| ..`): the
    /// backward multiplies `dS` by it rather than by the derivative of
    /// `score`, and the reference's finite-difference check leaves dq and
    /// dk (which it alone changes) out.
    const SCORE_GRAD_GIVEN: bool = false;
    /// How each row's scores become weights ([`Weights`]): a softmax (the
    /// default) or sigmoid weights, with or without a sink (one more logit
    /// in every query row's softmax, carrying no value; without one,
    /// [`sink`](HostVariant::sink) is `-inf`), with or without dropout
    /// (each call keeps a pair with probability `1 − p`, drawn from the
    /// call's seed, [`Dropout`](crate::Dropout), and scales what it keeps
    /// by `1/(1 − p)`).
    const WEIGHTS: Weights = Weights::SOFTMAX;
    /// `score` or `score_grad` reads a tensor with a checked index: they are
    /// then evaluated at visible pairs only, where the reference evaluates
    /// them, so that an index out of range there (and only there) is
    /// reported.
    const SCORE_CHECKS_READS: bool = false;
    /// The functions read neither the batch index `b` nor a captured
    /// tensor: every sequence of a call is attended alike, so a call may
    /// run any subset of its sequences as a batch of their own (as a mixed
    /// batch's decodes and prefills, [`Keys::paged_packed`](crate::Keys::paged_packed),
    /// run as one call of each kind). `false` is always sound.
    const BATCH_FREE: bool = false;

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
    /// `mask` in the language's f32 arithmetic with every operation
    /// rounded once (a division stays a division) and `std`'s functions,
    /// for the reference implementation: a mask is a decision, and at an
    /// exact tie f64 arithmetic could decide otherwise than every kernel.
    fn mask_exact(&self, b: i32, h: i32, q: i32, kv: i32) -> bool;

    /// Where the dropout draw of the call's row at position `q` of batch
    /// `b` is keyed: the batch and query position the variant's functions
    /// see there, and what its key positions are ahead of the call's. The
    /// call's own, `(b, q, 0)`, but for a call that sees the variant from
    /// elsewhere (a KV cache, a padded batch, packed sequences, one call
    /// of a ring), so that a pair drops alike however it is reached. Not
    /// for implementing.
    #[doc(hidden)]
    #[inline(always)]
    fn dropout_site(&self, b: i32, q: i32) -> (i32, i32, i32) {
        (b, q, 0)
    }

    /// The sink logit of query `q`'s row in batch `b`, query head `h`; `-inf`
    /// for none. It joins the row's softmax denominator (and its `lse`) and
    /// contributes no value, so a row that sees no key has `out = 0` and
    /// `lse = sink`.
    fn sink(&self, b: i32, h: i32, q: i32) -> f32 {
        let _ = (b, h, q);
        f32::NEG_INFINITY
    }

    /// `sink` evaluated in f64, for the reference implementation.
    fn sink_f64(&self, b: i32, h: i32, q: i32) -> f64 {
        let _ = (b, h, q);
        f64::NEG_INFINITY
    }

    /// The number of learnable tensors (gradient slots); their reads in
    /// `score` and `sink` have gradients.
    const LEARNABLE: usize = 0;
    /// `score` reads a learnable tensor (else only `sink` does, and the
    /// backward's per-pair accumulation is skipped).
    const SCORE_READS_LEARNABLE: bool = false;
    /// Every learnable read of `score` lands, and has its derivative, by the
    /// difference of the query and key positions alone, never the logit
    /// (`kernels_spec::ir::Program::score_grads_by_difference`): the
    /// backward sums `dz` along each diagonal of a tile and calls
    /// [`score_tensor_grads`](HostVariant::score_tensor_grads) once per
    /// diagonal, at one of its pairs.
    const SCORE_GRADS_BY_DIFFERENCE: bool = false;

    /// The number of elements of learnable tensor `slot` (0 for none).
    fn learnable_numel(&self, slot: usize) -> usize {
        let _ = slot;
        0
    }

    /// Add `dz · ∂score/∂t[i]` into `grads[slot][i]` for every read of a
    /// learnable tensor `t` in `score` at this pair, where `dz` is
    /// d loss / d score. A slot whose slice is empty is skipped (its
    /// gradient is not wanted), and so is a read outside its tensor.
    #[allow(clippy::too_many_arguments)]
    fn score_tensor_grads(
        &self,
        s: f32,
        b: i32,
        h: i32,
        q: i32,
        kv: i32,
        dz: f32,
        grads: &mut [&mut [f32]],
    ) {
        let _ = (s, b, h, q, kv, dz, grads);
    }

    /// [`score_tensor_grads`](HostVariant::score_tensor_grads) in f64, for
    /// the reference; with `abs`, `|dz · ∂score/∂t[i]|` is added instead
    /// (the magnitudes that scale the tolerance).
    #[allow(clippy::too_many_arguments)]
    fn score_tensor_grads_f64(
        &self,
        s: f64,
        b: i32,
        h: i32,
        q: i32,
        kv: i32,
        dz: f64,
        abs: bool,
        grads: &mut [&mut [f64]],
    ) {
        let _ = (s, b, h, q, kv, dz, abs, grads);
    }

    /// Add `dz · ∂sink/∂t[i]` for every read of a learnable tensor in
    /// `sink` at this row, where `dz` is d loss / d sink; as
    /// [`score_tensor_grads`](HostVariant::score_tensor_grads).
    fn sink_tensor_grads(&self, b: i32, h: i32, q: i32, dz: f32, grads: &mut [&mut [f32]]) {
        let _ = (b, h, q, dz, grads);
    }

    /// [`sink_tensor_grads`](HostVariant::sink_tensor_grads) in f64, as
    /// [`score_tensor_grads_f64`](HostVariant::score_tensor_grads_f64).
    fn sink_tensor_grads_f64(
        &self,
        b: i32,
        h: i32,
        q: i32,
        dz: f64,
        abs: bool,
        grads: &mut [&mut [f64]],
    ) {
        let _ = (b, h, q, dz, abs, grads);
    }

    /// Add `delta` to element `at` of learnable tensor `slot`, in a private
    /// copy, and return the change made (`fl(x + delta) − x`, exact): for
    /// finite-difference checks.
    #[doc(hidden)]
    fn perturb_learnable(&mut self, slot: usize, at: usize, delta: f32) -> f32 {
        let _ = (slot, at, delta);
        0.0
    }

    /// The least read out of range of the evaluations so far, as the error
    /// the call returns; `None` when every index was in range.
    fn out_of_range(&self) -> Option<Error> {
        None
    }
}

/// Implements [`Variant`] for a type that implements [`HostVariant`] by
/// hand: the type is its own host, has no captured tensors and no GPU
/// lowering (the GPU backends refuse it with [`BackendError::NoLowering`]);
/// it runs on the CPU and against the reference.
///
/// ```
/// use boostr_runtime::HostVariant;
/// use boostr_runtime::variant::TileClass;
///
/// /// Every key visible, logits halved.
/// #[derive(Clone, Debug)]
/// struct Halved;
///
/// impl HostVariant for Halved {
///     const NAME: &'static str = "Halved";
///     const SCORE_IS_IDENTITY: bool = false;
///     const HAS_MASK: bool = false;
///     fn score(&self, s: f32, _: i32, _: i32, _: i32, _: i32) -> f32 { 0.5 * s }
///     fn score_grad(&self, _: f32, _: i32, _: i32, _: i32, _: i32) -> f32 { 0.5 }
///     fn mask(&self, _: i32, _: i32, _: i32, _: i32) -> bool { true }
///     fn classify_tile(&self, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32) -> TileClass {
///         TileClass::Full
///     }
///     fn score_f64(&self, s: f64, _: i32, _: i32, _: i32, _: i32) -> f64 { 0.5 * s }
///     fn score_grad_f64(&self, _: f64, _: i32, _: i32, _: i32, _: i32) -> f64 { 0.5 }
///     fn mask_exact(&self, _: i32, _: i32, _: i32, _: i32) -> bool { true }
/// }
/// boostr_runtime::hand_written_variant!(Halved);
///
/// boostr_runtime::testing::check_variant::<boostr_runtime::testing::Cpu, _>(&Halved);
/// ```
#[macro_export]
macro_rules! hand_written_variant {
    ($ty:ty) => {
        impl $crate::Variant for $ty {
            const NAME: &'static str = <$ty as $crate::HostVariant>::NAME;
            type Host = $ty;
            fn host(&self, _: &$crate::Problem) -> $crate::Result<$ty> {
                ::core::result::Result::Ok(::core::clone::Clone::clone(self))
            }
            fn compiled() -> $crate::variant::CompiledStages {
                $crate::variant::CompiledStages::hand_written(<$ty as $crate::HostVariant>::NAME)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stock::CausalSoftcap;

    #[test]
    fn lowerings_are_found_by_target() {
        let stages = CausalSoftcap::compiled();
        let wgsl = stages.lowering(Target::Wgsl).expect("a WGSL lowering");
        let cuda = stages.lowering(Target::Cuda).expect("a CUDA lowering");
        assert!(wgsl.contains("fn variant_score(s: f32"), "{wgsl}");
        assert!(
            cuda.contains("__device__ __forceinline__ float variant_score("),
            "{cuda}"
        );
        assert_eq!(
            stages.lowering(Target::Cpu),
            Err(BackendError::NoLowering {
                variant: "CausalSoftcap",
                target: Target::Cpu
            })
        );
    }

    #[test]
    fn a_hand_written_variant_has_no_gpu_lowering() {
        let stages = CompiledStages::hand_written("ByHand");
        for target in [Target::Wgsl, Target::Cuda] {
            let e = stages.lowering(target).unwrap_err();
            assert_eq!(
                e,
                BackendError::NoLowering {
                    variant: "ByHand",
                    target
                }
            );
            let text = e.to_string();
            assert!(
                text.contains("`ByHand`") && text.contains(target.name()),
                "{text}"
            );
        }
    }
}
