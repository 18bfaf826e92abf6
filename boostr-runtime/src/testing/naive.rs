//! The naive f32 implementation, the yardstick of the tolerance rule.

use super::reference::{Forward, Gradients, reference_backward_lse, reference_forward};
use crate::problem::Problem;
use crate::variant::HostVariant;

/// The naive f32 implementation ([`reference_forward`] / [`reference_backward`]
/// in f32), run twice: on the inputs, and on the inputs with the head dim
/// rotated by `D/2` (which the math does not see, but every dot product then
/// sums in another order). Per element, the result further from the reference is
/// kept, so the naive error is the worse of two summation orders: a single
/// order's max error is one draw of a noisy statistic where it is rounding
/// noise of a few terms (rows with one visible key, large logits), and a
/// kernel's own draw must not fail the rule by luck.
pub(crate) fn naive_f32<V: HostVariant>(
    variant: &V,
    p: &Problem,
    [q, k, v, dout]: [&[f32]; 4],
    dlse: &[f32],
    want_f: &Forward<f64>,
    want_g: &Gradients<f64>,
) -> (Forward<f32>, Gradients<f32>) {
    // Rotate the head dims by half: the second run sums from the middle. (A
    // reversal would not do: `dP − D` summed forwards/backwards is exactly
    // the negation of the same pair summed backwards/forwards.)
    let rotate = |x: &[f32], d: usize, by: usize| -> Vec<f32> {
        x.chunks_exact(d)
            .flat_map(|row| row[by..].iter().chain(&row[..by]).copied())
            .collect()
    };
    // Rows of `D` (q, k, dq, dk) or of `Dv` (v, dout, out, dv).
    let (d, d_v) = (p.head_dim, p.head_dim_v);
    let flip = |x: &[f32], d: usize| rotate(x, d, d / 2);
    let unflip = |x: &[f32], d: usize| rotate(x, d, d - d / 2);
    let f = reference_forward(variant, p, q, k, v);
    let g = reference_backward_lse(variant, p, [q, k, v], (dout, dlse));
    let (qr, kr, vr, dr) = (flip(q, d), flip(k, d), flip(v, d_v), flip(dout, d_v));
    let fr = reference_forward(variant, p, &qr, &kr, &vr);
    let gr = reference_backward_lse(variant, p, [&qr, &kr, &vr], (&dr, dlse));
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
            out: worse(f.out, &unflip(&fr.out, d_v), &want_f.out),
            lse: worse(f.lse, &fr.lse, &want_f.lse),
            max_scores: worse(f.max_scores, &fr.max_scores, &want_f.max_scores),
        },
        Gradients {
            dq: worse(g.dq, &unflip(&gr.dq, d), &want_g.dq),
            dk: worse(g.dk, &unflip(&gr.dk, d), &want_g.dk),
            dv: worse(g.dv, &unflip(&gr.dv, d_v), &want_g.dv),
            tensors: g
                .tensors
                .into_iter()
                .zip(&gr.tensors)
                .zip(&want_g.tensors)
                .map(|((a, b), w)| worse(a, b, w))
                .collect(),
        },
    )
}
