//! Inputs as model code holds them, on the CPU: `[B, S, H, D]` projections
//! permuted to `[B, H, S, D]`, V as the first columns of K's rows (MLA's
//! absorbed decode, one latent cache, contiguous or paged), and views that
//! do not fit their storage.
//!
//! The CPU reads such views in place; a result must then be the bits of
//! the same call on contiguous copies (the kernels' arithmetic does not
//! depend on where a row lives), and columns outside a view are never
//! read (they hold NaN here).

use boostr_runtime::stock::{Alibi, Causal};
use boostr_runtime::testing::{CpuRuntime, Rng};
use boostr_runtime::{
    AttentionOptions, Backward, Error, Keys, KvScales, Variant, attention, attention_backward,
};
use numr::dtype::DType;
use numr::runtime::cpu::CpuDevice;
use numr::tensor::{Layout, Tensor};

type T = Tensor<CpuRuntime>;

fn host(data: &[f32], shape: &[usize]) -> T {
    Tensor::from_slice(data, shape, &CpuDevice::new()).expect("a host tensor")
}

/// `data` as a host tensor of `dtype` (f32, bf16 or f16; rounded to
/// nearest).
fn typed(data: &[f32], shape: &[usize], dtype: DType) -> T {
    let bytes: Vec<u8> = match dtype {
        DType::BF16 => data
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
        DType::F16 => data
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        _ => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
    };
    Tensor::from_bytes(&bytes, shape, dtype, &CpuDevice::new()).expect("a host tensor")
}

/// `[b, h, s, d]` read from a random `[b, s, h, d]` tensor in `dtype`.
fn permuted(rng: &mut Rng, [b, h, s, d]: [usize; 4], dtype: DType) -> T {
    let x = typed(&rng.normal_f32(b * s * h * d, 1.0), &[b, s, h, d], dtype);
    let x = x.permute(&[0, 2, 1, 3]).expect("a permutation");
    assert!(h == 1 || s == 1 || !x.is_contiguous());
    x
}

fn bits(t: &T) -> Vec<u8> {
    t.to_bytes().expect("the bytes")
}

#[track_caller]
fn same_bits(what: &str, got: &T, want: &T) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let (g, w) = (bits(got), bits(want));
    let diff = g.iter().zip(&w).position(|(a, b)| a != b);
    assert!(diff.is_none(), "{what}: differs at {diff:?}");
}

/// A forward and backward on permuted q, k, v (and dout) against the same
/// calls on contiguous copies.
fn check_permuted<V: Variant>(variant: &V, dims: ([usize; 4], usize, usize), dtype: DType) {
    let ([b, hq, hkv, sq], sk, (d, dv)) = (dims.0, dims.1, (dims.2, dims.2 * 3 / 4));
    let what = format!("{} {dims:?} {dtype:?}", V::NAME);
    let mut rng = Rng::new(0x1a7, sq as u64);
    let q = permuted(&mut rng, [b, hq, sq, d], dtype);
    let k = permuted(&mut rng, [b, hkv, sk, d], dtype);
    let v = permuted(&mut rng, [b, hkv, sk, dv], dtype);
    let dout = permuted(&mut rng, [b, hq, sq, dv], dtype);
    let c = |t: &T| t.contiguous().expect("a copy");
    let opts = AttentionOptions::default();
    let (out, lse) = attention(variant, &q, Keys::dense(&k, &v), &opts)
        .map(|y| (y.out, y.lse))
        .expect("permuted");
    let (out_c, lse_c) = attention(variant, &c(&q), Keys::dense(&c(&k), &c(&v)), &opts)
        .map(|y| (y.out, y.lse))
        .expect("copies");
    same_bits(&format!("out {what}"), &out, &out_c);
    same_bits(&format!("lse {what}"), &lse, &lse_c);
    let grads = attention_backward(
        variant,
        &q,
        Keys::dense(&k, &v),
        Backward::from_tensors(&out, &lse, &dout),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .expect("permuted");
    let (cq, ck, cv, cd) = (c(&q), c(&k), c(&v), c(&dout));
    let want = attention_backward(
        variant,
        &cq,
        Keys::dense(&ck, &cv),
        Backward::from_tensors(&out_c, &lse_c, &cd),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .expect("copies");
    same_bits(&format!("dq {what}"), &grads.0, &want.0);
    same_bits(&format!("dk {what}"), &grads.1, &want.1);
    same_bits(&format!("dv {what}"), &grads.2, &want.2);
}

#[test]
fn permuted_inputs_give_the_bits_of_contiguous_ones() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        // Tile kernel (odd lengths, GQA, Dv ≠ D) and decode kernel.
        check_permuted(&Causal, ([2, 4, 2, 70], 93, 40), dtype);
        check_permuted(&Alibi { heads: 4 }, ([1, 4, 1, 3], 130, 64), dtype);
    }
}

