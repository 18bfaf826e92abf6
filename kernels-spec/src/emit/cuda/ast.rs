//! A small typed representation of the CUDA C the variant lowering
//! produces: scalar types, expressions, statements, functions and the
//! `Params` struct, each with a `Display` that writes CUDA C text. Only what
//! the lowering needs is here; the kernels are text templates (see
//! `kernels.rs`).

use std::fmt;

/// A CUDA C scalar type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Type {
    /// `float`
    Float,
    /// `int`
    Int,
    /// `unsigned`
    Unsigned,
    /// `bool`
    Bool,
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Type::Float => "float",
            Type::Int => "int",
            Type::Unsigned => "unsigned",
            Type::Bool => "bool",
        })
    }
}

/// A literal. Non-finite floats have no C literal (and NVRTC has no
/// `INFINITY`/`NAN` macros without headers) and are never built here; the
/// lowering writes `__int_as_float` of their bits instead.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Literal {
    /// A finite `float`.
    Float(f32),
    /// An `int`.
    Int(i32),
    /// An `unsigned`.
    Unsigned(u32),
    /// A `bool`.
    Bool(bool),
}

impl fmt::Display for Literal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Literal::Float(v) => {
                debug_assert!(v.is_finite(), "non-finite CUDA literal");
                // `{:?}` always has a `.` or an exponent, so `f` makes it a
                // float literal, and it round-trips the f32 exactly.
                if v.is_sign_negative() {
                    write!(f, "(-{:?}f)", -v)
                } else {
                    write!(f, "{v:?}f")
                }
            }
            // `-2147483648` is the negation of a literal that does not fit.
            Literal::Int(i32::MIN) => f.write_str("(-2147483647 - 1)"),
            Literal::Int(v) if v < 0 => write!(f, "(-{})", -v),
            Literal::Int(v) => write!(f, "{v}"),
            Literal::Unsigned(v) => write!(f, "{v}u"),
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
    /// `cond ? then : otherwise`.
    Ternary(Box<Expr>, Box<Expr>, Box<Expr>),
    /// A C cast `(type)(value)`.
    Cast(Type, Box<Expr>),
    /// A call of an intrinsic or a helper.
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

    /// `c ? t : f`.
    pub fn ternary(c: Expr, t: Expr, f: Expr) -> Expr {
        Expr::Ternary(Box::new(c), Box::new(t), Box::new(f))
    }

    /// `(ty)(value)`.
    pub fn cast(ty: Type, value: Expr) -> Expr {
        Expr::Cast(ty, Box::new(value))
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
            Expr::Ternary(c, t, e) => write!(f, "({c} ? {t} : {e})"),
            Expr::Cast(t, a) => write!(f, "(({t})({a}))"),
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
    /// `(void)name;`: an argument the function does not read.
    Discard(String),
    /// `const ty name = value;`
    Const(String, Type, Expr),
    /// `return value;`
    Return(Expr),
}

impl fmt::Display for Stmt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stmt::Discard(n) => writeln!(f, "    (void){n};"),
            Stmt::Const(n, t, v) => writeln!(f, "    const {t} {n} = {v};"),
            Stmt::Return(v) => writeln!(f, "    return {v};"),
        }
    }
}

/// A `__device__ __forceinline__` function whose first parameter is
/// `const Params& params`.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    /// Its name.
    pub name: String,
    /// `(name, type)` of each parameter after `params`.
    pub params: Vec<(String, Type)>,
    /// Result type.
    pub ret: Type,
    /// Body.
    pub body: Vec<Stmt>,
}

impl fmt::Display for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "__device__ __forceinline__ {} {}(const Params& params",
            self.ret, self.name
        )?;
        for (n, t) in &self.params {
            write!(f, ", {t} {n}")?;
        }
        writeln!(f, ") {{")?;
        for s in &self.body {
            write!(f, "{s}")?;
        }
        writeln!(f, "}}")
    }
}

/// A struct of 4-byte scalar members, some of them arrays.
#[derive(Clone, Debug, PartialEq)]
pub struct Struct {
    /// Its name.
    pub name: String,
    /// `(name, type, array length)` of each member; length `None` for a
    /// scalar.
    pub members: Vec<(String, Type, Option<usize>)>,
}

impl fmt::Display for Struct {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "struct {} {{", self.name)?;
        for (n, t, len) in &self.members {
            match len {
                Some(len) => writeln!(f, "    {t} {n}[{len}];")?,
                None => writeln!(f, "    {t} {n};")?,
            }
        }
        writeln!(f, "}};")
    }
}
