//! `model::Attention` in a boostr block, against boostr 0.10's own
//! attention (`attention_core_masked`: repeated KV heads, a materialised
//! mask, softmax) on the same projections and RoPE tables: outputs and the
//! projections' gradients, for causal, soft-capped and sliding-window
//! attention with GQA; generation through boostr's `PagedKvCache` against
//! the training forward; bad shapes as errors.

use boostr::inference::kv_cache::PagedKvCache;
use boostr::model::attention_core::{AttentionCoreSpec, AttentionKernel, attention_core_masked};
use boostr::nn::RoPE;
use boostr_runtime::model::Attention;
use boostr_runtime::stock::{Causal, CausalSlidingWindow, CausalSoftcap};
use boostr_runtime::testing::Rng;
use boostr_runtime::variant::Variant;
use boostr_runtime::{Error, Keys};
use numr::autograd::{Var, backward, var_mul, var_sum};
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::runtime::cpu::{CpuClient, CpuDevice, CpuRuntime};
use numr::tensor::Tensor;

type T = Tensor<CpuRuntime>;

const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;

fn setup() -> (CpuDevice, CpuClient, Rng) {
    let device = CpuDevice::new();
    let client = CpuRuntime::default_client(&device);
    let seed = boostr_runtime::testing::choose_seed();
    eprintln!(
        "seed {seed} (rerun with {}={seed})",
        boostr_runtime::testing::SEED_ENV
    );
    (device, client, Rng::new(seed, 0))
}

fn normal(rng: &mut Rng, shape: &[usize], device: &CpuDevice) -> T {
    let n = shape.iter().product();
    Tensor::from_slice(&rng.normal_f32(n, 1.0), shape, device).expect("from_slice")
}

fn max_diff(a: &T, b: &T) -> (f64, f64) {
    let (a, b) = (
        a.contiguous().unwrap().to_vec::<f32>(),
        b.contiguous().unwrap().to_vec::<f32>(),
    );
    assert_eq!(a.len(), b.len());
    let err = a
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| f64::from(y.abs())).fold(0.0, f64::max);
    (err, scale)
}

/// boostr's attention with `spec`'s softcap and window, causal.
fn theirs(
    client: &CpuClient,
    [q, k, v]: [&Var<CpuRuntime>; 3],
    rope: &RoPE<CpuRuntime>,
    softcap: Option<f32>,
    sliding_window: usize,
) -> Var<CpuRuntime> {
    let spec = AttentionCoreSpec {
        num_heads: HEADS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        q_norm: None,
        k_norm: None,
        use_alibi: false,
        skip_rope: false,
        sliding_window,
        softcap,
        alibi_scale: 1.0,
        kernel: AttentionKernel::Masked,
    };
    let rope = rope.narrow_positions(q.shape()[1]).expect("narrow");
    attention_core_masked(
        client,
        q,
        k,
        v,
        Some(rope.cos_cache()),
        Some(rope.sin_cache()),
        &spec,
    )
    .expect("boostr's attention")
}

/// Ours and boostr's on the same random projections `[2, 37, ·]`: the
/// outputs, and the gradients of `Σ out ∘ w` in q, k and v.
fn against_boostr<V: Variant>(variant: V, softcap: Option<f32>, window: usize) {
    let (device, client, mut rng) = setup();
    let (b, s) = (2, 37);
    let rope =
        RoPE::<CpuRuntime>::precompute_freqs(64, HEAD_DIM, 10_000.0, None, &device).expect("rope");
    let q = normal(&mut rng, &[b, s, HEADS * HEAD_DIM], &device);
    let k = normal(&mut rng, &[b, s, KV_HEADS * HEAD_DIM], &device);
    let v = normal(&mut rng, &[b, s, KV_HEADS * HEAD_DIM], &device);
    let w = Var::new(normal(&mut rng, &[b, s, HEADS * HEAD_DIM], &device), false);
    let run = |ours: bool| {
        let vars = [&q, &k, &v].map(|t| Var::new(t.clone(), true));
        let out = if ours {
            let attention = Attention::new(variant.clone(), HEADS, KV_HEADS, HEAD_DIM).unwrap();
            attention
                .forward(&vars[0], &vars[1], &vars[2], Some(&rope))
                .expect("ours")
        } else {
            theirs(
                &client,
                [&vars[0], &vars[1], &vars[2]],
                &rope,
                softcap,
                window,
            )
        };
        let loss = var_sum(
            &var_mul(&out, &w, &client).unwrap(),
            &[0, 1, 2],
            false,
            &client,
        );
        let grads = backward(&loss.unwrap(), &client).expect("backward");
        let g = vars.map(|x| grads.get(x.id()).expect("a gradient").clone());
        (out.tensor().clone(), g)
    };
    let (out, grads) = run(true);
    let (want, want_grads) = run(false);
    let (err, scale) = max_diff(&out, &want);
    assert!(
        err <= 1e-5 * (1.0 + scale),
        "out: {err:e} (|out| up to {scale})"
    );
    for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(grads.iter().zip(&want_grads)) {
        let (err, scale) = max_diff(g, w);
        assert!(
            err <= 1e-5 * (1.0 + scale),
            "{name}: {err:e} (up to {scale})"
        );
    }
}

