//! The CPU target: IR → Rust tokens.
//!
//! Each IR function becomes the body of a `Variant` method that the generic
//! CPU kernels inline at the tile. The same emitter, with [`Float::F64`],
//! produces the f64 copy that the reference implementation evaluates.
//!
//! Semantics are the IR's (see [`crate::ir`]): integer `+ - *` wrap, `/` and
//! `%` by zero give 0, `clamp` never panics. One liberty in f32: a division
//! by a value made of parameters and constants only is a multiplication by
//! its reciprocal (one rounding apart from the quotient), so that the
//! kernels' row loops carry no vector division — but only where the
//! quotient flows smoothly into the result. Where it reaches a comparison,
//! `floor`/`ceil`, a cast, a float `%` or a tensor index (a mask, a
//! bucket), one rounding can flip the answer at an exact tie, so there the
//! division stays a division, as on the GPUs and in the f64 reference.

use crate::ir::{Arg, BinOp, Builtin, Const, Expr, ExprKind, Function, Local, Program, Ty, UnOp};
use proc_macro2::{Ident, Literal, Span, TokenStream};
use quote::{format_ident, quote};
use std::collections::HashSet;

/// The Rust type that IR `f32` values get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Float {
    /// `f32`: the kernels.
    F32,
    /// `f64`: the reference implementation.
    F64,
}

/// Emits Rust for the functions of one program.
#[derive(Clone, Debug)]
pub struct RustEmitter<'a> {
    program: &'a Program,
    float: Float,
    /// Every division stays a division (see [`RustEmitter::exact_f32`]).
    exact: bool,
    /// Transcendental functions from `std` rather than the runtime's
    /// vectorisable ones (see [`RustEmitter::exact_f32`]).
    std_math: bool,
    /// The divisions of the function being emitted whose quotient reaches
    /// a step (see [`stepped_divisions`]), when [`RustEmitter::body`]
    /// found them; without them no division becomes a product.
    stepped: Option<&'a HashSet<*const Expr>>,
    /// The runtime crate's path in the caller's crate.
    krate: TokenStream,
}

impl<'a> RustEmitter<'a> {
    /// An emitter for `program` with float type `float`.
    pub fn new(program: &'a Program, float: Float) -> Self {
        Self {
            program,
            float,
            exact: false,
            std_math: float == Float::F64,
            stepped: None,
            krate: quote!(::boostr_runtime),
        }
    }

    /// This emitter with the runtime crate (whose vectorisable math the
    /// f32 functions call) at `krate` in the caller's crate.
    pub fn with_crate(self, krate: TokenStream) -> Self {
        Self { krate, ..self }
    }

    /// An emitter of the language's f32 arithmetic as written: every
    /// operation rounded once (no reciprocal products), `std`'s functions.
    /// The reference evaluates masks with it, because a mask is a decision:
    /// at a tie (`q / 6.0 - kv / 6.0 <= 3.0` exactly) f64 arithmetic can
    /// answer otherwise than every kernel does in f32.
    pub fn exact_f32(program: &'a Program) -> Self {
        Self {
            program,
            float: Float::F32,
            exact: true,
            std_math: true,
            stepped: None,
            krate: quote!(::boostr_runtime),
        }
    }

    /// Whether division `e` may be a product with the reciprocal: its
    /// quotient flows smoothly into the result.
    fn smooth(&self, e: &Expr) -> bool {
        !self.exact
            && self
                .stepped
                .is_some_and(|s| !s.contains(&std::ptr::from_ref(e)))
    }

    /// The Rust type of an IR type.
    pub fn ty(&self, ty: Ty) -> TokenStream {
        match ty {
            Ty::F32 => match self.float {
                Float::F32 => quote!(f32),
                Float::F64 => quote!(f64),
            },
            Ty::I32 => quote!(i32),
            Ty::U32 => quote!(u32),
            Ty::Bool => quote!(bool),
        }
    }

