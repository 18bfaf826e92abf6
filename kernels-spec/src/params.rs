//! The parameter block and the capture arena: how a variant's fields travel
//! to the GPU kernels.
//!
//! Every GPU kernel of every variant takes the same fixed-size block of
//! [`PARAM_WORDS`] 32-bit words (a by-value `Params` struct in CUDA, a
//! uniform buffer in WGSL), so a new parameter value never recompiles a
//! kernel and every variant's kernels share one signature. The fields take
//! the first [`FIELD_WORDS`]; the last [`WINDOW_WORDS`] say where the call
//! sits in its sequence ([`WindowWord`]). The
//! [`ParamLayout`] says which words hold which field; it is built once, by
//! [`check`](crate::check), and read by every emitter (to declare the
//! struct), by the macro (to pack a value into [`ParamWords`]) and by the
//! runtimes (which bind the words as they are).
//!
//! Encoding, in field order: a scalar field is one word (`f32` as its bits,
//! `i32` and `u32` as their bits, `bool` as 0 or 1, stored as `u32` since
//! WGSL uniforms hold no `bool`). A captured tensor of rank `r` is `1 + 2r`
//! words: its offset in the capture arena, its `r` dimensions, and the
//! arena offsets of its per-axis summaries (0 for an axis without one).
//! The words after the last field are zero. A learnable tensor has no
//! summaries (it is never read by a mask, nor so by a classifier): its first
//! summary word holds the arena offset of its gradient accumulators instead.
//!
//! The capture arena ([`Arena`]) is one buffer of 32-bit words per call
//! holding every captured tensor and every summary, so that any number of
//! tensors costs one binding (WebGPU guarantees only 8 storage buffers per
//! shader stage): [`ERROR_WORDS`] words for the first out-of-range read,
//! then each tensor's elements (contiguous, row-major) in field order, then
//! each summary, then the gradient accumulators of each learnable tensor.
//!
//! # Gradient accumulators
//!
//! The GPU backward adds `dz · ∂score/∂read` into a learnable tensor's
//! gradient from every (query, key) pair that reads it, in no fixed order.
//! Float addition is not associative, so the sum would change from run to
//! run; instead each element's accumulator is a 64-bit two's-complement
//! **fixed-point** number with [`GRAD_FRACTION_BITS`] fraction bits (two
//! words, low first, at an even word offset), and each contribution is
//! rounded to that grid once and added with integer atomics. Integer
//! addition is associative: the sum is the same bits whatever the order.
//! Resolution 2⁻³² ≈ 2.3·10⁻¹⁰, range ±2³¹. Word [`GRAD_FLAG_WORD`] of the
//! record collects [`GRAD_NON_FINITE`] (a contribution was NaN or
//! infinite) and [`GRAD_RANGE`] (one was at least [`GRAD_MAX_CONTRIBUTION`]
//! in magnitude, and was dropped).

use crate::ir::{ParamDecl, TensorDecl, Ty};
use std::fmt;

/// 32-bit words in the parameter block of every kernel: the fields'
/// [`FIELD_WORDS`], then the call's window ([`WINDOW_WORDS`]).
pub const PARAM_WORDS: usize = FIELD_WORDS + WINDOW_WORDS;

/// Words the variant's fields may take (less [`DROPOUT_WORDS`] for a
/// variant with `dropout`).
pub const FIELD_WORDS: usize = 32;

/// Words at the end of the fields' part of the block that a variant with
/// `dropout` reserves for each call's generator state
/// ([`crate::dropout::Word`]); its fields have the words before them.
pub const DROPOUT_WORDS: usize = 5;

/// Words at the very end of every block: where the call sits in its
/// sequence ([`WindowWord`]). All zero for a call that is its whole
/// sequence.
pub const WINDOW_WORDS: usize = 4;

/// The call's window in the parameter block: word `FIELD_WORDS + w as
/// usize`. A call is a window of a longer sequence (one step of ring
/// attention): the kernels count positions from the start of the call
/// (query row `i` at `i + Sk − Sq`, key `j` at `j`), and every variant
/// function (`score`, `mask`, `sink`, the tile classifier, the reads of
/// learnable tensors, the dropout draw) adds the window's shifts to the
/// positions it is given, so it sees the whole sequence's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowWord {
    /// What the variant's query positions are ahead of the call's (`i32`).
    Q = 0,
    /// What the variant's key positions are ahead of the call's (`i32`).
    Kv = 1,
    /// 1: the call's rows do not carry the variant's sink (a ring adds it
    /// to each row in one call only); 0: they do.
    NoSink = 2,
    /// Zero: the block stays a whole number of 16-byte rows.
    Spare = 3,
}

