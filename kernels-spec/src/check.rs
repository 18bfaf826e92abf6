//! Stage 2, check: the spec [AST](crate::ast) → typed [IR](crate::ir).
//!
//! Resolves names (closure arguments, `let` bindings, `self.field`), types
//! every expression with Rust's rules (no implicit conversions; unsuffixed
//! literals take the type their context expects) and records every error at
//! its token with the rule it breaks. The result is IR that the analyses and
//! emitters may trust.

use crate::ast::{self, ExprKind as A};
use crate::diag::Diagnostics;
use crate::ir::{
    Arg, BinOp, Builtin, Const, Domain, Expr, ExprKind, Function, IndexCheck, Local, Normalize,
    ParamDecl, Read, TensorDecl, Ty, UnOp,
};
use crate::params::{Field, ParamLayout};
use crate::parse::scalar_of;
use proc_macro2::Span;
use quote::ToTokens;

/// The checked functions of a spec, before analysis.
#[derive(Clone, Debug)]
pub struct Checked {
    /// Scalar parameters in field order.
    pub params: Vec<ParamDecl>,
    /// Captured tensors in field order.
    pub tensors: Vec<TensorDecl>,
    /// Where both travel in the kernels' parameter block.
    pub layout: ParamLayout,
    /// The score function, if declared.
    pub score: Option<Function>,
    /// `d score / d s`, if declared (else derived from `score`).
    pub score_grad: Option<Function>,
    /// The mask function, if declared.
    pub mask: Option<Function>,
    /// The sink function, if declared.
    pub sink: Option<Function>,
    /// The dropout probability, a function of no arguments, if declared.
    pub dropout: Option<Function>,
    /// The normalisation.
    pub normalize: Normalize,
}

