//! Attention over disjoint key sets, merged: FlashInfer's `merge_state`.
//!
//! A softmax row over keys `A ∪ B` is the rows over `A` and over `B`
//! weighted by their shares of the total: with `m = max(lse_A, lse_B)`,
//! `lse = m + ln(e^(lse_A − m) + e^(lse_B − m))` and `out =
//! e^(lse_A − lse)·out_A + e^(lse_B − lse)·out_B`. So a shared prompt
//! prefix can be attended once for every sequence that shares it and each
//! suffix on its own, a cache split across devices or tiers attended part by
//! part, and the parts merged.

use crate::backend::AttentionRuntime;
use crate::error::{Error, Result};
use crate::op::Output;
use crate::ring::{RingOps, merge_rows};
use crate::variant::Weights;
use numr::dtype::DType;
use numr::tensor::Tensor;

/// The attention of the same queries over the union of disjoint key sets,
/// from each set's result `(out, lse)` as [`attention`](crate::attention())
/// returns them: `out [B, Hq, Sq, Dv]` (f32, f16 or bf16) and `lse [B, Hq,
/// Sq]` (f32). Returns `out` in the first part's dtype and `lse` in f32; a
/// row that no part's keys reach keeps `out = 0`, `lse = −inf`.
///
/// The parts must be softmax attention with the same scale; a variant's
/// sink belongs to one part only (each part that carries it counts it
/// again). `max_scores` is not merged (`None`); take the elementwise
/// maximum of the parts' if asked for.
///
/// ```
/// # fn main() -> boostr_runtime::Result<()> {
/// use boostr_runtime::{AttentionOptions, Keys, attention, merge_states, stock::Full};
/// use numr::runtime::cpu::{CpuDevice, CpuRuntime};
/// use numr::tensor::Tensor;
///
/// let device = CpuDevice::new();
/// let x = |n: usize, seed: f32| {
///     let data: Vec<f32> = (0..n * 16).map(|i| (i as f32 * seed).sin()).collect();
///     Tensor::<CpuRuntime>::from_slice(&data, &[1, 1, n, 16], &device)
/// };
/// let (q, k, v) = (x(4, 0.37)?, x(10, 0.41)?, x(10, 0.43)?);
/// let opts = AttentionOptions::default();
/// // Keys 0..6 and 6..10 on their own, then merged.
/// let part = |from: usize, n: usize| -> boostr_runtime::Result<_> {
///     let (k, v) = (k.narrow(2, from, n)?.contiguous()?, v.narrow(2, from, n)?.contiguous()?);
///     attention(&Full, &q, Keys::dense(&k, &v), &opts)
/// };
/// let (a, b) = (part(0, 6)?, part(6, 4)?);
/// let merged = merge_states(&[(&a.out, &a.lse), (&b.out, &b.lse)])?;
/// let whole = attention(&Full, &q, Keys::dense(&k, &v), &opts)?;
/// let (m, w) = (merged.out.to_vec::<f32>(), whole.out.to_vec::<f32>());
/// assert!(m.iter().zip(&w).all(|(m, w)| (m - w).abs() < 1e-5));
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// No parts ([`Error::ZeroSize`]); an `out` not of rank 4 or an `lse` not
/// of rank 3 ([`Error::Rank`]); an `lse` whose shape is not `out`'s first
/// three dimensions, or a part whose shapes differ from the first's
/// ([`Error::ShapeOf`]); an `lse` not in f32 or an `out` not in a float
/// dtype ([`Error::DType`]).
pub fn merge_states<R: AttentionRuntime>(parts: &[(&Tensor<R>, &Tensor<R>)]) -> Result<Output<R>>
where
    R::Client: RingOps<R>,
{
    let Some(((out0, lse0), rest)) = parts.split_first() else {
        return Err(Error::ZeroSize {
            name: "parts",
            shape: vec![0],
        });
    };
    let shape = out0.shape().to_vec();
    for (i, (out, lse)) in parts.iter().enumerate() {
        check(i, out, lse, &shape)?;
    }
    let mut acc = (out0.to_dtype(DType::F32)?, lse0.contiguous()?);
    for (out, lse) in rest {
        acc = merge_rows(
            Weights::SOFTMAX,
            acc,
            &out.contiguous()?,
            &lse.contiguous()?,
        )?;
    }
    let (out, lse) = acc;
    Ok(Output {
        out: out.to_dtype(out0.dtype())?,
        lse,
        max_scores: None,
    })
}

