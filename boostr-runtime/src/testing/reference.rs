//! The oracle: naive attention that evaluates the variant's own closures, one
//! row of scores at a time, with its analytic backward.
//!
//! The algorithm is written once, generic over [`Real`]:
//!
//! - in **f64** it calls `score_f64`, `score_grad_f64` and `mask_exact` (the
//!   mask in the language's f32 arithmetic, each operation rounded once: a
//!   mask is a decision, which f64 could make otherwise at an exact tie):
//!   this is the reference every kernel is compared with;
//! - in **f32** it calls `score`, `score_grad` and `mask`: this is the "naive
//!   f32 implementation" whose own error against the f64 reference sets the
//!   tolerance of the kernels (see [`check_variant`](super::check_variant)).
//!
//! Semantics (the contract of [`attention_fwd`](crate::attention_fwd)):
//!
//! - `s = scale · (q_i · k_j)`, `z = score(s, b, h, q_pos, kv_pos)` where query
//!   row `i` has `q_pos = i + Sk − Sq` (bottom-right alignment) and key `j` has
//!   `kv_pos = j`; query head `h` reads kv head `h / (Hq / Hkv)`;
//! - pairs with `mask(b, h, q_pos, kv_pos) == false` are excluded, and so are
//!   pairs whose modified score is `−inf` (they carry zero probability);
//! - the row's sink `σ_i = sink(b, h, q_pos)` (`−inf` without one) is one
//!   more logit with no value: `P = softmax(z)` over the visible keys and
//!   the sink, `out_i = Σ_j P_ij v_j`, `lse_i = ln (e^σ_i + Σ_j exp(z_ij))`;
//! - a row with no visible key has `out = 0`, `lse = σ_i` (`−inf` without
//!   a sink), and contributes nothing to any gradient.
//!
//! Backward of `out` with output gradient `dO` (`P` recomputed as
//! `exp(z − lse)` from the row's lse, and `O` as in the forward, just as a
//! kernel's backward uses its forward's `out` and `lse`):
//! `D_i = Σ_d dO_i·O_i`, `dP_ij = dO_i·v_j`,
//! `dS_ij = P_ij (dP_ij − D_i) · score_grad(s_ij)`,
//! `dQ = scale · dS K`, `dK = scale · dSᵀ Q`, `dV = Pᵀ dO`; the query heads of
//! one GQA group sum into their shared kv head. A learnable tensor `t` gets
//! `Σ_ij P_ij (dP_ij − D_i) · ∂score/∂t` over the visible pairs and, read by
//! the sink, `Σ_i −e^(σ_i − lse_i) D_i · ∂sink/∂t` over the rows (the
//! sink's probability times the derivative of `out_i` with respect to it).
//!
//! Query rows run in parallel over `(batch, query head)`; every sum runs in a
//! fixed order, so results do not depend on the thread count.

use crate::cpu::par::ForEachDyn as _;
pub use crate::cpu::weights::Float;
use crate::cpu::weights::RowWeights as _;
use crate::problem::Problem;
use crate::variant::HostVariant;
use rayon::prelude::*;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// The float type the reference algorithm runs in: `f32` (the variant's f32
/// closures) or `f64` (its f64 closures). Sealed.
pub trait Real: sealed::Sealed + Float {
    /// Widen to f64 (exact).
    fn to_f64(self) -> f64;
    /// The variant's `score` in this precision.
    fn score<V: HostVariant>(variant: &V, s: Self, b: i32, h: i32, q: i32, kv: i32) -> Self;
    /// The variant's `score_grad` in this precision.
    fn score_grad<V: HostVariant>(variant: &V, s: Self, b: i32, h: i32, q: i32, kv: i32) -> Self;
    /// The variant's mask in this precision.
    fn mask<V: HostVariant>(variant: &V, b: i32, h: i32, q: i32, kv: i32) -> bool;
    /// The variant's sink in this precision.
    fn sink<V: HostVariant>(variant: &V, b: i32, h: i32, q: i32) -> Self;
    /// `score_tensor_grads` in this precision (`abs`: magnitudes, f64 only).
    #[allow(clippy::too_many_arguments)]
    fn score_tensor_grads<V: HostVariant>(
        variant: &V,
        at: (Self, i32, i32, i32, i32),
        dz: Self,
        abs: bool,
        grads: &mut [&mut [Self]],
    );
    /// `sink_tensor_grads` in this precision (`abs`: magnitudes, f64 only).
    fn sink_tensor_grads<V: HostVariant>(
        variant: &V,
        at: (i32, i32, i32),
        dz: Self,
        abs: bool,
        grads: &mut [&mut [Self]],
    );
}