/// Check a parsed spec. Errors go to `diags`; the result is only meaningful
/// when none were recorded.
pub fn check(spec: &ast::Spec, diags: &mut Diagnostics) -> Checked {
    let mut fields = Fields::default();
    for p in &spec.params {
        if let Some(t) = &p.tensor {
            if t.elem.is_none() {
                // Reported at the attribute; reads of it fail silently.
                fields.names.push((p.name.clone(), FieldRef::Broken));
                continue;
            }
            fields
                .names
                .push((p.name.clone(), FieldRef::Tensor(fields.tensors.len())));
            let elem = t.elem.expect("checked above");
            let learnable = crate::parse::is_var(&p.ty);
            if learnable && (elem != Ty::F32 || t.given != crate::ir::Given::Elem) {
                let declared = match t.given {
                    crate::ir::Given::Bool => "bool".to_string(),
                    crate::ir::Given::I64 => "i64".to_string(),
                    crate::ir::Given::Elem => elem.to_string(),
                };
                diags.error(
                    t.elem_span,
                    format!(
                        "learnable tensor `{}` (a `Var`) must hold f32 to have a gradient, \
                         declared {declared}; pass a `Tensor` to read it without one",
                        p.name
                    ),
                );
            }
            fields.tensors.push(TensorDecl {
                name: p.name.to_string(),
                elem,
                given: t.given,
                dims: t.dims.clone(),
                learnable,
            });
            continue;
        }
        let ty = scalar_of(&p.ty);
        // A `Tensor<R>` without `#[tensor]` is reported where it is parsed.
        if ty.is_none() && crate::parse::tensor_runtime(&p.ty).is_none() {
            diags.error_spanned(
                &p.ty,
                format!(
                    "field `{}` has unsupported type `{}`; variant parameters are f32, i32, u32 \
                     or bool, or tensors declared `#[tensor(elem, [dims])] {}: Tensor<R>`",
                    p.name,
                    p.ty.to_token_stream(),
                    p.name
                ),
            );
        }
        let index = fields.params.len();
        fields.names.push((
            p.name.clone(),
            if ty.is_some() {
                FieldRef::Scalar(index)
            } else {
                FieldRef::Broken
            },
        ));
        fields.params.push(ParamDecl {
            name: p.name.to_string(),
            ty: ty.unwrap_or(Ty::F32),
        });
    }
    // The fixed-size block every GPU kernel takes: the first field that
    // does not fit is the error.
    let placed: Vec<(usize, Field<'_>)> = fields
        .names
        .iter()
        .enumerate()
        .filter_map(|(i, (_, r))| match *r {
            FieldRef::Scalar(p) => Some((i, Field::Scalar(&fields.params[p]))),
            FieldRef::Tensor(t) => Some((i, Field::Tensor(t, &fields.tensors[t]))),
            FieldRef::Broken => None,
        })
        .collect();
    let order: Vec<Field<'_>> = placed.iter().map(|(_, f)| *f).collect();
    let layout =
        ParamLayout::with_dropout(&order, spec.dropout.is_some()).unwrap_or_else(|overflow| {
            let field = &fields.names[placed[overflow.field].0].0;
            diags.error_spanned(
                field,
                format!("parameter `{field}` does not fit: {overflow}"),
            );
            ParamLayout::default()
        });
    let mut sites = 0;
    let score = spec.score.as_ref().and_then(|c| {
        let args = [Arg::S, Arg::B, Arg::H, Arg::Q, Arg::Kv];
        Checker::new(&fields, c, &args, &mut sites, diags).function("score", Ty::F32)
    });
    let score_grad = spec.score_grad.as_ref().and_then(|c| {
        if spec.score.is_none() {
            diags.error(
                c.span,
                "`score_grad` overrides the derivative of `score`, and no `score` is declared \
                 (the identity's derivative is 1)",
            );
            return None;
        }
        let args = [Arg::S, Arg::B, Arg::H, Arg::Q, Arg::Kv];
        Checker::new(&fields, c, &args, &mut sites, diags).function("score_grad", Ty::F32)
    });
    let mask = spec.mask.as_ref().and_then(|c| {
        Checker::new(&fields, c, &MASK_ARGS, &mut sites, diags).function("mask", Ty::Bool)
    });
    let sink = spec.sink.as_ref().and_then(|c| {
        let args = [Arg::B, Arg::H, Arg::Q];
        Checker::new(&fields, c, &args, &mut sites, diags).function("sink", Ty::F32)
    });
    let dropout = spec
        .dropout
        .as_ref()
        .and_then(|(c, _)| check_dropout(&fields, c, &mut sites, diags));
    let normalize = spec.normalize.map_or(Normalize::Softmax, |(n, _)| n);
    if let (Some((Normalize::Sigmoid, at)), Some(sink)) = (spec.normalize, &spec.sink) {
        diags.error(
            sink.span,
            "a sink is one more logit in the softmax's denominator, and `normalize = sigmoid` \
             has no denominator: drop the sink, or normalise with softmax",
        );
        diags.error(
            at,
            "`normalize = sigmoid` here cannot take the `sink` declared with it",
        );
    }
    Checked {
        params: fields.params,
        tensors: fields.tensors,
        layout,
        score,
        score_grad,
        mask,
        sink,
        dropout,
        normalize,
    }
}

/// `dropout = p`: an `f32` expression of the scalar fields (no tensor
/// reads: the runtimes evaluate it on the host, once per call), and a
/// literal `p` must lie in `[0, 1)`.
fn check_dropout(
    fields: &Fields,
    closure: &ast::Closure,
    sites: &mut u32,
    diags: &mut Diagnostics,
) -> Option<Function> {
    let f = Checker::new(fields, closure, &[], sites, diags).function("dropout", Ty::F32)?;
    let mut reads = false;
    f.body
        .walk(&mut |e| reads |= matches!(e.kind, ExprKind::Read(_) | ExprKind::Dim(..)));
    if reads {
        diags.error(
            closure.span,
            "`dropout` is a probability of the scalar fields (a literal, or `self.p`); \
             it cannot read a tensor",
        );
        return None;
    }
    let literal = match &closure.body.kind {
        A::Float(x) => Some(*x),
        A::Int(x, _) => Some(*x as f64),
        _ => None,
    };
    if let Some(p) = literal
        && !(0.0..1.0).contains(&p)
    {
        diags.error(
            closure.span,
            format!(
                "dropout probability {p} is outside [0, 1): a pair is dropped with probability p"
            ),
        );
        return None;
    }
    Some(f)
}

/// The mask's arguments: a function with these reads no learnable tensor.
const MASK_ARGS: [Arg; 4] = [Arg::B, Arg::H, Arg::Q, Arg::Kv];

/// What a field name refers to.
#[derive(Clone, Copy, Debug)]
enum FieldRef {
    /// Scalar parameter number `.0`.
    Scalar(usize),
    /// Captured tensor number `.0`.
    Tensor(usize),
    /// A field whose declaration was already reported.
    Broken,
}

/// The struct's fields, resolved.
#[derive(Default)]
struct Fields {
    names: Vec<(syn::Ident, FieldRef)>,
    params: Vec<ParamDecl>,
    tensors: Vec<TensorDecl>,
}

impl Fields {
    fn lookup(&self, name: &syn::Ident) -> Option<FieldRef> {
        self.names.iter().find(|(n, _)| n == name).map(|(_, r)| *r)
    }

    /// "the parameters are `a`, `b`" or "the struct has no fields".
    fn known(&self) -> String {
        let names: Vec<String> = self.names.iter().map(|(n, _)| format!("`{n}`")).collect();
        if names.is_empty() {
            "the struct has no fields".to_string()
        } else {
            format!("the fields are {}", names.join(", "))
        }
    }
}

struct Checker<'a> {
    /// The function's arguments, by role, in order.
    roles: Vec<Arg>,
    fields: &'a Fields,
    closure: &'a ast::Closure,
    args: Vec<(syn::Ident, Arg)>,
    /// `let` bindings in scope; the type is `None` when the value failed to
    /// check (already reported), so uses of the name fail silently.
    scopes: Vec<(syn::Ident, Local, Option<Ty>)>,
    next_local: u32,
    /// Read sites numbered so far in the program.
    sites: &'a mut u32,
    diags: &'a mut Diagnostics,
}

