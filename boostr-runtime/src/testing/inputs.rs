//! What a case runs on and is held to: its random inputs, and the f64
//! reference, the naive f32 implementation and the magnitudes of the summed
//! terms computed from them.

use super::cases::{Case, Logits};
use super::exact_zeros::seen_keys;
use super::naive::naive_f32;
use super::reference::{
    Forward, Gradients, reference_backward_lse, reference_forward, reference_magnitudes,
};
use super::rng::Rng;
use super::tolerance::recomputed_scores;
use crate::options::AttentionOptions;
use crate::problem::Problem;
use crate::variant::HostVariant;

/// `q` and `k` of `case`, as its [`Logits`] says.
fn draw_qk(case: &Case, rng: &mut Rng) -> (Vec<f32>, Vec<f32>) {
    let (q_len, kv_len) = (case.problem().q_len(), case.problem().k_len());
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

pub(crate) fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// The random inputs of case number `stream` of a run with `seed`.
pub(crate) struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
    /// `d loss / d lse`, read with `dout` by the backward.
    pub(crate) dlse: Vec<f32>,
    pub(crate) opts: AttentionOptions,
}

impl Inputs {
    pub(crate) fn draw(case: &Case, seed: u64, stream: u64) -> Inputs {
        let mut rng = Rng::new(seed, stream);
        let (q, k) = draw_qk(case, &mut rng);
        let v = rng.normal_f32(case.problem().v_len(), 1.0);
        let dout = rng.normal_f32(case.problem().out_len(), 1.0);
        let dlse = rng.normal_f32(case.problem().lse_len(), 1.0);
        // A fresh draw of dropout pairs per case (ignored without dropout),
        // and every other case asks for the rows' largest scores.
        let opts = AttentionOptions {
            scale: case.scale,
            dropout_seed: rng.next_u64(),
            dropout_offset: stream as u32,
            max_scores: stream.is_multiple_of(2),
        };
        Inputs {
            q,
            k,
            v,
            dout,
            dlse,
            opts,
        }
    }

    /// `q, k, v, dout`, to change in place.
    pub(crate) fn slices_mut(&mut self) -> [&mut [f32]; 4] {
        [&mut self.q, &mut self.k, &mut self.v, &mut self.dout]
    }

    pub(crate) fn slices(&self) -> [&[f32]; 4] {
        [&self.q, &self.k, &self.v, &self.dout]
    }

    /// Fill the K and V rows of every key that no query sees with NaN, +inf
    /// and -inf in turn: a hidden key must not affect any result, whatever
    /// its rows hold (a KV cache's unwritten slots, garbage padding).
    /// Returns how many keys were poisoned.
    pub(crate) fn poison_hidden_keys<V: HostVariant>(&mut self, variant: &V, p: &Problem) -> usize {
        if !V::HAS_MASK {
            return 0;
        }
        let poison = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
        let mut n = 0;
        for (key, _) in seen_keys(variant, p)
            .iter()
            .enumerate()
            .filter(|(_, s)| !**s)
        {
            for (t, d) in [(&mut self.k, p.head_dim), (&mut self.v, p.head_dim_v)] {
                for (x, &bad) in t[key * d..(key + 1) * d]
                    .iter_mut()
                    .zip(poison.iter().cycle())
                {
                    *x = bad;
                }
            }
            n += 1;
        }
        n
    }
}

/// What a case is compared against: the f64 reference (or another backend's
/// results, widened), the naive f32 implementation, and the magnitudes of
/// the summed terms (see [`reference_magnitudes`]).
pub(crate) struct Expected {
    pub(crate) fwd: Forward<f64>,
    pub(crate) grads: Gradients<f64>,
    pub(crate) naive_fwd: Forward<f32>,
    pub(crate) naive_grads: Gradients<f32>,
    /// `M` of out, dq, dk, dv.
    pub(crate) magnitudes: [f64; 4],
    /// `M` of each learnable tensor's gradient.
    pub(crate) tensor_magnitudes: Vec<f64>,
    /// Each learnable tensor's field name.
    pub(crate) tensor_names: Vec<&'static str>,
    /// The relative error of the backward's recomputed `P` (see
    /// [`recomputed_scores`]).
    pub(crate) recomputed: f64,
}

/// The field names of `V`'s learnable tensors, in slot order.
pub(crate) fn learnable_names<V: crate::Variant>() -> Vec<&'static str> {
    V::LEARNABLE.iter().map(|&t| V::TENSORS[t].name).collect()
}

impl Expected {
    pub(crate) fn reference<V: HostVariant>(
        variant: &V,
        p: &Problem,
        inputs: &Inputs,
        tensor_names: Vec<&'static str>,
    ) -> Expected {
        let [q, k, v, dout] = inputs.slices();
        let (q64, k64, v64, dout64) = (widen(q), widen(k), widen(v), widen(dout));
        let fwd = reference_forward(variant, p, &q64, &k64, &v64);
        let dlse64 = widen(&inputs.dlse);
        let grads = reference_backward_lse(variant, p, [&q64, &k64, &v64], (&dout64, &dlse64));
        let (naive_fwd, naive_grads) =
            naive_f32(variant, p, inputs.slices(), &inputs.dlse, &fwd, &grads);
        let (mag_out, mag_g) =
            reference_magnitudes(variant, p, [&q64, &k64, &v64, &dout64], Some(&dlse64));
        let max_abs = |x: &[f64]| x.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let recomputed = recomputed_scores(p, &fwd.max_scores);
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
            tensor_magnitudes: mag_g.tensors.iter().map(|t| max_abs(t)).collect(),
            tensor_names,
            recomputed,
        }
    }
}
