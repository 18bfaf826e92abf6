//! wgpu-specific tests: views, dtypes, shapes past llvmpipe's loop limit,
//! and concurrent first use of the pipeline cache. (Every variant's numerics
//! are checked by the generated tests.)

use crate::stock::{Causal, CausalSlidingWindow, CausalSoftcap, Documents, Full};
use crate::testing::fixtures::{Plain, fill_spare_slots};
use crate::testing::{
    Case, HEAD_DIM_CASES, Logits, REQUIRE_DEVICE_ENV, Wgpu, check_variant_built_on,
    check_variant_on,
};
use crate::variant::Target;
use crate::{AttentionOptions, BackendError, Backward, Error, Keys, attention, attention_backward};
use numr::dtype::DType;
use numr::runtime::wgpu::{WgpuDevice, WgpuRuntime, is_wgpu_available, wgpu_device};
use numr::tensor::Tensor;
use std::sync::{Arc, Barrier};

/// The device, or `None` with a skip message (a failure when
/// `BOOSTR_TEST_REQUIRE_DEVICE` is set).
fn device() -> Option<WgpuDevice> {
    if is_wgpu_available() {
        return Some(wgpu_device());
    }
    assert!(
        std::env::var_os(REQUIRE_DEVICE_ENV).is_none(),
        "no wgpu device, and {REQUIRE_DEVICE_ENV} is set"
    );
    eprintln!("boostr: skipping: no wgpu device");
    None
}

/// Views at a non-zero offset (here: along the batch) give the same
/// result as their contiguous copies; non-f32 inputs are refused.
#[test]
fn offset_views_and_dtypes() {
    let Some(device) = device() else { return };
    let data: Vec<f32> = (0..2 * 2 * 5 * 8)
        .map(|i| ((i * 7 % 13) as f32) * 0.1)
        .collect();
    let t = Tensor::<WgpuRuntime>::from_slice(&data, &[2, 2, 5, 8], &device).unwrap();
    let view = t.narrow(0, 1, 1).unwrap();
    let copy = Tensor::<WgpuRuntime>::from_slice(&data[80..], &[1, 2, 5, 8], &device).unwrap();
    let opts = AttentionOptions::default();
    let (o1, l1) = attention(&Causal, &view, Keys::dense(&view, &view), &opts)
        .map(|y| (y.out, y.lse))
        .unwrap();
    let (o2, l2) = attention(&Causal, &copy, Keys::dense(&copy, &copy), &opts)
        .map(|y| (y.out, y.lse))
        .unwrap();
    assert_eq!(o1.to_vec::<f32>(), o2.to_vec::<f32>());
    assert_eq!(l1.to_vec::<f32>(), l2.to_vec::<f32>());

    let ints = Tensor::<WgpuRuntime>::zeros(&[1, 2, 5, 8], DType::I32, &device).unwrap();
    let err = attention(&Causal, &ints, Keys::dense(&ints, &ints), &opts)
        .map(|y| (y.out, y.lse))
        .unwrap_err();
    assert!(matches!(err, Error::DType { .. }), "{err}");
}

/// The head dims the generated tests leave out on wgpu (they run at
/// 80/56, `testing::SMALL_CASES`): values as wide as the keys at 40, 64 and
/// 128, and wider at 32/48, unrolled and rolled head-dim loops, on a
/// variant with a score and a mask.
#[test]
fn other_head_dims_match_the_reference() {
    check_variant_on::<Wgpu, _>(&CausalSoftcap { cap: 2.0 }, HEAD_DIM_CASES);
}

const fn long_case(seq_q: usize, seq_k: usize, heads_q: usize, name: &'static str) -> Case {
    Case {
        batch: 1,
        heads_q,
        heads_kv: 1,
        seq_q,
        seq_k,
        head_dim: 128,
        head_dim_v: 128,
        logit_scale: 1.0,
        logits: Logits::Random,
        scale: None,
        name,
    }
}

