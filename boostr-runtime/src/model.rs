//! A compiled variant as the attention of a [boostr](https://docs.rs/boostr)
//! model (feature `boostr`).
//!
//! boostr's blocks run one sequence between their projections and their
//! output projection (`boostr::model::attention_core`): the raw projections
//! `[B, S, H·D]` are split into heads and permuted to `[B, H, S, D]`, q and
//! k are rotated (RoPE), attention runs, and the result is permuted back to
//! `[B, S, H·D]` for `o_proj`. [`Attention`] runs the same sequence with a
//! variant's fused kernels in the attention step, so a model built from
//! boostr's modules (embeddings, `Linear`, `RmsNorm`, `RoPE`, SwiGLU, AdamW)
//! trains through [`var_attention`] and decodes from a KV cache or pages
//! through [`attention`], with any declared variant: sliding windows with
//! sinks, soft-capping, ALiBi — what boostr's own flash path refuses.
//!
//! ```no_run
//! # fn main() -> boostr_runtime::Result<()> {
//! use boostr::nn::{Linear, RoPE};
//! use boostr_runtime::model::Attention;
//! use boostr_runtime::stock::CausalSoftcap;
//! # use numr::autograd::Var;
//! # use numr::runtime::cpu::{CpuDevice, CpuRuntime};
//! # let (x, q_proj, k_proj, v_proj, rope): (Var<CpuRuntime>, Linear<CpuRuntime>,
//! #     Linear<CpuRuntime>, Linear<CpuRuntime>, RoPE<CpuRuntime>) = todo!();
//! # let client = numr::runtime::cpu::CpuClient::new(CpuDevice::new());
//! // Gemma 2's soft-capped attention in a block with 8 query heads and 2 KV
//! // heads of 64.
//! let attention = Attention::new(CausalSoftcap { cap: 50.0 }, 8, 2, 64)?;
//! let (q, k, v) = (
//!     q_proj.forward(&client, &x)?,
//!     k_proj.forward(&client, &x)?,
//!     v_proj.forward(&client, &x)?,
//! );
//! let y = attention.forward(&q, &k, &v, Some(&rope))?; // [B, S, 8·64], for o_proj
//! # Ok(())
//! # }
//! ```

use crate::backend::AttentionRuntime;
use crate::error::{Error, Result};
use crate::keys::Keys;
use crate::op::{Output, attention, var_attention};
use crate::options::AttentionOptions;
use crate::variant::Variant;
use boostr::nn::RoPE;
use boostr::ops::RoPEOps;
use numr::autograd::{Var, var_permute, var_reshape};
use numr::tensor::Tensor;

/// A variant as a boostr block's attention: heads split from the raw
/// projections, RoPE, the variant's fused kernels, heads merged for
/// `o_proj` — boostr's `attention_core` sequence with the kernel swapped.
#[derive(Clone, Debug)]
pub struct Attention<V: Variant> {
    variant: V,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    opts: AttentionOptions,
}

