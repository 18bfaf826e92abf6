//! The typed representation of the variant functions that every C-like GPU
//! dialect prints: scalar types, literals, operators, functions and casts as
//! enums, and statements. It still has the IR's semantics (`+` on `i32`
//! wraps, `/` by zero is 0, `min` ignores a NaN); each [`Dialect`] prints a
//! node in whatever form gives its target those semantics (an intrinsic, a
//! helper, an operator).
//!
//! [`Dialect`]: super::Dialect

use crate::ir::{self, Arg, Local};
use std::fmt;

/// A scalar type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Type {
    /// 32-bit float.
    F32,
    /// 32-bit signed integer.
    I32,
    /// 32-bit unsigned integer.
    U32,
    /// Boolean.
    Bool,
}

impl From<ir::Ty> for Type {
    fn from(t: ir::Ty) -> Type {
        match t {
            ir::Ty::F32 => Type::F32,
            ir::Ty::I32 => Type::I32,
            ir::Ty::U32 => Type::U32,
            ir::Ty::Bool => Type::Bool,
        }
    }
}

/// A constant. Any `f32`, including the non-finite ones, which no C-like
/// target has a literal for: the dialect writes those its own way.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Literal {
    /// An `f32`.
    F32(f32),
    /// An `i32`.
    I32(i32),
    /// A `u32`.
    U32(u32),
    /// A `bool`.
    Bool(bool),
}

/// Prefix operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// Arithmetic negation (`f32`; `i32` wrapping).
    Neg,
    /// Logical not.
    Not,
}

impl UnaryOp {
    /// The operator as C-like languages write it.
    pub fn symbol(self) -> &'static str {
        match self {
            UnaryOp::Neg => "-",
            UnaryOp::Not => "!",
        }
    }
}

/// Infix operators, with the IR's meaning ([`ir::BinOp`]).
pub use crate::ir::BinOp as BinaryOp;

/// The functions a lowered variant calls. The argument types are the
/// [`Expr::Call`]'s; the result has the arguments' type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Func {
    /// `e^x` (f32).
    Exp,
    /// `2^x` (f32).
    Exp2,
    /// Natural logarithm (f32).
    Log,
    /// Base-2 logarithm (f32).
    Log2,
    /// Square root (f32).
    Sqrt,
    /// Rounding down (f32).
    Floor,
    /// Rounding up (f32).
    Ceil,
    /// `tanh`, exact near 0 and never NaN for large |x| (f32).
    Tanh,
    /// `1 / (1 + e^-x)` (f32).
    Sigmoid,
    /// Sine, radians, within 2 ulp for |x| < 1e5 (f32).
    Sin,
    /// Cosine, likewise (f32).
    Cos,
    /// Tangent, likewise (f32).
    Tan,
    /// Absolute value (f32, i32 wrapping; never u32, which the lowering
    /// drops).
    Abs,
    /// The smaller of two; with a NaN operand, the other one.
    Min,
    /// The larger of two; with a NaN operand, the other one.
    Max,
    /// Saturating `i32` addition.
    SatAdd,
    /// Saturating `i32` subtraction.
    SatSub,
    /// Saturating `i32` multiplication.
    SatMul,
}

/// A name in a function body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Name {
    /// A function argument.
    Arg(Arg),
    /// A `let`-bound value.
    Local(Local),
    /// The parameter block.
    Params,
    /// The capture arena (see [`crate::params`]).
    Captures,
    /// `score`, `score_grad` and `sink`'s last argument: the pair is
    /// visible (the row exists, for `sink`), so the reference evaluates the
    /// function there (a checked read reports an index out of range only
    /// then).
    Seen,
    /// An argument of a function the compiler writes itself (the row
    /// normalisation's, [`super::weights`]), by its name.
    Var(&'static str),
}

/// The name of a name in every dialect: the argument's own, `l<N>` for a
/// local, `params` for the parameter block.
impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Name::Arg(a) => f.write_str(a.name()),
            Name::Local(l) => write!(f, "l{}", l.0),
            Name::Params => f.write_str("params"),
            Name::Captures => f.write_str("captures"),
            Name::Seen => f.write_str("seen"),
            Name::Var(name) => f.write_str(name),
        }
    }
}

