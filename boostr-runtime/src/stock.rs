//! Stock variants, declared with the same macro users use. Each lists test
//! instances, so `cargo test` checks every one of them on every backend.

//!
//! Tensor fields declared `Var<R>` are learnable: given as a `Var` that
//! requires grad, `var_attention` and `attention_backward` return their
//! gradients, on every backend; a `Var::new(t, false)` reads them like any
//! captured tensor.

use crate::attention;
use numr::autograd::Var;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

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

/// Packed documents (sequences concatenated without padding): a query sees
/// the keys of its own document. Document ids come from a tensor over key
/// positions, so one tensor serves both sides (`Sq ≤ Sk`: query row `i`
/// sits at position `i + Sk − Sq`; with `Sq > Sk` the first rows' positions
/// are negative, and the call fails with the read out of range).
///
/// Tiles are classified from per-call summaries of the ids: with ids sorted
/// within each sequence, every tile whose queries and keys share no
/// document is skipped and every tile inside one document runs unmasked.
#[attention(
    mask = |b, _h, q, kv| self.doc[b][q] == self.doc[b][kv],
    tests = [
        |data| Documents { doc: data.documents() },
        |data| Documents { doc: data.unsorted_documents() },
    ],
)]
#[derive(Clone, Debug)]
pub struct Documents<R: Runtime> {
    /// The document id of every position, `[B, Sk]` `i32` (sorted within
    /// each sequence for exact tile skipping; any ids are correct).
    #[tensor(i32, [B, Sk])]
    pub doc: Tensor<R>,
}

/// Causal attention within packed documents: [`Documents`] and `kv <= q`.
#[attention(
    mask = |b, _h, q, kv| kv <= q && self.doc[b][q] == self.doc[b][kv],
    tests = [|data| CausalDocuments { doc: data.documents() }],
)]
#[derive(Clone, Debug)]
pub struct CausalDocuments<R: Runtime> {
    /// The document id of every position, `[B, Sk]` `i32`.
    #[tensor(i32, [B, Sk])]
    pub doc: Tensor<R>,
}

/// A padded batch, or a KV cache with per-sequence lengths: the keys at
/// positions `len[b]` and past are hidden (whatever their K and V rows
/// hold), and the tiles past a length are skipped.
#[attention(
    mask = |b, _h, _q, kv| kv < self.len[b],
    tests = [|data| KvLengths { len: data.lengths() }],
)]
#[derive(Clone, Debug)]
pub struct KvLengths<R: Runtime> {
    /// The number of valid keys of each sequence, `[B]` `i32`.
    #[tensor(i32, [B])]
    pub len: Tensor<R>,
}

/// Causal attention over per-sequence key lengths: [`KvLengths`] and
/// `kv <= q`.
#[attention(
    mask = |b, _h, q, kv| kv <= q && kv < self.len[b],
    tests = [|data| CausalKvLengths { len: data.lengths() }],
)]
#[derive(Clone, Debug)]
pub struct CausalKvLengths<R: Runtime> {
    /// The number of valid keys of each sequence, `[B]` `i32`.
    #[tensor(i32, [B])]
    pub len: Tensor<R>,
}

/// A relative-position bias table (T5-style, here read-only): the logit of
/// a pair gets `table[h][d + max_distance]`, `d = q − kv` clipped to
/// `±max_distance`. The table's width is declared `_`; a table narrower
/// than `2·max_distance + 1` makes the call fail with the read out of range.
#[attention(
    score = |s, _b, h, q, kv| s + self.table[h][clamp(q - kv, -self.max_distance, self.max_distance) + self.max_distance],
    tests = [
        |data| RelativeBias { table: data.f32s(&[data.heads_q(), 17], -1.0, 1.0), max_distance: 8 },
        // One column short: reads at distance 8 or more fail.
        |data| RelativeBias { table: data.f32s(&[data.heads_q(), 16], -1.0, 1.0), max_distance: 8 },
    ],
)]
#[derive(Clone, Debug)]
pub struct RelativeBias<R: Runtime> {
    /// The bias of each (query head, clipped distance), `[Hq, 2·max_distance + 1]` `f32`.
    #[tensor(f32, [Hq, _])]
    pub table: Tensor<R>,
    /// Distances are clipped to `-max_distance ..= max_distance`.
    pub max_distance: i32,
}

