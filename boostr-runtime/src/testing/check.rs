//! `check_variant`: a backend's kernels against the f64 reference, on the
//! standard cases, through both the tensor ops and the autograd op.

use super::cases::{CASES, Case, Logits};
use super::reference::{
    Forward, Gradients, q_pos, reference_backward, reference_forward, reference_magnitudes,
};
use super::rng::{Rng, SEED_ENV, choose_seed};
use super::unravel;
use crate::backend::AttentionRuntime;
use crate::op::{AttentionOptions, attention_bwd, attention_fwd, var_attention};
use crate::problem::Problem;
use crate::validate;
use crate::variant::{TileClass, Variant};
use numr::autograd::{Var, backward, var_mul, var_sum};
use numr::ops::TensorOps;
use numr::runtime::Runtime;
use numr::runtime::cpu::{CpuDevice, CpuRuntime};
use numr::tensor::Tensor;
use std::fmt::Write as _;

/// A backend under test: a numr runtime with attention kernels, and how to get
/// one of its devices.
///
/// [`Cpu`] is always available. GPU backends (wgpu, CUDA) implement this
/// behind their cargo features and return `None` from [`device`] when the
/// machine has no such device; the check is then skipped with a message
/// (or fails, when `BOOSTR_TEST_REQUIRE_DEVICE` is set).
///
/// [`device`]: TestBackend::device
pub trait TestBackend {
    /// The runtime whose kernels are checked.
    type Runtime: AttentionRuntime<Client: TensorOps<Self::Runtime>>;
    /// Short name, printed in every report.
    const NAME: &'static str;
    /// A device to run on, or `None` when this machine has none.
    fn device() -> Option<<Self::Runtime as Runtime>::Device>;
    /// The cases [`check_variant`] runs: [`CASES`] unless the backend is too
    /// slow for them on the machines it is tested on.
    fn cases() -> &'static [Case] {
        CASES
    }
}

/// numr's CPU runtime.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl TestBackend for Cpu {
    type Runtime = CpuRuntime;
    const NAME: &'static str = "cpu";
    fn device() -> Option<CpuDevice> {
        Some(CpuDevice::new())
    }
}

/// numr's WebGPU runtime, on its default adapter. Checked on
/// [`SMALL_CASES`](super::SMALL_CASES): software adapters (Mesa lavapipe)
/// run the standard cases' largest shapes for minutes.
#[cfg(feature = "wgpu")]
#[derive(Clone, Copy, Debug, Default)]
pub struct Wgpu;

#[cfg(feature = "wgpu")]
impl TestBackend for Wgpu {
    type Runtime = numr::runtime::wgpu::WgpuRuntime;
    const NAME: &'static str = "wgpu";
    fn device() -> Option<numr::runtime::wgpu::WgpuDevice> {
        numr::runtime::wgpu::is_wgpu_available().then(numr::runtime::wgpu::wgpu_device)
    }
    fn cases() -> &'static [Case] {
        super::cases::SMALL_CASES
    }
}

/// numr's CUDA runtime on device 0, f32 inputs (the f16/bf16 kernels are
/// timed and checked by `bench/gpu.sh`).
#[cfg(feature = "cuda")]
#[derive(Clone, Copy, Debug, Default)]
pub struct Cuda;

#[cfg(feature = "cuda")]
impl TestBackend for Cuda {
    type Runtime = numr::runtime::cuda::CudaRuntime;
    const NAME: &'static str = "cuda";
    fn device() -> Option<numr::runtime::cuda::CudaDevice> {
        numr::runtime::cuda::is_cuda_available().then(numr::runtime::cuda::cuda_device)
    }
}

/// Environment variable: when set, a backend without a device fails
/// [`check_variant`] instead of skipping it (for CI machines that have one).
pub const REQUIRE_DEVICE_ENV: &str = "BOOSTR_TEST_REQUIRE_DEVICE";

/// Factor on the naive f32 implementation's max error (FlashAttention's rule).
pub(crate) const NAIVE_FACTOR: f64 = 2.0;
/// The factor of [`check_parity`]: two backends that each pass their own
/// test may each be `NAIVE_FACTOR` naive errors away from the reference, on
/// opposite sides, so twice that apart. With large logits, where every f32
/// implementation's error is decided by the rounding of a few huge logits,
/// two correct backends were measured 2.05 naive errors apart.
const PARITY_FACTOR: f64 = 2.0 * NAIVE_FACTOR;
/// Absolute slack, in units of `1 + max |ref|`: a few ulps of the result,
/// for kernels whose `exp` or division is off by an ulp where the naive f32
/// happens to be exact (e.g. `P = 1` in a row with one visible key).
const SLACK: f64 = 1e-6;
/// Slack for cancellation, in units of `M`, the largest magnitude of the
/// terms summed into the tensor (see `reference_magnitudes`): one rounding
/// of that size. Matters where the result cancels to ~0 but its terms do not
/// (the `dq` of a row with one visible key is pure rounding noise of
/// `dP − D`, scaled by `|k|`).
const CANCEL: f64 = f32::EPSILON as f64;
/// The naive f32 implementation itself must be this close to the reference
/// (in units of `1 + M`, see [`CANCEL`]), else the variant's f32 and f64
/// closures disagree and the tolerance would be meaningless.
const NAIVE_SANITY: f64 = 1e-2;

