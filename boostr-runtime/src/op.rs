//! The attention ops: forward and backward on tensors, and the autograd op on
//! [`Var`] whose [`GradFn`] calls the fused backward.

use crate::backend::{
    AttentionGrads, AttentionRuntime, BackwardTensors, CacheLengths, CacheScales, KeyLayout, Keys,
    PageTable,
};
use crate::error::Result;
use crate::node::{self, Saved};
use crate::problem::Problem;
use crate::validate;
use crate::variant::Variant;
use numr::autograd::Var;
use numr::tensor::Tensor;

/// Options of one attention call: `AttentionOptions::default()`, then the
/// `with_` methods for what differs.
///
/// ```
/// use boostr_runtime::AttentionOptions;
/// let opts = AttentionOptions::default().with_scale(0.125).with_dropout(7, 3);
/// assert_eq!((opts.scale, opts.dropout_seed, opts.dropout_offset), (Some(0.125), 7, 3));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct AttentionOptions {
    /// Multiplier of `q·k` before `score`; `None` means `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// The seed of a dropout variant's draw (see
    /// [`kernels_spec::dropout`]): the same seed and offset drop the same
    /// pairs on every backend, and the backward of a call must be given
    /// the forward's. Ignored by variants without `dropout`.
    pub dropout_seed: u64,
    /// The call's offset under the seed: calls that share a seed (the
    /// layers of one step, say) take different offsets to draw
    /// independently.
    pub dropout_offset: u32,
}

impl AttentionOptions {
    /// These options with `q·k` multiplied by `scale` (not `1/sqrt(D)`).
    pub fn with_scale(self, scale: f32) -> Self {
        AttentionOptions {
            scale: Some(scale),
            ..self
        }
    }

    /// These options with a dropout variant's draw keyed by `seed` and
    /// `offset` (see [`AttentionOptions::dropout_seed`]).
    pub fn with_dropout(self, seed: u64, offset: u32) -> Self {
        AttentionOptions {
            dropout_seed: seed,
            dropout_offset: offset,
            ..self
        }
    }
}

/// Fused attention forward of `q [B, Hq, Sq, D]` against `k [B, Hkv, Sk,
/// D]` and `v [B, Hkv, Sk, Dv]`: returns `(out [B, Hq, Sq, Dv], lse [B, Hq,
/// Sq])`. `Dv` may differ from `D`, on every backend.
///
/// `lse` is the natural log-sum-exp of each query row's masked, modified,
/// scaled logits (and its sink, if the variant declares one); a row with no
/// visible key has `out = 0` and `lse = -inf` (its sink, with one).
///
/// `k` and `v` of batch 1 with `q` of batch `B` are one sequence of keys
/// shared by every query sequence (a common prefix, a shared memory), as
/// PyTorch broadcasts them: read in place on the CPU, and in the backward
/// ([`attention_bwd`], [`var_attention`]) their gradients are the sums over
/// the batch, shaped `[1, ..]`.
pub fn attention_fwd<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
    opts: &AttentionOptions,
) -> Result<(Tensor<R>, Tensor<R>)> {
    let dense = DenseKeys::new(q, k, v)?;
    let (k, v) = (&dense.k, &dense.v);
    let problem = validate::call(variant, validate::problem(q, k, v, opts.scale)?, opts)?;
    let layout = KeyLayout::Dense;
    R::attention_forward(
        variant,
        &problem,
        q,
        Keys {
            k,
            v,
            layout,
            scales: None,
        },
    )
}

/// A dense call's `k` and `v`, broadcast to `q`'s batch where they hold
/// one sequence shared by every query sequence.
struct DenseKeys<R: AttentionRuntime> {
    k: Tensor<R>,
    v: Tensor<R>,
    /// `k` and `v` were of batch 1, broadcast (a zero stride) to `q`'s.
    shared: bool,
}

impl<R: AttentionRuntime> DenseKeys<R> {
    fn new(q: &Tensor<R>, k: &Tensor<R>, v: &Tensor<R>) -> Result<Self> {
        let batch = |t: &Tensor<R>| (t.ndim() == 4).then(|| t.shape()[0]);
        let shared = match (batch(q), batch(k), batch(v)) {
            (Some(b), Some(1), Some(1)) => b != 1,
            _ => false,
        };
        if !shared {
            return Ok(Self {
                k: k.clone(),
                v: v.clone(),
                shared,
            });
        }
        let b = q.shape()[0];
        let wide = |t: &Tensor<R>| {
            let s = t.shape();
            t.broadcast_to(&[b, s[1], s[2], s[3]])
        };
        Ok(Self {
            k: wide(k)?,
            v: wide(v)?,
            shared,
        })
    }

