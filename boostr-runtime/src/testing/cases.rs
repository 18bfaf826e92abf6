//! The standard shapes every variant is checked on.

use std::fmt;

/// One shape of the standard test set, with the magnitude of its inputs.
///
/// Inputs are drawn per run: `q` and `k` from `N(0, logit_scale²)`, `v` and
/// `dout` from `N(0, 1)`. With the default `scale = 1/sqrt(D)` the logits
/// `scale·q·k` then have standard deviation about `logit_scale²`.
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
    /// Head dimension `D`.
    pub head_dim: usize,
    /// Standard deviation of `q` and `k` (each): the input magnitude.
    pub logit_scale: f32,
    /// Short name, printed in failures.
    pub name: &'static str,
}

impl Case {
    /// `[B, Hq, Sq, D]`.
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_q, self.seq_q, self.head_dim]
    }

    /// `[B, Hkv, Sk, D]`.
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_kv, self.seq_k, self.head_dim]
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` (B={} Hq={} Hkv={} Sq={} Sk={} D={} logit_scale={})",
            self.name,
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.seq_q,
            self.seq_k,
            self.head_dim,
            self.logit_scale
        )
    }
}

/// The standard cases, smallest first. Together they cover `S ∈ {1, 17, 97,
/// 257}`, `D ∈ {40, 64, 80, 128}`, `Sq < Sk`, `Sq > Sk`, GQA 4:1, MQA,
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
        logit_scale: 1.0,
        name: "single",
    },
    // Batch 2 with odd sizes below any tile: remainder handling in both
    // dimensions, a head dim (40) that is not a power of two, and batch
    // strides.
    Case {
        batch: 2,
        heads_q: 2,
        heads_kv: 2,
        seq_q: 17,
        seq_k: 17,
        head_dim: 40,
        logit_scale: 1.0,
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
        logit_scale: 1.0,
        name: "decode_mqa",
    },
    // Chunked prefill with GQA 4:1 (Hq = 8, Hkv = 2): Sq < Sk, so query
    // positions start at Sk − Sq = 80 and dk/dv sum over four query heads.
    Case {
        batch: 1,
        heads_q: 8,
        heads_kv: 2,
        seq_q: 17,
        seq_k: 97,
        head_dim: 64,
        logit_scale: 1.0,
        name: "gqa_prefix",
    },
    // Sq > Sk: query positions start at Sk − Sq = −80, so under a causal
    // mask the first 80 rows see no key (out 0, lse −inf, zero gradients).
    Case {
        batch: 1,
        heads_q: 2,
        heads_kv: 1,
        seq_q: 97,
        seq_k: 17,
        head_dim: 80,
        logit_scale: 1.0,
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
        logit_scale: 2.0,
        name: "square_peaked",
    },
    // Logits up to ~±1e4 (std 2500): the online softmax must rescale with a
    // running max, never exponentiate a raw logit; one-hot rows.
    Case {
        batch: 1,
        heads_q: 2,
        heads_kv: 1,
        seq_q: 97,
        seq_k: 97,
        head_dim: 64,
        logit_scale: 50.0,
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
        logit_scale: 1.0,
        name: "long",
    },
];
