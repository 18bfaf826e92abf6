//! Stage 3, the IR: typed, name-resolved, target-neutral.
//!
//! Every emitter (CPU, WGSL, CUDA) and every analysis reads this IR and only
//! this IR. Invariants (established by `check`, kept by every pass):
//! - every [`Expr`] carries its type, and operands have the types their
//!   operator requires (no implicit conversions);
//! - [`ExprKind::Local`] refers to a binding of an enclosing [`ExprKind::Let`];
//! - [`Builtin::SatAdd`], [`Builtin::SatSub`], [`Builtin::SatMul`] and
//!   [`ExprKind::ReadRange`] appear only in tile classifiers built by the
//!   analysis, never in user functions.
//!
//! Semantics shared by all targets: `i32`/`u32` `+ - *` wrap; `/` and `%` by
//! zero give 0 (and `i32::MIN / -1` wraps); float → int casts saturate with
//! NaN → 0; int ↔ int casts keep the bits. Evaluation is Rust's: a `let`'s
//! value when it is bound, the right operand of `&&`/`||` and one arm of
//! `if`/`else` only when they decide the value. Nothing but a checked
//! tensor read (an index out of range is reported, and reads nothing) can
//! tell the order apart.

mod weights;

pub use weights::{Normalize, Weights};

use crate::params::ParamLayout;
use std::fmt;

/// A scalar type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    /// 32-bit float.
    F32,
    /// 32-bit signed integer (the type of positions and indices).
    I32,
    /// 32-bit unsigned integer.
    U32,
    /// Boolean.
    Bool,
}

impl Ty {
    /// Whether arithmetic is defined on this type.
    pub fn is_numeric(self) -> bool {
        !matches!(self, Ty::Bool)
    }

    /// Whether this is an integer type.
    pub fn is_int(self) -> bool {
        matches!(self, Ty::I32 | Ty::U32)
    }

    /// The name in the language (and in Rust).
    pub fn name(self) -> &'static str {
        match self {
            Ty::F32 => "f32",
            Ty::I32 => "i32",
            Ty::U32 => "u32",
            Ty::Bool => "bool",
        }
    }
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A function argument, by role. Score and mask functions take the first
/// five; tile classifiers take the tile bounds instead of `q`/`kv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arg {
    /// The scaled logit `q·k * scale` (f32).
    S,
    /// Batch index (i32).
    B,
    /// Query head index (i32).
    H,
    /// Query position, bottom-right aligned (i32).
    Q,
    /// Key position (i32).
    Kv,
    /// Lowest query position of a tile (i32).
    QLo,
    /// Highest query position of a tile (i32).
    QHi,
    /// Lowest key position of a tile (i32).
    KvLo,
    /// Highest key position of a tile (i32).
    KvHi,
}

impl Arg {
    /// The argument's type.
    pub fn ty(self) -> Ty {
        match self {
            Arg::S => Ty::F32,
            _ => Ty::I32,
        }
    }

    /// The argument's name in emitted code.
    pub fn name(self) -> &'static str {
        match self {
            Arg::S => "s",
            Arg::B => "b",
            Arg::H => "h",
            Arg::Q => "q",
            Arg::Kv => "kv",
            Arg::QLo => "q_lo",
            Arg::QHi => "q_hi",
            Arg::KvLo => "kv_lo",
            Arg::KvHi => "kv_hi",
        }
    }
}

/// A `let`-bound value, numbered uniquely within a function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Local(pub u32);

/// A constant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Const {
    /// A float, kept in f64 so an f64 reference sees the literal as written.
    Float(f64),
    /// An integer of the expression's type (`i32` or `u32`).
    Int(i64),
    /// A boolean.
    Bool(bool),
}

/// Unary operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnOp {
    /// Arithmetic negation (f32, i32; wraps).
    Neg,
    /// Logical not (bool).
    Not,
}

