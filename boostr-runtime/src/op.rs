//! The attention ops, one call shape for every key source: the forward
//! ([`attention`]), the backward ([`attention_backward`]) and the autograd
//! op on [`Var`] ([`var_attention`]), whose [`GradFn`](numr::autograd::GradFn)
//! calls the same fused backward.

use crate::backend::{AttentionGrads, AttentionRuntime, BackwardTensors};
use crate::error::{Error, Result};
use crate::keys::{Call, Keys};
use crate::node::{self, Saved};
use crate::options::AttentionOptions;
use crate::variant::Variant;
use numr::autograd::Var;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// What a forward returns.
#[derive(Debug)]
#[non_exhaustive]
pub struct Output<R: Runtime> {
    /// `out`: shaped as `q` with the values' head dim `Dv` (`[B, Hq, Sq,
    /// Dv]`, or `[total_q, Hq, Dv]` for packed sequences).
    pub out: Tensor<R>,
    /// `lse` (f32): the natural log-sum-exp of each query row's masked,
    /// modified, scaled logits and its sink; `-inf` for a row that sees
    /// nothing. `[B, Hq, Sq]`, or `[Hq, total_q]` for packed sequences.
    pub lse: Tensor<R>,
    /// Where [`AttentionOptions::max_scores`] asks for it: each query
    /// row's largest modified score (`score(q·k · scale)`) over the keys it
    /// sees, before dropout and without the sink; `-inf` for a row that
    /// sees nothing. f32, shaped as `lse`; not differentiable.
    pub max_scores: Option<Tensor<R>>,
}

/// What a backward starts from: the forward's results and the gradients
/// of the loss with respect to them. `Backward::new(&output, &dout)`, or
/// [`Backward::from_tensors`] for saved tensors; [`Backward::with_dlse`]
/// where the loss reads the lse too.
#[derive(Debug)]
#[non_exhaustive]
pub struct Backward<'a, R: Runtime> {
    /// The forward's `out`.
    pub out: &'a Tensor<R>,
    /// The forward's `lse`.
    pub lse: &'a Tensor<R>,
    /// `d loss / d out`, shaped as `out`.
    pub dout: &'a Tensor<R>,
    /// `d loss / d lse` (f32, shaped as `lse`) where the loss reads it (a
    /// merge of partial attentions by lse, an lse penalty): it joins every
    /// row's `D_i` as `D_i − dlse_i`. `None` is zero. Rows whose `lse` is
    /// `-inf` get no gradient whatever it holds there.
    pub dlse: Option<&'a Tensor<R>>,
}

impl<R: Runtime> Clone for Backward<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: Runtime> Copy for Backward<'_, R> {}

impl<'a, R: Runtime> Backward<'a, R> {
    /// The backward of `forward`'s results given `dout`.
    pub fn new(forward: &'a Output<R>, dout: &'a Tensor<R>) -> Self {
        Self::from_tensors(&forward.out, &forward.lse, dout)
    }

    /// The backward of a forward that returned `out` and `lse`, given
    /// `dout`.
    pub fn from_tensors(out: &'a Tensor<R>, lse: &'a Tensor<R>, dout: &'a Tensor<R>) -> Self {
        Backward {
            out,
            lse,
            dout,
            dlse: None,
        }
    }

    /// This backward with `d loss / d lse` too.
    pub fn with_dlse(self, dlse: &'a Tensor<R>) -> Self {
        Backward {
            dlse: Some(dlse),
            ..self
        }
    }
}