    /// `g` with `dk`, `dv` summed over the batch where the keys were shared.
    fn fold(&self, mut g: AttentionGrads<R>) -> Result<AttentionGrads<R>> {
        if self.shared {
            g.dk = R::sum_batch(&g.dk)?;
            g.dv = R::sum_batch(&g.dv)?;
        }
        Ok(g)
    }
}

/// Keys and values in a cache with spare capacity: `k, v [B, Hkv, capacity,
/// D]`, of which sequence `b` holds its keys in slots `0 .. lengths[b]`
/// (`lengths`: `[B]` `i32` on the call's device). Slots past a sequence's
/// length are never read, so they may hold anything (NaN included).
///
/// `k` and `v` are in `q`'s dtype, or both in one fp8 format (`FP8E4M3`
/// or `FP8E5M2`) with their [`KvScales`]: forward only, on the CPU and
/// CUDA (numr's wgpu runtime holds no 8-bit tensors).
///
/// Built with [`KvCache::new`] (and [`KvCache::with_scales`] for fp8).
#[derive(Debug)]
#[non_exhaustive]
pub struct KvCache<'a, R: numr::runtime::Runtime> {
    /// `k [B, Hkv, capacity, D]`.
    pub k: &'a Tensor<R>,
    /// `v [B, Hkv, capacity, Dv]`.
    pub v: &'a Tensor<R>,
    /// `lengths [B]` (`i32`), each in `0 ..= capacity`.
    pub lengths: &'a Tensor<R>,
    /// The dequantization scales of an fp8 cache; `None` otherwise.
    pub scales: Option<KvScales<'a, R>>,
}

/// The dequantization scales of an fp8 KV cache, `f32`, positive and
/// finite: a stored element's value is its fp8 value times the scale of
/// its kv head (and page). The variant names the layout.
#[derive(Debug)]
#[non_exhaustive]
pub enum KvScales<'a, R: numr::runtime::Runtime> {
    /// One scale per kv head: `k` and `v` each `[Hkv]`.
    PerHead {
        /// K's scales.
        k: &'a Tensor<R>,
        /// V's scales.
        v: &'a Tensor<R>,
    },
    /// One scale per page and kv head, for a [`PagedKvCache`]: `k` and
    /// `v` each `[pages, Hkv]`.
    PerPage {
        /// K's scales.
        k: &'a Tensor<R>,
        /// V's scales.
        v: &'a Tensor<R>,
    },
}

impl<R: numr::runtime::Runtime> Clone for KvScales<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: numr::runtime::Runtime> Copy for KvScales<'_, R> {}

impl<'a, R: numr::runtime::Runtime> KvCache<'a, R> {
    /// A cache of `k`, `v` in `q`'s dtype and the sequences' `lengths`.
    pub fn new(k: &'a Tensor<R>, v: &'a Tensor<R>, lengths: &'a Tensor<R>) -> Self {
        KvCache {
            k,
            v,
            lengths,
            scales: None,
        }
    }

    /// This cache read as fp8 with `scales` (`k` and `v` in one fp8
    /// format; [`KvScales::PerHead`]).
    pub fn with_scales(self, scales: KvScales<'a, R>) -> Self {
        KvCache {
            scales: Some(scales),
            ..self
        }
    }

    /// The cache as a call's keys, with its lengths' and scales' values.
    fn keys<'k>(&self, host: &'k [usize], scales: Option<CacheScales<'k>>) -> Keys<'k, R>
    where
        'a: 'k,
    {
        let lengths = CacheLengths {
            tensor: self.lengths,
            host,
        };
        Keys {
            k: self.k,
            v: self.v,
            layout: KeyLayout::Cache(lengths),
            scales,
        }
    }
}

