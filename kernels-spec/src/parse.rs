//! Stage 1, parse: syn's view of the attribute and the struct → the spec
//! [AST](crate::ast). Only syntax is checked here; names and types are the
//! checker's. Unsupported syntax is reported at its token, and parsing goes on
//! so that one run reports every error.

use crate::ast::{
    BinaryOp, Closure, Expr, ExprKind, Let, Param, Scalar, Spec, TensorAttr, TileOverride, UnaryOp,
};
use crate::diag::Diagnostics;
use crate::ir::{DimDecl, Size};
use crate::symbol::{self, Symbol};
use proc_macro2::{Span, TokenStream};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Meta, Token};

/// Parse `#[attention(<attr>)]` applied to `item` into a [`Spec`].
///
/// Returns the spec even when errors were recorded, with the erroneous parts
/// left out, so later stages can still report their own errors.
pub fn parse_spec(attr: TokenStream, item: &syn::ItemStruct, diags: &mut Diagnostics) -> Spec {
    let mut spec = Spec {
        name: item.ident.clone(),
        params: Vec::new(),
        runtime: None,
        score: None,
        mask: None,
        sink: None,
        score_grad: None,
        dropout: None,
        normalize: None,
        tile: None,
        tests: Vec::new(),
        krate: None,
    };
    parse_fields(item, &mut spec, diags);
    let metas = match Punctuated::<Meta, Token![,]>::parse_terminated.parse2(attr) {
        Ok(metas) => metas,
        Err(e) => {
            diags.push(e);
            return spec;
        }
    };
    for meta in &metas {
        parse_meta(meta, &mut spec, diags);
    }
    spec
}

fn parse_fields(item: &syn::ItemStruct, spec: &mut Spec, diags: &mut Diagnostics) {
    match &item.fields {
        syn::Fields::Named(fields) => {
            for field in &fields.named {
                let Some(name) = field.ident.clone() else {
                    continue;
                };
                let mut tensor = None;
                for attr in field.attrs.iter().filter(|a| a.path() == symbol::TENSOR) {
                    if tensor.is_some() {
                        diags.error_spanned(attr, "duplicate `#[tensor]` attribute");
                        continue;
                    }
                    tensor = parse_tensor_attr(attr, diags);
                }
                spec.params.push(Param {
                    name,
                    ty: field.ty.clone(),
                    tensor,
                });
            }
        }
        syn::Fields::Unit => {}
        syn::Fields::Unnamed(fields) => diags.error_spanned(
            fields,
            "variant parameters must be named fields, read as `self.name` in the closures",
        ),
    }
    parse_runtime(item, spec, diags);
}

/// The struct's generics: none, or, with tensor fields, exactly the runtime
/// parameter the tensors live on.
fn parse_runtime(item: &syn::ItemStruct, spec: &mut Spec, diags: &mut Diagnostics) {
    let generics = &item.generics;
    // A `Tensor<R>` field without its attribute counts: the error is then
    // the missing attribute, not the generics.
    let has_tensors = spec
        .params
        .iter()
        .any(|p| p.tensor.is_some() || tensor_runtime(&p.ty).is_some());
    let type_params: Vec<&syn::TypeParam> = generics.type_params().collect();
    let only_one_type = type_params.len() == 1 && generics.params.len() == 1;
    if !has_tensors {
        if !generics.params.is_empty() {
            diags.error_spanned(
                generics,
                "an attention variant cannot be generic: kernels are specialised per variant \
                 (only a variant with tensor fields takes a runtime parameter, \
                 `struct Name<R: Runtime>`)",
            );
        }
        return;
    }
    if !only_one_type {
        let message = "a variant with tensor fields takes exactly one type parameter, the \
                       runtime its tensors live on: `struct Name<R: Runtime> { \
                       #[tensor(i32, [B, Sk])] field: Tensor<R> }`";
        if generics.params.is_empty() {
            diags.error_spanned(&item.ident, message);
        } else {
            diags.error_spanned(generics, message);
        }
        return;
    }
    let runtime = type_params[0].ident.clone();
    for p in &spec.params {
        let is_tensor_type = tensor_runtime(&p.ty).is_some();
        match (&p.tensor, tensor_runtime(&p.ty)) {
            (Some(_), Some(r)) if *r == runtime => {}
            (Some(_), _) => diags.error_spanned(
                &p.ty,
                format!(
                    "a `#[tensor(..)]` field is a `Tensor<{runtime}>` (or, learnable, a \
                     `Var<{runtime}>`), on the struct's runtime parameter `{runtime}`; found `{}`",
                    quote::ToTokens::to_token_stream(&p.ty)
                ),
            ),
            (None, _) if is_tensor_type => diags.error_spanned(
                &p.ty,
                format!(
                    "tensor field `{}` needs `#[tensor(elem, [dims])]`, e.g. \
                     `#[tensor(i32, [B, Sk])]`",
                    p.name
                ),
            ),
            (None, _) => {}
        }
    }
    spec.runtime = Some(runtime);
}

