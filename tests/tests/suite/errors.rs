//! Bad input is an `Err` naming the rule and the values, never a panic.

use boostr_runtime::stock::{Causal, Documents, Full, RelativeBias};
use boostr_runtime::{
    AttentionOptions, Backward, Error, Keys, attention, attention_backward, var_attention,
    var_flash_attention,
};
use numr::autograd::Var;
use numr::prelude::*;

fn tensor(shape: &[usize]) -> Tensor<CpuRuntime> {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5)
        .collect();
    Tensor::<CpuRuntime>::from_slice(&data, shape, &CpuDevice::new()).expect("tensor")
}

fn fwd_err(q: &[usize], k: &[usize], v: &[usize]) -> Error {
    attention(
        &Full,
        &tensor(q),
        Keys::dense(&tensor(k), &tensor(v)),
        &AttentionOptions::default(),
    )
    .map(|y| (y.out, y.lse))
    .expect_err("invalid shapes must be rejected")
}

#[test]
fn rank_must_be_four() {
    let e = fwd_err(&[2, 3, 8], &[1, 2, 3, 8], &[1, 2, 3, 8]);
    assert!(matches!(e, Error::Rank { name: "q", .. }), "{e}");
    assert!(e.to_string().contains("[2, 3, 8]"), "{e}");
}

#[test]
fn batch_heads_lengths_and_dims_must_agree() {
    type Shape = &'static [usize];
    // (k and v of batch 1 with q of batch 2 are keys shared by the batch;
    // k of one alone is not.)
    let cases: [(Shape, Shape, Shape, &str); 5] = [
        (&[2, 2, 3, 8], &[3, 2, 3, 8], &[3, 2, 3, 8], "batch"),
        (&[2, 2, 3, 8], &[1, 2, 3, 8], &[2, 2, 3, 8], "batch"),
        (&[1, 2, 3, 8], &[1, 2, 3, 8], &[1, 1, 3, 8], "heads"),
        (
            &[1, 2, 3, 8],
            &[1, 2, 5, 8],
            &[1, 2, 4, 8],
            "sequence length",
        ),
        (&[1, 2, 3, 8], &[1, 2, 3, 4], &[1, 2, 3, 8], "head dim"),
    ];
    for (q, k, v, rule) in cases {
        let e = fwd_err(q, k, v);
        assert!(matches!(e, Error::Shapes { .. }), "{e}");
        assert!(e.to_string().contains(rule), "{rule}: {e}");
    }
}