/// One latent cache `[B, 1, Sk, 576]` whose first 512 columns are V:
/// a decode through `attention_fwd` and through a cache with lengths,
/// against V copied out. V's rows are `576` apart in place.
#[test]
fn values_as_a_view_of_the_keys_are_read_in_place() {
    let (b, hq, sk, d, dv) = (2, 16, 200, 576, 512);
    let mut rng = Rng::new(0x31a, 0);
    for dtype in [DType::F32, DType::BF16] {
        let latent = typed(&rng.normal_f32(b * sk * d, 1.0), &[b, 1, sk, d], dtype);
        let q = typed(&rng.normal_f32(b * hq * d, 1.0), &[b, hq, 1, d], dtype);
        let v = latent.narrow(3, 0, dv).expect("a view");
        assert!(!v.is_contiguous());
        let v_copy = v.contiguous().expect("a copy");
        let opts = AttentionOptions::default();
        let (out, lse) = attention(&Causal, &q, Keys::dense(&latent, &v), &opts)
            .map(|y| (y.out, y.lse))
            .expect("the view");
        let (want, want_lse) = attention(&Causal, &q, Keys::dense(&latent, &v_copy), &opts)
            .map(|y| (y.out, y.lse))
            .expect("copy");
        same_bits(&format!("out {dtype:?}"), &out, &want);
        same_bits(&format!("lse {dtype:?}"), &lse, &want_lse);
        assert_eq!(out.shape(), [b, hq, 1, dv]);

        let lengths = Tensor::<CpuRuntime>::from_slice(&[150i32, 200], &[b], &CpuDevice::new())
            .expect("lengths");
        let cache = |v| Keys::cache(&latent, v, &lengths);
        let (out, lse) = attention(&Causal, &q, cache(&v), &opts)
            .map(|y| (y.out, y.lse))
            .expect("the view");
        let (want, want_lse) = attention(&Causal, &q, cache(&v_copy), &opts)
            .map(|y| (y.out, y.lse))
            .expect("the copy");
        same_bits(&format!("cache out {dtype:?}"), &out, &want);
        same_bits(&format!("cache lse {dtype:?}"), &lse, &want_lse);
    }
}

/// An fp8 E4M3 latent cache whose first 512 columns are V, 16 query heads
/// (the decode kernel's block products, V read from K's widened block):
/// the bits of V copied out, with one scale for K and V, and with V's
/// scale apart from K's (V then widened on its own).
#[test]
fn fp8_values_as_a_view_of_the_keys_give_the_bits_of_a_copy() {
    let (b, hq, sk, d, dv) = (1, 16, 300, 576, 512);
    let mut rng = Rng::new(0x318, 0);
    let bytes: Vec<u8> = rng
        .normal_f32(b * sk * d, 8.0)
        .iter()
        .map(|&x| numr::dtype::FP8E4M3::from_f32(x).0)
        .collect();
    let device = CpuDevice::new();
    let latent = T::from_bytes(&bytes, &[b, 1, sk, d], DType::FP8E4M3, &device).expect("fp8");
    let q = typed(
        &rng.normal_f32(b * hq * d, 1.0),
        &[b, hq, 1, d],
        DType::BF16,
    );
    let v = latent.narrow(3, 0, dv).expect("a view");
    let v_copy = v.contiguous().expect("a copy");
    let lengths = T::from_slice(&[sk as i32 - 7], &[b], &device).expect("lengths");
    let scale = |x: f32| T::from_slice(&[x], &[1], &device).expect("a scale");
    let (k_scale, v_scale) = (scale(0.125), scale(0.0625));
    for v_scale in [&k_scale, &v_scale] {
        let cache = |v| {
            Keys::cache(&latent, v, &lengths).with_scales(KvScales::PerHead {
                k: &k_scale,
                v: v_scale,
            })
        };
        let opts = AttentionOptions::default();
        let (out, lse) = attention(&Causal, &q, cache(&v), &opts)
            .map(|y| (y.out, y.lse))
            .expect("the view");
        let (want, want_lse) = attention(&Causal, &q, cache(&v_copy), &opts)
            .map(|y| (y.out, y.lse))
            .expect("the copy");
        same_bits("fp8 cache out", &out, &want);
        same_bits("fp8 cache lse", &lse, &want_lse);
    }
}

