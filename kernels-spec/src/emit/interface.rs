//! The vocabulary of kernel interfaces, shared by every GPU target.
//!
//! Each target describes each of its kernels once, as data: its entry point
//! and its arguments (CUDA) or bindings (WGSL) in order, each with its
//! [role](Arg), plus its launch geometry as [`Extent`]s. From that one
//! description the emitter writes the kernel's signature or binding
//! declarations, the runtime builds its argument list or bind group by role,
//! and [`Display`] writes the launch contract for people. So adding an
//! argument is one edit in one description, and a kernel and its launcher
//! cannot disagree on the order.

use std::fmt::{self, Display, Formatter};

/// A tensor a kernel reads or writes. All are contiguous; `B, Hq, Hkv, Sq,
/// Sk, D, DV` are the problem's sizes (`D` the query/key head dim, `DV` the
/// value head dim).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buffer {
    /// `q [B, Hq, Sq, D]`.
    Q,
    /// `k [B, Hkv, Sk, D]`.
    K,
    /// `v [B, Hkv, Sk, DV]`.
    V,
    /// `out [B, Hq, Sq, DV]`: the attention output.
    Out,
    /// `lse [B, Hq, Sq]` f32: each row's natural log-sum-exp.
    Lse,
    /// `dout [B, Hq, Sq, DV]`: the gradient of the loss with respect to `out`.
    Dout,
    /// `delta [B, Hq, Sq]` f32: `D_i = rowsum(dO ∘ O)` of the backward.
    Delta,
    /// `dq [B, Hq, Sq, D]`.
    Dq,
    /// `dk [B, Hkv, Sk, D]`.
    Dk,
    /// `dv [B, Hkv, Sk, DV]`.
    Dv,
    /// `stats [B, Hq, Sq, 4]` f32: per row of the WGSL forward, its running
    /// max and sum kept between the dispatches of one kernel and its
    /// largest score (without the sink), `(m, l, max score, 0)`.
    Stats,
    /// `rows [B, Hq, Sq, 4]` f32: per query row of the backward, two running
    /// sums, lse and `D_i` (WGSL, one binding where CUDA has `lse` and
    /// `delta`).
    Rows,
    /// `split_out [splits, B, Hq, Sq, DV]` f32: a split-KV forward's
    /// normalised output of each split (over its share of the keys).
    SplitOut,
    /// `split_lse [splits, B, Hq, Sq]` f32: each split's lse.
    SplitLse,
    /// `k_scale` f32, `[Hkv]` (keys in place) or `[pages, Hkv]` (paged):
    /// the dequantization scales of an fp8 cache's keys. Bound only over
    /// an fp8 cache ([`Buffer::optional`]).
    KScale,
    /// `v_scale`, as [`Buffer::KScale`] for the values.
    VScale,
    /// `max_scores [splits, B, Hq, Sq]` f32: each row's largest score (the
    /// sink apart) in each split, their largest in split 0's rows after
    /// the merge (CUDA). Bound only where a call asks for them.
    MaxScores,
}

/// What a [`Buffer`]'s elements are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    /// The call's element type (the dtype of `q`).
    Input,
    /// `f32`, whatever the call's element type.
    F32,
    /// Pairs of `f32`.
    F32x2,
    /// Fours of `f32`.
    F32x4,
}