/// Mesa's llvmpipe leaves a loop once an invocation's loops have run 65,535
/// iterations in total. At D = 128 the kernels stage 16 keys or 15 query
/// rows per tile, and one computed tile costs an invocation about 4,000
/// iterations (`WgslTiles::loop_iterations_per_tile`): the forward, `D_i`
/// and dQ kernels looping over 2053 keys (129 key tiles), and the dK/dV
/// kernel over 2 heads × 137 query tiles, run far past the limit in one
/// dispatch (with the limit lifted, this test fails). All must be right,
/// against the f64 reference.
#[test]
fn long_rows_and_columns_cross_the_loop_limit() {
    check_variant_on::<Wgpu, _>(
        &Full,
        &[
            long_case(5, 2053, 2, "long_keys"),
            long_case(2053, 5, 2, "long_queries"),
        ],
    );
}

/// Tiles skipped as empty across many dispatches: the one query row of a
/// 3-wide sliding window at the end of 4,099 keys skips 256 key tiles,
/// spread over the dispatches of each tile loop, before it reaches its
/// keys. (A skipped tile costs an invocation a few loop iterations, fewer
/// than a computed one, which is what the dispatches are sized for.)
#[test]
fn skipped_tiles_span_dispatches() {
    check_variant_on::<Wgpu, _>(
        &CausalSlidingWindow { window: 3 },
        &[long_case(1, 4_099, 1, "skip_256_tiles")],
    );
}

/// A document variant whose one query row sees only the last 3 of 4,099
/// keys: 256 tiles are skipped from the summaries of the ids (each
/// classification reads four of them) across the dispatches of each tile
/// loop.
#[test]
fn skipped_document_tiles_span_dispatches() {
    let Some(device) = device() else { return };
    let sk = 4_099;
    let mut ids = vec![0i32; sk];
    ids[sk - 3..].fill(1);
    let doc = Tensor::<WgpuRuntime>::from_slice(&ids, &[1, sk], &device).unwrap();
    check_variant_built_on::<Wgpu, _>(
        |_| Documents { doc: doc.clone() },
        &[long_case(1, sk, 1, "documents_skip_256_tiles")],
    );
}

/// A captured tensor lives on the call's runtime: a CPU tensor in a wgpu
/// call (and a wgpu tensor in a CPU call) is an error naming the field and
/// both runtimes.
#[test]
fn a_captured_tensor_on_another_runtime_is_refused() {
    let Some(device) = device() else { return };
    let opts = AttentionOptions::default();
    let x = Tensor::<WgpuRuntime>::zeros(&[1, 1, 4, 8], DType::F32, &device).unwrap();
    let cpu = numr::runtime::cpu::CpuDevice::new();
    let doc = Tensor::<numr::runtime::cpu::CpuRuntime>::zeros(&[1, 4], DType::I32, &cpu).unwrap();
    let err = attention(&Documents { doc }, &x, Keys::dense(&x, &x), &opts)
        .map(|y| (y.out, y.lse))
        .unwrap_err();
    assert!(
        matches!(err, Error::CaptureRuntime { field: "doc", .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("Wgpu") && err.to_string().contains("Cpu"),
        "{err}"
    );
    let xc =
        Tensor::<numr::runtime::cpu::CpuRuntime>::zeros(&[1, 1, 4, 8], DType::F32, &cpu).unwrap();
    let doc = Tensor::<WgpuRuntime>::zeros(&[1, 4], DType::I32, &device).unwrap();
    let err = attention(&Documents { doc }, &xc, Keys::dense(&xc, &xc), &opts)
        .map(|y| (y.out, y.lse))
        .unwrap_err();
    assert!(
        matches!(err, Error::CaptureRuntime { field: "doc", .. }),
        "{err}"
    );
}

/// Each thread's variant type is new to the pipeline cache (and, for the
/// document variant, the summary kernel is new to its cache); all threads
/// compile and launch at once, and every result matches a later, cached run.
#[test]
fn concurrent_first_use_of_the_pipeline_cache() {
    #[attention(score = |s, _b, h, _q, _kv| s * (1.0 + 0.25 * h as f32), mask = |_b, _h, q, kv| kv <= q)]
    #[derive(Clone, Copy, Debug)]
    struct HeadScaledA;
    #[attention(score = |s, _b, _h, q, kv| s - 0.01 * (q - kv) as f32)]
    #[derive(Clone, Copy, Debug)]
    struct DistanceB;

    let Some(device) = device() else { return };
    let (b, h, s, d) = (1, 2, 37, 40);
    let data: Vec<f32> = (0..b * h * s * d)
        .map(|i| ((i * 37 % 101) as f32) * 0.02 - 1.0)
        .collect();
    let x = Tensor::<WgpuRuntime>::from_slice(&data, &[b, h, s, d], &device).unwrap();
    let ids: Vec<i32> = (0..s as i32).map(|i| i / 5).collect();
    let docs = Documents {
        doc: Tensor::<WgpuRuntime>::from_slice(&ids, &[b, s], &device).unwrap(),
    };
    let opts = AttentionOptions::default();
    let run = move |which: usize| -> Result<Vec<f32>, Error> {
        let (out, lse) = match which % 3 {
            0 => attention(&HeadScaledA, &x, Keys::dense(&x, &x), &opts).map(|y| (y.out, y.lse))?,
            1 => attention(&DistanceB, &x, Keys::dense(&x, &x), &opts).map(|y| (y.out, y.lse))?,
            _ => attention(&docs, &x, Keys::dense(&x, &x), &opts).map(|y| (y.out, y.lse))?,
        };
        let mut all = out.to_vec::<f32>();
        all.extend(lse.to_vec::<f32>());
        Ok(all)
    };
    let threads = 6;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (barrier, run) = (barrier.clone(), run.clone());
            std::thread::spawn(move || {
                barrier.wait();
                run(t)
            })
        })
        .collect();
    let first: Vec<Vec<f32>> = handles
        .into_iter()
        .map(|h| h.join().expect("no panic").expect("no error"))
        .collect();
    for (t, got) in first.iter().enumerate() {
        let again = run(t).unwrap();
        assert!(got.iter().all(|x| x.is_finite()), "thread {t}: non-finite");
        assert_eq!(
            got, &again,
            "thread {t}: first use differs from a cached run"
        );
    }
    assert_ne!(first[0], first[1], "the variants must differ");
    assert_ne!(first[1], first[2], "the variants must differ");
}