/// Fused attention forward over a KV cache: as [`attention_fwd`], but
/// sequence `b` has only its first `lengths[b]` keys, and its query row `i`
/// sits at position `i + lengths[b] − Sq` (bottom-right aligned to its own
/// length). One length for the whole batch equal to the capacity is
/// [`attention_fwd`]. The cache is neither copied nor narrowed: the kernel
/// reads each sequence's keys in place (the decode kernel on the CPU:
/// split-KV, query heads packed by GQA group). A length outside `0 ..=
/// capacity` is [`Error::CacheLength`](crate::Error::CacheLength).
pub fn attention_fwd_cache<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Tensor<R>,
    cache: &KvCache<'_, R>,
    opts: &AttentionOptions,
) -> Result<(Tensor<R>, Tensor<R>)> {
    let problem = validate::call(
        variant,
        validate::problem(q, cache.k, cache.v, opts.scale)?,
        opts,
    )?;
    let host = validate::cache_lengths(cache.lengths, &problem)?;
    let scales = validate::cache_scales(cache.k, cache.v, cache.scales, None)?;
    let scales = scales.as_ref().map(|(k, v)| CacheScales { k, v });
    let keys = cache.keys(&host, scales);
    R::attention_forward(variant, &problem, q, keys)
}

/// Keys and values in pages: `k_pages [pages, Hkv, page_size, D]`,
/// `v_pages [pages, Hkv, page_size, Dv]` and a page table `[B, max_pages]` (`i32`): logical key `j` of sequence
/// `b` is slot `j % page_size` of page `page_table[b][j / page_size]`.
/// Sequence `b` holds `lengths[b]` keys (`[B]` `i32`, each at most
/// `max_pages · page_size`); page table entries past a sequence's length
/// and pages no entry names are never read.
///
/// Built with [`PagedKvCache::new`] (and [`PagedKvCache::with_scales`]
/// for fp8 pages).
#[derive(Debug)]
#[non_exhaustive]
pub struct PagedKvCache<'a, R: numr::runtime::Runtime> {
    /// `k_pages [pages, Hkv, page_size, D]`.
    pub k_pages: &'a Tensor<R>,
    /// `v_pages [pages, Hkv, page_size, Dv]`.
    pub v_pages: &'a Tensor<R>,
    /// `page_table [B, max_pages]` (`i32`).
    pub page_table: &'a Tensor<R>,
    /// `lengths [B]` (`i32`).
    pub lengths: &'a Tensor<R>,
    /// The dequantization scales of fp8 pages (per kv head, or per page
    /// and kv head); `None` otherwise.
    pub scales: Option<KvScales<'a, R>>,
}

impl<'a, R: numr::runtime::Runtime> PagedKvCache<'a, R> {
    /// Pages `k_pages`, `v_pages` in `q`'s dtype, the `page_table` and the
    /// sequences' `lengths`.
    pub fn new(
        k_pages: &'a Tensor<R>,
        v_pages: &'a Tensor<R>,
        page_table: &'a Tensor<R>,
        lengths: &'a Tensor<R>,
    ) -> Self {
        PagedKvCache {
            k_pages,
            v_pages,
            page_table,
            lengths,
            scales: None,
        }
    }

    /// These pages read as fp8 with `scales` (`k_pages` and `v_pages` in
    /// one fp8 format; [`KvScales::PerHead`] or [`KvScales::PerPage`]).
    pub fn with_scales(self, scales: KvScales<'a, R>) -> Self {
        PagedKvCache {
            scales: Some(scales),
            ..self
        }
    }

    /// The problem of `q` against these pages, with the values of the
    /// lengths and of the page table (each checked against the pages).
    fn validate(&self, q: &Tensor<R>, scale: Option<f32>) -> Result<PagedHost>
    where
        R: numr::runtime::Runtime<DType = numr::dtype::DType>,
    {
        let (problem, page_size) =
            validate::paged_problem(q, self.k_pages, self.v_pages, self.page_table, scale)?;
        let lengths = validate::cache_lengths(self.lengths, &problem)?;
        let pages = self.k_pages.shape()[0];
        let table = validate::page_table(self.page_table, &lengths, page_size, pages)?;
        Ok(PagedHost {
            problem,
            page_size,
            pages,
            lengths,
            table,
        })
    }

    /// The pages as a call's keys, with the lengths' and page table's
    /// values in `host`.
    fn keys<'k>(&self, host: &'k PagedHost, scales: Option<CacheScales<'k>>) -> Keys<'k, R>
    where
        'a: 'k,
    {
        let layout = KeyLayout::Paged(
            CacheLengths {
                tensor: self.lengths,
                host: &host.lengths,
            },
            PageTable {
                tensor: self.page_table,
                host: &host.table,
                page_size: host.page_size,
            },
        );
        Keys {
            k: self.k_pages,
            v: self.v_pages,
            layout,
            scales,
        }
    }
}