/// The [`Real`] functions that call the variant's functions of one
/// precision, by name; `abs` is passed on (`pass`) in f64, which takes
/// the magnitudes, and not (`drop`) in f32.
macro_rules! host_functions {
    (@grads pass, $v:ident.$f:ident($($arg:ident),*), $abs:ident, $grads:ident) => {
        $v.$f($($arg,)* $abs, $grads)
    };
    (@grads drop, $v:ident.$f:ident($($arg:ident),*), $abs:ident, $grads:ident) => {
        $v.$f($($arg,)* $grads)
    };
    ($score:ident, $score_grad:ident, $mask:ident, $sink:ident,
     $score_tensor_grads:ident, $sink_tensor_grads:ident, $abs:ident) => {
        fn score<V: HostVariant>(variant: &V, s: Self, b: i32, h: i32, q: i32, kv: i32) -> Self {
            variant.$score(s, b, h, q, kv)
        }
        fn score_grad<V: HostVariant>(
            variant: &V,
            s: Self,
            b: i32,
            h: i32,
            q: i32,
            kv: i32,
        ) -> Self {
            variant.$score_grad(s, b, h, q, kv)
        }
        fn mask<V: HostVariant>(variant: &V, b: i32, h: i32, q: i32, kv: i32) -> bool {
            variant.$mask(b, h, q, kv)
        }
        fn sink<V: HostVariant>(variant: &V, b: i32, h: i32, q: i32) -> Self {
            variant.$sink(b, h, q)
        }
        fn score_tensor_grads<V: HostVariant>(
            variant: &V,
            (s, b, h, q, kv): (Self, i32, i32, i32, i32),
            dz: Self,
            abs: bool,
            grads: &mut [&mut [Self]],
        ) {
            debug_assert!(!abs || size_of::<Self>() == 8, "magnitudes are taken in f64");
            host_functions!(@grads $abs, variant.$score_tensor_grads(s, b, h, q, kv, dz), abs, grads);
        }
        fn sink_tensor_grads<V: HostVariant>(
            variant: &V,
            (b, h, q): (i32, i32, i32),
            dz: Self,
            abs: bool,
            grads: &mut [&mut [Self]],
        ) {
            debug_assert!(!abs || size_of::<Self>() == 8, "magnitudes are taken in f64");
            host_functions!(@grads $abs, variant.$sink_tensor_grads(b, h, q, dz), abs, grads);
        }
    };
}

impl Real for f32 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    host_functions!(
        score,
        score_grad,
        mask,
        sink,
        score_tensor_grads,
        sink_tensor_grads,
        drop
    );
}

impl Real for f64 {
    fn to_f64(self) -> f64 {
        self
    }
    host_functions!(
        score_f64,
        score_grad_f64,
        mask_exact,
        sink_f64,
        score_tensor_grads_f64,
        sink_tensor_grads_f64,
        pass
    );
}

/// Forward results: `out [B, Hq, Sq, Dv]`, `lse [B, Hq, Sq]` and
/// `max_scores [B, Hq, Sq]`, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Forward<T> {
    /// Attention output.
    pub out: Vec<T>,
    /// Natural log-sum-exp of each row's visible modified scores (`−inf` for
    /// a row with no visible key).
    pub lse: Vec<T>,
    /// Each row's largest visible modified score (`−inf` for a row with no
    /// visible key; a sink takes no part): the references' always, a
    /// backend's where its call asked for them (else empty).
    pub max_scores: Vec<T>,
}

