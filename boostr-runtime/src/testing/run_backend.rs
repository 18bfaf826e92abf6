//! Running a backend's kernels: the tensor ops and the autograd path, with
//! host copies of every result.

use super::backends::TestBackend;
use super::cases::Case;
use super::inputs::Inputs;
use super::reference::{Forward, Gradients};
use crate::error::Error;
use crate::keys::Keys;
use crate::op::{Backward, Output, attention, attention_backward, var_attention};
use crate::options::AttentionOptions;
use crate::problem::Problem;
use crate::validate;
use crate::variant::Variant;
use numr::autograd::{Var, backward, var_add, var_mul, var_sum};
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// Results of the backend, host side.
pub(crate) struct BackendResults {
    /// `attention`'s `out` and `lse`.
    pub(crate) fwd: Forward<f32>,
    /// `attention_backward`'s gradients.
    pub(crate) grads: Gradients<f32>,
    /// `var_attention`'s `out`.
    pub(crate) var_out: Vec<f32>,
    /// The gradients autograd's backward produced through the `GradFn`.
    pub(crate) var_grads: Gradients<f32>,
}

/// Run the backend's ops and the autograd path, each backward of a loss
/// that reads `out` and `lse` (`dout` and `dlse`); host copies of every
/// result.
pub(crate) fn run_backend<R: TestBackend, V: Variant>(
    variant: &V,
    device: &<R::Runtime as Runtime>::Device,
    case: &Case,
    inputs: &Inputs,
) -> Result<(Problem, BackendResults), String> {
    let ([q, k, v, dout], opts) = (inputs.slices(), &inputs.opts);
    let host = |t: &Tensor<R::Runtime>| t.to_vec::<f32>();
    let upload = |name: &str, data: &[f32], shape: &[usize]| {
        Tensor::<R::Runtime>::from_slice(data, shape, device)
            .map_err(|e| format!("uploading {name}: {e}"))
    };
    let shapes = case.problem();
    let qt = upload("q", q, &shapes.q_shape())?;
    let kt = upload("k", k, &shapes.k_shape())?;
    let vt = upload("v", v, &shapes.v_shape())?;
    let dt = upload("dout", dout, &shapes.out_shape())?;
    let dlse = upload("dlse", &inputs.dlse, &shapes.lse_shape())?;
    let p = validate::problem(&qt, &kt, &vt, opts.scale)
        .and_then(|p| validate::call(variant, p, opts))
        .map_err(|e| format!("validation: {e}"))?;

    let keys = Keys::dense(&kt, &vt);
    let y = attention(variant, &qt, keys, opts).map_err(|e| format!("attention: {e}"))?;
    let grads = Backward::new(&y, &dt).with_dlse(&dlse);
    let g = attention_backward(variant, &qt, keys, grads, opts)
        .map_err(|e| format!("attention_backward: {e}"))?;
    let mut tensors = Vec::new();
    if !V::LEARNABLE.is_empty() {
        for (slot, t) in g.tensors.iter().enumerate() {
            let t = t
                .as_ref()
                .ok_or_else(|| format!("attention_backward: no gradient for slot {slot}"))?;
            tensors.push(host(t));
        }
        // Deterministic: the same call again gives the same bits (the GPU
        // backends add in whatever order their threads run).
        let again = attention_backward(variant, &qt, keys, grads, opts)
            .map_err(|e| format!("attention_backward, again: {e}"))?;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        for (slot, (first, t)) in tensors.iter().zip(&again.tensors).enumerate() {
            let t = t
                .as_ref()
                .ok_or_else(|| format!("attention_backward, again: no gradient for slot {slot}"))?;
            if bits(first) != bits(&host(t)) {
                return Err(format!(
                    "attention_backward: two identical calls gave different bits for the \
                     gradient of learnable slot {slot}"
                ));
            }
        }
    }

    let a = through_autograd::<R, V>(variant, &qt, keys, &y, (&dt, &dlse), opts)?;
    Ok((
        p,
        BackendResults {
            fwd: Forward {
                out: host(&y.out),
                lse: host(&y.lse),
                max_scores: a.max_scores,
            },
            grads: Gradients {
                dq: host(&g.dq),
                dk: host(&g.dk),
                dv: host(&g.dv),
                tensors,
            },
            var_out: a.out,
            var_grads: a.grads,
        },
    ))
}

