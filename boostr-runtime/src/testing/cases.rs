//! The standard shapes every variant is checked on.

use crate::problem::Problem;
use std::fmt;

/// How a case draws `q` and `k` (`v` and `dout` are always `N(0, 1)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// `q, k ~ N(0, logit_scale²)`, independent. With the default
    /// `scale = 1/sqrt(D)` the logits have standard deviation ≈ `logit_scale²`.
    Random,
    /// Large logits with ordinary softmax rows. `q, k ~ N(0, 1)`, then
    /// coordinate 0 is replaced: `logit_scale` in every key, and
    /// `±logit_scale·u_i` in query row `i` (`u_i ∈ [0.5, 1]`, random sign).
    /// Every logit of row `i` is shifted by `±scale·logit_scale²·u_i`
    /// (≈ ±1e4 for `logit_scale = 283`, `D = 64`): softmax ignores the shift,
    /// but a kernel that exponentiates a raw logit overflows (`+`) or
    /// underflows to `0/0` (`−`), and `lse` must be right to f32 precision at
    /// that magnitude.
    ///
    /// Why not just large random inputs (`Random` with a big `logit_scale`):
    /// then most rows are one-hot and the few rows whose top two logits nearly
    /// tie carry all the error, an f32 logit of magnitude 1e4 being known to
    /// only ~1e-3. The max error of any f32 implementation is then decided by
    /// a handful of rows, two correct implementations differ by 5× from one
    /// seed to the next, and the tolerance rule becomes a lottery. Here every
    /// row is alike, so the max error is a stable statistic.
    RowOffset,
}

/// One shape of the standard test set, with the magnitude of its inputs.
///
/// Inputs are drawn per run (see [`Logits`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Case {
    /// Batch size `B`.
    pub batch: usize,
    /// Query heads `Hq`.
    pub heads_q: usize,
    /// Key/value heads `Hkv` (divides `Hq`).
    pub heads_kv: usize,
    /// Query length `Sq`.
    pub seq_q: usize,
    /// Key length `Sk`.
    pub seq_k: usize,
    /// Head dimension `D` of queries and keys.
    pub head_dim: usize,
    /// Head dimension `Dv` of values and the output.
    pub head_dim_v: usize,
    /// Magnitude of `q` and `k` (each); see [`Logits`] for its exact use.
    pub logit_scale: f32,
    /// How `q` and `k` are drawn.
    pub logits: Logits,
    /// [`AttentionOptions::scale`](crate::AttentionOptions::scale) of the
    /// call: `None` is the default `1/sqrt(D)`.
    pub scale: Option<f32>,
    /// Short name, printed in failures.
    pub name: &'static str,
}