#[test]
fn causal_matches_boostrs_attention() {
    against_boostr(Causal, None, 0);
}

#[test]
fn softcap_matches_boostrs_attention() {
    against_boostr(CausalSoftcap { cap: 3.0 }, Some(3.0), 0);
}

#[test]
fn a_sliding_window_matches_boostrs_attention() {
    against_boostr(CausalSlidingWindow { window: 9 }, None, 9);
}

/// Prefill then one token at a time through boostr's paged cache (pages
/// in reverse storage order), read in place as `[pages, Hkv, page, D]`
/// views: each step's rows equal the training forward's at their positions.
#[test]
fn decoding_through_boostrs_paged_cache_matches_the_forward() {
    let (device, client, mut rng) = setup();
    let (s, prompt, page) = (29, 11, 8);
    let rope =
        RoPE::<CpuRuntime>::precompute_freqs(64, HEAD_DIM, 10_000.0, None, &device).expect("rope");
    let attention = Attention::new(CausalSoftcap { cap: 5.0 }, HEADS, KV_HEADS, HEAD_DIM).unwrap();
    let q = normal(&mut rng, &[1, s, HEADS * HEAD_DIM], &device);
    let k = normal(&mut rng, &[1, s, KV_HEADS * HEAD_DIM], &device);
    let v = normal(&mut rng, &[1, s, KV_HEADS * HEAD_DIM], &device);
    let var = |t: &T| Var::new(t.clone(), false);
    let want = attention
        .forward(&var(&q), &var(&k), &var(&v), Some(&rope))
        .unwrap();
    let want = want.tensor().to_vec::<f32>();
    let pages = s.div_ceil(page);
    let cache =
        PagedKvCache::<CpuRuntime>::new(pages, page, KV_HEADS, HEAD_DIM, DType::F32, &device)
            .unwrap();
    let order: Vec<i32> = (0..pages as i32).rev().collect();
    let table = Tensor::from_slice(&order, &[1, pages], &device).unwrap();
    let mut start = 0;
    while start < s {
        let n = if start == 0 { prompt } else { 1 };
        let at = |t: &T| var(&t.narrow(1, start, n).unwrap().contiguous().unwrap());
        let (qh, kh, vh) = attention
            .heads(&at(&q), &at(&k), &at(&v), Some(&rope), start)
            .unwrap();
        let token_major = |t: &T| {
            let t = t.permute(&[0, 2, 1, 3]).unwrap().contiguous().unwrap();
            t.reshape(&[n, KV_HEADS, HEAD_DIM]).unwrap()
        };
        let slots: Vec<i32> = (start..start + n)
            .map(|p| order[p / page] * page as i32 + (p % page) as i32)
            .collect();
        let slots = Tensor::from_slice(&slots, &[n], &device).unwrap();
        cache
            .update(&token_major(&kh), &token_major(&vh), &slots, &client)
            .unwrap();
        let k_pages = cache.k_cache().permute(&[0, 2, 1, 3]).unwrap();
        let v_pages = cache.v_cache().permute(&[0, 2, 1, 3]).unwrap();
        let lengths = Tensor::from_slice(&[(start + n) as i32], &[1], &device).unwrap();
        let got = attention
            .decode(&qh, Keys::paged(&k_pages, &v_pages, &table, &lengths))
            .expect("decode")
            .to_vec::<f32>();
        let width = HEADS * HEAD_DIM;
        let rows = &want[start * width..(start + n) * width];
        let err = got
            .iter()
            .zip(rows)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(err <= 1e-5, "positions {start}..{}: {err:e}", start + n);
        start += n;
    }
}

#[test]
fn bad_shapes_and_heads_are_errors() {
    let (device, _, mut rng) = setup();
    assert!(matches!(
        Attention::new(Causal, 6, 4, HEAD_DIM),
        Err(Error::Heads {
            heads_q: 6,
            heads_kv: 4
        })
    ));
    let attention = Attention::new(Causal, HEADS, KV_HEADS, HEAD_DIM).unwrap();
    let var = |shape: &[usize], rng: &mut Rng| Var::new(normal(rng, shape, &device), false);
    let (q, k) = (var(&[1, 5, 64], &mut rng), var(&[1, 5, 32], &mut rng));
    let narrow = var(&[1, 5, 30], &mut rng);
    let err = attention.forward(&q, &k, &narrow, None).unwrap_err();
    assert!(
        matches!(&err, Error::ShapeOf { name: "v", expected, got } if expected == &[1, 5, 32] && got == &[1, 5, 30]),
        "{err}"
    );
    let flat = var(&[5, 64], &mut rng);
    let err = attention.forward(&flat, &k, &k, None).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::Rank {
                name: "q",
                rank: 3,
                ..
            }
        ),
        "{err}"
    );
    let rope = RoPE::<CpuRuntime>::precompute_freqs(8, HEAD_DIM, 10_000.0, None, &device).unwrap();
    let err = attention.heads(&q, &k, &k, Some(&rope), 4).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::Argument {
                given: 9,
                actual: 8,
                ..
            }
        ),
        "{err}"
    );
}
