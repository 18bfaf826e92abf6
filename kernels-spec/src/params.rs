//! The parameter block: how a variant's fields travel to the GPU kernels.
//!
//! Every GPU kernel of every variant takes the same fixed-size block of
//! [`PARAM_WORDS`] 32-bit words (a by-value `Params` struct in CUDA, a
//! uniform buffer in WGSL), so a new parameter value never recompiles a
//! kernel and every variant's kernels share one signature. The
//! [`ParamLayout`] says which words hold which field; it is built once, by
//! [`check`](crate::check), and read by every emitter (to declare the
//! struct), by the macro (to pack a value into [`ParamWords`]) and by the
//! runtimes (which bind the words as they are).
//!
//! Encoding, one word per scalar field in declaration order: `f32` as its
//! bits, `i32` and `u32` as their bits, `bool` as 0 or 1 (stored as `u32`,
//! since WGSL uniforms cannot hold `bool`). The words after the last field
//! are zero.

use crate::ir::{ParamDecl, Ty};
use std::fmt;

/// 32-bit words in the parameter block of every kernel.
pub const PARAM_WORDS: usize = 32;

/// The parameter block's contents, as every GPU kernel receives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct ParamWords(pub [u32; PARAM_WORDS]);

impl ParamWords {
    /// All words zero: the block of a variant without fields.
    pub const ZERO: ParamWords = ParamWords([0; PARAM_WORDS]);

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

/// How a field's value becomes its word.
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

/// Where one field lives in the block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSlot {
    /// The field's name.
    pub name: String,
    /// The field's type in the language.
    pub ty: Ty,
    /// Index of its first word.
    pub word: usize,
}

impl ParamSlot {
    /// Words the field takes: one for every scalar.
    pub fn words(&self) -> usize {
        words_of(self.ty)
    }

    /// The type the word is declared with in a kernel: the field's own
    /// type, but `u32` for `bool` (read back as `word != 0`).
    pub fn storage(&self) -> Ty {
        match self.ty {
            Ty::Bool => Ty::U32,
            t => t,
        }
    }

    /// How a value of the field is encoded.
    pub fn encoding(&self) -> Encoding {
        match self.ty {
            Ty::F32 => Encoding::F32Bits,
            Ty::I32 => Encoding::I32Bits,
            Ty::U32 => Encoding::U32,
            Ty::Bool => Encoding::Bool,
        }
    }

    /// The member of the kernels' `Params` struct that holds the field.
    pub fn member(&self) -> String {
        format!("p_{}", self.name)
    }
}

/// Words a field of type `ty` takes.
pub fn words_of(ty: Ty) -> usize {
    match ty {
        Ty::F32 | Ty::I32 | Ty::U32 | Ty::Bool => 1,
    }
}

/// The fields of one variant, placed in the block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParamLayout {
    slots: Vec<ParamSlot>,
}

/// A field that does not fit the block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overflow {
    /// Index of the first field that crosses [`PARAM_WORDS`].
    pub field: usize,
    /// Words the fields up to and including it need.
    pub needed: usize,
}

impl fmt::Display for Overflow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the fields up to this one need {} parameter words; the kernels' parameter \
             block holds {PARAM_WORDS} (one word per f32, i32, u32 or bool field)",
            self.needed
        )
    }
}

impl ParamLayout {
    /// Place `params` in declaration order, or say which field crosses the
    /// limit.
    pub fn new(params: &[ParamDecl]) -> Result<ParamLayout, Overflow> {
        let mut slots = Vec::with_capacity(params.len());
        let mut word = 0;
        for (field, p) in params.iter().enumerate() {
            let needed = word + words_of(p.ty);
            if needed > PARAM_WORDS {
                return Err(Overflow { field, needed });
            }
            slots.push(ParamSlot {
                name: p.name.clone(),
                ty: p.ty,
                word,
            });
            word = needed;
        }
        Ok(ParamLayout { slots })
    }

    /// The fields, in declaration order.
    pub fn slots(&self) -> &[ParamSlot] {
        &self.slots
    }

    /// Words the fields take.
    pub fn used_words(&self) -> usize {
        self.slots.last().map_or(0, |s| s.word + s.words())
    }

    /// Zero words after the last field, up to [`PARAM_WORDS`].
    pub fn padding_words(&self) -> usize {
        PARAM_WORDS - self.used_words()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn fields_take_one_word_each_in_order() {
        let layout = ParamLayout::new(&decls(&[Ty::F32, Ty::Bool, Ty::U32, Ty::I32])).unwrap();
        let placed: Vec<(usize, Ty, Encoding)> = layout
            .slots()
            .iter()
            .map(|s| (s.word, s.storage(), s.encoding()))
            .collect();
        assert_eq!(
            placed,
            [
                (0, Ty::F32, Encoding::F32Bits),
                (1, Ty::U32, Encoding::Bool),
                (2, Ty::U32, Encoding::U32),
                (3, Ty::I32, Encoding::I32Bits),
            ]
        );
        assert_eq!((layout.used_words(), layout.padding_words()), (4, 28));
        assert_eq!(layout.slots()[1].member(), "p_f1");
    }

    #[test]
    fn the_limit_is_exact() {
        let empty = ParamLayout::new(&[]).unwrap();
        assert_eq!((empty.used_words(), empty.padding_words()), (0, 32));
        let full = ParamLayout::new(&decls(&[Ty::I32; PARAM_WORDS])).unwrap();
        assert_eq!(full.padding_words(), 0);
        let over = ParamLayout::new(&decls(&[Ty::I32; PARAM_WORDS + 2])).unwrap_err();
        assert_eq!(
            over,
            Overflow {
                field: PARAM_WORDS,
                needed: PARAM_WORDS + 1
            }
        );
        assert!(over.to_string().contains("33 parameter words"), "{over}");
        assert!(over.to_string().contains("holds 32"), "{over}");
    }
}
