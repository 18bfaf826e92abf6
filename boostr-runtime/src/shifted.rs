//! A variant seen from a call whose positions are not the variant's own.
//!
//! The kernels count positions from the start of their call: query row `i`
//! at `i + Sk − Sq`, key `j` at `j`. Two kinds of call see the variant's
//! sequence from elsewhere, and both reach it through [`Shifted`]:
//!
//! - a KV cache of per-sequence lengths ([`CacheWindow`]): sequence `b`'s
//!   rows sit at its own length, so every query position moves back by
//!   `Sk − len[b]`, and the spare slots from `len[b]` on are hidden;
//! - one call of a ring ([`RingWindow`](crate::ring)): a chunk of queries
//!   against a chunk of keys somewhere in a longer sequence, whose
//!   positions move forward to the global ones, and whose rows carry the
//!   sink in one call only.
//!
//! Every function of the variant is called at the moved positions; the
//! tile classifier sees the moved tile (and a tile past a hidden key's
//! bound is `Empty`, one across it `Partial`); the dropout draw is keyed by
//! [`position_shift`](HostVariant::position_shift), so a pair drops alike
//! however it is reached.

use crate::variant::{HostVariant, TileClass, Weights};
use std::ops::Deref;

/// Where a call sits in the variant's sequence.
pub(crate) trait Window: Send + Sync {
    /// The window hides keys from [`key_end`](Window::key_end) on.
    const HIDES_KEYS: bool;

    /// What the variant's query and key positions are ahead of the call's
    /// in sequence `b`.
    fn shift(&self, b: i32) -> (i32, i32);

    /// The first key (in the call's positions) that sequence `b` hides.
    fn key_end(&self, b: i32) -> i32 {
        let _ = b;
        i32::MAX
    }

    /// Whether the call's rows carry the variant's sink.
    fn carries_sink(&self) -> bool {
        true
    }
}

/// A KV cache's window: sequence `b` holds `len[b]` of the `Sk` slots.
pub(crate) struct CacheWindow {
    /// Per sequence, `Sk − len[b]`: what the kernels' positions are ahead.
    ahead: Vec<i32>,
    /// Per sequence, `len[b]`.
    len: Vec<i32>,
}

impl CacheWindow {
    /// `p.batch` sequences of `lens` keys in `p.seq_k` slots.
    pub(crate) fn new(p: &crate::Problem, lens: &[usize]) -> Self {
        assert_eq!(lens.len(), p.batch, "one length per sequence");
        let i32_of = |x: usize| i32::try_from(x).expect("lengths fit i32");
        CacheWindow {
            ahead: lens.iter().map(|&l| i32_of(p.seq_k - l)).collect(),
            len: lens.iter().map(|&l| i32_of(l)).collect(),
        }
    }
}

impl Window for CacheWindow {
    const HIDES_KEYS: bool = true;

    fn shift(&self, b: i32) -> (i32, i32) {
        (-self.ahead[b as usize], 0)
    }

    fn key_end(&self, b: i32) -> i32 {
        self.len[b as usize]
    }
}

/// `inner`, reached through `window`. `I` is a reference to the variant
/// or a box that owns it.
pub(crate) struct Shifted<I, W> {
    pub inner: I,
    pub window: W,
}

/// A KV cache over `inner`: the tile kernels run over a cache of
/// per-sequence lengths unchanged.
pub(crate) type Cached<'a, V> = Shifted<&'a V, CacheWindow>;

impl<'a, V: HostVariant> Cached<'a, V> {
    /// `inner` over `p.batch` sequences of `lens` keys in `p.seq_k` slots.
    pub(crate) fn new(inner: &'a V, p: &crate::Problem, lens: &[usize]) -> Self {
        Shifted {
            inner,
            window: CacheWindow::new(p, lens),
        }
    }
}

impl<I, W> Shifted<I, W>
where
    I: Deref + Send + Sync,
    I::Target: HostVariant,
    W: Window,
{
    #[inline(always)]
    fn at(&self, b: i32, q: i32, kv: i32) -> (i32, i32) {
        let (dq, dkv) = self.window.shift(b);
        (q + dq, kv + dkv)
    }

    #[inline(always)]
    fn row(&self, b: i32, q: i32) -> i32 {
        q + self.window.shift(b).0
    }
}