/// A hand-written variant has no WGSL lowering: a typed error naming it and
/// the target, never a panic, on every call (the failure is cached).
#[test]
fn a_variant_without_a_lowering_is_refused() {
    let Some(device) = device() else { return };
    let x = Tensor::<WgpuRuntime>::zeros(&[1, 1, 4, 8], DType::F32, &device).unwrap();
    for _ in 0..2 {
        let err = attention(
            &Plain,
            &x,
            Keys::dense(&x, &x),
            &AttentionOptions::default(),
        )
        .map(|y| (y.out, y.lse))
        .unwrap_err();
        assert!(
            matches!(
                err,
                Error::Backend(BackendError::NoLowering {
                    variant: "Plain",
                    target: Target::Wgsl
                })
            ),
            "{err}"
        );
    }
}

/// Random `q [B, Hq, Sq, D]` and `k, v [B, Hkv, cap, D]` of a KV cache of
/// `lens`, every slot past a length NaN in K and infinite in V.
fn cache_inputs(
    rng: &mut crate::testing::Rng,
    (b, hq, hkv, sq, cap): (usize, usize, usize, usize, usize),
    (d, dv): (usize, usize),
    lens: &[i32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let q = rng.normal_f32(b * hq * sq * d, 1.0);
    let mut k = rng.normal_f32(b * hkv * cap * d, 1.0);
    let mut v = rng.normal_f32(b * hkv * cap * dv, 1.0);
    let len = |b: usize| lens[b] as usize;
    fill_spare_slots(
        (&mut k, &mut v),
        (hkv, cap, (d, dv)),
        len,
        (f32::NAN, f32::INFINITY),
    );
    (q, k, v)
}

/// The CPU's `(out, lse)` over a KV cache of `lens` whose `q`, `k`, `v`
/// are host slices of the given sizes.
fn cpu_cache_forward<V: crate::Variant>(
    variant: &V,
    (q, k, v): (&[f32], &[f32], &[f32]),
    (b, hq, hkv, sq, cap): (usize, usize, usize, usize, usize),
    (d, dv): (usize, usize),
    lens: &[i32],
) -> (Vec<f32>, Vec<f32>) {
    use crate::testing::CpuRuntime;
    let cpu = numr::runtime::cpu::CpuDevice::new();
    let on_cpu = |x: &[f32], s: &[usize]| Tensor::<CpuRuntime>::from_slice(x, s, &cpu).unwrap();
    let lengths = Tensor::<CpuRuntime>::from_slice(lens, &[b], &cpu).unwrap();
    let (kc, vc) = (on_cpu(k, &[b, hkv, cap, d]), on_cpu(v, &[b, hkv, cap, dv]));
    let cache = Keys::cache(&kc, &vc, &lengths);
    let qc = on_cpu(q, &[b, hq, sq, d]);
    let opts = AttentionOptions::default();
    let (out, lse) = attention(variant, &qc, cache, &opts)
        .map(|y| (y.out, y.lse))
        .unwrap();
    (out.to_vec::<f32>(), lse.to_vec::<f32>())
}

/// A KV cache and the same keys in pages, on wgpu against the CPU: mixed
/// lengths (0, 1, a key-tile boundary, the capacity), GQA 4:1, values
/// narrower than keys (D = 64, Dv = 48), a sliding window, NaN in the spare
/// slots and in a spare page; pages of 16 and of 24 keys (the WGSL key
/// tile is 36 at 64/48: pages cross tiles).
#[test]
fn kv_caches_and_pages_match_the_cpu() {
    use crate::testing::Rng;
    let Some(device) = device() else { return };
    let (b, hq, hkv, sq, cap) = (4usize, 4usize, 1usize, 3usize, 96usize);
    let (d, dv) = (64usize, 48usize);
    let lens = [0i32, 1, 36, 96];
    let mut rng = Rng::new(5, 0);
    let (q, k, v) = cache_inputs(&mut rng, (b, hq, hkv, sq, cap), (d, dv), &lens);
    let variant = CausalSlidingWindow { window: 40 };
    let opts = AttentionOptions::default();
    let on_gpu = |x: &[f32], s: &[usize]| Tensor::<WgpuRuntime>::from_slice(x, s, &device).unwrap();
    let lens_gpu = Tensor::<WgpuRuntime>::from_slice(&lens, &[b], &device).unwrap();
    let sizes = (b, hq, hkv, sq, cap);
    let (want, want_lse) = cpu_cache_forward(&variant, (&q, &k, &v), sizes, (d, dv), &lens);
    let close = |what: &str, got: &[f32], want: &[f32]| {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                g == w || (g - w).abs() <= 2e-5 * (1.0 + w.abs()),
                "{what}[{i}] = {g}, cpu {w}"
            );
        }
    };
    let qg = on_gpu(&q, &[b, hq, sq, d]);
    let (kg, vg) = (
        on_gpu(&k, &[b, hkv, cap, d]),
        on_gpu(&v, &[b, hkv, cap, dv]),
    );
    let cache = Keys::cache(&kg, &vg, &lens_gpu);
    let (out, lse) = attention(&variant, &qg, cache, &opts)
        .map(|y| (y.out, y.lse))
        .unwrap();
    close("cache out", &out.to_vec::<f32>(), &want);
    close("cache lse", &lse.to_vec::<f32>(), &want_lse);

    for ps in [16usize, 24] {
        let max_pages = cap / ps;
        let pages = b * max_pages + 1;
        let (mut kp, mut vp) = (
            vec![f32::NAN; pages * hkv * ps * d],
            vec![f32::NAN; pages * hkv * ps * dv],
        );
        let mut table = vec![-1i32; b * max_pages];
        for s in 0..b {
            for lp in 0..max_pages {
                let page = pages - 1 - (s * max_pages + lp);
                if lp * ps < lens[s] as usize {
                    table[s * max_pages + lp] = page as i32;
                }
                // Rows `ps` at a time, of `w` elements each.
                let copy = |dst: &mut [f32], src: &[f32], w: usize| {
                    let (from, to) = ((s * cap + lp * ps) * w, page * ps * w);
                    dst[to..to + ps * w].copy_from_slice(&src[from..from + ps * w]);
                };
                copy(&mut kp, &k, d);
                copy(&mut vp, &v, dv);
            }
        }
        let (kpg, vpg) = (
            on_gpu(&kp, &[pages, hkv, ps, d]),
            on_gpu(&vp, &[pages, hkv, ps, dv]),
        );
        let table = Tensor::<WgpuRuntime>::from_slice(&table, &[b, max_pages], &device).unwrap();
        let paged = Keys::paged(&kpg, &vpg, &table, &lens_gpu);
        let (out, lse) = attention(&variant, &qg, paged, &opts)
            .map(|y| (y.out, y.lse))
            .unwrap();
        close(&format!("pages of {ps}: out"), &out.to_vec::<f32>(), &want);
        close(
            &format!("pages of {ps}: lse"),
            &lse.to_vec::<f32>(),
            &want_lse,
        );
    }
}

