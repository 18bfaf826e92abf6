//! Kernel tests against an f64 reference, with hand-written variants.

use super::backward::{self, key_chunks};
use super::*;
use crate::problem::Problem;
use crate::testing::fixtures::{
    CausalSoftcap, Unmasked, causal_class, fill_spare_slots, identity_score, no_mask_to_call,
};
use crate::variant::HostVariant;
use crate::variant::{TileClass, Variant};
use keys::KeyRows;
use operand::Operand;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

// ---------------------------------------------------------------- variants
// (`Unmasked` and `CausalSoftcap` are the runtime's shared fixtures.)

/// Causal sliding window: `0 ≤ q − kv < window`, identity score.
#[derive(Clone, Debug)]
struct SlidingWindow {
    window: i32,
}

impl HostVariant for SlidingWindow {
    const NAME: &'static str = "SlidingWindow";
    const SCORE_IS_IDENTITY: bool = true;
    const HAS_MASK: bool = true;
    identity_score!();
    fn mask(&self, _: i32, _: i32, q: i32, kv: i32) -> bool {
        kv <= q && q - kv < self.window
    }
    fn classify_tile(&self, _: i32, _: i32, ql: i32, qh: i32, kl: i32, kh: i32) -> TileClass {
        // q − kv ranges over [ql − kh, qh − kl].
        let (lo, hi) = (ql - kh, qh - kl);
        if hi < 0 || lo >= self.window {
            TileClass::Empty
        } else if lo >= 0 && hi < self.window {
            TileClass::Full
        } else {
            TileClass::Partial
        }
    }
    fn mask_exact(&self, _: i32, _: i32, q: i32, kv: i32) -> bool {
        kv <= q && q - kv < self.window
    }
}

crate::hand_written_variant!(SlidingWindow);

/// An ALiBi-like bias that depends on batch, query head and both positions,
/// so a wrong `b`, `h` (e.g. the kv head) or position shows up. No mask.
#[derive(Clone, Debug)]
struct Alibi {
    slope: f32,
}

impl HostVariant for Alibi {
    const NAME: &'static str = "Alibi";
    const SCORE_IS_IDENTITY: bool = false;
    const HAS_MASK: bool = false;
    fn score(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 {
        s - self.slope * (h + 1) as f32 * (q - kv).abs() as f32 + 0.25 * b as f32
    }
    fn score_grad(&self, _: f32, _: i32, _: i32, _: i32, _: i32) -> f32 {
        1.0
    }
    no_mask_to_call!();
    fn score_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 {
        s - self.slope as f64 * (h + 1) as f64 * (q - kv).abs() as f64 + 0.25 * b as f64
    }
    fn score_grad_f64(&self, _: f64, _: i32, _: i32, _: i32, _: i32) -> f64 {
        1.0
    }
}

crate::hand_written_variant!(Alibi);

/// Causal, counting how often the kernels call `score` and `mask`.
#[derive(Clone, Debug, Default)]
struct CountingCausal {
    scores: Arc<AtomicUsize>,
    masks: Arc<AtomicUsize>,
}

impl HostVariant for CountingCausal {
    const NAME: &'static str = "CountingCausal";
    const SCORE_IS_IDENTITY: bool = false;
    const HAS_MASK: bool = true;
    fn score(&self, s: f32, _: i32, _: i32, _: i32, _: i32) -> f32 {
        self.scores.fetch_add(1, Ordering::Relaxed);
        s
    }
    fn score_grad(&self, _: f32, _: i32, _: i32, _: i32, _: i32) -> f32 {
        1.0
    }
    fn mask(&self, _: i32, _: i32, q: i32, kv: i32) -> bool {
        self.masks.fetch_add(1, Ordering::Relaxed);
        kv <= q
    }
    fn classify_tile(&self, _: i32, _: i32, ql: i32, qh: i32, kl: i32, kh: i32) -> TileClass {
        causal_class(ql, qh, kl, kh)
    }
    fn score_f64(&self, s: f64, _: i32, _: i32, _: i32, _: i32) -> f64 {
        s
    }
    fn score_grad_f64(&self, _: f64, _: i32, _: i32, _: i32, _: i32) -> f64 {
        1.0
    }
    fn mask_exact(&self, _: i32, _: i32, q: i32, kv: i32) -> bool {
        kv <= q
    }
}

crate::hand_written_variant!(CountingCausal);

// --------------------------------------------------------------- reference

fn problem(
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq_q: usize,
    seq_k: usize,
    head_dim: usize,
) -> Problem {
    Problem::new(batch, (heads_q, heads_kv), (seq_q, seq_k), head_dim)
}

/// Deterministic uniform values in `[-amp, amp)` (SplitMix64).
fn random(len: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..len)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

pub(crate) struct Inputs {
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) dout: Vec<f32>,
    /// `d loss / d lse`: the backward's `D_i − dlse_i`.
    pub(crate) dlse: Vec<f32>,
}

impl Inputs {
    fn new(p: &Problem, seed: u64, qk_amp: f32) -> Self {
        Self {
            q: random(p.q_len(), seed, qk_amp),
            k: random(p.k_len(), seed + 1, qk_amp),
            v: random(p.v_len(), seed + 2, 1.0),
            dout: random(p.out_len(), seed + 3, 1.0),
            dlse: random(p.lse_len(), seed + 4, 1.0),
        }
    }

