//! Tests of the testing kit itself: the oracle against hand computations, the
//! finite-difference check on hand-written variants, and the checks' teeth.

use super::contract::contract;
use super::fixtures::{CausalSoftcap, Plain};
use super::tolerance::{Layout, NAIVE_FACTOR, compare};
use super::*;
use crate::problem::Problem;
use crate::variant::{HostVariant, TileClass};

/// `clamp(s, -1, 1) + 0.1·h·s` with a per-head slope: kinks at |s| = 1, and a
/// dependence on `h` and on `b` through the mask (batch 1 hides key 0).
#[derive(Clone, Debug)]
struct ClampPerHead;

impl HostVariant for ClampPerHead {
    const NAME: &'static str = "ClampPerHead";
    const SCORE_IS_IDENTITY: bool = false;
    const HAS_MASK: bool = true;
    fn score(&self, s: f32, _: i32, h: i32, _: i32, _: i32) -> f32 {
        s.clamp(-1.0, 1.0) + 0.1 * h as f32 * s
    }
    fn score_grad(&self, s: f32, _: i32, h: i32, _: i32, _: i32) -> f32 {
        f32::from(u8::from(s.abs() < 1.0)) + 0.1 * h as f32
    }
    fn mask(&self, b: i32, _: i32, _: i32, kv: i32) -> bool {
        b == 0 || kv != 0
    }
    fn classify_tile(&self, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32) -> TileClass {
        TileClass::Partial
    }
    fn score_f64(&self, s: f64, _: i32, h: i32, _: i32, _: i32) -> f64 {
        s.clamp(-1.0, 1.0) + 0.1 * f64::from(h) * s
    }
    fn score_grad_f64(&self, s: f64, _: i32, h: i32, _: i32, _: i32) -> f64 {
        f64::from(u8::from(s.abs() < 1.0)) + 0.1 * f64::from(h)
    }
    fn mask_exact(&self, b: i32, _: i32, _: i32, kv: i32) -> bool {
        b == 0 || kv != 0
    }
}

crate::hand_written_variant!(ClampPerHead);

fn problem(b: usize, hq: usize, hkv: usize, sq: usize, sk: usize, d: usize, scale: f32) -> Problem {
    Problem::new(b, (hq, hkv), (sq, sk), d).with_scale(scale)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-14 * (1.0 + b.abs())
}

#[test]
fn reference_matches_a_hand_computed_two_key_softmax() {
    // D = 1, one query, two keys: s = scale·q·k = [1, -0.5].
    let p = problem(1, 1, 1, 1, 2, 1, 0.5);
    let (q, k, v, g) = ([1.0f64], [2.0f64, -1.0], [3.0f64, 5.0], [0.7f64]);
    let f = reference_forward(&Plain, &p, &q, &k, &v);
    let g_out = reference_backward(&Plain, &p, &q, &k, &v, &g);

    // Two-way softmax as a logistic of the logit difference.
    let p0 = 1.0 / (1.0 + (-1.5f64).exp());
    let p1 = 1.0 - p0;
    let out = 3.0 * p0 + 5.0 * p1;
    // lse = s0 + ln(1 + e^(s1 - s0)).
    let lse = 1.0 + (-1.5f64).exp().ln_1p();
    assert!(close(f.out[0], out), "{} vs {out}", f.out[0]);
    assert!(close(f.lse[0], lse), "{} vs {lse}", f.lse[0]);

    // d out / d s_j = p_j (v_j − out); s_j = scale·q·k_j.
    let ds = [p0 * (3.0 - out), p1 * (5.0 - out)];
    let dq = 0.7 * 0.5 * (ds[0] * 2.0 - ds[1]);
    let dk = [0.7 * 0.5 * ds[0] * 1.0, 0.7 * 0.5 * ds[1] * 1.0];
    let dv = [0.7 * p0, 0.7 * p1];
    assert!(close(g_out.dq[0], dq), "{} vs {dq}", g_out.dq[0]);
    for j in 0..2 {
        assert!(close(g_out.dk[j], dk[j]), "dk[{j}]");
        assert!(close(g_out.dv[j], dv[j]), "dv[{j}]");
    }
}