/// What [`through_autograd`] gives, host side, in the layout of the call.
pub(crate) struct Autograd {
    /// `attention`'s rows' largest scores (empty where not asked for),
    /// the same bits as `var_attention`'s.
    pub(crate) max_scores: Vec<f32>,
    /// `var_attention`'s `out`.
    pub(crate) out: Vec<f32>,
    /// The gradients numr's `backward` gives `q`, `k`, `v` and the
    /// learnable tensors that require grad.
    pub(crate) grads: Gradients<f32>,
}

/// The call `attention` made (`q` over `keys`, returning `y`) through
/// autograd: `var_attention` over `Var`s of the same tensors, then numr's
/// `backward` of `L = sum(out ∘ dout) + sum(lse ∘ dlse)`.
pub(crate) fn through_autograd<R: TestBackend, V: Variant>(
    variant: &V,
    q: &Tensor<R::Runtime>,
    keys: Keys<'_, R::Runtime>,
    y: &Output<R::Runtime>,
    (dout, dlse): (&Tensor<R::Runtime>, &Tensor<R::Runtime>),
    opts: &AttentionOptions,
) -> Result<Autograd, String> {
    let host = |t: &Tensor<R::Runtime>| t.to_vec::<f32>();
    let client = <R::Runtime as Runtime>::default_client(q.device());
    let (k, v) = keys.kv();
    let (qv, kv, vv) = (
        Var::new(q.clone(), true),
        Var::new(k.clone(), true),
        Var::new(v.clone(), true),
    );
    let yv = var_attention(variant, &qv, keys.over(&kv, &vv), opts)
        .map_err(|e| format!("var_attention: {e}"))?;
    let max = max_scores(opts.max_scores, &y.lse, y.max_scores.as_ref())
        .map_err(|e| format!("attention: {e}"))?;
    let var_max = max_scores(opts.max_scores, yv.lse.tensor(), yv.max_scores.as_ref())
        .map_err(|e| format!("var_attention: {e}"))?;
    if !same_bits(&max, &var_max) {
        return Err("var_attention's max_scores differ from attention's".into());
    }
    let loss = out_and_lse_loss(&client, (&yv.out, &yv.lse), (dout, dlse))
        .map_err(|e| format!("building L = sum(out * dout) + sum(lse * dlse): {e}"))?;
    let grads = backward(&loss, &client).map_err(|e| format!("autograd backward: {e}"))?;
    let grad = |name: &str, var: &Var<R::Runtime>| {
        grads
            .get(var.id())
            .map(host)
            .ok_or_else(|| format!("autograd backward produced no gradient for {name}"))
    };
    let mut tensors = Vec::new();
    for l in variant.learnables() {
        let var = l.on::<R::Runtime>().map_err(|e| e.to_string())?;
        if var.requires_grad() {
            tensors.push(grad(l.decl.name, var)?);
        }
    }
    Ok(Autograd {
        max_scores: max,
        out: host(yv.out.tensor()),
        grads: Gradients {
            dq: grad("q", &qv)?,
            dk: grad("k", &kv)?,
            dv: grad("v", &vv)?,
            tensors,
        },
    })
}

/// The rows' largest scores of a call that asked for them (`asked`),
/// host side: of `lse`'s shape; empty where not asked for. Returned where
/// not asked for, or missing where asked, they are an error.
pub(crate) fn max_scores<R: Runtime>(
    asked: bool,
    lse: &Tensor<R>,
    got: Option<&Tensor<R>>,
) -> Result<Vec<f32>, String> {
    match (asked, got) {
        (false, None) => Ok(Vec::new()),
        (true, Some(m)) if m.shape() == lse.shape() => Ok(m.to_vec()),
        (true, Some(m)) => Err(format!(
            "max_scores of shape {:?}, want lse's {:?}",
            m.shape(),
            lse.shape()
        )),
        (true, None) => Err("max_scores asked for and not returned".into()),
        (false, Some(_)) => Err("max_scores returned unasked".into()),
    }
}