/// A test instance is a value of the variant, or a closure of one argument
/// that builds one from a case's test data; a variant with tensor fields
/// can only be built per case.
fn check_instance(instance: &syn::Expr, spec: &Spec, diags: &mut Diagnostics) {
    match instance {
        syn::Expr::Closure(c) if c.inputs.len() != 1 => diags.error_spanned(
            &c.inputs,
            format!(
                "a test instance closure takes one argument, the case's test data: \
                 `|data| {} {{ .. }}`",
                spec.name
            ),
        ),
        syn::Expr::Closure(_) => {}
        other if spec.runtime.is_some() => diags.error_spanned(
            other,
            format!(
                "a variant with tensor fields lists its test instances as closures that build \
                 them from each case's test data: `|data| {} {{ field: data.documents(), .. }}`",
                spec.name
            ),
        ),
        _ => {}
    }
}

/// `R` if `ty` is `Tensor<R>` or `Var<R>` (any path ending in `Tensor` or
/// `Var`).
pub(crate) fn tensor_runtime(ty: &syn::Type) -> Option<&syn::Ident> {
    let syn::Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    if last.ident != "Tensor" && last.ident != "Var" {
        return None;
    }
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.iter().collect::<Vec<_>>()[..] {
        [syn::GenericArgument::Type(syn::Type::Path(r))] => r.path.get_ident(),
        _ => None,
    }
}

/// Whether a tensor field's type is `Var<R>` (any path ending in `Var`):
/// a learnable tensor.
pub(crate) fn is_var(ty: &syn::Type) -> bool {
    matches!(ty, syn::Type::Path(p) if p.path.segments.last().is_some_and(|l| l.ident == "Var"))
}

/// `#[tensor(i32, [B, Sk])]`.
/// The field's `#[tensor(..)]`: always a tensor field, with no element
/// type when the attribute has an error (reported here), so that the error
/// does not cascade into the field being taken for a scalar.
fn parse_tensor_attr(attr: &syn::Attribute, diags: &mut Diagnostics) -> Option<TensorAttr> {
    Some(tensor_attr(attr, diags).unwrap_or(TensorAttr {
        elem: None,
        given: crate::ir::Given::Elem,
        elem_span: attr.span(),
        dims: Vec::new(),
        span: attr.span(),
    }))
}