/// Binary operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinOp {
    /// `+`
    Add,
    /// `-`
    Sub,
    /// `*`
    Mul,
    /// `/`
    Div,
    /// `%` (truncated remainder, like Rust, C and WGSL)
    Rem,
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
    /// `&&`
    And,
    /// `||`
    Or,
}

impl BinOp {
    /// The operator as written.
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::Rem => "%",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
            BinOp::Lt => "<",
            BinOp::Le => "<=",
            BinOp::Gt => ">",
            BinOp::Ge => ">=",
            BinOp::And => "&&",
            BinOp::Or => "||",
        }
    }

    /// Comparison operators: numeric operands, bool result.
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge
        )
    }

    /// Logical operators: bool operands and result.
    pub fn is_logical(self) -> bool {
        matches!(self, BinOp::And | BinOp::Or)
    }
}

/// The language's functions, and the analysis's internal ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Builtin {
    /// `exp(x)` (f32)
    Exp,
    /// `exp2(x)` (f32)
    Exp2,
    /// `log(x)`, natural (f32)
    Log,
    /// `log2(x)` (f32)
    Log2,
    /// `sqrt(x)` (f32)
    Sqrt,
    /// `tanh(x)` (f32)
    Tanh,
    /// `sin(x)`, radians (f32)
    Sin,
    /// `cos(x)`, radians (f32)
    Cos,
    /// `tan(x)`, radians (f32)
    Tan,
    /// `sigmoid(x) = 1 / (1 + exp(-x))` (f32)
    Sigmoid,
    /// `abs(x)` (f32, i32 wrapping, u32 identity)
    Abs,
    /// `min(a, b)` (numeric)
    Min,
    /// `max(a, b)` (numeric)
    Max,
    /// `clamp(x, lo, hi) = min(max(x, lo), hi)` (numeric; never panics)
    Clamp,
    /// `floor(x)` (f32)
    Floor,
    /// `ceil(x)` (f32)
    Ceil,
    /// Saturating `i32` addition (tile classifiers only).
    SatAdd,
    /// Saturating `i32` subtraction (tile classifiers only).
    SatSub,
    /// Saturating `i32` multiplication (tile classifiers only).
    SatMul,
}

/// Which types a builtin accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Domain {
    /// f32 only.
    Float,
    /// Any numeric type; all arguments share it.
    Numeric,
    /// i32 only.
    I32,
}

impl Builtin {
    /// The user-visible functions, by name.
    pub const USER: [Builtin; 16] = [
        Builtin::Exp,
        Builtin::Exp2,
        Builtin::Log,
        Builtin::Log2,
        Builtin::Sqrt,
        Builtin::Tanh,
        Builtin::Sin,
        Builtin::Cos,
        Builtin::Tan,
        Builtin::Sigmoid,
        Builtin::Abs,
        Builtin::Min,
        Builtin::Max,
        Builtin::Clamp,
        Builtin::Floor,
        Builtin::Ceil,
    ];

    /// Look up a user-visible function by name.
    pub fn from_name(name: &str) -> Option<Builtin> {
        Self::USER.into_iter().find(|b| b.name() == name)
    }

    /// The function's name.
    pub fn name(self) -> &'static str {
        match self {
            Builtin::Exp => "exp",
            Builtin::Exp2 => "exp2",
            Builtin::Log => "log",
            Builtin::Log2 => "log2",
            Builtin::Sqrt => "sqrt",
            Builtin::Tanh => "tanh",
            Builtin::Sin => "sin",
            Builtin::Cos => "cos",
            Builtin::Tan => "tan",
            Builtin::Sigmoid => "sigmoid",
            Builtin::Abs => "abs",
            Builtin::Min => "min",
            Builtin::Max => "max",
            Builtin::Clamp => "clamp",
            Builtin::Floor => "floor",
            Builtin::Ceil => "ceil",
            Builtin::SatAdd => "sat_add",
            Builtin::SatSub => "sat_sub",
            Builtin::SatMul => "sat_mul",
        }
    }

    /// Number of arguments.
    pub fn arity(self) -> usize {
        match self {
            Builtin::Min | Builtin::Max | Builtin::SatAdd | Builtin::SatSub | Builtin::SatMul => 2,
            Builtin::Clamp => 3,
            _ => 1,
        }
    }

    /// Accepted argument types (the result has the arguments' type).
    pub fn domain(self) -> Domain {
        match self {
            Builtin::Abs | Builtin::Min | Builtin::Max | Builtin::Clamp => Domain::Numeric,
            Builtin::SatAdd | Builtin::SatSub | Builtin::SatMul => Domain::I32,
            _ => Domain::Float,
        }
    }
}