impl Buffer {
    /// The argument's (or binding's) name in every kernel.
    pub const fn name(self) -> &'static str {
        match self {
            Buffer::Q => "q",
            Buffer::K => "k",
            Buffer::V => "v",
            Buffer::Out => "out",
            Buffer::Lse => "lse",
            Buffer::Dout => "dout",
            Buffer::Delta => "delta",
            Buffer::Dq => "dq",
            Buffer::Dk => "dk",
            Buffer::Dv => "dv",
            Buffer::Stats => "stats",
            Buffer::Rows => "rows",
            Buffer::SplitOut => "split_out",
            Buffer::SplitLse => "split_lse",
            Buffer::KScale => "k_scale",
            Buffer::VScale => "v_scale",
            Buffer::MaxScores => "max_scores",
        }
    }

    /// Its element type.
    pub const fn elem(self) -> Elem {
        match self {
            Buffer::Lse
            | Buffer::Delta
            | Buffer::SplitOut
            | Buffer::SplitLse
            | Buffer::KScale
            | Buffer::VScale
            | Buffer::MaxScores => Elem::F32,
            Buffer::Stats | Buffer::Rows => Elem::F32x4,
            _ => Elem::Input,
        }
    }

    /// Its shape, in the problem's sizes.
    pub const fn shape(self) -> &'static str {
        match self {
            Buffer::Q | Buffer::Dq => "[B, Hq, Sq, D]",
            Buffer::Out | Buffer::Dout => "[B, Hq, Sq, DV]",
            Buffer::K | Buffer::Dk => "[B, Hkv, Sk, D]",
            Buffer::V | Buffer::Dv => "[B, Hkv, Sk, DV]",
            Buffer::Lse | Buffer::Delta => "[B, Hq, Sq]",
            Buffer::Stats | Buffer::Rows => "[B, Hq, Sq, 4]",
            Buffer::SplitOut => "[splits, B, Hq, Sq, DV]",
            Buffer::SplitLse | Buffer::MaxScores => "[splits, B, Hq, Sq]",
            Buffer::KScale | Buffer::VScale => "[Hkv] or [pages, Hkv]",
        }
    }

    /// Whether a call binds it only where it applies (the scales of an fp8
    /// cache, the rows' largest scores): a kernel given none gets a null
    /// pointer and never reads or writes it.
    pub const fn optional(self) -> bool {
        matches!(self, Buffer::KScale | Buffer::VScale | Buffer::MaxScores)
    }
}

/// Whether a kernel only reads a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Read only.
    Read,
    /// Read and written.
    ReadWrite,
}

/// A scalar a kernel is given: a problem size, the scale, or (WGSL) the
/// range of its tile loop that one dispatch covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scalar {
    /// `B`.
    Batch,
    /// `Hq`.
    HeadsQ,
    /// `Hkv`.
    HeadsKv,
    /// `Sq`.
    SeqQ,
    /// `Sk`.
    SeqK,
    /// The multiplier of `q·k` (f32).
    Scale,
    /// First tile of this dispatch's range of the tile loop.
    TileBegin,
    /// One past the last tile of the range.
    TileEnd,
    /// `FIRST` (1: the range starts the loop) | `LAST` (2: it ends it).
    Flags,
    /// The arena word of a KV cache's per-sequence lengths, or
    /// [`NO_WORD`] (every sequence has `Sk` keys).
    KvLens,
    /// The arena word of a padded batch's per-sequence query rows, or
    /// [`NO_WORD`] (every sequence has `Sq` rows, last-aligned to its
    /// keys).
    QLens,
    /// The arena word of a paged cache's page table (`[B, max_pages]`),
    /// or [`NO_WORD`].
    KvPages,
    /// Keys per page; 0 without pages (`k [B, Hkv, Sk, D]`, `v [B, Hkv,
    /// Sk, DV]`).
    PageSize,
    /// Entries per page table row.
    MaxPages,
    /// Key splits of a split-KV forward ([`Sizes::splits`]); 1 writes
    /// `out` and `lse` directly.
    Splits,
}

/// The value of [`Scalar::KvLens`], [`Scalar::QLens`] and
/// [`Scalar::KvPages`] where there is none (the shader constant
/// `NO_WORD`).
pub const NO_WORD: u32 = u32::MAX;