impl<'a> Checker<'a> {
    fn new(
        fields: &'a Fields,
        closure: &'a ast::Closure,
        roles: &[Arg],
        sites: &'a mut u32,
        diags: &'a mut Diagnostics,
    ) -> Self {
        let mut args: Vec<(syn::Ident, Arg)> = Vec::new();
        for (name, &role) in closure.args.iter().zip(roles) {
            let Some(name) = name else { continue };
            if args.iter().any(|(n, _)| n == name) {
                diags.error_spanned(name, format!("closure argument `{name}` is bound twice"));
            }
            args.push((name.clone(), role));
        }
        Checker {
            fields,
            closure,
            roles: roles.to_vec(),
            args,
            scopes: Vec::new(),
            next_local: 0,
            sites,
            diags,
        }
    }

    fn function(mut self, name: &'static str, ret: Ty) -> Option<Function> {
        // `infer`, not `expr`: a body of the wrong type is reported here, by role.
        let body = self.infer(&self.closure.body, Some(ret))?;
        if body.ty != ret {
            let hint = if ret.is_numeric() && body.ty.is_numeric() {
                format!("; convert with `as {ret}`")
            } else {
                String::new()
            };
            self.diags.error(
                self.closure.body.span,
                format!("{name} must return {ret}, found {}{hint}", body.ty),
            );
            return None;
        }
        Some(Function {
            name,
            args: self.roles.clone(),
            ret,
            body,
        })
    }

    fn mismatch(&mut self, span: Span, expected: Ty, found: Ty, hint: &str) {
        self.diags.error(
            span,
            format!("type mismatch: expected {expected}, found {found}{hint}"),
        );
    }

    /// Check `e`, which must have type `expected` when given.
    fn expr(&mut self, e: &ast::Expr, expected: Option<Ty>) -> Option<Expr> {
        let out = self.infer(e, expected)?;
        if let Some(want) = expected
            && out.ty != want
        {
            let hint = if want.is_numeric() && out.ty.is_numeric() {
                format!("; convert with `as {want}`")
            } else {
                String::new()
            };
            self.mismatch(e.span, want, out.ty, &hint);
            return None;
        }
        Some(out)
    }

