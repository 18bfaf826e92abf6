//! The bf16 kernels (AMX tiles, `vdpbf16ps`) against the f64 reference
//! within the bf16 yardstick, and strided operands.

use super::*;

/// Naive attention in f64 with the AMX forward's one rounding: each row's
/// `p_j = e^(x_j − m)` rounded to bf16 before `Σ p_j v_j` (the row sum `l`
/// of the unrounded `p_j`, as the kernel keeps it); the yardstick of the
/// bf16 rule.
fn naive_bf16<V: HostVariant>(var: &V, p: &Problem, x: &Inputs) -> Vec<f64> {
    let (sq, sk, d, dv) = (p.seq_q, p.seq_k, p.head_dim, p.head_dim_v);
    let scale = p.scale as f64;
    let mut out = vec![0.0f64; p.out_len()];
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            let bh = b * p.heads_q + h;
            let kvb = (b * p.heads_kv + h / p.group()) * sk;
            for i in 0..sq {
                let qi = (i as i64 + sk as i64 - sq as i64) as i32;
                let qrow = &x.q[(bh * sq + i) * d..][..d];
                let xs: Vec<f64> = (0..sk)
                    .map(|j| {
                        let krow = &x.k[(kvb + j) * d..][..d];
                        let s = qrow
                            .iter()
                            .zip(krow)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>()
                            * scale;
                        if var.mask_exact(b as i32, h as i32, qi, j as i32) {
                            var.score_f64(s, b as i32, h as i32, qi, j as i32)
                        } else {
                            f64::NEG_INFINITY
                        }
                    })
                    .collect();
                let sink = var.sink_f64(b as i32, h as i32, qi);
                let m = xs.iter().copied().fold(sink, f64::max);
                if m == f64::NEG_INFINITY {
                    continue;
                }
                let l = xs.iter().map(|&x| (x - m).exp()).sum::<f64>() + (sink - m).exp();
                let o = &mut out[(bh * sq + i) * dv..][..dv];
                for (j, &xj) in xs.iter().enumerate() {
                    let pj = f64::from(bf16_round((xj - m).exp() as f32));
                    for (o, &v) in o.iter_mut().zip(&x.v[(kvb + j) * dv..][..dv]) {
                        *o += pj * f64::from(v);
                    }
                }
                o.iter_mut().for_each(|o| *o /= l);
            }
        }
    }
    out
}

