//! The options of one attention call.

/// Options of one attention call: `AttentionOptions::default()`, then the
/// `with_` methods for what differs.
///
/// ```
/// use boostr_runtime::AttentionOptions;
/// let opts = AttentionOptions::default().with_scale(0.125).with_dropout(7, 3);
/// assert_eq!((opts.scale, opts.dropout_seed, opts.dropout_offset), (Some(0.125), 7, 3));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct AttentionOptions {
    /// Multiplier of `q·k` before `score`; `None` means `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// The seed of a dropout variant's draw (see
    /// [`kernels_spec::dropout`]): the same seed and offset drop the same
    /// pairs on every backend, and the backward of a call must be given
    /// the forward's. Ignored by variants without `dropout`.
    pub dropout_seed: u64,
    /// The call's offset under the seed: calls that share a seed (the
    /// layers of one step, say) take different offsets to draw
    /// independently.
    pub dropout_offset: u32,
    /// Return each query row's largest modified score too
    /// ([`Output::max_scores`](crate::Output::max_scores)): FlexAttention's
    /// `AuxRequest(max_scores=True)`, what QK-Clip reads.
    pub max_scores: bool,
}

impl AttentionOptions {
    /// These options with `q·k` multiplied by `scale` (not `1/sqrt(D)`).
    pub fn with_scale(self, scale: f32) -> Self {
        AttentionOptions {
            scale: Some(scale),
            ..self
        }
    }

    /// These options with a dropout variant's draw keyed by `seed` and
    /// `offset` (see [`AttentionOptions::dropout_seed`]).
    pub fn with_dropout(self, seed: u64, offset: u32) -> Self {
        AttentionOptions {
            dropout_seed: seed,
            dropout_offset: offset,
            ..self
        }
    }

    /// These options with the rows' largest scores returned too
    /// ([`AttentionOptions::max_scores`]).
    pub fn with_max_scores(self) -> Self {
        AttentionOptions {
            max_scores: true,
            ..self
        }
    }
}
