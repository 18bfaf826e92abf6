//! Hand-written variants and test data the runtime's own tests share, each
//! declared once.

use crate::variant::{HostVariant, TileClass};

/// The [`HostVariant`] functions of an identity `score`, in f32 and f64.
macro_rules! identity_score {
    () => {
        fn score(&self, s: f32, _: i32, _: i32, _: i32, _: i32) -> f32 {
            s
        }
        fn score_grad(&self, _: f32, _: i32, _: i32, _: i32, _: i32) -> f32 {
            1.0
        }
        fn score_f64(&self, s: f64, _: i32, _: i32, _: i32, _: i32) -> f64 {
            s
        }
        fn score_grad_f64(&self, _: f64, _: i32, _: i32, _: i32, _: i32) -> f64 {
            1.0
        }
    };
}
pub(crate) use identity_score;

/// The mask functions of a variant without a mask (`HAS_MASK = false`):
/// the kernels must never call `mask` or `classify_tile`, which panic; the
/// reference's `mask_exact` sees every key.
macro_rules! no_mask_to_call {
    () => {
        fn mask(&self, _: i32, _: i32, _: i32, _: i32) -> bool {
            panic!("mask called on a variant without one")
        }
        fn classify_tile(
            &self,
            _: i32,
            _: i32,
            _: i32,
            _: i32,
            _: i32,
            _: i32,
        ) -> $crate::variant::TileClass {
            panic!("classify_tile called on a variant without a mask")
        }
        fn mask_exact(&self, _: i32, _: i32, _: i32, _: i32) -> bool {
            true
        }
    };
}
pub(crate) use no_mask_to_call;

/// Plain attention: no mask, identity score.
#[derive(Clone, Debug)]
pub(crate) struct Plain;

impl HostVariant for Plain {
    const NAME: &'static str = "Plain";
    const SCORE_IS_IDENTITY: bool = true;
    const HAS_MASK: bool = false;
    crate::testing::fixtures::identity_score!();
    fn mask(&self, _: i32, _: i32, _: i32, _: i32) -> bool {
        true
    }
    fn classify_tile(&self, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32) -> TileClass {
        TileClass::Full
    }
    fn mask_exact(&self, _: i32, _: i32, _: i32, _: i32) -> bool {
        true
    }
}

crate::hand_written_variant!(Plain);

/// [`Plain`] whose mask and classifier panic: kernels must never call them
/// when `HAS_MASK` is false.
#[derive(Clone, Debug)]
pub(crate) struct Unmasked;

impl HostVariant for Unmasked {
    const NAME: &'static str = "Unmasked";
    const SCORE_IS_IDENTITY: bool = true;
    const HAS_MASK: bool = false;
    crate::testing::fixtures::identity_score!();
    crate::testing::fixtures::no_mask_to_call!();
}

crate::hand_written_variant!(Unmasked);

/// Tile class of `kv ≤ q` over `[q_lo, q_hi] × [kv_lo, kv_hi]`.
pub(crate) fn causal_class(q_lo: i32, q_hi: i32, kv_lo: i32, kv_hi: i32) -> TileClass {
    if kv_hi <= q_lo {
        TileClass::Full
    } else if kv_lo > q_hi {
        TileClass::Empty
    } else {
        TileClass::Partial
    }
}

/// Causal mask with a tanh softcap; `score_grad` is right unless `wrong_grad`.
#[derive(Clone, Debug)]
pub(crate) struct CausalSoftcap {
    pub(crate) cap: f32,
    /// Claim `score_grad = 1` (a broken derivative, for the FD check's teeth).
    pub(crate) wrong_grad: bool,
    /// Claim every tile is `Full` (a broken classifier).
    pub(crate) lying_tiles: bool,
}

impl CausalSoftcap {
    pub(crate) const fn new(cap: f32) -> Self {
        Self {
            cap,
            wrong_grad: false,
            lying_tiles: false,
        }
    }
}

impl HostVariant for CausalSoftcap {
    const NAME: &'static str = "CausalSoftcap";
    const SCORE_IS_IDENTITY: bool = false;
    const HAS_MASK: bool = true;
    fn score(&self, s: f32, _: i32, _: i32, _: i32, _: i32) -> f32 {
        self.cap * (s / self.cap).tanh()
    }
    fn score_grad(&self, s: f32, _: i32, _: i32, _: i32, _: i32) -> f32 {
        if self.wrong_grad {
            return 1.0;
        }
        let t = (s / self.cap).tanh();
        1.0 - t * t
    }
    fn mask(&self, _: i32, _: i32, q: i32, kv: i32) -> bool {
        kv <= q
    }
    fn classify_tile(
        &self,
        _: i32,
        _: i32,
        q_lo: i32,
        q_hi: i32,
        kv_lo: i32,
        kv_hi: i32,
    ) -> TileClass {
        if self.lying_tiles {
            TileClass::Full
        } else {
            causal_class(q_lo, q_hi, kv_lo, kv_hi)
        }
    }
    fn score_f64(&self, s: f64, _: i32, _: i32, _: i32, _: i32) -> f64 {
        let cap = f64::from(self.cap);
        cap * (s / cap).tanh()
    }
    fn score_grad_f64(&self, s: f64, _: i32, _: i32, _: i32, _: i32) -> f64 {
        if self.wrong_grad {
            return 1.0;
        }
        let t = (s / f64::from(self.cap)).tanh();
        1.0 - t * t
    }
    fn mask_exact(&self, _: i32, _: i32, q: i32, kv: i32) -> bool {
        kv <= q
    }
}

crate::hand_written_variant!(CausalSoftcap);

/// Every key row of `k` and `v` (`[B, Hkv, cap, d]` and `[B, Hkv, cap,
/// d_v]`) past its sequence's length (`len(b)`) filled with `fills` (K, V):
/// cache slots that no kernel may read.
pub(crate) fn fill_spare_slots(
    (k, v): (&mut [f32], &mut [f32]),
    (hkv, cap, (d, d_v)): (usize, usize, (usize, usize)),
    len: impl Fn(usize) -> usize,
    fills: (f32, f32),
) {
    for (row, (k, v)) in k.chunks_mut(d).zip(v.chunks_mut(d_v)).enumerate() {
        if row % cap >= len(row / (hkv * cap)) {
            k.fill(fills.0);
            v.fill(fills.1);
        }
    }
}
