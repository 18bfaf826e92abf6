//! The spec AST: what `parse` makes of the attribute and the struct.
//!
//! Parsed from syn and not yet checked: names are unresolved and nothing is
//! typed. Every node keeps the [`Span`] of the tokens it came from, so the
//! checker's errors point at the offending token.

use proc_macro2::Span;

/// A whole variant declaration: the struct and its `#[attention(...)]` arguments.
#[derive(Clone, Debug)]
pub struct Spec {
    /// The struct's name.
    pub name: syn::Ident,
    /// The struct's fields: the variant's parameters and captured tensors,
    /// in declaration order.
    pub params: Vec<Param>,
    /// The struct's type parameter, the runtime its tensors live on
    /// (`struct V<R: Runtime>`); `None` without tensor fields.
    pub runtime: Option<syn::Ident>,
    /// `score = |s, b, h, q, kv| ...`, if given.
    pub score: Option<Closure>,
    /// `score_grad = |s, b, h, q, kv| ...`, if given: `d score / d s`
    /// in place of the derived one.
    pub score_grad: Option<Closure>,
    /// `mask = |b, h, q, kv| ...`, if given.
    pub mask: Option<Closure>,
    /// `sink = |b, h, q| ...`, if given.
    pub sink: Option<Closure>,
    /// `dropout = p`, if given: an expression of the variant's scalar
    /// fields (a zero-argument closure), with the span of its key.
    pub dropout: Option<(Closure, Span)>,
    /// `normalize = softmax | sigmoid`, if given, with the span of its key.
    pub normalize: Option<(crate::ir::Normalize, Span)>,
    /// `tile(q = .., kv = ..)`, if given.
    pub tile: Option<TileOverride>,
    /// `tests = [...]`: instances to generate tests for, as Rust expressions.
    pub tests: Vec<syn::Expr>,
    /// `crate = "path"`: the runtime crate's path in the caller's crate
    /// (`::boostr_runtime` without it).
    pub krate: Option<syn::Path>,
}

/// One field of the struct.
#[derive(Clone, Debug)]
pub struct Param {
    /// Field name.
    pub name: syn::Ident,
    /// Field type, as written.
    pub ty: syn::Type,
    /// `#[tensor(elem, [dims])]`: the field is a captured tensor.
    pub tensor: Option<TensorAttr>,
}

/// `#[tensor(i32, [B, Sk])]` on a `Tensor<R>` field: its element type and
/// declared shape.
#[derive(Clone, Debug)]
pub struct TensorAttr {
    /// The element type, if it is one the language reads.
    pub elem: Option<Scalar>,
    /// What the caller passes (`bool`, `i64`: converted to `elem`).
    pub given: crate::ir::Given,
    /// The element type's token, for errors.
    pub elem_span: Span,
    /// The declared dimensions, outermost first.
    pub dims: Vec<crate::ir::DimDecl>,
    /// The attribute's span.
    pub span: Span,
}

/// `tile(q = .., kv = ..)`: per-variant overrides of the targets' tile sizes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TileOverride {
    /// Query rows per tile.
    pub q: Option<u32>,
    /// Keys per tile.
    pub kv: Option<u32>,
}

/// A closure: its argument names (`None` for `_`) and its body.
#[derive(Clone, Debug)]
pub struct Closure {
    /// Argument names in order; `None` for a `_` pattern.
    pub args: Vec<Option<syn::Ident>>,
    /// The span of the whole closure.
    pub span: Span,
    /// The body.
    pub body: Expr,
}

/// An expression of the variant language.
#[derive(Clone, Debug)]
pub struct Expr {
    /// What it is.
    pub kind: ExprKind,
    /// Where it came from.
    pub span: Span,
}

/// The expression forms of the variant language.
#[derive(Clone, Debug)]
pub enum ExprKind {
    /// An integer literal, with its suffix if any (`3`, `3i32`, `3u32`).
    Int(u64, Option<Scalar>),
    /// A float literal (`2.0`, `1e-3`, `2f32`).
    Float(f64),
    /// `true` / `false`.
    Bool(bool),
    /// A name: a closure argument or a `let` binding.
    Name(syn::Ident),
    /// `self.field`.
    Field(syn::Ident),
    /// `base[index]`.
    Index(Box<Expr>, Box<Expr>),
    /// `-x`, `!x`.
    Unary(UnaryOp, Box<Expr>),
    /// `a op b`.
    Binary(BinaryOp, Box<Expr>, Box<Expr>),
    /// `f(args)` for one of the language's functions.
    Call(syn::Ident, Vec<Expr>),
    /// `x as ty`.
    Cast(Box<Expr>, Scalar),
    /// `if c { a } else { b }` (an `else` is required: every expression has a value).
    If(Box<Expr>, Box<Expr>, Box<Expr>),
    /// `{ let x = ..; ...; tail }`.
    Block(Vec<Let>, Box<Expr>),
}

/// `let name = value;` (an optional type annotation is checked against the value).
#[derive(Clone, Debug)]
pub struct Let {
    /// The bound name.
    pub name: syn::Ident,
    /// The annotated type, if any, with its span.
    pub ty: Option<(Scalar, Span)>,
    /// The value.
    pub value: Expr,
}

pub use crate::ir::Ty as Scalar;

pub use crate::ir::{BinOp as BinaryOp, UnOp as UnaryOp};