/// Check `R`'s attention kernels for `variant` on every case of
/// [`TestBackend::cases`] ([`CASES`] unless the backend says otherwise).
///
/// For each case, fresh random `q, k, v, dout` (seed from the clock, or from
/// `BOOSTR_TEST_SEED`) go through
///
/// 1. [`attention_fwd`] and [`attention_bwd`], and
/// 2. [`var_attention`] and [`numr::autograd::backward`] of
///    `L = sum(out ∘ dout)` (the `GradFn` path),
///
/// and `out, lse, dq, dk, dv` of both are compared with the f64 reference
/// ([`reference_forward`], [`reference_backward`] with the variant's f64
/// closures) on the same (f32) inputs.
///
/// # Tolerance rule
///
/// Per tensor `T`, with `ref` the f64 reference and `naive` the same algorithm
/// run in f32 with the variant's f32 closures (in two summation orders over
/// the head dim, keeping per element the worse of the two):
///
/// ```text
/// max |T − ref|  ≤  2 · max |naive − ref|  +  1e-6 · (1 + max |ref|)  +  ε · M
/// ```
///
/// Maxima are over all elements (for `lse`, over the finite reference
/// entries); ε = `f32::EPSILON`. The kernel may be at most twice as
/// inaccurate as straightforward f32 arithmetic (FlashAttention's rule). The
/// two slack terms matter only where the naive f32 is (nearly) exact:
/// `1e-6·(1 + max|ref|)` is a few ulps of the result; `M` is the largest
/// magnitude of the terms summed into `T` (the same sums over absolute
/// values, e.g. for `dq` `scale·Σ_j P_ij (Σ|dO_i||v_j| + Σ|dO_i||O_i|)
/// |score_grad| |k_j|`; `|lse|` for `lse`; never less than `max |ref|`), and
/// `ε·M` is one rounding of that size, for results that cancel to ~0 while
/// their terms do not: the `dq` of a row with one visible key is pure
/// rounding noise of `dP − D`, scaled by `|k|`.
///
/// Also required:
/// - no NaN, and no infinity except `lse = −inf`, which must be exactly where
///   the reference has it (rows with no visible key);
/// - those rows have exactly `0` in `out` and `dq`, and keys visible to no
///   query have exactly `0` in `dk` and `dv`;
/// - the naive f32 is itself within `1e-2 · (1 + M)` of the reference
///   (else the variant's f32 and f64 closures disagree);
/// - the variant's own contract: `mask` and `mask_f64` agree; no mask means
///   every pair is visible; an identity score is the identity with
///   derivative 1; `classify_tile` never says `Empty` or `Full` wrongly
///   (several tilings of every case).
///
/// # Panics
///
/// When anything above fails, after running every case, with the variant,
/// backend, seed (rerun with `BOOSTR_TEST_SEED=<seed>`), the case, and the
/// worst element of each failing tensor: index, got, want, naive f32 value
/// and error.
pub fn check_variant<R: TestBackend, V: Variant>(variant: &V) {
    check_variant_on::<R, V>(variant, R::cases());
}

/// [`check_variant`] on the given cases instead of the backend's own list.
///
/// # Panics
///
/// As [`check_variant`].
pub fn check_variant_on<R: TestBackend, V: Variant>(variant: &V, cases: &[Case]) {
    let Some(device) = R::device() else {
        assert!(
            std::env::var_os(REQUIRE_DEVICE_ENV).is_none(),
            "boostr: no {} device, and {REQUIRE_DEVICE_ENV} is set",
            R::NAME
        );
        eprintln!(
            "boostr: skipping the check of variant `{}`: no {} device",
            V::NAME,
            R::NAME
        );
        return;
    };
    let seed = choose_seed();
    let mut failures = String::new();
    for (n, case) in cases.iter().enumerate() {
        let report = run_case::<R, V>(variant, &device, case, seed, n as u64);
        eprintln!(
            "boostr: {} on {}, case {}: {}",
            V::NAME,
            R::NAME,
            case.name,
            report.summary
        );
        if !report.failures.is_empty() {
            let _ = writeln!(failures, "case {case}:");
            for f in &report.failures {
                let _ = writeln!(failures, "  {f}");
            }
        }
    }
    assert!(
        failures.is_empty(),
        "boostr: variant `{}` failed on backend `{}` (seed {seed}; rerun with {SEED_ENV}={seed})\n\
         tolerance: max|got − ref| ≤ {NAIVE_FACTOR}·max|naive_f32 − ref| + {SLACK:e}·(1 + max|ref|) \
         + ε·M, M = max magnitude of the summed terms (≥ max|ref|)\n\
         {failures}",
        V::NAME,
        R::NAME
    );
}

