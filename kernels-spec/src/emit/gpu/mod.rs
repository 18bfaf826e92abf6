//! The C-like GPU targets (CUDA C, WGSL): one lowering of the variant
//! functions, printed by a [`Dialect`].
//!
//! - [`ast`]: the typed representation both targets print;
//! - [`lower`]: IR → that representation, once for every dialect;
//! - [`Dialect`]: how one target writes each node, with the C-like form as
//!   the default. A dialect also brings the helper functions that give its
//!   target the IR's semantics where the target's own operators differ
//!   (integer division by zero, NaN in `min`, float contraction, ...).
//!
//! A new C-like target (Metal Shading Language, HLSL) is one dialect file,
//! its kernel templates, and its runtime: the walk is not copied.
//!
//! [`variant_section`] is what every kernel of a target is assembled
//! around: the dialect's helpers, the parameter block struct, and the four
//! variant functions `variant_score(s, b, h, q, kv)`, `variant_score_grad`
//! (same arguments), `variant_mask(b, h, q, kv)` and
//! `variant_classify(b, h, q_lo, q_hi, kv_lo, kv_hi)`, which returns a
//! [`TileClass`] code.

pub mod ast;
pub mod lower;
pub mod weights;

use self::ast::{BinaryOp, Expr, Func, Function, Literal, Name, ParamsStruct, Stmt, Type, UnaryOp};
use super::Target;
use crate::ir::{Program, TileClass};
use std::fmt::{self, Display, Formatter};
use std::marker::PhantomData;

/// A printed part of the code that a dialect places (an operand, a name,
/// a value).
pub type Part<'a> = &'a dyn Display;

/// How a dialect writes an operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpForm {
    /// The language's own operator: `(op a)`, `(a op b)`.
    Operator,
    /// A call of this function or helper: `name(a)`, `name(a, b)`.
    Call(&'static str),
}

/// How a dialect writes a conversion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CastForm {
    /// A call of this function, helper or type constructor: `name(a)`.
    Call(&'static str),
    /// A C-style cast to the result type: `((type)(a))`.
    CCast,
}

