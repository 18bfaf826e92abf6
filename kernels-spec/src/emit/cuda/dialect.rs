//! The CUDA C dialect of the GPU lowering ([`crate::emit::gpu`]).
//!
//! Where CUDA C differs from the IR (see [`crate::ir`]), the printed code
//! calls a helper or an intrinsic:
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
//! Variant functions are `__device__ __forceinline__` and take the kernel's
//! `Params` block by reference as their first argument.

use super::Cuda;
use crate::emit::Target;
use crate::emit::gpu::ast::{BinaryOp, Func, Function, Literal, ParamsStruct, Stmt, Type, UnaryOp};
use crate::emit::gpu::{Dialect, code, name};
use crate::ir::TileClass;
use crate::params::PARAM_WORDS;
use std::fmt::{self, Display, Formatter};

/// Helpers the lowered functions call. Every one is total.
const HELPERS: &str = r#"// ---- IR semantics helpers ----
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

fn int_literal(f: &mut Formatter<'_>, v: i32) -> fmt::Result {
    match v {
        // `-2147483648` is the negation of a literal that does not fit.
        i32::MIN => f.write_str("(-2147483647 - 1)"),
        v if v < 0 => write!(f, "(-{})", -v),
        v => write!(f, "{v}"),
    }
}

impl Dialect for Cuda {
    const TARGET: Target = Target::Cuda;
    const HELPERS: &'static str = HELPERS;