/// What one case produced: failure lines and a one-line summary.
struct CaseReport {
    failures: Vec<String>,
    summary: String,
}

impl CaseReport {
    fn new(failures: Vec<String>, summary: String) -> CaseReport {
        let summary = if failures.is_empty() {
            summary
        } else {
            format!("FAILED ({} problems) {summary}", failures.len())
        };
        CaseReport { failures, summary }
    }

    fn error(e: String) -> CaseReport {
        CaseReport {
            summary: format!("error: {e}"),
            failures: vec![e],
        }
    }
}

/// Results of the backend, host side.
struct BackendResults {
    fwd: Forward<f32>,
    grads: Gradients<f32>,
    var_out: Vec<f32>,
    var_grads: Gradients<f32>,
}

/// `q` and `k` of `case`, as its [`Logits`] says.
fn draw_qk(case: &Case, rng: &mut Rng) -> (Vec<f32>, Vec<f32>) {
    let (q_len, kv_len) = (
        case.q_shape().iter().product(),
        case.kv_shape().iter().product(),
    );
    match case.logits {
        Logits::Random => (
            rng.normal_f32(q_len, case.logit_scale),
            rng.normal_f32(kv_len, case.logit_scale),
        ),
        Logits::RowOffset => {
            // The shift sits on coordinate 0, so the naive f32's forward-order
            // dot product carries its magnitude through every addition: no
            // kernel's summation order rounds at that magnitude more often.
            let (d, c) = (case.head_dim, case.logit_scale);
            let mut q = rng.normal_f32(q_len, 1.0);
            let mut k = rng.normal_f32(kv_len, 1.0);
            for row in q.chunks_exact_mut(d) {
                let u = 0.5 + 0.5 * rng.uniform();
                let sign = if rng.uniform() < 0.5 { -1.0 } else { 1.0 };
                row[0] = (sign * u * f64::from(c)) as f32;
            }
            for row in k.chunks_exact_mut(d) {
                row[0] = c;
            }
            (q, k)
        }
    }
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// The random inputs of case number `stream` of a run with `seed`.
struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
    opts: AttentionOptions,
}

impl Inputs {
    fn draw(case: &Case, seed: u64, stream: u64) -> Inputs {
        let mut rng = Rng::new(seed, stream);
        let (q, k) = draw_qk(case, &mut rng);
        let v = rng.normal_f32(case.kv_shape().iter().product(), 1.0);
        let dout = rng.normal_f32(case.q_shape().iter().product(), 1.0);
        let opts = AttentionOptions { scale: case.scale };
        Inputs {
            q,
            k,
            v,
            dout,
            opts,
        }
    }

    fn slices(&self) -> [&[f32]; 4] {
        [&self.q, &self.k, &self.v, &self.dout]
    }
}

/// What a case is compared against: the f64 reference (or another backend's
/// results, widened), the naive f32 implementation, and the magnitudes of
/// the summed terms (see [`reference_magnitudes`]).
struct Expected {
    fwd: Forward<f64>,
    grads: Gradients<f64>,
    naive_fwd: Forward<f32>,
    naive_grads: Gradients<f32>,
    /// `M` of out, dq, dk, dv.
    magnitudes: [f64; 4],
}

impl Expected {
    fn reference<V: Variant>(variant: &V, p: &Problem, inputs: &Inputs) -> Expected {
        let [q, k, v, dout] = inputs.slices();
        let (q64, k64, v64, dout64) = (widen(q), widen(k), widen(v), widen(dout));
        let fwd = reference_forward(variant, p, &q64, &k64, &v64);
        let grads = reference_backward(variant, p, &q64, &k64, &v64, &dout64);
        let (naive_fwd, naive_grads) = naive_f32(variant, p, inputs.slices(), &fwd, &grads);
        let (mag_out, mag_g) = reference_magnitudes(variant, p, [&q64, &k64, &v64, &dout64]);
        let max_abs = |x: &[f64]| x.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        Expected {
            fwd,
            grads,
            naive_fwd,
            naive_grads,
            magnitudes: [
                max_abs(&mag_out),
                max_abs(&mag_g.dq),
                max_abs(&mag_g.dk),
                max_abs(&mag_g.dv),
            ],
        }
    }
}