#[test]
fn reference_aligns_bottom_right_and_zeroes_empty_rows() {
    // Sq = 3 > Sk = 2: rows have q_pos −1, 0, 1 under a causal mask.
    let p = problem(1, 1, 1, 3, 2, 1, 1.0);
    let variant = CausalSoftcap::new(1e6); // softcap ≈ identity at this cap
    let (q, k, v) = ([0.3f64, -0.4, 0.5], [1.0f64, 2.0], [7.0f64, -2.0]);
    let f = reference_forward(&variant, &p, &q, &k, &v);
    assert_eq!(f.out[0], 0.0);
    assert_eq!(f.lse[0], f64::NEG_INFINITY);
    // Row 1 sees key 0 only.
    assert_eq!(f.out[1], 7.0);
    assert!((f.lse[1] - (-0.4)).abs() < 1e-9);
    // Row 2 sees both: logits 0.5 and 1.0.
    let w = 1.0 / (1.0 + 0.5f64.exp());
    assert!((f.out[2] - (7.0 * w - 2.0 * (1.0 - w))).abs() < 1e-9);
    let g = reference_backward(&variant, &p, &q, &k, &v, &[1.0, 1.0, 1.0]);
    assert_eq!(g.dq[0], 0.0, "a row with no visible key has zero gradient");
    // Row 1's single-key softmax has dP − D = 0, hence no dq.
    assert!(g.dq[1].abs() < 1e-12);
}

#[test]
fn reference_sums_gqa_groups_over_query_heads() {
    // Hq = 2 on one kv head equals two separate Hq = 1 problems, with dk and
    // dv summed.
    let mut rng = rng::Rng::new(11, 0);
    let (sq, sk, d) = (3, 4, 5);
    let q = rng.normal_f64(2 * sq * d, 1.0);
    let k = rng.normal_f64(sk * d, 1.0);
    let v = rng.normal_f64(sk * d, 1.0);
    let g = rng.normal_f64(2 * sq * d, 1.0);
    let variant = CausalSoftcap::new(2.0);
    let both = reference_backward(&variant, &problem(1, 2, 1, sq, sk, d, 0.4), &q, &k, &v, &g);
    let single = problem(1, 1, 1, sq, sk, d, 0.4);
    let (h0, h1) = (sq * d, 2 * sq * d);
    let a = reference_backward(&variant, &single, &q[..h0], &k, &v, &g[..h0]);
    let b = reference_backward(&variant, &single, &q[h0..h1], &k, &v, &g[h0..h1]);
    assert_eq!(both.dq, [a.dq, b.dq].concat());
    for (x, (y, z)) in both.dk.iter().zip(a.dk.iter().zip(&b.dk)) {
        assert!(close(*x, y + z));
    }
    for (x, (y, z)) in both.dv.iter().zip(a.dv.iter().zip(&b.dv)) {
        assert!(close(*x, y + z));
    }
}

#[test]
fn naive_f32_is_close_to_the_f64_reference() {
    let p = problem(1, 2, 1, 9, 13, 8, 0.35);
    let mut rng = rng::Rng::new(5, 0);
    let q = rng.normal_f32(p.q_len(), 1.0);
    let k = rng.normal_f32(p.k_len(), 1.0);
    let v = rng.normal_f32(p.v_len(), 1.0);
    let widen = |x: &[f32]| x.iter().map(|&a| f64::from(a)).collect::<Vec<_>>();
    let variant = CausalSoftcap::new(3.0);
    let f32_out = reference_forward(&variant, &p, &q, &k, &v);
    let f64_out = reference_forward(&variant, &p, &widen(&q), &widen(&k), &widen(&v));
    for (a, b) in f32_out.out.iter().zip(&f64_out.out) {
        assert!((f64::from(*a) - b).abs() < 1e-5, "{a} vs {b}");
    }
}

#[test]
fn finite_differences_accept_correct_variants() {
    check_reference_gradients(&Plain);
    check_reference_gradients(&CausalSoftcap::new(2.0));
    check_reference_gradients(&CausalSoftcap::new(30.0));
    check_reference_gradients(&ClampPerHead);
}

