//! The WGSL target: every generated module parses and validates with naga.

use kernels_spec::compile_str;
use kernels_spec::emit::wgsl::{self, WgslTiles};
use kernels_spec::ir::Program;
use naga::valid::{Capabilities, ValidationFlags, Validator};

const HEAD_DIMS: [u32; 6] = [32, 40, 64, 80, 96, 128];

const VARIANTS: &[&str] = &[
    "#[attention()] struct Full;",
    "#[attention(mask = |b, h, q, kv| kv <= q)] struct Causal;",
    "#[attention(mask = |b, h, q, kv| kv <= q && q - kv < self.w)] struct Window { w: i32 }",
    "#[attention(score = |s, b, h, q, kv| s - exp2(-8.0 * ((h + 1) as f32) / (self.heads as f32)) * ((q - kv) as f32), mask = |b, h, q, kv| kv <= q)] struct Alibi { heads: u32 }",
    "#[attention(score = |s, b, h, q, kv| self.cap * tanh(s / self.cap))] struct Softcap { cap: f32 }",
    "#[attention(mask = |b, h, q, kv| kv < self.p || kv <= q)] struct PrefixLm { p: i32 }",
    "#[attention(score = |s, b, h, q, kv| { let t = clamp(s, -self.c, self.c); \
       let u = if self.flip { sigmoid(t) } else { log(1.0 + abs(t)) + log2(2.0 + sqrt(t * t)) }; \
       floor(u * 4.0) / 4.0 + ceil(min(u, 0.5)) * max(exp(t * 0.1), 0.0) + (self.n as f32) - ((q / 3) % 2) as f32 }, \
       mask = |b, h, q, kv| { let d = q - kv; (!self.flip || d >= 0) && (d / self.k) % 2 == 0 \
       && (kv as u32) % self.n < self.n / 2 + 1 && abs(d) < 1000 && min(d, 5) > -100 && max(kv, 0) >= 0 \
       && clamp(h, 0, 7) == h && (b * 2 - 1) != 3 && ((q as f32) * 0.5 >= -1.0 || true) && !(self.c as i32 == 99) })] \
       struct Everything { c: f32, flip: bool, n: u32, k: i32 }",
];

fn program(source: &str) -> Program {
    match compile_str(source) {
        Ok(c) => c.program,
        Err(d) => panic!("{source} failed to compile: {:?}", d.messages()),
    }
}

fn validate(what: &str, source: &str) {
    let module = match naga::front::wgsl::parse_str(source) {
        Ok(m) => m,
        Err(e) => panic!(
            "{what}: WGSL parse error:\n{}\n---- source ----\n{}",
            e.emit_to_string(source),
            numbered(source)
        ),
    };
    if let Err(e) = Validator::new(ValidationFlags::all(), Capabilities::empty()).validate(&module)
    {
        panic!(
            "{what}: naga validation error:\n{}\n---- source ----\n{}",
            e.emit_to_string(source),
            numbered(source)
        );
    }
}

fn numbered(source: &str) -> String {
    source
        .lines()
        .enumerate()
        .map(|(i, l)| format!("{:4} {l}\n", i + 1))
        .collect()
}

#[test]
fn every_module_validates() {
    for source in VARIANTS {
        let p = program(source);
        for d in HEAD_DIMS {
            let cfg = WgslTiles::for_head_dim(d);
            cfg.validate().expect("default tiles validate");
            validate(
                &format!("{} forward D={d}", p.name),
                &wgsl::forward_module(&p, &cfg),
            );
            let (dq, dkdv) = wgsl::backward_modules(&p, &cfg);
            validate(&format!("{} backward dq D={d}", p.name), &dq);
            validate(&format!("{} backward dkdv D={d}", p.name), &dkdv);
        }
    }
}