    /// Every input rounded to bf16 (so that bf16 kernels see them exactly).
    fn round_to_bf16(&mut self) {
        for t in [&mut self.q, &mut self.k, &mut self.v, &mut self.dout] {
            t.iter_mut().for_each(|v| *v = bf16_round(*v));
        }
    }

    /// What the f32 backward reads, given the forward's `out` and `lse`.
    fn backward<'a>(&'a self, out: &'a [f32], lse: &'a [f32]) -> BackwardInputs<'a> {
        let (q, k, v, dout) = (&self.q, &self.k, &self.v, &self.dout);
        BackwardInputs {
            q,
            k,
            v,
            out,
            lse,
            dout,
            dlse: Some(&self.dlse),
        }
    }

    /// Every keys' row (`D` wide) past its sequence's length in `lens`
    /// set to NaN in K and V: cache slots no kernel may read.
    fn poison_spare_slots(&mut self, p: &Problem, lens: &[usize], v_fill: f32) {
        fill_spare_slots(
            (&mut self.k, &mut self.v),
            (p.heads_kv, p.seq_k, (p.head_dim, p.head_dim_v)),
            |b| lens[b],
            (f32::NAN, v_fill),
        );
    }
}

/// The inputs and `out` of a backward rounded to bf16, for the bf16
/// backward.
struct Bf16Backward {
    q: Vec<half::bf16>,
    k: Vec<half::bf16>,
    v: Vec<half::bf16>,
    out: Vec<half::bf16>,
    dout: Vec<half::bf16>,
    dlse: Vec<f32>,
}

impl Bf16Backward {
    fn new(x: &Inputs, out: &[f32]) -> Self {
        Self {
            q: bf(&x.q),
            k: bf(&x.k),
            v: bf(&x.v),
            out: bf(out),
            dout: bf(&x.dout),
            dlse: x.dlse.clone(),
        }
    }

    /// What the bf16 backward reads, with the forward's `lse`.
    fn inputs<'a>(&'a self, lse: &'a [f32]) -> Bf16BackwardInputs<'a> {
        let (q, k, v, out, dout) = (&self.q, &self.k, &self.v, &self.out, &self.dout);
        BackwardInputs {
            q,
            k,
            v,
            out,
            lse,
            dout,
            dlse: Some(&self.dlse),
        }
    }
}

/// `dq`, `dk`, `dv`, poisoned with NaN so that unwritten elements fail.
struct Grads {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// The tensor gradients a CPU backward returns.
type TensorGrads = Vec<Option<Vec<f32>>>;

impl Grads {
    fn poisoned(p: &Problem) -> Self {
        Self {
            dq: vec![f32::NAN; p.q_len()],
            dk: vec![f32::NAN; p.k_len()],
            dv: vec![f32::NAN; p.v_len()],
        }
    }

    /// [`backward`] into these.
    fn f32<V: Variant>(
        &mut self,
        var: &V,
        p: &Problem,
        lens: Option<&[usize]>,
        i: BackwardInputs<'_>,
        wanted: &[bool],
    ) -> TensorGrads {
        let (dq, dk, dv) = (&mut self.dq, &mut self.dk, &mut self.dv);
        let cache = lens.map(CacheLayout::lengths);
        backward(var, p, cache, i, dq, dk, dv, wanted).expect("the f32 backward")
    }

    /// [`backward_bf16`] into these: `None` where it declines.
    fn bf16<V: Variant>(
        &mut self,
        var: &V,
        p: &Problem,
        lens: Option<&[usize]>,
        i: Bf16BackwardInputs<'_>,
        wanted: &[bool],
    ) -> Option<TensorGrads> {
        let (dq, dk, dv) = (&mut self.dq, &mut self.dk, &mut self.dv);
        let cache = lens.map(CacheLayout::lengths);
        backward_bf16(var, p, cache, i, dq, dk, dv, wanted).expect("the bf16 backward")
    }