fn run_case<R: TestBackend, V: Variant>(
    variant: &V,
    device: &<R::Runtime as Runtime>::Device,
    case: &Case,
    seed: u64,
    stream: u64,
) -> CaseReport {
    let inputs = Inputs::draw(case, seed, stream);
    let (p, got) = match run_backend::<R, V>(variant, device, case, inputs.slices(), &inputs.opts) {
        Ok(results) => results,
        Err(e) => return CaseReport::error(e),
    };
    let mut failures = Vec::new();
    contract(variant, &p, &mut failures);
    let want = Expected::reference(variant, &p, &inputs);
    let summary = compare_results(&p, &got, &want, NAIVE_FACTOR, &mut failures);
    exact_zeros(
        variant,
        &p,
        &want.fwd.lse,
        [
            ("attention_fwd out", &got.fwd.out),
            ("var_attention out", &got.var_out),
            ("attention_bwd dq", &got.grads.dq),
            ("GradFn dq", &got.var_grads.dq),
        ],
        [
            ("attention_bwd dk", &got.grads.dk),
            ("attention_bwd dv", &got.grads.dv),
            ("GradFn dk", &got.var_grads.dk),
            ("GradFn dv", &got.var_grads.dv),
        ],
        &mut failures,
    );
    CaseReport::new(failures, summary)
}

/// Every result of `got` under [`compare`] against `want`; returns the
/// one-line summary of the tensor-op results.
fn compare_results(
    p: &Problem,
    got: &BackendResults,
    want: &Expected,
    factor: f64,
    failures: &mut Vec<String>,
) -> String {
    let [m_out, m_dq, m_dk, m_dv] = want.magnitudes;
    let mut summary = String::new();
    let mut check = |label: &str, layout, got: &[f32], want: &[f64], naive: &[f32], m| {
        let c = compare(factor, label, layout, p, got, want, naive, m);
        failures.extend(c.failures);
        if let Some(short) = label.strip_prefix("attention_") {
            let _ = write!(summary, "{} {:.1e}/{:.1e} ", &short[4..], c.err, c.bound);
        }
    };
    let (wf, wg, nf, ng) = (&want.fwd, &want.grads, &want.naive_fwd, &want.naive_grads);
    let (q_, k_) = (Layout::Query, Layout::Key);
    let (fo, fl, vo) = (&got.fwd.out, &got.fwd.lse, &got.var_out);
    check("attention_fwd out", q_, fo, &wf.out, &nf.out, m_out);
    // lse's magnitude is |lse| itself (taken inside `compare`).
    check("attention_fwd lse", Layout::Lse, fl, &wf.lse, &nf.lse, 0.0);
    check("attention_bwd dq", q_, &got.grads.dq, &wg.dq, &ng.dq, m_dq);
    check("attention_bwd dk", k_, &got.grads.dk, &wg.dk, &ng.dk, m_dk);
    check("attention_bwd dv", k_, &got.grads.dv, &wg.dv, &ng.dv, m_dv);
    check("var_attention out", q_, vo, &wf.out, &nf.out, m_out);
    check("GradFn dq", q_, &got.var_grads.dq, &wg.dq, &ng.dq, m_dq);
    check("GradFn dk", k_, &got.var_grads.dk, &wg.dk, &ng.dk, m_dk);
    check("GradFn dv", k_, &got.var_grads.dv, &wg.dv, &ng.dv, m_dv);
    summary.push_str("(max err / bound)");
    summary
}

/// Check that backend `B` agrees with backend `A` for `variant`, on `B`'s
/// [`TestBackend::cases`], inputs drawn as in [`check_variant`].
///
/// `B`'s `out, lse, dq, dk, dv` (tensor ops and autograd) are compared with
/// `A`'s tensor-op results under [`check_variant`]'s rule with `A` in the
/// place of the f64 reference, and twice its factor: `B` may differ from `A`
/// by at most four times what the naive f32 implementation differs from
/// `A`, plus the same slack (each is held to twice the naive error by its
/// own test, so two correct backends can be twice that apart). `lse
/// = −inf` must match exactly. Skipped (or failed, with
/// `BOOSTR_TEST_REQUIRE_DEVICE`) like [`check_variant`] when either backend
/// has no device.
///
/// # Panics
///
/// When `B` and `A` disagree, after running every case, with the seed and
/// the worst element of each failing tensor.
pub fn check_parity<A: TestBackend, B: TestBackend, V: Variant>(variant: &V) {
    let (Some(dev_a), Some(dev_b)) = (A::device(), B::device()) else {
        assert!(
            std::env::var_os(REQUIRE_DEVICE_ENV).is_none(),
            "boostr: no {} or no {} device, and {REQUIRE_DEVICE_ENV} is set",
            A::NAME,
            B::NAME
        );
        eprintln!(
            "boostr: skipping {} vs {} for variant `{}`: no device",
            A::NAME,
            B::NAME,
            V::NAME
        );
        return;
    };
    let seed = choose_seed();
    let mut failures = String::new();
    for (n, case) in B::cases().iter().enumerate() {
        let inputs = Inputs::draw(case, seed, n as u64);
        let (a, b) = (
            run_backend::<A, V>(variant, &dev_a, case, inputs.slices(), &inputs.opts),
            run_backend::<B, V>(variant, &dev_b, case, inputs.slices(), &inputs.opts),
        );
        let report = match (a, b) {
            (Err(e), _) => CaseReport::error(format!("{}: {e}", A::NAME)),
            (_, Err(e)) => CaseReport::error(format!("{}: {e}", B::NAME)),
            (Ok((p, a)), Ok((_, b))) => {
                let reference = Expected::reference(variant, &p, &inputs);
                let want = Expected {
                    fwd: Forward {
                        out: widen(&a.fwd.out),
                        lse: widen(&a.fwd.lse),
                    },
                    grads: Gradients {
                        dq: widen(&a.grads.dq),
                        dk: widen(&a.grads.dk),
                        dv: widen(&a.grads.dv),
                    },
                    ..reference
                };
                let mut f = Vec::new();
                let summary = compare_results(&p, &b, &want, PARITY_FACTOR, &mut f);
                CaseReport::new(f, summary)
            }
        };
        eprintln!(
            "boostr: {} on {} vs {}, case {}: {}",
            V::NAME,
            B::NAME,
            A::NAME,
            case.name,
            report.summary
        );
        if !report.failures.is_empty() {
            let _ = writeln!(failures, "case {case}:");
            for f in &report.failures {
                let _ = writeln!(failures, "  {f}");
            }
        }
    }
    assert!(
        failures.is_empty(),
        "boostr: variant `{}`: {} disagrees with {} (seed {seed}; rerun with {SEED_ENV}={seed})\n\
         tolerance: max|{} − {}| ≤ {PARITY_FACTOR}·max|naive_f32 − {}| + {SLACK:e}·(1 + max|{}|) + ε·M\n\
         {failures}",
        V::NAME,
        B::NAME,
        A::NAME,
        B::NAME,
        A::NAME,
        A::NAME,
        A::NAME,
    );
}