/// A typed expression.
#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    /// What it computes.
    pub kind: ExprKind,
    /// Its type.
    pub ty: Ty,
}

/// Expression forms.
#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    /// A constant.
    Const(Const),
    /// A function argument.
    Arg(Arg),
    /// A variant parameter (`self.field`), by index into [`Program::params`].
    Param(usize),
    /// A `let`-bound value.
    Local(Local),
    /// A unary operation.
    Unary(UnOp, Box<Expr>),
    /// A binary operation.
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// A function call.
    Call(Builtin, Vec<Expr>),
    /// A conversion of the operand to this expression's type.
    Cast(Box<Expr>),
    /// `if cond { then } else { otherwise }` (both sides are pure).
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
    /// `let local = value; body`.
    Let(Local, Box<Expr>, Box<Expr>),
    /// An element of a captured tensor (`self.doc[b][q]`).
    Read(Read),
    /// A bound on the elements of a captured tensor over a range of one
    /// index (tile classifiers only, see [`ReadRange`]).
    ReadRange(ReadRange),
    /// The size of dimension `.1` of captured tensor `.0`, as an `i32`
    /// (tile classifiers only).
    Dim(usize, usize),
}

/// `tensor[indices...]`: an element of captured tensor `tensor` (an index
/// into [`Program::tensors`]), of the expression's type (the element type).
/// Every index is an `i32` or `u32` expression.
#[derive(Clone, Debug, PartialEq)]
pub struct Read {
    /// The tensor.
    pub tensor: usize,
    /// One index per dimension.
    pub indices: Vec<Expr>,
    /// Which bounds of each index the kernels check at run time: the ones
    /// that [`crate::analysis::reads`] could not prove from the declared
    /// shape. `check` makes every bound checked; the analysis clears what it
    /// proves.
    pub checks: Vec<IndexCheck>,
    /// The read's number within its program, for error reports.
    pub site: u32,
}

/// `constant + Σ per_size[s] · s` over the problem's sizes, in the order of
/// [`Size::ALL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SizeForm {
    /// The constant term.
    pub constant: i64,
    /// The coefficient of each size.
    pub per_size: [i64; 5],
}

impl SizeForm {
    /// The value for sizes `[B, Hq, Hkv, Sq, Sk]`.
    pub fn eval(&self, sizes: [i64; 5]) -> i64 {
        self.per_size
            .iter()
            .zip(sizes)
            .fold(self.constant, |acc, (k, s)| acc + k * s)
    }
}

/// When one checked bound of an index holds, from the call's sizes alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Holds {
    /// Not from the sizes (the index depends on a parameter or a value).
    Never,
    /// When the form is non-negative.
    NonNegative(SizeForm),
    /// When the form (the index's greatest value) is below the tensor's
    /// dimension `axis` (declared `_`, so known at call time only).
    BelowDim(SizeForm, usize),
}

/// What makes every check of one read site hold for a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiteCondition {
    /// The site.
    pub site: u32,
    /// The tensor it reads.
    pub tensor: usize,
    /// One per checked bound.
    pub holds: Vec<Holds>,
}

/// Which bounds of one index are checked at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IndexCheck {
    /// `index >= 0` is not proven.
    pub lower: bool,
    /// `index < dim` is not proven.
    pub upper: bool,
}