/// An expression. Compound forms are written fully parenthesised by every
/// dialect, so precedence never depends on a printer.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// A constant.
    Lit(Literal),
    /// An argument or a local.
    Name(Name),
    /// Member `member` of the parameter block, declared with type `ty`.
    Param {
        /// The member's name.
        member: String,
        /// Its declared (storage) type.
        ty: Type,
    },
    /// A prefix operation on a value of type `ty`.
    Unary(UnaryOp, Type, Box<Expr>),
    /// An infix operation whose operands have type `ty`.
    Binary(BinaryOp, Type, Box<Expr>, Box<Expr>),
    /// A call; every argument has type `ty`.
    Call(Func, Type, Vec<Expr>),
    /// A conversion from `from` to `to` (never the identity): float → int
    /// saturates with NaN → 0, int → float rounds to nearest, int ↔ int keeps
    /// the bits, bool → int is 0 or 1.
    Cast {
        /// The result type.
        to: Type,
        /// The operand's type.
        from: Type,
        /// The operand.
        value: Box<Expr>,
    },
    /// `if cond { then } else { otherwise }`, both sides pure.
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
    /// The capture arena's `u32` word at index `.0` (a read proved in range).
    Capture(Box<Expr>),
    /// The arena's word at `word` when `ok`, else 0 without reading; when
    /// `report` and not `ok`, the first such read of the launch records
    /// `site` and its `indices` (as `u32` bits) in the arena's error words.
    CheckedCapture {
        /// The word's index.
        word: Box<Expr>,
        /// Every checked bound holds.
        ok: Box<Expr>,
        /// The read is evaluated where the reference evaluates it.
        report: Box<Expr>,
        /// The read's site.
        site: u32,
        /// Its indices, as `u32` bits (one to four).
        indices: Vec<Expr>,
    },
    /// The bits of a `u32` as a value of type `.0` (`f32` or `i32`).
    Bits(Type, Box<Expr>),
    /// Whether an `f32` is `-inf` (a `bool`), by its bits: WGSL compilers
    /// may assume floats finite in comparisons.
    NegInf(Box<Expr>),
    /// The least (`max = false`) or greatest `i32` among `count` summary
    /// entries of the arena from word `first`, `stride` words apart; with
    /// `count = 0`, `i32::MIN` (`i32::MAX` for the greatest).
    Summary {
        /// The first entry's word.
        first: Box<Expr>,
        /// Words between entries.
        stride: Box<Expr>,
        /// Entries (at most [`SUMMARY_MAX_BLOCKS`](crate::params::SUMMARY_MAX_BLOCKS)).
        count: Box<Expr>,
        /// The greatest, else the least.
        max: bool,
    },
}

/// A statement of a function body.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// A name the function takes but never reads (C-like targets warn).
    Unused(Name),
    /// An immutable local.
    Let(Local, Type, Expr),
    /// The result.
    Return(Expr),
}

/// One variant function. Every function of a kind takes the same
/// arguments, read or not, and may read the parameter block.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    /// Its name in the target (`variant_score`, ...).
    pub name: String,
    /// Its arguments, in order, with their types.
    pub args: Vec<(Name, Type)>,
    /// It takes the parameter block and the capture arena first (every
    /// variant function does; the normalisation's functions, which read
    /// neither, do not).
    pub block: bool,
    /// It takes a last argument `seen: bool` ([`Name::Seen`]): `score`,
    /// `score_grad` and `sink` do.
    pub seen: bool,
    /// Its result type.
    pub ret: Type,
    /// Its body: `Unused` statements first, then `Let`s, then one `Return`.
    pub body: Vec<Stmt>,
}

/// One member of the parameter block struct.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Its name.
    pub name: String,
    /// Its type (never `bool`: a block holds words).
    pub ty: Type,
}

/// The parameter block as a struct: one member per field, then
/// `padding_words` zero words, then the `trailing` members (a dropout
/// variant's call state), [`PARAM_WORDS`](crate::params::PARAM_WORDS) in all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamsStruct {
    /// The fields' members, in word order.
    pub members: Vec<Member>,
    /// Zero words after them.
    pub padding_words: usize,
    /// Members at the end of the block, one word each.
    pub trailing: Vec<Member>,
}