    /// Every spare cache slot (past its sequence's length) got exactly
    /// zero in `dk` and `dv`.
    #[track_caller]
    fn assert_spare_slots_zero(&self, p: &Problem, lens: &[usize], ctx: &str) {
        let (d, d_v) = (p.head_dim, p.head_dim_v);
        for (row, (k, v)) in self.dk.chunks(d).zip(self.dv.chunks(d_v)).enumerate() {
            if row % p.seq_k >= lens[row / (p.heads_kv * p.seq_k)] {
                assert!(
                    k.iter().chain(v).all(|&g| g == 0.0),
                    "{ctx}: spare slot {row} has a gradient"
                );
            }
        }
    }
}

/// Forward and backward of attention in f64, straight from the definition.
pub(crate) struct Reference {
    pub(crate) out: Vec<f64>,
    pub(crate) lse: Vec<f64>,
    pub(crate) max_scores: Vec<f64>,
    pub(crate) dq: Vec<f64>,
    pub(crate) dk: Vec<f64>,
    pub(crate) dv: Vec<f64>,
}

fn reference<V: HostVariant>(var: &V, p: &Problem, x: &Inputs) -> Reference {
    reference_lens(var, p, x, None)
}

/// [`reference`] over a KV cache: sequence `b` has keys `0 .. lens[b]` of
/// its `Sk` slots, and its query row `i` sits at `i + lens[b] − Sq`.
pub(crate) fn reference_lens<V: HostVariant>(
    var: &V,
    p: &Problem,
    x: &Inputs,
    lens: Option<&[usize]>,
) -> Reference {
    reference_rounded(var, p, x, lens, |x| x)
}

/// [`reference_lens`] with the bf16 kernels' roundings applied by `round`:
/// to each `O` before `D_i = dO_i · O_i`, to `P` before `dV += Pᵀ dO`, and
/// to `scale · dS` before `dK` and `dQ` (the identity: the exact
/// reference).
fn reference_rounded<V: HostVariant>(
    var: &V,
    p: &Problem,
    x: &Inputs,
    lens: Option<&[usize]>,
    round: fn(f64) -> f64,
) -> Reference {
    let (sq, d, dv) = (p.seq_q, p.head_dim, p.head_dim_v);
    let cap = p.seq_k;
    let scale = p.scale as f64;
    let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let dlse = f(&x.dlse);
    let (q, k, v, dout) = (f(&x.q), f(&x.k), f(&x.v), f(&x.dout));
    let mut r = Reference {
        out: vec![0.0; p.out_len()],
        lse: vec![f64::NEG_INFINITY; p.lse_len()],
        max_scores: vec![f64::NEG_INFINITY; p.lse_len()],
        dq: vec![0.0; p.q_len()],
        dk: vec![0.0; p.k_len()],
        dv: vec![0.0; p.v_len()],
    };
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            let bh = b * p.heads_q + h;
            let kvb = (b * p.heads_kv + h / p.group()) * cap;
            let sk = lens.map_or(cap, |l| l[b]);
            let (bi, hi) = (b as i32, h as i32);
            for i in 0..sq {
                let qi = (i as i64 + sk as i64 - sq as i64) as i32;
                let qrow = &q[(bh * sq + i) * d..][..d];
                let mut s = vec![0.0; sk];
                let mut x = vec![f64::NEG_INFINITY; sk];
                for j in 0..sk {
                    let krow = &k[(kvb + j) * d..][..d];
                    s[j] = qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>() * scale;
                    if var.mask_exact(bi, hi, qi, j as i32) {
                        x[j] = var.score_f64(s[j], bi, hi, qi, j as i32);
                    }
                }
                let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                r.max_scores[bh * sq + i] = m;
                if m == f64::NEG_INFINITY {
                    continue; // out = 0, lse = -inf, no gradient
                }
                let l: f64 = x.iter().map(|&x| (x - m).exp()).sum();
                let lse = m + l.ln();
                r.lse[bh * sq + i] = lse;
                let pr: Vec<f64> = x.iter().map(|&x| (x - lse).exp()).collect();
                let o = &mut r.out[(bh * sq + i) * dv..][..dv];
                for j in 0..sk {
                    for (o, &vv) in o.iter_mut().zip(&v[(kvb + j) * dv..][..dv]) {
                        *o += pr[j] * vv;
                    }
                }
                let o = r.out[(bh * sq + i) * dv..][..dv].to_vec();
                let dorow = &dout[(bh * sq + i) * dv..][..dv];
                let di: f64 = dorow
                    .iter()
                    .zip(&o)
                    .map(|(a, &b)| a * round(b))
                    .sum::<f64>()
                    - dlse[bh * sq + i];
                for j in 0..sk {
                    if pr[j] == 0.0 {
                        continue;
                    }
                    let (krow, vrow) = (&k[(kvb + j) * d..][..d], &v[(kvb + j) * dv..][..dv]);
                    let dp: f64 = dorow.iter().zip(vrow).map(|(a, b)| a * b).sum();
                    let ds = pr[j] * (dp - di) * var.score_grad_f64(s[j], bi, hi, qi, j as i32);
                    let (pj, ds) = (round(pr[j]), round(scale * ds));
                    for (c, &g) in dorow.iter().enumerate() {
                        r.dv[(kvb + j) * dv + c] += pj * g;
                    }
                    for c in 0..d {
                        r.dq[(bh * sq + i) * d + c] += ds * krow[c];
                        r.dk[(kvb + j) * d + c] += ds * qrow[c];
                    }
                }
            }
        }
    }
    r
}

// ----------------------------------------------------------------- helpers

/// `|got − want| ≤ tol · (1 + |want|)` everywhere, and no NaN.
#[track_caller]
pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(!g.is_nan(), "{what}[{i}] is NaN (unwritten?)");
        if w == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "{what}[{i}]");
            continue;
        }
        let err = (g as f64 - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "{what}[{i}] = {g}, want {w} (err {err:e})"
        );
    }
}

/// `out` and `lse` buffers of `p`, NaN so that an element a kernel does
/// not write fails its check.
fn poisoned(p: impl std::borrow::Borrow<Problem>) -> (Vec<f32>, Vec<f32>) {
    let p = p.borrow();
    (vec![f32::NAN; p.out_len()], vec![f32::NAN; p.lse_len()])
}