impl IndexCheck {
    /// Both bounds checked.
    pub const BOTH: IndexCheck = IndexCheck {
        lower: true,
        upper: true,
    };

    /// Neither bound checked (proven in range).
    pub const NONE: IndexCheck = IndexCheck {
        lower: false,
        upper: false,
    };

    /// Whether some bound is checked.
    pub fn any(self) -> bool {
        self.lower || self.upper
    }
}

/// A bound on elements of `tensor`, for tile classifiers: with `axis =
/// None`, the element at `indices`; with `axis = Some(a)`, the smallest
/// (`max = false`) or largest (`max = true`) element where index `a` runs
/// over `indices[a] ..= hi` and the others are `indices`. Targets may widen
/// a range to whole blocks of their per-call summaries, and return
/// `i32::MIN` for the smallest (`i32::MAX` for the largest) when the range
/// is empty, reaches outside the tensor or spans more than
/// [`SUMMARY_MAX_BLOCKS`](crate::params::SUMMARY_MAX_BLOCKS) blocks; an
/// element outside the tensor is `i32::MIN` (`i32::MAX`). So the result is
/// always a sound bound, and reading it never fails. `i32` elements only.
#[derive(Clone, Debug, PartialEq)]
pub struct ReadRange {
    /// The tensor.
    pub tensor: usize,
    /// The index that runs over the range, if any.
    pub axis: Option<usize>,
    /// One index per dimension; entry `axis` is the range's low end.
    pub indices: Vec<Expr>,
    /// The range's high end (inclusive); unused without an axis.
    pub hi: Box<Expr>,
    /// The largest element, else the smallest.
    pub max: bool,
}

impl Expr {
    /// A float constant.
    pub fn float(v: f64) -> Expr {
        Expr {
            kind: ExprKind::Const(Const::Float(v)),
            ty: Ty::F32,
        }
    }

    /// An i32 constant.
    pub fn i32(v: i32) -> Expr {
        Expr {
            kind: ExprKind::Const(Const::Int(v.into())),
            ty: Ty::I32,
        }
    }

    /// A bool constant.
    pub fn bool(v: bool) -> Expr {
        Expr {
            kind: ExprKind::Const(Const::Bool(v)),
            ty: Ty::Bool,
        }
    }

    /// An argument.
    pub fn arg(a: Arg) -> Expr {
        Expr {
            kind: ExprKind::Arg(a),
            ty: a.ty(),
        }
    }

    /// A local of type `ty`.
    pub fn local(l: Local, ty: Ty) -> Expr {
        Expr {
            kind: ExprKind::Local(l),
            ty,
        }
    }

    /// The constant value, if this is a constant.
    pub fn as_const(&self) -> Option<Const> {
        match self.kind {
            ExprKind::Const(c) => Some(c),
            _ => None,
        }
    }

    /// Whether this is the float constant `v`.
    pub fn is_float(&self, v: f64) -> bool {
        matches!(self.kind, ExprKind::Const(Const::Float(x)) if x == v)
    }

    /// Visit every sub-expression, this one first.
    pub fn walk(&self, f: &mut impl FnMut(&Expr)) {
        f(self);
        self.for_each_child(&mut |c| c.walk(f));
    }

    /// Visit the direct sub-expressions, in order.
    pub fn for_each_child(&self, f: &mut impl FnMut(&Expr)) {
        match &self.kind {
            ExprKind::Const(_)
            | ExprKind::Arg(_)
            | ExprKind::Param(_)
            | ExprKind::Local(_)
            | ExprKind::Dim(..) => {}
            ExprKind::Read(r) => r.indices.iter().for_each(f),
            ExprKind::ReadRange(r) => {
                r.indices.iter().for_each(&mut *f);
                f(&r.hi);
            }
            ExprKind::Unary(_, a) | ExprKind::Cast(a) => f(a),
            ExprKind::Binary(_, a, b) | ExprKind::Let(_, a, b) => {
                f(a);
                f(b);
            }
            ExprKind::Call(_, args) => args.iter().for_each(f),
            ExprKind::Select(c, t, e) => {
                f(c);
                f(t);
                f(e);
            }
        }
    }