fn tensor_attr(attr: &syn::Attribute, diags: &mut Diagnostics) -> Option<TensorAttr> {
    const FORM: &str = "expected `#[tensor(elem, [dims])]`, e.g. `#[tensor(i32, [B, Sk])]`";
    let syn::Meta::List(list) = &attr.meta else {
        diags.error_spanned(attr, FORM);
        return None;
    };
    let parsed = (|input: syn::parse::ParseStream<'_>| {
        let elem: syn::Ident = input.parse()?;
        let _: Token![,] = input.parse()?;
        let content;
        let bracket = syn::bracketed!(content in input);
        let dims = Punctuated::<syn::Expr, Token![,]>::parse_terminated(&content)?;
        if !input.is_empty() {
            return Err(input.error("unexpected tokens after the dimensions"));
        }
        Ok((elem, bracket, dims))
    })
    .parse2(list.tokens.clone());
    let (elem, bracket, dims) = match parsed {
        Ok(p) => p,
        Err(e) => {
            diags.error(e.span(), format!("{e}; {FORM}"));
            return None;
        }
    };
    use crate::ir::Given;
    let (scalar, given) = match elem.to_string().as_str() {
        "i32" => (Some(Scalar::I32), Given::Elem),
        "u32" => (Some(Scalar::U32), Given::Elem),
        "f32" => (Some(Scalar::F32), Given::Elem),
        "bool" => (Some(Scalar::I32), Given::Bool),
        "i64" => (Some(Scalar::I32), Given::I64),
        _ => {
            diags.error_spanned(
                &elem,
                format!(
                    "unsupported tensor element type `{elem}`; captured tensors hold i32, u32, \
                     f32, bool or i64"
                ),
            );
            (None, Given::Elem)
        }
    };
    if dims.len() > 4 {
        diags.error(
            bracket.span.join(),
            format!(
                "a captured tensor has 0 to 4 dimensions, this declares {}",
                dims.len()
            ),
        );
        return None;
    }
    let mut out = Vec::with_capacity(dims.len());
    for d in &dims {
        match d {
            syn::Expr::Infer(_) => out.push(DimDecl::Any),
            syn::Expr::Path(p) if p.path.get_ident().is_some() => {
                let name = p.path.get_ident().expect("checked").to_string();
                match Size::ALL.into_iter().find(|s| s.name() == name) {
                    Some(size) => out.push(DimDecl::Size(size)),
                    None => {
                        diags.error_spanned(
                            p,
                            format!(
                                "unknown dimension `{name}`; a dimension is a size of the \
                                 problem (B, Hq, Hkv, Sq, Sk), an integer, or `_` for any size"
                            ),
                        );
                        return None;
                    }
                }
            }
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Int(n),
                ..
            }) => match n.base10_parse::<u32>() {
                Ok(v) if v > 0 => out.push(DimDecl::Fixed(v)),
                _ => {
                    diags.error_spanned(n, "a fixed dimension is a positive u32");
                    return None;
                }
            },
            other => {
                diags.error_spanned(
                    other,
                    "a dimension is a size of the problem (B, Hq, Hkv, Sq, Sk), an integer, \
                     or `_` for any size",
                );
                return None;
            }
        }
    }
    Some(TensorAttr {
        elem: scalar,
        given,
        elem_span: elem.span(),
        dims: out,
        span: attr.span(),
    })
}

fn duplicate(diags: &mut Diagnostics, path: &syn::Path, key: Symbol) {
    diags.error_spanned(path, format!("duplicate `{key}` argument"));
}