/// bf16 inputs on AMX tiles and on `vdpbf16ps` (capped at `Bf16Dot`),
/// each where this CPU has it: against the f64
/// reference of the same bf16 values under FlashAttention's rule, with
/// naive attention in the same roundings as the yardstick:
/// `max|kernel − ref| ≤ 2·max|naive_bf16 − ref| + 1e-6·(1 + max|ref|)` for
/// `out`, and `lse` (f32 throughout) within 2e-5. Odd shapes, GQA 4:1, Sq ≠
/// Sk, a long row (S = 4096), masks, a score; NaN in K and V rows no
/// query sees. The backward likewise, fed the forward's bf16 `out`, for
/// dq, dk and dv, with the yardstick in its roundings (`O`, `P` and
/// `scale·dS` in bf16). Capped at AVX-512, the same calls decline, and the
/// caller widens the inputs for the f32 kernels.
#[test]
fn bf16_tiles_match_the_reference_within_the_bf16_yardstick() {
    use crate::cpu::simd::Level;
    use crate::stock::{Causal, CausalSlidingWindow, Full, Softcap};
    // The products each level runs here: AMX tiles where present, and
    // (capped at Bf16Dot) vdpbf16ps wherever present.
    let levels = bf16_levels();
    if levels.is_empty() {
        return;
    }
    fn check<V: Variant>(var: &V, p: Problem, hide: bool, levels: &[Level]) {
        let host = var.host(&p).unwrap();
        let mut x = Inputs::new(&p, 0xbf16 ^ (p.seq_q * 7 + p.seq_k) as u64, 1.0);
        x.round_to_bf16();
        if hide {
            // Keys that no query sees (a causal mask with Sq < Sk hides
            // none; a window hides the oldest): NaN in K and V.
            let seen = crate::testing::seen_keys(&host, &p);
            for (key, seen) in seen.iter().enumerate() {
                if !seen {
                    let (d, dv) = (p.head_dim, p.head_dim_v);
                    x.k[key * d..(key + 1) * d].fill(f32::NAN);
                    x.v[key * dv..(key + 1) * dv].fill(f32::NAN);
                }
            }
        }
        let want = reference_lens(&host, &p, &x, None);
        let naive = naive_bf16(&host, &p, &x);
        let yard_grads =
            reference_rounded(&host, &p, &x, None, |x| f64::from(bf16_round(x as f32)));
        for &level in levels {
            capped(level, 2).install(|| {
                let kind = match level {
                    Level::Amx => amx::Kind::Amx,
                    _ => amx::Kind::Dot,
                };
                assert_eq!(amx::kind(), Some(kind), "capped at {level:?}");
                let (mut out, mut lse) = poisoned(p);
                let ran =
                    forward_bf16(var, &p, &bf(&x.q), &bf(&x.k), &bf(&x.v), &mut out, &mut lse)
                        .unwrap();
                assert!(ran, "{} {p:?} {level:?}: the bf16 forward runs", V::NAME);
                let ctx = format!("{} {p:?}", V::NAME);
                within(&format!("{ctx} out"), &out, &want.out, &naive);
                assert_close(&format!("{ctx} lse"), &lse, &want.lse, 2e-5);

                // The backward, fed the forward's bf16 out and f32 lse, against
                // the same reference, with the yardstick in the backward's
                // roundings (bf16 O, P and scale·dS).
                let bf16 = Bf16Backward::new(&x, &out);
                let mut g = Grads::poisoned(&p);
                let ran = g.bf16(var, &p, None, bf16.inputs(&lse), &[]);
                assert!(
                    ran.is_some(),
                    "{} {p:?} {level:?}: the bf16 backward runs",
                    V::NAME
                );
                within(&format!("{ctx} dq"), &g.dq, &want.dq, &yard_grads.dq);
                within(&format!("{ctx} dk"), &g.dk, &want.dk, &yard_grads.dk);
                within(&format!("{ctx} dv"), &g.dv, &want.dv, &yard_grads.dv);
            });
        }
        // Capped at AVX-512, the calls decline without writing.
        let pool = capped(Level::Avx512, 1);
        let (mut untouched, mut lse) = poisoned(p);
        let bf16 = Bf16Backward::new(&x, &x.dout);
        let declined = pool.install(|| {
            forward_bf16(var, &p, &bf16.q, &bf16.k, &bf16.v, &mut untouched, &mut lse).unwrap()
        });
        assert!(
            !declined && untouched.iter().all(|x| x.is_nan()),
            "capped, the bf16 forward runs"
        );
        let mut g = Grads::poisoned(&p);
        let declined = pool.install(|| g.bf16(var, &p, None, bf16.inputs(&lse), &[]));
        assert!(
            declined.is_none() && g.dq.iter().chain(&g.dk).all(|x| x.is_nan()),
            "capped, the bf16 backward runs"
        );
    }
    let l = &levels;
    check(&Full, problem(2, 4, 1, 77, 130, 64), false, l);
    check(&Causal, problem(1, 4, 2, 200, 200, 128), false, l);
    check(&Causal, problem(1, 2, 2, 33, 97, 96), false, l);
    check(
        &Softcap { cap: 20.0 },
        problem(1, 2, 1, 64, 64, 32),
        false,
        l,
    );
    check(
        &CausalSlidingWindow { window: 40 },
        problem(1, 2, 1, 150, 150, 64),
        true,
        l,
    );
    check(&Causal, problem(1, 1, 1, 4096, 4096, 64), false, l);
    // Values of their own head dim: MLA's prefill (192/128), a padded
    // value dim, and values wider than keys with hidden keys.
    check(
        &Causal,
        problem(1, 2, 2, 130, 130, 192).with_head_dim_v(128),
        false,
        l,
    );
    check(
        &Full,
        problem(1, 4, 2, 70, 90, 64).with_head_dim_v(40),
        false,
        l,
    );
    check(
        &CausalSlidingWindow { window: 33 },
        problem(1, 2, 1, 100, 100, 40).with_head_dim_v(96),
        true,
        l,
    );
    // Head dims that are no multiple of 32, padded inside.
    check(&Full, problem(1, 4, 2, 70, 90, 40), false, l);
    check(&Causal, problem(1, 2, 1, 129, 129, 80), false, l);
    check(
        &CausalSlidingWindow { window: 33 },
        problem(1, 2, 2, 100, 100, 72),
        true,
        l,
    );
}

