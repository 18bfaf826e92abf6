//! An interpreter of the IR with the targets' f32 semantics. Used to test
//! analyses against brute force (the tile classifier must agree with the mask
//! it was derived from; the derivative with finite differences).

use crate::ir::{Arg, BinOp, Builtin, Const, Expr, ExprKind, Function, Local, Ty, UnOp};
use std::collections::HashMap;

/// A runtime value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    /// An f32.
    F32(f32),
    /// An i32.
    I32(i32),
    /// A u32.
    U32(u32),
    /// A bool.
    Bool(bool),
}

impl Value {
    /// The f32 inside (panics on another type: an interpreter bug).
    pub fn f32(self) -> f32 {
        match self {
            Value::F32(v) => v,
            other => panic!("expected f32, got {other:?}"),
        }
    }
    /// The i32 inside.
    pub fn i32(self) -> i32 {
        match self {
            Value::I32(v) => v,
            other => panic!("expected i32, got {other:?}"),
        }
    }
    /// The bool inside.
    pub fn bool(self) -> bool {
        match self {
            Value::Bool(v) => v,
            other => panic!("expected bool, got {other:?}"),
        }
    }
}

/// Evaluate `f` with argument values in `f.args` order and parameter values
/// in field order.
pub fn call(f: &Function, args: &[Value], params: &[Value]) -> Value {
    assert_eq!(args.len(), f.args.len(), "argument count of {}", f.name);
    let mut env = Env {
        args: f.args.iter().copied().zip(args.iter().copied()).collect(),
        params,
        locals: HashMap::new(),
    };
    env.eval(&f.body)
}

struct Env<'a> {
    args: HashMap<Arg, Value>,
    params: &'a [Value],
    locals: HashMap<Local, Value>,
}

impl Env<'_> {
    fn eval(&mut self, e: &Expr) -> Value {
        match &e.kind {
            ExprKind::Const(Const::Float(v)) => Value::F32(*v as f32),
            ExprKind::Const(Const::Int(v)) => match e.ty {
                Ty::U32 => Value::U32(*v as u32),
                _ => Value::I32(*v as i32),
            },
            ExprKind::Const(Const::Bool(b)) => Value::Bool(*b),
            ExprKind::Arg(a) => self.args[a],
            ExprKind::Param(i) => self.params[*i],
            ExprKind::Local(l) => self.locals[l],
            ExprKind::Unary(op, a) => match (op, self.eval(a)) {
                (UnOp::Neg, Value::F32(x)) => Value::F32(-x),
                (UnOp::Neg, Value::I32(x)) => Value::I32(x.wrapping_neg()),
                (UnOp::Not, Value::Bool(x)) => Value::Bool(!x),
                (op, v) => panic!("ill-typed {op:?} {v:?}"),
            },
            ExprKind::Binary(op, a, b) => {
                let (x, y) = (self.eval(a), self.eval(b));
                binary(*op, x, y)
            }
            ExprKind::Call(f, args) => {
                let vals: Vec<Value> = args.iter().map(|a| self.eval(a)).collect();
                builtin(*f, &vals)
            }
            ExprKind::Cast(a) => cast(self.eval(a), e.ty),
            ExprKind::Select(c, t, f) => {
                if self.eval(c).bool() {
                    self.eval(t)
                } else {
                    self.eval(f)
                }
            }
            ExprKind::Let(l, v, body) => {
                let v = self.eval(v);
                self.locals.insert(*l, v);
                self.eval(body)
            }
        }
    }
}

fn binary(op: BinOp, x: Value, y: Value) -> Value {
    use Value::*;
    match (x, y) {
        (F32(a), F32(b)) => match op {
            BinOp::Add => F32(a + b),
            BinOp::Sub => F32(a - b),
            BinOp::Mul => F32(a * b),
            BinOp::Div => F32(a / b),
            BinOp::Rem => F32(a % b),
            _ => Bool(compare(op, a.partial_cmp(&b))),
        },
        (I32(a), I32(b)) => match op {
            BinOp::Add => I32(a.wrapping_add(b)),
            BinOp::Sub => I32(a.wrapping_sub(b)),
            BinOp::Mul => I32(a.wrapping_mul(b)),
            BinOp::Div => I32(if b == 0 { 0 } else { a.wrapping_div(b) }),
            BinOp::Rem => I32(if b == 0 { 0 } else { a.wrapping_rem(b) }),
            _ => Bool(compare(op, Some(a.cmp(&b)))),
        },
        (U32(a), U32(b)) => match op {
            BinOp::Add => U32(a.wrapping_add(b)),
            BinOp::Sub => U32(a.wrapping_sub(b)),
            BinOp::Mul => U32(a.wrapping_mul(b)),
            BinOp::Div => U32(a.checked_div(b).unwrap_or(0)),
            BinOp::Rem => U32(a.checked_rem(b).unwrap_or(0)),
            _ => Bool(compare(op, Some(a.cmp(&b)))),
        },
        (Bool(a), Bool(b)) => Bool(match op {
            BinOp::And => a && b,
            BinOp::Or => a || b,
            BinOp::Eq => a == b,
            BinOp::Ne => a != b,
            _ => panic!("ill-typed {op:?} on bool"),
        }),
        (x, y) => panic!("ill-typed {op:?} {x:?} {y:?}"),
    }
}