/// Whether `a` and `b` hold the same bits.
pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// `L = sum(out ∘ dout) + sum(lse ∘ dlse)`, whose gradients with respect
/// to `out` and `lse` are `dout` and `dlse`. (Its value is no number where
/// a row sees nothing, lse = −inf; a backward reads only its gradients, and
/// such a row's dlse must change nothing.)
pub(crate) fn out_and_lse_loss<R: Runtime<DType = numr::dtype::DType>>(
    client: &R::Client,
    (out, lse): (&Var<R>, &Var<R>),
    (dout, dlse): (&Tensor<R>, &Tensor<R>),
) -> numr::error::Result<Var<R>>
where
    R::Client: numr::ops::TensorOps<R>,
{
    let all = |t: &Var<R>| (0..t.ndim()).collect::<Vec<usize>>();
    let l_out = var_sum(
        &var_mul(out, &Var::new(dout.clone(), false), client)?,
        &all(out),
        false,
        client,
    )?;
    let l_lse = var_sum(
        &var_mul(lse, &Var::new(dlse.clone(), false), client)?,
        &all(lse),
        false,
        client,
    )?;
    var_add(&l_out, &l_lse, client)
}

/// The ops of a call whose tensor reads go out of range (the reference
/// found `expected`) must each fail with [`Error::IndexOutOfRange`] of that
/// field and shape, at an index outside the shape: the forward, the
/// backward (given any `out` and `lse`) and the autograd op.
pub(crate) fn expect_out_of_range<R: TestBackend, V: Variant>(
    variant: &V,
    device: &<R::Runtime as Runtime>::Device,
    case: &Case,
    inputs: &Inputs,
    expected: &Error,
    failures: &mut Vec<String>,
) {
    let Error::IndexOutOfRange {
        field: want_field,
        shape: want_shape,
        ..
    } = expected
    else {
        failures.push(format!(
            "the reference reported {expected}, not a read out of range"
        ));
        return;
    };
    let [q, k, v, dout] = inputs.slices();
    let upload = |data: &[f32], shape: &[usize]| {
        Tensor::<R::Runtime>::from_slice(data, shape, device).map_err(|e| e.to_string())
    };
    let p = case.problem();
    let tensors = (|| {
        Ok::<_, String>((
            upload(q, &p.q_shape())?,
            upload(k, &p.k_shape())?,
            upload(v, &p.v_shape())?,
            upload(dout, &p.out_shape())?,
            upload(&vec![0.0; p.out_len()], &p.out_shape())?,
            upload(&vec![0.0; p.lse_len()], &p.lse_shape())?,
        ))
    })();
    let (qt, kt, vt, dt, out, lse) = match tensors {
        Ok(t) => t,
        Err(e) => {
            failures.push(format!("uploading the inputs: {e}"));
            return;
        }
    };
    let opts = &inputs.opts;
    let mut judge = |op: &str, result: Result<(), Error>| match result {
        Err(Error::IndexOutOfRange {
            field,
            index,
            shape,
        }) if field == *want_field && shape == *want_shape => {
            let outside = index.len() != shape.len()
                || index
                    .iter()
                    .zip(&shape)
                    .any(|(&i, &d)| i < 0 || i >= d as i64);
            if !outside {
                failures.push(format!(
                    "{op}: reported index {index:?} of `{field}`, which is inside its shape {shape:?}"
                ));
            }
        }
        Err(other) => failures.push(format!("{op}: expected `{expected}`, got `{other}`")),
        Ok(()) => failures.push(format!("{op}: expected `{expected}`, but it succeeded")),
    };
    let keys = Keys::dense(&kt, &vt);
    judge("attention", attention(variant, &qt, keys, opts).map(drop));
    let grads = Backward::from_tensors(&out, &lse, &dt);
    judge(
        "attention_backward",
        attention_backward(variant, &qt, keys, grads, opts).map(drop),
    );
    let (qv, kv, vv) = (
        Var::new(qt.clone(), true),
        Var::new(kt.clone(), true),
        Var::new(vt.clone(), true),
    );
    judge(
        "var_attention",
        var_attention(variant, &qv, Keys::dense(&kv, &vv), opts).map(drop),
    );
}
