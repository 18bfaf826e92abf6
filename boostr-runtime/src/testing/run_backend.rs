//! Running a backend's kernels: the tensor ops and the autograd path, with
//! host copies of every result.

use super::backends::TestBackend;
use super::cases::Case;
use super::reference::{Forward, Gradients};
use crate::op::{AttentionOptions, attention_bwd, attention_fwd, var_attention};
use crate::problem::Problem;
use crate::validate;
use crate::variant::Variant;
use numr::autograd::{Var, backward, var_mul, var_sum};
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// Results of the backend, host side.
pub(crate) struct BackendResults {
    /// `attention_fwd`'s `out` and `lse`.
    pub(crate) fwd: Forward<f32>,
    /// `attention_bwd`'s gradients.
    pub(crate) grads: Gradients<f32>,
    /// `var_attention`'s `out`.
    pub(crate) var_out: Vec<f32>,
    /// The gradients autograd's backward produced through the `GradFn`.
    pub(crate) var_grads: Gradients<f32>,
}

/// Run the backend's ops and the autograd path; host copies of every result.
pub(crate) fn run_backend<R: TestBackend, V: Variant>(
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
