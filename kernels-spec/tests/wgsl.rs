//! The WGSL target: the parameter block, the bindings and the tile sizes
//! follow their rules. (naga validates the generated modules in the
//! workspace's `tests` crate, `tests/wgsl_validate.rs`.)

use kernels_spec::compile_str;
use kernels_spec::emit::TilingError;
use kernels_spec::emit::gpu::variant_section;
use kernels_spec::emit::wgsl::interface::Binding;
use kernels_spec::emit::wgsl::{self, Wgsl, WgslTiles, kernels};
use kernels_spec::ir::Program;

/// `(D, DV)`: equal dims, and the pairs of MLA (prefill 192/128, absorbed
/// decode 576/512) and of halved values.
const HEAD_DIMS: [(u32, u32); 10] = [
    (32, 32),
    (40, 40),
    (64, 64),
    (80, 80),
    (96, 96),
    (128, 128),
    (192, 128),
    (576, 512),
    (128, 64),
    (64, 32),
];

fn program(source: &str) -> Program {
    match compile_str(source) {
        Ok(c) => c.program,
        Err(d) => panic!("{source} failed to compile: {:?}", d.messages()),
    }
}

#[test]
fn default_tiles_fit() {
    for (d, dv) in HEAD_DIMS {
        let t = WgslTiles::for_head_dims(d, dv);
        t.validate().unwrap_or_else(|e| panic!("{t:?}: {e}"));
        assert!(t.workgroup_bytes() <= 16384, "{t:?}");
        // Eight staged rows where a row pair fits eight times.
        let fits = 16384 / (4 * (d + dv) + 8);
        assert!(
            t.block_q >= fits.min(8) && t.block_kv >= fits.min(8),
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
    let t = WgslTiles::for_head_dims(576, 512);
    assert_eq!((t.block_q, t.block_kv), (3, 3));
}

#[test]
fn oversize_configs_are_rejected() {
    let big = WgslTiles {
        head_dim: 128,
        value_dim: 128,
        block_q: 64,
        block_kv: 64,
        workgroup_size: 128,
    };
    let e = big.validate().unwrap_err();
    assert!(
        matches!(
            e,
            TilingError::Memory {
                max: 16384,
                limit: "maxComputeWorkgroupStorageSize",
                ..
            }
        ),
        "{e}"
    );
    let wide = WgslTiles {
        head_dim: 32,
        value_dim: 32,
        block_q: 8,
        block_kv: 8,
        workgroup_size: 512,
    };
    let e = wide.validate().unwrap_err();
    assert!(
        matches!(
            e,
            TilingError::Size {
                what: "workgroup_size",
                value: 512,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("1..=256"), "{e}");
    // A module is never assembled around a configuration that does not fit.
    let p = program("#[attention()] struct F;");
    let err = wgsl::module_source(&variant_section::<Wgsl>(&p), &kernels::FORWARD, &big);
    assert_eq!(err.unwrap_err(), big.validate().unwrap_err());
}

#[test]
fn a_masked_variant_section_contains_the_classifier() {
    let p =
        program("#[attention(mask = |b, h, q, kv| kv + self.lag <= q)] struct Lagged { lag: i32 }");
    let text = variant_section::<Wgsl>(&p);
    assert!(
        text.contains("fn variant_classify(b: i32, h: i32, q_lo: i32, q_hi: i32, kv_lo: i32, kv_hi: i32) -> i32 {"),
        "{text}"
    );
    assert!(
        text.contains(
            "fn variant_mask(b: i32, h: i32, q: i32, kv: i32) -> bool {\n    \
             let l0: i32 = (q + params.win_q);\n    let l1: i32 = (kv + params.win_kv);\n    \
             return ((l1 + params.p_lag) <= l0);\n}"
        ),
        "{text}"
    );
    assert!(text.contains("kv_hi"), "{text}");
    // The classifier is not the constant FULL of an unmasked variant.
    assert!(!text.contains("-> i32 {\n    return 2i;\n}"), "{text}");
}

#[test]
fn params_block_is_36_words_and_bool_is_u32() {
    let p = program(
        "#[attention(mask = |b, h, q, kv| self.on && kv <= q + self.w)] struct X { on: bool, w: i32 }",
    );
    let text = variant_section::<Wgsl>(&p);
    assert!(
        text.contains(
            "struct Params {\n    p_on: u32,\n    p_w: i32,\n    pad_0: u32,\n    pad_1: u32,\n    \
             pad: array<vec4<u32>, 7>,\n    win_q: i32,\n    win_kv: i32,\n    win_no_sink: u32,\n    \
             win_spare: u32,\n}"
        ),
        "{text}"
    );
    assert!(text.contains("(params.p_on != 0u)"), "{text}");
    let full = program("#[attention()] struct F;");
    assert!(
        variant_section::<Wgsl>(&full)
            .contains("struct Params {\n    pad: array<vec4<u32>, 8>,\n    win_q: i32,\n")
    );
}

#[test]
fn bindings_follow_the_module_description() {
    let text = kernels::BACKWARD_DKDV.declarations();
    for (i, line) in [
        "var<uniform> params: Params;",
        "var<uniform> shape: Shape;",
        "var<storage, read_write> captures: array<atomic<u32>>;",
        "var<storage, read> q: array<f32>;",
        "var<storage, read> k: array<f32>;",
        "var<storage, read> v: array<f32>;",
        "var<storage, read> dout: array<f32>;",
        "var<storage, read> rows: array<vec4<f32>>;",
        "var<storage, read_write> dk: array<f32>;",
        "var<storage, read_write> dv: array<f32>;",
    ]
    .iter()
    .enumerate()
    {
        let want = format!("@group(0) @binding({i}) {line}\n");
        assert!(text.contains(&want), "{want} not in\n{text}");
    }
    assert_eq!(
        text.matches("@binding(").count(),
        kernels::BACKWARD_DKDV.bindings.len()
    );
}

#[test]
fn every_module_stays_within_the_default_storage_buffer_limit() {
    use kernels_spec::emit::wgsl::interface::MAX_STORAGE_BUFFERS;
    for module in [
        &kernels::FORWARD,
        &kernels::BACKWARD_DQ,
        &kernels::BACKWARD_DKDV,
    ] {
        assert!(
            module.storage_buffers() <= MAX_STORAGE_BUFFERS,
            "{module}: {} storage buffers, WebGPU guarantees {MAX_STORAGE_BUFFERS}",
            module.storage_buffers()
        );
    }
    // The arena is one of them in every module.
    assert!(
        [
            &kernels::FORWARD,
            &kernels::BACKWARD_DQ,
            &kernels::BACKWARD_DKDV
        ]
        .iter()
        .all(|m| m.bindings.contains(&Binding::Captures))
    );
}

/// `explain` ends with the tiles of both GPU targets at both head dims of
/// each standard pair, the variant's override applied where it validates
/// (16 keys: WGSL takes it where 16 rows of K and V fit, and CUDA's
/// f16/bf16 tiles take it, a multiple of 16).
#[test]
fn explain_prints_the_tiles_at_both_head_dims() {
    let p = program("#[attention(mask = |b, h, q, kv| kv <= q, tile(kv = 16))] struct T;");
    let text = kernels_spec::explain(&p);
    let tiles = &text[text.find("== tiles").expect("a tiles section")..];
    for (d, dv) in kernels_spec::EXPLAINED_HEAD_DIMS {
        for target in ["wgsl", "cuda f32", "cuda f16/bf16"] {
            assert!(
                tiles.contains(&format!("{target} {d}/{dv}: ")),
                "{target} {d}/{dv} missing:\n{tiles}"
            );
        }
        let t = WgslTiles::for_head_dims(d, dv);
        let staged = if 16 * 4 * (d + dv) <= 16384 {
            16
        } else {
            t.block_kv
        };
        let want = format!(
            "wgsl {d}/{dv}: 64 rows per workgroup; {staged} keys staged (forward, dQ), {} query rows",
            t.block_q
        );
        assert!(tiles.contains(&want), "{want}:\n{tiles}");
    }
    assert!(
        tiles.contains("cuda f16/bf16 576/512: forward 16×16 over"),
        "{tiles}"
    );
}
