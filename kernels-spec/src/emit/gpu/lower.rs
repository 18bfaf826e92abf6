//! IR → [`ast`](super::ast): the one walk over the variant functions that
//! every C-like GPU dialect shares.
//!
//! - Every closed sub-expression (no argument, parameter, or local bound to
//!   a runtime value) is folded here with [`crate::eval`], with the IR's
//!   semantics, so what remains depends on a runtime value. (WGSL needs it:
//!   a constant expression that overflows or is non-finite is a
//!   shader-creation error; CUDA gets the same text for free.)
//! - `let` has no expression form in C-like languages: bindings become
//!   immutable locals before the `return`. Hoisting them out of `if`/`else`
//!   arms is sound because every IR expression is pure and total.
//! - `clamp(x, lo, hi)` becomes `min(max(x, lo), hi)` (never panics, even if
//!   `lo > hi`), `abs` of a `u32` the value itself, a `bool` parameter
//!   `word != 0`.
//! - Arguments (and the parameter block) that a function does not read are
//!   still taken, so every variant function of a kind has the same
//!   signature; they are listed as [`Stmt::Unused`].

use super::ast::{BinaryOp, Expr, Func, Function, Literal, Member, Name, ParamsStruct, Stmt, Type};
use crate::eval::{self, Value};
use crate::ir::{self, Builtin, Const, ExprKind, Local, Program, Ty, UnOp};
use crate::params::ParamLayout;

/// The name of a variant function in every target (`score` →
/// `variant_score`).
pub fn function_name(f: &ir::Function) -> String {
    format!("variant_{}", f.name)
}

/// The parameter block struct of a layout.
pub fn params_struct(layout: &ParamLayout) -> ParamsStruct {
    ParamsStruct {
        members: layout
            .slots()
            .iter()
            .map(|s| Member {
                name: s.member(),
                ty: s.storage().into(),
            })
            .collect(),
        padding_words: layout.padding_words(),
    }
}

/// Lower one IR function of `program`.
pub fn function(program: &Program, f: &ir::Function) -> Function {
    let mut cx = Lowering {
        program,
        stmts: Vec::new(),
        closed_locals: Vec::new(),
    };
    let mut reads_params = false;
    f.body
        .walk(&mut |e| reads_params |= matches!(e.kind, ExprKind::Param(_)));
    if !reads_params {
        cx.stmts.push(Stmt::Unused(Name::Params));
    }
    for a in &f.args {
        if !f.body.uses_arg(*a) {
            cx.stmts.push(Stmt::Unused(Name::Arg(*a)));
        }
    }
    let value = cx.expr(&f.body);
    cx.stmts.push(Stmt::Return(value));
    Function {
        name: function_name(f),
        args: f.args.iter().map(|a| (*a, a.ty().into())).collect(),
        ret: f.ret.into(),
        body: cx.stmts,
    }
}

struct Lowering<'a> {
    program: &'a Program,
    stmts: Vec<Stmt>,
    /// Locals bound to closed values, in binding order, for folding.
    closed_locals: Vec<(Local, ir::Expr)>,
}

fn literal(v: Value) -> Expr {
    Expr::Lit(match v {
        Value::F32(x) => Literal::F32(x),
        Value::I32(x) => Literal::I32(x),
        Value::U32(x) => Literal::U32(x),
        Value::Bool(x) => Literal::Bool(x),
    })
}

fn call(f: Func, ty: Type, args: Vec<Expr>) -> Expr {
    Expr::Call(f, ty, args)
}