struct Outputs {
    out: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// Forward then backward (fed the kernel's own `out` and `lse`), into
/// NaN-poisoned buffers; the backward with the given (key chunks, key tiles
/// per pass), else its own choice.
fn run<V: HostVariant>(
    var: &V,
    p: &Problem,
    tiles: CpuTiles,
    schedule: Option<(usize, usize)>,
    x: &Inputs,
) -> Outputs {
    let mut o = Outputs {
        out: vec![f32::NAN; p.out_len()],
        lse: vec![f32::NAN; p.lse_len()],
        dq: vec![f32::NAN; p.q_len()],
        dk: vec![f32::NAN; p.k_len()],
        dv: vec![f32::NAN; p.v_len()],
    };
    forward_tiled(var, p, tiles, &x.q, &x.k, &x.v, &mut o.out, &mut o.lse);
    let inputs = x.backward(&o.out, &o.lse);
    match schedule {
        None => backward_tiled(
            var,
            p,
            tiles,
            inputs,
            &mut o.dq,
            &mut o.dk,
            &mut o.dv,
            &mut [],
        ),
        Some((c, g)) => backward::backward(
            var,
            p,
            tiles,
            c,
            g,
            inputs,
            &mut o.dq,
            &mut o.dk,
            &mut o.dv,
            &mut [],
        ),
    }
    o
}

#[track_caller]
fn check<V: HostVariant>(
    var: &V,
    p: &Problem,
    tiles: CpuTiles,
    schedule: Option<(usize, usize)>,
    seed: u64,
) {
    let x = Inputs::new(p, seed, 1.0);
    let want = reference(var, p, &x);
    let got = run(var, p, tiles, schedule, &x);
    let ctx = format!(
        "{} {p:?} {tiles:?} (chunks, kv group) {schedule:?}",
        V::NAME
    );
    assert_close(&format!("out {ctx}"), &got.out, &want.out, 2e-5);
    assert_close(&format!("lse {ctx}"), &got.lse, &want.lse, 2e-5);
    assert_close(&format!("dq {ctx}"), &got.dq, &want.dq, 1e-4);
    assert_close(&format!("dk {ctx}"), &got.dk, &want.dk, 1e-4);
    assert_close(&format!("dv {ctx}"), &got.dv, &want.dv, 1e-4);
}

/// Odd shapes: S ∈ {1, 17, 97, 130}, D ∈ {40, 64, 80}, Sq ≠ Sk both ways,
/// GQA 4:1, MQA, batch 2.
const SHAPES: [(usize, usize, usize, usize, usize, usize); 7] = [
    (1, 1, 1, 1, 1, 40),
    (1, 2, 2, 1, 17, 64),
    (2, 4, 1, 17, 17, 64),
    (1, 4, 4, 97, 130, 80),
    (1, 3, 1, 130, 97, 40),
    (2, 2, 2, 130, 130, 64),
    (1, 8, 2, 17, 97, 40),
];

const TILES: [CpuTiles; 3] = [
    CpuTiles::DEFAULT,
    CpuTiles { q: 16, kv: 32 },
    CpuTiles { q: 7, kv: 13 },
];

fn check_all<V: HostVariant>(var: &V) {
    for (n, &(b, hq, hkv, sq, sk, d)) in SHAPES.iter().enumerate() {
        for tiles in TILES {
            check(
                var,
                &problem(b, hq, hkv, sq, sk, d),
                tiles,
                None,
                n as u64 * 10,
            );
        }
    }
}

// ------------------------------------------------------------------- tests

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
    use super::simd::Level;
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

// ------------------------------------------------------------------ decode

/// The decode kernel with `chunks` key chunks, into NaN-poisoned buffers:
/// `out`, `lse` and each row's largest score.
fn decode<V: HostVariant>(
    v: &V,
    p: &Problem,
    t: CpuTiles,
    chunks: usize,
    x: &Inputs,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut out, mut lse) = poisoned(p);
    let mut max = lse.clone();
    let inputs = ForwardInputs::packed(p, &x.q, (&x.k, &x.v), None);
    let outputs = (&mut out[..], &mut lse[..], Some(&mut max[..]));
    entry::forward_inputs(v, p, (t, Some(chunks)), inputs, outputs);
    (out, lse, max)
}

#[track_caller]
fn check_decode<V: HostVariant>(v: &V, p: &Problem, t: CpuTiles) {
    let x = Inputs::new(p, 0xdec0de ^ p.seq_k as u64, 1.0);
    let want = reference(v, p, &x);
    let (one, one_lse, _) = decode(v, p, t, 1, &x);
    for chunks in [1, 2, 3, 7, 1000] {
        let (out, lse, max) = decode(v, p, t, chunks, &x);
        let ctx = format!("{} {p:?} {t:?} chunks {chunks}", V::NAME);
        assert_close(&format!("out {ctx}"), &out, &want.out, 2e-5);
        assert_close(&format!("lse {ctx}"), &lse, &want.lse, 2e-5);
        assert_close(&format!("max {ctx}"), &max, &want.max_scores, 2e-5);
        // Split against unsplit: the same rows, merged by their lse.
        assert_close(
            &format!("out {ctx} vs 1 chunk"),
            &out,
            &one.iter().map(|&y| y as f64).collect::<Vec<_>>(),
            1e-5,
        );
        assert_close(
            &format!("lse {ctx} vs 1 chunk"),
            &lse,
            &one_lse.iter().map(|&y| y as f64).collect::<Vec<_>>(),
            1e-5,
        );
        // Run to run: the same bits.
        let (again, again_lse, _) = decode(v, p, t, chunks, &x);
        assert!(
            out.iter()
                .zip(&again)
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && lse
                    .iter()
                    .zip(&again_lse)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ctx}: two runs differ"
        );
    }
}

