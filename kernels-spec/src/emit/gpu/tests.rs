//! One lowering, two dialects: each construct as CUDA C and WGSL write it.

use super::ast::Literal;
use super::{Dialect, code, lower, variant_section};
use crate::compile_str;
use crate::emit::cuda::Cuda;
use crate::emit::wgsl::Wgsl;
use crate::ir::Program;
use std::fmt;

fn program(source: &str) -> Program {
    match compile_str(source) {
        Ok(c) => c.program,
        Err(d) => panic!("{source}: {:?}", d.messages()),
    }
}

fn literal<D: Dialect>(l: Literal) -> String {
    struct Printed<D>(Literal, std::marker::PhantomData<D>);
    impl<D: Dialect> fmt::Display for Printed<D> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            super::literal::<D>(f, self.0)
        }
    }
    Printed::<D>(l, std::marker::PhantomData).to_string()
}

/// `f` of `p` as both dialects write it.
fn both(p: &Program, f: &crate::ir::Function) -> (String, String) {
    let lowered = lower::function(p, f);
    (
        super::code::<Cuda, _>(&lowered).to_string(),
        super::code::<Wgsl, _>(&lowered).to_string(),
    )
}

#[test]
fn literals_keep_their_value_and_type() {
    let cases = [
        (
            Literal::I32(i32::MIN),
            "(-2147483647 - 1)",
            "(-2147483647i - 1i)",
        ),
        (Literal::I32(-3), "(-3)", "(-3i)"),
        (Literal::U32(7), "7u", "7u"),
        (Literal::F32(-0.5), "(-0.5f)", "(-0.5f)"),
        (Literal::F32(1e-7), "1e-7f", "1e-7f"),
        (
            Literal::F32(f32::NEG_INFINITY),
            "__int_as_float((-8388608))",
            "(- bx_inf())",
        ),
        (
            Literal::F32(f32::INFINITY),
            "__int_as_float(2139095040)",
            "bx_inf()",
        ),
        (
            Literal::F32(f32::NAN),
            "__int_as_float(2143289344)",
            "bx_nan()",
        ),
        (Literal::Bool(true), "true", "true"),
    ];
    for (l, cuda, wgsl) in cases {
        assert_eq!(literal::<Cuda>(l), cuda, "{l:?}");
        assert_eq!(literal::<Wgsl>(l), wgsl, "{l:?}");
    }
}

#[test]
fn operators_get_the_ir_semantics_in_each_dialect() {
    let p = program(
        "#[attention(score = |s, b, h, q, kv| s * self.a + (q / kv) as f32 - (-(q % self.k)) as f32 \
           + sigmoid(s) + (if self.on { 1 } else { 0 }) as f32, \
         mask = |b, h, q, kv| (kv as u32) / self.u < 3u32 && min(q, kv) >= clamp(h, 0, 4) \
           && min(self.a, 1.0) > 0.0)] \
         struct V { a: f32, k: i32, u: u32, on: bool }",
    );
    let (cuda, wgsl) = both(&p, &p.score);
    // Positions are shifted by the call's window once, into locals.
    assert!(
        cuda.contains("const int l0 = bx_add_i32(q, params.win_q);"),
        "{cuda}"
    );
    assert!(
        wgsl.contains("let l1: i32 = (kv + params.win_kv);"),
        "{wgsl}"
    );
    for (c, w) in [
        // Floats never contract in CUDA; WGSL writes the operators.
        ("__fmul_rn(s, params.p_a)", "(s * params.p_a)"),
        // Integer division and remainder by zero give 0.
        ("bx_div_i32(l0, l1)", "bx_div_i32(l0, l1)"),
        ("bx_rem_i32(l0, params.p_k)", "bx_rem_i32(l0, params.p_k)"),
        // Signed negation wraps: UB in C++, defined in WGSL.
        (
            "bx_neg_i32(bx_rem_i32(l0, params.p_k))",
            "(- bx_rem_i32(l0, params.p_k))",
        ),
        ("((float)(bx_div_i32(l0, l1)))", "f32(bx_div_i32(l0, l1))"),
        ("bx_sigmoid(s)", "bx_sigmoid(s)"),
        // A bool parameter is a word; `if` is a select.
        (
            "((params.p_on != 0u) ? 1 : 0)",
            "select(0i, 1i, (params.p_on != 0u))",
        ),
    ] {
        assert!(cuda.contains(c), "{c} not in\n{cuda}");
        assert!(wgsl.contains(w), "{w} not in\n{wgsl}");
    }
    let (cuda, wgsl) = both(&p, &p.mask);
    for (c, w) in [
        (
            "bx_div_u32(((unsigned)(l1)), params.p_u)",
            "bx_div_u32(bitcast<u32>(l1), params.p_u)",
        ),
        ("bx_min_i32(l0, l1)", "min(l0, l1)"),
        // clamp is min(max(..)), never the target's clamp (lo > hi).
        ("bx_min_i32(bx_max_i32(h, 0), 4)", "min(max(h, 0i), 4i)"),
        // A NaN operand of min/max gives the other one.
        ("fminf(params.p_a, 1.0f)", "bx_min_f32(params.p_a, 1.0f)"),
    ] {
        assert!(cuda.contains(c), "{c} not in\n{cuda}");
        assert!(wgsl.contains(w), "{w} not in\n{wgsl}");
    }
}