/// Pages `[pages, 1, page_size, 40]` whose last 16 columns are NaN, V the
/// first 24: nothing outside the view may reach a result.
#[test]
fn paged_values_as_a_view_of_the_key_pages_never_read_past_it() {
    let (pages, page_size, d, dv, hq) = (7, 16, 40, 24, 4);
    let mut rng = Rng::new(0x9a6, 0);
    let mut data = rng.normal_f32(pages * page_size * d, 1.0);
    let k_copy = host(&data, &[pages, 1, page_size, d]);
    for row in data.chunks_mut(d) {
        row[dv..].fill(f32::NAN);
    }
    let latent = host(&data, &[pages, 1, page_size, d]);
    let v = latent.narrow(3, 0, dv).expect("a view");
    let v_copy = v.contiguous().expect("a copy");
    let q = host(&rng.normal_f32(2 * hq * 3 * d, 1.0), &[2, hq, 3, d]);
    let table =
        Tensor::<CpuRuntime>::from_slice(&[3i32, 0, 5, 6, 1, 2, 4, 0], &[2, 4], &CpuDevice::new())
            .expect("a table");
    let lengths =
        Tensor::<CpuRuntime>::from_slice(&[50i32, 64], &[2], &CpuDevice::new()).expect("lengths");
    let opts = AttentionOptions::default();
    let run = |v| {
        let cache = Keys::paged(&k_copy, v, &table, &lengths);
        attention(&Causal, &q, cache, &opts)
            .map(|y| (y.out, y.lse))
            .expect("a paged call")
    };
    let ((out, lse), (want, want_lse)) = (run(&v), run(&v_copy));
    assert!(out.to_vec::<f32>().iter().all(|x| x.is_finite()));
    same_bits("paged out", &out, &want);
    same_bits("paged lse", &lse, &want_lse);
}

/// A view built from raw parts whose elements run past its storage is an
/// `Err` naming it, never a read outside the buffer.
#[test]
fn a_view_past_its_storage_is_an_error() {
    let (b, h, s, d) = (1, 2, 8, 16);
    let mut rng = Rng::new(0x7e, 0);
    let q = host(&rng.normal_f32(b * h * s * d, 1.0), &[b, h, s, d]);
    let k = host(&rng.normal_f32(b * h * s * d, 1.0), &[b, h, s, d]);
    // V as K's rows from column 8, 16 wide: its last row reaches 8 past K.
    let layout = Layout::contiguous(&[b, h, s, d]).as_strided(
        &[b, h, s, d],
        &[(h * s * d) as isize, (s * d) as isize, d as isize, 1],
        8,
    );
    let v = Tensor::from_parts(k.storage().clone(), layout);
    let err = attention(
        &Causal,
        &q,
        Keys::dense(&k, &v),
        &AttentionOptions::default(),
    )
    .map(|y| (y.out, y.lse))
    .expect_err("a view past its storage");
    assert!(
        matches!(
            &err,
            Error::ViewPastStorage { name: "v", reach, storage, .. }
                if *reach == (b * h * s * d + 7) as i64 && *storage == b * h * s * d
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("must lie inside its storage"),
        "{err}"
    );
}