/// A paged call's problem, and its lengths and page table on the host.
struct PagedHost {
    problem: Problem,
    page_size: usize,
    pages: usize,
    lengths: Vec<usize>,
    table: Vec<usize>,
}

/// Fused attention forward over a paged KV cache: as
/// [`attention_fwd_cache`] with the keys gathered through the page table,
/// in place (`kv` is the logical position, so every variant works
/// unchanged; any page size). A length past `max_pages · page_size` is
/// [`Error::CacheLength`](crate::Error::CacheLength), a table entry a
/// length reaches that is no page [`Error::PageIndex`](crate::Error::PageIndex).
pub fn attention_fwd_paged<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Tensor<R>,
    cache: &PagedKvCache<'_, R>,
    opts: &AttentionOptions,
) -> Result<(Tensor<R>, Tensor<R>)> {
    let host = cache.validate(q, opts.scale)?;
    let problem = validate::call(variant, host.problem, opts)?;
    let (k, v) = (cache.k_pages, cache.v_pages);
    let scales = validate::cache_scales(k, v, cache.scales, Some(host.pages))?;
    let scales = scales.as_ref().map(|(k, v)| CacheScales { k, v });
    R::attention_forward(variant, &problem, q, cache.keys(&host, scales))
}

/// The backward of [`attention_fwd_paged`]: `(dq, dk, dv)` given its `out`
/// and `lse`, with `dk` and `dv` shaped as the pages (`[pages, Hkv,
/// page_size, D]` and `[.., Dv]`). A page's gradient is the sum, in
/// sequence order, of the gradients of the keys that read it: a page that
/// several sequences share (a common prefix) gets all of theirs, and one
/// that no sequence's length reaches gets zeros. For training on sequences
/// that live in a paged cache, every variant, on every backend.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_paged<V: Variant, R: AttentionRuntime>(
    variant: &V,
    dout: &Tensor<R>,
    q: &Tensor<R>,
    cache: &PagedKvCache<'_, R>,
    out: &Tensor<R>,
    lse: &Tensor<R>,
    opts: &AttentionOptions,
) -> Result<(Tensor<R>, Tensor<R>, Tensor<R>)> {
    let host = cache.validate(q, opts.scale)?;
    let problem = validate::call(variant, host.problem, opts)?;
    let (k, v) = (cache.k_pages, cache.v_pages);
    no_fp8_backward(validate::cache_scales(
        k,
        v,
        cache.scales,
        Some(host.pages),
    )?)?;
    let keys = cache.keys(&host, None);
    let g = backward(variant, &problem, ([dout, q, out, lse], None), keys, &[])?;
    Ok((g.dq, g.dk, g.dv))
}

/// The backward of an fp8 cache (with `scales`) is an error.
fn no_fp8_backward<T>(scales: Option<T>) -> Result<()> {
    match scales {
        Some(_) => Err(crate::Error::CacheScales {
            rule: "the backward reads keys and values in q's dtype (fp8 caches are for \
                   inference)",
            got: "an fp8 cache with its scales".to_string(),
        }),
        None => Ok(()),
    }
}

/// Fused attention backward: returns `(dq, dk, dv)` given the forward's
/// `out` and `lse` and the output gradient `dout`. Learnable tensors get
/// no gradient here; [`attention_bwd_tensors`] computes theirs too.
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
    let g = dense_backward(variant, [dout, q, k, v, out, lse], None, opts, &[])?;
    Ok((g.dq, g.dk, g.dv))
}

/// The backward of a loss that reads the forward's `lse` as well as its
/// `out` (partial attentions merged by lse, an lse penalty): given `dlse =
/// d loss / d lse [B, Hq, Sq]` (f32) besides `dout`, returns `(dq, dk,
/// dv)` and the gradient of every learnable tensor, from the same fused
/// backward ([`attention_bwd_tensors`] with `dlse` zero). Rows where
/// `lse` is `-inf` (nothing visible) get no gradient whatever `dlse`
/// holds there. [`var_attention_lse`] is the autograd form.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_lse<V: Variant, R: AttentionRuntime>(
    variant: &V,
    (dout, dlse): (&Tensor<R>, &Tensor<R>),
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
    out: &Tensor<R>,
    lse: &Tensor<R>,
    opts: &AttentionOptions,
) -> Result<AttentionGrads<R>> {
    let all = vec![true; V::LEARNABLE.len()];
    dense_backward(variant, [dout, q, k, v, out, lse], Some(dlse), opts, &all)
}