/// A prefix every query sees, then a causal window: at `Sq < Sk`, the key
/// tiles between the prefix and the window are empty for every query
/// tile, in the middle of the bf16 backward's passes of several key tiles.
#[crate::attention(mask = |_b, _h, q, kv| kv < 64 || (kv <= q && q - kv < 40))]
#[derive(Clone, Debug)]
struct PrefixWindow;

/// The bf16 backward with one to four key tiles per pass (its dQ one
/// product over a pass's tiles): empty tiles in the middle of a pass, NaN
/// in the K and V rows no query sees, against the f64 reference under the
/// bf16 yardstick, on each bf16 level this CPU has.
#[test]
fn bf16_backward_passes_of_several_key_tiles_match_the_reference() {
    let levels = bf16_levels();
    if levels.is_empty() {
        return;
    }
    // Sq < Sk: the keys between prefix and window are hidden from every
    // query (NaN there). Sq = Sk: query tile 2 computes key tile 1, which
    // is empty for query tile 3, between the prefix's tile and its own.
    for (sq, hidden) in [(96, true), (384, false)] {
        let p = problem(1, 2, 1, sq, 384, 64);
        let host = PrefixWindow.host(&p).unwrap();
        let mut x = Inputs::new(&p, 0x9a55 ^ sq as u64, 1.0);
        x.round_to_bf16();
        let seen = crate::testing::seen_keys(&host, &p);
        assert_eq!(seen.iter().any(|s| !s), hidden);
        for (key, seen) in seen.iter().enumerate() {
            if !seen {
                x.k[key * 64..(key + 1) * 64].fill(f32::NAN);
                x.v[key * 64..(key + 1) * 64].fill(f32::NAN);
            }
        }
        let want = reference_lens(&host, &p, &x, None);
        let yard = reference_rounded(&host, &p, &x, None, |x| f64::from(bf16_round(x as f32)));
        for &level in &levels {
            capped(level, 2).install(|| {
                let (mut out, mut lse) = poisoned(p);
                let (q, k, v) = (bf(&x.q), bf(&x.k), bf(&x.v));
                assert!(forward_bf16(&PrefixWindow, &p, &q, &k, &v, &mut out, &mut lse).unwrap());
                let bits =
                    |x: &[half::bf16]| -> Vec<u16> { x.iter().map(|y| y.to_bits()).collect() };
                let (outb, doutb) = (bits(&bf(&out)), bits(&bf(&x.dout)));
                let (qb, kb, vb) = (bits(&q), bits(&k), bits(&v));
                for kv_group in [1, 2, 4] {
                    let inputs = amx_backward::Inputs {
                        q: &qb,
                        k: &kb,
                        v: &vb,
                        out: &outb,
                        dout: &doutb,
                        lse: &lse,
                        dlse: Some(&x.dlse),
                    };
                    let mut g = Grads::poisoned(&p);
                    let (dq, dk, dv) = (&mut g.dq, &mut g.dk, &mut g.dv);
                    amx_backward::backward(&host, &p, 1, kv_group, inputs, dq, dk, dv, &mut []);
                    let ctx = format!("Sq {sq}, {level:?}, {kv_group} key tiles a pass");
                    within(&format!("{ctx}: dq"), &g.dq, &want.dq, &yard.dq);
                    within(&format!("{ctx}: dk"), &g.dk, &want.dk, &yard.dk);
                    within(&format!("{ctx}: dv"), &g.dv, &want.dv, &yard.dv);
                }
            });
        }
    }
}