    fn ty(t: Type) -> &'static str {
        match t {
            Type::F32 => "float",
            Type::I32 => "int",
            Type::U32 => "unsigned",
            Type::Bool => "bool",
        }
    }

    fn literal(f: &mut Formatter<'_>, l: Literal) -> fmt::Result {
        match l {
            // `{:?}` always has a `.` or an exponent, so `f` makes it a
            // float literal, and it round-trips the f32 exactly.
            Literal::F32(v) if v.is_finite() && v.is_sign_negative() => write!(f, "(-{:?}f)", -v),
            Literal::F32(v) if v.is_finite() => write!(f, "{v:?}f"),
            // No literal for ±inf and NaN: their bits, as the signed int
            // `__int_as_float` takes.
            Literal::F32(v) => {
                f.write_str("__int_as_float(")?;
                int_literal(f, v.to_bits() as i32)?;
                f.write_str(")")
            }
            Literal::I32(v) => int_literal(f, v),
            Literal::U32(v) => write!(f, "{v}u"),
            Literal::Bool(v) => write!(f, "{v}"),
        }
    }

    fn tile_class_constant(f: &mut Formatter<'_>, class: TileClass) -> fmt::Result {
        writeln!(f, "constexpr int {} = {};", class.constant(), class.code())
    }

    fn unary(f: &mut Formatter<'_>, op: UnaryOp, ty: Type, a: &dyn Display) -> fmt::Result {
        match (op, ty) {
            (UnaryOp::Neg, Type::I32) => write!(f, "bx_neg_i32({a})"),
            (UnaryOp::Neg, _) => write!(f, "(- {a})"),
            (UnaryOp::Not, _) => write!(f, "(! {a})"),
        }
    }

    fn binary(
        f: &mut Formatter<'_>,
        op: BinaryOp,
        ty: Type,
        a: &dyn Display,
        b: &dyn Display,
    ) -> fmt::Result {
        let helper = match (op, ty) {
            (BinaryOp::Add, Type::F32) => "__fadd_rn",
            (BinaryOp::Sub, Type::F32) => "__fsub_rn",
            (BinaryOp::Mul, Type::F32) => "__fmul_rn",
            (BinaryOp::Div, Type::F32) => "__fdiv_rn",
            // The IR's float `%` is Rust's (truncated) remainder.
            (BinaryOp::Rem, Type::F32) => "fmodf",
            (BinaryOp::Add, Type::I32) => "bx_add_i32",
            (BinaryOp::Sub, Type::I32) => "bx_sub_i32",
            (BinaryOp::Mul, Type::I32) => "bx_mul_i32",
            (BinaryOp::Div, Type::I32) => "bx_div_i32",
            (BinaryOp::Rem, Type::I32) => "bx_rem_i32",
            (BinaryOp::Div, Type::U32) => "bx_div_u32",
            (BinaryOp::Rem, Type::U32) => "bx_rem_u32",
            _ => return write!(f, "({a} {} {b})", op.symbol()),
        };
        write!(f, "{helper}({a}, {b})")
    }

    fn call(f: &mut Formatter<'_>, func: Func, ty: Type, args: &[&dyn Display]) -> fmt::Result {
        let name = match (func, ty) {
            (Func::Exp, _) => "expf",
            (Func::Exp2, _) => "exp2f",
            (Func::Log, _) => "logf",
            (Func::Log2, _) => "log2f",
            (Func::Sqrt, _) => "sqrtf",
            (Func::Floor, _) => "floorf",
            (Func::Ceil, _) => "ceilf",
            (Func::Tanh, _) => "bx_tanh",
            (Func::Sigmoid, _) => "bx_sigmoid",
            (Func::Abs, Type::F32) => "fabsf",
            (Func::Abs, _) => "bx_abs_i32",
            (Func::Min, Type::F32) => "fminf",
            (Func::Min, Type::U32) => "bx_min_u32",
            (Func::Min, _) => "bx_min_i32",
            (Func::Max, Type::F32) => "fmaxf",
            (Func::Max, Type::U32) => "bx_max_u32",
            (Func::Max, _) => "bx_max_i32",
            (Func::SatAdd, _) => "bx_sat_add",
            (Func::SatSub, _) => "bx_sat_sub",
            (Func::SatMul, _) => "bx_sat_mul",
        };
        write!(f, "{name}(")?;
        for (i, a) in args.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{a}")?;
        }
        f.write_str(")")
    }

    fn cast(f: &mut Formatter<'_>, to: Type, from: Type, value: &dyn Display) -> fmt::Result {
        match (from, to) {
            (Type::F32, Type::I32) => write!(f, "bx_f32_to_i32({value})"),
            (Type::F32, Type::U32) => write!(f, "bx_f32_to_u32({value})"),
            (Type::Bool, Type::U32) => write!(f, "({value} ? 1u : 0u)"),
            (Type::Bool, _) => write!(f, "({value} ? 1 : 0)"),
            // int → float rounds to nearest, like Rust's `as f32`; int ↔ int
            // keeps the bits.
            _ => write!(f, "(({})({value}))", Self::ty(to)),
        }
    }

    fn select(
        f: &mut Formatter<'_>,
        cond: &dyn Display,
        then: &dyn Display,
        otherwise: &dyn Display,
    ) -> fmt::Result {
        write!(f, "({cond} ? {then} : {otherwise})")
    }

    fn stmt(f: &mut Formatter<'_>, s: &Stmt) -> fmt::Result {
        match s {
            Stmt::Unused(n) => writeln!(f, "    (void){};", name::<Self>(*n)),
            Stmt::Let(l, t, v) => writeln!(
                f,
                "    const {} {} = {};",
                Self::ty(*t),
                name::<Self>(crate::emit::gpu::ast::Name::Local(*l)),
                code::<Self, _>(v)
            ),
            Stmt::Return(v) => writeln!(f, "    return {};", code::<Self, _>(v)),
        }
    }

    fn function(f: &mut Formatter<'_>, fun: &Function) -> fmt::Result {
        write!(
            f,
            "__device__ __forceinline__ {} {}(const Params& params",
            Self::ty(fun.ret),
            fun.name
        )?;
        for (a, t) in &fun.args {
            write!(f, ", {} {}", Self::ty(*t), a.name())?;
        }
        writeln!(f, ") {{")?;
        for s in &fun.body {
            Self::stmt(f, s)?;
        }
        writeln!(f, "}}")
    }

    fn params_struct(f: &mut Formatter<'_>, s: &ParamsStruct) -> fmt::Result {
        writeln!(f, "struct Params {{")?;
        for m in &s.members {
            writeln!(f, "    {} {};", Self::ty(m.ty), m.name)?;
        }
        if s.padding_words > 0 {
            writeln!(f, "    unsigned _pad[{}];", s.padding_words)?;
        }
        writeln!(f, "}};")?;
        writeln!(
            f,
            "static_assert(sizeof(Params) == {}, \"Params is {PARAM_WORDS} words\");",
            4 * PARAM_WORDS
        )
    }
}