/// Fused attention forward of `q` against `keys`: `out` and `lse`.
///
/// `keys` says where each sequence's keys are ([`Keys::dense`],
/// [`Keys::cache`], [`Keys::paged`], [`Keys::padded`],
/// [`Keys::varlen`]); every source runs every variant on every backend,
/// and `Dv` may differ from `D`. The cache, pages and packed sequences are
/// read in place (the CPU: any strides; the decode kernel for a few query
/// rows over long keys).
///
/// ```
/// # use boostr_runtime::{AttentionOptions, Keys, attention, stock::Causal};
/// # use numr::prelude::{CpuDevice, CpuRuntime, Tensor};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let device = CpuDevice::new();
/// let x = |shape: &[usize]| {
///     let data: Vec<f32> = (0..shape.iter().product()).map(|i| (i as f32 * 0.37).sin()).collect();
///     Tensor::<CpuRuntime>::from_slice(&data, shape, &device)
/// };
/// // Two sequences of 5 and 3 rows, packed: q, k, v [8, heads 2, D 16].
/// let (q, k, v) = (x(&[8, 2, 16])?, x(&[8, 2, 16])?, x(&[8, 2, 16])?);
/// let cu = Tensor::<CpuRuntime>::from_slice(&[0i32, 5, 8], &[3], &device)?;
/// let y = attention(&Causal, &q, Keys::varlen(&k, &v, &cu, &cu), &AttentionOptions::default())?;
/// assert_eq!((y.out.shape(), y.lse.shape()), (&[8, 2, 16][..], &[2, 8][..]));
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// Every rule of the inputs, before any kernel runs, as an [`Error`]
/// naming the rule and the values (shapes, dtypes, lengths, page table
/// entries, offsets, scales); a read of a captured tensor out of range
/// ([`Error::IndexOutOfRange`]); a backend's failure.
pub fn attention<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Tensor<R>,
    keys: Keys<'_, R>,
    opts: &AttentionOptions,
) -> Result<Output<R>> {
    // A batch of mixed decodes and prefills: one call of each kind.
    if let Some(y) = crate::mixed::forward(variant, q, keys, opts)? {
        return Ok(y);
    }
    let call = Call::new(variant, q, &keys, opts)?;
    forward(variant, &call)
}

/// The forward of a validated call, its results in the caller's layout.
fn forward<V: Variant, R: AttentionRuntime>(variant: &V, call: &Call<R>) -> Result<Output<R>> {
    call.output(R::attention_forward(
        variant,
        &call.problem,
        &call.q,
        call.keys(),
    )?)
}

/// The fused backward of [`attention`]: `dq`, `dk` and `dv` (shaped as
/// `q`, `k` and `v`: a cache's slots past each length and a padded
/// batch's rows past each sequence get zeros; pages get the sum of their
/// readers' gradients; shared keys the sum over the batch) and the
/// gradient of every learnable tensor of the variant whose `Var`
/// requires grad, from one pass.
///
/// ```
/// # use boostr_runtime::{AttentionOptions, Backward, Keys, attention, attention_backward, stock::Causal};
/// # use numr::prelude::{CpuDevice, CpuRuntime, Tensor};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let device = CpuDevice::new();
/// # let x = |shape: &[usize]| {
/// #     let data: Vec<f32> = (0..shape.iter().product()).map(|i| (i as f32 * 0.37).sin()).collect();
/// #     Tensor::<CpuRuntime>::from_slice(&data, shape, &device)
/// # };
/// let (q, k, v) = (x(&[1, 2, 8, 16])?, x(&[1, 2, 8, 16])?, x(&[1, 2, 8, 16])?);
/// let opts = AttentionOptions::default();
/// let y = attention(&Causal, &q, Keys::dense(&k, &v), &opts)?;
/// let dout = x(&[1, 2, 8, 16])?;
/// let g = attention_backward(&Causal, &q, Keys::dense(&k, &v), Backward::new(&y, &dout), &opts)?;
/// assert_eq!(g.dk.shape(), k.shape());
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// As [`attention`]; fp8 keys ([`Error::CacheScales`]: they are for
/// inference), and `out`, `lse`, `dout` or `dlse` of another shape than
/// the forward's ([`Error::ShapeOf`]).
pub fn attention_backward<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Tensor<R>,
    keys: Keys<'_, R>,
    grads: Backward<'_, R>,
    opts: &AttentionOptions,
) -> Result<AttentionGrads<R>> {
    let call = Call::new(variant, q, &keys, opts)?;
    no_fp8_backward(&call)?;
    let wanted = variant
        .learnables()
        .iter()
        .map(|l| Ok(l.on::<R>()?.requires_grad()))
        .collect::<Result<Vec<bool>>>()?;
    backward(variant, &call, grads, &wanted)
}

