//! The validated shape of one attention call, shared by every backend.

/// Sizes of one attention call. Layout (all contiguous, row-major):
/// `q [batch, heads_q, seq_q, head_dim]`, `k, v [batch, heads_kv, seq_k, head_dim]`,
/// `out [batch, heads_q, seq_q, head_dim]`, `lse [batch, heads_q, seq_q]`.
///
/// Built only by validation (see `validate`), so every field is non-zero and
/// `heads_q % heads_kv == 0`.
#[derive(Clone, Copy, Debug, PartialEq)]
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
    /// Head dimension `D`.
    pub head_dim: usize,
    /// Multiplier of `q·k` before `score` (default `1/sqrt(D)`).
    pub scale: f32,
}

impl Problem {
    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// Bottom-right alignment: query row `i` has position `i + q_offset()`.
    pub fn q_offset(&self) -> i64 {
        self.seq_k as i64 - self.seq_q as i64
    }

    /// Elements in `q` and `out`.
    pub fn q_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q * self.head_dim
    }

    /// Elements in `k` and `v`.
    pub fn kv_len(&self) -> usize {
        self.batch * self.heads_kv * self.seq_k * self.head_dim
    }

    /// Elements in `lse`.
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q
    }
}