    fn is_untyped_literal(e: &ast::Expr) -> bool {
        match &e.kind {
            A::Int(_, None) | A::Float(_) => true,
            A::Unary(ast::UnaryOp::Neg, inner) => Self::is_untyped_literal(inner),
            _ => false,
        }
    }

    fn infer(&mut self, e: &ast::Expr, expected: Option<Ty>) -> Option<Expr> {
        let span = e.span;
        match &e.kind {
            A::Int(v, suffix) => self.int_literal(*v, false, *suffix, expected, span),
            A::Float(v) => {
                if let Some(t) = expected.filter(|t| *t != Ty::F32) {
                    self.mismatch(span, t, Ty::F32, "");
                    return None;
                }
                Some(Expr::float(*v))
            }
            A::Bool(b) => Some(Expr::bool(*b)),
            A::Name(name) => self.name(name),
            A::Field(name) => self.field(name),
            A::Index(..) => self.index(e),
            A::Unary(op, inner) => self.unary(*op, inner, expected, span),
            A::Binary(op, lhs, rhs) => self.binary(*op, lhs, rhs, expected, span),
            A::Call(name, args) => self.call(name, args, expected, span),
            A::Cast(inner, to) => {
                let value = self.expr(inner, None)?;
                let ok = value.ty == *to
                    || (value.ty.is_numeric() && to.is_numeric())
                    || (value.ty == Ty::Bool && to.is_int());
                if !ok {
                    self.diags
                        .error(span, format!("unsupported cast from {} to {to}", value.ty));
                    return None;
                }
                if value.ty == *to {
                    return Some(value);
                }
                Some(Expr {
                    kind: ExprKind::Cast(Box::new(value)),
                    ty: *to,
                })
            }
            A::If(cond, then, els) => {
                let cond = self.expr(cond, Some(Ty::Bool));
                let (then, els) = if expected.is_none() && Self::is_untyped_literal(then) {
                    let els = self.expr(els, None);
                    let then = self.expr(then, els.as_ref().map(|x| x.ty));
                    (then, els)
                } else {
                    let then = self.expr(then, expected);
                    let els = self.expr(els, then.as_ref().map(|x| x.ty).or(expected));
                    (then, els)
                };
                let (cond, then, els) = (cond?, then?, els?);
                let ty = then.ty;
                Some(Expr {
                    kind: ExprKind::Select(Box::new(cond), Box::new(then), Box::new(els)),
                    ty,
                })
            }
            A::Block(lets, tail) => {
                let depth = self.scopes.len();
                let mut bound = Vec::new();
                let mut ok = true;
                for l in lets {
                    let annotated = l.ty.map(|(t, _)| t);
                    let value = self.expr(&l.value, annotated);
                    let local = Local(self.next_local);
                    self.next_local += 1;
                    // A binding whose value failed still binds its name (with
                    // its annotated type, if any): its uses must not cascade
                    // into "unknown name" errors.
                    let ty = value.as_ref().map(|v| v.ty).or(annotated);
                    self.scopes.push((l.name.clone(), local, ty));
                    match value {
                        Some(value) => bound.push((local, value)),
                        None => ok = false,
                    }
                }
                let body = self.expr(tail, expected);
                self.scopes.truncate(depth);
                let mut body = body?;
                if !ok {
                    return None;
                }
                for (local, value) in bound.into_iter().rev() {
                    let ty = body.ty;
                    body = Expr {
                        kind: ExprKind::Let(local, Box::new(value), Box::new(body)),
                        ty,
                    };
                }
                Some(body)
            }
        }
    }