impl Scalar {
    /// The argument's (or member's) name in every kernel.
    pub const fn name(self) -> &'static str {
        match self {
            Scalar::Batch => "batch",
            Scalar::HeadsQ => "heads_q",
            Scalar::HeadsKv => "heads_kv",
            Scalar::SeqQ => "seq_q",
            Scalar::SeqK => "seq_k",
            Scalar::Scale => "scale",
            Scalar::TileBegin => "tile_begin",
            Scalar::TileEnd => "tile_end",
            Scalar::Flags => "flags",
            Scalar::KvLens => "kv_lens",
            Scalar::QLens => "q_lens",
            Scalar::KvPages => "kv_pages",
            Scalar::PageSize => "page_size",
            Scalar::MaxPages => "max_pages",
            Scalar::Splits => "splits",
        }
    }

    /// Whether it is an `f32` (else a count or index).
    pub const fn is_float(self) -> bool {
        matches!(self, Scalar::Scale)
    }
}

/// One argument of a kernel, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arg {
    /// A tensor.
    Buffer(Buffer, Access),
    /// A scalar.
    Scalar(Scalar),
    /// The variant's parameter block ([`ParamWords`](crate::params::ParamWords)).
    Params,
    /// The capture arena of the call: `u32` words, the error record first,
    /// then the captured tensors and their summaries
    /// ([`Arena`](crate::params::Arena)).
    Captures,
}

impl Arg {
    /// A buffer the kernel only reads.
    pub const fn read(b: Buffer) -> Arg {
        Arg::Buffer(b, Access::Read)
    }

    /// A buffer the kernel writes (and may read).
    pub const fn write(b: Buffer) -> Arg {
        Arg::Buffer(b, Access::ReadWrite)
    }

    /// The argument's name in every kernel.
    pub const fn name(self) -> &'static str {
        match self {
            Arg::Buffer(b, _) => b.name(),
            Arg::Scalar(s) => s.name(),
            Arg::Params => "params",
            Arg::Captures => "captures",
        }
    }
}

/// A size of the problem, for launch geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    /// `B`.
    Batch,
    /// `Hq`.
    HeadsQ,
    /// `Hkv`.
    HeadsKv,
    /// `Sq`.
    SeqQ,
    /// `Sk`.
    SeqK,
    /// `Hq / Hkv`, query heads per kv head.
    Group,
    /// `B · Hq`.
    BatchHeadsQ,
    /// `B · Hkv`.
    BatchHeadsKv,
    /// `B · Hq · Sq`, every query row.
    Rows,
    /// `(Hq / Hkv) · Sq`: the query rows of one kv head, every head of its
    /// GQA group packed together (a forward block's rows).
    GroupRows,
    /// Key splits of a split-KV forward.
    Splits,
}

impl Dim {
    fn symbol(self) -> &'static str {
        match self {
            Dim::Batch => "B",
            Dim::HeadsQ => "Hq",
            Dim::HeadsKv => "Hkv",
            Dim::SeqQ => "Sq",
            Dim::SeqK => "Sk",
            Dim::Group => "Hq/Hkv",
            Dim::BatchHeadsQ => "B·Hq",
            Dim::BatchHeadsKv => "B·Hkv",
            Dim::Rows => "B·Hq·Sq",
            Dim::GroupRows => "(Hq/Hkv)·Sq",
            Dim::Splits => "splits",
        }
    }
}

/// The problem's sizes, as launch geometry reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sizes {
    /// `B`.
    pub batch: u64,
    /// `Hq`.
    pub heads_q: u64,
    /// `Hkv` (divides `Hq`).
    pub heads_kv: u64,
    /// `Sq`.
    pub seq_q: u64,
    /// `Sk`.
    pub seq_k: u64,
    /// Key splits of a split-KV forward: each (block of query rows, kv
    /// head) runs as `splits` blocks over consecutive shares of the key
    /// tiles, merged by their lse afterwards. 1 everywhere else.
    pub splits: u64,
}