/// How one C-like target writes the [`ast`]: its syntax, as small tables and
/// hooks. The structure (expressions, statements, functions, the parameter
/// block) is written once, here; a dialect supplies only what differs, with
/// the C-like form as the default where there is one.
pub trait Dialect: Sized + 'static {
    /// The target this dialect writes.
    const TARGET: Target;
    /// The helper functions the printed code calls (text in the target's
    /// language, every one total).
    const HELPERS: &'static str;
    /// The helpers that read the capture arena (`bx_capture`,
    /// `bx_capture_checked`, `bx_summary`), included for variants that
    /// read tensors.
    const CAPTURE_HELPERS: &'static str;

    // ---- types and literals ----

    /// The names of `f32`, `i32`, `u32` and `bool`, in that order.
    const TYPES: [&'static str; 4];

    /// The suffix of an `i32` literal (a `u32`'s is `u`, an `f32`'s `f`).
    const I32_SUFFIX: &'static str;

    /// The name of a scalar type.
    fn ty(t: Type) -> &'static str {
        Self::TYPES[match t {
            Type::F32 => 0,
            Type::I32 => 1,
            Type::U32 => 2,
            Type::Bool => 3,
        }]
    }

    /// A non-finite `f32`, which no C-like target has a literal for.
    fn non_finite(f: &mut Formatter<'_>, v: f32) -> fmt::Result;

    // ---- operations ----

    /// How a prefix operation on a value of type `ty` is written.
    fn unary(op: UnaryOp, ty: Type) -> OpForm {
        let _ = (op, ty);
        OpForm::Operator
    }

    /// How an infix operation on operands of type `ty` is written.
    fn binary(op: BinaryOp, ty: Type) -> OpForm {
        let _ = (op, ty);
        OpForm::Operator
    }

    /// The name of `func` on arguments of type `ty`.
    fn function(func: Func, ty: Type) -> &'static str;

    /// How a numeric conversion from `from` to `to` is written (a `bool`
    /// becomes 0 or 1 through [`select`](Dialect::select)).
    fn cast(from: Type, to: Type) -> CastForm;

    /// How the bits of a `u32` are read as an `f32` or an `i32`.
    fn bits(to: Type) -> CastForm;

    /// What the capture helpers (`bx_capture`, `bx_capture_checked`,
    /// `bx_summary`) take before their own arguments: nothing where the
    /// arena is a module-scope binding, the arena where it is an argument.
    const CAPTURES_ARG: &'static str = "";

    /// What a call of a variant function takes before its own arguments:
    /// nothing where the block and the arena are module-scope bindings,
    /// both where they are arguments.
    const VARIANT_ARGS: &'static str = "";

    /// The declaration of a helper that returns nothing, taking what the
    /// variant functions take (the block, the arena) and then `args`, up to
    /// and including its `{` line.
    fn void_header(f: &mut Formatter<'_>, name: &str, args: &[(&str, Type)]) -> fmt::Result;

    /// `if cond { then } else { otherwise }`.
    fn select(
        f: &mut Formatter<'_>,
        cond: Part<'_>,
        then: Part<'_>,
        otherwise: Part<'_>,
    ) -> fmt::Result;

    // ---- statements and declarations ----

    /// An immutable local, on its own line, indented one level.
    fn let_local(
        f: &mut Formatter<'_>,
        name: &dyn Display,
        ty: Type,
        value: &dyn Display,
    ) -> fmt::Result;

    /// A name the function takes but never reads; by default nothing.
    fn unused(f: &mut Formatter<'_>, name: Part<'_>) -> fmt::Result {
        let _ = (f, name);
        Ok(())
    }

    /// A variant function's declaration up to and including its `{` line.
    fn function_header(f: &mut Formatter<'_>, fun: &Function) -> fmt::Result;

    /// One member of the parameter block struct `Params`, on its own line.
    fn params_member(f: &mut Formatter<'_>, name: &str, ty: Type) -> fmt::Result;

    /// The block's `words` zero words after its members, from word `start`
    /// (`words > 0`).
    fn params_padding(f: &mut Formatter<'_>, start: usize, words: usize) -> fmt::Result;

    /// The draw of a dropout variant: `variant_dropout(b, h, q, kv)`
    /// (after [`VARIANT_ARGS`](Dialect::VARIANT_ARGS)), the pair's weight
    /// factor, `0` or `1/(1 − p)` ([`crate::dropout`]); without `dropout`,
    /// one that returns 1 (the kernels call it either way).
    fn dropout_helpers(dropout: bool) -> String;

    /// The end of the `Params` struct, after its members.
    fn params_end(f: &mut Formatter<'_>) -> fmt::Result;

    /// The declaration of one tile-class constant: [`TileClass::constant`]
    /// with its [`TileClass::code`].
    fn tile_class_constant(f: &mut Formatter<'_>, class: TileClass) -> fmt::Result;
}

/// A node of the [`ast`] as `D` writes it.
pub struct Code<'a, D, T: ?Sized>(&'a T, PhantomData<D>);

/// `node` as dialect `D` writes it.
pub fn code<D: Dialect, T: ?Sized>(node: &T) -> Code<'_, D, T> {
    Code(node, PhantomData)
}

impl<D, T: ?Sized> fmt::Debug for Code<'_, D, T> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        f.write_str("Code(..)")
    }
}

/// A constant as `D` writes it: a finite float round-trips exactly (`{:?}`
/// always has a `.` or an exponent), negative numbers are parenthesised, and
/// `i32::MIN`, whose magnitude is no `i32` literal, is written `MAX - 1`.
pub fn literal<D: Dialect>(f: &mut Formatter<'_>, l: Literal) -> fmt::Result {
    let s = D::I32_SUFFIX;
    match l {
        Literal::F32(v) if !v.is_finite() => D::non_finite(f, v),
        Literal::F32(v) if v.is_sign_negative() => write!(f, "(-{:?}f)", -v),
        Literal::F32(v) => write!(f, "{v:?}f"),
        Literal::I32(i32::MIN) => write!(f, "(-2147483647{s} - 1{s})"),
        Literal::I32(v) if v < 0 => write!(f, "(-{}{s})", -v),
        Literal::I32(v) => write!(f, "{v}{s}"),
        Literal::U32(v) => write!(f, "{v}u"),
        Literal::Bool(v) => write!(f, "{v}"),
    }
}

/// `name(args, ...)`.
fn call(f: &mut Formatter<'_>, name: &str, args: &[&dyn Display]) -> fmt::Result {
    write!(f, "{name}(")?;
    for (i, a) in args.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{a}")?;
    }
    f.write_str(")")
}

impl<D: Dialect> Display for Code<'_, D, Expr> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let c = code::<D, Expr>;
        match self.0 {
            Expr::Lit(l) => literal::<D>(f, *l),
            Expr::Name(n) => write!(f, "{n}"),
            Expr::Param { member, .. } => write!(f, "params.{member}"),
            Expr::Unary(op, ty, a) => match D::unary(*op, *ty) {
                // The space keeps `- -x` from becoming the `--` token.
                OpForm::Operator => write!(f, "({} {})", op.symbol(), c(a)),
                OpForm::Call(name) => call(f, name, &[&c(a)]),
            },
            Expr::Binary(op, ty, a, b) => match D::binary(*op, *ty) {
                OpForm::Operator => write!(f, "({} {} {})", c(a), op.symbol(), c(b)),
                OpForm::Call(name) => call(f, name, &[&c(a), &c(b)]),
            },
            Expr::Call(func, ty, args) => {
                let printed: Vec<Code<'_, D, Expr>> = args.iter().map(c).collect();
                let args: Vec<&dyn Display> = printed.iter().map(|a| a as &dyn Display).collect();
                call(f, D::function(*func, *ty), &args)
            }
            // A bool becomes 1 or 0, by the dialect's select.
            Expr::Cast {
                to,
                from: Type::Bool,
                value,
            } => {
                let (one, zero) = match to {
                    Type::U32 => (Literal::U32(1), Literal::U32(0)),
                    _ => (Literal::I32(1), Literal::I32(0)),
                };
                D::select(f, &c(value), &c(&Expr::Lit(one)), &c(&Expr::Lit(zero)))
            }
            Expr::Cast { to, from, value } => match D::cast(*from, *to) {
                CastForm::Call(name) => call(f, name, &[&c(value)]),
                CastForm::CCast => write!(f, "(({})({}))", D::ty(*to), c(value)),
            },
            Expr::Select(cond, then, otherwise) => D::select(f, &c(cond), &c(then), &c(otherwise)),
            Expr::Capture(word) => write!(f, "bx_capture({}{})", D::CAPTURES_ARG, c(word)),
            Expr::CheckedCapture {
                word,
                ok,
                report,
                site,
                indices,
            } => {
                write!(
                    f,
                    "bx_capture_checked({}{}, {}, {}, {site}u",
                    D::CAPTURES_ARG,
                    c(word),
                    c(ok),
                    c(report)
                )?;
                for i in 0..4 {
                    match indices.get(i) {
                        Some(index) => write!(f, ", {}", c(index))?,
                        None => f.write_str(", 0u")?,
                    }
                }
                f.write_str(")")
            }
            Expr::NegInf(value) => write!(f, "bx_is_neg_inf({})", c(value)),
            Expr::Bits(to, value) => match D::bits(*to) {
                CastForm::Call(name) => call(f, name, &[&c(value)]),
                CastForm::CCast => write!(f, "(({})({}))", D::ty(*to), c(value)),
            },
            Expr::Summary {
                first,
                stride,
                count,
                max,
            } => write!(
                f,
                "bx_summary({}{}, {}, {}, {max})",
                D::CAPTURES_ARG,
                c(first),
                c(stride),
                c(count)
            ),
        }
    }
}