impl Lowering<'_> {
    /// Whether `e` reads no argument, parameter, or local bound to a
    /// runtime value.
    fn is_closed(&self, e: &ir::Expr) -> bool {
        let mut bound: Vec<Local> = Vec::new();
        e.walk(&mut |x| {
            if let ExprKind::Let(l, _, _) = x.kind {
                bound.push(l);
            }
        });
        let mut closed = true;
        e.walk(&mut |x| match x.kind {
            ExprKind::Arg(_) | ExprKind::Param(_) => closed = false,
            ExprKind::Local(l) => {
                closed &= bound.contains(&l) || self.closed_locals.iter().any(|(c, _)| *c == l)
            }
            _ => {}
        });
        closed
    }

    /// The value of a closed expression, with the IR's semantics.
    fn fold(&self, e: &ir::Expr) -> Value {
        let mut body = e.clone();
        for (l, v) in self.closed_locals.iter().rev() {
            body = ir::Expr {
                ty: body.ty,
                kind: ExprKind::Let(*l, Box::new(v.clone()), Box::new(body)),
            };
        }
        let f = ir::Function {
            name: "const",
            args: Vec::new(),
            ret: e.ty,
            body,
        };
        eval::call(&f, &[], &[])
    }

    fn expr(&mut self, e: &ir::Expr) -> Expr {
        let ty = Type::from(e.ty);
        match &e.kind {
            ExprKind::Const(c) => Expr::Lit(match (*c, e.ty) {
                (Const::Float(v), _) => Literal::F32(v as f32),
                (Const::Int(v), Ty::U32) => Literal::U32(v as u32),
                (Const::Int(v), _) => Literal::I32(v as i32),
                (Const::Bool(b), _) => Literal::Bool(b),
            }),
            ExprKind::Arg(a) => Expr::Name(Name::Arg(*a)),
            ExprKind::Param(i) => {
                let slot = &self.program.layout.slots()[*i];
                let word = Expr::Param {
                    member: slot.member(),
                    ty: slot.storage().into(),
                };
                if slot.ty == Ty::Bool {
                    let zero = Expr::Lit(Literal::U32(0));
                    Expr::Binary(BinaryOp::Ne, Type::U32, Box::new(word), Box::new(zero))
                } else {
                    word
                }
            }
            ExprKind::Local(l) => Expr::Name(Name::Local(*l)),
            _ if self.is_closed(e) => literal(self.fold(e)),
            ExprKind::Unary(op, a) => {
                let op = match op {
                    UnOp::Neg => super::ast::UnaryOp::Neg,
                    UnOp::Not => super::ast::UnaryOp::Not,
                };
                Expr::Unary(op, ty, Box::new(self.expr(a)))
            }
            ExprKind::Binary(op, a, b) => {
                let operands = a.ty.into();
                let (x, y) = (self.expr(a), self.expr(b));
                Expr::Binary(*op, operands, Box::new(x), Box::new(y))
            }
            ExprKind::Call(f, args) => {
                let arg_ty = args[0].ty;
                let mut a: Vec<Expr> = args.iter().map(|x| self.expr(x)).collect();
                let t = Type::from(arg_ty);
                let f = match f {
                    Builtin::Exp => Func::Exp,
                    Builtin::Exp2 => Func::Exp2,
                    Builtin::Log => Func::Log,
                    Builtin::Log2 => Func::Log2,
                    Builtin::Sqrt => Func::Sqrt,
                    Builtin::Floor => Func::Floor,
                    Builtin::Ceil => Func::Ceil,
                    Builtin::Tanh => Func::Tanh,
                    Builtin::Sigmoid => Func::Sigmoid,
                    Builtin::Abs if arg_ty == Ty::U32 => return a.remove(0),
                    Builtin::Abs => Func::Abs,
                    Builtin::Min => Func::Min,
                    Builtin::Max => Func::Max,
                    Builtin::Clamp => {
                        let hi = a.pop().expect("clamp takes three arguments");
                        return call(Func::Min, t, vec![call(Func::Max, t, a), hi]);
                    }
                    Builtin::SatAdd => Func::SatAdd,
                    Builtin::SatSub => Func::SatSub,
                    Builtin::SatMul => Func::SatMul,
                };
                call(f, t, a)
            }
            ExprKind::Cast(a) => {
                let value = self.expr(a);
                if a.ty == e.ty {
                    return value;
                }
                Expr::Cast {
                    to: ty,
                    from: a.ty.into(),
                    value: Box::new(value),
                }
            }
            ExprKind::Select(c, t, f) => {
                let (c, t, f) = (self.expr(c), self.expr(t), self.expr(f));
                Expr::Select(Box::new(c), Box::new(t), Box::new(f))
            }
            ExprKind::Let(l, v, body) => {
                let value = self.expr(v);
                self.stmts.push(Stmt::Let(*l, v.ty.into(), value));
                if self.is_closed(v) {
                    self.closed_locals.push((*l, (**v).clone()));
                }
                self.expr(body)
            }
        }
    }
}