    fn int_literal(
        &mut self,
        v: u64,
        negative: bool,
        suffix: Option<Ty>,
        expected: Option<Ty>,
        span: Span,
    ) -> Option<Expr> {
        let ty = match (suffix, expected) {
            (Some(t), _) => t,
            (None, Some(t)) if t.is_int() => t,
            (None, Some(Ty::F32)) => {
                self.diags.error(
                    span,
                    "type mismatch: expected f32, found an integer literal; write it with a decimal point, e.g. `2.0`",
                );
                return None;
            }
            (None, Some(t)) => {
                self.mismatch(span, t, Ty::I32, "");
                return None;
            }
            (None, None) => Ty::I32,
        };
        let value = if negative { -(v as i128) } else { v as i128 };
        let (lo, hi) = match ty {
            Ty::I32 => (i32::MIN as i128, i32::MAX as i128),
            _ => (0, u32::MAX as i128),
        };
        if value < lo || value > hi {
            self.diags
                .error(span, format!("literal {value} does not fit in {ty}"));
            return None;
        }
        Some(Expr {
            kind: ExprKind::Const(Const::Int(value as i64)),
            ty,
        })
    }

    fn name(&mut self, name: &syn::Ident) -> Option<Expr> {
        if let Some((_, local, ty)) = self.scopes.iter().rev().find(|(n, _, _)| n == name) {
            return ty.map(|ty| Expr::local(*local, ty));
        }
        if let Some((_, arg)) = self.args.iter().find(|(n, _)| n == name) {
            return Some(Expr::arg(*arg));
        }
        let hint = if self.fields.lookup(name).is_some() {
            format!("; fields are read as `self.{name}`")
        } else {
            let names: Vec<String> = self.args.iter().map(|(n, _)| format!("`{n}`")).collect();
            format!("; the closure's arguments are {}", names.join(", "))
        };
        self.diags
            .error_spanned(name, format!("unknown name `{name}`{hint}"));
        None
    }

    fn field(&mut self, name: &syn::Ident) -> Option<Expr> {
        match self.fields.lookup(name) {
            None => {
                let known = self.fields.known();
                self.diags
                    .error_spanned(name, format!("no field `{name}`; {known}"));
                None
            }
            // Reported at its declaration.
            Some(FieldRef::Broken) => None,
            Some(FieldRef::Scalar(index)) => Some(Expr {
                kind: ExprKind::Param(index),
                ty: self.fields.params[index].ty,
            }),
            // A tensor of no dimensions is one value.
            Some(FieldRef::Tensor(t)) if self.fields.tensors[t].dims.is_empty() => {
                self.read(name, t, Vec::new())
            }
            Some(FieldRef::Tensor(t)) => {
                let decl = &self.fields.tensors[t];
                self.diags.error_spanned(
                    name,
                    format!(
                        "tensor `{name}` is read by indexing, one index per dimension: \
                         `self.{name}{}` ({})",
                        "[..]".repeat(decl.dims.len()),
                        shape(decl)
                    ),
                );
                None
            }
        }
    }

    /// `base[i]..[j]`: a read of a captured tensor, one index per dimension.
    fn index(&mut self, e: &ast::Expr) -> Option<Expr> {
        // Unwind `((self.t[i])[j])[k]` into the root and its indices.
        let mut indices = Vec::new();
        let mut root = e;
        while let A::Index(base, index) = &root.kind {
            indices.push(&**index);
            root = base;
        }
        indices.reverse();
        let A::Field(name) = &root.kind else {
            self.diags.error(
                root.span,
                "only captured tensors (`self.field`, declared `#[tensor(..)]`) can be indexed",
            );
            return None;
        };
        let tensor = match self.fields.lookup(name) {
            Some(FieldRef::Tensor(t)) => t,
            Some(FieldRef::Scalar(_)) => {
                self.diags.error_spanned(
                    name,
                    format!(
                        "`{name}` is a scalar parameter; only tensor fields, declared \
                         `#[tensor(elem, [dims])]`, can be indexed"
                    ),
                );
                return None;
            }
            Some(FieldRef::Broken) => return None,
            None => return self.field(name),
        };
        let decl = &self.fields.tensors[tensor];
        if decl.learnable && self.roles == MASK_ARGS {
            // Reported by `read`, before the indices.
            return self.read(name, tensor, Vec::new());
        }
        let mut checked = Vec::with_capacity(indices.len());
        let mut ok = true;
        for index in &indices {
            match self.expr(index, None) {
                Some(i) if i.ty.is_int() => checked.push(i),
                Some(i) => {
                    self.diags.error(
                        index.span,
                        format!("a tensor index is an i32 or u32, found {}", i.ty),
                    );
                    ok = false;
                }
                None => ok = false,
            }
        }
        if indices.len() != decl.dims.len() {
            self.diags.error(
                e.span,
                format!(
                    "`{name}` has {} dimension{} ({}) but is read with {} ind{}",
                    decl.dims.len(),
                    if decl.dims.len() == 1 { "" } else { "s" },
                    shape(decl),
                    indices.len(),
                    if indices.len() == 1 { "ex" } else { "ices" }
                ),
            );
            return None;
        }
        if !ok {
            return None;
        }
        self.read(name, tensor, checked)
    }