/// Backward results: `dq [B, Hq, Sq, D]`, `dk [B, Hkv, Sk, D]`, `dv [B,
/// Hkv, Sk, Dv]`, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients<T> {
    /// Gradient of the loss with respect to `q`.
    pub dq: Vec<T>,
    /// Gradient of the loss with respect to `k`.
    pub dk: Vec<T>,
    /// Gradient of the loss with respect to `v`.
    pub dv: Vec<T>,
    /// Gradient of the loss with respect to each learnable tensor, in slot
    /// order (row-major, its shape); empty for a variant without them.
    pub tensors: Vec<Vec<T>>,
}

/// Position of query row `i` (bottom-right alignment).
pub(crate) fn q_pos(p: &Problem, i: usize) -> i32 {
    (i as i64 + p.q_offset()) as i32
}

fn check_len(name: &str, got: usize, want: usize, p: &Problem) {
    assert_eq!(
        got, want,
        "reference attention: {name} has {got} elements, but {p:?} needs {want}"
    );
}

fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut acc = T::ZERO;
    for (&x, &y) in a.iter().zip(b) {
        acc += x * y;
    }
    acc
}

fn dot_rev<T: Real>(a: &[T], b: &[T]) -> T {
    let mut acc = T::ZERO;
    for (&x, &y) in a.iter().zip(b).rev() {
        acc += x * y;
    }
    acc
}

/// Philox 4×32-10 (Random123's definition), written for the reference
/// alone: one round at a time over 64-bit products.
pub(crate) fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut x0, mut x1, mut x2, mut x3] = counter;
    let [mut k0, mut k1] = key;
    for _ in 0..10 {
        let p0 = u64::from(0xD251_1F53u32) * u64::from(x0);
        let p1 = u64::from(0xCD9E_8D57u32) * u64::from(x2);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        (x0, x1, x2, x3) = (hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0);
        k0 = k0.wrapping_add(0x9E37_79B9);
        k1 = k1.wrapping_add(0xBB67_AE85);
    }
    [x0, x1, x2, x3]
}

/// Whether the call's dropout keeps pair `(b, h, q, kv)`
/// ([`kernels_spec::dropout`]): always without dropout.
pub(crate) fn keeps(p: &Problem, b: i32, h: i32, q: i32, kv: i32) -> bool {
    let d = p.dropout;
    if !d.active() {
        return true;
    }
    let counter = [
        (kv as u32) >> 2,
        q as u32,
        ((b as u32) << 16) | h as u32,
        d.offset,
    ];
    let r = philox4x32_10(counter, [d.seed as u32, (d.seed >> 32) as u32]);
    r[(kv & 3) as usize] >= d.threshold
}

/// One query row's weights (softmax or sigmoid), materialised over all keys.
struct Row<T> {
    /// Scaled logits `s` (unused where not visible).
    s: Vec<T>,
    /// Modified scores `z` (`−inf` where not visible).
    z: Vec<T>,
    /// Probabilities `exp(z − max) / Σ exp(z − max)` (exactly zero where not
    /// visible).
    p: Vec<T>,
    /// Log-sum-exp (`−inf` when no key is visible); 0 with sigmoid.
    lse: T,
    /// The largest of `z` (`−inf` when no key is visible).
    z_max: T,
    /// The dropout factor of each key: 0 (dropped) or `1/(1 − p)`.
    keep: Vec<T>,
}

impl<T: Real> Row<T> {
    fn new(seq_k: usize) -> Self {
        Self {
            s: vec![T::ZERO; seq_k],
            z: vec![T::NEG_INFINITY; seq_k],
            p: vec![T::ZERO; seq_k],
            lse: T::NEG_INFINITY,
            z_max: T::NEG_INFINITY,
            keep: vec![T::ZERO; seq_k],
        }
    }