    /// Whether the expression reads a captured tensor.
    pub fn reads_tensor(&self) -> bool {
        let mut found = false;
        self.walk(&mut |e| found |= matches!(e.kind, ExprKind::Read(_)));
        found
    }

    /// Whether the expression reads argument `arg`.
    pub fn uses_arg(&self, arg: Arg) -> bool {
        let mut found = false;
        self.walk(&mut |e| found |= e.kind == ExprKind::Arg(arg));
        found
    }
}

/// A function of the program: a score, a mask, a derivative or a classifier.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    /// Its name in emitted code.
    pub name: &'static str,
    /// Its arguments, in order.
    pub args: Vec<Arg>,
    /// Its result type.
    pub ret: Ty,
    /// Its body.
    pub body: Expr,
}

/// A variant parameter (a field of the struct).
#[derive(Clone, Debug, PartialEq)]
pub struct ParamDecl {
    /// Field name.
    pub name: String,
    /// Field type.
    pub ty: Ty,
}

/// A captured tensor (a field declared `#[tensor(elem, [dims])]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDecl {
    /// Field name.
    pub name: String,
    /// Element type the kernels hold (`i32`, `u32` or `f32`).
    pub elem: Ty,
    /// What the caller passes, where it differs from `elem`.
    pub given: Given,
    /// The declared shape, outermost first (0 to 4 dimensions; none: one
    /// value, read as `self.field`).
    pub dims: Vec<DimDecl>,
    /// A learnable tensor: the field is a `Var<R>` (of `f32`), whose reads
    /// in `score` and `sink` get gradients.
    pub learnable: bool,
}

/// What a captured tensor's caller passes, where the kernels hold another
/// element type (PyTorch's masks as data and index tensors).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Given {
    /// The element type itself.
    #[default]
    Elem,
    /// `bool` (numr's `DType::Bool`, or `U8`): held as an i32 0 or 1 (so
    /// that the tile classifier bounds it), and a read is a `bool`.
    Bool,
    /// `i64`: held as i32, every value checked to fit at each call; a read
    /// is an `i32`.
    I64,
}

/// A read of a learnable tensor in `score` or `sink`: what the backward
/// adds into the tensor's gradient, `dz · grad(..)` at element `index(..)`,
/// for each (query, key) pair (`score`; `dz = d loss / d score`) or each
/// query row (`sink`; `dz = d loss / d sink`).
#[derive(Clone, Debug, PartialEq)]
pub struct LearnableSite {
    /// The read's site number.
    pub site: u32,
    /// The tensor read ([`Program::tensors`]).
    pub tensor: usize,
    /// The tensor's place among the learnable ones ([`Program::learnable`]).
    pub slot: usize,
    /// The read is in `sink` (else in `score`).
    pub in_sink: bool,
    /// d f / d (the value read), with `f`'s signature.
    pub grad: Function,
    /// The element read, as a row-major linear index (`-1` outside the
    /// tensor), with `f`'s signature.
    pub index: Function,
}

/// One declared dimension of a captured tensor. Checked against the
/// tensor's shape at every call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DimDecl {
    /// A size of the problem.
    Size(Size),
    /// This many.
    Fixed(u32),
    /// Any size (`_`).
    Any,
}

/// A size of the problem, as tensor shapes are declared in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Size {
    /// `B`, the batch.
    B,
    /// `Hq`, the query heads.
    Hq,
    /// `Hkv`, the key/value heads.
    Hkv,
    /// `Sq`, the query length.
    Sq,
    /// `Sk`, the key length.
    Sk,
}

impl Size {
    /// Every size, by name.
    pub const ALL: [Size; 5] = [Size::B, Size::Hq, Size::Hkv, Size::Sq, Size::Sk];