    /// A read of captured tensor `tensor` at `indices` (one per dimension,
    /// checked), numbered; a `bool` tensor's (held as i32, which the tile
    /// classifier bounds) is `!= 0`.
    fn read(&mut self, name: &syn::Ident, tensor: usize, indices: Vec<Expr>) -> Option<Expr> {
        let decl = &self.fields.tensors[tensor];
        if decl.learnable && self.roles == MASK_ARGS {
            // `mask(b, h, q, kv)`: boolean, so no gradient reaches its reads.
            self.diags.error_spanned(
                name,
                format!(
                    "learnable tensor `{name}` (a `Var`) is read in `mask`, which is boolean and \
                     carries no gradient; read it in `score` or `sink`, or capture a read-only \
                     `Tensor` for the mask"
                ),
            );
            return None;
        }
        let site = *self.sites;
        *self.sites += 1;
        let read = Expr {
            ty: decl.elem,
            kind: ExprKind::Read(Read {
                tensor,
                checks: vec![IndexCheck::BOTH; indices.len()],
                indices,
                site,
            }),
        };
        if decl.given != crate::ir::Given::Bool {
            return Some(read);
        }
        let zero = Expr {
            ty: Ty::I32,
            kind: ExprKind::Const(crate::ir::Const::Int(0)),
        };
        Some(Expr {
            ty: Ty::Bool,
            kind: ExprKind::Binary(BinOp::Ne, Box::new(read), Box::new(zero)),
        })
    }

    fn unary(
        &mut self,
        op: UnOp,
        inner: &ast::Expr,
        expected: Option<Ty>,
        span: Span,
    ) -> Option<Expr> {
        match op {
            UnOp::Not => {
                let v = self.expr(inner, Some(Ty::Bool))?;
                Some(Expr {
                    kind: ExprKind::Unary(UnOp::Not, Box::new(v)),
                    ty: Ty::Bool,
                })
            }
            UnOp::Neg => {
                if let A::Int(v, suffix) = inner.kind {
                    return self.int_literal(v, true, suffix, expected, span);
                }
                let v = self.expr(inner, expected)?;
                if !matches!(v.ty, Ty::F32 | Ty::I32) {
                    self.diags.error(
                        span,
                        format!(
                            "cannot negate a value of type {}; negation is defined on f32 and i32",
                            v.ty
                        ),
                    );
                    return None;
                }
                if let ExprKind::Const(Const::Float(x)) = v.kind {
                    return Some(Expr::float(-x));
                }
                let ty = v.ty;
                Some(Expr {
                    kind: ExprKind::Unary(UnOp::Neg, Box::new(v)),
                    ty,
                })
            }
        }
    }

    /// Check two operands that must share a type; an untyped literal side
    /// takes the other side's type.
    fn operands(
        &mut self,
        lhs: &ast::Expr,
        rhs: &ast::Expr,
        expected: Option<Ty>,
    ) -> Option<(Expr, Expr)> {
        if Self::is_untyped_literal(lhs) && !Self::is_untyped_literal(rhs) {
            let r = self.expr(rhs, expected)?;
            let l = self.expr(lhs, Some(r.ty))?;
            Some((l, r))
        } else {
            let l = self.expr(lhs, expected)?;
            let r = self.operand_like(rhs, &l)?;
            Some((l, r))
        }
    }