/// [`attention_bwd`] that also returns the gradient of every learnable
/// tensor of the variant (its `Var<R>` fields, in field order; see
/// [`Variant::LEARNABLE`]), from the same fused backward.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_tensors<V: Variant, R: AttentionRuntime>(
    variant: &V,
    dout: &Tensor<R>,
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
    out: &Tensor<R>,
    lse: &Tensor<R>,
    opts: &AttentionOptions,
) -> Result<AttentionGrads<R>> {
    let all = vec![true; V::LEARNABLE.len()];
    dense_backward(variant, [dout, q, k, v, out, lse], None, opts, &all)
}

/// The backward over dense `k, v`, with the tensor gradients `wanted`.
fn dense_backward<V: Variant, R: AttentionRuntime>(
    variant: &V,
    [dout, q, k, v, out, lse]: [&Tensor<R>; 6],
    dlse: Option<&Tensor<R>>,
    opts: &AttentionOptions,
    wanted: &[bool],
) -> Result<AttentionGrads<R>> {
    let dense = DenseKeys::new(q, k, v)?;
    let (k, v) = (&dense.k, &dense.v);
    let problem = validate::call(variant, validate::problem(q, k, v, opts.scale)?, opts)?;
    let layout = KeyLayout::Dense;
    let g = backward(
        variant,
        &problem,
        ([dout, q, out, lse], dlse),
        Keys {
            k,
            v,
            layout,
            scales: None,
        },
        wanted,
    );
    dense.fold(g?)
}

/// The backward of `q` against `keys` (their problem already validated),
/// with the tensor gradients `wanted`, after checking `out`, `dout`,
/// `lse` and `dlse` against the problem.
fn backward<V: Variant, R: AttentionRuntime>(
    variant: &V,
    problem: &Problem,
    ([dout, q, out, lse], dlse): ([&Tensor<R>; 4], Option<&Tensor<R>>),
    keys: Keys<'_, R>,
    wanted: &[bool],
) -> Result<AttentionGrads<R>> {
    validate::shape_of("out", out, &problem.out_shape())?;
    validate::shape_of("dout", dout, &problem.out_shape())?;
    validate::shape_of("lse", lse, &problem.lse_shape())?;
    if let Some(dlse) = dlse {
        validate::shape_of("dlse", dlse, &problem.lse_shape())?;
    }
    let tensors = BackwardTensors {
        q,
        keys,
        out,
        lse,
        dout,
        dlse,
        tensor_grads: wanted,
    };
    R::attention_backward(variant, problem, tensors)
}

/// The backward of [`attention_fwd_cache`]: `(dq, dk, dv)` given its `out`
/// and `lse`, with `dk, dv` shaped as the cache (`[B, Hkv, capacity, D]`
/// and `[.., Dv]`) and zero in every slot past a sequence's length. For training on
/// sequences of different lengths in one padded batch. Every backend runs
/// it (the tile kernels at each sequence's own positions; the spare slots
/// are never read).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_cache<V: Variant, R: AttentionRuntime>(
    variant: &V,
    dout: &Tensor<R>,
    q: &Tensor<R>,
    cache: &KvCache<'_, R>,
    out: &Tensor<R>,
    lse: &Tensor<R>,
    opts: &AttentionOptions,
) -> Result<(Tensor<R>, Tensor<R>, Tensor<R>)> {
    let problem = validate::call(
        variant,
        validate::problem(q, cache.k, cache.v, opts.scale)?,
        opts,
    )?;
    let host = validate::cache_lengths(cache.lengths, &problem)?;
    no_fp8_backward(validate::cache_scales(
        cache.k,
        cache.v,
        cache.scales,
        None,
    )?)?;
    let keys = cache.keys(&host, None);
    let g = backward(variant, &problem, ([dout, q, out, lse], None), keys, &[])?;
    Ok((g.dq, g.dk, g.dv))
}