#[test]
fn decode_matches_reference_for_every_chunking() {
    let t = CpuTiles::new(64, 64);
    // Decode, speculative rows and a short append; GQA 8:1 and MQA; key
    // counts that leave a last block and a last chunk short; Sq > Sk (rows
    // that see nothing).
    for (hq, hkv, sq, sk, d) in [
        (8, 1, 1, 1000, 64),
        (16, 2, 4, 777, 128),
        (4, 4, 17, 301, 40),
        (2, 1, 32, 65, 64),
        (4, 2, 9, 5, 32),
    ] {
        let p = problem(2, hq, hkv, sq, sk, d);
        check_decode(&Unmasked, &p, t);
        check_decode(&CausalSoftcap::new(20.0), &p, t);
        check_decode(&SlidingWindow { window: 100 }, &p, t);
        check_decode(&Alibi { slope: 0.01 }, &p, t);
    }
    // Key tiles of another size.
    let p = problem(1, 8, 2, 3, 999, 64);
    check_decode(&SlidingWindow { window: 300 }, &p, CpuTiles::new(64, 48));
}

#[test]
fn decode_splits_only_when_the_heads_leave_threads_idle() {
    let t = CpuTiles::new(64, 64);
    // One sequence, 8 kv heads, 2 threads: 8 tasks already.
    assert_eq!(decode::chunks(&problem(1, 32, 8, 1, 32768, 128), t, 2), 1);
    // One kv head: 8 tasks wanted, and 32k keys allow them.
    assert_eq!(decode::chunks(&problem(1, 8, 1, 1, 32768, 128), t, 2), 8);
    // Short keys cap the chunks at one per 512 keys.
    assert_eq!(decode::chunks(&problem(1, 8, 1, 1, 1000, 128), t, 16), 2);
    assert_eq!(decode::chunks(&problem(1, 8, 1, 1, 100, 128), t, 16), 1);
    assert!(decode::applies(&problem(1, 8, 1, 32, 100, 128)));
    assert!(!decode::applies(&problem(1, 8, 1, 33, 100, 128)));
}

/// The cache forward into NaN-poisoned buffers, against the f64 reference;
/// the spare slots past each length hold NaN and infinities.
#[track_caller]
fn check_cache<V: HostVariant>(v: &V, p: &Problem, t: CpuTiles, lens: &[usize]) {
    let mut x = Inputs::new(p, 0xcac4e ^ p.seq_k as u64, 1.0);
    let (cap, d, d_v) = (p.seq_k, p.head_dim, p.head_dim_v);
    for (row, (k, v)) in x.k.chunks_mut(d).zip(x.v.chunks_mut(d_v)).enumerate() {
        let b = row / (p.heads_kv * cap);
        if row % cap >= lens[b] {
            k.fill(f32::NAN);
            v.iter_mut()
                .enumerate()
                .for_each(|(i, y)| *y = [f32::INFINITY, f32::NAN][i % 2]);
        }
    }
    let want = reference_lens(v, p, &x, Some(lens));
    let (out, lse) = cache_forward(v, p, t, lens, &x);
    let ctx = format!("{} {p:?} lens {lens:?}", V::NAME);
    assert_close(&format!("out {ctx}"), &out, &want.out, 2e-5);
    assert_close(&format!("lse {ctx}"), &lse, &want.lse, 2e-5);
}

/// The tile forward of `x` over a cache of `lens`, into poisoned buffers.
fn cache_forward<V: HostVariant>(
    v: &V,
    p: &Problem,
    t: CpuTiles,
    lens: &[usize],
    x: &Inputs,
) -> (Vec<f32>, Vec<f32>) {
    let (mut out, mut lse) = poisoned(p);
    let cache = CacheLayout::lengths(lens);
    forward_cache_tiled(v, p, t, cache, &x.q, &x.k, &x.v, &mut out, &mut lse);
    (out, lse)
}

#[test]
fn cache_lengths_match_reference_and_spare_slots_stay_out() {
    let t = CpuTiles::new(64, 64);
    // Lengths 0, 1, a key-tile boundary, the capacity and others, mixed in
    // one batch; GQA 8:1; decode, speculative rows, and more rows than
    // some sequences have keys.
    let lens = [0, 1, 64, 200, 129, 17];
    for (hq, hkv, sq) in [(8, 1, 1), (8, 1, 4), (4, 2, 17), (2, 2, 40)] {
        let p = problem(lens.len(), hq, hkv, sq, 200, 64);
        check_cache(&Unmasked, &p, t, &lens);
        check_cache(&CausalSoftcap::new(20.0), &p, t, &lens);
        check_cache(&SlidingWindow { window: 50 }, &p, t, &lens);
        check_cache(&Alibi { slope: 0.02 }, &p, t, &lens);
    }
}

#[test]
fn a_full_cache_is_the_plain_forward() {
    // One length for the whole batch, at capacity: the plain call (the
    // same kernel for Sq <= 32), bit for bit.
    let p = problem(3, 8, 2, 5, 333, 64);
    let x = Inputs::new(&p, 7, 1.0);
    let v = CausalSoftcap::new(30.0);
    let t = CpuTiles::new(64, 64);
    let (mut out, mut lse) = poisoned(p);
    forward_tiled(&v, &p, t, &x.q, &x.k, &x.v, &mut out, &mut lse);
    let (mut out2, mut lse2) = poisoned(p);
    forward_cache_tiled(
        &v,
        &p,
        t,
        CacheLayout::lengths(&[333; 3]),
        &x.q,
        &x.k,
        &x.v,
        &mut out2,
        &mut lse2,
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&out), bits(&out2));
    assert_eq!(bits(&lse), bits(&lse2));
}

