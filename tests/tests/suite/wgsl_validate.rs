//! naga parses and validates every WGSL module the compiler generates: each
//! module of every declared variant (the stock ones and the test fixtures)
//! at every head dim of the standard cases and at the standard pairs of a
//! value head dim apart from the keys' (MLA's 192/128 and 576/512, 128/64,
//! 64/32), rolled and unrolled, and the
//! corner cases of constant folding, where a constant expression that
//! overflows or is not finite would be a shader-creation error.

use crate::fixtures;

use boostr_runtime::variant::Target;
use kernels_spec::compile_str;
use kernels_spec::emit::choose_tiles;
use kernels_spec::emit::gpu::variant_section;
use kernels_spec::emit::wgsl::{Wgsl, WgslTiles, kernels, module_source};
use naga::valid::{Capabilities, ValidationFlags, Validator};

/// `(D, DV)`.
const HEAD_DIMS: [(u32, u32); 10] = [
    (32, 32),
    (40, 40),
    (64, 64),
    (80, 80),
    (96, 96),
    (128, 128),
    (64, 32),
    (128, 64),
    (192, 128),
    (576, 512),
];

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

/// Every module around `section` at head dims `(d, dv)`, with the tiles
/// the runtime picks for `tile`.
fn validate_modules(
    name: &str,
    section: &str,
    tile: (Option<u32>, Option<u32>),
    (d, dv): (u32, u32),
) {
    let cfg = choose_tiles(WgslTiles::for_head_dims(d, dv), tile.0, tile.1).expect("tiles");
    for module in [
        &kernels::FORWARD,
        &kernels::MERGE,
        &kernels::BACKWARD_DQ,
        &kernels::BACKWARD_DKDV,
        &kernels::BACKWARD_TENSORS,
    ] {
        let source = module_source(section, module, &cfg).expect("the tiles validate");
        validate(&format!("{name} {} D={d} Dv={dv}", module.name), &source);
    }
}

#[test]
fn every_declared_variant_validates() {
    for declared in fixtures::all() {
        let section = declared
            .compiled
            .lowering(Target::Wgsl)
            .expect("a declared variant has a WGSL lowering");
        for d in HEAD_DIMS {
            validate_modules(declared.compiled.name, section, declared.tile, d);
        }
    }
}

#[test]
fn the_summary_kernel_validates() {
    validate("summarize", kernels::SUMMARY_SOURCE);
    assert!(
        kernels::SUMMARY_SOURCE.contains(&format!(
            "const BLOCK: u32 = {}u;",
            kernels_spec::params::SUMMARY_BLOCK
        )) && kernels::SUMMARY_SOURCE
            .contains(&format!("@workgroup_size({})", kernels::SUMMARY_WORKGROUP)),
        "the summary kernel's constants follow kernels_spec"
    );
}

/// A declaration given as text, validated at `d`.
fn validate_declaration(source: &str, d: u32) -> String {
    let program = match compile_str(source) {
        Ok(c) => c.program,
        Err(e) => panic!("{source} failed to compile: {:?}", e.messages()),
    };
    let section = variant_section::<Wgsl>(&program);
    validate_modules(&program.name, &section, program.tile, (d, d));
    section
}

#[test]
fn constants_are_folded_with_ir_semantics() {
    // Overflow and division by zero in constant sub-expressions must not reach
    // naga's constant evaluator.
    let text = validate_declaration(
        "#[attention(mask = |b, h, q, kv| kv <= q + (2147483647 + 1) / (1 - 1) + 2147483647 * 2)] struct C;",
        64,
    );
    assert!(!text.contains("2147483647i + 1i"), "{text}");
}

#[test]
fn non_finite_and_tiny_floats_have_no_literal() {
    let text = validate_declaration(
        "#[attention(score = |s, b, h, q, kv| s * 0.0000000001 + exp(1000.0) * 0.0 + exp(1000.0) - exp(1000.0 - s))] struct F;",
        32,
    );
    assert!(
        text.contains("bx_inf()") || text.contains("bx_nan()"),
        "{text}"
    );
}