/// Attention as an autograd op: the forward runs now, and the backward
/// (through [`numr::autograd::backward`]) runs the fused backward kernel.
///
/// The node's inputs are `q, k, v` and every learnable tensor of the
/// variant (a `Var<R>` field) that requires grad, whose gradient the same
/// backward computes. When none of them requires grad, no graph node is
/// created. [`var_attention_lse`] also returns the lse, differentiable.
pub fn var_attention<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Var<R>,
    k: &Var<R>,
    v: &Var<R>,
    opts: &AttentionOptions,
) -> Result<Var<R>> {
    Ok(var_attention_lse(variant, q, k, v, opts)?.0)
}

/// [`var_attention`] that also returns `lse [B, Hq, Sq]` (f32) as a
/// differentiable output, as FlexAttention's `return_lse`: a loss may read
/// both (partial attentions merged by their lse, an lse penalty), and one
/// fused backward takes `dout` and `dlse` together (`dlse` joins each
/// row's `D_i`; a loss that reads only `out` costs nothing more).
///
/// ```
/// # use boostr_runtime::{AttentionOptions, stock::Causal, var_attention_lse};
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
/// let (out, lse) = var_attention_lse(&Causal, &q, &k, &v, &AttentionOptions::default())?;
/// // A loss of both: the sum of the outputs plus the sum of the lse.
/// let loss = var_add(
///     &var_sum(&out, &[0, 1, 2, 3], false, &client)?,
///     &var_sum(&lse, &[0, 1, 2], false, &client)?,
///     &client,
/// )?;
/// let grads = backward(&loss, &client)?;
/// assert_eq!(grads.get(q.id()).expect("q requires grad").shape(), &[1, 2, 8, 16]);
/// # Ok(())
/// # }
/// ```
pub fn var_attention_lse<V: Variant, R: AttentionRuntime>(
    variant: &V,
    q: &Var<R>,
    k: &Var<R>,
    v: &Var<R>,
    opts: &AttentionOptions,
) -> Result<(Var<R>, Var<R>)> {
    let dense = DenseKeys::new(q.tensor(), k.tensor(), v.tensor())?;
    let problem = validate::call(
        variant,
        validate::problem(q.tensor(), &dense.k, &dense.v, opts.scale)?,
        opts,
    )?;
    let keys = Keys {
        k: &dense.k,
        v: &dense.v,
        layout: KeyLayout::Dense,
        scales: None,
    };
    let out = R::attention_forward(variant, &problem, q.tensor(), keys)?;
    let variant_ = variant.clone();
    let gradients = move |[q, k, v, out, lse]: &Saved<R>,
                          (dout, dlse): (&Tensor<R>, Option<&Tensor<R>>),
                          wanted: &[bool]| {
        validate::shape_of("grad_output", dout, &problem.out_shape())?;
        let dense = DenseKeys::new(q, k, v)?;
        let keys = Keys {
            k: &dense.k,
            v: &dense.v,
            layout: KeyLayout::Dense,
            scales: None,
        };
        let tensors = BackwardTensors {
            q,
            keys,
            out,
            lse,
            dout,
            dlse,
            tensor_grads: wanted,
        };
        dense.fold(R::attention_backward(&variant_, &problem, tensors)?)
    };
    node::attach(variant, [q, k, v], out, ("AttentionBackward", gradients))
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
/// # use boostr_runtime::{AttentionOptions, learnable_grads, stock::AlibiSlopes, var_attention};
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
/// let out = var_attention(
///     &variant,
///     &Var::new(q, false),
///     &Var::new(k, false),
///     &Var::new(v, false),
///     &AttentionOptions::default(),
/// )?;
/// let grads = backward(&var_sum(&out, &[0, 1, 2, 3], false, &client)?, &client)?;
/// assert!(grads.get(slopes.id()).is_none()); // the clone's id, not ours
/// let by_name = learnable_grads(&variant, &grads)?;
/// assert_eq!(by_name[0].0, "slopes");
/// assert_eq!(by_name[0].1.expect("slopes require grad").shape(), &[2]);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`Error::CaptureRuntime`](crate::Error::CaptureRuntime) for a field
/// that is a `Var` of another runtime than `grads`.
pub fn learnable_grads<'g, V: Variant, R: numr::runtime::Runtime>(
    variant: &V,
    grads: &'g numr::autograd::GradStore<R>,
) -> Result<Vec<LearnableGrad<'g, R>>> {
    variant
        .learnables()
        .iter()
        .map(|l| Ok((l.decl.name, grads.get(l.on::<R>()?.id()))))
        .collect()
}