/// Split-KV decode on wgpu against the f64 reference and the CPU: Sq ∈
/// {1, 4, 17} over a cache of mixed
/// lengths (0, 1, a key-tile boundary, past a split, the capacity) with
/// GQA 8:1, values wider than keys (D = 32, Dv = 40) and NaN in the spare
/// slots, for a causal, a sliding-window and
/// a score-modifying variant. Forced splits (3 and 7: splits of one key
/// tile and of many, some past a sequence's end), the automatic choice and
/// the unsplit kernel agree with the CPU and with each other, and a split
/// forward gives the same bits on every run.
#[test]
fn split_kv_decode_matches_the_unsplit_kernel() {
    use super::forward_split;
    use crate::Problem;
    use crate::backend::{CacheLengths, CallKeys, KeyLayout};
    use crate::stock::{SlidingWindow, Softcap};
    use crate::testing::Rng;
    let Some(device) = device() else { return };
    fn check<V: crate::Variant>(variant: &V, sq: usize, seed: u64, device: &WgpuDevice) {
        let (b, hq, hkv, cap, d, dv) = (5usize, 8usize, 1usize, 1040usize, 32usize, 40usize);
        let lens = [0i32, 1, 56, 700, 1040];
        let mut rng = Rng::new(seed, sq as u64);
        let (q, k, v) = cache_inputs(&mut rng, (b, hq, hkv, sq, cap), (d, dv), &lens);
        let on_gpu =
            |x: &[f32], s: &[usize]| Tensor::<WgpuRuntime>::from_slice(x, s, device).unwrap();
        let sizes = (b, hq, hkv, sq, cap);
        let (want, want_lse) = cpu_cache_forward(variant, (&q, &k, &v), sizes, (d, dv), &lens);
        let p = Problem::new(b, (hq, hkv), (sq, cap), d)
            .with_head_dim_v(dv)
            .with_max_scores(true);
        let (qg, kg, vg) = (
            on_gpu(&q, &[b, hq, sq, d]),
            on_gpu(&k, &[b, hkv, cap, d]),
            on_gpu(&v, &[b, hkv, cap, dv]),
        );
        let lens_gpu = Tensor::<WgpuRuntime>::from_slice(&lens, &[b], device).unwrap();
        let host_lens: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
        let lengths = CacheLengths {
            tensor: &lens_gpu,
            host: &host_lens,
        };
        let keys = CallKeys {
            k: &kg,
            v: &vg,
            layout: KeyLayout::Cache(lengths),
            scales: None,
        };
        // The f64 reference, from the same inputs.
        let host = variant.host(&p).unwrap();
        let inputs = crate::cpu::tests::Inputs {
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
            dout: vec![0.0; b * hq * sq * dv],
            dlse: vec![0.0; b * hq * sq],
        };
        let reference = crate::cpu::tests::reference_lens(&host, &p, &inputs, Some(&host_lens));
        let mut results = Vec::new();
        for splits in [Some(3), Some(1), Some(7), None, Some(3)] {
            let y = forward_split(variant, &p, &qg, keys, splits).unwrap();
            let (out, lse) = (y.out.to_vec::<f32>(), y.lse.to_vec::<f32>());
            let max = y.max_scores.expect("asked for").to_vec::<f32>();
            let ctx = format!("{} Sq={sq} splits {splits:?}", V::NAME);
            crate::cpu::tests::assert_close(&format!("{ctx}: out"), &out, &reference.out, 2e-5);
            crate::cpu::tests::assert_close(&format!("{ctx}: lse"), &lse, &reference.lse, 2e-5);
            let want_max = &reference.max_scores;
            crate::cpu::tests::assert_close(&format!("{ctx}: max"), &max, want_max, 2e-5);
            for (what, got, want) in [("out", &out, &want), ("lse", &lse, &want_lse)] {
                for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
                    assert!(
                        g == w || (g - w).abs() <= 2e-5 * (1.0 + w.abs()),
                        "{} Sq={sq} splits {splits:?}: {what}[{i}] = {g}, cpu {w}",
                        V::NAME
                    );
                }
            }
            results.push((out, lse));
        }
        assert!(
            results[0] == results[4],
            "{} Sq={sq}: two split forwards differ",
            V::NAME
        );
    }
    check(&Causal, 1, 1, &device);
    check(&SlidingWindow { window: 100 }, 4, 2, &device);
    check(&Softcap { cap: 8.0 }, 17, 3, &device);
}