impl Case {
    /// The problem of the case, as validation makes it from its tensors
    /// (its shapes: [`Problem::q_shape`] and the others).
    pub fn problem(&self) -> Problem {
        let p = Problem::new(
            self.batch,
            (self.heads_q, self.heads_kv),
            (self.seq_q, self.seq_k),
            self.head_dim,
        )
        .with_head_dim_v(self.head_dim_v);
        match self.scale {
            Some(scale) => p.with_scale(scale),
            None => p,
        }
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` (B={} Hq={} Hkv={} Sq={} Sk={} D={} Dv={} logit_scale={} {:?} scale={:?})",
            self.name,
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.seq_q,
            self.seq_k,
            self.head_dim,
            self.head_dim_v,
            self.logit_scale,
            self.logits,
            self.scale
        )
    }
}

/// The standard cases, smallest first. Together they cover `S ∈ {1, 17, 97,
/// 257}`, `D ∈ {40, 64, 80, 128}`, value head dims below and above `D`
/// (64/32, 80/104), `Sq < Sk`, `Sq > Sk`, GQA 4:1, MQA,
/// batch 2 and logits of magnitude ~1e4. No length is a multiple of a
/// power-of-two tile, so every kernel runs its remainder paths. The largest
/// is `B·Hq·Sq·Sk·D = 1·4·257·257·128`.
pub const CASES: &[Case] = &[
    // One query, one key: P = 1 exactly, so dS = 0 for an identity score and
    // any mismatch is a plumbing bug (indexing, lse of a single term).
    Case {
        batch: 1,
        heads_q: 2,
        heads_kv: 2,
        seq_q: 1,
        seq_k: 1,
        head_dim: 64,
        head_dim_v: 64,
        logit_scale: 1.0,
        logits: Logits::Random,
        scale: None,
        name: "single",
    },
    // Batch 2 with odd sizes below any tile: remainder handling in both
    // dimensions, a head dim (40) that is not a power of two, batch strides,
    // and an explicit scale (0.3 rather than 1/sqrt(40)).
    Case {
        batch: 2,
        heads_q: 2,
        heads_kv: 2,
        seq_q: 17,
        seq_k: 17,
        head_dim: 40,
        head_dim_v: 40,
        logit_scale: 1.0,
        logits: Logits::Random,
        scale: Some(0.3),
        name: "batch2_odd",
    },
    // Decoding with MQA (Hkv = 1): one query row against a long cache, batch
    // 2; with bottom-right alignment the query sits at position Sk − 1, so a
    // causal mask sees every key.
    Case {
        batch: 2,
        heads_q: 4,
        heads_kv: 1,
        seq_q: 1,
        seq_k: 257,
        head_dim: 80,
        head_dim_v: 80,
        logit_scale: 1.0,
        logits: Logits::Random,
        scale: None,
        name: "decode_mqa",
    },
    // Chunked prefill with GQA 4:1 (Hq = 8, Hkv = 2): Sq < Sk, so query
    // positions start at Sk − Sq = 80 and dk/dv sum over four query heads.
    // Values half as wide as keys (MLA-like, Dv < D).
    Case {
        batch: 1,
        heads_q: 8,
        heads_kv: 2,
        seq_q: 17,
        seq_k: 97,
        head_dim: 64,
        head_dim_v: 32,
        logit_scale: 1.0,
        logits: Logits::Random,
        scale: None,
        name: "gqa_prefix",
    },
    // Sq > Sk: query positions start at Sk − Sq = −80, so under a causal
    // mask the first 80 rows see no key (out 0, lse −inf, zero gradients).
    // Values wider than keys (Dv > D), an odd width.
    Case {
        batch: 1,
        heads_q: 2,
        heads_kv: 1,
        seq_q: 97,
        seq_k: 17,
        head_dim: 80,
        head_dim_v: 104,
        logit_scale: 1.0,
        logits: Logits::Random,
        scale: None,
        name: "more_queries",
    },
    // Square, mid-sized, D = 128 with larger logits (std ~4): peaked
    // softmax rows, many tiles in both dimensions.
    Case {
        batch: 1,
        heads_q: 2,
        heads_kv: 2,
        seq_q: 97,
        seq_k: 97,
        head_dim: 128,
        head_dim_v: 128,
        logit_scale: 2.0,
        logits: Logits::Random,
        scale: None,
        name: "square_peaked",
    },
    // Logits shifted by up to ±283²/8 ≈ ±1e4 per row: the online softmax
    // must subtract a running max, never exponentiate a raw logit, and keep
    // lse ~ ±1e4 to f32 precision.
    Case {
        batch: 1,
        heads_q: 2,
        heads_kv: 1,
        seq_q: 97,
        seq_k: 97,
        head_dim: 64,
        head_dim_v: 64,
        logit_scale: 283.0,
        logits: Logits::RowOffset,
        scale: None,
        name: "large_logits",
    },
    // The largest: S = 257 (one past a power of two) in both dimensions with
    // D = 128, four heads.
    Case {
        batch: 1,
        heads_q: 4,
        heads_kv: 4,
        seq_q: 257,
        seq_k: 257,
        head_dim: 128,
        head_dim_v: 128,
        logit_scale: 1.0,
        logits: Logits::Random,
        scale: None,
        name: "long",
    },
];

/// A smaller set for slow backends (software GPU adapters): the same kinds of
/// shapes as [`CASES`] — odd lengths below and across tiles, batch 2, MQA,
/// GQA 4:1, `Sq < Sk`, `Sq > Sk` (rows with no visible key under a causal
/// mask), peaked and ~1e4 logits, an explicit scale — at a few percent of
/// the work, all at one pair of head dims, `D` = 80 and `Dv` = 56.
///
/// Why one: each pair of head dims of a variant is a set of pipelines
/// that a software adapter compiles one at a time (Mesa's lavapipe holds
/// one lock per device while it compiles), and compiling is most of what
/// such a check costs. The code that depends on the head dims (the
/// head-dim loops, the staged rows per tile) is the same for every
/// variant, so the other head dims are checked once per backend, on one
/// variant ([`HEAD_DIM_CASES`]). Why 80/56: values narrower than keys
/// (MLA's shape) run every product over its own dim and the loops over
/// both dims their remainder; 80 is not a power of two, the WGSL kernels
/// roll its head-dim loops (the cheaper compile), and it stages 30 keys
/// per tile, so tile edges fall off every power of two. The largest is
/// `B·Hq·Sq·Sk·D = 1·8·7·23·80`.
pub const SMALL_CASES: &[Case] = &[
    Case {
        head_dim: 80,
        head_dim_v: 56,
        ..CASES[0]
    },
    Case {
        head_dim: 80,
        head_dim_v: 56,
        ..CASES[1]
    },
    Case {
        seq_k: 33,
        head_dim_v: 56,
        ..CASES[2]
    },
    Case {
        seq_q: 7,
        seq_k: 23,
        head_dim: 80,
        head_dim_v: 56,
        ..CASES[3]
    },
    Case {
        seq_q: 23,
        seq_k: 7,
        head_dim_v: 56,
        ..CASES[4]
    },
    Case {
        seq_q: 19,
        seq_k: 19,
        head_dim: 80,
        head_dim_v: 56,
        ..CASES[5]
    },
    Case {
        seq_q: 19,
        seq_k: 19,
        head_dim: 80,
        head_dim_v: 56,
        ..CASES[6]
    },
];

/// The other head dims of the backends that run [`SMALL_CASES`], on both
/// sides of the WGSL kernels' unrolling limit
/// (`kernels_spec::emit::wgsl::UNROLL_MAX_HEAD_DIM`): values as wide as
/// the keys at 40 (not a power of two, batch 2, odd lengths, an explicit
/// scale), 64 (GQA 4:1, `Sq < Sk`) and 128 (peaked logits), and values
/// wider than the keys, 32/48 (`Sq > Sk`).
pub const HEAD_DIM_CASES: &[Case] = &[
    CASES[1],
    Case {
        seq_q: 7,
        seq_k: 23,
        head_dim_v: 64,
        ..CASES[3]
    },
    Case {
        seq_q: 19,
        seq_k: 19,
        ..CASES[5]
    },
    Case {
        seq_q: 23,
        seq_k: 7,
        head_dim: 32,
        head_dim_v: 48,
        ..CASES[4]
    },
];

/// The CPU's cases: [`CASES`], [`SMALL_CASES`], and the shapes of
/// [`HEAD_DIM_CASES`] that `CASES` lacks (its first is `CASES`' own).
/// Every shape a GPU backend is checked on is then one the CPU is checked
/// on too, each against the f64 reference, so a GPU backend agrees with
/// the CPU on all of them to within the sum of their two tolerances
/// without a check of its own against the CPU.
pub const CPU_CASES: &[Case] =
    &concat::<{ CASES.len() + SMALL_CASES.len() + HEAD_DIM_CASES.len() - 1 }>(
        &concat::<{ CASES.len() + SMALL_CASES.len() }>(CASES, SMALL_CASES),
        HEAD_DIM_CASES.split_at(1).1,
    );

/// `a` then `b`, as one array of `N = a.len() + b.len()` cases.
const fn concat<const N: usize>(a: &[Case], b: &[Case]) -> [Case; N] {
    assert!(a.len() + b.len() == N);
    let mut out = [a[0]; N];
    let mut i = 0;
    while i < a.len() {
        out[i] = a[i];
        i += 1;
    }
    let mut j = 0;
    while j < b.len() {
        out[a.len() + j] = b[j];
        j += 1;
    }
    out
}
