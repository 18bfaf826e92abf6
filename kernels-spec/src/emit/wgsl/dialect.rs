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
use crate::emit::gpu::ast::{BinaryOp, Func, Function, Literal, Name, Type};
use crate::emit::gpu::{CastForm, Dialect, OpForm, Part, literal};
use crate::ir::TileClass;
use std::fmt::{self, Formatter};

impl Dialect for Wgsl {
    const TARGET: Target = Target::Wgsl;
    const HELPERS: &'static str = include_str!("helpers.wgsl");
    const CAPTURE_HELPERS: &'static str = include_str!("captures.wgsl");
    const TYPES: [&'static str; 4] = ["f32", "i32", "u32", "bool"];
    const I32_SUFFIX: &'static str = "i";

    // WGSL's `+ - *` and negation wrap, and its float `%` is the truncated
    // remainder, as the IR's; only integer division needs a helper.
    fn binary(op: BinaryOp, ty: Type) -> OpForm {
        match (op, ty) {
            (BinaryOp::Div, Type::I32) => OpForm::Call("bx_div_i32"),
            (BinaryOp::Rem, Type::I32) => OpForm::Call("bx_rem_i32"),
            (BinaryOp::Div, Type::U32) => OpForm::Call("bx_div_u32"),
            (BinaryOp::Rem, Type::U32) => OpForm::Call("bx_rem_u32"),
            _ => OpForm::Operator,
        }
    }

    fn function(func: Func, ty: Type) -> &'static str {
        let float = ty == Type::F32;
        match func {
            Func::Exp => "exp",
            Func::Exp2 => "exp2",
            Func::Log => "log",
            Func::Log2 => "log2",
            Func::Sqrt => "sqrt",
            Func::Floor => "floor",
            Func::Ceil => "ceil",
            Func::Tanh => "bx_tanh",
            Func::Sigmoid => "bx_sigmoid",
            Func::Sin => "bx_sin",
            Func::Cos => "bx_cos",
            Func::Tan => "bx_tan",
            // WGSL's abs(i32::MIN) is i32::MIN: it wraps, as the IR's.
            Func::Abs => "abs",
            Func::Min if float => "bx_min_f32",
            Func::Max if float => "bx_max_f32",
            Func::Min => "min",
            Func::Max => "max",
            Func::SatAdd => "bx_sat_add",
            Func::SatSub => "bx_sat_sub",
            Func::SatMul => "bx_sat_mul",
        }
    }

    fn cast(from: Type, to: Type) -> CastForm {
        CastForm::Call(match (from, to) {
            (Type::F32, Type::I32) => "bx_f32_to_i32",
            (Type::F32, Type::U32) => "bx_f32_to_u32",
            (_, Type::F32) => "f32",
            // int ↔ int keeps the bits.
            (_, Type::U32) => "bitcast<u32>",
            _ => "bitcast<i32>",
        })
    }

    fn bits(to: Type) -> CastForm {
        CastForm::Call(match to {
            Type::F32 => "bitcast<f32>",
            _ => "bitcast<i32>",
        })
    }

    fn select(f: &mut Formatter<'_>, c: Part<'_>, t: Part<'_>, e: Part<'_>) -> fmt::Result {
        write!(f, "select({e}, {t}, {c})")
    }

    /// A helper that reads a `var`, so the value is never constant-folded.
    fn non_finite(f: &mut Formatter<'_>, v: f32) -> fmt::Result {
        f.write_str(match v {
            f32::INFINITY => "bx_inf()",
            f32::NEG_INFINITY => "(- bx_inf())",
            _ => "bx_nan()",
        })
    }

    fn let_local(f: &mut Formatter<'_>, name: Part<'_>, ty: Type, value: Part<'_>) -> fmt::Result {
        writeln!(f, "    let {name}: {} = {value};", Self::ty(ty))
    }

    fn void_header(f: &mut Formatter<'_>, name: &str, args: &[(&str, Type)]) -> fmt::Result {
        let args: Vec<String> = args
            .iter()
            .map(|(a, t)| format!("{a}: {}", Self::ty(*t)))
            .collect();
        writeln!(f, "fn {name}({}) {{", args.join(", "))
    }

    fn function_header(f: &mut Formatter<'_>, fun: &Function) -> fmt::Result {
        let mut args: Vec<String> = fun
            .args
            .iter()
            .map(|(a, t)| format!("{a}: {}", Self::ty(*t)))
            .collect();
        if fun.seen {
            args.push(format!("{}: bool", Name::Seen));
        }
        writeln!(
            f,
            "fn {}({}) -> {} {{",
            fun.name,
            args.join(", "),
            Self::ty(fun.ret)
        )
    }

    fn params_member(f: &mut Formatter<'_>, name: &str, ty: Type) -> fmt::Result {
        writeln!(f, "    {name}: {},", Self::ty(ty))
    }

    /// Scalar words up to a 16-byte boundary, then as many as fit as an
    /// array of `vec4<u32>` (a uniform array's stride must be a multiple of
    /// 16, and it starts on a 16-byte boundary), then scalars again up to
    /// the dropout state where the block ends with one.
    fn params_padding(f: &mut Formatter<'_>, start: usize, words: usize) -> fmt::Result {
        let end = start + words;
        let mut w = start;
        while !w.is_multiple_of(4) && w < end {
            writeln!(f, "    pad_{}: u32,", w - start)?;
            w += 1;
        }
        if end - w >= 4 {
            writeln!(f, "    pad: array<vec4<u32>, {}>,", (end - w) / 4)?;
            w += (end - w) / 4 * 4;
        }
        while w < end {
            writeln!(f, "    pad_t{}: u32,", end - w)?;
            w += 1;
        }
        Ok(())
    }

    fn dropout_helpers(dropout: bool) -> String {
        crate::dropout::wgsl_helpers(dropout)
    }

    fn params_end(f: &mut Formatter<'_>) -> fmt::Result {
        writeln!(f, "}}")
    }

    fn tile_class_constant(f: &mut Formatter<'_>, class: TileClass) -> fmt::Result {
        write!(f, "const {}: i32 = ", class.constant())?;
        literal::<Self>(f, Literal::I32(class.code()))?;
        writeln!(f, ";")
    }
}