impl<D: Dialect> Display for Code<'_, D, Stmt> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self.0 {
            Stmt::Unused(n) => D::unused(f, n),
            Stmt::Let(l, ty, v) => D::let_local(f, &Name::Local(*l), *ty, &code::<D, _>(v)),
            Stmt::Return(v) => writeln!(f, "    return {};", code::<D, _>(v)),
        }
    }
}

impl<D: Dialect> Display for Code<'_, D, Function> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        D::function_header(f, self.0)?;
        for s in &self.0.body {
            write!(f, "{}", code::<D, _>(s))?;
        }
        writeln!(f, "}}")
    }
}

impl<D: Dialect> Display for Code<'_, D, ParamsStruct> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        writeln!(f, "struct Params {{")?;
        for m in &self.0.members {
            D::params_member(f, &m.name, m.ty)?;
        }
        if self.0.padding_words > 0 {
            D::params_padding(f, self.0.members.len(), self.0.padding_words)?;
        }
        for m in &self.0.trailing {
            D::params_member(f, &m.name, m.ty)?;
        }
        D::params_end(f)
    }
}

/// The tile-class constants as `D` declares them.
pub fn tile_class_constants<D: Dialect>() -> String {
    struct Printed<D>(PhantomData<D>);
    impl<D: Dialect> Display for Printed<D> {
        fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
            for class in TileClass::ALL {
                D::tile_class_constant(f, class)?;
            }
            Ok(())
        }
    }
    Printed::<D>(PhantomData).to_string()
}