/// Part `i`: `out` of rank 4 in a float dtype, shaped as the first part's
/// (`shape`), and `lse` in f32 shaped as its first three dimensions.
fn check<R: AttentionRuntime>(
    i: usize,
    out: &Tensor<R>,
    lse: &Tensor<R>,
    shape: &[usize],
) -> Result<()> {
    const OUT: [&str; 2] = ["out of part 0", "out of a later part"];
    const LSE: [&str; 2] = ["lse of part 0", "lse of a later part"];
    let which = usize::from(i > 0);
    if out.shape().len() != 4 {
        return Err(Error::Rank {
            name: OUT[which],
            rank: 4,
            layout: "[B, Hq, Sq, Dv]",
            shape: out.shape().to_vec(),
        });
    }
    if lse.shape().len() != 3 {
        return Err(Error::Rank {
            name: LSE[which],
            rank: 3,
            layout: "[B, Hq, Sq]",
            shape: lse.shape().to_vec(),
        });
    }
    if out.shape() != shape {
        return Err(Error::ShapeOf {
            name: OUT[which],
            expected: shape.to_vec(),
            got: out.shape().to_vec(),
        });
    }
    if lse.shape() != &shape[..3] {
        return Err(Error::ShapeOf {
            name: LSE[which],
            expected: shape[..3].to_vec(),
            got: lse.shape().to_vec(),
        });
    }
    if lse.dtype() != DType::F32 {
        return Err(Error::DType {
            name: LSE[which],
            dtype: lse.dtype(),
            backend: R::name(),
            supported: "f32 (as attention returns it)",
        });
    }
    if !matches!(out.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(Error::DType {
            name: OUT[which],
            dtype: out.dtype(),
            backend: R::name(),
            supported: "f32, f16 and bf16",
        });
    }
    Ok(())
}