impl WindowWord {
    /// Every word, in block order.
    pub const ALL: [WindowWord; WINDOW_WORDS] = [
        WindowWord::Q,
        WindowWord::Kv,
        WindowWord::NoSink,
        WindowWord::Spare,
    ];

    /// The member's name in the kernels' `Params` struct.
    pub const fn member(self) -> &'static str {
        match self {
            WindowWord::Q => "win_q",
            WindowWord::Kv => "win_kv",
            WindowWord::NoSink => "win_no_sink",
            WindowWord::Spare => "win_spare",
        }
    }

    /// The member's type: `i32` for the shifts, `u32` otherwise.
    pub const fn ty(self) -> Ty {
        match self {
            WindowWord::Q | WindowWord::Kv => Ty::I32,
            _ => Ty::U32,
        }
    }

    /// Its index in the block.
    pub const fn index(self) -> usize {
        FIELD_WORDS + self as usize
    }
}

/// Words at the start of the capture arena that record the first read out
/// of range: `[site + 1, index 0, index 1, index 2, index 3, 0, 0, 0]`
/// (zero while no read was out of range).
pub const ERROR_WORDS: usize = 8;

/// Elements of one index that one summary entry covers: a summary of axis
/// `a` holds the least and the greatest element of every run of
/// `SUMMARY_BLOCK` consecutive positions along `a` (the last run may be
/// shorter), for every value of the other indices.
pub const SUMMARY_BLOCK: usize = 16;

/// Blocks of a summary that a range read looks at, at most: a range over
/// more of them is unbounded (the classifier then cannot decide the tile,
/// which is always safe).
pub const SUMMARY_MAX_BLOCKS: usize = 8;

/// Fraction bits of a gradient accumulator (see the module docs).
pub const GRAD_FRACTION_BITS: u32 = 32;

/// Contributions to a gradient accumulator are below this in magnitude
/// (2²⁴): a larger one is dropped and flagged ([`GRAD_RANGE`]), so that
/// no 128 of them can overflow the ±2³¹ range together.
pub const GRAD_MAX_CONTRIBUTION: f32 = 16_777_216.0;

/// The record word where the GPU backward flags its gradient accumulators
/// ([`GRAD_NON_FINITE`], [`GRAD_RANGE`]).
pub const GRAD_FLAG_WORD: usize = 5;

/// Flag: a contribution to a gradient was NaN or infinite.
pub const GRAD_NON_FINITE: u32 = 1;

/// Flag: a contribution to a gradient was out of the accumulators' range.
pub const GRAD_RANGE: u32 = 2;

/// The value of one gradient accumulator, from its two words (low, high).
pub fn grad_value(lo: u32, hi: u32) -> f64 {
    let fixed = ((u64::from(hi) << 32) | u64::from(lo)) as i64;
    fixed as f64 / f64::from(GRAD_FRACTION_BITS).exp2()
}

/// The words one contribution adds to an accumulator, as the kernels form
/// them: `x · 2³²` rounded to the nearest integer (ties to even), in two's
/// complement; `None` where the kernels drop it (non-finite, or at least
/// [`GRAD_MAX_CONTRIBUTION`] in magnitude).
pub fn grad_words(x: f32) -> Option<(u32, u32)> {
    if !x.is_finite() || x.abs() >= GRAD_MAX_CONTRIBUTION {
        return None;
    }
    let fixed = (f64::from(x) * f64::from(GRAD_FRACTION_BITS).exp2()).round_ties_even() as i64;
    Some((fixed as u32, (fixed >> 32) as u32))
}

/// The parameter block's contents, as every GPU kernel receives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct ParamWords(pub [u32; PARAM_WORDS]);

impl ParamWords {
    /// All words zero: the block of a variant without fields.
    pub const ZERO: ParamWords = ParamWords([0; PARAM_WORDS]);

    /// These words with the call's window: positions shifted by `q` and
    /// `kv`, and the rows carrying the sink or not ([`WindowWord`]).
    pub fn with_window(mut self, q: i32, kv: i32, sink: bool) -> ParamWords {
        self.0[WindowWord::Q.index()] = q as u32;
        self.0[WindowWord::Kv.index()] = kv as u32;
        self.0[WindowWord::NoSink.index()] = u32::from(!sink);
        self
    }