impl<I, W> HostVariant for Shifted<I, W>
where
    I: Deref + Send + Sync,
    I::Target: HostVariant,
    W: Window,
{
    const NAME: &'static str = <I::Target as HostVariant>::NAME;
    const SCORE_IS_IDENTITY: bool = <I::Target as HostVariant>::SCORE_IS_IDENTITY;
    const HAS_MASK: bool = W::HIDES_KEYS || <I::Target as HostVariant>::HAS_MASK;
    const SCORE_GRAD_IS_ONE: bool = <I::Target as HostVariant>::SCORE_GRAD_IS_ONE;
    const SCORE_GRAD_GIVEN: bool = <I::Target as HostVariant>::SCORE_GRAD_GIVEN;
    const WEIGHTS: Weights = <I::Target as HostVariant>::WEIGHTS;
    const SCORE_CHECKS_READS: bool = <I::Target as HostVariant>::SCORE_CHECKS_READS;
    const LEARNABLE: usize = <I::Target as HostVariant>::LEARNABLE;
    const SCORE_READS_LEARNABLE: bool = <I::Target as HostVariant>::SCORE_READS_LEARNABLE;
    // The shifts are constant over a sequence, so a function of `kv − q`
    // stays one.
    const SCORE_GRADS_BY_DIFFERENCE: bool = <I::Target as HostVariant>::SCORE_GRADS_BY_DIFFERENCE;

    #[inline(always)]
    fn score(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 {
        let (q, kv) = self.at(b, q, kv);
        self.inner.score(s, b, h, q, kv)
    }

    #[inline(always)]
    fn score_grad(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 {
        let (q, kv) = self.at(b, q, kv);
        self.inner.score_grad(s, b, h, q, kv)
    }

    #[inline(always)]
    fn mask(&self, b: i32, h: i32, q: i32, kv: i32) -> bool {
        let seen = !W::HIDES_KEYS || kv < self.window.key_end(b);
        let (q, kv) = self.at(b, q, kv);
        seen && (!<I::Target as HostVariant>::HAS_MASK || self.inner.mask(b, h, q, kv))
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
        let end = self.window.key_end(b);
        if W::HIDES_KEYS && kv_lo >= end {
            return TileClass::Empty;
        }
        let inner = if <I::Target as HostVariant>::HAS_MASK {
            let (q_lo, kv_lo) = self.at(b, q_lo, kv_lo);
            let (q_hi, kv_hi) = self.at(b, q_hi, kv_hi);
            self.inner.classify_tile(b, h, q_lo, q_hi, kv_lo, kv_hi)
        } else {
            TileClass::Full
        };
        match inner {
            TileClass::Full if W::HIDES_KEYS && kv_hi >= end => TileClass::Partial,
            class => class,
        }
    }

    fn score_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 {
        let (q, kv) = self.at(b, q, kv);
        self.inner.score_f64(s, b, h, q, kv)
    }

    fn score_grad_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 {
        let (q, kv) = self.at(b, q, kv);
        self.inner.score_grad_f64(s, b, h, q, kv)
    }

    fn mask_exact(&self, b: i32, h: i32, q: i32, kv: i32) -> bool {
        let seen = !W::HIDES_KEYS || kv < self.window.key_end(b);
        let (q, kv) = self.at(b, q, kv);
        seen && (!<I::Target as HostVariant>::HAS_MASK || self.inner.mask_exact(b, h, q, kv))
    }

    fn position_shift(&self, b: i32) -> (i32, i32) {
        let (dq, dkv) = self.inner.position_shift(b);
        let (wq, wkv) = self.window.shift(b);
        (dq + wq, dkv + wkv)
    }

    fn sink(&self, b: i32, h: i32, q: i32) -> f32 {
        if self.window.carries_sink() {
            self.inner.sink(b, h, self.row(b, q))
        } else {
            f32::NEG_INFINITY
        }
    }

    fn sink_f64(&self, b: i32, h: i32, q: i32) -> f64 {
        if self.window.carries_sink() {
            self.inner.sink_f64(b, h, self.row(b, q))
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
        let (q, kv) = self.at(b, q, kv);
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
        let (q, kv) = self.at(b, q, kv);
        self.inner
            .score_tensor_grads_f64(s, b, h, q, kv, dz, abs, grads);
    }

    fn sink_tensor_grads(&self, b: i32, h: i32, q: i32, dz: f32, grads: &mut [&mut [f32]]) {
        if self.window.carries_sink() {
            self.inner
                .sink_tensor_grads(b, h, self.row(b, q), dz, grads);
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
        if self.window.carries_sink() {
            self.inner
                .sink_tensor_grads_f64(b, h, self.row(b, q), dz, abs, grads);
        }
    }

    fn out_of_range(&self) -> Option<crate::Error> {
        self.inner.out_of_range()
    }
}