fn parse_meta(meta: &Meta, spec: &mut Spec, diags: &mut Diagnostics) {
    let path = meta.path();
    let Some(key) = path.get_ident() else {
        diags.error_spanned(
            path,
            format!(
                "unknown attention argument; expected one of {}",
                symbol::ATTRIBUTE_KEYS
            ),
        );
        return;
    };
    if key == symbol::SCORE
        || key == symbol::SCORE_GRAD
        || key == symbol::MASK
        || key == symbol::SINK
    {
        let Meta::NameValue(nv) = meta else {
            diags.error_spanned(meta, format!("expected `{key} = |...| expression`"));
            return;
        };
        let (arity, slot, signature, symbol) = if key == symbol::SCORE {
            (5, &mut spec.score, "|s, b, h, q, kv|", symbol::SCORE)
        } else if key == symbol::SCORE_GRAD {
            (
                5,
                &mut spec.score_grad,
                "|s, b, h, q, kv|",
                symbol::SCORE_GRAD,
            )
        } else if key == symbol::MASK {
            (4, &mut spec.mask, "|b, h, q, kv|", symbol::MASK)
        } else {
            (3, &mut spec.sink, "|b, h, q|", symbol::SINK)
        };
        if slot.is_some() {
            duplicate(diags, path, symbol);
            return;
        }
        *slot = parse_closure(&nv.value, arity, signature, diags);
    } else if key == symbol::DROPOUT {
        let Meta::NameValue(nv) = meta else {
            diags.error_spanned(
                meta,
                "expected `dropout = p`, `p` a literal or `self.field`",
            );
            return;
        };
        if spec.dropout.is_some() {
            duplicate(diags, path, symbol::DROPOUT);
            return;
        }
        if let Some(body) = parse_expr(&nv.value, diags) {
            let closure = Closure {
                args: Vec::new(),
                span: nv.value.span(),
                body,
            };
            spec.dropout = Some((closure, key.span()));
        }
    } else if key == symbol::NORMALIZE {
        if spec.normalize.is_some() {
            duplicate(diags, path, symbol::NORMALIZE);
            return;
        }
        let value = match meta {
            Meta::NameValue(nv) => match &nv.value {
                syn::Expr::Path(p) if p.path.get_ident().is_some() => p.path.get_ident(),
                _ => None,
            },
            _ => None,
        };
        let normalize = match value {
            Some(id) if id == symbol::SOFTMAX => Some(crate::ir::Normalize::Softmax),
            Some(id) if id == symbol::SIGMOID => Some(crate::ir::Normalize::Sigmoid),
            _ => None,
        };
        match normalize {
            Some(n) => spec.normalize = Some((n, key.span())),
            None => {
                let at: &dyn quote::ToTokens = match meta {
                    Meta::NameValue(nv) => &nv.value,
                    other => other,
                };
                diags.error_spanned(
                    at,
                    "expected `normalize = softmax` or `normalize = sigmoid`",
                );
            }
        }
    } else if key == symbol::TILE {
        if spec.tile.is_some() {
            duplicate(diags, path, symbol::TILE);
            return;
        }
        spec.tile = Some(parse_tile(meta, diags));
    } else if key == symbol::TESTS {
        let Meta::NameValue(nv) = meta else {
            diags.error_spanned(meta, "expected `tests = [Variant { .. }, ...]`");
            return;
        };
        match &nv.value {
            syn::Expr::Array(array) => {
                for instance in &array.elems {
                    check_instance(instance, spec, diags);
                }
                spec.tests.extend(array.elems.iter().cloned());
            }
            other => diags.error_spanned(
                other,
                "`tests` takes an array of instances: `tests = [Variant { .. }, ...]`",
            ),
        }
    } else if key == symbol::CRATE {
        if spec.krate.is_some() {
            duplicate(diags, path, symbol::CRATE);
            return;
        }
        match crate_value(meta) {
            Ok(path) => spec.krate = Some(path),
            Err(at) => diags.error_spanned(
                at,
                "expected `crate = \"path\"`, the runtime crate's path (as serde's `crate`)",
            ),
        }
    } else {
        diags.error_spanned(
            key,
            format!(
                "unknown attention argument `{key}`; expected one of {}",
                symbol::ATTRIBUTE_KEYS
            ),
        );
    }
}

/// The path of `crate = "path"`, or the token to put an error at.
fn crate_value(meta: &Meta) -> Result<syn::Path, &dyn quote::ToTokens> {
    let Meta::NameValue(nv) = meta else {
        return Err(meta);
    };
    match &nv.value {
        syn::Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Str(s),
            ..
        }) => s
            .parse::<syn::Path>()
            .map_err(|_| &nv.value as &dyn quote::ToTokens),
        other => Err(other),
    }
}

/// The path `crate = ".."` gives in an attribute's arguments, if they
/// parse and hold one: the macro names the runtime crate by it even where
/// the rest of the declaration fails (its stub items too).
pub fn crate_path(attr: TokenStream) -> Option<syn::Path> {
    let metas = Punctuated::<Meta, Token![,]>::parse_terminated
        .parse2(attr)
        .ok()?;
    metas
        .iter()
        .find(|m| m.path().is_ident("crate"))
        .and_then(|m| crate_value(m).ok())
}

