//! IR → the WGSL representation of [`super::ast`], for the four variant
//! functions, plus the helpers that give WGSL the IR's semantics.
//!
//! Where WGSL differs from the IR (see [`crate::ir`]):
//! - integer `/` by zero gives `x` in WGSL (0 in the IR): `bx_div_*`/`bx_rem_*`;
//! - float → int conversion is implementation-defined out of range and for
//!   NaN: `bx_f32_to_*` saturate with NaN → 0, testing NaN on the bits (WGSL
//!   implementations may assume no NaN in float comparisons);
//! - float `min`/`max` with a NaN operand is implementation-defined (Rust
//!   returns the other operand): `bx_min_f32`/`bx_max_f32`;
//! - `tanh` is imprecise near 0 and overflows to NaN for large |x| on some
//!   backends: `bx_tanh`;
//! - no i64 for the saturating classifier ops: overflow checks in u32;
//! - no literal for ±inf/NaN, and a constant expression that overflows or
//!   gives a non-finite float is a shader-creation error. So every closed
//!   sub-expression (no argument or parameter) is folded here with
//!   [`crate::eval`], and non-finite results come from helpers that read a
//!   `var` (never constant-folded). What remains in the text depends on a
//!   runtime value, where `+ - *` wrap as the IR requires.
//!
//! `let` has no expression form in WGSL: bindings become `let` statements
//! before the `return`. Hoisting them out of `if`/`else` arms is sound because
//! every IR expression is pure and, with the helpers, total.

use super::ast::{Expr, Function, Literal, Stmt, Struct, Type};
use crate::eval::{self, Value};
use crate::ir::{self, Arg, BinOp, Builtin, Const, ExprKind, Local, Program, Ty, UnOp};

/// Helpers the lowered functions call. Every one is total.
pub const HELPERS: &str = r#"// ---- IR semantics helpers ----
fn bx_inf() -> f32 {
    var bits: u32 = 0x7f800000u; // a var: never constant-folded
    return bitcast<f32>(bits);
}
fn bx_nan() -> f32 {
    var bits: u32 = 0x7fc00000u;
    return bitcast<f32>(bits);
}
fn bx_is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}
fn bx_is_neg_inf(x: f32) -> bool {
    return bitcast<u32>(x) == 0xff800000u;
}
fn bx_div_i32(a: i32, b: i32) -> i32 {
    if b == 0i { return 0i; }
    if b == -1i { return bitcast<i32>(0u - bitcast<u32>(a)); } // i32::MIN / -1 wraps
    return a / b;
}
fn bx_rem_i32(a: i32, b: i32) -> i32 {
    if b == 0i || b == -1i { return 0i; }
    return a % b;
}
fn bx_div_u32(a: u32, b: u32) -> u32 {
    if b == 0u { return 0u; }
    return a / b;
}
fn bx_rem_u32(a: u32, b: u32) -> u32 {
    if b == 0u { return 0u; }
    return a % b;
}
fn bx_f32_to_i32(x: f32) -> i32 {
    if bx_is_nan(x) { return 0i; }
    if x >= 2147483648.0f { return 2147483647i; }
    if x < -2147483648.0f { return -2147483647i - 1i; }
    return i32(x);
}
fn bx_f32_to_u32(x: f32) -> u32 {
    if bx_is_nan(x) || x < 1.0f { return 0u; }
    if x >= 4294967296.0f { return 4294967295u; }
    return u32(x);
}
fn bx_min_f32(a: f32, b: f32) -> f32 {
    if bx_is_nan(a) { return b; }
    if bx_is_nan(b) { return a; }
    return min(a, b);
}
fn bx_max_f32(a: f32, b: f32) -> f32 {
    if bx_is_nan(a) { return b; }
    if bx_is_nan(b) { return a; }
    return max(a, b);
}
fn bx_tanh(x: f32) -> f32 {
    // Not the builtin: implementations may form it as (e^2x - 1)/(e^2x + 1),
    // which loses all relative precision near 0 and overflows to NaN for
    // large |x|. Below |x| = 0.625 an odd polynomial (Cephes tanhf), above
    // (1 - t)/(1 + t) with t = e^(-2|x|) <= 0.29 (exactly 1 once t underflows).
    if bx_is_nan(x) { return x; }
    let a = abs(x);
    let z = x * x;
    var p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    if a < 0.625f { return x + x * z * p; }
    let t = exp(-2.0f * a);
    return sign(x) * ((1.0f - t) / (1.0f + t));
}
fn bx_sat_add(a: i32, b: i32) -> i32 {
    let r = bitcast<i32>(bitcast<u32>(a) + bitcast<u32>(b));
    if (a >= 0i) == (b >= 0i) && (r >= 0i) != (a >= 0i) {
        return select(-2147483647i - 1i, 2147483647i, a >= 0i);
    }
    return r;
}
fn bx_sat_sub(a: i32, b: i32) -> i32 {
    let r = bitcast<i32>(bitcast<u32>(a) - bitcast<u32>(b));
    if (a >= 0i) != (b >= 0i) && (r >= 0i) != (a >= 0i) {
        return select(-2147483647i - 1i, 2147483647i, a >= 0i);
    }
    return r;
}
fn bx_sat_mul(a: i32, b: i32) -> i32 {
    if a == 0i || b == 0i { return 0i; }
    let neg = (a < 0i) != (b < 0i);
    // Magnitudes in u32 (|i32::MIN| = 2^31 fits); overflow iff |a|·|b| > limit.
    let ua = select(bitcast<u32>(a), 0u - bitcast<u32>(a), a < 0i);
    let ub = select(bitcast<u32>(b), 0u - bitcast<u32>(b), b < 0i);
    let limit = select(2147483647u, 2147483648u, neg);
    if ua > limit / ub {
        return select(2147483647i, -2147483647i - 1i, neg);
    }
    let p = ua * ub;
    return bitcast<i32>(select(p, 0u - p, neg));
}
"#;

