//! A KV cache as a variant: the tile kernels run over a cache of
//! per-sequence lengths unchanged, through [`Cached`], which gives them the
//! cache's positions and hides its spare slots.
//!
//! The kernels place query row `i` at `i + Sk − Sq` (`Sk` the capacity);
//! over a cache it sits at `i + len[b] − Sq`, so every call of the inner
//! variant sees `q − (Sk − len[b])`. Keys at or past `len[b]` are masked,
//! and a tile that starts past them is `Empty`: no arithmetic, and the
//! kernels never read a key row they do not need (a partial tile zeroes the
//! rows no query sees before any product meets them).

use crate::variant::{HostVariant, TileClass};

/// `inner` over a KV cache of `Sk` slots per sequence, of which sequence
/// `b` holds `len[b]`.
pub(crate) struct Cached<'a, V> {
    inner: &'a V,
    /// Per sequence, `Sk − len[b]`: what the kernels' positions are ahead.
    shift: Vec<i32>,
    /// Per sequence, `len[b]`.
    len: Vec<i32>,
}

impl<'a, V> Cached<'a, V> {
    /// `inner` over `p.batch` sequences of `lens` keys in `p.seq_k` slots.
    pub(crate) fn new(inner: &'a V, p: &crate::Problem, lens: &[usize]) -> Self {
        assert_eq!(lens.len(), p.batch, "one length per sequence");
        let i32_of = |x: usize| i32::try_from(x).expect("lengths fit i32");
        Cached {
            inner,
            shift: lens.iter().map(|&l| i32_of(p.seq_k - l)).collect(),
            len: lens.iter().map(|&l| i32_of(l)).collect(),
        }
    }

    fn at(&self, b: i32, q: i32) -> (i32, i32) {
        let b_ = b as usize;
        (q - self.shift[b_], self.len[b_])
    }
}

impl<V: HostVariant> HostVariant for Cached<'_, V> {
    const NAME: &'static str = V::NAME;
    const SCORE_IS_IDENTITY: bool = V::SCORE_IS_IDENTITY;
    const HAS_MASK: bool = true;
    const SCORE_GRAD_IS_ONE: bool = V::SCORE_GRAD_IS_ONE;
    const WEIGHTS: crate::variant::Weights = V::WEIGHTS;
    const SCORE_CHECKS_READS: bool = V::SCORE_CHECKS_READS;
    const LEARNABLE: usize = V::LEARNABLE;
    const SCORE_READS_LEARNABLE: bool = V::SCORE_READS_LEARNABLE;
    // The shift is one per sequence, so a function of `kv − q` stays one.
    const SCORE_GRADS_BY_DIFFERENCE: bool = V::SCORE_GRADS_BY_DIFFERENCE;

    #[inline(always)]
    fn score(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 {
        self.inner.score(s, b, h, self.at(b, q).0, kv)
    }

    #[inline(always)]
    fn score_grad(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 {
        self.inner.score_grad(s, b, h, self.at(b, q).0, kv)
    }

    #[inline(always)]
    fn mask(&self, b: i32, h: i32, q: i32, kv: i32) -> bool {
        let (q, len) = self.at(b, q);
        kv < len && (!V::HAS_MASK || self.inner.mask(b, h, q, kv))
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
        let (q_lo, len) = self.at(b, q_lo);
        let q_hi = self.at(b, q_hi).0;
        if kv_lo >= len {
            return TileClass::Empty;
        }
        let inner = if V::HAS_MASK {
            self.inner.classify_tile(b, h, q_lo, q_hi, kv_lo, kv_hi)
        } else {
            TileClass::Full
        };
        match inner {
            TileClass::Full if kv_hi >= len => TileClass::Partial,
            class => class,
        }
    }

    fn score_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 {
        self.inner.score_f64(s, b, h, self.at(b, q).0, kv)
    }

    fn score_grad_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 {
        self.inner.score_grad_f64(s, b, h, self.at(b, q).0, kv)
    }

    fn mask_f64(&self, b: i32, h: i32, q: i32, kv: i32) -> bool {
        let (q, len) = self.at(b, q);
        kv < len && (!V::HAS_MASK || self.inner.mask_f64(b, h, q, kv))
    }

    fn position_shift(&self, b: i32) -> (i32, i32) {
        let (dq, dkv) = self.inner.position_shift(b);
        (dq - self.shift[b as usize], dkv)
    }

    fn sink(&self, b: i32, h: i32, q: i32) -> f32 {
        self.inner.sink(b, h, self.at(b, q).0)
    }

    fn sink_f64(&self, b: i32, h: i32, q: i32) -> f64 {
        self.inner.sink_f64(b, h, self.at(b, q).0)
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
        self.inner
            .score_tensor_grads(s, b, h, self.at(b, q).0, kv, dz, grads);
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
        self.inner
            .score_tensor_grads_f64(s, b, h, self.at(b, q).0, kv, dz, abs, grads);
    }

    fn sink_tensor_grads(&self, b: i32, h: i32, q: i32, dz: f32, grads: &mut [&mut [f32]]) {
        self.inner
            .sink_tensor_grads(b, h, self.at(b, q).0, dz, grads);
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
        self.inner
            .sink_tensor_grads_f64(b, h, self.at(b, q).0, dz, abs, grads);
    }

    fn out_of_range(&self) -> Option<crate::Error> {
        self.inner.out_of_range()
    }
}