fn parse_tile(meta: &Meta, diags: &mut Diagnostics) -> TileOverride {
    let mut tile = TileOverride::default();
    let Meta::List(list) = meta else {
        diags.error_spanned(meta, "expected `tile(q = <rows>, kv = <keys>)`");
        return tile;
    };
    let args = match Punctuated::<syn::MetaNameValue, Token![,]>::parse_terminated
        .parse2(list.tokens.clone())
    {
        Ok(args) => args,
        Err(e) => {
            diags.push(e);
            return tile;
        }
    };
    for arg in &args {
        let slot = match arg.path.get_ident() {
            Some(id) if id == symbol::TILE_Q => &mut tile.q,
            Some(id) if id == symbol::TILE_KV => &mut tile.kv,
            _ => {
                diags.error_spanned(&arg.path, "unknown tile size; expected `q` or `kv`");
                continue;
            }
        };
        let value = match &arg.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Int(lit),
                ..
            }) => lit.base10_parse::<u32>().ok(),
            _ => None,
        };
        match value {
            Some(v) if (1..=1024).contains(&v) => *slot = Some(v),
            _ => diags.error_spanned(
                &arg.value,
                "tile sizes are integer literals between 1 and 1024",
            ),
        }
    }
    tile
}

fn parse_closure(
    expr: &syn::Expr,
    arity: usize,
    signature: &str,
    diags: &mut Diagnostics,
) -> Option<Closure> {
    let syn::Expr::Closure(closure) = expr else {
        diags.error_spanned(expr, format!("expected a closure `{signature} expression`"));
        return None;
    };
    if closure.inputs.len() != arity {
        let (begin, inputs, end) = (&closure.inputs_begin, &closure.inputs, &closure.inputs_end);
        diags.error_spanned(
            quote::quote!(#begin #inputs #end),
            format!(
                "this closure takes {arity} arguments `{signature}`, found {}",
                closure.inputs.len()
            ),
        );
        return None;
    }
    if let syn::ReturnType::Type(_, ty) = &closure.output {
        diags.error_spanned(
            ty,
            "closures declare no return type: it is implied by the role",
        );
    }
    if let Some(capture) = &closure.capture {
        diags.error_spanned(
            capture,
            "`move` has no meaning here; parameters are read as `self.field`",
        );
    }
    let mut args = Vec::with_capacity(arity);
    for pat in &closure.inputs {
        match pat {
            syn::Pat::Ident(p) if p.by_ref.is_none() && p.subpat.is_none() => {
                args.push(Some(p.ident.clone()))
            }
            syn::Pat::Wild(_) => args.push(None),
            other => {
                diags.error_spanned(other, "closure arguments must be plain names or `_`");
                args.push(None);
            }
        }
    }
    let body = parse_expr(&closure.body, diags)?;
    Some(Closure {
        args,
        span: closure.span(),
        body,
    })
}

fn unsupported(diags: &mut Diagnostics, tokens: impl quote::ToTokens, what: &str) -> Option<Expr> {
    diags.error_spanned(
        tokens,
        format!(
            "unsupported expression: {what}; the variant language has literals, names, `self.field`, \
             tensor reads `self.field[i]`, arithmetic, comparisons, `&& || !`, `as` casts, \
             `if`/`else`, `let` blocks and its functions"
        ),
    );
    None
}

/// `f32::INFINITY` and `f32::NEG_INFINITY` (also as `core::f32::..` or
/// `std::f32::..`): the values FlexAttention's mods write as `-inf`.
fn float_constant(p: &syn::ExprPath) -> Option<f64> {
    if p.qself.is_some() {
        return None;
    }
    let names: Vec<String> = p
        .path
        .segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect();
    let tail = match names.as_slice() {
        [f, c] if f == "f32" => c,
        [root, f, c] if (root == "core" || root == "std") && f == "f32" => c,
        _ => return None,
    };
    match tail.as_str() {
        "INFINITY" => Some(f64::INFINITY),
        "NEG_INFINITY" => Some(f64::NEG_INFINITY),
        _ => None,
    }
}

/// Parse one expression; `None` after recording an error.
fn parse_expr(expr: &syn::Expr, diags: &mut Diagnostics) -> Option<Expr> {
    let span = expr_span(expr);
    let kind = match expr {
        syn::Expr::Lit(lit) => parse_lit(&lit.lit, diags)?,
        syn::Expr::Paren(p) => {
            // The parentheses' span covers the whole expression.
            let mut inner = parse_expr(&p.expr, diags)?;
            inner.span = p.paren_token.span.join();
            return Some(inner);
        }
        syn::Expr::Group(g) => return parse_expr(&g.expr, diags),
        syn::Expr::Path(p) => {
            if let Some(value) = float_constant(p) {
                return Some(Expr {
                    kind: ExprKind::Float(value),
                    span,
                });
            }
            let Some(ident) = p.path.get_ident().filter(|_| p.qself.is_none()) else {
                return unsupported(
                    diags,
                    p,
                    "a path (the constants are `f32::INFINITY` and `f32::NEG_INFINITY`)",
                );
            };
            ExprKind::Name(ident.clone())
        }
        syn::Expr::Field(f) => {
            let is_self = matches!(&*f.base, syn::Expr::Path(p) if p.path.is_ident("self"));
            match (&f.member, is_self) {
                (syn::Member::Named(name), true) => ExprKind::Field(name.clone()),
                _ => return unsupported(diags, f, "a field access other than `self.field`"),
            }
        }
        syn::Expr::Unary(u) => {
            let op = match u.op {
                syn::UnOp::Neg(_) => UnaryOp::Neg,
                syn::UnOp::Not(_) => UnaryOp::Not,
                _ => return unsupported(diags, u.op, "this unary operator"),
            };
            let inner = parse_expr(&u.expr, diags)?;
            ExprKind::Unary(op, Box::new(inner))
        }
        syn::Expr::Binary(b) => {
            let op = binary_op(&b.op);
            let lhs = parse_expr(&b.left, diags);
            let rhs = parse_expr(&b.right, diags);
            let Some(op) = op else {
                return unsupported(diags, b.op, "this operator");
            };
            ExprKind::Binary(op, Box::new(lhs?), Box::new(rhs?))
        }
        syn::Expr::Call(c) => {
            let syn::Expr::Path(p) = &*c.func else {
                return unsupported(diags, &c.func, "a call of a computed function");
            };
            let Some(name) = p.path.get_ident() else {
                return unsupported(diags, p, "a call of a path");
            };
            let args: Vec<Option<Expr>> = c.args.iter().map(|a| parse_expr(a, diags)).collect();
            ExprKind::Call(name.clone(), args.into_iter().collect::<Option<_>>()?)
        }
        syn::Expr::Cast(c) => {
            let inner = parse_expr(&c.expr, diags);
            let ty = parse_scalar(&c.ty, diags);
            ExprKind::Cast(Box::new(inner?), ty?)
        }
        syn::Expr::If(i) => {
            let cond = parse_expr(&i.cond, diags);
            let then = parse_block(&i.then_branch, i.then_branch.brace_token.span.join(), diags);
            let Some((_, else_expr)) = &i.else_branch else {
                diags.error(
                    i.if_token.span,
                    "`if` without `else`: every expression must have a value",
                );
                return None;
            };
            let els = parse_expr(else_expr, diags);
            ExprKind::If(Box::new(cond?), Box::new(then?), Box::new(els?))
        }
        syn::Expr::Block(b) => {
            if b.label.is_some() {
                return unsupported(diags, b, "a labelled block");
            }
            return parse_block(&b.block, span, diags);
        }
        syn::Expr::MethodCall(m) => {
            diags.error_spanned(
                &m.method,
                format!(
                    "unsupported expression: method call `.{}()`; call the function instead, e.g. `{}(x)`",
                    m.method, m.method
                ),
            );
            return None;
        }
        syn::Expr::Macro(m) => return unsupported(diags, m, "a macro invocation"),
        syn::Expr::Index(i) => {
            let base = parse_expr(&i.expr, diags);
            let index = parse_expr(&i.index, diags);
            ExprKind::Index(Box::new(base?), Box::new(index?))
        }
        syn::Expr::Match(m) => {
            return unsupported(diags, m.match_token, "`match` (use `if`/`else`)");
        }
        syn::Expr::Closure(c) => return unsupported(diags, c, "a nested closure"),
        syn::Expr::Assign(a) => return unsupported(diags, a, "assignment"),
        syn::Expr::Return(r) => return unsupported(diags, r, "`return`"),
        syn::Expr::Loop(l) => return unsupported(diags, l.loop_token, "a loop"),
        syn::Expr::ForLoop(l) => return unsupported(diags, l.for_token, "a loop"),
        syn::Expr::While(l) => return unsupported(diags, l.while_token, "a loop"),
        syn::Expr::Reference(r) => return unsupported(diags, r, "a reference"),
        syn::Expr::Tuple(t) => return unsupported(diags, t, "a tuple"),
        syn::Expr::Array(a) => return unsupported(diags, a, "an array"),
        other => return unsupported(diags, other, "this expression"),
    };
    Some(Expr { kind, span })
}

/// Where the checker's errors about `expr` point. A proc macro on a stable
/// compiler cannot join spans, so the `span()` of a multi-token expression is
/// its first token's: `a` for `a + b`, as if `a` were at fault. Where the
/// whole range cannot be had, point at the token that makes the expression
/// what it is: the operator of `a + b`, the `as` of a cast, the name in
/// `self.name`, the last brackets of `self.t[i][j]`.
fn expr_span(expr: &syn::Expr) -> Span {
    use quote::ToTokens;
    let key = match expr {
        syn::Expr::Binary(b) => b.op.span(),
        syn::Expr::Cast(c) => c.as_token.span,
        syn::Expr::Field(f) => f.member.span(),
        syn::Expr::Index(i) => i.bracket_token.span.join(),
        _ => return expr.span(),
    };
    let mut tokens = expr.to_token_stream().into_iter();
    let first = tokens.next().map(|t| t.span());
    let last = tokens.last().map(|t| t.span());
    first.zip(last).and_then(|(a, b)| a.join(b)).unwrap_or(key)
}

fn parse_block(block: &syn::Block, span: Span, diags: &mut Diagnostics) -> Option<Expr> {
    let mut lets = Vec::new();
    let mut tail = None;
    let mut ok = true;
    let count = block.stmts.len();
    for (i, stmt) in block.stmts.iter().enumerate() {
        match stmt {
            syn::Stmt::Local(local) => {
                if i + 1 == count {
                    diags.error_spanned(
                        local,
                        "a block must end with an expression (its value), not a `let`",
                    );
                    ok = false;
                }
                match parse_let(local, diags) {
                    Some(l) => lets.push(l),
                    None => ok = false,
                }
            }
            syn::Stmt::Expr(e, None) if i + 1 == count => tail = parse_expr(e, diags),
            syn::Stmt::Expr(e, _) => {
                diags.error_spanned(
                    e,
                    "only `let` statements may come before a block's final expression",
                );
                ok = false;
            }
            other => {
                diags.error_spanned(other, "unsupported statement; only `let` is allowed");
                ok = false;
            }
        }
    }
    if count == 0 {
        diags.error(span, "an empty block has no value");
        return None;
    }
    let tail = tail?;
    if !ok {
        return None;
    }
    if lets.is_empty() {
        return Some(tail);
    }
    Some(Expr {
        kind: ExprKind::Block(lets, Box::new(tail)),
        span,
    })
}

fn parse_let(local: &syn::Local, diags: &mut Diagnostics) -> Option<Let> {
    let (pat, ty) = match &local.pat {
        syn::Pat::Type(pt) => {
            let ty = parse_scalar(&pt.ty, diags).map(|s| (s, pt.ty.span()));
            (&*pt.pat, Some(ty?))
        }
        other => (other, None),
    };
    let name = match pat {
        syn::Pat::Ident(p) if p.by_ref.is_none() && p.subpat.is_none() => {
            if let Some(m) = &p.mutability {
                diags.error_spanned(m, "bindings are immutable in the variant language");
                return None;
            }
            p.ident.clone()
        }
        other => {
            diags.error_spanned(other, "`let` binds a single name");
            return None;
        }
    };
    let Some(init) = &local.init else {
        diags.error_spanned(local, "`let` needs a value: `let x = ...;`");
        return None;
    };
    if let Some((else_token, _)) = &init.diverge {
        diags.error_spanned(else_token, "`let ... else` is not supported");
        return None;
    }
    let value = parse_expr(&init.expr, diags)?;
    Some(Let { name, ty, value })
}

fn parse_lit(lit: &syn::Lit, diags: &mut Diagnostics) -> Option<ExprKind> {
    match lit {
        syn::Lit::Int(i) => {
            let suffix = match i.suffix() {
                "" => None,
                "i32" => Some(Scalar::I32),
                "u32" => Some(Scalar::U32),
                "f32" => return i.base10_parse::<f64>().ok().map(ExprKind::Float),
                other => {
                    diags.error_spanned(
                        i,
                        format!("unsupported literal suffix `{other}`; use i32, u32 or f32"),
                    );
                    return None;
                }
            };
            match i.base10_parse::<u64>() {
                Ok(v) => Some(ExprKind::Int(v, suffix)),
                Err(e) => {
                    diags.push(e);
                    None
                }
            }
        }
        syn::Lit::Float(f) => {
            if !matches!(f.suffix(), "" | "f32") {
                diags.error_spanned(
                    f,
                    format!(
                        "unsupported float suffix `{}`; the language's float is f32",
                        f.suffix()
                    ),
                );
                return None;
            }
            match f.base10_parse::<f64>() {
                Ok(v) => Some(ExprKind::Float(v)),
                Err(e) => {
                    diags.push(e);
                    None
                }
            }
        }
        syn::Lit::Bool(b) => Some(ExprKind::Bool(b.value)),
        other => {
            diags.error_spanned(
                other,
                "unsupported literal; the language has integer, float and bool literals",
            );
            None
        }
    }
}

/// Parse a type that must be one of the language's scalars.
pub fn parse_scalar(ty: &syn::Type, diags: &mut Diagnostics) -> Option<Scalar> {
    let scalar = scalar_of(ty);
    if scalar.is_none() {
        diags.error_spanned(
            ty,
            "unsupported type; the language's types are f32, i32, u32 and bool",
        );
    }
    scalar
}

/// The scalar a type names, if it names one.
pub fn scalar_of(ty: &syn::Type) -> Option<Scalar> {
    let syn::Type::Path(p) = ty else {
        return None;
    };
    if p.qself.is_some() {
        return None;
    }
    let ident = p.path.get_ident()?;
    Some(match ident.to_string().as_str() {
        "f32" => Scalar::F32,
        "i32" => Scalar::I32,
        "u32" => Scalar::U32,
        "bool" => Scalar::Bool,
        _ => return None,
    })
}

fn binary_op(op: &syn::BinOp) -> Option<BinaryOp> {
    Some(match op {
        syn::BinOp::Add(_) => BinaryOp::Add,
        syn::BinOp::Sub(_) => BinaryOp::Sub,
        syn::BinOp::Mul(_) => BinaryOp::Mul,
        syn::BinOp::Div(_) => BinaryOp::Div,
        syn::BinOp::Rem(_) => BinaryOp::Rem,
        syn::BinOp::Eq(_) => BinaryOp::Eq,
        syn::BinOp::Ne(_) => BinaryOp::Ne,
        syn::BinOp::Lt(_) => BinaryOp::Lt,
        syn::BinOp::Le(_) => BinaryOp::Le,
        syn::BinOp::Gt(_) => BinaryOp::Gt,
        syn::BinOp::Ge(_) => BinaryOp::Ge,
        syn::BinOp::And(_) => BinaryOp::And,
        syn::BinOp::Or(_) => BinaryOp::Or,
        _ => return None,
    })
}