/// The naive f32 implementation ([`reference_forward`] / [`reference_backward`]
/// in f32), run twice: on the inputs, and on the inputs with the head dim
/// rotated by `D/2` (which the math does not see, but every dot product then
/// sums in another order). Per element, the result further from the reference is
/// kept, so the naive error is the worse of two summation orders: a single
/// order's max error is one draw of a noisy statistic where it is rounding
/// noise of a few terms (rows with one visible key, large logits), and a
/// kernel's own draw must not fail the rule by luck.
fn naive_f32<V: Variant>(
    variant: &V,
    p: &Problem,
    [q, k, v, dout]: [&[f32]; 4],
    want_f: &Forward<f64>,
    want_g: &Gradients<f64>,
) -> (Forward<f32>, Gradients<f32>) {
    let d = p.head_dim;
    // Rotate the head dim by half: the second run sums from the middle. (A
    // reversal would not do: `dP − D` summed forwards/backwards is exactly
    // the negation of the same pair summed backwards/forwards.)
    let (there, back) = (d / 2, d - d / 2);
    let rotate = |x: &[f32], by: usize| -> Vec<f32> {
        x.chunks_exact(d)
            .flat_map(|row| row[by..].iter().chain(&row[..by]).copied())
            .collect()
    };
    let flip = |x: &[f32]| rotate(x, there);
    let unflip = |x: &[f32]| rotate(x, back);
    let f = reference_forward(variant, p, q, k, v);
    let g = reference_backward(variant, p, q, k, v, dout);
    let (qr, kr, vr, dr) = (flip(q), flip(k), flip(v), flip(dout));
    let fr = reference_forward(variant, p, &qr, &kr, &vr);
    let gr = reference_backward(variant, p, &qr, &kr, &vr, &dr);
    // Keep, per element, whichever is further from `want` (NaN counts as
    // furthest, so the checks still see it).
    let worse = |a: Vec<f32>, b: &[f32], want: &[f64]| -> Vec<f32> {
        a.into_iter()
            .zip(b)
            .zip(want)
            .map(|((a, &b), &w)| {
                let (ea, eb) = ((f64::from(a) - w).abs(), (f64::from(b) - w).abs());
                if b.is_nan() || eb > ea { b } else { a }
            })
            .collect()
    };
    (
        Forward {
            out: worse(f.out, &unflip(&fr.out), &want_f.out),
            lse: worse(f.lse, &fr.lse, &want_f.lse),
        },
        Gradients {
            dq: worse(g.dq, &unflip(&gr.dq), &want_g.dq),
            dk: worse(g.dk, &unflip(&gr.dk), &want_g.dk),
            dv: worse(g.dv, &unflip(&gr.dv), &want_g.dv),
        },
    )
}