/// The functions through which the backward adds into the gradients of
/// learnable tensors ([`crate::params`], "Gradient accumulators"):
/// `bx_learn_score(dz, s, b, h, q, kv)` adds `dz · ∂score/∂read` for every
/// read of a learnable tensor in `score` at a visible pair whose
/// `d loss / d score` is `dz` and scaled logit `s`; `bx_learn_sink(dz, b, h,
/// q)` likewise for the reads in `sink`, `dz = d loss / d sink`. Both
/// exist for every variant (empty without such reads), so every kernel
/// compiles whatever the variant.
fn learn_functions<D: Dialect>(program: &Program) -> String {
    struct Printed<'a, D>(&'a Program, PhantomData<D>);
    impl<D: Dialect> Display for Printed<'_, D> {
        fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
            let (fl, int) = (Type::F32, Type::I32);
            let score = [
                ("dz", fl),
                ("s", fl),
                ("b", int),
                ("h", int),
                ("q", int),
                ("kv", int),
            ];
            let sink = [("dz", fl), ("b", int), ("h", int), ("q", int)];
            let kinds = [
                ("bx_learn_score", &score[..], false, "s, b, h, q, kv, true"),
                ("bx_learn_sink", &sink[..], true, "b, h, q"),
            ];
            for (name, args, in_sink, call) in kinds {
                D::void_header(f, name, args)?;
                for site in self
                    .0
                    .learnable_sites
                    .iter()
                    .filter(|s| s.in_sink == in_sink)
                {
                    let (n, v) = (site.site, D::VARIANT_ARGS);
                    writeln!(
                        f,
                        "    bx_grad_add({}variant_site{n}_at({v}{call}), dz * variant_site{n}_grad({v}{call}));",
                        D::CAPTURES_ARG
                    )?;
                }
                writeln!(f, "}}")?;
            }
            Ok(())
        }
    }
    Printed::<D>(program, PhantomData).to_string()
}

/// The section every kernel of dialect `D` is assembled around: the
/// helpers, the parameter block struct, the variant functions, the
/// functions of each read of a learnable tensor and the two that add into
/// their gradients (`bx_learn_score`, `bx_learn_sink`).
pub fn variant_section<D: Dialect>(program: &Program) -> String {
    let mut s = String::from(D::HELPERS);
    if !program.tensors.is_empty() {
        s.push_str(D::CAPTURE_HELPERS);
    }
    s.push_str("\n// ---- variant ");
    s.push_str(&program.name);
    s.push_str(" ----\n");
    s.push_str(
        "// Positions: the kernels' (query row i at i + Sk - Sq, key j at j) plus the\n\
         // call's window (params.win_q, params.win_kv; 0 but in a ring's calls, whose\n\
         // rows carry the sink only where params.win_no_sink is 0).\n",
    );
    s.push_str(&code::<D, _>(&lower::params_struct(&program.layout)).to_string());
    s.push('\n');
    for f in program.functions() {
        s.push_str(&code::<D, _>(&lower::function(program, f)).to_string());
        s.push('\n');
    }
    for site in &program.learnable_sites {
        for f in lower::site_functions(program, site) {
            s.push_str(&code::<D, _>(&f).to_string());
            s.push('\n');
        }
    }
    s.push_str(&learn_functions::<D>(program));
    for f in weights::functions(program.weights) {
        s.push_str(&code::<D, _>(&f).to_string());
    }
    s.push_str(&D::dropout_helpers(program.weights.dropout));
    s
}

#[cfg(test)]
mod tests;