fn compare(op: BinOp, ord: Option<std::cmp::Ordering>) -> bool {
    use std::cmp::Ordering::*;
    match (op, ord) {
        (_, None) => op == BinOp::Ne,
        (BinOp::Eq, Some(o)) => o == Equal,
        (BinOp::Ne, Some(o)) => o != Equal,
        (BinOp::Lt, Some(o)) => o == Less,
        (BinOp::Le, Some(o)) => o != Greater,
        (BinOp::Gt, Some(o)) => o == Greater,
        (BinOp::Ge, Some(o)) => o != Less,
        _ => unreachable!("not a comparison"),
    }
}

fn builtin(f: Builtin, v: &[Value]) -> Value {
    use Value::*;
    match (f, v) {
        (Builtin::Exp, [F32(x)]) => F32(x.exp()),
        (Builtin::Exp2, [F32(x)]) => F32(x.exp2()),
        (Builtin::Log, [F32(x)]) => F32(x.ln()),
        (Builtin::Log2, [F32(x)]) => F32(x.log2()),
        (Builtin::Sqrt, [F32(x)]) => F32(x.sqrt()),
        (Builtin::Tanh, [F32(x)]) => F32(x.tanh()),
        (Builtin::Sigmoid, [F32(x)]) => F32(1.0 / (1.0 + (-x).exp())),
        (Builtin::Floor, [F32(x)]) => F32(x.floor()),
        (Builtin::Ceil, [F32(x)]) => F32(x.ceil()),
        (Builtin::Abs, [F32(x)]) => F32(x.abs()),
        (Builtin::Abs, [I32(x)]) => I32(x.wrapping_abs()),
        (Builtin::Abs, [U32(x)]) => U32(*x),
        (Builtin::Min, [F32(a), F32(b)]) => F32(a.min(*b)),
        (Builtin::Max, [F32(a), F32(b)]) => F32(a.max(*b)),
        (Builtin::Min, [I32(a), I32(b)]) => I32(*a.min(b)),
        (Builtin::Max, [I32(a), I32(b)]) => I32(*a.max(b)),
        (Builtin::Min, [U32(a), U32(b)]) => U32(*a.min(b)),
        (Builtin::Max, [U32(a), U32(b)]) => U32(*a.max(b)),
        (Builtin::Clamp, [x, lo, hi]) => {
            let m = builtin(Builtin::Max, &[*x, *lo]);
            builtin(Builtin::Min, &[m, *hi])
        }
        (Builtin::SatAdd, [I32(a), I32(b)]) => I32(a.saturating_add(*b)),
        (Builtin::SatSub, [I32(a), I32(b)]) => I32(a.saturating_sub(*b)),
        (Builtin::SatMul, [I32(a), I32(b)]) => I32(a.saturating_mul(*b)),
        (f, v) => panic!("ill-typed call {f:?} {v:?}"),
    }
}

fn cast(v: Value, to: Ty) -> Value {
    use Value::*;
    match (v, to) {
        (F32(x), Ty::F32) => F32(x),
        (F32(x), Ty::I32) => I32(x as i32),
        (F32(x), Ty::U32) => U32(x as u32),
        (I32(x), Ty::F32) => F32(x as f32),
        (I32(x), Ty::I32) => I32(x),
        (I32(x), Ty::U32) => U32(x as u32),
        (U32(x), Ty::F32) => F32(x as f32),
        (U32(x), Ty::I32) => I32(x as i32),
        (U32(x), Ty::U32) => U32(x),
        (Bool(x), Ty::I32) => I32(x.into()),
        (Bool(x), Ty::U32) => U32(x.into()),
        (Bool(x), Ty::Bool) => Bool(x),
        (v, t) => panic!("ill-typed cast {v:?} as {t}"),
    }
}
