//! The symbolic derivatives of the backward: d score / d s, used by every
//! target, and d f / d (a tensor read) for the reads of learnable tensors.
//!
//! Forward-mode differentiation of the IR with respect to [`Arg::S`] or to
//! the value of one read site: each `let` gets a companion holding its derivative, nonlinear
//! functions bind their value once and reuse it (`tanh'(a) = 1 - t²` with
//! `t = tanh(a)`), and the smart constructors of [`build`] fold constants and
//! identities as the derivative is built, so the identity score gives `1`.
//!
//! Integer-typed values are piecewise constant in `s`: their derivative is 0.
//! At kinks (`abs`, `min`, `max`, `clamp`) the derivative of the branch taken
//! is used, as PyTorch does.

use super::build::{self, add, call, div, le, let_, lt, mul, neg, select, sub};
use crate::ir::{Arg, BinOp, Builtin, Expr, ExprKind, Function, Local, Ty, UnOp};
use std::collections::HashMap;
use std::f64::consts::LN_2;

/// d`score`/d`s` as a function with the score's signature.
pub fn score_grad(score: &Function) -> Function {
    derivative(score, Wrt::S, "score_grad")
}

/// d`f`/d(the value read at `site`), a function with `f`'s signature: what
/// the backward multiplies into the gradient of the element that read
/// landed on (the reads of other sites, and of this site's tensor
/// elsewhere, are constants).
pub fn read_grad(f: &Function, site: u32) -> Function {
    derivative(f, Wrt::Site(site), "read_grad")
}

/// What a derivative is taken with respect to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wrt {
    /// The scaled logit.
    S,
    /// The value of one tensor read.
    Site(u32),
}

fn derivative(f: &Function, wrt: Wrt, name: &'static str) -> Function {
    let mut d = Differentiator {
        wrt,
        derivs: HashMap::new(),
        next: build::next_local(&f.body),
    };
    let body = d.diff(&f.body);
    Function {
        name,
        args: f.args.clone(),
        ret: Ty::F32,
        body: build::simplify(body),
    }
}

struct Differentiator {
    wrt: Wrt,
    /// The local holding each float local's derivative.
    derivs: HashMap<Local, Local>,
    next: u32,
}

impl Differentiator {
    fn fresh(&mut self) -> Local {
        let l = Local(self.next);
        self.next += 1;
        l
    }

    /// `let t = value; f(t)` with a fresh `t`.
    fn bind(&mut self, value: Expr, f: impl FnOnce(Expr) -> Expr) -> Expr {
        let t = self.fresh();
        let ty = value.ty;
        let body = f(Expr::local(t, ty));
        let_(t, value, body)
    }

    /// The derivative of `e` (which is evaluated in the same scope).
    fn diff(&mut self, e: &Expr) -> Expr {
        if e.ty != Ty::F32 {
            // Only the body of a `let` can be non-float here; handle it so
            // float locals inside stay differentiable.
            if let ExprKind::Let(..) = e.kind {
                return self.diff_let(e);
            }
            return Expr::float(0.0);
        }
        match &e.kind {
            // Tensor reads are data, constant in s; the read differentiated
            // against is the variable.
            ExprKind::Read(r) => Expr::float(if self.wrt == Wrt::Site(r.site) {
                1.0
            } else {
                0.0
            }),
            ExprKind::Const(_)
            | ExprKind::Param(_)
            | ExprKind::ReadRange(_)
            | ExprKind::Dim(..) => Expr::float(0.0),
            ExprKind::Arg(a) => Expr::float(if *a == Arg::S && self.wrt == Wrt::S {
                1.0
            } else {
                0.0
            }),
            ExprKind::Local(l) => match self.derivs.get(l) {
                Some(d) => Expr::local(*d, Ty::F32),
                None => Expr::float(0.0),
            },
            ExprKind::Unary(UnOp::Neg, a) => neg(self.diff(a)),
            ExprKind::Unary(UnOp::Not, _) => Expr::float(0.0),
            ExprKind::Binary(op, a, b) => self.diff_binary(*op, a, b),
            ExprKind::Call(f, args) => self.diff_call(*f, args),
            // Conversions into f32 come from integers or bools: constant in s.
            ExprKind::Cast(_) => Expr::float(0.0),
            ExprKind::Select(c, t, f) => {
                let (dt, df) = (self.diff(t), self.diff(f));
                select((**c).clone(), dt, df)
            }
            ExprKind::Let(..) => self.diff_let(e),
        }
    }

