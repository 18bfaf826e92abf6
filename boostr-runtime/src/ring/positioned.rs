//! One kernel call of a ring as a variant: a window of a longer sequence.
//!
//! The kernels place query row `i` of a call at `i + Sk − Sq` and key `j`
//! at `j`. A rank's call covers a chunk of queries against a chunk of
//! keys somewhere else in the sequence, so [`Positioned`] hands every
//! function of the variant the global positions: `q + q_shift` and
//! `kv + kv_shift`. The variant's captured tensors are read for the whole
//! sequence (its `Sq = Sk = S`), so they are indexed by global position
//! too, and their range proofs still hold. Only one call per query row
//! carries the sink, so that the merged softmax counts it once. The host
//! functions are the variant's through [`Shifted`]; the GPU kernels are
//! the variant's own, given the window in their parameter block
//! ([`Variant::window`]).

use crate::capture::{Capture, Learnable};
use crate::error::Result;
use crate::problem::Problem;
use crate::shifted::{Shifted, Tile, Window};
use crate::variant::{CallWindow, CompiledStages, Variant};

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

    fn window(&self) -> RingWindow {
        RingWindow {
            q_shift: self.q_shift,
            kv_shift: self.kv_shift,
            sink: self.sink,
        }
    }
}

impl<V: Variant> Variant for Positioned<V> {
    const NAME: &'static str = V::NAME;
    const TILE_Q: Option<u32> = V::TILE_Q;
    const TILE_KV: Option<u32> = V::TILE_KV;
    const TENSORS: &'static [crate::capture::TensorDecl] = V::TENSORS;
    const SUMMARIES: &'static [(usize, usize)] = V::SUMMARIES;
    const READ_CHECKS: &'static [crate::capture::ReadCheck] = V::READ_CHECKS;
    const LEARNABLE: &'static [usize] = V::LEARNABLE;

    type Host = Shifted<Box<V::Host>, RingWindow>;

    fn host(&self, _: &Problem) -> Result<Self::Host> {
        Ok(Shifted {
            inner: Box::new(self.inner.host(&self.whole)?),
            window: self.window(),
        })
    }

    fn host_copy(&self, _: &Problem) -> Result<Self::Host> {
        Ok(Shifted {
            inner: Box::new(self.inner.host_copy(&self.whole)?),
            window: self.window(),
        })
    }

    fn captures(&self) -> Vec<Capture<'_>> {
        self.inner.captures()
    }

    fn learnables(&self) -> Vec<Learnable<'_>> {
        self.inner.learnables()
    }

    fn dropout(&self) -> f32 {
        self.inner.dropout()
    }

    /// The variant's own kernels: they take the window from the
    /// parameter block ([`window`](Variant::window)).
    fn compiled() -> CompiledStages {
        V::compiled()
    }

    fn param_words(&self) -> kernels_spec::params::ParamWords {
        self.inner.param_words()
    }

    fn kernels() -> std::any::TypeId {
        V::kernels()
    }

    fn window(&self) -> CallWindow {
        CallWindow {
            q_shift: self.q_shift,
            kv_shift: self.kv_shift,
            sink: self.sink,
            whole: Some(self.whole),
        }
    }
}

/// A ring call's window: its positions behind the global ones by
/// `q_shift` and `kv_shift`, its rows carrying the sink or not.
pub(crate) struct RingWindow {
    q_shift: i32,
    kv_shift: i32,
    sink: bool,
}

impl Window for RingWindow {
    const HIDES: bool = false;

    #[inline(always)]
    fn row(&self, b: i32, q: i32) -> (i32, i32) {
        (b, q + self.q_shift)
    }

    #[inline(always)]
    fn key_shift(&self, _: i32, _: i32) -> i32 {
        self.kv_shift
    }

    #[inline]
    fn tile(&self, b: i32, q: (i32, i32), kv: (i32, i32)) -> Tile {
        let (dq, dkv) = (self.q_shift, self.kv_shift);
        Tile::Seen {
            b,
            q: (q.0 + dq, q.1 + dq),
            kv: (kv.0 + dkv, kv.1 + dkv),
            whole: true,
        }
    }

    fn carries_sink(&self) -> bool {
        self.sink
    }
}
