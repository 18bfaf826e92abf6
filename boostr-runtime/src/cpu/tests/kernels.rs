//! The tile forward and backward against the f64 reference: odd shapes,
//! every key chunking and query grouping, masked rows, huge logits,
//! determinism, every instruction set, skipped tiles and bands.

use super::*;

#[test]
fn plain_matches_reference() {
    check_all(&Unmasked);
}

#[test]
fn causal_softcap_matches_reference() {
    check_all(&CausalSoftcap::new(2.0));
}

#[test]
fn sliding_window_matches_reference() {
    check_all(&SlidingWindow { window: 20 });
}

#[test]
fn alibi_sees_batch_query_head_and_positions() {
    check_all(&Alibi { slope: 0.05 });
}

#[test]
fn every_key_chunking_and_grouping_matches_reference() {
    // Chunk counts beyond the number of key tiles are clamped; passes of 3
    // key tiles leave a short last pass in chunks of 9 tiles, and groups
    // larger than a chunk take the whole chunk in one pass.
    let p = problem(2, 4, 2, 97, 130, 64);
    for chunks in [1, 2, 3, 5, 100] {
        for kv_group in [1, 3, 100] {
            let schedule = Some((chunks, kv_group));
            let tiles = CpuTiles::new(16, 16);
            check(&CausalSoftcap::new(3.0), &p, tiles, schedule, 7);
            check(&Unmasked, &p, CpuTiles::new(32, 16), schedule, 8);
        }
    }
}

#[test]
fn key_tiles_group_only_when_queries_outgrow_l2() {
    let t = CpuTiles::DEFAULT;
    // A key tile's pass reads Q, dO and dQ: 3 · 64 · D · 4 bytes per query
    // tile and query head: 1.5 MiB at S = 1024, D = 128, Hkv = Hq (not
    // grouped, just), 3 MiB at S = 2048; GQA 4:1 multiplies by four.
    let p = |hq, hkv, s, d| problem(1, hq, hkv, s, s, d);
    assert_eq!(
        backward::kv_group_size(&Unmasked, &p(8, 8, 1024, 128), t),
        1
    );
    assert_eq!(
        backward::kv_group_size(&Unmasked, &p(8, 8, 2048, 128), t),
        4
    );
    assert_eq!(backward::kv_group_size(&Unmasked, &p(8, 2, 1024, 64), t), 4);
    // Under a causal mask about half as many query tiles meet a key tile.
    let causal = CausalSoftcap::new(2.0);
    assert_eq!(backward::kv_group_size(&causal, &p(8, 8, 1024, 128), t), 1);
    assert_eq!(backward::kv_group_size(&causal, &p(8, 8, 4096, 128), t), 4);
    // A sliding window: a few query tiles per key tile, however long.
    let window = SlidingWindow { window: 256 };
    assert_eq!(backward::kv_group_size(&window, &p(8, 8, 16384, 128), t), 1);
}

