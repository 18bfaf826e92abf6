//! Up-front validation of attention inputs: every rule is checked before any
//! kernel runs, and a broken rule is an [`Error`] naming it and the values.

use crate::error::{Error, Result};
use crate::problem::Problem;
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// Positions, batch and head indices are `i32` in every kernel (CUDA and WGSL
/// index with 32 bits), and the tile classifiers rely on them staying below
/// 2^30 in magnitude so that sums and differences of two never overflow.
const MAX_INDEX: usize = (1 << 30) - 1;

fn dims4<R: Runtime<DType = DType>>(name: &'static str, t: &Tensor<R>) -> Result<[usize; 4]> {
    let shape = t.shape();
    let dims: [usize; 4] = shape.try_into().map_err(|_| Error::Rank {
        name,
        shape: shape.to_vec(),
    })?;
    if dims.contains(&0) {
        return Err(Error::ZeroSize {
            name,
            shape: shape.to_vec(),
        });
    }
    Ok(dims)
}

/// Check a tensor's dtype against what the backend supports.
pub(crate) fn check_dtype<R: Runtime<DType = DType>>(
    name: &'static str,
    t: &Tensor<R>,
    backend: &'static str,
    supported: &[DType],
    supported_text: &'static str,
) -> Result<()> {
    if supported.contains(&t.dtype()) {
        Ok(())
    } else {
        Err(Error::DType {
            name,
            dtype: t.dtype(),
            backend,
            supported: supported_text,
        })
    }
}

/// Validate `q, k, v` and derive the [`Problem`].
pub fn problem<R: Runtime<DType = DType>>(
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
    scale: Option<f32>,
) -> Result<Problem> {
    let [bq, hq, sq, dq] = dims4("q", q)?;
    let [bk, hk, sk, dk] = dims4("k", k)?;
    let [bv, hv, sv, dv] = dims4("v", v)?;
    let shapes = |rule| Error::Shapes {
        rule,
        q: q.shape().to_vec(),
        k: k.shape().to_vec(),
        v: v.shape().to_vec(),
    };
    if bq != bk || bq != bv {
        return Err(shapes("q, k and v must have the same batch size (dim 0)"));
    }
    if hk != hv {
        return Err(shapes("k and v must have the same number of heads (dim 1)"));
    }
    if sk != sv {
        return Err(shapes("k and v must have the same sequence length (dim 2)"));
    }
    if dq != dk || dq != dv {
        return Err(shapes("q, k and v must have the same head dim (dim 3)"));
    }
    if hq % hk != 0 {
        return Err(Error::Heads {
            heads_q: hq,
            heads_kv: hk,
        });
    }
    for (name, value) in [("batch", bq), ("Hq", hq), ("Sq", sq), ("Sk", sk)] {
        if value > MAX_INDEX {
            return Err(Error::TooLarge {
                name,
                value,
                max: MAX_INDEX,
            });
        }
    }
    let scale = scale.unwrap_or(1.0 / (dq as f32).sqrt());
    if !scale.is_finite() {
        return Err(Error::Scale(scale));
    }
    Ok(Problem {
        batch: bq,
        heads_q: hq,
        heads_kv: hk,
        seq_q: sq,
        seq_k: sk,
        head_dim: dq,
        scale,
    })
}

/// Check that `t` has exactly `expected` as its shape.
pub fn shape_of<R: Runtime<DType = DType>>(
    name: &'static str,
    t: &Tensor<R>,
    expected: &[usize],
) -> Result<()> {
    if t.shape() == expected {
        Ok(())
    } else {
        Err(Error::ShapeOf {
            name,
            expected: expected.to_vec(),
            got: t.shape().to_vec(),
        })
    }
}