    /// Compute row `i` of `(b, h)`; returns whether any key carries
    /// probability. The row's sink, if finite, is one more logit of its
    /// softmax with no value: it takes part in the max, the sum and the lse,
    /// and a row with no visible key has `lse = sink`.
    #[allow(clippy::too_many_arguments)]
    fn compute<V: HostVariant>(
        &mut self,
        variant: &V,
        p: &Problem,
        q: &[T],
        k: &[T],
        b: usize,
        h: usize,
        i: usize,
    ) -> bool {
        let d = p.head_dim;
        let hk = h / p.group();
        let scale = T::from_f32(p.scale);
        let qr = &q[((b * p.heads_q + h) * p.seq_q + i) * d..][..d];
        let (bi, hi, qi) = (b as i32, h as i32, q_pos(p, i));
        // First pass: z and its max over the visible keys and the sink.
        let sink = T::sink(variant, bi, hi, qi);
        let mut max = sink;
        self.z_max = T::NEG_INFINITY;
        for j in 0..p.seq_k {
            let ji = j as i32;
            if !T::mask(variant, bi, hi, qi, ji) {
                self.z[j] = T::NEG_INFINITY;
                continue;
            }
            let kr = &k[((b * p.heads_kv + hk) * p.seq_k + j) * d..][..d];
            let s = scale * dot(qr, kr);
            let z = T::score(variant, s, bi, hi, qi, ji);
            self.s[j] = s;
            self.z[j] = z;
            if z > max {
                max = z;
            }
            if z > self.z_max {
                self.z_max = z;
            }
        }
        let factor = T::from_f32(p.dropout.scale());
        // The draw is keyed by the batch and positions the variant's
        // functions see.
        let (db, dq, dkv) = variant.dropout_site(bi, qi);
        for (j, keep) in self.keep.iter_mut().enumerate() {
            *keep = if keeps(p, db, hi, dq, j as i32 + dkv) {
                factor
            } else {
                T::ZERO
            };
        }
        // Second pass: the weights from the whole row's max (the sink's
        // share counted once), finished as the kernels finish a row. A NaN
        // score propagates (on purpose: the checks report it).
        let w = V::WEIGHTS;
        let mut sum = w.start(sink) * w.rescale(sink, max);
        for (pj, &z) in self.p.iter_mut().zip(&self.z) {
            *pj = w.pair(z, max);
            sum += *pj;
        }
        let scale = w.scale(sum);
        for pj in &mut self.p {
            *pj = *pj * scale;
        }
        self.lse = w.lse(max, sum);
        self.z.iter().any(|&z| z != T::NEG_INFINITY)
    }

    /// `P_j` recomputed from the row's log-sum-exp, `exp(z_j − lse)`, as a
    /// backward kernel does from its saved lse. In f32 this carries the
    /// rounding of `lse` itself (half an ulp: ~5e-4 at |lse| ~ 1e4), which
    /// every kernel's backward carries too; in f64 it equals `p`.
    fn p_from_lse<V: HostVariant>(&self, j: usize) -> T {
        let z = self.z[j];
        if z == T::NEG_INFINITY {
            T::ZERO
        } else {
            V::WEIGHTS.prob(z, self.lse)
        }
    }
}