/// The WGSL type of an IR type.
pub fn ty(t: Ty) -> Type {
    match t {
        Ty::F32 => Type::F32,
        Ty::I32 => Type::I32,
        Ty::U32 => Type::U32,
        Ty::Bool => Type::Bool,
    }
}

/// The WGSL name of a variant function (`score` → `variant_score`).
pub fn function_name(f: &ir::Function) -> String {
    format!("variant_{}", f.name)
}

/// The uniform member holding parameter `name`.
fn member_name(name: &str) -> String {
    format!("p_{name}")
}

/// The `Params` uniform struct: one 4-byte member per parameter (bool as
/// u32, since uniforms cannot hold bool), padded to a multiple of 16 bytes
/// (and never empty, which WGSL forbids).
pub fn params_struct(program: &Program) -> Struct {
    let mut members: Vec<(String, Type)> = program
        .params
        .iter()
        .map(|p| {
            let t = if p.ty == Ty::Bool {
                Type::U32
            } else {
                ty(p.ty)
            };
            (member_name(&p.name), t)
        })
        .collect();
    let mut pad = 0;
    while members.is_empty() || !members.len().is_multiple_of(4) {
        members.push((format!("pad_{pad}"), Type::U32));
        pad += 1;
    }
    Struct {
        name: "Params".into(),
        members,
    }
}

/// Lower one IR function.
pub fn function(program: &Program, f: &ir::Function) -> Function {
    let mut cx = Lowering {
        program,
        stmts: Vec::new(),
        closed_locals: Vec::new(),
    };
    let value = cx.expr(&f.body);
    cx.stmts.push(Stmt::Return(value));
    Function {
        name: function_name(f),
        params: f
            .args
            .iter()
            .map(|a| (a.name().into(), ty(a.ty())))
            .collect(),
        ret: ty(f.ret),
        body: cx.stmts,
    }
}

struct Lowering<'a> {
    program: &'a Program,
    stmts: Vec<Stmt>,
    /// Locals bound to closed values, in binding order, for folding.
    closed_locals: Vec<(Local, ir::Expr)>,
}

fn local_name(l: Local) -> String {
    format!("l{}", l.0)
}

fn lit_f32(v: f32) -> Expr {
    if v.is_nan() {
        Expr::call("bx_nan", vec![])
    } else if v.is_infinite() {
        let inf = Expr::call("bx_inf", vec![]);
        if v > 0.0 { inf } else { Expr::unary("-", inf) }
    } else {
        Expr::Lit(Literal::F32(v))
    }
}