#[test]
fn values_may_have_their_own_head_dim_which_out_and_dout_follow() {
    // q, k [.., D = 8]; v [.., Dv = 4]: out [.., Dv], default scale 1/sqrt(D).
    let (q, k, v) = (
        tensor(&[1, 2, 3, 8]),
        tensor(&[1, 1, 5, 8]),
        tensor(&[1, 1, 5, 4]),
    );
    let opts = AttentionOptions::default();
    let (out, lse) = attention(&Causal, &q, Keys::dense(&k, &v), &opts)
        .map(|y| (y.out, y.lse))
        .unwrap();
    assert_eq!(out.shape(), &[1, 2, 3, 4]);
    let explicit = AttentionOptions::default().with_scale(1.0 / 8f32.sqrt());
    let (same, _) = attention(&Causal, &q, Keys::dense(&k, &v), &explicit)
        .map(|y| (y.out, y.lse))
        .unwrap();
    assert_eq!(
        out.to_vec::<f32>(),
        same.to_vec::<f32>(),
        "the default scale"
    );
    // A dout shaped with D instead of Dv.
    let e = attention_backward(
        &Causal,
        &q,
        Keys::dense(&k, &v),
        Backward::from_tensors(&out, &lse, &q),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .unwrap_err();
    assert!(matches!(e, Error::ShapeOf { name: "dout", .. }), "{e}");
    assert!(e.to_string().contains("[1, 2, 3, 4]"), "{e}");
    // An out shaped with D.
    let e = attention_backward(
        &Causal,
        &q,
        Keys::dense(&k, &v),
        Backward::from_tensors(&q, &lse, &out),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .unwrap_err();
    assert!(matches!(e, Error::ShapeOf { name: "out", .. }), "{e}");
    // k and v that disagree in anything but the last dim.
    for (bad, rule) in [
        (&[2, 1, 5, 4][..], "batch"),
        (&[1, 2, 5, 4][..], "heads"),
        (&[1, 1, 6, 4][..], "sequence length"),
    ] {
        let e = attention(&Causal, &q, Keys::dense(&k, &tensor(bad)), &opts)
            .map(|y| (y.out, y.lse))
            .unwrap_err();
        assert!(matches!(e, Error::Shapes { .. }), "{rule}: {e}");
        assert!(e.to_string().contains(rule), "{rule}: {e}");
    }
}

#[test]
fn query_heads_must_be_a_multiple_of_kv_heads() {
    let e = fwd_err(&[1, 3, 4, 8], &[1, 2, 4, 8], &[1, 2, 4, 8]);
    assert!(
        matches!(
            e,
            Error::Heads {
                heads_q: 3,
                heads_kv: 2
            }
        ),
        "{e}"
    );
}

#[test]
fn zero_size_dimensions_are_rejected() {
    let e = fwd_err(&[1, 2, 0, 8], &[1, 2, 3, 8], &[1, 2, 3, 8]);
    assert!(matches!(e, Error::ZeroSize { name: "q", .. }), "{e}");
    let e = fwd_err(&[1, 2, 3, 8], &[1, 2, 0, 8], &[1, 2, 0, 8]);
    assert!(matches!(e, Error::ZeroSize { name: "k", .. }), "{e}");
}

#[test]
fn unsupported_and_mixed_dtypes_are_rejected_on_the_cpu() {
    let device = CpuDevice::new();
    let q = Tensor::<CpuRuntime>::from_slice(&[0.5f64; 16], &[1, 1, 2, 8], &device).unwrap();
    let k = tensor(&[1, 1, 2, 8]);
    let e = attention(&Full, &q, Keys::dense(&k, &k), &AttentionOptions::default())
        .map(|y| (y.out, y.lse))
        .unwrap_err();
    assert!(matches!(e, Error::DType { name: "q", .. }), "{e}");
    assert!(e.to_string().contains("F64"), "{e}");

    // bf16 q with f32 k: every tensor must share q's dtype.
    let bits = [0x3f00u16; 16]; // 0.5 in bf16
    let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let q = Tensor::<CpuRuntime>::from_bytes(&bytes, &[1, 1, 2, 8], DType::BF16, &device).unwrap();
    let e = attention(&Full, &q, Keys::dense(&k, &k), &AttentionOptions::default())
        .map(|y| (y.out, y.lse))
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::DType {
                name: "k",
                dtype: DType::F32,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("dtype of q"), "{e}");
}

#[test]
fn scale_must_be_finite() {
    let q = tensor(&[1, 1, 2, 8]);
    let opts = AttentionOptions::default().with_scale(f32::NAN);
    let e = attention(&Full, &q, Keys::dense(&q, &q), &opts)
        .map(|y| (y.out, y.lse))
        .unwrap_err();
    assert!(matches!(e, Error::Scale(_)), "{e}");
}

#[test]
fn backward_checks_out_lse_and_dout() {
    let q = tensor(&[1, 2, 3, 8]);
    let opts = AttentionOptions::default();
    let (out, lse) = attention(&Causal, &q, Keys::dense(&q, &q), &opts)
        .map(|y| (y.out, y.lse))
        .unwrap();
    let bad = tensor(&[1, 2, 3, 4]);
    let e = attention_backward(
        &Causal,
        &q,
        Keys::dense(&q, &q),
        Backward::from_tensors(&out, &lse, &bad),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .unwrap_err();
    assert!(matches!(e, Error::ShapeOf { name: "dout", .. }), "{e}");
    let e = attention_backward(
        &Causal,
        &q,
        Keys::dense(&q, &q),
        Backward::from_tensors(&out, &bad, &out),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .unwrap_err();
    assert!(matches!(e, Error::ShapeOf { name: "lse", .. }), "{e}");
}

#[test]
fn flash_attention_arguments_must_match_the_shapes() {
    let q = Var::new(tensor(&[1, 4, 3, 8]), true);
    let k = Var::new(tensor(&[1, 2, 3, 8]), true);
    for (heads, kv_heads, dim, name) in [
        (2, 2, 8, "num_heads"),
        (4, 1, 8, "num_kv_heads"),
        (4, 2, 16, "head_dim"),
    ] {
        let e = var_flash_attention(&q, &k, &k, heads, kv_heads, dim, true, 0).unwrap_err();
        assert!(
            matches!(e, Error::Argument { name: n, .. } if n == name),
            "{name}: {e}"
        );
    }
}

#[test]
fn inputs_without_grad_make_no_graph_node() {
    let q = Var::new(tensor(&[1, 2, 5, 8]), false);
    let out = var_attention(
        &Causal,
        &q,
        Keys::dense(&q, &q),
        &AttentionOptions::default(),
    )
    .map(|y| y.out)
    .unwrap();
    assert!(!out.requires_grad());
    assert!(out.grad_fn().is_none());

    let k = Var::new(tensor(&[1, 2, 5, 8]), true);
    let out = var_attention(
        &Causal,
        &q,
        Keys::dense(&k, &q),
        &AttentionOptions::default(),
    )
    .map(|y| y.out)
    .unwrap();
    assert!(out.requires_grad());
    assert!(out.grad_fn().is_some());
}

#[test]
fn flash_attention_is_the_flash_mask_variant() {
    let q = tensor(&[2, 4, 9, 16]);
    let k = tensor(&[2, 2, 13, 16]);
    let v = tensor(&[2, 2, 13, 16]);
    let (qv, kv, vv) = (
        Var::new(q.clone(), false),
        Var::new(k.clone(), false),
        Var::new(v.clone(), false),
    );
    let flash = var_flash_attention(&qv, &kv, &vv, 4, 2, 16, true, 0).unwrap();
    let (causal, _) = attention(
        &Causal,
        &q,
        Keys::dense(&k, &v),
        &AttentionOptions::default(),
    )
    .map(|y| (y.out, y.lse))
    .unwrap();
    let (a, b) = (flash.tensor().to_vec::<f32>(), causal.to_vec::<f32>());
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= 1e-6,
        "flash causal vs stock causal differ by {worst}"
    );
}

/// `q, k, v [1, 2, 5, 8]`.
fn qkv() -> [Tensor<CpuRuntime>; 3] {
    [
        tensor(&[1, 2, 5, 8]),
        tensor(&[1, 2, 5, 8]),
        tensor(&[1, 2, 5, 8]),
    ]
}

fn ints(values: &[i32], shape: &[usize]) -> Tensor<CpuRuntime> {
    Tensor::<CpuRuntime>::from_slice(values, shape, &CpuDevice::new()).expect("tensor")
}

fn documents_err(doc: Tensor<CpuRuntime>) -> Error {
    let [q, k, v] = qkv();
    attention(
        &Documents { doc },
        &q,
        Keys::dense(&k, &v),
        &AttentionOptions::default(),
    )
    .map(|y| (y.out, y.lse))
    .expect_err("a captured tensor that does not match its declaration")
}

#[test]
fn a_captured_tensor_must_match_its_declaration() {
    // dtype: i32 declared, f32 given.
    let e = documents_err(tensor(&[1, 5]));
    assert!(
        matches!(
            e,
            Error::CaptureDType {
                field: "doc",
                expected: DType::I32,
                got: DType::F32
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("`doc`"), "{e}");
    // rank: [B, Sk] declared, a vector given.
    let e = documents_err(ints(&[0; 5], &[5]));
    assert!(matches!(e, Error::CaptureShape { field: "doc", .. }), "{e}");
    assert!(
        e.to_string().contains("[B = 1, Sk = 5]") && e.to_string().contains("[5]"),
        "{e}"
    );
    // a declared size: Sk = 5, 4 given.
    let e = documents_err(ints(&[0; 4], &[1, 4]));
    assert!(
        e.to_string().contains("[B = 1, Sk = 5]") && e.to_string().contains("[1, 4]"),
        "{e}"
    );
}

/// A bias table one column short of `2·max_distance + 1`: the pair at
/// distance 2 reads column 4 of a table of 4.
fn short_table() -> RelativeBias<CpuRuntime> {
    RelativeBias {
        table: Tensor::<CpuRuntime>::from_slice(&[0.5f32; 8], &[2, 4], &CpuDevice::new())
            .expect("tensor"),
        max_distance: 2,
    }
}

#[test]
fn a_read_out_of_range_names_the_field_the_index_and_the_shape() {
    let [q, k, v] = qkv();
    let e = attention(
        &short_table(),
        &q,
        Keys::dense(&k, &v),
        &AttentionOptions::default(),
    )
    .map(|y| (y.out, y.lse))
    .expect_err("a read past the table");
    match &e {
        Error::IndexOutOfRange {
            field,
            index,
            shape,
        } => {
            assert_eq!(
                (*field, shape.as_slice()),
                ("table", &[2usize, 4][..]),
                "{e}"
            );
            assert_eq!(index[1], 4, "{e}");
        }
        other => panic!("expected a read out of range, got {other}"),
    }
    assert!(e.to_string().contains("`table`"), "{e}");
    // Documents over key positions with more queries than keys: the first
    // rows' positions are negative.
    let (q, kv) = (tensor(&[1, 2, 7, 8]), tensor(&[1, 2, 5, 8]));
    let e = attention(
        &Documents {
            doc: ints(&[0, 0, 1, 1, 1], &[1, 5]),
        },
        &q,
        Keys::dense(&kv, &kv),
        &AttentionOptions::default(),
    )
    .map(|y| (y.out, y.lse))
    .expect_err("negative positions");
    assert!(
        matches!(&e, Error::IndexOutOfRange { field: "doc", index, .. } if index[1] < 0),
        "{e}"
    );
}

#[test]
fn the_backward_and_the_autograd_op_report_the_same_reads() {
    let [q, k, v] = qkv();
    let variant = short_table();
    let opts = AttentionOptions::default();
    let e = attention_backward(
        &variant,
        &q,
        Keys::dense(&k, &v),
        Backward::from_tensors(&q, &tensor(&[1, 2, 5]), &q),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .expect_err("the backward reads past the table too");
    assert!(
        matches!(e, Error::IndexOutOfRange { field: "table", .. }),
        "{e}"
    );
    let (qv, kv, vv) = (Var::new(q, true), Var::new(k, true), Var::new(v, true));
    let e = var_attention(&variant, &qv, Keys::dense(&kv, &vv), &opts)
        .map(|y| y.out)
        .expect_err("and the autograd op");
    assert!(
        matches!(e, Error::IndexOutOfRange { field: "table", .. }),
        "{e}"
    );
}