#[test]
#[should_panic(expected = "finite-difference check of the reference backward failed")]
fn finite_differences_reject_a_wrong_score_grad() {
    check_reference_gradients(&CausalSoftcap {
        wrong_grad: true,
        ..CausalSoftcap::new(2.0)
    });
}

#[test]
fn contract_catches_a_lying_tile_classifier() {
    let p = problem(1, 1, 1, 17, 17, 4, 0.5);
    let mut failures = Vec::new();
    contract(&CausalSoftcap::new(2.0), &p, &mut failures);
    assert!(failures.is_empty(), "{failures:?}");
    contract(
        &CausalSoftcap {
            lying_tiles: true,
            ..CausalSoftcap::new(2.0)
        },
        &p,
        &mut failures,
    );
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(failures[0].contains("classify_tile"), "{failures:?}");
}

#[test]
fn compare_applies_the_tolerance_rule() {
    let p = problem(1, 1, 1, 2, 2, 2, 1.0);
    let want = [1.0f64, -2.0, 0.5, 3.0];
    let naive = [1.000_001f32, -2.0, 0.5, 3.0]; // naive err 9.537e-7 at [0]
    let eps = f64::from(f32::EPSILON);
    let query = |got: &[f32], naive: &[f32], m| {
        compare(
            NAIVE_FACTOR,
            "t",
            Layout::Query(2),
            &p,
            got,
            &want,
            naive,
            m,
            0.0,
        )
    };
    // bound = 2·naive err + 1e-6·(1 + max|want|) + ε·M.
    let bound = |m: f64| 2.0 * 9.536_743e-7 + 1e-6 * 4.0 + eps * m;
    // 7e-6 off at [3]: beyond 2·naive + 1e-6·(1 + 3) + ε·3 ≈ 6.3e-6 when the
    // terms are no larger than the result (M = max|want|)...
    let got = [1.0, -2.0, 0.5, 3.000_007];
    let tight = query(&got, &naive, 0.0);
    assert_eq!(tight.failures.len(), 1, "{:?}", tight.failures);
    assert!((tight.bound - bound(3.0)).abs() < 1e-12, "{}", tight.bound);
    // ...within it when the result came from terms of magnitude 100.
    let ok = query(&got, &naive, 100.0);
    assert!(ok.failures.is_empty(), "{:?}", ok.failures);
    assert!((ok.bound - bound(100.0)).abs() < 1e-12, "{}", ok.bound);
    // 2e-5 off: fails, naming the element.
    let got = [1.0, -2.0, 0.5, 3.000_02];
    let bad = query(&got, &naive, 10.0);
    assert_eq!(bad.failures.len(), 1);
    assert!(
        bad.failures[0].contains("i=1 (q_pos 1), d=1"),
        "{:?}",
        bad.failures
    );
    // NaN anywhere fails.
    let got = [f32::NAN, -2.0, 0.5, 3.0];
    let nan = query(&got, &naive, 10.0);
    assert!(!nan.failures.is_empty());
    // lse: −inf must be matched exactly, and only where the reference has it.
    let p_lse = problem(1, 1, 1, 2, 2, 1, 1.0);
    let want_lse = [f64::NEG_INFINITY, 0.25];
    let naive_lse = [f32::NEG_INFINITY, 0.25];
    let lse = |got: &[f32]| {
        compare(
            NAIVE_FACTOR,
            "lse",
            Layout::Lse,
            &p_lse,
            got,
            &want_lse,
            &naive_lse,
            0.0,
            0.0,
        )
    };
    let ok = lse(&naive_lse);
    assert!(ok.failures.is_empty(), "{:?}", ok.failures);
    let got = [-1e30, 0.25];
    let bad = lse(&got);
    assert_eq!(bad.failures.len(), 1, "{:?}", bad.failures);
    // A naive f32 far from the reference means the f32 and f64 closures
    // disagree.
    let (got, off) = ([1.0, -2.0, 0.5, 3.0], [1.5, -2.0, 0.5, 3.0]);
    let off = query(&got, &off, 3.0);
    assert!(
        off.failures.iter().any(|f| f.contains("f32 closures")),
        "{:?}",
        off.failures
    );
}

