//! The WGSL dialect of the GPU lowering ([`crate::emit::gpu`]).
//!
//! Where WGSL differs from the IR (see [`crate::ir`]), the printed code
//! calls a helper:
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
//!   gives a non-finite float is a shader-creation error: the lowering folds
//!   every closed sub-expression, and non-finite constants come from helpers
//!   that read a `var` (never constant-folded). What remains in the text
//!   depends on a runtime value, where `+ - *` wrap as the IR requires.
//!
//! Variant functions read the parameter block as the module's `params`
//! uniform; a `bool` field is a `u32` word there (uniforms hold no `bool`).

use super::Wgsl;
use crate::emit::Target;
use crate::emit::gpu::ast::{BinaryOp, Func, Function, Literal, Name, ParamsStruct, Stmt, Type};
use crate::emit::gpu::{Dialect, code, name};
use crate::ir::TileClass;
use std::fmt::{self, Display, Formatter};

/// Helpers the lowered functions call. Every one is total.
const HELPERS: &str = r#"// ---- IR semantics helpers ----
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
fn bx_sigmoid(x: f32) -> f32 {
    return 1.0f / (1.0f + exp(-x));
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

fn int_literal(f: &mut Formatter<'_>, v: i32) -> fmt::Result {
    match v {
        // `-2147483648i` would negate an out-of-range literal.
        i32::MIN => f.write_str("(-2147483647i - 1i)"),
        v if v < 0 => write!(f, "(-{}i)", -v),
        v => write!(f, "{v}i"),
    }
}

fn call_args(f: &mut Formatter<'_>, name: &str, args: &[&dyn Display]) -> fmt::Result {
    write!(f, "{name}(")?;
    for (i, a) in args.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{a}")?;
    }
    f.write_str(")")
}

impl Dialect for Wgsl {
    const TARGET: Target = Target::Wgsl;
    const HELPERS: &'static str = HELPERS;

    fn ty(t: Type) -> &'static str {
        match t {
            Type::F32 => "f32",
            Type::I32 => "i32",
            Type::U32 => "u32",
            Type::Bool => "bool",
        }
    }

    fn literal(f: &mut Formatter<'_>, l: Literal) -> fmt::Result {
        match l {
            Literal::F32(v) if v.is_nan() => f.write_str("bx_nan()"),
            Literal::F32(v) if v == f32::INFINITY => f.write_str("bx_inf()"),
            Literal::F32(v) if v == f32::NEG_INFINITY => f.write_str("(- bx_inf())"),
            // `{:?}` always has a `.` or an exponent: a float literal.
            Literal::F32(v) if v.is_sign_negative() => write!(f, "(-{:?}f)", -v),
            Literal::F32(v) => write!(f, "{v:?}f"),
            Literal::I32(v) => int_literal(f, v),
            Literal::U32(v) => write!(f, "{v}u"),
            Literal::Bool(v) => write!(f, "{v}"),
        }
    }

    fn tile_class_constant(f: &mut Formatter<'_>, class: TileClass) -> fmt::Result {
        write!(f, "const {}: i32 = ", class.constant())?;
        int_literal(f, class.code())?;
        writeln!(f, ";")
    }

    fn binary(
        f: &mut Formatter<'_>,
        op: BinaryOp,
        ty: Type,
        a: &dyn Display,
        b: &dyn Display,
    ) -> fmt::Result {
        let helper = match (op, ty) {
            (BinaryOp::Div, Type::I32) => "bx_div_i32",
            (BinaryOp::Rem, Type::I32) => "bx_rem_i32",
            (BinaryOp::Div, Type::U32) => "bx_div_u32",
            (BinaryOp::Rem, Type::U32) => "bx_rem_u32",
            // WGSL's float `%` is the truncated remainder, as the IR's.
            _ => return write!(f, "({a} {} {b})", op.symbol()),
        };
        write!(f, "{helper}({a}, {b})")
    }

    fn call(f: &mut Formatter<'_>, func: Func, ty: Type, args: &[&dyn Display]) -> fmt::Result {
        let float = ty == Type::F32;
        let name = match func {
            Func::Exp => "exp",
            Func::Exp2 => "exp2",
            Func::Log => "log",
            Func::Log2 => "log2",
            Func::Sqrt => "sqrt",
            Func::Floor => "floor",
            Func::Ceil => "ceil",
            Func::Tanh => "bx_tanh",
            Func::Sigmoid => "bx_sigmoid",
            // WGSL's abs(i32::MIN) is i32::MIN: it wraps, as the IR's.
            Func::Abs => "abs",
            Func::Min if float => "bx_min_f32",
            Func::Max if float => "bx_max_f32",
            Func::Min => "min",
            Func::Max => "max",
            Func::SatAdd => "bx_sat_add",
            Func::SatSub => "bx_sat_sub",
            Func::SatMul => "bx_sat_mul",
        };
        call_args(f, name, args)
    }

    fn cast(f: &mut Formatter<'_>, to: Type, from: Type, value: &dyn Display) -> fmt::Result {
        match (from, to) {
            (Type::F32, Type::I32) => write!(f, "bx_f32_to_i32({value})"),
            (Type::F32, Type::U32) => write!(f, "bx_f32_to_u32({value})"),
            (Type::Bool, Type::U32) => write!(f, "select(0u, 1u, {value})"),
            (Type::Bool, _) => write!(f, "select(0i, 1i, {value})"),
            (_, Type::F32) => write!(f, "f32({value})"),
            // int ↔ int keeps the bits.
            _ => write!(f, "bitcast<{}>({value})", Self::ty(to)),
        }
    }

    fn select(
        f: &mut Formatter<'_>,
        cond: &dyn Display,
        then: &dyn Display,
        otherwise: &dyn Display,
    ) -> fmt::Result {
        write!(f, "select({otherwise}, {then}, {cond})")
    }

    fn stmt(f: &mut Formatter<'_>, s: &Stmt) -> fmt::Result {
        match s {
            // WGSL does not warn about unused arguments.
            Stmt::Unused(_) => Ok(()),
            Stmt::Let(l, t, v) => writeln!(
                f,
                "    let {}: {} = {};",
                name::<Self>(Name::Local(*l)),
                Self::ty(*t),
                code::<Self, _>(v)
            ),
            Stmt::Return(v) => writeln!(f, "    return {};", code::<Self, _>(v)),
        }
    }

    fn function(f: &mut Formatter<'_>, fun: &Function) -> fmt::Result {
        write!(f, "fn {}(", fun.name)?;
        for (i, (a, t)) in fun.args.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}: {}", a.name(), Self::ty(*t))?;
        }
        writeln!(f, ") -> {} {{", Self::ty(fun.ret))?;
        for s in &fun.body {
            Self::stmt(f, s)?;
        }
        writeln!(f, "}}")
    }

    /// Scalar words up to a 16-byte boundary, then the rest as an array of
    /// `vec4<u32>` (a uniform array's stride must be a multiple of 16).
    fn params_struct(f: &mut Formatter<'_>, s: &ParamsStruct) -> fmt::Result {
        writeln!(f, "struct Params {{")?;
        for m in &s.members {
            writeln!(f, "    {}: {},", m.name, Self::ty(m.ty))?;
        }
        let scalars = s.padding_words % 4;
        for i in 0..scalars {
            writeln!(f, "    pad_{i}: u32,")?;
        }
        if s.padding_words >= 4 {
            writeln!(f, "    pad: array<vec4<u32>, {}>,", s.padding_words / 4)?;
        }
        writeln!(f, "}}")
    }
}