/// A learnable bias per (query head, key), causal: a read of `score`
/// whose element depends on the key itself, not on `kv − q`, so its
/// gradient goes pair by pair (not by diagonal).
#[crate::attention(
    score = |s, _b, h, _q, kv| s + self.bias[h][kv],
    mask = |_b, _h, q, kv| kv <= q,
)]
#[derive(Clone, Debug)]
struct KeyBias<R: numr::runtime::Runtime> {
    #[tensor(f32, [Hq, Sk])]
    bias: numr::autograd::Var<R>,
}

/// The bf16 products (each kind this CPU has, the level capped to it)
/// with a head dim that is no multiple of 32, learnable tensors read by
/// `score` (pair by pair and by diagonal), and over a KV cache whose
/// spare slots hold NaN: out, dq, dk, dv and the tensors' gradients
/// against the f64 reference, within twice the error of the yardstick
/// (the reference with the bf16 kernels' roundings for out, dq, dk and
/// dv; the widened f32 backward, fed the same bf16 out, for the tensors,
/// whose gradients the bf16 kernels compute from f32 `P` and `dP`).
#[test]
fn bf16_tiles_cover_padded_dims_learnable_tensors_and_caches() {
    use crate::cpu::simd::Level;
    use crate::stock::AlibiSlopes;
    use numr::autograd::Var;
    use numr::runtime::cpu::{CpuDevice, CpuRuntime};
    use numr::tensor::Tensor;
    let levels = bf16_levels();
    if levels.is_empty() {
        return;
    }
    let device = CpuDevice::new();
    let mut rng = crate::testing::Rng::new(0xbf1e, 0);

    // Learnable tensors, with padded head dims (40, 80).
    fn learnable<V: Variant>(var: &V, p: Problem, levels: &[Level]) {
        let host = var.host(&p).unwrap();
        let mut x = Inputs::new(&p, 0x1ea ^ p.head_dim as u64, 1.0);
        x.round_to_bf16();
        let f = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
        let want = crate::testing::reference_backward(
            &host,
            &p,
            &f(&x.q),
            &f(&x.k),
            &f(&x.v),
            &f(&x.dout),
        );
        let (mut out, mut lse) = (vec![0.0f32; p.out_len()], vec![0.0f32; p.lse_len()]);
        forward(var, &p, &x.q, &x.k, &x.v, &mut out, &mut lse).unwrap();
        let out: Vec<f32> = out.iter().map(|&o| bf16_round(o)).collect();
        // The yardstick: the f32 backward on the same inputs and bf16 out.
        let yard = Grads::poisoned(&p).f32(var, &p, None, x.backward(&out, &lse), &[true]);
        let yard: Vec<f64> = f(yard[0].as_ref().unwrap());
        let bf16 = Bf16Backward::new(&x, &out);
        for &level in levels {
            let pool = capped(level, 2);
            let mut g = Grads::poisoned(&p);
            let grads = pool.install(|| g.bf16(var, &p, None, bf16.inputs(&lse), &[true]));
            let grads = grads.expect("the bf16 backward runs");
            let got = grads[0].as_ref().expect("the tensor's gradient");
            within(
                &format!("{} {p:?} {level:?} tensor", V::NAME),
                got,
                &want.tensors[0],
                &yard,
            );
            // Every thread count gives the same bits (fixed chunking).
            let one = capped(level, 1);
            let mut h = Grads::poisoned(&p);
            let again = one.install(|| h.bf16(var, &p, None, bf16.inputs(&lse), &[true]));
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(again.unwrap()[0].as_ref().unwrap()),
                bits(got),
                "thread counts"
            );
            assert_eq!(
                (bits(&h.dq), bits(&h.dk)),
                (bits(&g.dq), bits(&g.dk)),
                "dq, dk bits"
            );
        }
    }
    let p = problem(1, 4, 2, 100, 100, 40);
    let bias: Vec<f32> = (0..p.heads_q * p.seq_k)
        .map(|_| rng.uniform() as f32 - 0.5)
        .collect();
    let bias = Tensor::<CpuRuntime>::from_slice(&bias, &[p.heads_q, p.seq_k], &device).unwrap();
    learnable(
        &KeyBias {
            bias: Var::new(bias, true),
        },
        p,
        &levels,
    );
    // Values of their own (padded) head dim.
    for p in [
        problem(1, 2, 1, 77, 130, 80),
        problem(1, 2, 1, 77, 130, 64).with_head_dim_v(40),
    ] {
        let slopes = Tensor::<CpuRuntime>::from_slice(&[0.05f32, 0.3], &[2], &device).unwrap();
        learnable(
            &AlibiSlopes {
                slopes: Var::new(slopes, true),
            },
            p,
            &levels,
        );
    }

    // The backward over a KV cache, NaN in the spare slots, D = 40.
    let lens = [0usize, 37, 128, 90];
    let p = problem(lens.len(), 4, 2, 40, 128, 40);
    let mut x = Inputs::new(&p, 0xcac7e, 1.0);
    x.round_to_bf16();
    x.poison_spare_slots(&p, &lens, f32::NAN);
    let var = crate::stock::CausalSoftcap { cap: 20.0 };
    let host = var.host(&p).unwrap();
    let want = reference_lens(&host, &p, &x, Some(&lens));
    let yard = reference_rounded(&host, &p, &x, Some(&lens), |x| {
        f64::from(bf16_round(x as f32))
    });
    let (mut out, mut lse) = (vec![0.0f32; p.out_len()], vec![0.0f32; p.lse_len()]);
    forward_cache(
        &var,
        &p,
        CacheLayout::lengths(&lens),
        &x.q,
        &x.k,
        &x.v,
        &mut out,
        &mut lse,
    )
    .unwrap();
    let bf16 = Bf16Backward::new(&x, &out);
    for &level in &levels {
        let mut g = Grads::poisoned(&p);
        let ran =
            capped(level, 2).install(|| g.bf16(&var, &p, Some(&lens), bf16.inputs(&lse), &[]));
        assert!(ran.is_some(), "{level:?}: the bf16 cache backward runs");
        let ctx = format!("cache {p:?} {level:?}");
        within(&format!("{ctx} dq"), &g.dq, &want.dq, &yard.dq);
        within(&format!("{ctx} dk"), &g.dk, &want.dk, &yard.dk);
        within(&format!("{ctx} dv"), &g.dv, &want.dv, &yard.dv);
        g.assert_spare_slots_zero(&p, &lens, &ctx);
    }
}