/// The forward alone with `group` query tiles per task, into NaN-poisoned
/// buffers, against the f64 reference.
#[track_caller]
fn check_forward_grouped<V: HostVariant>(
    v: &V,
    p: &Problem,
    t: CpuTiles,
    group: usize,
    x: &Inputs,
) {
    let want = reference(v, p, x);
    let poisoned = || {
        let (out, lse) = poisoned(p);
        (out, lse.clone(), lse)
    };
    let (mut out, mut lse, mut max) = poisoned();
    let run = |(q, k, v_): (&[_], &[_], &[_]),
               out: &mut [f32],
               lse: &mut [f32],
               max: Option<&mut [f32]>| {
        let x = ForwardInputs::packed(p, q, (k, v_), None);
        forward::forward(v, p, t, group, x.q, x.keys, (out, lse, max));
    };
    run((&x.q, &x.k, &x.v), &mut out, &mut lse, Some(&mut max[..]));
    let ctx = format!("{} {p:?} {t:?} group {group}", V::NAME);
    assert_close(&format!("out {ctx}"), &out, &want.out, 2e-5);
    assert_close(&format!("lse {ctx}"), &lse, &want.lse, 2e-5);
    assert_close(&format!("max {ctx}"), &max, &want.max_scores, 2e-5);
    // Without the rows' largest scores: the same bits.
    let mut alone = poisoned();
    run((&x.q, &x.k, &x.v), &mut alone.0, &mut alone.1, None);
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(
        same(&alone.0, &out) && same(&alone.1, &lse),
        "without max {ctx}"
    );
    // 16-bit inputs, read as stored (widened a tile or a kv head at a
    // time): the same bits as f32 inputs of the same values.
    let (q, k, vv) = (bf16s(&x.q), bf16s(&x.k), bf16s(&x.v));
    let wide = |x: &[half::bf16]| x.iter().map(|y| y.to_f32()).collect::<Vec<f32>>();
    let (qw, kw, vw) = (wide(&q), wide(&k), wide(&vv));
    let mut want = poisoned();
    run(
        (&qw, &kw, &vw),
        &mut want.0,
        &mut want.1,
        Some(&mut want.2[..]),
    );
    let mut got = poisoned();
    let x = ForwardInputs::packed(p, &q[..], (&k[..], &vv[..]), None);
    forward::forward(
        v,
        p,
        t,
        group,
        x.q,
        x.keys,
        (&mut got.0, &mut got.1, Some(&mut got.2)),
    );
    assert!(
        same(&got.0, &want.0) && same(&got.1, &want.1) && same(&got.2, &want.2),
        "bf16 as stored {ctx}"
    );
}

fn bf16s(x: &[f32]) -> Vec<half::bf16> {
    x.iter().map(|&y| half::bf16::from_f32(y)).collect()
}

#[test]
fn every_query_grouping_matches_reference() {
    // Groups of 1 to 4 query tiles per task, and more than there are tiles;
    // 97 rows in tiles of 16 leave a last group short of tiles and a last
    // tile short of rows. Sq > Sk puts fully masked rows in the first tile.
    for (sq, sk) in [(97, 130), (130, 97)] {
        let p = problem(2, 4, 2, sq, sk, 40);
        let x = Inputs::new(&p, 11, 1.0);
        let tiles = CpuTiles::new(16, 32);
        for group in [1, 2, 3, 4, 100] {
            check_forward_grouped(&SlidingWindow { window: 20 }, &p, tiles, group, &x);
            check_forward_grouped(&Unmasked, &p, tiles, group, &x);
        }
    }
}

#[test]
fn query_groups_only_when_keys_outgrow_l2() {
    let t = CpuTiles::DEFAULT;
    let p = |hq, s, d| problem(1, hq, hq, s, s, d);
    // A query tile reads 1 MiB of K and V at S = 2048, D = 64 (not grouped),
    // 2 MiB at D = 128; under a causal mask about half that on average.
    let causal = CausalSoftcap::new(2.0);
    assert_eq!(forward::group_size(&Unmasked, &p(8, 2048, 64), t, 2), 1);
    assert_eq!(forward::group_size(&Unmasked, &p(8, 2048, 128), t, 2), 4);
    assert_eq!(forward::group_size(&causal, &p(8, 1024, 128), t, 2), 1);
    assert_eq!(forward::group_size(&causal, &p(8, 4096, 128), t, 2), 4);
    // A sliding window reads a few key tiles per query tile, however long.
    let window = SlidingWindow { window: 256 };
    assert_eq!(forward::group_size(&window, &p(8, 16384, 128), t, 2), 1);
    // Too few tasks for four per thread: 1 head × 32 tiles → groups of 2
    // leave 16 tasks for 4 threads, groups of 4 would leave 8.
    assert_eq!(forward::group_size(&Unmasked, &p(1, 2048, 128), t, 4), 2);
    assert_eq!(forward::group_size(&Unmasked, &p(1, 2048, 128), t, 64), 1);
}

