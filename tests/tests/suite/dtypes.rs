//! f16 and bf16 inputs on the CPU: the kernels widen them to f32 exactly,
//! compute in f32 and round the outputs once, so every output must be the
//! f32 result on the widened inputs, rounded to nearest-even — bit for bit.
//! (Except bf16 on a CPU with AMX, whose forward and backward multiply bf16
//! tiles as stored and round P and dS to bf16: within bf16 rounding of the
//! widened kernels there, checked against the reference in the CPU
//! kernels' tests.)

use boostr_runtime::stock::{Alibi, Causal, CausalSoftcap};
use boostr_runtime::testing::Rng;
use boostr_runtime::{AttentionOptions, Backward, Keys, Variant, attention, attention_backward};
use numr::prelude::*;

/// A 16-bit float format: rounding from f32 and widening back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Half {
    F16,
    Bf16,
}

impl Half {
    fn dtype(self) -> DType {
        match self {
            Half::F16 => DType::F16,
            Half::Bf16 => DType::BF16,
        }
    }

    /// Round-to-nearest-even bits, computed independently of the library the
    /// runtime uses: for bf16 the classic bit trick, for f16 a search.
    fn round(self, x: f32) -> u16 {
        match self {
            Half::Bf16 => {
                let b = x.to_bits();
                if x.is_nan() {
                    return ((b >> 16) | 0x40) as u16;
                }
                let lsb = (b >> 16) & 1;
                ((b + 0x7fff + lsb) >> 16) as u16
            }
            Half::F16 => f16_nearest(x),
        }
    }

    fn widen(self, bits: u16) -> f32 {
        match self {
            Half::Bf16 => f32::from_bits((bits as u32) << 16),
            Half::F16 => {
                let (sign, exp, man) = ((bits >> 15) & 1, (bits >> 10) & 0x1f, bits & 0x3ff);
                let mag = match exp {
                    0 => man as f32 * 2f32.powi(-24),
                    31 if man == 0 => f32::INFINITY,
                    31 => f32::NAN,
                    _ => (1024 + man) as f32 * 2f32.powi(exp as i32 - 25),
                };
                if sign == 1 { -mag } else { mag }
            }
        }
    }
}

/// f32 → f16 bits, to nearest with ties to even, by search: the largest
/// f16 at or below `|x|` and its successor, compared in f64 (exact for both).
fn f16_nearest(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7e00;
    }
    let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
    let a = x.abs() as f64;
    let widen = |bits: u16| Half::F16.widen(bits) as f64;
    // Largest finite pattern with value ≤ a (patterns are ordered like values).
    let (mut lo, mut hi) = (0u16, 0x7bffu16);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if widen(mid) <= a {
            lo = mid
        } else {
            hi = mid - 1
        }
    }
    if lo == 0x7bff {
        // Past the largest finite f16 (65504): inf from 65520 (half an ulp) on.
        return sign | if a >= 65520.0 { 0x7c00 } else { 0x7bff };
    }
    let (below, above) = (a - widen(lo), widen(lo + 1) - a);
    let pick = if below < above || (below == above && lo % 2 == 0) {
        lo
    } else {
        lo + 1
    };
    sign | pick
}

fn half_tensor(h: Half, bits: &[u16], shape: &[usize]) -> Tensor<CpuRuntime> {
    let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    Tensor::<CpuRuntime>::from_bytes(&bytes, shape, h.dtype(), &CpuDevice::new()).unwrap()
}

fn f32_tensor(data: &[f32], shape: &[usize]) -> Tensor<CpuRuntime> {
    Tensor::<CpuRuntime>::from_slice(data, shape, &CpuDevice::new()).unwrap()
}

/// Random q, k, v and dout of the shapes `shapes` rounded to `h`: as `h`
/// tensors, and widened exactly to f32 tensors.
fn random_inputs(
    h: Half,
    rng: &mut Rng,
    shapes: [[usize; 4]; 4],
) -> ([Tensor<CpuRuntime>; 4], [Tensor<CpuRuntime>; 4]) {
    let bits: Vec<(Vec<u16>, [usize; 4])> = shapes
        .into_iter()
        .map(|shape| {
            let n = shape.iter().product();
            let x = rng.normal_f32(n, 1.0).iter().map(|&x| h.round(x)).collect();
            (x, shape)
        })
        .collect();
    let half = std::array::from_fn(|i| half_tensor(h, &bits[i].0, &bits[i].1));
    let wide = std::array::from_fn(|i| {
        let x: Vec<f32> = bits[i].0.iter().map(|&b| h.widen(b)).collect();
        f32_tensor(&x, &bits[i].1)
    });
    (half, wide)
}

/// `(B, Hq, Hkv, Sq, Sk, D, Dv)`.
type Shape = (usize, usize, usize, usize, usize, usize, usize);