/// The checks of [`merge_states`] on one runtime (the CPU's below; wgpu's in
/// its tests).
#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::keys::Keys;
    use crate::op::attention;
    use crate::options::AttentionOptions;
    use crate::stock::Full;
    use crate::testing::{Rng, SEED_ENV, choose_seed};
    use numr::runtime::cpu::{CpuDevice, CpuRuntime};

    fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let ok = if w.is_finite() {
                (g - w).abs() <= tol * (1.0 + w.abs())
            } else {
                g == w
            };
            assert!(ok, "{what}[{i}]: got {g}, want {w}");
        }
    }

    /// Attention over three disjoint key ranges (one of them a single
    /// key), merged, equals one call over all the keys (GQA, batch 2); an
    /// empty part (`out = 0`, `lse = −inf`) changes nothing; f16 parts give
    /// f16 (where the runtime holds f16: `half`); bad parts are errors
    /// naming them.
    pub(crate) fn merges_like_one_call_on<R: AttentionRuntime>(device: &R::Device, half: bool)
    where
        R::Client: RingOps<R>,
    {
        let seed = choose_seed();
        let mut rng = Rng::new(seed, 0);
        let context = format!("seed {seed} (rerun with {SEED_ENV}={seed})");
        let (b, hq, hkv, sq, sk, d) = (2, 4, 2, 9, 23, 16);
        let mut tensor = |shape: &[usize]| {
            let n = shape.iter().product();
            Tensor::<R>::from_slice(&rng.normal_f32(n, 1.0), shape, device).unwrap()
        };
        let (q, k, v) = (
            tensor(&[b, hq, sq, d]),
            tensor(&[b, hkv, sk, d]),
            tensor(&[b, hkv, sk, d]),
        );
        let opts = AttentionOptions::default();
        let part = |from: usize, n: usize| {
            let k = k.narrow(2, from, n).unwrap().contiguous().unwrap();
            let v = v.narrow(2, from, n).unwrap().contiguous().unwrap();
            attention(&Full, &q, Keys::dense(&k, &v), &opts).unwrap()
        };
        let whole = attention(&Full, &q, Keys::dense(&k, &v), &opts).unwrap();
        let parts = [part(0, 7), part(7, 1), part(8, 15)];
        let refs: Vec<_> = parts.iter().map(|p| (&p.out, &p.lse)).collect();
        let merged = merge_states(&refs).unwrap();
        let (want_out, want_lse) = (whole.out.to_vec::<f32>(), whole.lse.to_vec::<f32>());
        close(
            &format!("out, {context}"),
            &merged.out.to_vec(),
            &want_out,
            1e-5,
        );
        close(
            &format!("lse, {context}"),
            &merged.lse.to_vec(),
            &want_lse,
            1e-5,
        );
        assert!(merged.max_scores.is_none());

        // An empty part, first or last, changes nothing; two merge to empty.
        let zeros = Tensor::<R>::zeros(&[b, hq, sq, d], DType::F32, device).unwrap();
        let none = vec![f32::NEG_INFINITY; b * hq * sq];
        let none = Tensor::<R>::from_slice(&none, &[b, hq, sq], device).unwrap();
        let a = &parts[0];
        for pair in [
            [(&a.out, &a.lse), (&zeros, &none)],
            [(&zeros, &none), (&a.out, &a.lse)],
        ] {
            let m = merge_states(&pair).unwrap();
            close(
                "out with an empty part",
                &m.out.to_vec(),
                &a.out.to_vec(),
                0.0,
            );
            close(
                "lse with an empty part",
                &m.lse.to_vec(),
                &a.lse.to_vec(),
                0.0,
            );
        }
        let m = merge_states(&[(&zeros, &none), (&zeros, &none)]).unwrap();
        assert!(m.out.to_vec::<f32>().iter().all(|&x| x == 0.0));
        assert!(
            m.lse
                .to_vec::<f32>()
                .iter()
                .all(|&x| x == f32::NEG_INFINITY)
        );

        // Bad parts.
        assert!(matches!(
            merge_states::<R>(&[]),
            Err(Error::ZeroSize { name: "parts", .. })
        ));
        let short = parts[2].out.narrow(2, 0, 5).unwrap().contiguous().unwrap();
        let err = merge_states(&[(&a.out, &a.lse), (&short, &a.lse)]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::ShapeOf {
                    name: "out of a later part",
                    ..
                }
            ),
            "{err}"
        );
        let err = merge_states(&[(&a.out, &a.out)]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Rank {
                    name: "lse of part 0",
                    rank: 3,
                    ..
                }
            ),
            "{err}"
        );
        if !half {
            return;
        }
        // f16 parts: an f16 result, within f16's rounding.
        let halves: Vec<Tensor<R>> = parts
            .iter()
            .map(|p| p.out.to_dtype(DType::F16).unwrap())
            .collect();
        let refs: Vec<_> = halves
            .iter()
            .zip(&parts)
            .map(|(o, p)| (o, &p.lse))
            .collect();
        let m = merge_states(&refs).unwrap();
        assert_eq!(m.out.dtype(), DType::F16);
        let got: Vec<f32> = m.out.to_dtype(DType::F32).unwrap().to_vec();
        close("f16 out", &got, &want_out, 2e-3);
        let lse16 = a.lse.to_dtype(DType::F16).unwrap();
        let err = merge_states(&[(&a.out, &lse16)]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::DType {
                    name: "lse of part 0",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn merges_like_one_call() {
        merges_like_one_call_on::<CpuRuntime>(&CpuDevice::new(), true);
    }
}