    /// Its name in declarations.
    pub const fn name(self) -> &'static str {
        match self {
            Size::B => "B",
            Size::Hq => "Hq",
            Size::Hkv => "Hkv",
            Size::Sq => "Sq",
            Size::Sk => "Sk",
        }
    }
}

impl fmt::Display for DimDecl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DimDecl::Size(s) => f.write_str(s.name()),
            DimDecl::Fixed(n) => write!(f, "{n}"),
            DimDecl::Any => f.write_str("_"),
        }
    }
}

/// What a tile's mask is known to be over a whole (query range × key range),
/// as the classifier ([`Program::classify`]) returns it, by its
/// [`code`](TileClass::code).
///
/// Produced by interval analysis of the mask: `Empty` and `Full` are proofs,
/// `Partial` means "evaluate the mask per element" (it is always safe).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TileClass {
    /// No (query, key) pair in the tile is visible: the tile is skipped.
    Empty,
    /// Some pairs may be visible: the mask is evaluated per element.
    Partial,
    /// Every pair is visible: the mask is not evaluated.
    Full,
}

impl TileClass {
    /// Every class, in code order.
    pub const ALL: [TileClass; 3] = [TileClass::Empty, TileClass::Partial, TileClass::Full];

    /// The `i32` a classifier returns for this class, on every target.
    #[inline]
    pub const fn code(self) -> i32 {
        match self {
            TileClass::Empty => 0,
            TileClass::Partial => 1,
            TileClass::Full => 2,
        }
    }

    /// The class of a classifier's result; anything but the codes of
    /// `Empty` and `Full` is `Partial` (always safe).
    pub const fn from_code(code: i32) -> TileClass {
        match code {
            0 => TileClass::Empty,
            2 => TileClass::Full,
            _ => TileClass::Partial,
        }
    }

    /// The name of the constant that kernel templates compare a class code
    /// with (`TILE_EMPTY`, ...), declared by each target from [`code`](Self::code).
    pub const fn constant(self) -> &'static str {
        match self {
            TileClass::Empty => "TILE_EMPTY",
            TileClass::Partial => "TILE_PARTIAL",
            TileClass::Full => "TILE_FULL",
        }
    }
}

/// A compiled variant: everything the emitters need.
#[derive(Clone, Debug, PartialEq)]
pub struct Program {
    /// The variant's name.
    pub name: String,
    /// Its parameters, in field order ([`ExprKind::Param`] indexes them).
    pub params: Vec<ParamDecl>,
    /// Its captured tensors, in field order ([`ExprKind::Read`] indexes
    /// them).
    pub tensors: Vec<TensorDecl>,
    /// Where each parameter and each tensor's shape travel in the kernels'
    /// parameter block.
    pub layout: ParamLayout,
    /// The `(tensor, axis)` pairs whose per-call summaries the classifier
    /// reads ([`ExprKind::ReadRange`]), in order.
    pub summaries: Vec<(usize, usize)>,
    /// What makes the checks of each checked read hold for one call (a
    /// call for which all hold can report no read out of range).
    pub read_conditions: Vec<SiteCondition>,
    /// `score(s, b, h, q, kv) -> f32`.
    pub score: Function,
    /// `score_grad(s, b, h, q, kv) -> f32`: d score / d s.
    pub score_grad: Function,
    /// `mask(b, h, q, kv) -> bool`.
    pub mask: Function,
    /// `sink(b, h, q)`: one more logit in each query row's softmax, which
    /// carries no value (`-inf` when the variant declares none).
    pub sink: Function,
    /// `classify(b, h, q_lo, q_hi, kv_lo, kv_hi) -> i32`, a [`TileClass`] code.
    pub classify: Function,
    /// `score` is the identity (it was not given, or is `|s, ..| s`).
    pub score_is_identity: bool,
    /// `score_grad` is the constant 1: `score` is `s` plus terms that do
    /// not depend on it (a bias, ALiBi), so a backward multiplies nothing
    /// by it.
    pub score_grad_is_one: bool,
    /// `score_grad` is the variant's own (`score_grad = |..| ..`), not the
    /// derivative of `score`: a straight-through or clamped gradient,
    /// which finite differences of `score` need not match.
    pub score_grad_given: bool,
    /// A mask was given.
    pub has_mask: bool,
    /// How each row's scores become weights: `normalize = ..`, the sink
    /// (without one, `sink` is `-inf`: no extra logit) and `dropout`.
    pub weights: Weights,
    /// `dropout() -> f32`: the probability of dropping a pair, an
    /// expression of the scalar fields (`0.0` without `dropout`).
    pub dropout: Function,
    /// Per-variant tile size overrides `(q, kv)`.
    pub tile: (Option<u32>, Option<u32>),
    /// The learnable tensors ([`Program::tensors`] indices), in field
    /// order: gradient slot `k` is tensor `learnable[k]`.
    pub learnable: Vec<usize>,
    /// Every read of a learnable tensor in `score` and `sink`, in site
    /// order.
    pub learnable_sites: Vec<LearnableSite>,
}

