//! One kernel call of a ring as a variant: a window of a longer sequence.
//!
//! The kernels place query row `i` of a call at `i + Sk − Sq` and key `j`
//! at `j`. A rank's call covers a chunk of queries against a chunk of
//! keys somewhere else in the sequence, so [`Positioned`] hands every
//! function of the variant the global positions: `q + q_shift` and
//! `kv + kv_shift`. The variant's captured tensors are read for the whole
//! sequence (its `Sq = Sk = S`), so they are indexed by global position
//! too, and their range proofs still hold. Only one call per query row
//! carries the sink, so that the merged softmax counts it once.

use crate::capture::{Capture, Learnable};
use crate::error::Result;
use crate::problem::Problem;
use crate::variant::{CompiledStages, HostVariant, TileClass, Variant};

/// `inner` on a window of the sequence of problem `whole`.
#[derive(Clone, Debug)]
pub(crate) struct Positioned<V> {
    pub inner: V,
    /// The whole sequence's problem (`Sq = Sk = S`), which the captured
    /// tensors are checked against.
    pub whole: Problem,
    /// What the call's query positions are behind the global ones.
    pub q_shift: i32,
    /// What the call's key positions are behind the global ones.
    pub kv_shift: i32,
    /// Whether this call's rows carry the sink.
    pub sink: bool,
}

impl<V> Positioned<V> {
    /// The call `p` (queries from global position `q_start`, keys from
    /// `kv_start`) of `inner` over the sequence of `whole`.
    pub fn new(inner: V, whole: Problem, p: &Problem, starts: (usize, usize), sink: bool) -> Self {
        let i32_of = |x: usize| i32::try_from(x).expect("positions fit i32 (validated)");
        let local_q0 = i32_of(p.seq_k) - i32_of(p.seq_q);
        Positioned {
            inner,
            whole,
            q_shift: i32_of(starts.0) - local_q0,
            kv_shift: i32_of(starts.1),
            sink,
        }
    }
}

impl<V: Variant> Variant for Positioned<V> {
    const NAME: &'static str = V::NAME;
    const TILE_Q: Option<u32> = V::TILE_Q;
    const TILE_KV: Option<u32> = V::TILE_KV;
    const TENSORS: &'static [crate::capture::TensorDecl] = V::TENSORS;
    const LEARNABLE: &'static [usize] = V::LEARNABLE;

    type Host = PositionedHost<V::Host>;

    fn host(&self, _: &Problem) -> Result<Self::Host> {
        Ok(PositionedHost {
            inner: self.inner.host(&self.whole)?,
            q_shift: self.q_shift,
            kv_shift: self.kv_shift,
            sink: self.sink,
        })
    }

    fn host_copy(&self, _: &Problem) -> Result<Self::Host> {
        Ok(PositionedHost {
            inner: self.inner.host_copy(&self.whole)?,
            q_shift: self.q_shift,
            kv_shift: self.kv_shift,
            sink: self.sink,
        })
    }

    fn captures(&self) -> Vec<Capture<'_>> {
        self.inner.captures()
    }

    fn learnables(&self) -> Vec<Learnable<'_>> {
        self.inner.learnables()
    }

    /// No GPU lowering: the GPU kernels place positions from the start of
    /// the call ([`AttentionRuntime::GLOBAL_POSITIONS`](crate::AttentionRuntime::GLOBAL_POSITIONS)).
    fn compiled() -> CompiledStages {
        CompiledStages::hand_written(V::NAME)
    }
}

/// The host functions of [`Positioned`].
pub(crate) struct PositionedHost<H> {
    inner: H,
    q_shift: i32,
    kv_shift: i32,
    sink: bool,
}