/// ALiBi with learnable per-head slopes: causal, the logit of a pair
/// lowered by `slopes[h] · (q − kv)`; the slopes' gradient is
/// `−Σ dS · (q − kv)` over each head's visible pairs.
#[attention(
    score = |s, _b, h, q, kv| s - self.slopes[h] * ((q - kv) as f32),
    mask = |_b, _h, q, kv| kv <= q,
    tests = [|data| AlibiSlopes { slopes: data.learnable(&[data.heads_q()], 0.0, 0.5) }],
)]
#[derive(Clone, Debug)]
pub struct AlibiSlopes<R: Runtime> {
    /// The slope of each query head, `[Hq]` `f32`.
    #[tensor(f32, [Hq])]
    pub slopes: Var<R>,
}

/// T5's relative position bias (Raffel et al.), bidirectional as in its
/// encoder: a learnable `[Hq, 32]` table of per-head biases, indexed by
/// T5's bucket of `kv − q`, 16 buckets for each direction: distances below
/// 8 exactly, then logarithmic up to 128 (`8 + ⌊2·log2(n / 8)⌋`, written
/// as its thresholds so that every target rounds it alike), and 15 beyond.
#[attention(
    score = |s, _b, h, q, kv| {
        let rel = kv - q;
        let n = abs(rel);
        let large = 8 + (if n >= 12 { 1 } else { 0 }) + (if n >= 16 { 1 } else { 0 })
            + (if n >= 23 { 1 } else { 0 }) + (if n >= 32 { 1 } else { 0 })
            + (if n >= 46 { 1 } else { 0 }) + (if n >= 64 { 1 } else { 0 })
            + (if n >= 91 { 1 } else { 0 });
        let bucket = (if rel > 0 { 16 } else { 0 }) + (if n < 8 { clamp(n, 0, 7) } else { large });
        s + self.buckets[h][bucket]
    },
    tests = [|data| T5Bias { buckets: data.learnable(&[data.heads_q(), 32], -1.0, 1.0) }],
)]
#[derive(Clone, Debug)]
pub struct T5Bias<R: Runtime> {
    /// The bias of each (query head, bucket), `[Hq, 32]` `f32`.
    #[tensor(f32, [Hq, 32])]
    pub buckets: Var<R>,
}

/// T5's relative position bias as in its decoder: causal, with 32
/// unidirectional buckets of `q − kv` (below 16 exactly, then
/// `16 + ⌊16·log2(n / 16) / 3⌋` up to 128, as thresholds, and 31 beyond).
#[attention(
    score = |s, _b, h, q, kv| {
        let n = q - kv;
        let large = 16 + (if n >= 19 { 1 } else { 0 }) + (if n >= 21 { 1 } else { 0 })
            + (if n >= 24 { 1 } else { 0 }) + (if n >= 27 { 1 } else { 0 })
            + (if n >= 31 { 1 } else { 0 }) + (if n >= 35 { 1 } else { 0 })
            + (if n >= 40 { 1 } else { 0 }) + (if n >= 46 { 1 } else { 0 })
            + (if n >= 52 { 1 } else { 0 }) + (if n >= 59 { 1 } else { 0 })
            + (if n >= 67 { 1 } else { 0 }) + (if n >= 77 { 1 } else { 0 })
            + (if n >= 87 { 1 } else { 0 }) + (if n >= 99 { 1 } else { 0 })
            + (if n >= 113 { 1 } else { 0 });
        s + self.buckets[h][if n < 16 { clamp(n, 0, 15) } else { large }]
    },
    mask = |_b, _h, q, kv| kv <= q,
    tests = [|data| CausalT5Bias { buckets: data.learnable(&[data.heads_q(), 32], -1.0, 1.0) }],
)]
#[derive(Clone, Debug)]
pub struct CausalT5Bias<R: Runtime> {
    /// The bias of each (query head, bucket), `[Hq, 32]` `f32`.
    #[tensor(f32, [Hq, 32])]
    pub buckets: Var<R>,
}

/// gpt-oss attention: a causal sliding window with a learned sink logit per
/// query head, which takes a share of every row's softmax and carries no
/// value (a learnable `[Hq]` tensor; a row that sees no key has `out = 0`
/// and `lse` = its head's sink). The sinks' gradient is
/// `−Σ_rows e^(sink − lse) · D_i` over each head's rows.
#[attention(
    mask = |_b, _h, q, kv| kv <= q && q - kv < self.window,
    sink = |_b, h, _q| self.sinks[h],
    tests = [
        |data| CausalSlidingWindowSinks { window: 16, sinks: data.learnable(&[data.heads_q()], -2.0, 2.0) },
        |data| CausalSlidingWindowSinks { window: 3, sinks: data.learnable(&[data.heads_q()], 0.0, 4.0) },
    ],
)]
#[derive(Clone, Debug)]
pub struct CausalSlidingWindowSinks<R: Runtime> {
    /// Keys with `0 <= q - kv < window` are visible.
    pub window: i32,
    /// The sink logit of each query head, `[Hq]` `f32`.
    #[tensor(f32, [Hq])]
    pub sinks: Var<R>,
}

