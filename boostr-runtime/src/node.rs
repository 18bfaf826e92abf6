//! The autograd node of every attention op on [`Var`]: single-device
//! ([`var_attention`](crate::var_attention)) and ring
//! ([`var_ring_attention`](crate::var_ring_attention)) differ only in how
//! they compute the gradients from what the node saved.

use crate::backend::{AttentionGrads, AttentionRuntime};
use crate::error::Result;
use crate::variant::Variant;
use numr::autograd::{GradFn, TensorId, Var};
use numr::tensor::Tensor;
use std::sync::{Arc, Mutex};

/// What the forward saved: `[q, k, v, out, lse]`.
pub(crate) type Saved<R> = [Tensor<R>; 5];

/// How a node computes its gradients from what it saved, `dout` and
/// `dlse` (`None` where the loss does not read lse): `(dq, dk, dv)` and
/// the gradient of each learnable slot whose `wanted` is set (others may
/// be computed too, and are dropped).
pub(crate) trait Gradients<R: AttentionRuntime>:
    Fn(&Saved<R>, (&Tensor<R>, Option<&Tensor<R>>), &[bool]) -> Result<AttentionGrads<R>>
    + Send
    + Sync
    + 'static
{
}

impl<R: AttentionRuntime, G> Gradients<R> for G where
    G: Fn(&Saved<R>, (&Tensor<R>, Option<&Tensor<R>>), &[bool]) -> Result<AttentionGrads<R>>
        + Send
        + Sync
        + 'static
{
}

/// `out` and `lse` as [`Var`]s. `out`'s node takes `q, k, v` and the
/// learnable tensors of `variant` that require grad as inputs; `lse`'s
/// takes `out` (see [`LseNode`]). No nodes (both leaves) when none of the
/// inputs requires grad. `name` names `out`'s node in numr's graph.
pub(crate) fn attach<V: Variant, R: AttentionRuntime, G: Gradients<R>>(
    variant: &V,
    [q, k, v]: [&Var<R>; 3],
    (out, lse): (Tensor<R>, Tensor<R>),
    (name, gradients): (&'static str, G),
) -> Result<(Var<R>, Var<R>)> {
    let dlse: DlseSlot<R> = Arc::new(Mutex::new(None));
    let learnables = variant
        .learnables()
        .iter()
        .map(|l| l.on::<R>())
        .collect::<Result<Vec<&Var<R>>>>()?;
    let tensor_grads: Vec<bool> = learnables.iter().map(|t| t.requires_grad()).collect();
    let any_tensor = tensor_grads.iter().any(|&w| w);
    if !(q.requires_grad() || k.requires_grad() || v.requires_grad() || any_tensor) {
        return Ok((Var::new(out, false), Var::new(lse, false)));
    }
    let inputs: Vec<&Var<R>> = [q, k, v]
        .into_iter()
        .chain(learnables.iter().copied().filter(|t| t.requires_grad()))
        .collect();
    let node = Node {
        name,
        gradients,
        input_ids: inputs.iter().map(|x| x.graph_id()).collect(),
        input_grad_fns: inputs.iter().map(|x| x.grad_fn().cloned()).collect(),
        tensor_grads,
        saved: [
            q.tensor().clone(),
            k.tensor().clone(),
            v.tensor().clone(),
            out.clone(),
            lse.clone(),
        ],
        dlse: dlse.clone(),
    };
    let out = Var::from_op(out, Arc::new(node));
    if !out.requires_grad() {
        // Gradients are off (numr's no-grad mode): no graph at all.
        return Ok((out, Var::new(lse, false)));
    }
    let lse_node = LseNode {
        input_ids: [out.graph_id()],
        input_grad_fns: [out.grad_fn().cloned()],
        out: (
            out.tensor().shape().to_vec(),
            out.tensor().dtype(),
            out.tensor().device().clone(),
        ),
        dlse,
    };
    Ok((out, Var::from_op(lse, Arc::new(lse_node))))
}

/// Where `lse`'s node leaves `dlse` for `out`'s node.
type DlseSlot<R> = Arc<Mutex<Option<Tensor<R>>>>;

/// `lse`'s node. numr's `GradFn` has one output, but lse and out share one
/// fused backward (`dlse` joins every row's `D_i`), so `lse`'s node takes
/// `out` as its input: a backward reaches it before `out`'s node (which
/// then sees `dout` complete, as every consumer of `out` has run), and it
/// leaves `dlse` in the slot the two share and hands `out` a zero gradient
/// (`out` gets a gradient, and its node runs, also where the loss reads
/// only lse).
struct LseNode<R: AttentionRuntime> {
    input_ids: [TensorId; 1],
    input_grad_fns: [Option<Arc<dyn GradFn<R>>>; 1],
    /// `out`'s shape, dtype and device, for its zero gradient.
    out: (Vec<usize>, R::DType, R::Device),
    dlse: DlseSlot<R>,
}

impl<R: AttentionRuntime> GradFn<R> for LseNode<R> {
    fn backward(
        &self,
        grad_output: &Tensor<R>,
        needed: &[bool],
    ) -> numr::error::Result<Vec<Option<Tensor<R>>>> {
        if !needed.first().copied().unwrap_or(true) {
            return Ok(vec![None]);
        }
        *self.dlse.lock().unwrap_or_else(|e| e.into_inner()) = Some(grad_output.clone());
        let (shape, dtype, device) = &self.out;
        Ok(vec![Some(Tensor::zeros_generic(shape, *dtype, device)?)])
    }

    fn inputs(&self) -> &[TensorId] {
        &self.input_ids
    }

    fn input_grad_fns(&self) -> Vec<Option<Arc<dyn GradFn<R>>>> {
        self.input_grad_fns.to_vec()
    }

    fn name(&self) -> &'static str {
        "AttentionLseBackward"
    }
}