/// Run the backend's ops and the autograd path; host copies of every result.
fn run_backend<R: TestBackend, V: Variant>(
    variant: &V,
    device: &<R::Runtime as Runtime>::Device,
    case: &Case,
    [q, k, v, dout]: [&[f32]; 4],
    opts: &AttentionOptions,
) -> Result<(Problem, BackendResults), String> {
    let host = |t: &Tensor<R::Runtime>| t.to_vec::<f32>();
    let upload = |name: &str, data: &[f32], shape: &[usize]| {
        Tensor::<R::Runtime>::from_slice(data, shape, device)
            .map_err(|e| format!("uploading {name}: {e}"))
    };
    let qt = upload("q", q, &case.q_shape())?;
    let kt = upload("k", k, &case.kv_shape())?;
    let vt = upload("v", v, &case.kv_shape())?;
    let dt = upload("dout", dout, &case.q_shape())?;
    let p = validate::problem(&qt, &kt, &vt, opts.scale).map_err(|e| format!("validation: {e}"))?;

    let (out, lse) =
        attention_fwd(variant, &qt, &kt, &vt, opts).map_err(|e| format!("attention_fwd: {e}"))?;
    let (dq, dk, dv) = attention_bwd(variant, &dt, &qt, &kt, &vt, &out, &lse, opts)
        .map_err(|e| format!("attention_bwd: {e}"))?;

    let client = <R::Runtime as Runtime>::default_client(device);
    let (qv, kv, vv) = (
        Var::new(qt.clone(), true),
        Var::new(kt.clone(), true),
        Var::new(vt.clone(), true),
    );
    let out_v =
        var_attention(variant, &qv, &kv, &vv, opts).map_err(|e| format!("var_attention: {e}"))?;
    let dout_v = Var::new(dt.clone(), false);
    let loss = var_mul(&out_v, &dout_v, &client)
        .and_then(|prod| var_sum(&prod, &[0, 1, 2, 3], false, &client))
        .map_err(|e| format!("building L = sum(out * dout): {e}"))?;
    let grads = backward(&loss, &client).map_err(|e| format!("autograd backward: {e}"))?;
    let grad = |name: &str, var: &Var<R::Runtime>| {
        grads
            .get(var.id())
            .map(host)
            .ok_or_else(|| format!("autograd backward produced no gradient for {name}"))
    };
    let var_grads = Gradients {
        dq: grad("q", &qv)?,
        dk: grad("k", &kv)?,
        dv: grad("v", &vv)?,
    };
    Ok((
        p,
        BackendResults {
            fwd: Forward {
                out: host(&out),
                lse: host(&lse),
            },
            grads: Gradients {
                dq: host(&dq),
                dk: host(&dk),
                dv: host(&dv),
            },
            var_out: host(out_v.tensor()),
            var_grads,
        },
    ))
}

/// Which index space a tensor lives in, for messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// `[B, Hq, Sq, D]`: q, out, dq.
    Query,
    /// `[B, Hkv, Sk, D]`: k, v, dk, dv.
    Key,
    /// `[B, Hq, Sq]`.
    Lse,
}

/// The position of element `index` of a `layout` tensor, in words.
pub(crate) fn locate(layout: Layout, p: &Problem, index: usize) -> String {
    match layout {
        Layout::Query => {
            let [b, h, i, d] = unravel(&[p.batch, p.heads_q, p.seq_q, p.head_dim], index)[..]
            else {
                unreachable!()
            };
            format!("[b={b}, h={h}, i={i} (q_pos {}), d={d}]", q_pos(p, i))
        }
        Layout::Key => {
            let [b, h, j, d] = unravel(&[p.batch, p.heads_kv, p.seq_k, p.head_dim], index)[..]
            else {
                unreachable!()
            };
            format!("[b={b}, h_kv={h}, j={j} (kv_pos {j}), d={d}]")
        }
        Layout::Lse => {
            let [b, h, i] = unravel(&[p.batch, p.heads_q, p.seq_q], index)[..] else {
                unreachable!()
            };
            format!("[b={b}, h={h}, i={i} (q_pos {})]", q_pos(p, i))
        }
    }
}

/// Outcome of comparing one tensor.
#[derive(Debug)]
pub(crate) struct Comparison {
    /// Max `|got − want|` over the finite reference entries.
    pub(crate) err: f64,
    /// The bound it was held to.
    pub(crate) bound: f64,
    /// Failure lines (empty when it passed).
    pub(crate) failures: Vec<String>,
}