/// Sigmoid attention (FlashSigmoid, Ramapuram et al. 2024): each pair
/// weighs `sigmoid(s + bias)`, with no normalisation over the row and no
/// lse; `bias = −ln(Sk)` keeps a long row's weights summing to about one.
#[attention(
    score = |s, _b, _h, _q, _kv| s + self.bias,
    normalize = sigmoid,
    tests = [SigmoidAttention { bias: -2.0 }, SigmoidAttention { bias: 0.0 }],
)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SigmoidAttention {
    /// Added to every logit before the sigmoid (FlashSigmoid: `−ln(Sk)`).
    pub bias: f32,
}

/// Causal sigmoid attention: [`SigmoidAttention`] over keys `kv <= q`.
#[attention(
    score = |s, _b, _h, _q, _kv| s + self.bias,
    mask = |_b, _h, q, kv| kv <= q,
    normalize = sigmoid,
    tests = [CausalSigmoid { bias: -3.0 }],
)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CausalSigmoid {
    /// Added to every logit before the sigmoid.
    pub bias: f32,
}

/// Causal attention with dropout on the probabilities: each call drops a
/// pair with probability `p` (drawn from the call's
/// [`dropout_seed`](crate::AttentionOptions::dropout_seed) and
/// offset) and scales the rest by `1/(1 − p)`; the backward draws the same
/// pairs again.
#[attention(
    mask = |_b, _h, q, kv| kv <= q,
    dropout = self.p,
    tests = [CausalDropout { p: 0.1 }, CausalDropout { p: 0.6 }],
)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CausalDropout {
    /// The probability of dropping a pair, in `[0, 1)`.
    pub p: f32,
}

/// Speculative decoding over a tree of draft tokens (SpecInfer, Medusa,
/// EAGLE; FlashInfer's tree attention): a sequence's last keys are draft
/// tokens, one query row each, and a row sees the keys before the drafts
/// and its own ancestors in the tree (itself included), never its
/// siblings' branches.
///
/// The tree is each position's preorder interval: draft `j` is an
/// ancestor of draft `i` (or `i` itself) when `pre[j] <= pre[i] < end[j]`;
/// every position before the drafts has `pre = 0` and `end = i32::MAX`,
/// seen by all. Build it from parent indices
/// ([`DraftTree::from_parents`]) or ancestor bit masks
/// ([`DraftTree::from_masks`]); the mask is two reads and three
/// comparisons, so the tiles before the drafts stay whole and are never
/// masked element by element.
#[attention(
    mask = |b, _h, q, kv| kv <= q && self.pre[b][kv] <= self.pre[b][q] && self.pre[b][q] < self.end[b][kv],
    tests = [|data| data.draft_tree()],
)]
#[derive(Clone, Debug)]
pub struct DraftTree<R: Runtime> {
    /// Each position's preorder number: 0 before the drafts, then 1 ..
    /// `n` over the drafts. `[B, Sk]` `i32`.
    #[tensor(i32, [B, Sk])]
    pub pre: Tensor<R>,
    /// The end of each position's preorder interval: its `pre` plus the
    /// size of its subtree; `i32::MAX` before the drafts. `[B, Sk]` `i32`.
    #[tensor(i32, [B, Sk])]
    pub end: Tensor<R>,
}

/// Calls `$callback!` with the type of every stock variant, so that code
/// which enumerates them (tests, tools) lists them from here:
/// `boostr_runtime::stock_variants!(my_macro)` expands to
/// `my_macro!(boostr_runtime::stock::Full, ...)`, the variants with
/// tensors at the CPU runtime (`Documents<CpuRuntime>`).
#[macro_export]
macro_rules! stock_variants {
    ($callback:ident) => {
        $callback!(
            $crate::stock::Full,
            $crate::stock::Causal,
            $crate::stock::SigmoidAttention,
            $crate::stock::CausalSigmoid,
            $crate::stock::CausalDropout,
            $crate::stock::SlidingWindow,
            $crate::stock::CausalSlidingWindow,
            $crate::stock::Alibi,
            $crate::stock::Softcap,
            $crate::stock::CausalSoftcap,
            $crate::stock::PrefixLm,
            $crate::stock::FlashMask,
            $crate::stock::Documents<$crate::testing::CpuRuntime>,
            $crate::stock::CausalDocuments<$crate::testing::CpuRuntime>,
            $crate::stock::KvLengths<$crate::testing::CpuRuntime>,
            $crate::stock::CausalKvLengths<$crate::testing::CpuRuntime>,
            $crate::stock::RelativeBias<$crate::testing::CpuRuntime>,
            $crate::stock::AlibiSlopes<$crate::testing::CpuRuntime>,
            $crate::stock::T5Bias<$crate::testing::CpuRuntime>,
            $crate::stock::CausalT5Bias<$crate::testing::CpuRuntime>,
            $crate::stock::CausalSlidingWindowSinks<$crate::testing::CpuRuntime>,
            $crate::stock::DraftTree<$crate::testing::CpuRuntime>,
        )
    };
}