/// The node: its inputs are `q, k, v` and then the learnable tensors that
/// require grad.
struct Node<R: AttentionRuntime, G> {
    name: &'static str,
    gradients: G,
    input_ids: Vec<TensorId>,
    input_grad_fns: Vec<Option<Arc<dyn GradFn<R>>>>,
    /// Per learnable slot: it requires grad (and is an input).
    tensor_grads: Vec<bool>,
    saved: Saved<R>,
    /// `dlse`, where `lse`'s node left one in this backward.
    dlse: DlseSlot<R>,
}

impl<R: AttentionRuntime, G: Gradients<R>> GradFn<R> for Node<R, G> {
    fn backward(
        &self,
        grad_output: &Tensor<R>,
        needed: &[bool],
    ) -> numr::error::Result<Vec<Option<Tensor<R>>>> {
        let need = |i: usize| needed.get(i).copied().unwrap_or(true);
        // The learnable inputs follow q, k, v: input 3 + n is the n-th
        // learnable slot that requires grad.
        let mut wanted = self.tensor_grads.clone();
        for (input, w) in (3..).zip(wanted.iter_mut().filter(|w| **w)) {
            *w = need(input);
        }
        // dq, dk and dv fall out of the same recomputed P and dS, so one
        // fused kernel computes all three; unneeded ones are dropped, not
        // skipped.
        let dlse = self.dlse.lock().unwrap_or_else(|e| e.into_inner()).take();
        let g = (self.gradients)(&self.saved, (grad_output, dlse.as_ref()), &wanted)?;
        let keep = |i: usize, t: Tensor<R>| need(i).then_some(t);
        let mut grads = vec![keep(0, g.dq), keep(1, g.dk), keep(2, g.dv)];
        for (slot, t) in g.tensors.into_iter().enumerate() {
            if self.tensor_grads[slot] {
                grads.push(t.filter(|_| wanted[slot]));
            }
        }
        Ok(grads)
    }

    fn inputs(&self) -> &[TensorId] {
        &self.input_ids
    }

    fn input_grad_fns(&self) -> Vec<Option<Arc<dyn GradFn<R>>>> {
        self.input_grad_fns.clone()
    }

    fn saved_tensors(&self) -> &[Tensor<R>] {
        &self.saved
    }

    fn name(&self) -> &'static str {
        self.name
    }
}
