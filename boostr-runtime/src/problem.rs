//! The validated shape of one attention call, shared by every backend.

/// Sizes of one attention call. Layout (all contiguous, row-major):
/// `q [batch, heads_q, seq_q, head_dim]`, `k [batch, heads_kv, seq_k,
/// head_dim]`, `v [batch, heads_kv, seq_k, head_dim_v]`, `out [batch,
/// heads_q, seq_q, head_dim_v]`, `lse [batch, heads_q, seq_q]`.
///
/// The value head dim `Dv` may differ from the query/key head dim `D`
/// (DeepSeek's MLA: 192/128 in prefill, 576/512 in absorbed decode); the
/// default scale stays `1/sqrt(D)`.
///
/// Validation (see `validate`) builds it from the tensors, so every field is
/// non-zero and `heads_q % heads_kv == 0`; [`Problem::new`] builds one by
/// hand (kernel tests, benchmarks).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Problem {
    /// Batch size `B`.
    pub batch: usize,
    /// Query heads `Hq`.
    pub heads_q: usize,
    /// Key/value heads `Hkv` (divides `Hq`; query head `h` reads kv head `h / (Hq / Hkv)`).
    pub heads_kv: usize,
    /// Query length `Sq`.
    pub seq_q: usize,
    /// Key length `Sk`.
    pub seq_k: usize,
    /// Head dimension `D` of queries and keys.
    pub head_dim: usize,
    /// Head dimension `Dv` of values and the output.
    pub head_dim_v: usize,
    /// Multiplier of `q·k` before `score` (default `1/sqrt(D)`).
    pub scale: f32,
    /// The call's dropout draw ([`Dropout::NONE`] keeps every pair).
    pub dropout: Dropout,
    /// The forward also returns each row's largest modified score.
    pub max_scores: bool,
}

/// The dropout draw of one call: which pairs it keeps, from a counter-based
/// generator keyed by `(seed, b, h, q, kv)` and the call's offset, the same
/// bits on every backend and in the backward
/// ([`kernels_spec::dropout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Dropout {
    /// A pair whose draw is below it is dropped: `round(p · 2^32)`; 0
    /// keeps every pair, and the kernels then draw nothing.
    pub threshold: u32,
    /// The bits of `1/(1 − p)` (f32), a kept pair's factor.
    pub scale_bits: u32,
    /// The generator's key.
    pub seed: u64,
    /// The call's offset, the counter's last word.
    pub offset: u32,
}

impl Dropout {
    /// No dropout: every pair kept, with factor 1.
    pub const NONE: Dropout = Dropout {
        threshold: 0,
        scale_bits: 0x3f80_0000,
        seed: 0,
        offset: 0,
    };

    /// Probability `p` with `seed` and `offset`; `None` for a `p` outside
    /// `[0, 1)`.
    pub fn new(p: f32, seed: u64, offset: u32) -> Option<Dropout> {
        Some(Dropout {
            threshold: kernels_spec::dropout::threshold(p)?,
            scale_bits: kernels_spec::dropout::keep_scale(p).to_bits(),
            seed,
            offset,
        })
    }

    /// Some pair may be dropped (`p > 0`).
    pub fn active(&self) -> bool {
        self.threshold != 0
    }

    /// A kept pair's factor, `1/(1 − p)`.
    pub fn scale(&self) -> f32 {
        f32::from_bits(self.scale_bits)
    }

    /// The words the GPU kernels read at the end of the parameter block
    /// ([`kernels_spec::dropout::Word`]).
    pub fn words(&self) -> [u32; kernels_spec::dropout::DROPOUT_WORDS] {
        [
            self.threshold,
            self.scale_bits,
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.offset,
        ]
    }
}

impl Default for Dropout {
    fn default() -> Self {
        Self::NONE
    }
}

impl Problem {
    /// `q [batch, heads_q, seq_q, head_dim]` against `k, v [batch,
    /// heads_kv, seq_k, head_dim]`, with `Dv = D` and the default scale
    /// `1/sqrt(D)`. Unchecked: the ops validate their tensors; this is for
    /// calling the kernels directly.
    pub fn new(
        batch: usize,
        (heads_q, heads_kv): (usize, usize),
        (seq_q, seq_k): (usize, usize),
        head_dim: usize,
    ) -> Self {
        Self {
            batch,
            heads_q,
            heads_kv,
            seq_q,
            seq_k,
            head_dim,
            head_dim_v: head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            dropout: Dropout::NONE,
            max_scores: false,
        }
    }

    /// The same problem with values (and the output) of head dim `dv`.
    pub fn with_head_dim_v(self, dv: usize) -> Self {
        Self {
            head_dim_v: dv,
            ..self
        }
    }

    /// The same problem with `q·k` multiplied by `scale`.
    pub fn with_scale(self, scale: f32) -> Self {
        Self { scale, ..self }
    }

    /// The same problem with the dropout draw `dropout`.
    pub fn with_dropout(self, dropout: Dropout) -> Self {
        Self { dropout, ..self }
    }

    /// The same problem, its forward returning each row's largest
    /// modified score (`max_scores`) or not.
    pub fn with_max_scores(self, max_scores: bool) -> Self {
        Self { max_scores, ..self }
    }

    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// Bottom-right alignment: query row `i` has position `i + q_offset()`.
    pub fn q_offset(&self) -> i64 {
        self.seq_k as i64 - self.seq_q as i64
    }

    /// Elements in `q`.
    pub fn q_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q * self.head_dim
    }

    /// Elements in `out` (and `dout`).
    pub fn out_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q * self.head_dim_v
    }

    /// Elements in `k`.
    pub fn k_len(&self) -> usize {
        self.batch * self.heads_kv * self.seq_k * self.head_dim
    }

    /// Elements in `v`.
    pub fn v_len(&self) -> usize {
        self.batch * self.heads_kv * self.seq_k * self.head_dim_v
    }

    /// Elements in `lse`.
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q
    }

    /// `[B, Hq, Sq, D]`.
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_q, self.seq_q, self.head_dim]
    }

    /// `[B, Hq, Sq, Dv]`.
    pub fn out_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_q, self.seq_q, self.head_dim_v]
    }

    /// `[B, Hkv, Sk, D]`.
    pub fn k_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_kv, self.seq_k, self.head_dim]
    }

    /// `[B, Hkv, Sk, Dv]`.
    pub fn v_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_kv, self.seq_k, self.head_dim_v]
    }

    /// `[B, Hq, Sq]`.
    pub fn lse_shape(&self) -> [usize; 3] {
        [self.batch, self.heads_q, self.seq_q]
    }
}
