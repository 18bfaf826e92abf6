//! Kernel tests against an f64 reference, with hand-written variants: the
//! variants, the reference and the helpers here; the tests by subject in
//! `kernels` (tile forward and backward), `caches` (decode, caches, pages)
//! and `bf16_tiles` (the bf16 kernels, strided operands).

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

/// `x` rounded to bf16 and back (to nearest, ties to even).
fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
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

mod bf16_tiles;
mod caches;
mod kernels;