/// Compare `got` with the f64 reference `want` under the tolerance rule with
/// `factor` on the naive error (`NAIVE_FACTOR` against the reference,
/// `PARITY_FACTOR` between backends), `naive` being the naive f32
/// implementation's result.
#[allow(clippy::too_many_arguments)]
pub(crate) fn compare(
    factor: f64,
    label: &str,
    layout: Layout,
    p: &Problem,
    got: &[f32],
    want: &[f64],
    naive: &[f32],
    magnitude: f64,
) -> Comparison {
    let mut failures = Vec::new();
    let at = |i: usize| locate(layout, p, i);
    if got.len() != want.len() || naive.len() != want.len() {
        failures.push(format!(
            "{label}: {} elements, the reference has {} (naive {})",
            got.len(),
            want.len(),
            naive.len()
        ));
        return Comparison {
            err: f64::INFINITY,
            bound: 0.0,
            failures,
        };
    }
    // Worst of: |got − want|, |naive − want|, and max |want|, over finite refs.
    let (mut err, mut err_at) = (0.0f64, None);
    let (mut naive_err, mut naive_at) = (0.0f64, None);
    let mut ref_max = 0.0f64;
    let (mut bad_got, mut bad_want, mut bad_naive) = (None, None, None);
    let mut bad_got_count = 0usize;
    for (i, ((&g, &w), &nv)) in got.iter().zip(want).zip(naive).enumerate() {
        let (g, nv) = (f64::from(g), f64::from(nv));
        if w.is_nan() {
            bad_want.get_or_insert(i);
            continue;
        }
        if w.is_infinite() {
            // Only lse = −inf is expected; it must be matched exactly.
            if g != w {
                bad_got_count += 1;
                bad_got.get_or_insert(i);
            }
            continue;
        }
        if !g.is_finite() {
            bad_got_count += 1;
            bad_got.get_or_insert(i);
            continue;
        }
        if !nv.is_finite() {
            bad_naive.get_or_insert(i);
            continue;
        }
        ref_max = ref_max.max(w.abs());
        if (g - w).abs() > err {
            (err, err_at) = ((g - w).abs(), Some(i));
        }
        if (nv - w).abs() > naive_err {
            (naive_err, naive_at) = ((nv - w).abs(), Some(i));
        }
    }
    if let Some(i) = bad_want {
        failures.push(format!(
            "{label}: the f64 reference is NaN at {} (the variant's f64 closures produce NaN)",
            at(i)
        ));
    }
    if let Some(i) = bad_got {
        failures.push(format!(
            "{label}: {bad_got_count} non-finite or mismatched-infinite values, first at {}: \
             got {}, want {:e}",
            at(i),
            got[i],
            want[i]
        ));
    }
    let m = magnitude.max(ref_max);
    let sanity = NAIVE_SANITY * (1.0 + m);
    if let Some(i) = bad_naive {
        failures.push(format!(
            "{label}: the naive f32 implementation is not finite at {} (got {}, want {:e}): \
             the variant's f32 closures overflow or produce NaN where its f64 closures do not",
            at(i),
            naive[i],
            want[i]
        ));
    }
    if naive_err > sanity {
        let i = naive_at.unwrap_or(0);
        failures.push(format!(
            "{label}: the naive f32 implementation differs from the f64 reference by \
             {naive_err:.3e} > {sanity:.3e} at {} (naive {}, want {:e}): the variant's f32 \
             closures (score, score_grad, mask) disagree with its f64 closures",
            at(i),
            naive[i],
            want[i]
        ));
    }
    let bound = factor * naive_err.min(sanity) + SLACK * (1.0 + ref_max) + CANCEL * m;
    if err > bound {
        let i = err_at.unwrap_or(0);
        let n = naive_at.unwrap_or(0);
        failures.push(format!(
            "{label}: max |got − want| = {err:.3e} > bound {bound:.3e} \
             (= {factor}·naive err {naive_err:.3e} + {SLACK:e}·(1 + max|want| {ref_max:.3e}) \
             + ε·M, M = {m:.3e}); \
             worst at {}: got {:e}, want {:e}, naive f32 {:e} (naive err there {:.3e}); \
             naive's worst at {}",
            at(i),
            got[i],
            want[i],
            naive[i],
            (f64::from(naive[i]) - want[i]).abs(),
            at(n)
        ));
    }
    Comparison {
        err,
        bound,
        failures,
    }
}

/// Rows with no visible key must give exactly 0 in `out` and `dq`; keys that
/// no query sees (under `mask_f64`) exactly 0 in `dk` and `dv`.
fn exact_zeros<V: Variant>(
    variant: &V,
    p: &Problem,
    want_lse: &[f64],
    rows: [(&str, &Vec<f32>); 4],
    keys: [(&str, &Vec<f32>); 4],
    failures: &mut Vec<String>,
) {
    let d = p.head_dim;
    for (label, t) in rows {
        let bad = want_lse
            .iter()
            .enumerate()
            .filter(|&(_, &l)| l == f64::NEG_INFINITY)
            .flat_map(|(r, _)| r * d..(r + 1) * d)
            .find(|&e| t.get(e).is_none_or(|&x| x != 0.0));
        if let Some(e) = bad {
            failures.push(format!(
                "{label}: a row with no visible key must be exactly 0, got {:?} at {}",
                t.get(e),
                locate(Layout::Query, p, e)
            ));
        }
    }
    // seen[(b·Hkv + hk)·Sk + j]: some query of the group sees key j.
    let mut seen = vec![false; p.batch * p.heads_kv * p.seq_k];
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            let hk = h / p.group();
            for i in 0..p.seq_q {
                for j in 0..p.seq_k {
                    let s = &mut seen[(b * p.heads_kv + hk) * p.seq_k + j];
                    if !*s && variant.mask_f64(b as i32, h as i32, q_pos(p, i), j as i32) {
                        *s = true;
                    }
                }
            }
        }
    }
    for (label, t) in keys {
        let bad = seen
            .iter()
            .enumerate()
            .filter(|&(_, &s)| !s)
            .flat_map(|(r, _)| r * d..(r + 1) * d)
            .find(|&e| t.get(e).is_none_or(|&x| x != 0.0));
        if let Some(e) = bad {
            failures.push(format!(
                "{label}: a key no query sees must have exactly 0 gradient, got {:?} at {}",
                t.get(e),
                locate(Layout::Key, p, e)
            ));
        }
    }
}