/// The backward over a KV cache on wgpu against the f64 reference and the
/// CPU's: mixed lengths
/// (0, 1, a key-tile boundary, between, the capacity), GQA 2:1, values
/// narrower than keys (D = 32, Dv = 24), Sq > a
/// sequence's length (rows that see nothing), NaN in the spare slots, and
/// the spare slots' gradients exactly zero.
#[test]
fn cache_backward_matches_the_cpu() {
    use crate::stock::{CausalSoftcap, SlidingWindow};
    use crate::testing::{CpuRuntime, Rng};
    use numr::runtime::cpu::CpuDevice;
    let Some(device) = device() else { return };
    let cpu = CpuDevice::new();
    fn check<V: crate::Variant>(variant: &V, sq: usize, device: &WgpuDevice, cpu: &CpuDevice) {
        let (b, hq, hkv, cap, d, dv) = (5usize, 4usize, 2usize, 80usize, 32usize, 24usize);
        let lens = [0i32, 1, 64, 7, 80];
        let mut rng = Rng::new(41, sq as u64);
        let q = rng.normal_f32(b * hq * sq * d, 1.0);
        let dout = rng.normal_f32(b * hq * sq * dv, 1.0);
        let mut k = rng.normal_f32(b * hkv * cap * d, 1.0);
        let mut v = rng.normal_f32(b * hkv * cap * dv, 1.0);
        let spare = |row: usize| row % cap >= lens[row / (hkv * cap)] as usize;
        for (row, (kr, vr)) in k.chunks_mut(d).zip(v.chunks_mut(dv)).enumerate() {
            if spare(row) {
                kr.fill(f32::NAN);
                vr.fill(f32::INFINITY);
            }
        }
        // Forward then backward over the cache on runtime R's `device`.
        fn grads<R: crate::AttentionRuntime, V: crate::Variant>(
            variant: &V,
            device: &R::Device,
            (q, k, v, dout): (&[f32], &[f32], &[f32], &[f32]),
            lens: &[i32],
            [qs, os, ks, vs]: [[usize; 4]; 4],
        ) -> [Vec<f32>; 3] {
            let t = |x: &[f32], s: &[usize]| Tensor::<R>::from_slice(x, s, device).unwrap();
            let lengths = Tensor::<R>::from_slice(lens, &[lens.len()], device).unwrap();
            let (kt, vt) = (t(k, &ks), t(v, &vs));
            let cache = Keys::cache(&kt, &vt, &lengths);
            let (qt, dt) = (t(q, &qs), t(dout, &os));
            let opts = AttentionOptions::default();
            let (out, lse) = attention(variant, &qt, cache, &opts)
                .map(|y| (y.out, y.lse))
                .unwrap();
            let (dq, dk, dv) = attention_backward(
                variant,
                &qt,
                cache,
                Backward::from_tensors(&out, &lse, &dt),
                &opts,
            )
            .map(|g| (g.dq, g.dk, g.dv))
            .unwrap();
            [dq.to_vec::<f32>(), dk.to_vec::<f32>(), dv.to_vec::<f32>()]
        }
        let x = (&q[..], &k[..], &v[..], &dout[..]);
        let shapes = [
            [b, hq, sq, d],
            [b, hq, sq, dv],
            [b, hkv, cap, d],
            [b, hkv, cap, dv],
        ];
        let want = grads::<CpuRuntime, V>(variant, cpu, x, &lens, shapes);
        let got = grads::<WgpuRuntime, V>(variant, device, x, &lens, shapes);
        // Against the f64 reference too (the CPU's is checked against it).
        let p = crate::Problem::new(b, (hq, hkv), (sq, cap), d).with_head_dim_v(dv);
        let inputs = crate::cpu::tests::Inputs {
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
            dout: dout.clone(),
            dlse: vec![0.0; b * hq * sq],
        };
        let host_lens: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
        let reference = crate::cpu::tests::reference_lens(
            &variant.host(&p).unwrap(),
            &p,
            &inputs,
            Some(&host_lens),
        );
        for (name, got, want) in [
            ("dq", &got[0], &reference.dq),
            ("dk", &got[1], &reference.dk),
            ("dv", &got[2], &reference.dv),
        ] {
            crate::cpu::tests::assert_close(
                &format!("{} Sq={sq}: {name}", V::NAME),
                got,
                want,
                1e-4,
            );
        }
        for ((name, want), got) in ["dq", "dk", "dv"].iter().zip(&want).zip(&got) {
            let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1.0);
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    g.is_finite() && (g - w).abs() <= 1e-5 * scale,
                    "{} Sq={sq}: {name}[{i}] = {g}, cpu {w}",
                    V::NAME
                );
            }
        }
        for ((name, got), w) in ["dk", "dv"].iter().zip(&got[1..]).zip([d, dv]) {
            for (row, g) in got.chunks(w).enumerate() {
                if spare(row) {
                    assert!(
                        g.iter().all(|x| x.to_bits() == 0),
                        "{} Sq={sq}: {name} of spare slot {row} = {g:?}",
                        V::NAME
                    );
                }
            }
        }
    }
    check(&CausalSoftcap { cap: 20.0 }, 3, &device, &cpu);
    check(&SlidingWindow { window: 9 }, 12, &device, &cpu);
}