impl<V: Variant> Attention<V> {
    /// `heads` query heads and `kv_heads` key/value heads (GQA when fewer;
    /// they must divide `heads`) of `head_dim`.
    ///
    /// # Errors
    /// [`Error::Heads`] when a count is zero or `kv_heads` does not divide
    /// `heads`; [`Error::Argument`] for a zero `head_dim`.
    pub fn new(variant: V, heads: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(Error::Heads {
                heads_q: heads,
                heads_kv: kv_heads,
            });
        }
        if head_dim == 0 {
            return Err(Error::ZeroSize {
                name: "head_dim",
                shape: vec![heads, head_dim],
            });
        }
        Ok(Self {
            variant,
            heads,
            kv_heads,
            head_dim,
            opts: AttentionOptions::default(),
        })
    }

    /// The options of every call (scale, dropout).
    pub fn with_options(mut self, opts: AttentionOptions) -> Self {
        self.opts = opts;
        self
    }

    /// The variant.
    pub fn variant(&self) -> &V {
        &self.variant
    }

    /// Training or prefill over the whole sequence: `q [B, S, H·D]`, `k`,
    /// `v [B, S, H_kv·D]` (the projections' outputs), rotated by `rope` at
    /// positions `0..S` (`None`: no rotation, e.g. for ALiBi), attended with
    /// the variant; returns `[B, S, H·D]`, differentiable in `q`, `k`, `v`
    /// (and so in the projections and the variant's learnable tensors).
    ///
    /// # Errors
    /// A projection whose shape is not `[B, S, heads·head_dim]`; as
    /// [`var_attention`].
    pub fn forward<R>(
        &self,
        q: &Var<R>,
        k: &Var<R>,
        v: &Var<R>,
        rope: Option<&RoPE<R>>,
    ) -> Result<Var<R>>
    where
        R: AttentionRuntime,
        R::Client: RoPEOps<R>,
    {
        let (q, k, v) = self.heads_of(q, k, v, rope, 0)?;
        let y = var_attention(&self.variant, &q, Keys::dense(&k, &v), &self.opts)?;
        merge_heads(&y.out)
    }

    /// The projections of new tokens at `position..position + S` as the
    /// heads a cache stores: `q [B, H, S, D]` and `k`, `v [B, H_kv, S, D]`,
    /// q and k rotated at their positions. Write `k`, `v` into the cache,
    /// then call [`decode`](Self::decode) with `q`.
    ///
    /// # Errors
    /// As [`forward`](Self::forward); positions past the RoPE table.
    pub fn heads<R>(
        &self,
        q: &Var<R>,
        k: &Var<R>,
        v: &Var<R>,
        rope: Option<&RoPE<R>>,
        position: usize,
    ) -> Result<(Tensor<R>, Tensor<R>, Tensor<R>)>
    where
        R: AttentionRuntime,
        R::Client: RoPEOps<R>,
    {
        let (q, k, v) = self.heads_of(q, k, v, rope, position)?;
        Ok((q.tensor().clone(), k.tensor().clone(), v.tensor().clone()))
    }

    /// Generation: the queries `q [B, H, S_q, D]` of [`heads`](Self::heads)
    /// against `keys` (a cache with lengths, pages, …: each sequence's last
    /// query row at its last key), merged for `o_proj` as `[B, S_q, H·D]`.
    ///
    /// # Errors
    /// As [`attention`].
    pub fn decode<R: AttentionRuntime>(
        &self,
        q: &Tensor<R>,
        keys: Keys<'_, R>,
    ) -> Result<Tensor<R>> {
        let Output { out, .. } = attention(&self.variant, q, keys, &self.opts)?;
        Ok(merge_heads(&Var::new(out, false))?.tensor().clone())
    }

    /// `[B, S, n·D]` → `[B, n, S, D]`, contiguous.
    fn split<R: AttentionRuntime>(
        &self,
        x: &Var<R>,
        n: usize,
        what: &'static str,
    ) -> Result<Var<R>> {
        let shape = x.shape();
        let &[b, s, width] = shape else {
            return Err(Error::Rank {
                name: what,
                rank: 3,
                layout: "[B, S, heads·head_dim]",
                shape: shape.to_vec(),
            });
        };
        if width != n * self.head_dim {
            return Err(Error::ShapeOf {
                name: what,
                expected: vec![b, s, n * self.head_dim],
                got: shape.to_vec(),
            });
        }
        let x = var_reshape(x, &[b, s, n, self.head_dim])?;
        contiguous(&var_permute(&x, &[0, 2, 1, 3])?)
    }

    #[allow(clippy::type_complexity)]
    fn heads_of<R>(
        &self,
        q: &Var<R>,
        k: &Var<R>,
        v: &Var<R>,
        rope: Option<&RoPE<R>>,
        position: usize,
    ) -> Result<(Var<R>, Var<R>, Var<R>)>
    where
        R: AttentionRuntime,
        R::Client: RoPEOps<R>,
    {
        let (q, k, v) = (
            self.split(q, self.heads, "q")?,
            self.split(k, self.kv_heads, "k")?,
            self.split(v, self.kv_heads, "v")?,
        );
        let Some(rope) = rope else {
            return Ok((q, k, v));
        };
        let (cos, sin) = (rope.cos_cache(), rope.sin_cache());
        let (seq, table) = (q.shape()[2].max(k.shape()[2]), cos.shape()[0]);
        if position + seq > table {
            return Err(Error::Argument {
                name: "position + S (the last rotated position + 1)",
                given: position + seq,
                actual: table,
            });
        }
        let client = R::default_client(q.tensor().device());
        let rotate = |x: &Var<R>| -> Result<Var<R>> {
            let n = x.shape()[2];
            let at = |t: &Var<R>| -> Result<Var<R>> {
                Ok(Var::new(
                    t.tensor().narrow(0, position, n)?.contiguous()?,
                    false,
                ))
            };
            let (cos, sin) = (at(cos)?, at(sin)?);
            Ok(client.apply_rope(x, &cos, &sin)?)
        };
        Ok((rotate(&q)?, rotate(&k)?, v))
    }
}

/// `[B, H, S, D]` → `[B, S, H·D]`.
fn merge_heads<R: AttentionRuntime>(x: &Var<R>) -> Result<Var<R>> {
    let &[b, h, s, d] = x.shape() else {
        unreachable!("attention returns [B, H, S, D]")
    };
    let x = contiguous(&var_permute(x, &[0, 2, 1, 3])?)?;
    Ok(var_reshape(&x, &[b, s, h * d])?)
}

fn contiguous<R: AttentionRuntime>(x: &Var<R>) -> Result<Var<R>> {
    Ok(boostr::nn::var_contiguous(x)?)
}