/// Naive attention forward in precision `T` (f64: the oracle; f32: the naive
/// f32 implementation). Slices are contiguous in the layout of [`Problem`].
///
/// # Panics
///
/// When a slice's length does not match `problem`.
pub fn reference_forward<T: Real, V: HostVariant>(
    variant: &V,
    problem: &Problem,
    q: &[T],
    k: &[T],
    v: &[T],
) -> Forward<T> {
    let p = problem;
    check_len("q", q.len(), p.q_len(), p);
    check_len("k", k.len(), p.k_len(), p);
    check_len("v", v.len(), p.v_len(), p);
    let dv = p.head_dim_v;
    let mut out = vec![T::ZERO; p.out_len()];
    let mut lse = vec![T::NEG_INFINITY; p.lse_len()];
    let mut max_scores = vec![T::NEG_INFINITY; p.lse_len()];
    out.par_chunks_mut(p.seq_q * dv)
        .zip(lse.par_chunks_mut(p.seq_q))
        .zip(max_scores.par_chunks_mut(p.seq_q))
        .enumerate()
        .for_each_dyn(&|(bh, ((out_bh, lse_bh), max_bh))| {
            let (b, h) = (bh / p.heads_q, bh % p.heads_q);
            let hk = h / p.group();
            let mut row = Row::new(p.seq_k);
            for i in 0..p.seq_q {
                let any = row.compute(variant, p, q, k, b, h, i);
                lse_bh[i] = row.lse;
                max_bh[i] = row.z_max;
                if !any {
                    continue;
                }
                let o = &mut out_bh[i * dv..][..dv];
                for (j, &pj) in row.p.iter().enumerate() {
                    let pj = pj * row.keep[j];
                    if pj == T::ZERO {
                        continue;
                    }
                    let vr = &v[((b * p.heads_kv + hk) * p.seq_k + j) * dv..][..dv];
                    for (ox, &vx) in o.iter_mut().zip(vr) {
                        *ox += pj * vx;
                    }
                }
            }
        });
    Forward {
        out,
        lse,
        max_scores,
    }
}

/// Analytic backward of [`reference_forward`] in precision `T`, for output
/// gradient `dout` (the forward is recomputed). Keys that no query sees, and
/// rows with no visible key, get exactly zero gradient.
///
/// # Panics
///
/// When a slice's length does not match `problem`.
pub fn reference_backward<T: Real, V: HostVariant>(
    variant: &V,
    problem: &Problem,
    q: &[T],
    k: &[T],
    v: &[T],
    dout: &[T],
) -> Gradients<T> {
    backward(variant, problem, [q, k, v, dout], None, false)
}

/// [`reference_backward`] of a loss that reads `lse` too, `dlse = d loss
/// / d lse` (`[B, Hq, Sq]`): `d loss / d z_ij = P_ij (dP_ij − D_i +
/// dlse_i)` under a softmax (lse is the constant 0 under sigmoid weights,
/// and `dlse` changes nothing).
///
/// # Panics
///
/// When a slice's length does not match `problem`.
pub fn reference_backward_lse<T: Real, V: HostVariant>(
    variant: &V,
    problem: &Problem,
    [q, k, v]: [&[T]; 3],
    (dout, dlse): (&[T], &[T]),
) -> Gradients<T> {
    backward(variant, problem, [q, k, v, dout], Some(dlse), false)
}

/// Magnitudes of the terms that make up each result, for the absolute slack
/// of the tolerance: the sums of [`reference_forward`] and
/// [`reference_backward`] with every factor but `P` replaced by its absolute
/// value, and `dP_ij − D_i` by `Σ|dO_i||v_j| + Σ|dO_i||O_i|`:
///
/// - `out`: `Σ_j P_ij |v_j|`
/// - `dq`: `scale · Σ_j P_ij (Σ|dO_i||v_j| + Σ|dO_i||O_i|) |score_grad| |k_j|`
/// - `dk`: the same summed over `i` with `|q_i|`
/// - `dv`: `Σ_i P_ij |dO_i|`
///
/// Rounding anywhere in these sums is a fraction of their magnitude, also
/// where the result itself cancels to ~0 (a row with one visible key has
/// `dP − D = 0`, so its `dq` is pure rounding noise, of size ε·magnitude).
pub(crate) fn reference_magnitudes<V: HostVariant>(
    variant: &V,
    problem: &Problem,
    [q, k, v, dout]: [&[f64]; 4],
    dlse: Option<&[f64]>,
) -> (Vec<f64>, Gradients<f64>) {
    let v_abs: Vec<f64> = v.iter().map(|x| x.abs()).collect();
    let out = reference_forward(variant, problem, q, k, &v_abs).out;
    (out, backward(variant, problem, [q, k, v, dout], dlse, true))
}