    /// `name: type` for each argument of `f`.
    pub fn params(&self, f: &Function) -> Vec<TokenStream> {
        f.args
            .iter()
            .map(|a| {
                let name = arg_ident(*a);
                let ty = self.ty(a.ty());
                quote!(#name: #ty)
            })
            .collect()
    }

    /// The body of `f` as a block; arguments it does not read are consumed so
    /// the generated method has no unused-variable warnings.
    pub fn body(&self, f: &Function) -> TokenStream {
        let unused: Vec<Ident> = f
            .args
            .iter()
            .filter(|a| !f.body.uses_arg(**a))
            .map(|a| arg_ident(*a))
            .collect();
        let stepped = stepped_divisions(&f.body);
        let emitter = RustEmitter {
            program: self.program,
            float: self.float,
            exact: self.exact,
            std_math: self.std_math,
            stepped: Some(&stepped),
            krate: self.krate.clone(),
        };
        let expr = emitter.expr(&f.body);
        quote!({
            #( let _ = #unused; )*
            #expr
        })
    }

    fn float_lit(&self, v: f64) -> TokenStream {
        let ty = match self.float {
            Float::F32 => quote!(f32),
            Float::F64 => quote!(f64),
        };
        // The value in the target's precision (an f64 beyond f32's range is
        // an f32 infinity), whose literal exists only when finite.
        let v = match self.float {
            Float::F32 => f64::from(v as f32),
            Float::F64 => v,
        };
        let lit = |x: f64| match self.float {
            Float::F32 => Literal::f32_suffixed(x as f32),
            Float::F64 => Literal::f64_suffixed(x),
        };
        if v.is_nan() {
            quote!(#ty::NAN)
        } else if v.is_infinite() && v > 0.0 {
            quote!(#ty::INFINITY)
        } else if v.is_infinite() {
            quote!(#ty::NEG_INFINITY)
        } else if v < 0.0 || (v == 0.0 && v.is_sign_negative()) {
            let pos = lit(-v);
            quote!((-#pos))
        } else {
            let lit = lit(v);
            quote!(#lit)
        }
    }

    /// One expression.
    pub fn expr(&self, e: &Expr) -> TokenStream {
        match &e.kind {
            ExprKind::Const(Const::Float(v)) => self.float_lit(*v),
            ExprKind::Const(Const::Int(v)) => match e.ty {
                Ty::U32 => {
                    let lit = Literal::u32_suffixed(*v as u32);
                    quote!(#lit)
                }
                _ => {
                    let v = *v as i32;
                    if v < 0 {
                        quote!(#v)
                    } else {
                        let lit = Literal::i32_suffixed(v);
                        quote!(#lit)
                    }
                }
            },
            ExprKind::Const(Const::Bool(b)) => quote!(#b),
            ExprKind::Arg(a) => {
                let id = arg_ident(*a);
                quote!(#id)
            }
            ExprKind::Param(i) => {
                let p = &self.program.params[*i];
                let name = Ident::new(&p.name, Span::call_site());
                if p.ty == Ty::F32 && self.float == Float::F64 {
                    quote!((self.#name as f64))
                } else {
                    quote!(self.#name)
                }
            }
            ExprKind::Local(l) => {
                let id = local_ident(*l);
                quote!(#id)
            }
            ExprKind::Unary(UnOp::Neg, a) => {
                let a = self.expr(a);
                if e.ty == Ty::F32 {
                    quote!((-#a))
                } else {
                    quote!((#a).wrapping_neg())
                }
            }
            ExprKind::Unary(UnOp::Not, a) => {
                let a = self.expr(a);
                quote!((!#a))
            }
            ExprKind::Binary(op, a, b) => self.binary(e, *op, a, b),
            ExprKind::Call(f, args) => self.call(*f, args),
            ExprKind::Cast(a) => {
                let ty = self.ty(e.ty);
                let inner = self.expr(a);
                quote!((#inner as #ty))
            }
            ExprKind::Select(c, t, f) => {
                let (c, t, f) = (self.expr(c), self.expr(t), self.expr(f));
                quote!((if #c { #t } else { #f }))
            }
            ExprKind::Let(l, v, body) => {
                let id = local_ident(*l);
                let ty = self.ty(v.ty);
                let (v, body) = (self.expr(v), self.expr(body));
                quote!({ let #id: #ty = #v; #body })
            }
            ExprKind::Read(r) => {
                let t = self.tensor(r.tensor);
                let idx = self.indices(&r.indices);
                let read = if r.checks.iter().any(|c| c.any()) {
                    let site = r.site;
                    quote!(self.#t.checked(#site, [#(#idx),*]))
                } else {
                    quote!(self.#t.at([#(#idx),*]))
                };
                if e.ty == Ty::F32 && self.float == Float::F64 {
                    quote!((#read as f64))
                } else {
                    read
                }
            }
            ExprKind::ReadRange(r) => {
                let t = self.tensor(r.tensor);
                let idx = self.indices(&r.indices);
                let max = r.max;
                match r.axis {
                    None => quote!(self.#t.bound_at([#(#idx),*], #max)),
                    Some(axis) => {
                        let hi = self.expr(&r.hi);
                        quote!(self.#t.range_bound(#axis, [#(#idx),*], (#hi) as i64, #max))
                    }
                }
            }
            ExprKind::Dim(t, axis) => {
                let t = self.tensor(*t);
                quote!(self.#t.dim_i32(#axis))
            }
        }
    }

    /// The field holding captured tensor `t`.
    fn tensor(&self, t: usize) -> Ident {
        Ident::new(&self.program.tensors[t].name, Span::call_site())
    }

    /// Tensor indices as the host views take them (`i64`, so that an `i32`
    /// and a `u32` index both keep their value).
    fn indices(&self, indices: &[Expr]) -> Vec<TokenStream> {
        indices
            .iter()
            .map(|i| {
                let i = self.expr(i);
                quote!(((#i) as i64))
            })
            .collect()
    }

    fn binary(&self, e: &Expr, op: BinOp, a: &Expr, b: &Expr) -> TokenStream {
        let int = a.ty.is_int();
        let (x, y) = (self.expr(a), self.expr(b));
        let zero = if a.ty == Ty::U32 {
            quote!(0u32)
        } else {
            quote!(0i32)
        };
        match op {
            // A vector division costs as much as the rest of a typical score
            // together, and the kernels evaluate scores a tile row at a time
            // with the parameters fixed: so a division by a value that
            // depends only on parameters and constants becomes a product
            // with its reciprocal, which the compiler hoists out of the row
            // loop. The quotient may differ from `x / y` by one rounding.
            BinOp::Div if !int && self.float == Float::F32 && is_uniform(b) && self.smooth(e) => {
                let one = self.float_lit(1.0);
                quote!((#x * (#one / #y)))
            }
            BinOp::Add if int => quote!((#x).wrapping_add(#y)),
            BinOp::Sub if int => quote!((#x).wrapping_sub(#y)),
            BinOp::Mul if int => quote!((#x).wrapping_mul(#y)),
            BinOp::Div if int => {
                quote!({ let (n, d) = (#x, #y); if d == #zero { #zero } else { n.wrapping_div(d) } })
            }
            BinOp::Rem if int => {
                quote!({ let (n, d) = (#x, #y); if d == #zero { #zero } else { n.wrapping_rem(d) } })
            }
            _ => {
                let sym: TokenStream = op.symbol().parse().expect("operator tokens");
                quote!((#x #sym #y))
            }
        }
    }

    fn call(&self, f: Builtin, args: &[Expr]) -> TokenStream {
        let ty = args[0].ty;
        let a: Vec<TokenStream> = args.iter().map(|x| self.expr(x)).collect();
        let x = &a[0];
        let float = ty == Ty::F32;
        // In f32, the transcendental functions call the runtime's branch-free
        // versions (libm calls would stop the per-element score loops from
        // vectorizing); the f64 reference keeps std, independent of them.
        if !self.std_math {
            let name = match f {
                Builtin::Exp => Some("exp"),
                Builtin::Exp2 => Some("exp2"),
                Builtin::Log => Some("log"),
                Builtin::Log2 => Some("log2"),
                Builtin::Tanh => Some("tanh"),
                Builtin::Sigmoid => Some("sigmoid"),
                _ => None,
            };
            if let Some(name) = name {
                let m = format_ident!("{}", name);
                let krate = &self.krate;
                return quote!(#krate::cpu::math::#m(#x));
            }
        }
        match f {
            Builtin::Exp => quote!((#x).exp()),
            Builtin::Exp2 => quote!((#x).exp2()),
            Builtin::Log => quote!((#x).ln()),
            Builtin::Log2 => quote!((#x).log2()),
            Builtin::Sqrt => quote!((#x).sqrt()),
            Builtin::Tanh => quote!((#x).tanh()),
            // std's, in f32 too: correctly reduced over the whole range.
            Builtin::Sin => quote!((#x).sin()),
            Builtin::Cos => quote!((#x).cos()),
            Builtin::Tan => quote!((#x).tan()),
            Builtin::Floor => quote!((#x).floor()),
            Builtin::Ceil => quote!((#x).ceil()),
            Builtin::Sigmoid => {
                let one = self.float_lit(1.0);
                quote!((#one / (#one + (-(#x)).exp())))
            }
            Builtin::Abs if float => quote!((#x).abs()),
            Builtin::Abs if ty == Ty::I32 => quote!((#x).wrapping_abs()),
            Builtin::Abs => quote!((#x)),
            Builtin::Min | Builtin::Max => {
                let y = &a[1];
                let m = format_ident!("{}", f.name());
                if float {
                    quote!((#x).#m(#y))
                } else {
                    quote!(::core::cmp::Ord::#m(#x, #y))
                }
            }
            Builtin::Clamp => {
                let (lo, hi) = (&a[1], &a[2]);
                if float {
                    quote!((#x).max(#lo).min(#hi))
                } else {
                    quote!(::core::cmp::Ord::min(::core::cmp::Ord::max(#x, #lo), #hi))
                }
            }
            Builtin::SatAdd | Builtin::SatSub | Builtin::SatMul => {
                let y = &a[1];
                let m = match f {
                    Builtin::SatAdd => quote!(saturating_add),
                    Builtin::SatSub => quote!(saturating_sub),
                    _ => quote!(saturating_mul),
                };
                quote!((#x).#m(#y))
            }
        }
    }
}

/// Whether `op` on operands like `a` is a step function of them: a
/// comparison, or a float remainder.
fn steps(op: BinOp, a: &Expr) -> bool {
    match op {
        BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge => true,
        BinOp::Rem => a.ty == Ty::F32,
        _ => false,
    }
}

/// The divisions in `e` whose quotient reaches a step: a comparison,
/// `floor`/`ceil`, a cast, a float `%`, a condition or a tensor index,
/// where one rounding can change the result by a step. One pass, each
/// `let`'s body before its value, so that the value is visited knowing
/// whether its local reaches a step.
fn stepped_divisions(e: &Expr) -> HashSet<*const Expr> {
    #[derive(Default)]
    struct Walk {
        locals: HashSet<Local>,
        out: HashSet<*const Expr>,
    }
    impl Walk {
        fn walk(&mut self, e: &Expr, exact: bool) {
            match &e.kind {
                ExprKind::Local(m) => {
                    if exact {
                        self.locals.insert(*m);
                    }
                }
                ExprKind::Const(_) | ExprKind::Arg(_) | ExprKind::Param(_) | ExprKind::Dim(..) => {}
                ExprKind::Unary(_, a) => self.walk(a, exact),
                ExprKind::Cast(a) => self.walk(a, true),
                ExprKind::Binary(op, a, b) => {
                    if exact && *op == BinOp::Div {
                        self.out.insert(std::ptr::from_ref(e));
                    }
                    let exact = exact || steps(*op, a);
                    self.walk(a, exact);
                    self.walk(b, exact);
                }
                ExprKind::Call(f, args) => {
                    let exact = exact || matches!(f, Builtin::Floor | Builtin::Ceil);
                    args.iter().for_each(|x| self.walk(x, exact));
                }
                ExprKind::Select(c, t, f) => {
                    self.walk(c, true);
                    self.walk(t, exact);
                    self.walk(f, exact);
                }
                ExprKind::Let(m, v, body) => {
                    self.walk(body, exact);
                    let v_exact = exact || self.locals.contains(m);
                    self.walk(v, v_exact);
                }
                ExprKind::Read(r) => r.indices.iter().for_each(|i| self.walk(i, true)),
                ExprKind::ReadRange(r) => {
                    r.indices.iter().for_each(|i| self.walk(i, true));
                    self.walk(&r.hi, true);
                }
            }
        }
    }
    let mut w = Walk::default();
    w.walk(e, false);
    w.out
}

/// Whether `e` depends only on parameters and constants (never on the
/// function's arguments), so that it is the same for every score of a
/// kernel launch. `let`-bound locals count as varying: a conservative answer.
fn is_uniform(e: &Expr) -> bool {
    match &e.kind {
        ExprKind::Const(_) | ExprKind::Param(_) => true,
        // A tensor read may vary with its indices (and its data).
        ExprKind::Arg(_)
        | ExprKind::Local(_)
        | ExprKind::Let(..)
        | ExprKind::Read(_)
        | ExprKind::ReadRange(_)
        | ExprKind::Dim(..) => false,
        ExprKind::Unary(_, a) | ExprKind::Cast(a) => is_uniform(a),
        ExprKind::Binary(_, a, b) => is_uniform(a) && is_uniform(b),
        ExprKind::Call(_, args) => args.iter().all(is_uniform),
        ExprKind::Select(c, t, f) => is_uniform(c) && is_uniform(t) && is_uniform(f),
    }
}

fn arg_ident(a: Arg) -> Ident {
    Ident::new(a.name(), Span::call_site())
}

fn local_ident(l: Local) -> Ident {
    format_ident!("l{}", l.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f32 score body of `score`, as token text.
    fn score_body(score: &str, float: Float) -> String {
        let src = format!(
            "#[attention(score = |s, b, h, q, kv| {score})] struct V {{ cap: f32, n: i32 }}"
        );
        let program = match crate::compile_str(&src) {
            Ok(c) => c.program,
            Err(d) => panic!("{src}: {:?}", d.messages()),
        };
        RustEmitter::new(&program, float)
            .body(&program.score)
            .to_string()
    }

    #[test]
    fn division_by_a_uniform_value_becomes_a_reciprocal_product() {
        // Parameters and constants only: multiplied by the reciprocal.
        let body = score_body("tanh(s / self.cap) * self.cap", Float::F32);
        assert!(body.contains("* (1f32 / self . cap)"), "{body}");
        assert!(!body.contains("s / "), "{body}");
        let body = score_body("s / (self.cap * 2.0 + (self.n as f32))", Float::F32);
        assert!(body.contains("* (1f32 /"), "{body}");
        // Anything that varies per score keeps its division.
        for varying in ["s / (s * s + 1.0)", "s / (kv as f32 + 1.0)"] {
            let body = score_body(varying, Float::F32);
            assert!(!body.contains("1f32 /"), "{varying}: {body}");
        }
        // The f64 reference divides.
        let body = score_body("s / self.cap", Float::F64);
        assert!(!body.contains("1f64 /") && body.contains(" / "), "{body}");
        // A quotient that reaches a step keeps its division: a rounding
        // there moves the answer by a step at an exact tie.
        for stepped in [
            "if (q as f32) / self.cap <= 3.0 { s } else { 0.0 }",
            "s + floor((kv as f32) / self.cap)",
            "s + (((q as f32) / self.cap) as i32) as f32",
            "s + ((q as f32) / self.cap) % 2.0",
            "{ let x = (q as f32) / self.cap; if x < 1.0 { s } else { s * x } }",
        ] {
            let body = score_body(stepped, Float::F32);
            assert!(!body.contains("1f32 /"), "{stepped}: {body}");
        }
        // Smooth uses beside a step keep theirs.
        let body = score_body("if q < kv { s / self.cap } else { s }", Float::F32);
        assert!(body.contains("* (1f32 / self . cap)"), "{body}");
    }
}
