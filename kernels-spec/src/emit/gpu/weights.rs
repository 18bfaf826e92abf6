//! The row normalisation ([`Weights`]) lowered once for every C-like GPU
//! dialect: the functions the kernel templates call where a row's scores
//! become weights, so that no template tests which normalisation it runs.
//!
//! | function | softmax | sigmoid |
//! |---|---|---|
//! | `weights_start(sink)`: a row's running sum before any key (its running max starts at `sink`, `-inf` without one) | `0` for no sink, else `1` | `0` |
//! | `weights_rescale(m_old, m_new)`: what the running sum and output are multiplied by when the max moves | `e^(m_old − m_new)`, `1` while nothing is visible | `1` |
//! | `weights_pair(s, m)`: a pair's unnormalised weight, `s` its score (`-inf` hidden), `m` its row's running max | `e^(s − m)`, `0` while nothing is visible | `sigmoid(s)`, `0` hidden |
//! | `weights_scale(l)`: what a finished row's output is multiplied by, `l` its running sum | `1/l`, `0` for an empty row | `1` |
//! | `weights_lse(m, l)`: a finished row's lse | `m + ln l`, `-inf` for an empty row | `0` |
//! | `weights_merge(lse, m)`: a partial row's weight in a merge, `m` the largest partial lse | `e^(lse − m)`, `0` when every part is empty | `1` |
//! | `weights_prob(s, lse)`: a visible pair's weight in the backward | `e^(s − lse)` | `sigmoid(s)` |
//! | `weights_dz(p, dpz, delta)`: `d loss / d score` of a pair of weight `p`, `dpz = d loss / d P` (its dropout factor included), `delta` its row's `D_i` | `p (dpz − delta)` | `p (1 − p) dpz` |
//!
//! A merge is `out = Σ_s out_s · weights_merge(lse_s, m) · weights_scale(l)`
//! with `l` the sum of the weights, and `lse = weights_lse(m, l)`: the same
//! finish as a row's. Dropout is not here: a pair's factor is
//! `variant_dropout`, 1 without `dropout`, on the weight `P·V` uses and never
//! on the running sum.
//!
//! Every function is total and pure, takes no parameter block, and is
//! printed by the dialect like the variant's own functions (CUDA's float
//! operations are `__f*_rn`, never contracted, so a weight recomputed in the
//! backward is bitwise the forward's).

use super::ast::{BinaryOp, Expr, Func, Function, Literal, Name, Stmt, Type};
use crate::ir::{Normalize, Weights};

/// The functions of `weights`, in the order of the table above.
pub fn functions(weights: Weights) -> Vec<Function> {
    let sigmoid = weights.normalize == Normalize::Sigmoid;
    let softmax_or = |softmax: Expr, sigmoid_value: Expr| {
        if sigmoid { sigmoid_value } else { softmax }
    };
    let (s, m, l, lse) = (var("s"), var("m"), var("l"), var("lse"));
    let exp_minus = |a: Expr, b: Expr| call(Func::Exp, vec![sub(a, b)]);
    vec![
        function(
            "weights_start",
            &["sink"],
            softmax_or(select(neg_inf(var("sink")), lit(0.0), lit(1.0)), lit(0.0)),
        ),
        function(
            "weights_rescale",
            &["m_old", "m_new"],
            softmax_or(
                select(
                    neg_inf(var("m_new")),
                    lit(1.0),
                    exp_minus(var("m_old"), var("m_new")),
                ),
                lit(1.0),
            ),
        ),
        function(
            "weights_pair",
            &["s", "m"],
            softmax_or(
                select(
                    neg_inf(m.clone()),
                    lit(0.0),
                    exp_minus(s.clone(), m.clone()),
                ),
                select(
                    neg_inf(s.clone()),
                    lit(0.0),
                    call(Func::Sigmoid, vec![s.clone()]),
                ),
            ),
        ),
        function(
            "weights_scale",
            &["l"],
            softmax_or(
                select(
                    binary(BinaryOp::Gt, l.clone(), lit(0.0)),
                    binary(BinaryOp::Div, lit(1.0), l.clone()),
                    lit(0.0),
                ),
                lit(1.0),
            ),
        ),
        function(
            "weights_lse",
            &["m", "l"],
            softmax_or(
                select(
                    binary(BinaryOp::Gt, l.clone(), lit(0.0)),
                    binary(BinaryOp::Add, m.clone(), call(Func::Log, vec![l])),
                    lit(f32::NEG_INFINITY),
                ),
                lit(0.0),
            ),
        ),
        function(
            "weights_merge",
            &["lse", "m"],
            softmax_or(
                select(neg_inf(m.clone()), lit(0.0), exp_minus(lse.clone(), m)),
                lit(1.0),
            ),
        ),
        function(
            "weights_prob",
            &["s", "lse"],
            softmax_or(exp_minus(s.clone(), lse), call(Func::Sigmoid, vec![s])),
        ),
        function("weights_dz", &["p", "dpz", "delta"], {
            let p = var("p");
            softmax_or(
                binary(BinaryOp::Mul, p.clone(), sub(var("dpz"), var("delta"))),
                binary(
                    BinaryOp::Mul,
                    binary(BinaryOp::Mul, p.clone(), sub(lit(1.0), p)),
                    var("dpz"),
                ),
            )
        }),
    ]
}

/// An `f32` function `name(args) -> f32` returning `body`; arguments it
/// does not read are listed as unused.
fn function(name: &str, args: &[&'static str], body: Expr) -> Function {
    let mut stmts: Vec<Stmt> = args
        .iter()
        .filter(|a| !reads(&body, a))
        .map(|a| Stmt::Unused(Name::Var(a)))
        .collect();
    stmts.push(Stmt::Return(body));
    Function {
        name: name.to_string(),
        args: args.iter().map(|a| (Name::Var(a), Type::F32)).collect(),
        block: false,
        seen: false,
        ret: Type::F32,
        body: stmts,
    }
}

/// Whether `e` reads the argument `name`.
fn reads(e: &Expr, name: &str) -> bool {
    match e {
        Expr::Name(Name::Var(n)) => *n == name,
        Expr::Unary(_, _, a) | Expr::NegInf(a) => reads(a, name),
        Expr::Binary(_, _, a, b) => reads(a, name) || reads(b, name),
        Expr::Call(_, _, args) => args.iter().any(|a| reads(a, name)),
        Expr::Select(c, t, f) => reads(c, name) || reads(t, name) || reads(f, name),
        _ => false,
    }
}

fn var(name: &'static str) -> Expr {
    Expr::Name(Name::Var(name))
}

fn lit(v: f32) -> Expr {
    Expr::Lit(Literal::F32(v))
}

fn binary(op: BinaryOp, a: Expr, b: Expr) -> Expr {
    Expr::Binary(op, Type::F32, Box::new(a), Box::new(b))
}

fn sub(a: Expr, b: Expr) -> Expr {
    binary(BinaryOp::Sub, a, b)
}

fn call(f: Func, args: Vec<Expr>) -> Expr {
    Expr::Call(f, Type::F32, args)
}

fn select(cond: Expr, then: Expr, otherwise: Expr) -> Expr {
    Expr::Select(Box::new(cond), Box::new(then), Box::new(otherwise))
}

fn neg_inf(x: Expr) -> Expr {
    Expr::NegInf(Box::new(x))
}