#[test]
fn magnitudes_bound_the_results_and_see_through_cancellation() {
    let mut rng = rng::Rng::new(17, 0);
    let p = problem(1, 2, 1, 6, 5, 4, 0.5);
    let x = [
        rng.normal_f64(p.q_len(), 1.0),
        rng.normal_f64(p.k_len(), 1.0),
        rng.normal_f64(p.v_len(), 1.0),
        rng.normal_f64(p.out_len(), 1.0),
    ];
    let variant = CausalSoftcap::new(2.0);
    let f = reference_forward(&variant, &p, &x[0], &x[1], &x[2]);
    let g = reference_backward(&variant, &p, &x[0], &x[1], &x[2], &x[3]);
    let (m_out, m) =
        reference::reference_magnitudes(&variant, &p, [&x[0], &x[1], &x[2], &x[3]], None);
    for (r, m) in [
        (&f.out, &m_out),
        (&g.dq, &m.dq),
        (&g.dk, &m.dk),
        (&g.dv, &m.dv),
    ] {
        for (r, m) in r.iter().zip(m) {
            assert!(r.abs() <= m * (1.0 + 1e-12), "{r} > {m}");
        }
    }
    // Sq > Sk: row 1 (q_pos 0) sees key 0 only, so dP − D = 0 and its dq
    // vanishes, but the terms it was summed from do not.
    let d = p.head_dim;
    assert!(g.dq[d..2 * d].iter().all(|x| x.abs() < 1e-12));
    assert!(m.dq[d..2 * d].iter().all(|&x| x > 0.0));
    // Row 0 sees nothing: no terms at all.
    assert!(m.dq[..d].iter().all(|&x| x == 0.0));
}

#[test]
fn cases_fit_the_budget_and_cover_the_shapes() {
    let mut seqs = Vec::new();
    let mut dims = Vec::new();
    for c in CASES {
        assert_eq!(c.heads_q % c.heads_kv, 0, "{c}");
        assert!(c.batch * c.heads_q * c.seq_q * c.seq_k * c.head_dim <= 4 * 257 * 257 * 128);
        seqs.extend([c.seq_q, c.seq_k]);
        dims.push(c.head_dim);
    }
    for s in [1, 17, 97, 257] {
        assert!(seqs.contains(&s), "S = {s}");
    }
    for d in [40, 64, 80, 128] {
        assert!(dims.contains(&d), "D = {d}");
    }
    assert!(CASES.iter().any(|c| c.seq_q < c.seq_k) && CASES.iter().any(|c| c.seq_q > c.seq_k));
    assert!(
        CASES
            .iter()
            .any(|c| c.heads_q == 4 * c.heads_kv && c.heads_kv > 1)
    );
    assert!(CASES.iter().any(|c| c.heads_kv == 1 && c.heads_q > 1));
    assert!(CASES.iter().any(|c| c.batch == 2));
    assert!(CASES.iter().any(|c| c.scale.is_some()));
    assert!(CASES.iter().any(|c| c.logit_scale * c.logit_scale >= 1e3));
}

/// A backend with no device: the check is skipped.
struct Absent;

impl TestBackend for Absent {
    type Runtime = numr::runtime::cpu::CpuRuntime;
    const NAME: &'static str = "absent";
    fn device() -> Option<numr::runtime::cpu::CpuDevice> {
        None
    }
}

#[test]
fn a_backend_without_a_device_is_skipped() {
    if std::env::var_os(REQUIRE_DEVICE_ENV).is_none() {
        check_variant::<Absent, _>(&Plain);
    }
}

#[test]
fn cpu_kernels_pass_plain() {
    check_variant::<Cpu, _>(&Plain);
}

#[test]
fn cpu_kernels_pass_causal_softcap() {
    check_variant::<Cpu, _>(&CausalSoftcap::new(20.0));
}
