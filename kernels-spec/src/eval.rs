//! An interpreter of the IR with the targets' f32 semantics. Used to test
//! analyses against brute force (the tile classifier must agree with the mask
//! it was derived from; the derivative with finite differences), and to fold
//! constants.
//!
//! Range reads ([`ExprKind::ReadRange`]) give the exact least or greatest
//! element, the tightest of the bounds a target may return.

use crate::ir::{
    Arg, BinOp, Builtin, Const, Expr, ExprKind, Function, Local, Read, ReadRange, Ty, UnOp,
};
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

/// A captured tensor's value: its shape and its elements, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorValue {
    /// Its dimensions.
    pub dims: Vec<usize>,
    /// Its elements (of the declared element type).
    pub data: Vec<Value>,
}

impl TensorValue {
    /// The linear position of `index`, if it is inside the tensor.
    fn position(&self, index: &[i64]) -> Option<usize> {
        let mut at = 0usize;
        for (&i, &d) in index.iter().zip(&self.dims) {
            if i < 0 || i as u64 >= d as u64 {
                return None;
            }
            at = at * d + i as usize;
        }
        Some(at)
    }
}

/// The first read whose index was out of range, if any: its site and its
/// index.
pub type OutOfRange = Option<(u32, Vec<i64>)>;

/// Evaluate `f` with argument values in `f.args` order and parameter values
/// in field order (a variant without tensors).
pub fn call(f: &Function, args: &[Value], params: &[Value]) -> Value {
    call_with(f, args, params, &[]).0
}

/// [`call`] with the values of the captured tensors; also returns the first
/// read out of range (which read nothing and gave a zero of its type).
pub fn call_with(
    f: &Function,
    args: &[Value],
    params: &[Value],
    tensors: &[TensorValue],
) -> (Value, OutOfRange) {
    assert_eq!(args.len(), f.args.len(), "argument count of {}", f.name);
    let mut env = Env {
        args: f.args.iter().copied().zip(args.iter().copied()).collect(),
        params,
        tensors,
        locals: HashMap::new(),
        out_of_range: None,
    };
    let v = env.eval(&f.body);
    (v, env.out_of_range)
}

struct Env<'a> {
    args: HashMap<Arg, Value>,
    params: &'a [Value],
    tensors: &'a [TensorValue],
    locals: HashMap<Local, Value>,
    out_of_range: OutOfRange,
}

fn index_value(v: Value) -> i64 {
    match v {
        Value::I32(x) => x.into(),
        Value::U32(x) => x.into(),
        other => panic!("ill-typed index {other:?}"),
    }
}

fn zero(ty: Ty) -> Value {
    match ty {
        Ty::F32 => Value::F32(0.0),
        Ty::I32 => Value::I32(0),
        Ty::U32 => Value::U32(0),
        Ty::Bool => Value::Bool(false),
    }
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
            // The right operand only when it decides the value.
            ExprKind::Binary(BinOp::And, a, b) => {
                Value::Bool(self.eval(a).bool() && self.eval(b).bool())
            }
            ExprKind::Binary(BinOp::Or, a, b) => {
                Value::Bool(self.eval(a).bool() || self.eval(b).bool())
            }
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
            ExprKind::Read(r) => self.read(r, e.ty),
            ExprKind::ReadRange(r) => self.range(r),
            ExprKind::Dim(t, axis) => Value::I32(self.tensors[*t].dims[*axis] as i32),
        }
    }

    fn read(&mut self, r: &Read, ty: Ty) -> Value {
        let index: Vec<i64> = r
            .indices
            .iter()
            .map(|i| index_value(self.eval(i)))
            .collect();
        let t = &self.tensors[r.tensor];
        match t.position(&index) {
            Some(at) => t.data[at],
            None => {
                self.out_of_range.get_or_insert((r.site, index));
                zero(ty)
            }
        }
    }

    fn range(&mut self, r: &ReadRange) -> Value {
        let mut index: Vec<i64> = r
            .indices
            .iter()
            .map(|i| index_value(self.eval(i)))
            .collect();
        let extreme = Value::I32(if r.max { i32::MAX } else { i32::MIN });
        let t = &self.tensors[r.tensor];
        let (lo, hi) = match r.axis {
            None => (0, 0),
            Some(a) => (index[a], index_value(self.eval(&r.hi))),
        };
        let mut best: Option<i32> = None;
        for i in lo..=hi {
            if let Some(a) = r.axis {
                index[a] = i;
            }
            let Some(at) = t.position(&index) else {
                return extreme;
            };
            let v = t.data[at].i32();
            best = Some(match best {
                None => v,
                Some(b) if r.max => b.max(v),
                Some(b) => b.min(v),
            });
        }
        best.map_or(extreme, Value::I32)
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
        (Builtin::Sin, [F32(x)]) => F32(x.sin()),
        (Builtin::Cos, [F32(x)]) => F32(x.cos()),
        (Builtin::Tan, [F32(x)]) => F32(x.tan()),
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
