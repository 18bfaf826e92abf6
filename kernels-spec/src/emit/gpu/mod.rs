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

use self::ast::{BinaryOp, Expr, Func, Function, Literal, Name, ParamsStruct, Stmt, Type, UnaryOp};
use super::Target;
use crate::ir::{Program, TileClass};
use std::fmt::{self, Display, Formatter};
use std::marker::PhantomData;

/// How one C-like target writes the [`ast`]. Every method has the C-like
/// form as its default where there is one; a dialect overrides what differs.
pub trait Dialect: Sized + 'static {
    /// The target this dialect writes.
    const TARGET: Target;
    /// The helper functions the printed code calls (text in the target's
    /// language, every one total).
    const HELPERS: &'static str;

    // ---- types and literals ----

    /// The name of a scalar type.
    fn ty(t: Type) -> &'static str;

    /// A constant (any `f32`, non-finite included).
    fn literal(f: &mut Formatter<'_>, l: Literal) -> fmt::Result;

    /// The declaration of the tile-class constants, one per
    /// [`TileClass::constant`] with its [`TileClass::code`].
    fn tile_class_constant(f: &mut Formatter<'_>, class: TileClass) -> fmt::Result;

    // ---- expressions ----

    /// A name: an argument, a local, or the parameter block.
    fn name(f: &mut Formatter<'_>, n: Name) -> fmt::Result {
        match n {
            Name::Arg(a) => f.write_str(a.name()),
            Name::Local(l) => write!(f, "l{}", l.0),
            Name::Params => f.write_str("params"),
        }
    }

    /// Member `member` of the parameter block.
    fn param(f: &mut Formatter<'_>, member: &str) -> fmt::Result {
        write!(f, "params.{member}")
    }

    /// A prefix operation on a value of type `ty`.
    fn unary(f: &mut Formatter<'_>, op: UnaryOp, ty: Type, a: &dyn Display) -> fmt::Result {
        let _ = ty;
        // The space keeps `- -x` from becoming the `--` token.
        match op {
            UnaryOp::Neg => write!(f, "(- {a})"),
            UnaryOp::Not => write!(f, "(! {a})"),
        }
    }

    /// An infix operation whose operands have type `ty`.
    fn binary(
        f: &mut Formatter<'_>,
        op: BinaryOp,
        ty: Type,
        a: &dyn Display,
        b: &dyn Display,
    ) -> fmt::Result {
        let _ = ty;
        write!(f, "({a} {} {b})", op.symbol())
    }

    /// A call of `func` on arguments of type `ty`.
    fn call(f: &mut Formatter<'_>, func: Func, ty: Type, args: &[&dyn Display]) -> fmt::Result;

    /// A conversion (never the identity; see [`Expr::Cast`]).
    fn cast(f: &mut Formatter<'_>, to: Type, from: Type, value: &dyn Display) -> fmt::Result;

    /// `if cond { then } else { otherwise }`.
    fn select(
        f: &mut Formatter<'_>,
        cond: &dyn Display,
        then: &dyn Display,
        otherwise: &dyn Display,
    ) -> fmt::Result;

    // ---- statements, functions, the parameter block ----

    /// One statement, on its own line, indented one level.
    fn stmt(f: &mut Formatter<'_>, s: &Stmt) -> fmt::Result;

    /// A whole variant function.
    fn function(f: &mut Formatter<'_>, fun: &Function) -> fmt::Result;

    /// The parameter block struct, named `Params`.
    fn params_struct(f: &mut Formatter<'_>, s: &ParamsStruct) -> fmt::Result;
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

impl<D: Dialect> Display for Code<'_, D, Expr> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self.0 {
            Expr::Lit(l) => D::literal(f, *l),
            Expr::Name(n) => D::name(f, *n),
            Expr::Param { member, .. } => D::param(f, member),
            Expr::Unary(op, ty, a) => D::unary(f, *op, *ty, &code::<D, _>(&**a)),
            Expr::Binary(op, ty, a, b) => {
                D::binary(f, *op, *ty, &code::<D, _>(&**a), &code::<D, _>(&**b))
            }
            Expr::Call(func, ty, args) => {
                let printed: Vec<Code<'_, D, Expr>> = args.iter().map(code::<D, _>).collect();
                let args: Vec<&dyn Display> = printed.iter().map(|a| a as &dyn Display).collect();
                D::call(f, *func, *ty, &args)
            }
            Expr::Cast { to, from, value } => D::cast(f, *to, *from, &code::<D, _>(&**value)),
            Expr::Select(c, t, e) => D::select(
                f,
                &code::<D, _>(&**c),
                &code::<D, _>(&**t),
                &code::<D, _>(&**e),
            ),
        }
    }
}

impl<D: Dialect> Display for Code<'_, D, Stmt> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        D::stmt(f, self.0)
    }
}

impl<D: Dialect> Display for Code<'_, D, Function> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        D::function(f, self.0)
    }
}

impl<D: Dialect> Display for Code<'_, D, ParamsStruct> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        D::params_struct(f, self.0)
    }
}

/// The name of `n` as `D` writes it.
pub fn name<D: Dialect>(n: Name) -> impl Display {
    struct Printed<D>(Name, PhantomData<D>);
    impl<D: Dialect> Display for Printed<D> {
        fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
            D::name(f, self.0)
        }
    }
    Printed::<D>(n, PhantomData)
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

/// The section every kernel of dialect `D` is assembled around: the
/// helpers, the parameter block struct and the four variant functions.
pub fn variant_section<D: Dialect>(program: &Program) -> String {
    let mut s = String::from(D::HELPERS);
    s.push_str("\n// ---- variant ");
    s.push_str(&program.name);
    s.push_str(" ----\n");
    s.push_str(&code::<D, _>(&lower::params_struct(&program.layout)).to_string());
    s.push('\n');
    for f in [
        &program.score,
        &program.score_grad,
        &program.mask,
        &program.classify,
    ] {
        s.push_str(&code::<D, _>(&lower::function(program, f)).to_string());
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests;
