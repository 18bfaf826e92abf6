//! The attention ops: forward and backward on tensors, and the autograd op on
//! [`Var`] whose [`GradFn`] calls the fused backward.

use crate::backend::{AttentionRuntime, BackwardTensors};
use crate::error::Result;
use crate::problem::Problem;
use crate::validate;
use crate::variant::Variant;
use numr::autograd::{GradFn, TensorId, Var};
use numr::tensor::Tensor;
use std::sync::Arc;

/// Options of one attention call.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOptions {
    /// Multiplier of `q·k` before `score`; `None` means `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
}

/// Fused attention forward: returns `(out [B, Hq, Sq, D], lse [B, Hq, Sq])`.
///
/// `lse` is the natural log-sum-exp of each query row's masked, modified,
/// scaled logits; a row with no visible key has `out = 0` and `lse = -inf`.
pub fn attention_fwd<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
    opts: &AttentionOptions,
) -> Result<(Tensor<R>, Tensor<R>)> {
    let problem = validate::problem(q, k, v, opts.scale)?;
    R::attention_forward(variant, &problem, q, k, v)
}

/// Fused attention backward: returns `(dq, dk, dv)` given the forward's
/// `out` and `lse` and the output gradient `dout`.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd<V: Variant, R: AttentionRuntime>(
    variant: &V,
    dout: &Tensor<R>,
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
    out: &Tensor<R>,
    lse: &Tensor<R>,
    opts: &AttentionOptions,
) -> Result<(Tensor<R>, Tensor<R>, Tensor<R>)> {
    let problem = validate::problem(q, k, v, opts.scale)?;
    validate::shape_of("out", out, q.shape())?;
    validate::shape_of("dout", dout, q.shape())?;
    validate::shape_of("lse", lse, &[problem.batch, problem.heads_q, problem.seq_q])?;
    let tensors = BackwardTensors {
        q,
        k,
        v,
        out,
        lse,
        dout,
    };
    R::attention_backward(variant, &problem, tensors)
}

/// Attention as an autograd op: the forward runs now, and the backward
/// (through [`numr::autograd::backward`]) runs the fused backward kernel.
///
/// When none of `q, k, v` requires grad, no graph node is created.
pub fn var_attention<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Var<R>,
    k: &Var<R>,
    v: &Var<R>,
    opts: &AttentionOptions,
) -> Result<Var<R>> {
    let problem = validate::problem(q.tensor(), k.tensor(), v.tensor(), opts.scale)?;
    let (out, lse) = R::attention_forward(variant, &problem, q.tensor(), k.tensor(), v.tensor())?;
    if !(q.requires_grad() || k.requires_grad() || v.requires_grad()) {
        return Ok(Var::new(out, false));
    }
    let grad_fn = AttentionBackward {
        variant: variant.clone(),
        problem,
        input_ids: [q.graph_id(), k.graph_id(), v.graph_id()],
        input_grad_fns: [
            q.grad_fn().cloned(),
            k.grad_fn().cloned(),
            v.grad_fn().cloned(),
        ],
        saved: [
            q.tensor().clone(),
            k.tensor().clone(),
            v.tensor().clone(),
            out.clone(),
            lse,
        ],
    };
    Ok(Var::from_op(out, Arc::new(grad_fn)))
}

/// The backward node of [`var_attention`]: saves `q, k, v, out, lse`.
struct AttentionBackward<V: Variant, R: AttentionRuntime> {
    variant: V,
    problem: Problem,
    input_ids: [TensorId; 3],
    input_grad_fns: [Option<Arc<dyn GradFn<R>>>; 3],
    /// `[q, k, v, out, lse]`.
    saved: [Tensor<R>; 5],
}

impl<V: Variant, R: AttentionRuntime> GradFn<R> for AttentionBackward<V, R> {
    fn backward(
        &self,
        grad_output: &Tensor<R>,
        needed: &[bool],
    ) -> numr::error::Result<Vec<Option<Tensor<R>>>> {
        let [q, k, v, out, lse] = &self.saved;
        validate::shape_of("grad_output", grad_output, q.shape())?;
        // dq, dk and dv fall out of the same recomputed P and dS, so one fused
        // kernel computes all three; unneeded ones are dropped, not skipped.
        let tensors = BackwardTensors {
            q,
            k,
            v,
            out,
            lse,
            dout: grad_output,
        };
        let (dq, dk, dv) = R::attention_backward(&self.variant, &self.problem, tensors)?;
        let keep = |i: usize, t: Tensor<R>| needed.get(i).copied().unwrap_or(true).then_some(t);
        Ok(vec![keep(0, dq), keep(1, dk), keep(2, dv)])
    }

    fn inputs(&self) -> &[TensorId] {
        &self.input_ids
    }

    fn input_grad_fns(&self) -> Vec<Option<Arc<dyn GradFn<R>>>> {
        self.input_grad_fns.to_vec()
    }

    fn saved_tensors(&self) -> &[Tensor<R>] {
        &self.saved
    }

    fn name(&self) -> &'static str {
        "AttentionBackward"
    }
}