/// `x` (`[n, h, s, d]`, contiguous) laid out as `[n, s, h, d + 5]`, the
/// spare columns NaN, and read back in place as `[n, h, s, d]`: rows
/// `h·(d + 5)` apart, heads `d + 5`.
struct Spread<E> {
    data: Vec<E>,
    shape: [usize; 4],
}

impl<E: KvElem> Spread<E> {
    const PAD: usize = 5;

    fn new(x: &[f32], shape @ [n, h, s, d]: [usize; 4], elem: impl Fn(f32) -> E) -> Self {
        let w = d + Self::PAD;
        let mut data = vec![elem(f32::NAN); n * s * h * w];
        for (row, src) in x.chunks_exact(d).enumerate() {
            let (bh, si) = (row / s, row % s);
            let (bi, hi) = (bh / h, bh % h);
            let at = ((bi * s + si) * h + hi) * w;
            for (dst, &v) in data[at..at + d].iter_mut().zip(src) {
                *dst = elem(v);
            }
        }
        Self { data, shape }
    }

    fn operand(&self) -> Operand<'_> {
        let [_, h, s, d] = self.shape;
        let w = d + Self::PAD;
        Operand::new(E::stored(&self.data), self.shape, [s * h * w, w, h * w])
    }
}

/// Every forward path over operands read in place with rows, heads and
/// batches apart (NaN between the rows, which must never be read) gives
/// the bits of the same inputs packed: the tile kernel in f32 and f16, the
/// decode kernel, a cache, and the bf16 tile products at each level.
#[test]
fn strided_operands_give_the_bits_of_packed_ones() {
    use crate::stock::Causal;
    fn run<E: KvElem>(
        p: &Problem,
        x: &Inputs,
        elem: impl Fn(f32) -> E + Copy,
        cache: Option<CacheLayout<'_>>,
        bf16_tiles: bool,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let [b, hq, hkv, sq, sk] = [p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k];
        let packed = |x: &[f32]| x.iter().map(|&v| elem(v)).collect::<Vec<E>>();
        let (q, k, v) = (packed(&x.q), packed(&x.k), packed(&x.v));
        let sq_ = Spread::new(&x.q, [b, hq, sq, p.head_dim], elem);
        let sk_ = Spread::new(&x.k, [b, hkv, sk, p.head_dim], elem);
        let sv_ = Spread::new(&x.v, [b, hkv, sk, p.head_dim_v], elem);
        let spread = ForwardInputs {
            q: sq_.operand(),
            keys: KeyRows::new(sk_.operand(), sv_.operand(), cache, p),
            seqs: crate::cpu::Seqs::of_cache(cache),
        };
        let packed = ForwardInputs::packed(p, &q, (&k, &v), cache);
        let mut results = Vec::new();
        for x in [packed, spread] {
            let (mut out, mut lse) = poisoned(p);
            let mut max = lse.clone();
            let outputs = (&mut out[..], &mut lse[..], Some(&mut max[..]));
            if bf16_tiles {
                assert!(forward_bf16_inputs(&Causal, p, x, outputs).unwrap());
            } else {
                forward_stored_inputs(&Causal, p, x, outputs).unwrap();
            }
            results.push((out, lse, max));
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (what, got, want) in [
            ("out", &results[1].0, &results[0].0),
            ("lse", &results[1].1, &results[0].1),
            ("max", &results[1].2, &results[0].2),
        ] {
            assert_eq!(bits(got), bits(want), "{what} {p:?} cache {cache:?}");
        }
        assert!(results[0].0.iter().all(|v| v.is_finite()), "{p:?}");
        results.pop().unwrap()
    }
    let f16 = half::f16::from_f32;
    let bf16 = half::bf16::from_f32;
    let tile = problem(2, 4, 2, 70, 93, 40).with_head_dim_v(24);
    let decode = problem(2, 8, 2, 3, 150, 64).with_head_dim_v(48);
    let x = Inputs::new(&tile, 0x5e7, 1.0);
    run(&tile, &x, |v| v, None, false);
    run(&tile, &x, f16, None, false);
    let x = Inputs::new(&decode, 0x5e8, 1.0);
    run(&decode, &x, |v| v, None, false);
    run(&decode, &x, bf16, None, false);
    let lens = [97, 150];
    run(&decode, &x, bf16, Some(CacheLayout::lengths(&lens)), false);
    let mut x = Inputs::new(&tile, 0x5e9, 1.0);
    x.round_to_bf16();
    for level in bf16_levels() {
        capped(level, 2).install(|| run(&tile, &x, bf16, None, true));
    }
}