impl Sizes {
    /// The value of `d`.
    pub fn dim(&self, d: Dim) -> u64 {
        match d {
            Dim::Batch => self.batch,
            Dim::HeadsQ => self.heads_q,
            Dim::HeadsKv => self.heads_kv,
            Dim::SeqQ => self.seq_q,
            Dim::SeqK => self.seq_k,
            Dim::Group => self.heads_q / self.heads_kv.max(1),
            Dim::BatchHeadsQ => self.batch * self.heads_q,
            Dim::BatchHeadsKv => self.batch * self.heads_kv,
            Dim::Rows => self.batch * self.heads_q * self.seq_q,
            Dim::GroupRows => self.heads_q / self.heads_kv.max(1) * self.seq_q,
            Dim::Splits => self.splits.max(1),
        }
    }
}

/// A count of a launch (grid blocks along an axis, tiles of a loop), in
/// the problem's sizes and the target's tile sizes `S`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Extent<S: 'static> {
    /// One.
    One,
    /// A size of the problem.
    Dim(Dim),
    /// `⌈dim / size⌉`: the tiles of `size` that cover `dim`.
    Tiles(Dim, S),
    /// The product of the factors.
    Product(&'static [Extent<S>]),
    /// `⌈count / splits⌉`: one split's share of a count.
    PerSplit(&'static Extent<S>),
}

impl<S: Copy + 'static> Extent<S> {
    /// The count for `sizes`, with the target's tile sizes from `size`.
    pub fn eval(&self, sizes: &Sizes, size: &impl Fn(S) -> u32) -> u64 {
        match *self {
            Extent::One => 1,
            Extent::Dim(d) => sizes.dim(d),
            Extent::Tiles(d, s) => sizes.dim(d).div_ceil(u64::from(size(s)).max(1)),
            Extent::Product(factors) => factors.iter().map(|e| e.eval(sizes, size)).product(),
            Extent::PerSplit(e) => e.eval(sizes, size).div_ceil(sizes.dim(Dim::Splits)),
        }
    }

    /// The count as blocks (or workgroups) along grid `axis`, at most `max`.
    pub fn blocks(
        &self,
        axis: &'static str,
        max: u64,
        sizes: &Sizes,
        size: &impl Fn(S) -> u32,
    ) -> Result<u32, GridTooLarge> {
        let blocks = self.eval(sizes, size);
        u32::try_from(blocks)
            .ok()
            .filter(|&b| u64::from(b) <= max)
            .ok_or(GridTooLarge { axis, blocks, max })
    }
}

/// A grid larger than the target can launch.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{blocks} blocks along grid {axis} exceed the limit of {max}")]
pub struct GridTooLarge {
    /// The axis (`x`, `y` or `z`).
    pub axis: &'static str,
    /// The blocks it would need.
    pub blocks: u64,
    /// The target's limit on it.
    pub max: u64,
}

impl<S: Copy + Display + 'static> Display for Extent<S> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self {
            Extent::One => f.write_str("1"),
            Extent::Dim(d) => f.write_str(d.symbol()),
            Extent::Tiles(d, s) => write!(f, "⌈{}/{s}⌉", d.symbol()),
            Extent::Product(factors) => {
                for (i, e) in factors.iter().enumerate() {
                    if i > 0 {
                        f.write_str("·")?;
                    }
                    write!(f, "{e}")?;
                }
                Ok(())
            }
            Extent::PerSplit(e) => write!(f, "⌈{e}/splits⌉"),
        }
    }
}

/// `parts` one after the other, as one array of `N` (a compile-time error
/// unless `N` is their total length): for lists that share runs, as the
/// backward kernels' arguments do.
pub const fn concat<T: Copy, const N: usize>(parts: &[&[T]]) -> [T; N] {
    let mut first = 0;
    while parts[first].is_empty() {
        first += 1;
    }
    let mut out = [parts[first][0]; N];
    let (mut i, mut n) = (0, 0);
    while i < parts.len() {
        let mut j = 0;
        while j < parts[i].len() {
            out[n] = parts[i][j];
            n += 1;
            j += 1;
        }
        i += 1;
    }
    assert!(n == N, "the parts' lengths add up to N");
    out
}
