//! How a row's scores become the weights of its values: the one
//! description of the normalisation every kernel reads.

/// How a query row's scores become the weights of its values: its
/// normalisation, whether the row has a sink logit, and whether pairs drop
/// out.
///
/// The one description every kernel asks its questions of ([`has_lse`],
/// [`merges_by_lse`], [`needs_delta`]), lowered once per target: for the
/// GPU dialects by [`crate::emit::gpu::weights`] (the functions that start
/// a row, weigh a tile's pairs, finish a row, merge partial rows and give
/// a pair's gradient), for the CPU kernels and the test reference by one
/// trait of the runtime.
///
/// [`has_lse`]: Weights::has_lse
/// [`merges_by_lse`]: Weights::merges_by_lse
/// [`needs_delta`]: Weights::needs_delta
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Weights {
    /// The normalisation.
    pub normalize: Normalize,
    /// Each row has one more logit, with no value (softmax only).
    pub sink: bool,
    /// Each call drops pairs with the variant's probability `p` and
    /// scales the kept ones by `1/(1 − p)` ([`crate::dropout`]).
    pub dropout: bool,
}

impl Weights {
    /// Rows normalised by `normalize`, with a sink and with dropout where
    /// given.
    pub const fn new(normalize: Normalize, sink: bool, dropout: bool) -> Weights {
        Weights {
            normalize,
            sink,
            dropout,
        }
    }

    /// A plain softmax: no sink, no dropout.
    pub const SOFTMAX: Weights = Weights {
        normalize: Normalize::Softmax,
        sink: false,
        dropout: false,
    };

    /// A row keeps running statistics (its max and sum) and the forward
    /// writes its log-sum-exp; without, the forward's `lse` is 0.
    pub const fn has_lse(self) -> bool {
        matches!(self.normalize, Normalize::Softmax)
    }

    /// Partial results of one row over disjoint keys (split-KV decode,
    /// ring attention) combine by their lse; otherwise they add.
    pub const fn merges_by_lse(self) -> bool {
        self.has_lse()
    }

    /// The backward needs each row's `D_i = rowsum(dO ∘ O)`: a pair's
    /// gradient depends on the other pairs of its row through the sum.
    pub const fn needs_delta(self) -> bool {
        self.has_lse()
    }
}

/// How a query row's scores become the weights of its values.
///
/// Exhaustive on purpose: each backend's row weights (the CPU's
/// `RowWeights`, the GPU lowering's table) match it arm by arm, so that a
/// new normalization is a compile error at every step it must teach. A
/// caller names a variant's normalization in its declaration, and never
/// matches on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Normalize {
    /// `P = softmax(score)` over the row's visible keys (and its sink):
    /// the kernels keep a running max and sum, and write the row's lse.
    #[default]
    Softmax,
    /// `P = sigmoid(score)` per pair, with no sum over the row (FlashSigmoid):
    /// no running statistics, no sink, and no lse (the forward writes 0).
    Sigmoid,
}

impl Normalize {
    /// The variant's name in Rust (`Softmax`), for code that names it.
    pub const fn variant_name(self) -> &'static str {
        match self {
            Normalize::Softmax => "Softmax",
            Normalize::Sigmoid => "Sigmoid",
        }
    }
}