#[test]
fn fully_masked_rows_are_zero_with_lse_neg_inf() {
    // Causal with Sq > Sk: rows 0..12 sit at negative positions, see no key.
    let p = problem(2, 2, 1, 17, 5, 40);
    for tiles in TILES.into_iter().chain([CpuTiles::new(4, 2)]) {
        let x = Inputs::new(&p, 3, 1.0);
        let got = run(&CausalSoftcap::new(5.0), &p, tiles, None, &x);
        let want = reference(&CausalSoftcap::new(5.0), &p, &x);
        for bh in 0..4 {
            for i in 0..17 {
                let row = (bh * 17 + i) * 40..(bh * 17 + i + 1) * 40;
                if i < 12 {
                    assert_eq!(got.lse[bh * 17 + i], f32::NEG_INFINITY);
                    assert!(got.out[row.clone()].iter().all(|&o| o == 0.0));
                    assert!(got.dq[row].iter().all(|&g| g == 0.0));
                } else {
                    assert!(got.lse[bh * 17 + i].is_finite());
                }
            }
        }
        assert_close("out", &got.out, &want.out, 2e-5);
        assert_close("dq", &got.dq, &want.dq, 1e-4);
        assert_close("dk", &got.dk, &want.dk, 1e-4);
        assert_close("dv", &got.dv, &want.dv, 1e-4);
    }

    // No visible key at all: everything is zero, lse is -inf.
    let p = problem(1, 1, 1, 9, 40, 64);
    let x = Inputs::new(&p, 4, 1.0);
    let got = run(
        &SlidingWindow { window: 0 },
        &p,
        CpuTiles::new(4, 8),
        Some((3, 1)),
        &x,
    );
    assert!(got.lse.iter().all(|&l| l == f32::NEG_INFINITY));
    for g in [&got.out, &got.dq, &got.dk, &got.dv] {
        assert!(g.iter().all(|&x| x == 0.0));
    }
}

#[test]
fn huge_logits_do_not_overflow() {
    // q, k of magnitude 100 with D = 64: logits spread over about ±1e4.
    let p = problem(1, 2, 1, 33, 70, 64);
    let x = Inputs::new(&p, 5, 100.0);
    let logits = reference(&Unmasked, &p, &x).lse;
    assert!(
        logits.iter().any(|&l| l.abs() > 5e3),
        "logits not large: {logits:?}"
    );
    for tiles in [CpuTiles::DEFAULT, CpuTiles::new(8, 16)] {
        for causal in [false, true] {
            let (got, want) = if causal {
                let var = CausalSoftcap::new(1e6);
                (run(&var, &p, tiles, None, &x), reference(&var, &p, &x))
            } else {
                (
                    run(&Unmasked, &p, tiles, None, &x),
                    reference(&Unmasked, &p, &x),
                )
            };
            // The f32 logits themselves carry ~1e-3 relative error, so the
            // comparison is loose; the point is: finite, and right.
            assert_close("lse", &got.lse, &want.lse, 1e-5);
            assert_close("out", &got.out, &want.out, 2e-2);
            let gmax = want
                .dq
                .iter()
                .chain(&want.dk)
                .map(|g| g.abs())
                .fold(1.0, f64::max);
            for (what, g, w) in [("dq", &got.dq, &want.dq), ("dk", &got.dk, &want.dk)] {
                for (&g, &w) in g.iter().zip(w.iter()) {
                    assert!(g.is_finite(), "{what} not finite");
                    assert!((g as f64 - w).abs() <= 2e-2 * gmax, "{what}: {g} vs {w}");
                }
            }
            assert_close("dv", &got.dv, &want.dv, 2e-2);
        }
    }
}