/// Tilings on which `classify_tile` is checked: (query rows, keys) per tile.
const TILINGS: &[(usize, usize)] = &[(16, 16), (7, 13), (64, 32), (usize::MAX, usize::MAX)];

/// The variant's own contract, on the positions of problem `p`.
pub(crate) fn contract<V: Variant>(variant: &V, p: &Problem, failures: &mut Vec<String>) {
    let name = V::NAME;
    let (sq, sk) = (p.seq_q, p.seq_k);
    // Each kind of breach is reported once (its first instance).
    let (mut mask_reported, mut unmasked_reported, mut tile_reported) = (false, false, false);
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            let (bi, hi) = (b as i32, h as i32);
            // vis[i·Sk + j] under the f32 mask, the one kernels evaluate.
            let mut vis = vec![false; sq * sk];
            let mut mismatch: Option<(i32, i32, bool, bool)> = None;
            let mut unmasked_hidden = None;
            for i in 0..sq {
                let qi = q_pos(p, i);
                for j in 0..sk {
                    let ji = j as i32;
                    let (m32, m64) = (
                        variant.mask(bi, hi, qi, ji),
                        variant.mask_f64(bi, hi, qi, ji),
                    );
                    vis[i * sk + j] = m32;
                    if m32 != m64 && mismatch.is_none() {
                        mismatch = Some((qi, ji, m32, m64));
                    }
                    if !(V::HAS_MASK || m32 && m64) && unmasked_hidden.is_none() {
                        unmasked_hidden = Some((qi, ji));
                    }
                }
            }
            if let Some((qi, ji, m32, m64)) = mismatch.filter(|_| !mask_reported) {
                mask_reported = true;
                failures.push(format!(
                    "variant `{name}`: mask({b}, {h}, q={qi}, kv={ji}) = {m32} but mask_f64 = {m64}"
                ));
            }
            if let Some((qi, ji)) = unmasked_hidden.filter(|_| !unmasked_reported) {
                unmasked_reported = true;
                failures.push(format!(
                    "variant `{name}`: HAS_MASK is false but the mask hides (b={b}, h={h}, \
                     q={qi}, kv={ji})"
                ));
            }
            if tile_reported {
                continue;
            }
            'tilings: for &(ti, tj) in TILINGS {
                for i0 in (0..sq).step_by(ti.min(sq)) {
                    let i1 = i0.saturating_add(ti).min(sq);
                    for j0 in (0..sk).step_by(tj.min(sk)) {
                        let j1 = j0.saturating_add(tj).min(sk);
                        let (q_lo, q_hi) = (q_pos(p, i0), q_pos(p, i1 - 1));
                        let (kv_lo, kv_hi) = (j0 as i32, (j1 - 1) as i32);
                        let class = variant.classify_tile(bi, hi, q_lo, q_hi, kv_lo, kv_hi);
                        let want_vis = match class {
                            TileClass::Partial => continue,
                            TileClass::Empty => false,
                            TileClass::Full => true,
                        };
                        let wrong = (i0..i1).find_map(|i| {
                            (j0..j1)
                                .find(|&j| vis[i * sk + j] != want_vis)
                                .map(|j| (i, j))
                        });
                        if let Some((i, j)) = wrong {
                            failures.push(format!(
                                "variant `{name}`: classify_tile(b={b}, h={h}, q {q_lo}..={q_hi}, \
                                 kv {kv_lo}..={kv_hi}) = {class:?}, but mask(q={}, kv={j}) = {}",
                                q_pos(p, i),
                                !want_vis
                            ));
                            tile_reported = true;
                            break 'tilings;
                        }
                    }
                }
            }
        }
    }
    if V::SCORE_IS_IDENTITY {
        for s in [-1.0e4f32, -3.5, -1.0, -0.0, 0.0, 0.25, 1.0, 7.5, 1.0e4] {
            let (qi, kv) = (q_pos(p, p.seq_q - 1), (p.seq_k - 1) as i32);
            let got = (
                variant.score(s, 0, 0, qi, kv),
                variant.score_grad(s, 0, 0, qi, kv),
                variant.score_f64(f64::from(s), 0, 0, qi, kv),
                variant.score_grad_f64(f64::from(s), 0, 0, qi, kv),
            );
            if got != (s, 1.0, f64::from(s), 1.0) {
                failures.push(format!(
                    "variant `{name}`: SCORE_IS_IDENTITY is true but at s = {s} \
                     (score, score_grad, score_f64, score_grad_f64) = {got:?}"
                ));
                break;
            }
        }
    }
}