impl Program {
    /// Every function, in the order the targets print them: `score`,
    /// `score_grad`, `mask`, `sink`, `classify`.
    pub fn functions(&self) -> [&Function; 5] {
        [
            &self.score,
            &self.score_grad,
            &self.mask,
            &self.sink,
            &self.classify,
        ]
    }

    /// The functions that read tensors by index (`score`, `mask`, `sink`;
    /// `score_grad` reads what `score` does, `classify` reads summaries).
    pub fn reading_functions(&self) -> [&Function; 3] {
        [&self.score, &self.mask, &self.sink]
    }

    /// Whether every read of a learnable tensor in `score` lands on an
    /// element, and has a derivative, that depend on the query and key
    /// positions only through their difference (`kv - q` or `q - kv`, as
    /// written) and not on the logit: a relative-position bias, ALiBi's
    /// slopes. The pairs of a diagonal then add the same derivative at the
    /// same element, so a backward may sum `dz` along each diagonal first
    /// and evaluate the read once per diagonal. A syntactic test: a
    /// position used any other way (even through a `let` of `q` alone)
    /// answers no.
    pub fn score_grads_by_difference(&self) -> bool {
        let by_difference = |e: &Expr| {
            fn walk(e: &Expr, ok: &mut bool) {
                match &e.kind {
                    ExprKind::Binary(BinOp::Sub, a, b)
                        if matches!(
                            (&a.kind, &b.kind),
                            (ExprKind::Arg(Arg::Kv), ExprKind::Arg(Arg::Q))
                                | (ExprKind::Arg(Arg::Q), ExprKind::Arg(Arg::Kv))
                        ) => {}
                    ExprKind::Arg(Arg::Q | Arg::Kv | Arg::S) => *ok = false,
                    _ => e.for_each_child(&mut |c| walk(c, ok)),
                }
            }
            let mut ok = true;
            walk(e, &mut ok);
            ok
        };
        let mut sites = self
            .learnable_sites
            .iter()
            .filter(|l| !l.in_sink)
            .peekable();
        sites.peek().is_some()
            && sites.all(|l| by_difference(&l.index.body) && by_difference(&l.grad.body))
    }

    /// Loop iterations one evaluation of the tile classifier may run on a
    /// GPU target: each read of a tensor's summary loops over up to
    /// [`SUMMARY_MAX_BLOCKS`](crate::params::SUMMARY_MAX_BLOCKS) entries.
    pub fn classify_loop_iterations(&self) -> u64 {
        let mut n = 0;
        self.classify.body.walk(&mut |e| {
            if let ExprKind::ReadRange(r) = &e.kind
                && r.axis.is_some()
            {
                n += crate::params::SUMMARY_MAX_BLOCKS as u64;
            }
        });
        n
    }
}