#[cfg(test)]
mod tests {
    //! Tile classification over data against brute force: exact for sorted
    //! document ids and for lengths, sound for anything.

    use super::*;
    use crate::testing::{CpuRuntime, TestData};
    use crate::variant::TileClass;
    use crate::{HostVariant, Problem, Variant};
    use numr::runtime::cpu::CpuDevice;

    fn problem(batch: usize, s: usize) -> Problem {
        Problem::new(batch, (2, 1), (s, s), 8).with_scale(1.0)
    }

    /// The class of a tile from every pair of it.
    fn brute<H: HostVariant>(
        host: &H,
        b: i32,
        (q_lo, q_hi): (i32, i32),
        (k_lo, k_hi): (i32, i32),
    ) -> TileClass {
        let (mut any, mut all) = (false, true);
        for q in q_lo..=q_hi {
            for kv in k_lo..=k_hi {
                let m = host.mask(b, 0, q, kv);
                any |= m;
                all &= m;
            }
        }
        match (any, all) {
            (false, _) => TileClass::Empty,
            (true, true) => TileClass::Full,
            _ => TileClass::Partial,
        }
    }

    /// Every square tile of side `t` (positions multiples of `t`), and
    /// tiles of `t` queries by `t / 2` keys: the classifier against brute
    /// force. `exact`: equal on the square ones; always sound.
    fn check<V: Variant>(variant: &V, p: &Problem, exact: bool) -> (usize, usize) {
        let host = variant.host(p).expect("the tensors fit");
        let s = p.seq_k as i32;
        let (mut tiles, mut skipped) = (0, 0);
        for t in [16, 32, 64, 128] {
            for (tq, tk) in [(t, t), (t, t / 2)] {
                for b in 0..p.batch as i32 {
                    for q0 in (0..s).step_by(tq as usize) {
                        for k0 in (0..s).step_by(tk as usize) {
                            let qr = (q0, (q0 + tq).min(s) - 1);
                            let kr = (k0, (k0 + tk).min(s) - 1);
                            let got = host.classify_tile(b, 0, qr.0, qr.1, kr.0, kr.1);
                            let want = brute(&host, b, qr, kr);
                            assert!(
                                got == want || got == TileClass::Partial,
                                "{}: unsound: tile {qr:?} x {kr:?} of batch {b} is {want:?}, \
                                 classified {got:?}",
                                V::NAME
                            );
                            if exact && tq == tk {
                                assert_eq!(
                                    got,
                                    want,
                                    "{}: tile {qr:?} x {kr:?} of batch {b}",
                                    V::NAME
                                );
                            }
                            tiles += 1;
                            skipped += usize::from(got == TileClass::Empty);
                        }
                    }
                }
            }
        }
        (tiles, skipped)
    }

    #[test]
    fn sorted_documents_classify_exactly() {
        let device = CpuDevice::new();
        for seed in 0..8 {
            let p = problem(2, 300);
            let mut data = TestData::<CpuRuntime>::new(p, &device, seed, 0);
            let doc = data.documents();
            let (_, skipped) = check(&Documents { doc: doc.clone() }, &p, true);
            assert!(skipped > 0, "documents of at most 100 positions skip tiles");
            check(&CausalDocuments { doc }, &p, true);
        }
    }

    #[test]
    fn lengths_classify_exactly() {
        let device = CpuDevice::new();
        for seed in 0..8 {
            let p = problem(4, 200);
            let mut data = TestData::<CpuRuntime>::new(p, &device, seed, seed);
            let len = data.lengths();
            check(&KvLengths { len: len.clone() }, &p, true);
            check(&CausalKvLengths { len }, &p, true);
        }
    }

    #[test]
    fn unsorted_documents_stay_sound() {
        let device = CpuDevice::new();
        for seed in 0..8 {
            let p = problem(2, 150);
            let mut data = TestData::<CpuRuntime>::new(p, &device, seed, 0);
            let doc = data.unsorted_documents();
            check(&Documents { doc: doc.clone() }, &p, false);
            check(&CausalDocuments { doc }, &p, false);
        }
    }
}