#[test]
fn backward_is_bitwise_deterministic() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    let p = problem(1, 2, 1, 130, 130, 64);
    let tiles = CpuTiles::new(16, 16);
    let chunks = pool.install(|| key_chunks(&p, tiles, rayon::current_num_threads()));
    assert!(
        chunks > 1,
        "the test must exercise dQ partials (got {chunks} chunk)"
    );
    let x = Inputs::new(&p, 9, 1.0);
    let var = CausalSoftcap::new(4.0);
    let bits = |o: &Outputs| {
        [&o.dq, &o.dk, &o.dv].map(|g| g.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
    };
    let first = bits(&pool.install(|| run(&var, &p, tiles, None, &x)));
    for _ in 0..3 {
        assert!(first == bits(&pool.install(|| run(&var, &p, tiles, None, &x))));
    }
    check(&var, &p, tiles, Some((chunks, 1)), 9);
}

#[test]
fn every_instruction_set_agrees() {
    use crate::cpu::simd::Level;
    fn all_paths<V: HostVariant>(var: &V) {
        let p = problem(2, 4, 2, 97, 70, 40);
        let x = Inputs::new(&p, 12, 1.0);
        let tiles = CpuTiles::new(16, 32);
        let bits = |o: Outputs| {
            [o.out, o.lse, o.dq, o.dk, o.dv]
                .map(|g| g.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
        };
        let [baseline, avx2, avx512] = [Level::Baseline, Level::Avx2, Level::Avx512].map(|level| {
            let pool = capped(level, 2);
            bits(pool.install(|| run(var, &p, tiles, None, &x)))
        });
        // The elementwise passes give the same bits on every path, and the
        // SSE and AVX2 paths share the `gemm` crate's tile products; the
        // AVX-512 path multiplies tiles with its own kernel, whose rounding
        // differs (each is deterministic), so it is compared with a bound.
        assert!(baseline == avx2, "{}: SSE and AVX2 paths differ", V::NAME);
        for (which, (a, b)) in baseline.iter().zip(&avx512).enumerate() {
            for (&a, &b) in a.iter().zip(b) {
                let (a, b) = (f32::from_bits(a), f32::from_bits(b));
                assert!(
                    a == b || (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                    "{}: output {which}: SSE {a} vs AVX-512 {b}",
                    V::NAME
                );
            }
        }
    }
    all_paths(&CausalSoftcap::new(3.0));
    all_paths(&Alibi { slope: 0.1 });
    all_paths(&SlidingWindow { window: 9 });
}

#[test]
fn key_chunking_follows_threads_and_work() {
    let t = CpuTiles::DEFAULT;
    // One head, long sequence: split so two threads both get work.
    assert!(key_chunks(&problem(1, 1, 1, 1024, 1024, 64), t, 2) >= 2);
    assert_eq!(key_chunks(&problem(1, 1, 1, 1024, 1024, 64), t, 2), 4);
    // Enough (batch, kv head) pairs already: no split, no dQ partials.
    assert_eq!(key_chunks(&problem(2, 8, 8, 1024, 1024, 64), t, 2), 1);
    // Never more chunks than key tiles, never a tiny chunk.
    assert_eq!(key_chunks(&problem(1, 1, 1, 1024, 60, 64), t, 64), 1);
    assert_eq!(
        key_chunks(&problem(1, 1, 1, 8, 8, 64), CpuTiles::new(1, 1), 64),
        1
    );
}

#[test]
fn empty_tiles_and_chunks_are_skipped_and_full_tiles_unmasked() {
    let (sq, sk) = (70, 100);
    let p = problem(1, 1, 1, sq, sk, 40);
    let tiles = CpuTiles::new(16, 32);
    let x = Inputs::new(&p, 11, 1.0);
    let var = CountingCausal::default();
    let (mut out, mut lse) = poisoned(p);
    forward_tiled(&var, &p, tiles, &x.q, &x.k, &x.v, &mut out, &mut lse);

    // Expected: score on every element of each Full tile; score and mask,
    // on a Partial tile, for each band of `BAND_ROWS` rows on the keys from
    // its first to its last 16-key chunk that is not Empty; nothing else.
    let class = |(ql, qh): (usize, usize), c0: usize, cols: usize| {
        let off = sk - sq;
        causal_class(
            (ql + off) as i32,
            (qh + off) as i32,
            c0 as i32,
            (c0 + cols - 1) as i32,
        )
    };
    let (mut scored, mut masked, mut trimmed) = (0, 0, 0);
    for r0 in (0..sq).step_by(tiles.q) {
        let rows = tiles.q.min(sq - r0);
        for c0 in (0..sk).step_by(tiles.kv) {
            let cols = tiles.kv.min(sk - c0);
            match class((r0, r0 + rows - 1), c0, cols) {
                TileClass::Empty => {}
                TileClass::Full => scored += rows * cols,
                TileClass::Partial => {
                    for b0 in (r0..r0 + rows).step_by(BAND_ROWS) {
                        let band = (b0, (b0 + BAND_ROWS).min(r0 + rows) - 1);
                        let live: Vec<usize> = (c0..c0 + cols)
                            .step_by(math::LANES)
                            .filter(|&k| {
                                let n = math::LANES.min(c0 + cols - k);
                                class(band, k, n) != TileClass::Empty
                            })
                            .collect();
                        let keys = match (live.first(), live.last()) {
                            (Some(&lo), Some(&hi)) => math::LANES.min(c0 + cols - hi) + hi - lo,
                            _ => 0,
                        };
                        scored += (band.1 + 1 - band.0) * keys;
                        masked += (band.1 + 1 - band.0) * keys;
                        trimmed += (band.1 + 1 - band.0) * (cols - keys);
                    }
                }
            }
        }
    }
    assert!(
        scored < sq * sk && masked < scored && trimmed > 0,
        "shape must have all three classes, and partial tiles with empty chunks"
    );
    assert_eq!(var.scores.load(Ordering::Relaxed), scored);
    assert_eq!(var.masks.load(Ordering::Relaxed), masked);
    let want = reference(&var, &p, &x);
    assert_close("out", &out, &want.out, 2e-5);
}

#[test]
fn bands_hold_every_visible_pair_and_only_whole_chunks_beyond() {
    // `SlidingWindow` classifies exactly, so each band's keys must be the
    // hull of the LANES-wide chunks holding a visible pair.
    for window in [1, 5, 37, 64, 300] {
        let var = SlidingWindow { window };
        for (rows, cols) in [(1, 1), (16, 64), (17, 33), (64, 64), (70, 5), (5, 70)] {
            for q_lo in [-40, 0, 3, 29, 64, 100] {
                for kv0 in [0usize, 7, 32, 64] {
                    let pos = (q_lo, q_lo + rows as i32 - 1);
                    let class = tile_class(&var, 0, 0, pos, kv0, cols);
                    let mut bands = Vec::new();
                    class_bands(&var, (0, 0), class, (q_lo, kv0), (rows, cols), &mut bands);
                    if class != TileClass::Partial {
                        let whole = Band {
                            rows: 0..rows,
                            cols: 0..cols,
                        };
                        assert_eq!(bands, [whole]);
                        continue;
                    }
                    // The bands partition the rows in order, BAND_ROWS at a time.
                    let starts: Vec<usize> = bands.iter().map(|b| b.rows.start).collect();
                    assert_eq!(starts, (0..rows).step_by(BAND_ROWS).collect::<Vec<_>>());
                    assert_eq!(bands.last().map(|b| b.rows.end), Some(rows));
                    for band in &bands {
                        let var = &var;
                        let visible: Vec<usize> = band
                            .rows
                            .clone()
                            .flat_map(|i| {
                                let qi = q_lo + i as i32;
                                (0..cols).filter(move |&j| var.mask(0, 0, qi, (kv0 + j) as i32))
                            })
                            .collect();
                        let l = math::LANES;
                        match (visible.iter().min(), visible.iter().max()) {
                            (Some(&lo), Some(&hi)) => assert_eq!(
                                band.cols,
                                lo / l * l..((hi / l + 1) * l).min(cols),
                                "window {window}, {rows}×{cols} at ({q_lo}, {kv0})"
                            ),
                            _ => assert!(band.cols.is_empty(), "{band:?}"),
                        }
                    }
                }
            }
        }
    }
}