/// Ring attention on wgpu, its traffic staged through host memory (the
/// in-process communicator moves host buffers): every rank's rows equal
/// the single-device result on the same backend (out, lse, dq, dk, dv,
/// learnable gradients), both layouts.
mod ring {
    use super::device;
    use crate::Schedule;
    use crate::ring::tests::{
        a_failing_kernel_fails_every_rank_on, disagreeing_ranks_fail_alike_on, documents_on,
        each_layout_on, learnable_on,
    };
    use crate::stock::{AlibiSlopes, Causal, CausalSlidingWindow, CausalSlidingWindowSinks, Full};
    use numr::runtime::wgpu::WgpuRuntime;

    #[test]
    fn full_and_causal_match_one_device() {
        let Some(device) = device() else { return };
        each_layout_on::<_, WgpuRuntime>(&device, 30, &[1, 2, 4], Schedule::Ring, |_, _, _| Full);
        each_layout_on::<_, WgpuRuntime>(&device, 31, &[2, 3], Schedule::Ring, |_, _, _| Causal);
    }

    #[test]
    fn a_window_and_documents_match_one_device() {
        let Some(device) = device() else { return };
        each_layout_on::<_, WgpuRuntime>(&device, 32, &[3], Schedule::Ring, |_, _, _| {
            CausalSlidingWindow { window: 4 }
        });
        each_layout_on::<_, WgpuRuntime>(&device, 33, &[2, 3], Schedule::Ring, |_, w, d| {
            documents_on::<WgpuRuntime>(w, d)
        });
    }