    /// The words as little-endian bytes, as a uniform buffer holds them.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        self.0.iter().flat_map(|w| w.to_le_bytes()).collect()
    }
}

impl Default for ParamWords {
    fn default() -> Self {
        Self::ZERO
    }
}

/// How a scalar field's value becomes its word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// `f32::to_bits`.
    F32Bits,
    /// `i32 as u32` (the same bits).
    I32Bits,
    /// The `u32` itself.
    U32,
    /// `0` or `1`.
    Bool,
}

/// What a slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SlotKind {
    /// A scalar field of this type.
    Scalar(Ty),
    /// Captured tensor number `tensor` (in [`crate::ir::Program::tensors`])
    /// of rank `rank`.
    Tensor {
        /// Its index among the tensors.
        tensor: usize,
        /// Its rank.
        rank: usize,
        /// It is learnable: its first summary word is its gradient's offset.
        learnable: bool,
    },
}

/// Where one field lives in the block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSlot {
    /// The field's name.
    pub name: String,
    /// What it holds.
    pub kind: SlotKind,
    /// Index of its first word.
    pub word: usize,
}

/// One word of the block, by what it means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Its name in the kernels' `Params` struct.
    pub name: String,
    /// Its declared type (`u32` for anything but an `f32` or `i32` scalar).
    pub ty: Ty,
}

impl ParamSlot {
    /// Words the field takes: one for a scalar, `1 + 2·rank` for a tensor.
    pub fn words(&self) -> usize {
        match self.kind {
            SlotKind::Scalar(_) => 1,
            SlotKind::Tensor { rank, .. } => 1 + 2 * rank,
        }
    }

    /// The scalar's encoding, or `None` for a tensor.
    pub fn encoding(&self) -> Option<Encoding> {
        match self.kind {
            SlotKind::Scalar(Ty::F32) => Some(Encoding::F32Bits),
            SlotKind::Scalar(Ty::I32) => Some(Encoding::I32Bits),
            SlotKind::Scalar(Ty::U32) => Some(Encoding::U32),
            SlotKind::Scalar(Ty::Bool) => Some(Encoding::Bool),
            SlotKind::Tensor { .. } => None,
        }
    }

    /// The member holding a scalar field (`p_<name>`).
    pub fn member(&self) -> String {
        format!("p_{}", self.name)
    }

    /// The member holding a tensor's arena offset (`p_<name>_off`).
    pub fn offset_member(&self) -> String {
        format!("p_{}_off", self.name)
    }

    /// The member holding dimension `axis` of a tensor (`p_<name>_d<axis>`).
    pub fn dim_member(&self, axis: usize) -> String {
        format!("p_{}_d{axis}", self.name)
    }

    /// The member holding the arena offset of a tensor's summary along
    /// `axis` (`p_<name>_s<axis>`).
    pub fn summary_member(&self, axis: usize) -> String {
        format!("p_{}_s{axis}", self.name)
    }

    /// The member holding the arena offset of a learnable tensor's gradient
    /// accumulators (`p_<name>_grad`, in place of its first summary word).
    pub fn grad_member(&self) -> String {
        format!("p_{}_grad", self.name)
    }

    /// The slot's words, in order, by name and type.
    pub fn members(&self) -> Vec<Member> {
        match self.kind {
            SlotKind::Scalar(ty) => vec![Member {
                name: self.member(),
                ty: if ty == Ty::Bool { Ty::U32 } else { ty },
            }],
            SlotKind::Tensor {
                rank, learnable, ..
            } => {
                let word = |name| Member { name, ty: Ty::U32 };
                let summary = |a| match (learnable, a) {
                    (true, 0) => self.grad_member(),
                    _ => self.summary_member(a),
                };
                std::iter::once(word(self.offset_member()))
                    .chain((0..rank).map(|a| word(self.dim_member(a))))
                    .chain((0..rank).map(|a| word(summary(a))))
                    .collect()
            }
        }
    }
}

/// A field, as the layout places it.
#[derive(Clone, Copy, Debug)]
pub enum Field<'a> {
    /// A scalar parameter.
    Scalar(&'a ParamDecl),
    /// Captured tensor number `.0`.
    Tensor(usize, &'a TensorDecl),
}

/// The fields of one variant, placed in the block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParamLayout {
    slots: Vec<ParamSlot>,
    /// The last [`DROPOUT_WORDS`] words hold each call's dropout state.
    dropout: bool,
}