    fn operand_like(&mut self, rhs: &ast::Expr, lhs: &Expr) -> Option<Expr> {
        let r = self.infer(rhs, Some(lhs.ty).filter(|_| Self::is_untyped_literal(rhs)))?;
        if r.ty != lhs.ty {
            self.diags.error(
                rhs.span,
                format!(
                    "type mismatch: the operands are {} and {}; convert one side with `as`",
                    lhs.ty, r.ty
                ),
            );
            return None;
        }
        Some(r)
    }

    fn binary(
        &mut self,
        op: BinOp,
        lhs: &ast::Expr,
        rhs: &ast::Expr,
        expected: Option<Ty>,
        span: Span,
    ) -> Option<Expr> {
        if op.is_logical() {
            let l = self.expr(lhs, Some(Ty::Bool));
            let r = self.expr(rhs, Some(Ty::Bool));
            return Some(Expr {
                kind: ExprKind::Binary(op, Box::new(l?), Box::new(r?)),
                ty: Ty::Bool,
            });
        }
        if op.is_comparison() {
            let (l, r) = self.operands(lhs, rhs, None)?;
            if l.ty == Ty::Bool && !matches!(op, BinOp::Eq | BinOp::Ne) {
                self.diags
                    .error(span, format!("`{}` is not defined on bool", op.symbol()));
                return None;
            }
            return Some(Expr {
                kind: ExprKind::Binary(op, Box::new(l), Box::new(r)),
                ty: Ty::Bool,
            });
        }
        let numeric_expected = expected.filter(|t| t.is_numeric());
        let (l, r) = self.operands(lhs, rhs, numeric_expected)?;
        if !l.ty.is_numeric() {
            self.diags
                .error(span, format!("`{}` is not defined on bool", op.symbol()));
            return None;
        }
        let ty = l.ty;
        Some(Expr {
            kind: ExprKind::Binary(op, Box::new(l), Box::new(r)),
            ty,
        })
    }

    fn call(
        &mut self,
        name: &syn::Ident,
        args: &[ast::Expr],
        expected: Option<Ty>,
        span: Span,
    ) -> Option<Expr> {
        if let Some(floor) = Floored::from_name(&name.to_string()) {
            return self.floored(floor, args, expected, span);
        }
        let Some(f) = Builtin::from_name(&name.to_string()) else {
            let known: Vec<&str> = Builtin::USER
                .iter()
                .map(|b| b.name())
                .chain(Floored::ALL.iter().map(|f| f.name()))
                .collect();
            self.diags.error_spanned(
                name,
                format!(
                    "unknown function `{name}`; the variant language has {}",
                    known.join(" ")
                ),
            );
            return None;
        };
        if args.len() != f.arity() {
            self.diags.error(
                span,
                format!(
                    "`{}` takes {} argument{}, found {}",
                    f.name(),
                    f.arity(),
                    if f.arity() == 1 { "" } else { "s" },
                    args.len()
                ),
            );
            return None;
        }
        let checked: Option<Vec<Expr>> = match f.domain() {
            Domain::Float => args.iter().map(|a| self.expr(a, Some(Ty::F32))).collect(),
            Domain::I32 => args.iter().map(|a| self.expr(a, Some(Ty::I32))).collect(),
            Domain::Numeric => {
                // The first argument that is not an untyped literal fixes the type.
                let lead = args
                    .iter()
                    .position(|a| !Self::is_untyped_literal(a))
                    .unwrap_or(0);
                let first = self.expr(&args[lead], expected.filter(|t| t.is_numeric()))?;
                if !first.ty.is_numeric() {
                    self.diags.error(
                        args[lead].span,
                        format!("`{}` takes numbers, found {}", f.name(), first.ty),
                    );
                    return None;
                }
                let ty = first.ty;
                let mut out = Vec::with_capacity(args.len());
                for (i, a) in args.iter().enumerate() {
                    if i == lead {
                        out.push(first.clone());
                    } else {
                        out.push(self.expr(a, Some(ty))?);
                    }
                }
                Some(out)
            }
        };
        let checked = checked?;
        let ty = checked[0].ty;
        Some(Expr {
            kind: ExprKind::Call(f, checked),
            ty,
        })
    }
}

