//! IR → the CUDA C representation of [`super::ast`], for the four variant
//! functions, plus the helpers that give CUDA C the IR's semantics.
//!
//! Where CUDA C differs from the IR (see [`crate::ir`]):
//! - signed `+ - *` and negation overflow is undefined behaviour in C++: they
//!   go through `unsigned` (`bx_add_i32`, ...), which wraps;
//! - integer `/` and `%` by zero are undefined (0 in the IR), and so is
//!   `INT_MIN / -1` (wraps in the IR): `bx_div_*`/`bx_rem_*`;
//! - float → int conversion is undefined out of range and for NaN:
//!   `bx_f32_to_*` saturate with NaN → 0;
//! - float `+ - * /` may be contracted into FMAs differently in each kernel
//!   a function is inlined into: they are written `__fadd_rn` & co., which
//!   the compiler never fuses, so a score is bitwise the same in the forward
//!   and the backward kernels (and rounds like Rust's, which never fuses);
//! - `tanhf` is accurate, but we keep the same odd polynomial / exp form as
//!   the WGSL target (`bx_tanh`) so both are exact near 0 and overflow-safe;
//! - NVRTC has no headers: no `INFINITY`/`NAN`, so non-finite constants are
//!   `__int_as_float` of their bits;
//! - `fminf`/`fmaxf` already ignore a NaN operand, like Rust's `min`/`max`.
//!
//! Every closed sub-expression (no argument, parameter, or local bound to a
//! runtime value) is folded here with [`crate::eval`], so what remains in the
//! text depends on a runtime value. `let` bindings become `const` locals
//! before the `return`; hoisting them out of `?:` arms is sound because every
//! IR expression is pure and, with the helpers, total.

use super::PARAM_WORDS;
use super::ast::{Expr, Function, Literal, Stmt, Struct, Type};
use crate::eval::{self, Value};
use crate::ir::{self, Arg, BinOp, Builtin, Const, ExprKind, Local, Program, Ty, UnOp};