/// A field that does not fit the block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overflow {
    /// Index (in declaration order) of the first field that crosses
    /// [`FIELD_WORDS`].
    pub field: usize,
    /// Words the fields up to and including it need.
    pub needed: usize,
}

impl fmt::Display for Overflow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the fields up to this one need {} parameter words; the kernels' parameter \
             block holds {FIELD_WORDS} for fields (one word per f32, i32, u32 or bool field, \
             1 + 2·rank per tensor)",
            self.needed
        )
    }
}

impl ParamLayout {
    /// Place `fields` in declaration order, or say which field crosses the
    /// limit.
    pub fn new(fields: &[Field<'_>]) -> Result<ParamLayout, Overflow> {
        Self::with_dropout(fields, false)
    }

    /// [`new`](ParamLayout::new), with the last [`DROPOUT_WORDS`] words
    /// kept for the dropout state where `dropout` holds.
    pub fn with_dropout(fields: &[Field<'_>], dropout: bool) -> Result<ParamLayout, Overflow> {
        let capacity = FIELD_WORDS - if dropout { DROPOUT_WORDS } else { 0 };
        let mut slots = Vec::with_capacity(fields.len());
        let mut word = 0;
        for (field, f) in fields.iter().enumerate() {
            let (name, kind) = match *f {
                Field::Scalar(p) => (p.name.clone(), SlotKind::Scalar(p.ty)),
                Field::Tensor(tensor, t) => (
                    t.name.clone(),
                    SlotKind::Tensor {
                        tensor,
                        rank: t.dims.len(),
                        learnable: t.learnable,
                    },
                ),
            };
            let slot = ParamSlot { name, kind, word };
            let needed = word + slot.words();
            if needed > capacity {
                return Err(Overflow {
                    field,
                    needed: needed + FIELD_WORDS - capacity,
                });
            }
            slots.push(slot);
            word = needed;
        }
        Ok(ParamLayout { slots, dropout })
    }

    /// Whether the block ends with the dropout state
    /// ([`crate::dropout::Word`]).
    pub fn dropout(&self) -> bool {
        self.dropout
    }

    /// The fields, in declaration order.
    pub fn slots(&self) -> &[ParamSlot] {
        &self.slots
    }

    /// The slot of scalar parameter `index` (in [`crate::ir::Program::params`]).
    pub fn scalar(&self, index: usize) -> &ParamSlot {
        self.slots
            .iter()
            .filter(|s| matches!(s.kind, SlotKind::Scalar(_)))
            .nth(index)
            .expect("a checked parameter has a slot")
    }

    /// The slot of captured tensor `tensor`.
    pub fn tensor(&self, tensor: usize) -> &ParamSlot {
        self.slots
            .iter()
            .find(|s| matches!(s.kind, SlotKind::Tensor { tensor: t, .. } if t == tensor))
            .expect("a checked tensor has a slot")
    }

    /// Words the fields take.
    pub fn used_words(&self) -> usize {
        self.slots.last().map_or(0, |s| s.word + s.words())
    }

    /// Zero words after the last field, up to [`FIELD_WORDS`] (or up to
    /// the dropout state).
    pub fn padding_words(&self) -> usize {
        FIELD_WORDS - self.used_words() - if self.dropout { DROPOUT_WORDS } else { 0 }
    }
}

/// Blocks of [`SUMMARY_BLOCK`] positions covering `len` positions.
pub fn summary_blocks(len: usize) -> usize {
    len.div_ceil(SUMMARY_BLOCK)
}

/// Words of the summary of a tensor of `shape` along `axis`: the least
/// elements, then the greatest, each laid out as the tensor with dimension
/// `axis` replaced by its [`summary_blocks`].
pub fn summary_words(shape: &[usize], axis: usize) -> usize {
    let outer_inner: usize = shape
        .iter()
        .enumerate()
        .filter(|&(a, _)| a != axis)
        .map(|(_, &d)| d)
        .product();
    2 * summary_blocks(shape[axis]) * outer_inner
}

/// Where each tensor and each summary of one call lives in the capture
/// arena (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arena {
    /// The word offset of each tensor's elements.
    pub tensors: Vec<usize>,
    /// The word offset of each summary, in the order they were asked for.
    pub summaries: Vec<usize>,
    /// The word offset of each learnable tensor's gradient accumulators
    /// (two words per element, at an even offset), in the order asked for.
    pub grads: Vec<usize>,
    /// The first word of the accumulators (the arena's end without them).
    pub grad_start: usize,
    /// Words in all.
    pub words: usize,
}

/// One summary as the GPU targets' summary kernel computes it, every word
/// an arena index or a count: entry `e = (o·blocks + blk)·inner + i` is the
/// least element of positions `blk·SUMMARY_BLOCK ..` (at most
/// [`SUMMARY_BLOCK`], fewer in the last block) along the summarized axis,
/// at outer index `o` and inner index `i`, and entry `entries + e` the
/// greatest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SummaryJob {
    /// The tensor's first word.
    pub source: u32,
    /// The summary's first word.
    pub dest: u32,
    /// The product of the dimensions before the axis.
    pub outer: u32,
    /// The axis's dimension.
    pub len: u32,
    /// The product of the dimensions after it.
    pub inner: u32,
    /// `⌈len / SUMMARY_BLOCK⌉`.
    pub blocks: u32,
}