/// The backward of fp8 keys is an error.
fn no_fp8_backward<R: AttentionRuntime>(call: &Call<R>) -> Result<()> {
    if call.is_fp8() {
        return Err(Error::CacheScales {
            rule: "the backward reads keys and values in q's dtype (fp8 keys are for inference)",
            got: "fp8 keys with their scales".to_string(),
        });
    }
    Ok(())
}

/// The backward of a validated call, with the learnable gradients
/// `wanted` (by slot), its results in the caller's layout.
fn backward<V: Variant, R: AttentionRuntime>(
    variant: &V,
    call: &Call<R>,
    grads: Backward<'_, R>,
    wanted: &[bool],
) -> Result<AttentionGrads<R>> {
    let out = call.rows_in("out", grads.out)?;
    let dout = call.rows_in("dout", grads.dout)?;
    let lse = call.lse_in("lse", grads.lse)?;
    let dlse = grads.dlse.map(|g| call.lse_in("dlse", g)).transpose()?;
    let tensors = BackwardTensors {
        q: &call.q,
        keys: call.keys(),
        out: &out,
        lse: &lse,
        dout: &dout,
        dlse: dlse.as_ref(),
        tensor_grads: wanted,
    };
    let g = R::attention_backward(variant, &call.problem, tensors)?;
    Ok(AttentionGrads {
        dq: call.rows_out(g.dq)?,
        dk: call.keys_out(g.dk)?,
        dv: call.keys_out(g.dv)?,
        tensors: g.tensors,
    })
}

/// What [`var_attention`] returns: `out` and `lse` as [`Var`]s, both
/// differentiable (a loss may read either or both; one fused backward
/// takes `dout` and `dlse` together).
#[derive(Debug)]
#[non_exhaustive]
pub struct VarOutput<R: Runtime> {
    /// `out`, as [`Output::out`].
    pub out: Var<R>,
    /// `lse`, as [`Output::lse`].
    pub lse: Var<R>,
    /// As [`Output::max_scores`] (not differentiable).
    pub max_scores: Option<Tensor<R>>,
}

/// Attention as an autograd op, over any key source: the forward runs
/// now, and numr's [`backward`](numr::autograd::backward) runs the fused
/// backward ([`attention_backward`]), whose gradients reach `q`, the keys'
/// and values' `Var`s (a cache's, pages' — each page the sum of its
/// readers' — or packed ones) and every learnable tensor of the variant
/// that requires grad. When none of them requires grad, no graph node is
/// made.
///
/// ```
/// # use boostr_runtime::{AttentionOptions, Keys, stock::Causal, var_attention};
/// # use numr::autograd::{Var, backward, var_add, var_sum};
/// # use numr::prelude::{CpuDevice, CpuRuntime, Runtime, Tensor};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let device = CpuDevice::new();
/// let client = CpuRuntime::default_client(&device);
/// let x = |seed: f32| {
///     let data: Vec<f32> = (0..2 * 8 * 16).map(|i| (i as f32 * seed).sin()).collect();
///     Tensor::<CpuRuntime>::from_slice(&data, &[1, 2, 8, 16], &device)
/// };
/// let (q, k, v) = (Var::new(x(0.37)?, true), Var::new(x(0.41)?, true), Var::new(x(0.43)?, true));
/// let y = var_attention(&Causal, &q, Keys::dense(&k, &v), &AttentionOptions::default())?;
/// // A loss of both: the sum of the outputs plus the sum of the lse.
/// let loss = var_add(
///     &var_sum(&y.out, &[0, 1, 2, 3], false, &client)?,
///     &var_sum(&y.lse, &[0, 1, 2], false, &client)?,
///     &client,
/// )?;
/// let grads = backward(&loss, &client)?;
/// assert_eq!(grads.get(q.id()).expect("q requires grad").shape(), &[1, 2, 8, 16]);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// As [`attention`]; fp8 keys, which have no backward.
pub fn var_attention<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Var<R>,
    keys: Keys<'_, R, Var<R>>,
    opts: &AttentionOptions,
) -> Result<VarOutput<R>> {
    let (k, v) = keys.kv();
    let call = Call::new(
        variant,
        q.tensor(),
        &keys.over(k.tensor(), v.tensor()),
        opts,
    )?;
    no_fp8_backward(&call)?;
    let y = forward(variant, &call)?;
    let variant_ = variant.clone();
    // The call keeps what its backward reads: the kernels' views of q, k
    // and v, and the index tensors with their values.
    let gradients = move |[_, _, _, out, lse]: &Saved<R>,
                          (dout, dlse): (&Tensor<R>, Option<&Tensor<R>>),
                          wanted: &[bool]| {
        let grads = Backward {
            out,
            lse,
            dout,
            dlse,
        };
        backward(&variant_, &call, grads, wanted)
    };
    let max_scores = y.max_scores;
    let (out, lse) = node::attach(
        variant,
        [q, k, v],
        (y.out, y.lse),
        ("AttentionBackward", gradients),
    )?;
    Ok(VarOutput {
        out,
        lse,
        max_scores,
    })
}