    fn diff_let(&mut self, e: &Expr) -> Expr {
        let ExprKind::Let(l, value, body) = &e.kind else {
            unreachable!("diff_let is called on lets")
        };
        if value.ty == Ty::F32 {
            let dl = self.fresh();
            let dvalue = self.diff(value);
            self.derivs.insert(*l, dl);
            let dbody = self.diff(body);
            let_(*l, (**value).clone(), let_(dl, dvalue, dbody))
        } else {
            let dbody = self.diff(body);
            let_(*l, (**value).clone(), dbody)
        }
    }

    fn diff_binary(&mut self, op: BinOp, a: &Expr, b: &Expr) -> Expr {
        let (da, db) = (self.diff(a), self.diff(b));
        let (a, b) = (a.clone(), b.clone());
        match op {
            BinOp::Add => add(da, db),
            BinOp::Sub => sub(da, db),
            BinOp::Mul => add(mul(da, b.clone()), mul(a, db)),
            BinOp::Div if db.is_float(0.0) => div(da, b),
            BinOp::Div => div(sub(mul(da, b.clone()), mul(a, db)), mul(b.clone(), b)),
            // a % b = a - trunc(a / b) * b, and trunc is piecewise constant.
            BinOp::Rem if db.is_float(0.0) => da,
            BinOp::Rem => {
                let quotient = build::cast(build::cast(div(a, b), Ty::I32), Ty::F32);
                sub(da, mul(quotient, db))
            }
            // Comparisons and logic are not float-valued.
            _ => Expr::float(0.0),
        }
    }

    fn diff_call(&mut self, f: Builtin, args: &[Expr]) -> Expr {
        let a = args[0].clone();
        let da = self.diff(&a);
        match f {
            Builtin::Exp => self.bind(call(f, vec![a]), |t| mul(t, da)),
            Builtin::Exp2 => mul(mul(call(f, vec![a]), Expr::float(LN_2)), da),
            Builtin::Log => div(da, a),
            Builtin::Log2 => div(da, mul(a, Expr::float(LN_2))),
            Builtin::Sqrt => self.bind(call(f, vec![a]), |t| div(da, mul(Expr::float(2.0), t))),
            Builtin::Tanh => self.bind(call(f, vec![a]), |t| {
                mul(sub(Expr::float(1.0), mul(t.clone(), t)), da)
            }),
            Builtin::Sin => mul(call(Builtin::Cos, vec![a]), da),
            Builtin::Cos => neg(mul(call(Builtin::Sin, vec![a]), da)),
            // tan' = 1 + tan².
            Builtin::Tan => self.bind(call(f, vec![a]), |t| {
                mul(add(Expr::float(1.0), mul(t.clone(), t)), da)
            }),
            Builtin::Sigmoid => self.bind(call(f, vec![a]), |t| {
                mul(mul(t.clone(), sub(Expr::float(1.0), t)), da)
            }),
            Builtin::Abs => select(lt(a, Expr::float(0.0)), neg(da.clone()), da),
            Builtin::Min => {
                let db = self.diff(&args[1]);
                select(le(a, args[1].clone()), da, db)
            }
            Builtin::Max => {
                let db = self.diff(&args[1]);
                select(le(args[1].clone(), a), da, db)
            }
            Builtin::Clamp => {
                // clamp(x, lo, hi) = min(max(x, lo), hi)
                let (lo, hi) = (args[1].clone(), args[2].clone());
                let (dlo, dhi) = (self.diff(&lo), self.diff(&hi));
                let m = call(Builtin::Max, vec![a.clone(), lo.clone()]);
                let dm = select(le(lo, a), da, dlo);
                select(le(m, hi), dm, dhi)
            }
            Builtin::Floor | Builtin::Ceil => Expr::float(0.0),
            Builtin::SatAdd | Builtin::SatSub | Builtin::SatMul => Expr::float(0.0),
        }
    }
}