#[test]
fn closed_expressions_are_folded_with_the_ir_semantics() {
    let p = program(
        "#[attention(score = |s, b, h, q, kv| s + ((2147483647 + 1) as f32) + 1.0 / 0.0)] struct V;",
    );
    let (cuda, wgsl) = both(&p, &p.score);
    assert!(
        cuda.contains("(-2147483600.0f)") && cuda.contains("__int_as_float(2139095040)"),
        "{cuda}"
    );
    assert!(
        wgsl.contains("(-2147483600.0f)") && wgsl.contains("bx_inf()"),
        "{wgsl}"
    );
}

#[test]
fn unread_arguments_are_taken_and_marked_in_cuda_only() {
    let p = program("#[attention(mask = |b, h, q, kv| kv < q)] struct Strict;");
    let (cuda, wgsl) = both(&p, &p.mask);
    assert_eq!(
        cuda,
        "__device__ __forceinline__ bool variant_mask(const Params& params, unsigned* __restrict__ captures, \
         int b, int h, int q, int kv) {\n    \
         (void)captures;\n    (void)b;\n    (void)h;\n    \
         const int l0 = bx_add_i32(q, params.win_q);\n    const int l1 = bx_add_i32(kv, params.win_kv);\n    \
         return (l1 < l0);\n}\n"
    );
    assert_eq!(
        wgsl,
        "fn variant_mask(b: i32, h: i32, q: i32, kv: i32) -> bool {\n    \
         let l0: i32 = (q + params.win_q);\n    let l1: i32 = (kv + params.win_kv);\n    \
         return (l1 < l0);\n}\n"
    );
    // Without positions, nothing is shifted and the block is unread.
    let (cuda, _) = both(
        &program("#[attention(score = |s, b, h, q, kv| 2.0 * s)] struct D;"),
        &p.score,
    );
    assert!(
        cuda.contains("(void)params;") && !cuda.contains("win_"),
        "{cuda}"
    );
}

#[test]
fn let_bindings_become_locals_in_order() {
    let p = program(
        "#[attention(score = |s, b, h, q, kv| { let t = s * self.c; let u = t + 1.0; u * t + u })] \
         struct L { c: f32 }",
    );
    let (cuda, wgsl) = both(&p, &p.score);
    let (c0, c1) = (
        cuda.find("const float l0 = __fmul_rn(s, params.p_c);"),
        cuda.find("const float l1 = __fadd_rn(l0, 1.0f);"),
    );
    assert!(c0.is_some() && c1 > c0, "{cuda}");
    let (w0, w1) = (
        wgsl.find("let l0: f32 = (s * params.p_c);"),
        wgsl.find("let l1: f32 = (l0 + 1.0f);"),
    );
    assert!(w0.is_some() && w1 > w0, "{wgsl}");
}

#[test]
fn the_params_struct_fills_the_block_in_both_dialects() {
    let p = program(
        "#[attention(mask = |b, h, q, kv| self.on && kv as u32 <= self.n)] \
         struct V { cap: f32, on: bool, n: u32, w: i32 }",
    );
    let cuda = variant_section::<Cuda>(&p);
    assert!(
        cuda.contains(
            "struct Params {\n    float p_cap;\n    unsigned p_on;\n    unsigned p_n;\n    int p_w;\n    \
             unsigned _pad[28];\n    int win_q;\n    int win_kv;\n    unsigned win_no_sink;\n    \
             unsigned win_spare;\n};\nstatic_assert(sizeof(Params) == 144,"
        ),
        "{cuda}"
    );
    let wgsl = variant_section::<Wgsl>(&p);
    assert!(
        wgsl.contains(
            "struct Params {\n    p_cap: f32,\n    p_on: u32,\n    p_n: u32,\n    p_w: i32,\n    \
             pad: array<vec4<u32>, 7>,\n    win_q: i32,\n    win_kv: i32,\n    win_no_sink: u32,\n    \
             win_spare: u32,\n}"
        ),
        "{wgsl}"
    );
}