impl<H: HostVariant> HostVariant for PositionedHost<H> {
    const NAME: &'static str = H::NAME;
    const SCORE_IS_IDENTITY: bool = H::SCORE_IS_IDENTITY;
    const HAS_MASK: bool = H::HAS_MASK;
    const SCORE_GRAD_IS_ONE: bool = H::SCORE_GRAD_IS_ONE;
    const WEIGHTS: crate::variant::Weights = H::WEIGHTS;
    const SCORE_CHECKS_READS: bool = H::SCORE_CHECKS_READS;
    const LEARNABLE: usize = H::LEARNABLE;
    const SCORE_READS_LEARNABLE: bool = H::SCORE_READS_LEARNABLE;
    // Both shifts are constant over the call, so a function of `kv − q`
    // stays one.
    const SCORE_GRADS_BY_DIFFERENCE: bool = H::SCORE_GRADS_BY_DIFFERENCE;

    #[inline(always)]
    fn score(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 {
        self.inner
            .score(s, b, h, q + self.q_shift, kv + self.kv_shift)
    }

    #[inline(always)]
    fn score_grad(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 {
        self.inner
            .score_grad(s, b, h, q + self.q_shift, kv + self.kv_shift)
    }

    #[inline(always)]
    fn mask(&self, b: i32, h: i32, q: i32, kv: i32) -> bool {
        self.inner.mask(b, h, q + self.q_shift, kv + self.kv_shift)
    }

    #[inline]
    fn classify_tile(
        &self,
        b: i32,
        h: i32,
        q_lo: i32,
        q_hi: i32,
        kv_lo: i32,
        kv_hi: i32,
    ) -> TileClass {
        let (dq, dkv) = (self.q_shift, self.kv_shift);
        self.inner
            .classify_tile(b, h, q_lo + dq, q_hi + dq, kv_lo + dkv, kv_hi + dkv)
    }

    fn score_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 {
        self.inner
            .score_f64(s, b, h, q + self.q_shift, kv + self.kv_shift)
    }

    fn score_grad_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 {
        self.inner
            .score_grad_f64(s, b, h, q + self.q_shift, kv + self.kv_shift)
    }

    fn mask_f64(&self, b: i32, h: i32, q: i32, kv: i32) -> bool {
        self.inner
            .mask_f64(b, h, q + self.q_shift, kv + self.kv_shift)
    }

    fn position_shift(&self, b: i32) -> (i32, i32) {
        let (dq, dkv) = self.inner.position_shift(b);
        (dq + self.q_shift, dkv + self.kv_shift)
    }

    fn sink(&self, b: i32, h: i32, q: i32) -> f32 {
        if self.sink {
            self.inner.sink(b, h, q + self.q_shift)
        } else {
            f32::NEG_INFINITY
        }
    }

    fn sink_f64(&self, b: i32, h: i32, q: i32) -> f64 {
        if self.sink {
            self.inner.sink_f64(b, h, q + self.q_shift)
        } else {
            f64::NEG_INFINITY
        }
    }

    fn learnable_numel(&self, slot: usize) -> usize {
        self.inner.learnable_numel(slot)
    }

    #[inline(always)]
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
        let (q, kv) = (q + self.q_shift, kv + self.kv_shift);
        self.inner.score_tensor_grads(s, b, h, q, kv, dz, grads);
    }

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
        let (q, kv) = (q + self.q_shift, kv + self.kv_shift);
        self.inner
            .score_tensor_grads_f64(s, b, h, q, kv, dz, abs, grads);
    }

    fn sink_tensor_grads(&self, b: i32, h: i32, q: i32, dz: f32, grads: &mut [&mut [f32]]) {
        if self.sink {
            self.inner
                .sink_tensor_grads(b, h, q + self.q_shift, dz, grads);
        }
    }

    fn sink_tensor_grads_f64(
        &self,
        b: i32,
        h: i32,
        q: i32,
        dz: f64,
        abs: bool,
        grads: &mut [&mut [f64]],
    ) {
        if self.sink {
            self.inner
                .sink_tensor_grads_f64(b, h, q + self.q_shift, dz, abs, grads);
        }
    }

    fn perturb_learnable(&mut self, slot: usize, at: usize, delta: f32) -> f32 {
        self.inner.perturb_learnable(slot, at, delta)
    }

    fn out_of_range(&self) -> Option<crate::Error> {
        self.inner.out_of_range()
    }
}
