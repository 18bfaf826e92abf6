//! A small typed representation of the WGSL the variant lowering produces:
//! scalar types, expressions, statements, functions and structs, each with a
//! `Display` that writes WGSL text. Only what the lowering needs is here; the
//! kernels themselves are text templates (see `kernels.rs`).

use std::fmt;

/// A WGSL scalar type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Type {
    /// `f32`
    F32,
    /// `i32`
    I32,
    /// `u32`
    U32,
    /// `bool`
    Bool,
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Type::F32 => "f32",
            Type::I32 => "i32",
            Type::U32 => "u32",
            Type::Bool => "bool",
        })
    }
}

/// A literal. Non-finite floats have no WGSL literal and are never built
/// here; the lowering calls a helper for them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Literal {
    /// A finite `f32`.
    F32(f32),
    /// An `i32`.
    I32(i32),
    /// A `u32`.
    U32(u32),
    /// A `bool`.
    Bool(bool),
}

impl fmt::Display for Literal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Literal::F32(v) => {
                debug_assert!(v.is_finite(), "non-finite WGSL literal");
                if v.is_sign_negative() {
                    // `{:?}` always has a `.` or an exponent: a float literal.
                    write!(f, "(-{:?}f)", -v)
                } else {
                    write!(f, "{v:?}f")
                }
            }
            // `-2147483648i` would negate an out-of-range literal.
            Literal::I32(i32::MIN) => f.write_str("(-2147483647i - 1i)"),
            Literal::I32(v) if v < 0 => write!(f, "(-{}i)", -v),
            Literal::I32(v) => write!(f, "{v}i"),
            Literal::U32(v) => write!(f, "{v}u"),
            Literal::Bool(v) => write!(f, "{v}"),
        }
    }
}

/// An expression. Every compound form is written fully parenthesized, so
/// precedence never depends on the printer.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// A literal.
    Lit(Literal),
    /// A name: argument, local, or global.
    Ident(String),
    /// `base.member`.
    Member(Box<Expr>, String),
    /// A prefix operator (`-`, `!`).
    Unary(&'static str, Box<Expr>),
    /// An infix operator.
    Binary(&'static str, Box<Expr>, Box<Expr>),
    /// A call of a builtin, a helper, or a type constructor / conversion.
    Call(String, Vec<Expr>),
}

impl Expr {
    /// A name.
    pub fn ident(name: impl Into<String>) -> Expr {
        Expr::Ident(name.into())
    }

    /// A call.
    pub fn call(name: impl Into<String>, args: Vec<Expr>) -> Expr {
        Expr::Call(name.into(), args)
    }

    /// An infix operation.
    pub fn binary(op: &'static str, a: Expr, b: Expr) -> Expr {
        Expr::Binary(op, Box::new(a), Box::new(b))
    }

    /// A prefix operation.
    pub fn unary(op: &'static str, a: Expr) -> Expr {
        Expr::Unary(op, Box::new(a))
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Lit(l) => write!(f, "{l}"),
            Expr::Ident(n) => f.write_str(n),
            Expr::Member(b, m) => write!(f, "{b}.{m}"),
            // The space keeps `- -x` from becoming the `--` token.
            Expr::Unary(op, a) => write!(f, "({op} {a})"),
            Expr::Binary(op, a, b) => write!(f, "({a} {op} {b})"),
            Expr::Call(name, args) => {
                write!(f, "{name}(")?;
                for (i, a) in args.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{a}")?;
                }
                f.write_str(")")
            }
        }
    }
}

/// A statement.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// `let name: ty = value;`
    Let(String, Type, Expr),
    /// `var name: ty = value;` (a variable the compiler cannot const-fold)
    Var(String, Type, Expr),
    /// `if (cond) { then }` with no else.
    If(Expr, Vec<Stmt>),
    /// `return value;`
    Return(Expr),
}

impl Stmt {
    fn write(&self, f: &mut fmt::Formatter<'_>, indent: usize) -> fmt::Result {
        let pad = "    ".repeat(indent);
        match self {
            Stmt::Let(n, t, v) => writeln!(f, "{pad}let {n}: {t} = {v};"),
            Stmt::Var(n, t, v) => writeln!(f, "{pad}var {n}: {t} = {v};"),
            Stmt::If(c, body) => {
                writeln!(f, "{pad}if {c} {{")?;
                for s in body {
                    s.write(f, indent + 1)?;
                }
                writeln!(f, "{pad}}}")
            }
            Stmt::Return(v) => writeln!(f, "{pad}return {v};"),
        }
    }
}

/// A function.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    /// Its name.
    pub name: String,
    /// `(name, type)` of each parameter.
    pub params: Vec<(String, Type)>,
    /// Result type.
    pub ret: Type,
    /// Body.
    pub body: Vec<Stmt>,
}

impl fmt::Display for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fn {}(", self.name)?;
        for (i, (n, t)) in self.params.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{n}: {t}")?;
        }
        writeln!(f, ") -> {} {{", self.ret)?;
        for s in &self.body {
            s.write(f, 1)?;
        }
        writeln!(f, "}}")
    }
}

/// A struct of 4-byte scalar members.
#[derive(Clone, Debug, PartialEq)]
pub struct Struct {
    /// Its name.
    pub name: String,
    /// `(name, type)` of each member.
    pub members: Vec<(String, Type)>,
}

impl fmt::Display for Struct {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "struct {} {{", self.name)?;
        for (n, t) in &self.members {
            writeln!(f, "    {n}: {t},")?;
        }
        writeln!(f, "}}")
    }
}