#[test]
fn default_tiles_fit() {
    for d in HEAD_DIMS {
        let t = WgslTiles::for_head_dim(d);
        assert!(t.workgroup_bytes() <= 16384, "{t:?}");
        assert!(
            t.block_q >= 8 && t.block_kv >= 8,
            "{t:?} is needlessly small"
        );
        // One more staged row would not fit.
        let more = WgslTiles {
            block_q: t.block_q + 1,
            block_kv: t.block_kv + 1,
            ..t
        };
        assert!(
            t.block_q == WgslTiles::MAX_STAGED || more.validate().is_err(),
            "{t:?} leaves room"
        );
    }
    let t = WgslTiles::for_head_dim(64);
    assert_eq!((t.block_q, t.block_kv, t.workgroup_size), (31, 32, 64));
}

#[test]
fn oversize_configs_are_rejected() {
    let big = WgslTiles {
        head_dim: 128,
        block_q: 64,
        block_kv: 64,
        workgroup_size: 128,
    };
    let e = big.validate().unwrap_err();
    assert!(e.contains("16384"), "{e}");
    assert!(e.contains("maxComputeWorkgroupStorageSize"), "{e}");
    let wide = WgslTiles {
        head_dim: 32,
        block_q: 8,
        block_kv: 8,
        workgroup_size: 512,
    };
    let e = wide.validate().unwrap_err();
    assert!(e.contains("256"), "{e}");
}

#[test]
fn causal_variant_functions_contain_the_classifier() {
    let p = program("#[attention(mask = |b, h, q, kv| kv <= q)] struct Causal;");
    let text = wgsl::variant_functions(&p);
    assert!(
        text.contains("fn variant_classify(b: i32, h: i32, q_lo: i32, q_hi: i32, kv_lo: i32, kv_hi: i32) -> i32 {"),
        "{text}"
    );
    assert!(
        text.contains(
            "fn variant_mask(b: i32, h: i32, q: i32, kv: i32) -> bool {\n    return (kv <= q);\n}"
        ),
        "{text}"
    );
    assert!(text.contains("kv_hi"), "{text}");
    // The classifier is not the constant FULL of an unmasked variant.
    assert!(!text.contains("-> i32 {\n    return 2i;\n}"), "{text}");
}

#[test]
fn params_struct_is_padded_and_bool_is_u32() {
    let p = program(
        "#[attention(mask = |b, h, q, kv| self.on && kv <= q + self.w)] struct X { on: bool, w: i32 }",
    );
    let text = wgsl::variant_functions(&p);
    assert!(
        text.contains(
            "struct Params {\n    p_on: u32,\n    p_w: i32,\n    pad_0: u32,\n    pad_1: u32,\n}"
        ),
        "{text}"
    );
    assert!(text.contains("(params.p_on != 0u)"), "{text}");
    let full = program("#[attention()] struct F;");
    assert!(wgsl::variant_functions(&full).contains("struct Params {\n    pad_0: u32,"));
}

#[test]
fn constants_are_folded_with_ir_semantics() {
    // Overflow and division by zero in constant sub-expressions must not reach
    // naga's constant evaluator (a shader-creation error there).
    let p = program(
        "#[attention(mask = |b, h, q, kv| kv <= q + (2147483647 + 1) / (1 - 1) + 2147483647 * 2)] struct C;",
    );
    let text = wgsl::variant_functions(&p);
    assert!(!text.contains("2147483647i + 1i"), "{text}");
    validate(
        "folding",
        &wgsl::forward_module(&p, &WgslTiles::for_head_dim(64)),
    );
}

#[test]
fn non_finite_and_tiny_floats_have_no_literal() {
    let p = program(
        "#[attention(score = |s, b, h, q, kv| s * 0.0000000001 + exp(1000.0) * 0.0 + exp(1000.0) - exp(1000.0 - s))] struct F;",
    );
    let text = wgsl::variant_functions(&p);
    assert!(
        text.contains("bx_inf()") || text.contains("bx_nan()"),
        "{text}"
    );
    validate(
        "non-finite",
        &wgsl::forward_module(&p, &WgslTiles::for_head_dim(32)),
    );
}