/// One learnable tensor's field name and its gradient, if any (see
/// [`learnable_grads`]).
pub type LearnableGrad<'g, R> = (&'static str, Option<&'g Tensor<R>>);

/// The gradients of `variant`'s learnable tensors (its `Var<R>` fields) in
/// `grads`, the result of numr's `backward`, by field name, in slot order
/// ([`Variant::LEARNABLE`]): `None` for a field whose `Var` does not
/// require grad (or that the loss does not depend on).
///
/// numr keys a gradient by its `Var`'s id, and a cloned `Var` gets an id of
/// its own: after `AlibiSlopes { slopes: v.clone() }`, `grads.get(v.id())`
/// is `None`, and the gradient is under the field's id. This reads the
/// fields themselves, so no id is needed:
///
/// ```
/// # use boostr_runtime::{AttentionOptions, Keys, learnable_grads, stock::AlibiSlopes, var_attention};
/// # use numr::autograd::{Var, backward, var_sum};
/// # use numr::prelude::{CpuDevice, CpuRuntime, Runtime, Tensor};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let device = CpuDevice::new();
/// let client = CpuRuntime::default_client(&device);
/// let x = |shape: &[usize]| {
///     let n: usize = shape.iter().product();
///     let data: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
///     Tensor::<CpuRuntime>::from_slice(&data, shape, &device)
/// };
/// let (q, k, v) = (x(&[1, 2, 8, 16])?, x(&[1, 2, 8, 16])?, x(&[1, 2, 8, 16])?);
/// let slopes = Var::new(x(&[2])?, true);
/// let variant = AlibiSlopes { slopes: slopes.clone() };
/// let (k, v) = (Var::new(k, false), Var::new(v, false));
/// let y = var_attention(&variant, &Var::new(q, false), Keys::dense(&k, &v), &AttentionOptions::default())?;
/// let grads = backward(&var_sum(&y.out, &[0, 1, 2, 3], false, &client)?, &client)?;
/// assert!(grads.get(slopes.id()).is_none()); // the clone's id, not ours
/// let by_name = learnable_grads(&variant, &grads)?;
/// assert_eq!(by_name[0].0, "slopes");
/// assert_eq!(by_name[0].1.expect("slopes require grad").shape(), &[2]);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`Error::CaptureRuntime`] for a field that is a `Var` of another
/// runtime than `grads`.
pub fn learnable_grads<'g, V: Variant, R: Runtime>(
    variant: &V,
    grads: &'g numr::autograd::GradStore<R>,
) -> Result<Vec<LearnableGrad<'g, R>>> {
    variant
        .learnables()
        .iter()
        .map(|l| Ok((l.decl.name, grads.get(l.on::<R>()?.id()))))
        .collect()
}