/// Helpers the lowered functions call. Every one is total.
pub const HELPERS: &str = r#"// ---- IR semantics helpers ----
__device__ __forceinline__ float bx_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float bx_nan() { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ int bx_add_i32(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
__device__ __forceinline__ int bx_sub_i32(int a, int b) { return (int)((unsigned)a - (unsigned)b); }
__device__ __forceinline__ int bx_mul_i32(int a, int b) { return (int)((unsigned)a * (unsigned)b); }
__device__ __forceinline__ int bx_neg_i32(int a) { return (int)(0u - (unsigned)a); }
__device__ __forceinline__ int bx_abs_i32(int a) { return a < 0 ? bx_neg_i32(a) : a; }
__device__ __forceinline__ int bx_div_i32(int a, int b) {
    if (b == 0) return 0;
    if (b == -1) return bx_neg_i32(a); // INT_MIN / -1 wraps
    return a / b;
}
__device__ __forceinline__ int bx_rem_i32(int a, int b) {
    if (b == 0 || b == -1) return 0;
    return a % b;
}
__device__ __forceinline__ unsigned bx_div_u32(unsigned a, unsigned b) { return b == 0u ? 0u : a / b; }
__device__ __forceinline__ unsigned bx_rem_u32(unsigned a, unsigned b) { return b == 0u ? 0u : a % b; }
__device__ __forceinline__ int bx_min_i32(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int bx_max_i32(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ unsigned bx_min_u32(unsigned a, unsigned b) { return a < b ? a : b; }
__device__ __forceinline__ unsigned bx_max_u32(unsigned a, unsigned b) { return a > b ? a : b; }
__device__ __forceinline__ int bx_f32_to_i32(float x) {
    if (x != x) return 0;
    if (x >= 2147483648.0f) return 2147483647;
    if (x < -2147483648.0f) return -2147483647 - 1;
    return (int)x;
}
__device__ __forceinline__ unsigned bx_f32_to_u32(float x) {
    if (x != x || x < 1.0f) return 0u;
    if (x >= 4294967296.0f) return 4294967295u;
    return (unsigned)x;
}
__device__ __forceinline__ float bx_tanh(float x) {
    // Below |x| = 0.625 an odd polynomial (Cephes tanhf), above (1 - t)/(1 + t)
    // with t = e^(-2|x|) <= 0.29 (exactly 1 once t underflows): exact near 0,
    // never inf/inf. The same form as the WGSL target's.
    if (x != x) return x;
    const float a = fabsf(x);
    const float z = __fmul_rn(x, x);
    float p = -5.70498872745e-3f;
    p = __fadd_rn(__fmul_rn(p, z), 2.06390887954e-2f);
    p = __fadd_rn(__fmul_rn(p, z), -5.37397155531e-2f);
    p = __fadd_rn(__fmul_rn(p, z), 1.33314422036e-1f);
    p = __fadd_rn(__fmul_rn(p, z), -3.33332819422e-1f);
    if (a < 0.625f) return __fadd_rn(x, __fmul_rn(__fmul_rn(x, z), p));
    const float t = expf(__fmul_rn(-2.0f, a));
    const float r = __fdiv_rn(__fsub_rn(1.0f, t), __fadd_rn(1.0f, t));
    return x < 0.0f ? -r : r;
}
__device__ __forceinline__ float bx_sigmoid(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
}
__device__ __forceinline__ int bx_sat_i32(long long v) {
    return v > 2147483647LL ? 2147483647 : (v < -2147483648LL ? (-2147483647 - 1) : (int)v);
}
__device__ __forceinline__ int bx_sat_add(int a, int b) { return bx_sat_i32((long long)a + (long long)b); }
__device__ __forceinline__ int bx_sat_sub(int a, int b) { return bx_sat_i32((long long)a - (long long)b); }
__device__ __forceinline__ int bx_sat_mul(int a, int b) { return bx_sat_i32((long long)a * (long long)b); }
"#;

/// The CUDA C type of an IR type.
pub fn ty(t: Ty) -> Type {
    match t {
        Ty::F32 => Type::Float,
        Ty::I32 => Type::Int,
        Ty::U32 => Type::Unsigned,
        Ty::Bool => Type::Bool,
    }
}

/// The CUDA name of a variant function (`score` → `variant_score`).
pub fn function_name(f: &ir::Function) -> String {
    format!("variant_{}", f.name)
}

/// The `Params` member holding parameter `name`.
fn member_name(name: &str) -> String {
    format!("p_{name}")
}

/// Checks that the program's parameters fit the fixed-size `Params` struct:
/// one 32-bit word each, at most [`PARAM_WORDS`].
pub fn check_params(program: &Program) -> Result<(), String> {
    if program.params.len() > PARAM_WORDS {
        return Err(format!(
            "variant `{}` has {} parameter words; the CUDA kernels take at most {PARAM_WORDS} \
             (one per field of type f32, i32, u32 or bool)",
            program.name,
            program.params.len()
        ));
    }
    Ok(())
}

/// The `Params` struct: one 4-byte member per parameter in declaration
/// order (f32 → `float`, i32 → `int`, u32 → `unsigned`, bool → `unsigned`
/// 0/1), then `unsigned _pad[..]` to exactly [`PARAM_WORDS`] words, so every
/// variant's kernels take the same 128-byte argument.
///
/// # Panics
/// If [`check_params`] fails (the macro reports that as a compile error
/// before any emitter runs).
pub fn params_struct(program: &Program) -> Struct {
    if let Err(e) = check_params(program) {
        panic!("{e}");
    }
    let mut members: Vec<(String, Type, Option<usize>)> = program
        .params
        .iter()
        .map(|p| {
            let t = if p.ty == Ty::Bool {
                Type::Unsigned
            } else {
                ty(p.ty)
            };
            (member_name(&p.name), t, None)
        })
        .collect();
    let pad = PARAM_WORDS - members.len();
    if pad > 0 {
        members.push(("_pad".into(), Type::Unsigned, Some(pad)));
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
    // Arguments (and `params`) a function does not read are still taken, so
    // every variant function of a kind has the same signature.
    let mut reads_params = false;
    f.body
        .walk(&mut |e| reads_params |= matches!(e.kind, ExprKind::Param(_)));
    if !reads_params {
        cx.stmts.push(Stmt::Discard("params".into()));
    }
    for a in &f.args {
        if !f.body.uses_arg(*a) {
            cx.stmts.push(Stmt::Discard(a.name().into()));
        }
    }
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
    if v.is_finite() {
        Expr::Lit(Literal::Float(v))
    } else {
        // Bits as a signed int literal: `__int_as_float` takes an int.
        let bits = v.to_bits() as i32;
        Expr::call("__int_as_float", vec![Expr::Lit(Literal::Int(bits))])
    }
}

fn lit(v: Value) -> Expr {
    match v {
        Value::F32(x) => lit_f32(x),
        Value::I32(x) => Expr::Lit(Literal::Int(x)),
        Value::U32(x) => Expr::Lit(Literal::Unsigned(x)),
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
                (Const::Int(v), Ty::U32) => Expr::Lit(Literal::Unsigned(v as u32)),
                (Const::Int(v), _) => Expr::Lit(Literal::Int(v as i32)),
                (Const::Bool(b), _) => Expr::Lit(Literal::Bool(b)),
            },
            ExprKind::Arg(a) => Expr::ident(Arg::name(*a)),
            ExprKind::Param(i) => {
                let p = &self.program.params[*i];
                let m = Expr::Member(Box::new(Expr::ident("params")), member_name(&p.name));
                if p.ty == Ty::Bool {
                    Expr::binary("!=", m, Expr::Lit(Literal::Unsigned(0)))
                } else {
                    m
                }
            }
            ExprKind::Local(l) => Expr::ident(local_name(*l)),
            _ if self.is_closed(e) => lit(self.fold(e)),
            ExprKind::Unary(UnOp::Neg, a) => {
                let x = self.expr(a);
                if e.ty == Ty::I32 {
                    Expr::call("bx_neg_i32", vec![x])
                } else {
                    Expr::unary("-", x)
                }
            }
            ExprKind::Unary(UnOp::Not, a) => Expr::unary("!", self.expr(a)),
            ExprKind::Binary(op, a, b) => {
                let (x, y) = (self.expr(a), self.expr(b));
                let helper = match (op, a.ty) {
                    (BinOp::Add, Ty::F32) => Some("__fadd_rn"),
                    (BinOp::Sub, Ty::F32) => Some("__fsub_rn"),
                    (BinOp::Mul, Ty::F32) => Some("__fmul_rn"),
                    (BinOp::Div, Ty::F32) => Some("__fdiv_rn"),
                    (BinOp::Add, Ty::I32) => Some("bx_add_i32"),
                    (BinOp::Sub, Ty::I32) => Some("bx_sub_i32"),
                    (BinOp::Mul, Ty::I32) => Some("bx_mul_i32"),
                    (BinOp::Div, Ty::I32) => Some("bx_div_i32"),
                    (BinOp::Rem, Ty::I32) => Some("bx_rem_i32"),
                    (BinOp::Div, Ty::U32) => Some("bx_div_u32"),
                    (BinOp::Rem, Ty::U32) => Some("bx_rem_u32"),
                    // The IR's float `%` is Rust's (truncated) remainder.
                    (BinOp::Rem, Ty::F32) => Some("fmodf"),
                    _ => None,
                };
                match helper {
                    Some(h) => Expr::call(h, vec![x, y]),
                    None => Expr::binary(op.symbol(), x, y),
                }
            }
            ExprKind::Call(f, args) => {
                let t = args[0].ty;
                let mut a: Vec<Expr> = args.iter().map(|x| self.expr(x)).collect();
                let (min, max) = match t {
                    Ty::F32 => ("fminf", "fmaxf"),
                    Ty::U32 => ("bx_min_u32", "bx_max_u32"),
                    _ => ("bx_min_i32", "bx_max_i32"),
                };
                let name = match f {
                    Builtin::Exp => "expf",
                    Builtin::Exp2 => "exp2f",
                    Builtin::Log => "logf",
                    Builtin::Log2 => "log2f",
                    Builtin::Sqrt => "sqrtf",
                    Builtin::Tanh => "bx_tanh",
                    Builtin::Sigmoid => "bx_sigmoid",
                    Builtin::Floor => "floorf",
                    Builtin::Ceil => "ceilf",
                    Builtin::Abs => match t {
                        Ty::F32 => "fabsf",
                        Ty::U32 => return a.remove(0),
                        _ => "bx_abs_i32",
                    },
                    Builtin::Min => min,
                    Builtin::Max => max,
                    Builtin::Clamp => {
                        // min(max(x, lo), hi): never panics, even if lo > hi.
                        let hi = a.pop().expect("clamp arity");
                        let inner = Expr::call(max, a);
                        return Expr::call(min, vec![inner, hi]);
                    }
                    Builtin::SatAdd => "bx_sat_add",
                    Builtin::SatSub => "bx_sat_sub",
                    Builtin::SatMul => "bx_sat_mul",
                };
                Expr::call(name, a)
            }
            ExprKind::Cast(a) => {
                let x = self.expr(a);
                match (a.ty, e.ty) {
                    (from, to) if from == to => x,
                    (Ty::F32, Ty::I32) => Expr::call("bx_f32_to_i32", vec![x]),
                    (Ty::F32, Ty::U32) => Expr::call("bx_f32_to_u32", vec![x]),
                    (Ty::Bool, to) => {
                        let (zero, one) = if to == Ty::U32 {
                            (Literal::Unsigned(0), Literal::Unsigned(1))
                        } else {
                            (Literal::Int(0), Literal::Int(1))
                        };
                        Expr::ternary(x, Expr::Lit(one), Expr::Lit(zero))
                    }
                    // int → float rounds to nearest, like Rust's `as f32`;
                    // int ↔ int keeps the bits.
                    (_, to) => Expr::cast(ty(to), x),
                }
            }
            ExprKind::Select(c, t, f) => {
                let (c, t, f) = (self.expr(c), self.expr(t), self.expr(f));
                Expr::ternary(c, t, f)
            }
            ExprKind::Let(l, v, body) => {
                let value = self.expr(v);
                self.stmts
                    .push(Stmt::Const(local_name(*l), ty(v.ty), value));
                if self.is_closed(v) {
                    self.closed_locals.push((*l, (**v).clone()));
                }
                self.expr(body)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile_str;

    fn program(source: &str) -> Program {
        match compile_str(source) {
            Ok(c) => c.program,
            Err(d) => panic!("{source}: {:?}", d.messages()),
        }
    }

    #[test]
    fn params_are_one_word_per_field_padded_to_32() {
        let p = program(
            "#[attention(mask = |b, h, q, kv| self.on && kv as u32 <= self.n)] \
             struct V { cap: f32, on: bool, n: u32, w: i32 }",
        );
        let s = params_struct(&p);
        let types: Vec<(&str, Type, Option<usize>)> = s
            .members
            .iter()
            .map(|(n, t, l)| (n.as_str(), *t, *l))
            .collect();
        assert_eq!(
            types,
            [
                ("p_cap", Type::Float, None),
                ("p_on", Type::Unsigned, None),
                ("p_n", Type::Unsigned, None),
                ("p_w", Type::Int, None),
                ("_pad", Type::Unsigned, Some(28)),
            ]
        );
        let words: usize = s.members.iter().map(|(_, _, l)| l.unwrap_or(1)).sum();
        assert_eq!(words, PARAM_WORDS);
        // A bool parameter reads as `!= 0u`.
        let mask = function(&p, &p.mask).to_string();
        assert!(mask.contains("(params.p_on != 0u)"), "{mask}");
    }

    #[test]
    fn params_with_no_fields_and_with_32_fields() {
        let none = params_struct(&program("#[attention()] struct V;"));
        assert_eq!(
            none.to_string(),
            "struct Params {\n    unsigned _pad[32];\n};\n"
        );
        let fields: Vec<String> = (0..32).map(|i| format!("f{i}: i32")).collect();
        let full = program(&format!(
            "#[attention()] struct V {{ {} }}",
            fields.join(", ")
        ));
        assert!(check_params(&full).is_ok());
        assert_eq!(params_struct(&full).members.len(), 32);
        let fields: Vec<String> = (0..33).map(|i| format!("f{i}: i32")).collect();
        let over = program(&format!(
            "#[attention()] struct V {{ {} }}",
            fields.join(", ")
        ));
        let e = check_params(&over).unwrap_err();
        assert!(
            e.contains("33 parameter words") && e.contains("at most 32"),
            "{e}"
        );
    }

    #[test]
    fn literals_and_operators_keep_the_ir_semantics() {
        assert_eq!(Literal::Int(i32::MIN).to_string(), "(-2147483647 - 1)");
        assert_eq!(Literal::Int(-3).to_string(), "(-3)");
        assert_eq!(Literal::Float(-0.5).to_string(), "(-0.5f)");
        assert_eq!(Literal::Float(1e-7).to_string(), "1e-7f");
        assert_eq!(
            lit_f32(f32::NEG_INFINITY).to_string(),
            "__int_as_float((-8388608))"
        );
        assert_eq!(
            lit_f32(f32::INFINITY).to_string(),
            "__int_as_float(2139095040)"
        );
        let p = program(
            "#[attention(score = |s, b, h, q, kv| s * self.a + (q / kv) as f32 - (-(q % self.k)) as f32, \
             mask = |b, h, q, kv| (kv as u32) / self.u < 3u32 && min(q, kv) >= clamp(h, 0, 4))] \
             struct V { a: f32, k: i32, u: u32 }",
        );
        let score = function(&p, &p.score).to_string();
        for needle in [
            "__fmul_rn(s, params.p_a)",
            "bx_div_i32(q, kv)",
            "bx_rem_i32(q, params.p_k)",
            "bx_neg_i32(",
        ] {
            assert!(score.contains(needle), "{needle} not in {score}");
        }
        let mask = function(&p, &p.mask).to_string();
        for needle in [
            "bx_div_u32(((unsigned)(kv)), params.p_u)",
            "bx_min_i32(q, kv)",
            "bx_min_i32(bx_max_i32(h, 0), 4)",
        ] {
            assert!(mask.contains(needle), "{needle} not in {mask}");
        }
        // Closed sub-expressions are folded, with the IR's wrapping.
        let folded = program(
            "#[attention(score = |s, b, h, q, kv| s + ((2147483647 + 1) as f32) + 1.0 / 0.0)] struct V;",
        );
        let text = function(&folded, &folded.score).to_string();
        assert!(
            text.contains("(-2147483600.0f)") && text.contains("__int_as_float(2139095040)"),
            "{text}"
        );
    }
}