#[test]
fn tensor_reads_are_arena_words_and_checked_reads_report_on_their_path() {
    let p = program(
        "#[attention(score = |s, b, h, q, kv| if kv > 3 { s + self.t[kv - 4] } else { s * self.w[h] }, \
           mask = |b, h, q, kv| self.doc[b][kv] == self.doc[b][q])] \
         struct V<R: Runtime> { #[tensor(f32, [8])] t: Tensor<R>, #[tensor(f32, [Hq])] w: Tensor<R>, \
           #[tensor(i32, [B, Sk])] doc: Tensor<R> }",
    );
    let (cuda, wgsl) = both(&p, &p.score);
    // `w[h]` is proved in range: a plain load. `t[kv - 4]` is checked above
    // (it may reach past 8), and reports only where `kv > 3` holds, at a
    // visible pair (`seen`).
    assert!(
        cuda.contains("__uint_as_float(bx_capture(captures, (params.p_w_off + ((unsigned)(h)))))"),
        "{cuda}"
    );
    assert!(
        wgsl.contains("bitcast<f32>(bx_capture((params.p_w_off + bitcast<u32>(h))))"),
        "{wgsl}"
    );
    assert!(
        wgsl.contains("let l0: i32 = (kv + params.win_kv);"),
        "{wgsl}"
    );
    assert!(wgsl.contains("let l1: bool = (l0 > 3i);"), "{wgsl}");
    assert!(
        wgsl.contains(
            "bx_capture_checked((params.p_t_off + bitcast<u32>((l0 - 4i))), \
             (bitcast<u32>((l0 - 4i)) < params.p_t_d0), (seen && l1), 0u, bitcast<u32>((l0 - 4i)), 0u, 0u, 0u)"
        ),
        "{wgsl}"
    );
    assert!(
        wgsl.contains(
            "fn variant_score(s: f32, b: i32, h: i32, q: i32, kv: i32, seen: bool) -> f32"
        ),
        "{wgsl}"
    );
    // Without a checked read, `seen` is taken and unused.
    let (cuda_mask, _) = both(&p, &p.score_grad);
    assert!(cuda_mask.contains(", int kv, bool seen) {"), "{cuda_mask}");
    // The classifier bounds `doc` over the tile's positions from summaries.
    let classify = code::<Wgsl, _>(&lower::function(&p, &p.classify)).to_string();
    assert!(
        classify.contains("bx_summary((params.p_doc_s1 + "),
        "{classify}"
    );
    assert_eq!(p.summaries, [(2, 1)]);
}

#[test]
fn a_sink_is_a_function_of_the_row_that_reports_only_for_live_rows() {
    let p = program(
        "#[attention(mask = |b, h, q, kv| kv <= q, sink = |b, h, q| self.sinks[h][q - 2]) ] \
         struct V<R: Runtime> { #[tensor(f32, [Hq, _])] sinks: Tensor<R> }",
    );
    assert!(p.weights.sink);
    let (cuda, wgsl) = both(&p, &p.sink);
    assert!(
        wgsl.contains("fn variant_sink(b: i32, h: i32, q: i32, seen: bool) -> f32"),
        "{wgsl}"
    );
    assert!(cuda.contains(", int q, bool seen) {"), "{cuda}");
    // `q - 2` may be out of range: checked, reported where the row exists.
    assert!(wgsl.contains("bx_capture_checked("), "{wgsl}");
    assert!(wgsl.contains(", seen, 0u, "), "{wgsl}");
    // A call whose rows do not carry the sink (a ring's) has none.
    assert!(
        wgsl.contains("return select(bitcast<f32>(bx_capture_checked(")
            && wgsl.contains("(- bx_inf()), (params.win_no_sink != 0u));"),
        "{wgsl}"
    );
    // Without a sink: -inf, and no read.
    let none = program("#[attention(mask = |b, h, q, kv| kv <= q)] struct W;");
    assert!(!none.weights.sink);
    let (_, wgsl) = both(&none, &none.sink);
    assert!(wgsl.contains("return (- bx_inf());"), "{wgsl}");
}
