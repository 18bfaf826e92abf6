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
use crate::emit::gpu::ast::{BinaryOp, Func, Function, Literal, Name, Type, UnaryOp};
use crate::emit::gpu::{CastForm, Dialect, OpForm, Part, literal};
use crate::ir::TileClass;
use crate::params::PARAM_WORDS;
use std::fmt::{self, Formatter};

impl Dialect for Cuda {
    const TARGET: Target = Target::Cuda;
    const HELPERS: &'static str = include_str!("helpers.cu");
    const CAPTURE_HELPERS: &'static str = include_str!("captures.cu");
    const TYPES: [&'static str; 4] = ["float", "int", "unsigned", "bool"];
    const I32_SUFFIX: &'static str = "";

    /// Its bits, as the signed int `__int_as_float` takes (NVRTC has no
    /// `INFINITY` or `NAN` without headers).
    fn non_finite(f: &mut Formatter<'_>, v: f32) -> fmt::Result {
        f.write_str("__int_as_float(")?;
        literal::<Self>(f, Literal::I32(v.to_bits() as i32))?;
        f.write_str(")")
    }

    fn unary(op: UnaryOp, ty: Type) -> OpForm {
        match (op, ty) {
            (UnaryOp::Neg, Type::I32) => OpForm::Call("bx_neg_i32"),
            _ => OpForm::Operator,
        }
    }

    fn binary(op: BinaryOp, ty: Type) -> OpForm {
        OpForm::Call(match (op, ty) {
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
            _ => return OpForm::Operator,
        })
    }

    fn function(func: Func, ty: Type) -> &'static str {
        match (func, ty) {
            (Func::Exp, _) => "expf",
            (Func::Exp2, _) => "exp2f",
            (Func::Log, _) => "logf",
            (Func::Log2, _) => "log2f",
            (Func::Sqrt, _) => "sqrtf",
            (Func::Floor, _) => "floorf",
            (Func::Ceil, _) => "ceilf",
            (Func::Tanh, _) => "bx_tanh",
            (Func::Sigmoid, _) => "bx_sigmoid",
            (Func::Sin, _) => "bx_sin",
            (Func::Cos, _) => "bx_cos",
            (Func::Tan, _) => "bx_tan",
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
        }
    }

    fn cast(from: Type, to: Type) -> CastForm {
        match (from, to) {
            (Type::F32, Type::I32) => CastForm::Call("bx_f32_to_i32"),
            (Type::F32, Type::U32) => CastForm::Call("bx_f32_to_u32"),
            // int → float rounds to nearest, like Rust's `as f32`; int ↔ int
            // keeps the bits.
            _ => CastForm::CCast,
        }
    }

    fn bits(to: Type) -> CastForm {
        match to {
            Type::F32 => CastForm::Call("__uint_as_float"),
            _ => CastForm::CCast,
        }
    }

    const CAPTURES_ARG: &'static str = "captures, ";

    const VARIANT_ARGS: &'static str = "params, captures, ";

    fn void_header(f: &mut Formatter<'_>, name: &str, args: &[(&str, Type)]) -> fmt::Result {
        write!(
            f,
            "__device__ __forceinline__ void {name}(const Params& params, unsigned* __restrict__ captures"
        )?;
        for (a, t) in args {
            write!(f, ", {} {a}", Self::ty(*t))?;
        }
        writeln!(f, ") {{")
    }

    fn select(f: &mut Formatter<'_>, c: Part<'_>, t: Part<'_>, e: Part<'_>) -> fmt::Result {
        write!(f, "({c} ? {t} : {e})")
    }

    fn let_local(f: &mut Formatter<'_>, name: Part<'_>, ty: Type, value: Part<'_>) -> fmt::Result {
        writeln!(f, "    const {} {name} = {value};", Self::ty(ty))
    }

    fn unused(f: &mut Formatter<'_>, name: Part<'_>) -> fmt::Result {
        writeln!(f, "    (void){name};")
    }

    fn function_header(f: &mut Formatter<'_>, fun: &Function) -> fmt::Result {
        let mut args: Vec<String> = Vec::new();
        if fun.block {
            args.push("const Params& params".into());
            args.push("unsigned* __restrict__ captures".into());
        }
        args.extend(
            fun.args
                .iter()
                .map(|(a, t)| format!("{} {a}", Self::ty(*t))),
        );
        if fun.seen {
            args.push(format!("bool {}", Name::Seen));
        }
        writeln!(
            f,
            "__device__ __forceinline__ {} {}({}) {{",
            Self::ty(fun.ret),
            fun.name,
            args.join(", ")
        )
    }

    fn params_member(f: &mut Formatter<'_>, name: &str, ty: Type) -> fmt::Result {
        writeln!(f, "    {} {name};", Self::ty(ty))
    }

    fn params_padding(f: &mut Formatter<'_>, _start: usize, words: usize) -> fmt::Result {
        writeln!(f, "    unsigned _pad[{words}];")
    }

    fn dropout_helpers(dropout: bool) -> String {
        crate::dropout::cuda_helpers(dropout)
    }

    fn params_end(f: &mut Formatter<'_>) -> fmt::Result {
        writeln!(f, "}};")?;
        writeln!(
            f,
            "static_assert(sizeof(Params) == {}, \"Params is {PARAM_WORDS} words\");",
            4 * PARAM_WORDS
        )
    }

    fn tile_class_constant(f: &mut Formatter<'_>, class: TileClass) -> fmt::Result {
        writeln!(f, "constexpr int {} = {};", class.constant(), class.code())
    }
}