/// The floored division and remainder of Python's `//` and `%`
/// (`div_floor(a, b)`, `rem_floor(a, b)`): the quotient rounded toward
/// −∞, and the remainder with the divisor's sign. Written in the IR's own
/// operations (no backend has more to do), each operand evaluated once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Floored {
    Div,
    Rem,
}

impl Floored {
    const ALL: [Floored; 2] = [Floored::Div, Floored::Rem];

    fn name(self) -> &'static str {
        match self {
            Floored::Div => "div_floor",
            Floored::Rem => "rem_floor",
        }
    }

    fn from_name(name: &str) -> Option<Floored> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }
}

impl Checker<'_> {
    /// `div_floor(a, b)` or `rem_floor(a, b)` of two numbers of one type.
    /// i32: the truncated quotient less one where the remainder is non-zero
    /// and its sign differs from the divisor's (the remainder plus the
    /// divisor); by zero, 0 as `/` and `%`. u32: `/` and `%`. f32:
    /// `floor(a / b)` and `a − b · floor(a / b)`.
    fn floored(
        &mut self,
        op: Floored,
        args: &[ast::Expr],
        expected: Option<Ty>,
        span: Span,
    ) -> Option<Expr> {
        use crate::analysis::build::{and, binary, call, let_, lt, mul, ne, select, sub};
        if args.len() != 2 {
            self.diags.error(
                span,
                format!("`{}` takes 2 arguments, found {}", op.name(), args.len()),
            );
            return None;
        }
        let (a, b) = self.operands(&args[0], &args[1], expected.filter(|t| t.is_numeric()))?;
        if !a.ty.is_numeric() {
            self.diags.error(
                args[0].span,
                format!("`{}` takes numbers, found {}", op.name(), a.ty),
            );
            return None;
        }
        let ty = a.ty;
        let mut fresh = || {
            let local = Local(self.next_local);
            self.next_local += 1;
            local
        };
        let (la, lb) = (fresh(), fresh());
        let (x, y) = (Expr::local(la, ty), Expr::local(lb, ty));
        let int = |v: i64, ty: Ty| Expr {
            kind: ExprKind::Const(Const::Int(v)),
            ty,
        };
        let zero = |ty| int(0, ty);
        let body = match (ty, op) {
            (Ty::F32, Floored::Div) => call(Builtin::Floor, vec![binary(BinOp::Div, x, y)]),
            (Ty::F32, Floored::Rem) => {
                let q = call(
                    Builtin::Floor,
                    vec![binary(BinOp::Div, x.clone(), y.clone())],
                );
                sub(x, mul(y, q))
            }
            (Ty::U32, Floored::Div) => binary(BinOp::Div, x, y),
            (Ty::U32, Floored::Rem) => binary(BinOp::Rem, x, y),
            (_, op) => {
                let (lq, lr) = (fresh(), fresh());
                let (q, r) = (Expr::local(lq, ty), Expr::local(lr, ty));
                // Truncation went the wrong way when the remainder is
                // non-zero and its sign is not the divisor's.
                let off = and(
                    ne(r.clone(), zero(ty)),
                    ne(lt(r.clone(), zero(ty)), lt(y.clone(), zero(ty))),
                );
                let body = match op {
                    Floored::Div => select(off, sub(q.clone(), int(1, ty)), q),
                    Floored::Rem => select(off, binary(BinOp::Add, r.clone(), y.clone()), r),
                };
                let body = let_(lr, binary(BinOp::Rem, x.clone(), y.clone()), body);
                let_(lq, binary(BinOp::Div, x, y), body)
            }
        };
        Some(let_(la, a, let_(lb, b, body)))
    }
}

/// `[B, Sk] i32`, as declared.
fn shape(t: &TensorDecl) -> String {
    let dims: Vec<String> = t.dims.iter().map(|d| d.to_string()).collect();
    format!("`[{}]` of {}", dims.join(", "), t.elem)
}