impl SummaryJob {
    /// Entries of each half (least, greatest).
    pub fn entries(&self) -> u64 {
        u64::from(self.outer) * u64::from(self.blocks) * u64::from(self.inner)
    }

    /// The job as the kernels take it: its six words, then the entries
    /// (which fit `u32`: the arena does), then a zero.
    pub fn words(&self) -> [u32; 8] {
        [
            self.source,
            self.dest,
            self.outer,
            self.len,
            self.inner,
            self.blocks,
            self.entries() as u32,
            0,
        ]
    }
}

impl Arena {
    /// The summary kernel's job for summary `s` of tensors of `shapes`
    /// (placed by `self`) with the `(tensor, axis)` `summaries`.
    pub fn job(&self, s: usize, shapes: &[&[usize]], summaries: &[(usize, usize)]) -> SummaryJob {
        let (t, axis) = summaries[s];
        let shape = shapes[t];
        let word = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        SummaryJob {
            source: word(self.tensors[t]),
            dest: word(self.summaries[s]),
            outer: word(shape[..axis].iter().product()),
            len: word(shape[axis]),
            inner: word(shape[axis + 1..].iter().product()),
            blocks: word(summary_blocks(shape[axis])),
        }
    }

    /// The arena of tensors of `shapes` with the `(tensor, axis)` summaries
    /// and the gradient accumulators of the `learnable` tensors.
    pub fn new(shapes: &[&[usize]], summaries: &[(usize, usize)], learnable: &[usize]) -> Arena {
        let mut words = ERROR_WORDS;
        let mut tensors = Vec::with_capacity(shapes.len());
        for shape in shapes {
            tensors.push(words);
            words += shape.iter().product::<usize>();
        }
        let mut offsets = Vec::with_capacity(summaries.len());
        for &(t, axis) in summaries {
            offsets.push(words);
            words += summary_words(shapes[t], axis);
        }
        let grad_start = words;
        let mut grads = Vec::with_capacity(learnable.len());
        for &t in learnable {
            words = words.next_multiple_of(2);
            grads.push(words);
            words += 2 * shapes[t].iter().product::<usize>();
        }
        Arena {
            tensors,
            summaries: offsets,
            grads,
            grad_start,
            words,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DimDecl;

    fn decls(types: &[Ty]) -> Vec<ParamDecl> {
        types
            .iter()
            .enumerate()
            .map(|(i, &ty)| ParamDecl {
                name: format!("f{i}"),
                ty,
            })
            .collect()
    }

    fn scalars(d: &[ParamDecl]) -> Vec<Field<'_>> {
        d.iter().map(Field::Scalar).collect()
    }

    #[test]
    fn fields_take_their_words_in_order() {
        let d = decls(&[Ty::F32, Ty::Bool]);
        let doc = TensorDecl {
            name: "doc".into(),
            elem: Ty::I32,
            given: crate::ir::Given::Elem,
            dims: vec![DimDecl::Any, DimDecl::Fixed(3)],
            learnable: false,
        };
        let fields = [
            Field::Scalar(&d[0]),
            Field::Tensor(0, &doc),
            Field::Scalar(&d[1]),
        ];
        let layout = ParamLayout::new(&fields).unwrap();
        let placed: Vec<(usize, usize)> =
            layout.slots().iter().map(|s| (s.word, s.words())).collect();
        assert_eq!(placed, [(0, 1), (1, 5), (6, 1)]);
        assert_eq!((layout.used_words(), layout.padding_words()), (7, 25));
        let names: Vec<String> = layout
            .tensor(0)
            .members()
            .into_iter()
            .map(|m| m.name)
            .collect();
        assert_eq!(
            names,
            ["p_doc_off", "p_doc_d0", "p_doc_d1", "p_doc_s0", "p_doc_s1"]
        );
        assert_eq!(layout.scalar(1).member(), "p_f1");
        assert_eq!(layout.scalar(1).members()[0].ty, Ty::U32);
        assert_eq!(layout.scalar(0).encoding(), Some(Encoding::F32Bits));
    }

    #[test]
    fn the_limit_is_exact() {
        let empty = ParamLayout::new(&[]).unwrap();
        assert_eq!((empty.used_words(), empty.padding_words()), (0, 32));
        let d = decls(&[Ty::I32; FIELD_WORDS + 2]);
        let full = ParamLayout::new(&scalars(&d[..FIELD_WORDS])).unwrap();
        assert_eq!(full.padding_words(), 0);
        let over = ParamLayout::new(&scalars(&d)).unwrap_err();
        assert_eq!(
            over,
            Overflow {
                field: FIELD_WORDS,
                needed: FIELD_WORDS + 1
            }
        );
        assert!(over.to_string().contains("33 parameter words"), "{over}");
        assert!(over.to_string().contains("holds 32"), "{over}");
    }

    #[test]
    fn the_window_ends_every_block() {
        let words = ParamWords::ZERO.with_window(-3, 40, false);
        assert_eq!(words.0[FIELD_WORDS..], [(-3i32) as u32, 40, 1, 0]);
        assert!(words.0[..FIELD_WORDS].iter().all(|&w| w == 0));
        let whole = ParamWords::ZERO.with_window(0, 0, true);
        assert_eq!(whole, ParamWords::ZERO);
        for (i, w) in WindowWord::ALL.iter().enumerate() {
            assert_eq!(w.index(), FIELD_WORDS + i);
        }
        assert_eq!(PARAM_WORDS % 4, 0, "a whole number of 16-byte rows");
    }

    #[test]
    fn the_arena_holds_the_record_then_tensors_then_summaries() {
        let (doc, len) = ([2usize, 37], [2usize]);
        let bias = [3usize];
        let arena = Arena::new(&[&doc, &len, &bias], &[(0, 1)], &[2]);
        assert_eq!(
            arena.tensors,
            [ERROR_WORDS, ERROR_WORDS + 74, ERROR_WORDS + 76]
        );
        assert_eq!(arena.summaries, [ERROR_WORDS + 79]);
        // ⌈37 / 16⌉ = 3 blocks for each of 2 rows, least and greatest.
        assert_eq!(summary_words(&doc, 1), 12);
        // The accumulators start at the next even word: two per element.
        assert_eq!(arena.grad_start, ERROR_WORDS + 91);
        assert_eq!(arena.grads, [ERROR_WORDS + 92]);
        assert_eq!(arena.words, ERROR_WORDS + 92 + 6);
    }

    #[test]
    fn gradient_accumulators_are_64_bit_fixed_point() {
        for x in [
            0.0f32,
            1.0,
            -1.0,
            0.75,
            -3.5e-7,
            1.0e-12,
            -1.0e-12,
            12_345.678,
            -16_777_215.0,
        ] {
            let (lo, hi) = grad_words(x).expect("in range");
            let back = grad_value(lo, hi);
            assert!(
                (back - f64::from(x)).abs() <= 0.5 / 4_294_967_296.0,
                "{x}: {back}"
            );
        }
        // Sums wrap through zero in two's complement.
        let add = |a: (u32, u32), b: (u32, u32)| {
            let (lo, carry) = a.0.overflowing_add(b.0);
            (lo, a.1.wrapping_add(b.1).wrapping_add(u32::from(carry)))
        };
        let minus = grad_words(-0.25).unwrap();
        let plus = grad_words(0.75).unwrap();
        let sum = add(minus, plus);
        assert_eq!(grad_value(sum.0, sum.1), 0.5);
        for x in [f32::NAN, f32::INFINITY, -GRAD_MAX_CONTRIBUTION, 1.0e30] {
            assert_eq!(grad_words(x), None, "{x}");
        }
    }
}