/// The backward (`dlse`: none is zero); with `magnitudes`, the sums of
/// [`reference_magnitudes`].
fn backward<T: Real, V: HostVariant>(
    variant: &V,
    problem: &Problem,
    [q, k, v, dout]: [&[T]; 4],
    dlse: Option<&[T]>,
    magnitudes: bool,
) -> Gradients<T> {
    let p = problem;
    check_len("q", q.len(), p.q_len(), p);
    check_len("k", k.len(), p.k_len(), p);
    check_len("v", v.len(), p.v_len(), p);
    check_len("dout", dout.len(), p.out_len(), p);
    if let Some(dlse) = dlse {
        check_len("dlse", dlse.len(), p.lse_len(), p);
    }
    let (d, d_v) = (p.head_dim, p.head_dim_v);
    let scale = T::from_f32(p.scale);
    // The factors multiplied into the sums: signed, or their magnitudes.
    let abs_of = |x: &[T]| -> Vec<T> { x.iter().map(|a| a.abs()).collect() };
    let abs = magnitudes.then(|| [abs_of(q), abs_of(k), abs_of(v), abs_of(dout)]);
    let [qf, kf, vf, df]: [&[T]; 4] = match &abs {
        Some([qa, ka, va, da]) => [qa, ka, va, da],
        None => [q, k, v, dout],
    };
    let mut dq = vec![T::ZERO; p.q_len()];
    // Each (batch, query head) accumulates its own dk, dv over its rows; the
    // heads of a GQA group are summed afterwards in head order.
    let numel: Vec<usize> = (0..V::LEARNABLE)
        .map(|k| variant.learnable_numel(k))
        .collect();
    // Per (batch, query head): its dk, dv and tensor gradients.
    type Partial<T> = (Vec<T>, Vec<T>, Vec<Vec<T>>);
    let partials: Vec<Partial<T>> =
        dq.par_chunks_mut(p.seq_q * d)
            .enumerate()
            .map_collect_dyn(&|(bh, dq_bh)| {
                let (b, h) = (bh / p.heads_q, bh % p.heads_q);
                let hk = h / p.group();
                let (bi, hi) = (b as i32, h as i32);
                let mut dk_h = vec![T::ZERO; p.seq_k * d];
                let mut dv_h = vec![T::ZERO; p.seq_k * d_v];
                let mut tensors_h: Vec<Vec<T>> = numel.iter().map(|&n| vec![T::ZERO; n]).collect();
                let mut views: Vec<&mut [T]> =
                    tensors_h.iter_mut().map(Vec::as_mut_slice).collect();
                let mut row = Row::new(p.seq_k);
                let mut o = vec![T::ZERO; d_v];
                for i in 0..p.seq_q {
                    let visible = row.compute(variant, p, q, k, b, h, i);
                    // A row that sees nothing has out 0 and `lse = sink`:
                    // its sink's gradient is `dlse` alone.
                    let sink_seen = V::LEARNABLE > 0 && row.lse != T::NEG_INFINITY;
                    if !visible && !sink_seen {
                        continue;
                    }
                    let qi = q_pos(p, i);
                    let row_i = (b * p.heads_q + h) * p.seq_q + i;
                    let (qr, dor) = (&qf[row_i * d..][..d], &df[row_i * d_v..][..d_v]);
                    let key = |j: usize| (b * p.heads_kv + hk) * p.seq_k + j;
                    o.fill(T::ZERO);
                    for (j, &pj) in row.p.iter().enumerate() {
                        let pj = pj * row.keep[j];
                        if pj != T::ZERO {
                            for (ox, &vx) in o.iter_mut().zip(&v[key(j) * d_v..][..d_v]) {
                                *ox += pj * vx;
                            }
                        }
                    }
                    if magnitudes {
                        o.iter_mut().for_each(|x| *x = x.abs());
                    }
                    // Summed in the opposite order from `dP` below: in a one-hot
                    // row `O = v_j` exactly, and summing both alike would cancel
                    // `dP_ij − D_i` exactly, which no kernel does (its `D` comes
                    // from its forward's `out`); the naive f32 error must include
                    // that rounding.
                    // `D_i − dlse_i` (its magnitude: `Σ|dO_i||O_i| + |dlse_i|`).
                    let g_lse = dlse.map_or(T::ZERO, |g| g[row_i]);
                    let d_i = if !V::WEIGHTS.needs_delta() {
                        T::ZERO
                    } else if magnitudes {
                        dot_rev(dor, &o) + g_lse.abs()
                    } else {
                        dot_rev(dor, &o) - g_lse
                    };
                    let sink = T::sink(variant, bi, hi, qi);
                    if V::LEARNABLE > 0 && sink != T::NEG_INFINITY {
                        let p_sink = (sink - row.lse).exp();
                        let dz = if magnitudes {
                            p_sink * d_i
                        } else {
                            -(p_sink * d_i)
                        };
                        T::sink_tensor_grads(variant, (bi, hi, qi), dz, magnitudes, &mut views);
                    }
                    let dq_r = &mut dq_bh[i * d..][..d];
                    for (j, &s) in row.s.iter().enumerate() {
                        let pj = row.p_from_lse::<V>(j);
                        if pj == T::ZERO {
                            continue;
                        }
                        let (kr, vr) = (&kf[key(j) * d..][..d], &vf[key(j) * d_v..][..d_v]);
                        // d loss / d P through the kept pairs' factor.
                        let dp = dot(dor, vr) * row.keep[j];
                        let g = T::score_grad(variant, s, bi, hi, qi, j as i32);
                        // The magnitudes' bound: every term of `dP − D_i`
                        // counted positive.
                        let delta = if magnitudes { -d_i } else { d_i };
                        let dz = V::WEIGHTS.dz(pj, dp, delta);
                        let ds = if magnitudes { dz * g.abs() } else { dz * g };
                        if V::LEARNABLE > 0 {
                            let at = (s, bi, hi, qi, j as i32);
                            T::score_tensor_grads(variant, at, dz, magnitudes, &mut views);
                        }
                        let sds = scale * ds;
                        let (dk_j, dv_j) = (&mut dk_h[j * d..][..d], &mut dv_h[j * d_v..][..d_v]);
                        for x in 0..d {
                            dq_r[x] += sds * kr[x];
                            dk_j[x] += sds * qr[x];
                        }
                        let pk = pj * row.keep[j];
                        for (dv_x, &do_x) in dv_j.iter_mut().zip(dor) {
                            *dv_x += pk * do_x;
                        }
                    }
                }
                drop(views);
                (dk_h, dv_h, tensors_h)
            });
    let mut dk = vec![T::ZERO; p.k_len()];
    let mut dv = vec![T::ZERO; p.v_len()];
    let mut tensors: Vec<Vec<T>> = numel.iter().map(|&n| vec![T::ZERO; n]).collect();
    for (bh, (dk_h, dv_h, tensors_h)) in partials.into_iter().enumerate() {
        for (acc, part) in tensors.iter_mut().zip(tensors_h) {
            for (a, x) in acc.iter_mut().zip(part) {
                *a += x;
            }
        }
        let (b, h) = (bh / p.heads_q, bh % p.heads_q);
        let head = (b * p.heads_kv + h / p.group()) * p.seq_k;
        for (acc, x) in dk[head * d..][..p.seq_k * d].iter_mut().zip(dk_h) {
            *acc += x;
        }
        for (acc, x) in dv[head * d_v..][..p.seq_k * d_v].iter_mut().zip(dv_h) {
            *acc += x;
        }
    }
    Gradients {
        dq,
        dk,
        dv,
        tensors,
    }
}