fn check<V: Variant>(variant: &V, h: Half, (b, hq, hkv, sq, sk, d, dv): Shape) {
    let mut rng = Rng::new(0xd7e5, (sq * 131 + d) as u64);
    let problem = boostr_runtime::Problem::new(b, (hq, hkv), (sq, sk), d).with_head_dim_v(dv);
    let os = problem.out_shape();
    let shapes = [problem.q_shape(), problem.k_shape(), problem.v_shape(), os];
    let wide = |x: &[u16]| x.iter().map(|&b| h.widen(b)).collect::<Vec<f32>>();
    let opts = AttentionOptions::default();
    let ([qh, kh, vh, doh], [qf, kf, vf, dof]) = random_inputs(h, &mut rng, shapes);

    let (out_h, lse_h) = attention(variant, &qh, Keys::dense(&kh, &vh), &opts)
        .map(|y| (y.out, y.lse))
        .unwrap();
    let (out_f, lse_f) = attention(variant, &qf, Keys::dense(&kf, &vf), &opts)
        .map(|y| (y.out, y.lse))
        .unwrap();
    assert_eq!((out_h.dtype(), lse_h.dtype()), (h.dtype(), DType::F32));
    if h == Half::Bf16 && boostr_runtime::cpu::bf16_tiles(&problem) {
        // bf16 tile products (AMX) round P to bf16: not the widened f32
        // forward's bits (their own test is in the CPU kernels'), but
        // within bf16 rounding of it.
        let (got, want) = (out_h.to_vec::<u16>(), out_f.to_vec::<f32>());
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let g = h.widen(g);
            assert!(
                (g - w).abs() <= 2e-2 * (1.0 + w.abs()),
                "{} bf16 out[{i}] = {g}, widened {w}",
                V::NAME
            );
        }
        let (got, want) = (lse_h.to_vec::<f32>(), lse_f.to_vec::<f32>());
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g == w || (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "{} bf16 lse[{i}] = {g}, widened {w}",
                V::NAME
            );
        }
        // The backward on bf16 tiles rounds P and dS to bf16 too: within
        // bf16 rounding of the widened backward (against the reference in
        // the CPU kernels' tests), relative to each gradient's largest.
        let out_rounded = f32_tensor(&wide(&out_h.to_vec::<u16>()), &os);
        let (dq_h, dk_h, dv_h) = attention_backward(
            variant,
            &qh,
            Keys::dense(&kh, &vh),
            Backward::from_tensors(&out_h, &lse_h, &doh),
            &opts,
        )
        .map(|g| (g.dq, g.dk, g.dv))
        .unwrap();
        let (dq_f, dk_f, dv_f) = attention_backward(
            variant,
            &qf,
            Keys::dense(&kf, &vf),
            Backward::from_tensors(&out_rounded, &lse_h, &dof),
            &opts,
        )
        .map(|g| (g.dq, g.dk, g.dv))
        .unwrap();
        let near = |name: &str, got: &Tensor<CpuRuntime>, want: &Tensor<CpuRuntime>| {
            assert_eq!(got.dtype(), h.dtype(), "{name} dtype");
            let (got, want) = (got.to_vec::<u16>(), want.to_vec::<f32>());
            let big = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                let g = h.widen(g);
                assert!(
                    (g - w).abs() <= 2e-2 * big,
                    "{} bf16 {name}[{i}] = {g}, widened {w} (largest {big})",
                    V::NAME
                );
            }
        };
        near("dq", &dq_h, &dq_f);
        near("dk", &dk_h, &dk_f);
        near("dv", &dv_h, &dv_f);
        return;
    }
    assert_eq!(lse_h.to_vec::<f32>(), lse_f.to_vec::<f32>(), "{h:?} lse");
    let same = |name: &str, got: &Tensor<CpuRuntime>, want: &Tensor<CpuRuntime>| {
        assert_eq!(got.dtype(), h.dtype(), "{name} dtype");
        let got = got.to_vec::<u16>();
        let want: Vec<u16> = want.to_vec::<f32>().iter().map(|&x| h.round(x)).collect();
        let bad = got.iter().zip(&want).position(|(a, b)| a != b);
        assert!(
            bad.is_none(),
            "{} {h:?} {name}: element {bad:?} differs",
            V::NAME
        );
    };
    same("out", &out_h, &out_f);

    // The backward reads `out` in the inputs' dtype, as autograd hands it back.
    let out_f_rounded = f32_tensor(&wide(&out_h.to_vec::<u16>()), &os);
    let (dq_h, dk_h, dv_h) = attention_backward(
        variant,
        &qh,
        Keys::dense(&kh, &vh),
        Backward::from_tensors(&out_h, &lse_h, &doh),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .unwrap();
    let (dq_f, dk_f, dv_f) = attention_backward(
        variant,
        &qf,
        Keys::dense(&kf, &vf),
        Backward::from_tensors(&out_f_rounded, &lse_f, &dof),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .unwrap();
    same("dq", &dq_h, &dq_f);
    same("dk", &dk_h, &dk_f);
    same("dv", &dv_h, &dv_f);
}

#[test]
fn half_inputs_give_the_rounded_f32_results() {
    for h in [Half::Bf16, Half::F16] {
        check(&Causal, h, (1, 4, 2, 77, 77, 64, 64));
        check(&Alibi { heads: 4 }, h, (2, 4, 4, 33, 90, 40, 40));
        check(&CausalSoftcap { cap: 5.0 }, h, (1, 2, 1, 130, 65, 128, 128));
        // Decode shapes read 16-bit keys and values as stored: through the
        // matrix-vector products (4 packed rows) and the tile products (36).
        check(&Causal, h, (2, 8, 2, 1, 300, 64, 64));
        check(&CausalSoftcap { cap: 5.0 }, h, (1, 4, 1, 9, 100, 40, 40));
        // Values of another head dim (on bf16 tiles where the CPU has
        // them, and widened through the decode kernel).
        check(&Causal, h, (1, 4, 2, 77, 90, 96, 64));
        check(&Causal, h, (1, 8, 1, 2, 200, 192, 128));
    }
}

#[test]
fn the_reference_roundings_are_right() {
    // Exact values, ties to even, subnormals, overflow.
    let cases: [(f32, u16, u16); 6] = [
        (1.0, 0x3c00, 0x3f80),
        (1.0 + 2f32.powi(-11), 0x3c00, 0x3f80), // f16 tie → even (down)
        (1.0 + 3.0 * 2f32.powi(-11), 0x3c02, 0x3f80), // f16 tie → even (up)
        (1.0 + 2f32.powi(-8), 0x3c04, 0x3f80),  // bf16 tie → even (down)
        (2f32.powi(-24), 0x0001, 0x3380),       // smallest f16 subnormal
        (65520.0, 0x7c00, 0x4780),              // f16 overflow to inf
    ];
    for (x, f16, bf16) in cases {
        assert_eq!(Half::F16.round(x), f16, "f16 of {x}");
        assert_eq!(Half::Bf16.round(x), bf16, "bf16 of {x}");
        assert_eq!(Half::F16.round(-x), f16 | 0x8000, "f16 of -{x}");
    }
}

/// The gradients of a model-like loss, `L = Σ out ∘ W` (W random: `dout =
/// W`), from bf16 inputs (on a CPU with AMX, on bf16 tiles both ways)
/// point the same way as those of the f32 kernels on the widened inputs:
/// cosine similarity above 0.999 for dq, dk and dv, at S = 2048.
#[test]
fn bf16_gradients_point_the_way_of_f32() {
    let h = Half::Bf16;
    let (b, hq, hkv, s, d) = (1usize, 2usize, 1usize, 2048usize, 64usize);
    let mut rng = Rng::new(0xc05, 2048);
    let qs = [b, hq, s, d];
    let ks = [b, hkv, s, d];
    let wide = |x: &[u16]| x.iter().map(|&b| h.widen(b)).collect::<Vec<f32>>();
    let opts = AttentionOptions::default();
    let cosine = |a: &[f32], b: &[f32]| {
        let dot: f64 = a
            .iter()
            .zip(b)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum();
        let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        dot / (na * nb)
    };
    let ([qh, kh, vh, wh], [qf, kf, vf, wf]) = random_inputs(h, &mut rng, [qs, ks, ks, qs]);
    let (out_h, lse_h) = attention(&Causal, &qh, Keys::dense(&kh, &vh), &opts)
        .map(|y| (y.out, y.lse))
        .unwrap();
    let (dq_h, dk_h, dv_h) = attention_backward(
        &Causal,
        &qh,
        Keys::dense(&kh, &vh),
        Backward::from_tensors(&out_h, &lse_h, &wh),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .unwrap();
    let (out_f, lse_f) = attention(&Causal, &qf, Keys::dense(&kf, &vf), &opts)
        .map(|y| (y.out, y.lse))
        .unwrap();
    let (dq_f, dk_f, dv_f) = attention_backward(
        &Causal,
        &qf,
        Keys::dense(&kf, &vf),
        Backward::from_tensors(&out_f, &lse_f, &wf),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .unwrap();
    for (name, got, want) in [("dq", dq_h, dq_f), ("dk", dk_h, dk_f), ("dv", dv_h, dv_f)] {
        let c = cosine(&wide(&got.to_vec::<u16>()), &want.to_vec::<f32>());
        assert!(c > 0.999, "{name}: cosine similarity {c}");
    }
}