    #[test]
    fn a_learnable_bias_and_sinks_match_one_device() {
        let Some(device) = device() else { return };
        each_layout_on::<_, WgpuRuntime>(&device, 34, &[2, 3], Schedule::Ring, |rng, _, d| {
            AlibiSlopes {
                slopes: learnable_on::<WgpuRuntime>(rng, 0.2, d),
            }
        });
        each_layout_on::<_, WgpuRuntime>(&device, 35, &[3], Schedule::AllGather, |rng, _, d| {
            CausalSlidingWindowSinks {
                window: 3,
                sinks: learnable_on::<WgpuRuntime>(rng, 1.0, d),
            }
        });
    }

    #[test]
    fn faults_fail_every_rank() {
        let Some(device) = device() else { return };
        disagreeing_ranks_fail_alike_on::<WgpuRuntime>(&device);
        a_failing_kernel_fails_every_rank_on::<WgpuRuntime>(&device);
    }
}

/// The same seed and offset drop the same pairs on the CPU, on WGSL and in
/// the reference's own generator, bit for bit: with `q = 0` every visible
/// pair of a row weighs `1/Sk`, and with `V` the identity `out[i][j]` is
/// that weight times pair `(i, j)`'s factor, so `out != 0` is the mask.
/// Offsets 0 and 1 draw different masks; the dropout probability is
/// checked per call.
#[test]
fn dropout_masks_agree_bit_for_bit_across_backends() {
    use crate::stock::CausalDropout;
    use numr::runtime::cpu::{CpuDevice, CpuRuntime};
    let Some(device) = device() else { return };
    let (b, h, s) = (2, 3, 96);
    let mut eye = vec![0.0f32; b * h * s * s];
    for (i, x) in eye.iter_mut().enumerate() {
        if i / s % s == i % s {
            *x = 1.0;
        }
    }
    let zeros = vec![0.0f32; b * h * s * 8];
    let variant = CausalDropout { p: 0.3 };
    let masks = |offset: u32| {
        let opts = AttentionOptions {
            dropout_seed: 0x0123_4567_89AB_CDEF,
            dropout_offset: offset,
            ..Default::default()
        };
        let cpu = CpuDevice::new();
        let t = |x: &[f32], d| Tensor::<CpuRuntime>::from_slice(x, &[b, h, s, d], &cpu).unwrap();
        let (out_cpu, _) = attention(
            &variant,
            &t(&zeros, 8),
            Keys::dense(&t(&zeros, 8), &t(&eye, s)),
            &opts,
        )
        .map(|y| (y.out, y.lse))
        .unwrap();
        let w =
            |x: &[f32], d| Tensor::<WgpuRuntime>::from_slice(x, &[b, h, s, d], &device).unwrap();
        let (out_gpu, _) = attention(
            &variant,
            &w(&zeros, 8),
            Keys::dense(&w(&zeros, 8), &w(&eye, s)),
            &opts,
        )
        .map(|y| (y.out, y.lse))
        .unwrap();
        let bits = |o: Vec<f32>| o.iter().map(|&x| x != 0.0).collect::<Vec<bool>>();
        let p = crate::validate::call(&variant, crate::Problem::new(b, (h, h), (s, s), 8), &opts)
            .unwrap();
        let mut want = vec![false; b * h * s * s];
        for (at, w) in want.iter_mut().enumerate() {
            let (bh, i, j) = (at / (s * s), at / s % s, at % s);
            let (bi, hi) = ((bh / h) as i32, (bh % h) as i32);
            *w = j <= i && crate::testing::reference::keeps(&p, bi, hi, i as i32, j as i32);
        }
        let (cpu, gpu) = (bits(out_cpu.to_vec::<f32>()), bits(out_gpu.to_vec::<f32>()));
        assert_eq!(
            cpu, want,
            "CPU against the reference's draw (offset {offset})"
        );
        assert_eq!(
            gpu, want,
            "WGSL against the reference's draw (offset {offset})"
        );
        want
    };
    assert_ne!(masks(0), masks(1), "offsets draw different masks");
    let ones = Tensor::<WgpuRuntime>::from_slice(&zeros, &[b, h, s, 8], &device).unwrap();
    for p in [1.0, -0.1, f32::NAN] {
        let e = attention(
            &CausalDropout { p },
            &ones,
            Keys::dense(&ones, &ones),
            &AttentionOptions::default(),
        )
        .map(|y| (y.out, y.lse))
        .unwrap_err();
        assert!(matches!(e, Error::Dropout(_)), "p = {p}: {e}");
    }
}

#[test]
fn merged_states_equal_one_call() {
    let Some(device) = device() else { return };
    crate::merge::tests::merges_like_one_call_on::<WgpuRuntime>(&device, false);
}

/// Cache writes in place, from several threads at once (the writer's
/// pipeline built on first use by whichever comes first).
#[test]
fn appends_write_in_place_from_several_threads() {
    let Some(device) = device() else { return };
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                crate::append::tests::writes_in_place_on::<WgpuRuntime>(
                    &device,
                    &[crate::append::tests::F32],
                )
            });
        }
    });
}

#[test]
fn draft_trees_see_the_prefix_and_their_ancestors() {
    let Some(device) = device() else { return };
    crate::tree::tests::drafts_see_the_prefix_and_their_ancestors_on::<WgpuRuntime>(&device);
}

#[test]
fn mixed_batches_equal_each_sequence_alone() {
    let Some(device) = device() else { return };
    crate::mixed::tests::mixed_batches_equal_each_sequence_alone_on::<WgpuRuntime>(&device);
}