/// The bf16 tile-product levels this CPU has (AMX tiles, and capped at
/// `Bf16Dot`, `vdpbf16ps`); none, with a skip message, where it has neither.
fn bf16_levels() -> Vec<super::simd::Level> {
    use super::simd::Level;
    let mut levels = Vec::new();
    if amx::kind() == Some(amx::Kind::Amx) {
        levels.push(Level::Amx);
    }
    if bf16_dot::present() {
        levels.push(Level::Bf16Dot);
    }
    if levels.is_empty() {
        eprintln!("boostr: skipping: neither AMX-BF16 nor AVX512-BF16 on this CPU or OS");
    }
    levels
}

/// A pool of `threads` whose workers run at most `level`.
fn capped(level: super::simd::Level, threads: usize) -> rayon::ThreadPool {
    use super::simd::LEVEL_CAP;
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .start_handler(move |_| LEVEL_CAP.with(|c| c.set(level)))
        .build()
        .unwrap()
}

/// `v` rounded to bf16.
fn bf(v: &[f32]) -> Vec<half::bf16> {
    v.iter().map(|&x| half::bf16::from_f32(x)).collect()
}

/// The paged layout of `lens` over `table`.
fn paging<'a>(lens: &'a [usize], table: &'a [usize], page_size: usize) -> CacheLayout<'a> {
    let pages = Some(Pages { table, page_size });
    CacheLayout { lens, pages }
}

/// The cache of `x` (`[B, Hkv, Sk, D]`, lengths `lens`) scattered into
/// pages of `page_size` in a shuffled order, with one spare page of NaN:
/// `(k pages, v pages, table)`, table entries past a length garbage.
fn paged(
    p: &Problem,
    x: &Inputs,
    lens: &[usize],
    page_size: usize,
) -> (Vec<f32>, Vec<f32>, Vec<usize>) {
    let (d, d_v, hkv, cap) = (p.head_dim, p.head_dim_v, p.heads_kv, p.seq_k);
    let max_pages = cap / page_size;
    let pages = p.batch * max_pages + 1;
    // Page `n` of the shuffled order holds (sequence, page) `order[n]`.
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let m = [7, 5, 11, 13]
        .into_iter()
        .find(|&m| gcd(m, pages) == 1)
        .unwrap_or(1);
    let order: Vec<usize> = (0..pages).map(|n| (n * m + 3) % pages).collect();
    let mut kp = vec![f32::NAN; pages * hkv * page_size * d];
    let mut vp = vec![f32::NAN; pages * hkv * page_size * d_v];
    let mut table = vec![usize::MAX; p.batch * max_pages];
    for (page, &logical) in order.iter().enumerate() {
        if logical == pages - 1 {
            continue; // the spare page
        }
        let (b, lp) = (logical / max_pages, logical % max_pages);
        if lp * page_size < lens[b] {
            table[b * max_pages + lp] = page;
        }
        for h in 0..hkv {
            for slot in 0..page_size {
                let from = (b * hkv + h) * cap + lp * page_size + slot;
                let to = (page * hkv + h) * page_size + slot;
                kp[to * d..(to + 1) * d].copy_from_slice(&x.k[from * d..(from + 1) * d]);
                let v = &x.v[from * d_v..(from + 1) * d_v];
                vp[to * d_v..(to + 1) * d_v].copy_from_slice(v);
            }
        }
    }
    (kp, vp, table)
}