fn lit(v: Value) -> Expr {
    match v {
        Value::F32(x) => lit_f32(x),
        Value::I32(x) => Expr::Lit(Literal::I32(x)),
        Value::U32(x) => Expr::Lit(Literal::U32(x)),
        Value::Bool(x) => Expr::Lit(Literal::Bool(x)),
    }
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
        match &e.kind {
            ExprKind::Const(c) => match (*c, e.ty) {
                (Const::Float(v), _) => lit_f32(v as f32),
                (Const::Int(v), Ty::U32) => Expr::Lit(Literal::U32(v as u32)),
                (Const::Int(v), _) => Expr::Lit(Literal::I32(v as i32)),
                (Const::Bool(b), _) => Expr::Lit(Literal::Bool(b)),
            },
            ExprKind::Arg(a) => Expr::ident(Arg::name(*a)),
            ExprKind::Param(i) => {
                let p = &self.program.params[*i];
                let m = Expr::Member(Box::new(Expr::ident("params")), member_name(&p.name));
                if p.ty == Ty::Bool {
                    Expr::binary("!=", m, Expr::Lit(Literal::U32(0)))
                } else {
                    m
                }
            }
            ExprKind::Local(l) => Expr::ident(local_name(*l)),
            _ if self.is_closed(e) => lit(self.fold(e)),
            ExprKind::Unary(UnOp::Neg, a) => Expr::unary("-", self.expr(a)),
            ExprKind::Unary(UnOp::Not, a) => Expr::unary("!", self.expr(a)),
            ExprKind::Binary(op, a, b) => {
                let (x, y) = (self.expr(a), self.expr(b));
                match (op, a.ty) {
                    (BinOp::Div, Ty::I32) => Expr::call("bx_div_i32", vec![x, y]),
                    (BinOp::Rem, Ty::I32) => Expr::call("bx_rem_i32", vec![x, y]),
                    (BinOp::Div, Ty::U32) => Expr::call("bx_div_u32", vec![x, y]),
                    (BinOp::Rem, Ty::U32) => Expr::call("bx_rem_u32", vec![x, y]),
                    _ => Expr::binary(op.symbol(), x, y),
                }
            }
            ExprKind::Call(f, args) => {
                let float = args[0].ty == Ty::F32;
                let mut a: Vec<Expr> = args.iter().map(|x| self.expr(x)).collect();
                let name = match f {
                    Builtin::Sigmoid => {
                        let one = || Expr::Lit(Literal::F32(1.0));
                        let x = a.remove(0);
                        let e = Expr::call("exp", vec![Expr::unary("-", x)]);
                        return Expr::binary("/", one(), Expr::binary("+", one(), e));
                    }
                    Builtin::Clamp => {
                        // min(max(x, lo), hi), never WGSL's clamp (lo > hi).
                        let (min, max) = if float {
                            ("bx_min_f32", "bx_max_f32")
                        } else {
                            ("min", "max")
                        };
                        let hi = a.pop().expect("clamp arity");
                        let inner = Expr::call(max, a);
                        return Expr::call(min, vec![inner, hi]);
                    }
                    Builtin::Abs if e.ty == Ty::U32 => return a.remove(0),
                    Builtin::Min if float => "bx_min_f32",
                    Builtin::Max if float => "bx_max_f32",
                    Builtin::Tanh => "bx_tanh",
                    Builtin::SatAdd => "bx_sat_add",
                    Builtin::SatSub => "bx_sat_sub",
                    Builtin::SatMul => "bx_sat_mul",
                    // WGSL's abs(i32::MIN) is i32::MIN: it wraps, as the IR's.
                    other => other.name(),
                };
                Expr::call(name, a)
            }
            ExprKind::Cast(a) => {
                let x = self.expr(a);
                match (a.ty, e.ty) {
                    (Ty::F32, Ty::I32) => Expr::call("bx_f32_to_i32", vec![x]),
                    (Ty::F32, Ty::U32) => Expr::call("bx_f32_to_u32", vec![x]),
                    (Ty::Bool, to) => {
                        let (zero, one) = if to == Ty::U32 {
                            (Literal::U32(0), Literal::U32(1))
                        } else {
                            (Literal::I32(0), Literal::I32(1))
                        };
                        Expr::call("select", vec![Expr::Lit(zero), Expr::Lit(one), x])
                    }
                    (from, to) if from == to => x,
                    (Ty::I32 | Ty::U32, Ty::F32) => Expr::call("f32", vec![x]),
                    // int ↔ int keeps the bits.
                    (_, to) => Expr::call(format!("bitcast<{}>", ty(to)), vec![x]),
                }
            }
            ExprKind::Select(c, t, f) => {
                let (c, t, f) = (self.expr(c), self.expr(t), self.expr(f));
                Expr::call("select", vec![f, t, c])
            }
            ExprKind::Let(l, v, body) => {
                let value = self.expr(v);
                self.stmts.push(Stmt::Let(local_name(*l), ty(v.ty), value));
                if self.is_closed(v) {
                    self.closed_locals.push((*l, (**v).clone()));
                }
                self.expr(body)
            }
        }
    }
}
