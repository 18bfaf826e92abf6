//! Stock variants, declared with the same macro users use. Each lists test
//! instances, so `cargo test` checks every one of them on every backend.

use crate::attention;

/// Plain softmax attention: no score modification, no mask.
#[attention(tests = [Full])]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Full;

/// Causal attention: key `kv` is visible to query `q` when `kv <= q`
/// (positions bottom-right aligned, so this holds for prefill and decode).
#[attention(mask = |_b, _h, q, kv| kv <= q, tests = [Causal])]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Causal;

/// Symmetric local attention: keys within `window - 1` positions either side.
#[attention(
    mask = |_b, _h, q, kv| q - kv < self.window && kv - q < self.window,
    tests = [SlidingWindow { window: 16 }, SlidingWindow { window: 1 }],
)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Keys with `|q - kv| < window` are visible.
    pub window: i32,
}

/// Causal local attention (Mistral): the `window` most recent keys, itself included.
#[attention(
    mask = |_b, _h, q, kv| kv <= q && q - kv < self.window,
    tests = [CausalSlidingWindow { window: 32 }, CausalSlidingWindow { window: 3 }],
)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CausalSlidingWindow {
    /// Keys with `0 <= q - kv < window` are visible.
    pub window: i32,
}

/// ALiBi (Press et al.): causal attention with a linear distance penalty whose
/// slope falls geometrically with the head, `m_h = 2^(-8 (h + 1) / heads)`.
#[attention(
    score = |s, _b, h, q, kv| s - exp2(-8.0 * ((h + 1) as f32) / (self.heads as f32)) * ((q - kv) as f32),
    mask = |_b, _h, q, kv| kv <= q,
    tests = [Alibi { heads: 4 }, Alibi { heads: 1 }],
)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Alibi {
    /// Number of query heads the slopes are spread over.
    pub heads: i32,
}

/// Logit soft-capping (Gemma 2, Grok): `cap * tanh(s / cap)`, no mask.
#[attention(
    score = |s, _b, _h, _q, _kv| self.cap * tanh(s / self.cap),
    tests = [Softcap { cap: 30.0 }, Softcap { cap: 0.5 }],
)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Softcap {
    /// The cap: logits are squashed into `(-cap, cap)`.
    pub cap: f32,
}

/// Causal attention with logit soft-capping (Gemma 2).
#[attention(
    score = |s, _b, _h, _q, _kv| self.cap * tanh(s / self.cap),
    mask = |_b, _h, q, kv| kv <= q,
    tests = [CausalSoftcap { cap: 30.0 }, CausalSoftcap { cap: 2.0 }],
)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CausalSoftcap {
    /// The cap: logits are squashed into `(-cap, cap)`.
    pub cap: f32,
}

/// Prefix-LM: the first `prefix` keys are visible to every query
/// (bidirectional prefix), the rest causally.
#[attention(
    mask = |_b, _h, q, kv| kv < self.prefix || kv <= q,
    tests = [PrefixLm { prefix: 20 }, PrefixLm { prefix: 0 }],
)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefixLm {
    /// Length of the bidirectional prefix.
    pub prefix: i32,
}

/// The mask of [`var_flash_attention`](crate::var_flash_attention): optional
/// causality and an optional window `q - kv < window` (`window <= 0`: none).
#[attention(
    mask = |_b, _h, q, kv| (!self.causal || kv <= q) && (self.window <= 0 || q - kv < self.window),
    tests = [
        FlashMask { causal: true, window: 0 },
        FlashMask { causal: false, window: 0 },
        FlashMask { causal: true, window: 24 },
        FlashMask { causal: false, window: 7 },
    ],
)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashMask {
    /// Keys after the query are hidden.
    pub causal: bool,
    /// When positive, keys with `q - kv >= window` are hidden.
    pub window: i32,
}

/// Calls `$callback!` with the name of every stock variant, so that code
/// which enumerates them (tests, tools) lists them from here:
/// `boostr_runtime::stock_variants!(my_macro)` expands to
/// `my_macro!(Full, Causal, ...)`, each name a type of this module.
#[macro_export]
macro_rules! stock_variants {
    ($callback:ident) => {
        $callback!(
            Full,
            Causal,
            SlidingWindow,
            CausalSlidingWindow,
            Alibi,
            Softcap,
            CausalSoftcap,
            PrefixLm,
            FlashMask,
        )
    };
}