#[test]
fn paged_caches_match_the_contiguous_cache() {
    let t = CpuTiles::new(64, 64);
    let lens = [0, 1, 48, 192, 130];
    let p = problem(lens.len(), 8, 2, 3, 192, 64);
    let x = Inputs::new(&p, 0x9a9e, 1.0);
    let v = CausalSoftcap::new(20.0);
    let want = reference_lens(&v, &p, &x, Some(&lens));
    let (mut out, mut lse) = poisoned(p);
    forward_cache_tiled(
        &v,
        &p,
        t,
        CacheLayout::lengths(&lens),
        &x.q,
        &x.k,
        &x.v,
        &mut out,
        &mut lse,
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // Pages of whole key tiles: the same blocks, bit for bit; other sizes
    // cut blocks at page boundaries: within rounding.
    for page_size in [64, 192, 48, 16, 96] {
        let (kp, vp, table) = paged(&p, &x, &lens, page_size);
        let (mut po, mut pl) = poisoned(p);
        forward_cache_tiled(
            &v,
            &p,
            t,
            paging(&lens, &table, page_size),
            &x.q,
            &kp,
            &vp,
            &mut po,
            &mut pl,
        );
        let ctx = format!("page size {page_size}");
        assert_close(&format!("out {ctx}"), &po, &want.out, 2e-5);
        assert_close(&format!("lse {ctx}"), &pl, &want.lse, 2e-5);
        if page_size % t.kv == 0 {
            assert_eq!(
                bits(&po),
                bits(&out),
                "{ctx}: out differs from the contiguous cache"
            );
            assert_eq!(
                bits(&pl),
                bits(&lse),
                "{ctx}: lse differs from the contiguous cache"
            );
        }
    }
}

/// Values of another head dim than queries and keys (`Dv ≠ D`, as in
/// DeepSeek's MLA: 192/128 in prefill, 576/512 in absorbed decode, and the
/// pairs 128/64, 64/32 and a wider odd one) through every f32 kernel: the
/// tile forward and backward over several tilings and key chunkings, the
/// decode kernel over key chunks, and KV caches (lengths, pages, the cache
/// backward) with NaN in the spare slots.
#[test]
fn value_head_dims_apart_from_key_head_dims_match_the_reference() {
    // (B, Hq, Hkv, Sq, Sk, D, Dv)
    let shapes = [
        (1, 2, 2, 97, 130, 192, 128),
        (1, 4, 1, 17, 97, 128, 64),
        (2, 2, 1, 130, 33, 64, 32),
        (1, 3, 1, 40, 61, 40, 72),
    ];
    for (n, &(b, hq, hkv, sq, sk, d, dv)) in shapes.iter().enumerate() {
        let p = problem(b, hq, hkv, sq, sk, d).with_head_dim_v(dv);
        let seed = 0xd5 + n as u64;
        check(&CausalSoftcap::new(20.0), &p, CpuTiles::DEFAULT, None, seed);
        check(
            &Alibi { slope: 0.03 },
            &p,
            CpuTiles { q: 7, kv: 13 },
            Some((3, 2)),
            seed,
        );
        check(
            &SlidingWindow { window: 30 },
            &p,
            CpuTiles { q: 16, kv: 32 },
            None,
            seed,
        );
    }
    // Absorbed decode: one query row per head against a latent cache.
    let p = problem(2, 16, 1, 1, 300, 576).with_head_dim_v(512);
    check_decode(&CausalSoftcap::new(20.0), &p, CpuTiles::new(64, 64));
    let p = problem(1, 8, 2, 4, 150, 64).with_head_dim_v(32);
    check_decode(&Alibi { slope: 0.03 }, &p, CpuTiles::new(32, 32));

    let lens = [0usize, 1, 64, 150, 97];
    for (hq, hkv, sq, d, dv) in [(8, 1, 1, 576, 512), (4, 2, 4, 64, 32), (2, 2, 70, 48, 80)] {
        let p = problem(lens.len(), hq, hkv, sq, 150, d).with_head_dim_v(dv);
        check_cache(&CausalSoftcap::new(20.0), &p, CpuTiles::new(64, 64), &lens);
        let mut x = Inputs::new(&p, 0xdcac ^ sq as u64, 1.0);
        x.poison_spare_slots(&p, &lens, f32::NEG_INFINITY);
        check_cache_backward(&SlidingWindow { window: 30 }, &p, &lens, &x);
        // Pages of 30 and of 50 keys (no tile's multiple), shuffled.
        let want = reference_lens(&Unmasked, &p, &x, Some(&lens));
        for page_size in [30, 50] {
            let (kp, vp, table) = paged(&p, &x, &lens, page_size);
            let (mut out, mut lse) = poisoned(p);
            let cache = paging(&lens, &table, page_size);
            forward_cache(&Unmasked, &p, cache, &x.q, &kp, &vp, &mut out, &mut lse).unwrap();
            let ctx = format!("{p:?} pages of {page_size}");
            assert_close(&format!("out {ctx}"), &out, &want.out, 2e-5);
            assert_close(&format!("lse {ctx}"), &lse, &want.lse, 2e-5);
        }
    }
}

#[test]
fn cache_backward_matches_reference_and_spare_slots_get_zero() {
    // Forward over the cache, then the backward from its out and lse, for
    // short and long query blocks (Sq 4 runs the decode forward, 70 the
    // same through the tile kernels' positions); NaN in the spare slots.
    let lens = [0usize, 1, 64, 150, 97];
    for (hq, hkv, sq) in [(4, 1, 4), (2, 2, 70)] {
        let p = problem(lens.len(), hq, hkv, sq, 150, 32);
        let mut x = Inputs::new(&p, 0xbac4 ^ sq as u64, 1.0);
        x.poison_spare_slots(&p, &lens, f32::NEG_INFINITY);
        check_cache_backward(&CausalSoftcap::new(20.0), &p, &lens, &x);
        check_cache_backward(&SlidingWindow { window: 30 }, &p, &lens, &x);
        check_cache_backward(&Alibi { slope: 0.03 }, &p, &lens, &x);
    }
}

#[track_caller]
fn check_cache_backward<V: crate::Variant>(v: &V, p: &Problem, lens: &[usize], x: &Inputs)
where
    V::Host: HostVariant,
{
    let host = v.host(p).expect("host");
    let want = reference_lens(&host, p, x, Some(lens));
    let (out, lse) = cache_forward(&host, p, CpuTiles::for_variant::<V>(), lens, x);
    let mut g = Grads::poisoned(p);
    g.f32(v, p, Some(lens), x.backward(&out, &lse), &[]);
    let ctx = format!("{} {p:?} lens {lens:?}", V::NAME);
    assert_close(&format!("out {ctx}"), &out, &want.out, 2e-5);
    assert_close(&format!("dq {ctx}"), &g.dq, &want.dq, 5e-5);
    assert_close(&format!("dk {ctx}"), &g.dk, &want.dk, 5e-5);
    assert_close(&format!("dv {ctx}"), &g.dv, &want.dv, 5e-5);
    g.assert_spare_slots_zero(p, lens, &ctx);
}

#[test]
fn a_16_bit_cache_reads_as_its_widened_copy() {
    // Widening block by block is exact: the same bits as the f32 kernel
    // on the values widened up front, contiguous and paged.
    let t = CpuTiles::new(64, 64);
    let lens = [0usize, 1, 100, 192];
    let p = problem(lens.len(), 8, 2, 2, 192, 64);
    let x = Inputs::new(&p, 0x16, 1.0);
    let v = SlidingWindow { window: 70 };
    let bf: (Vec<half::bf16>, Vec<half::bf16>) = (
        x.k.iter().map(|&y| half::bf16::from_f32(y)).collect(),
        x.v.iter().map(|&y| half::bf16::from_f32(y)).collect(),
    );
    let hf: (Vec<half::f16>, Vec<half::f16>) = (
        x.k.iter().map(|&y| half::f16::from_f32(y)).collect(),
        x.v.iter().map(|&y| half::f16::from_f32(y)).collect(),
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let run = |k: &[f32], vv: &[f32]| {
        let (mut out, mut lse) = poisoned(p);
        forward_cache_tiled(
            &v,
            &p,
            t,
            CacheLayout::lengths(&lens),
            &x.q,
            k,
            vv,
            &mut out,
            &mut lse,
        );
        (bits(&out), bits(&lse))
    };
    let wide_bf: (Vec<f32>, Vec<f32>) = (
        bf.0.iter().map(|y| y.to_f32()).collect(),
        bf.1.iter().map(|y| y.to_f32()).collect(),
    );
    let (mut out, mut lse) = poisoned(p);
    forward_cache_tiled(
        &v,
        &p,
        t,
        CacheLayout::lengths(&lens),
        &x.q,
        &bf.0,
        &bf.1,
        &mut out,
        &mut lse,
    );
    assert_eq!(
        (bits(&out), bits(&lse)),
        run(&wide_bf.0, &wide_bf.1),
        "bf16 cache"
    );

    let wide_hf: (Vec<f32>, Vec<f32>) = (
        hf.0.iter().map(|y| y.to_f32()).collect(),
        hf.1.iter().map(|y| y.to_f32()).collect(),
    );
    // Pages of 32 (half a key tile) holding the f16 cache in order.
    let (max_pages, ps) = (192 / 32, 32);
    let table: Vec<usize> = (0..lens.len() * max_pages).collect();
    let (mut out, mut lse) = poisoned(p);
    let (mut wout, mut wlse) = poisoned(p);
    // Pages [pages, Hkv, ps, D] from [B, Hkv, Sk, D]: page n of sequence s
    // is its keys n·ps .. for every kv head.
    let paged_of = |src: &[f32]| -> Vec<f32> {
        let mut dst = vec![0.0f32; src.len()];
        let d = p.head_dim;
        for s in 0..lens.len() {
            for n in 0..max_pages {
                for h in 0..p.heads_kv {
                    let from = ((s * p.heads_kv + h) * p.seq_k + n * ps) * d;
                    let to = (((s * max_pages + n) * p.heads_kv + h) * ps) * d;
                    dst[to..to + ps * d].copy_from_slice(&src[from..from + ps * d]);
                }
            }
        }
        dst
    };
    let (kp, vp) = (paged_of(&wide_hf.0), paged_of(&wide_hf.1));
    let kp16: Vec<half::f16> = kp.iter().map(|&y| half::f16::from_f32(y)).collect();
    let vp16: Vec<half::f16> = vp.iter().map(|&y| half::f16::from_f32(y)).collect();
    forward_cache_tiled(
        &v,
        &p,
        t,
        paging(&lens, &table, ps),
        &x.q,
        &kp16,
        &vp16,
        &mut out,
        &mut lse,
    );
    forward_cache_tiled(
        &v,
        &p,
        t,
        paging(&lens, &table, ps),
        &x.q,
        &kp,
        &vp,
        &mut wout,
        &mut wlse,
    );
    assert_eq!(
        (bits(&out), bits(&lse)),
        (bits(&wout), bits(&wlse)),
        "f16 pages"
    );
    // And the f16 cache against the f64 reference.
    let xr = Inputs {
        q: x.q.clone(),
        k: wide_hf.0.clone(),
        v: wide_hf.1.clone(),
        dout: x.dout.clone(),
        dlse: x.dlse.clone(),
    };
    let want = reference_lens(&v, &p, &xr, Some(&lens));
    assert_close("f16 pages out", &out, &want.out, 2e-5);
}

// ------------------------------------------------------------ bf16 on AMX

/// `x` rounded to bf16 and back (to nearest, ties to even).
fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

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
    use super::simd::Level;
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

/// `got`'s largest error against `want` is within twice `yard`'s (and a
/// millionth of the largest magnitude).
#[track_caller]
fn within(what: &str, got: &[f32], want: &[f64], yard: &[f64]) {
    assert!(
        got.iter().all(|x| x.is_finite()),
        "{what}: a non-finite value"
    );
    let err = |x: &mut dyn Iterator<Item = f64>| {
        x.zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs()))
    };
    let yard = err(&mut yard.iter().copied());
    let got = err(&mut got.iter().map(|&x| f64::from(x)));
    let big = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let bound = 2.0 * yard + 1e-6 * (1.0 + big);
    assert!(
        got <= bound,
        "{what}: error {got:e} > {bound:e} (yardstick {yard:e})"
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
    use super::simd::Level;
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
