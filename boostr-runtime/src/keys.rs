//! The keys and values of one call: [`Keys`], one type for every place
//! they may live, and [`Call`], the one place a call is validated into
//! what every backend reads (a [`Problem`], tensors laid out as the
//! kernels take them, and a [`KeyLayout`]).
//!
//! A new layout is one variant of [`Keys`] (its constructor and rules,
//! here), one of [`KeyLayout`] (what the backends read), its addressing
//! in each backend (`cpu::keys`, and the GPUs' `keys` sections), and its
//! case in the generated tests (`testing::layouts`).

use crate::backend::{
    AttentionRuntime, CacheLengths, CacheScales, CallKeys, KeyLayout, PageTable, SeqMap,
};
use crate::error::{Error, Result};
use crate::op::Output;
use crate::options::AttentionOptions;
use crate::problem::Problem;
use crate::validate::{self, MAX_INDEX};
use crate::variant::Variant;
use numr::autograd::Var;
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// A tensor that holds a call's keys or values: a [`Tensor`] for the tensor
/// ops ([`attention`](crate::attention()),
/// [`attention_backward`](crate::attention_backward)), a [`Var`] for the
/// autograd op ([`var_attention`](crate::var_attention)). Sealed.
pub trait KeyTensor<R: Runtime>: sealed::Sealed + std::fmt::Debug {
    /// The tensor itself.
    fn tensor(&self) -> &Tensor<R>;
}

impl<R: Runtime> KeyTensor<R> for Tensor<R> {
    fn tensor(&self) -> &Tensor<R> {
        self
    }
}

impl<R: Runtime> KeyTensor<R> for Var<R> {
    fn tensor(&self) -> &Tensor<R> {
        Var::tensor(self)
    }
}

mod sealed {
    pub trait Sealed {}
    impl<R: numr::runtime::Runtime> Sealed for numr::tensor::Tensor<R> {}
    impl<R: numr::runtime::Runtime> Sealed for numr::autograd::Var<R> {}
}

/// The keys and values of one call, and where each sequence's keys (and,
/// for [`Padded`](Keys::Padded) and [`Varlen`](Keys::Varlen), its query
/// rows) are. Built with [`Keys::dense`], [`Keys::cache`],
/// [`Keys::paged`], [`Keys::padded`] or [`Keys::varlen`] (and
/// [`Keys::with_scales`] for fp8 keys); `T` is [`Tensor<R>`] for the tensor
/// ops and [`Var<R>`] for [`var_attention`](crate::var_attention). Index
/// tensors (lengths, page tables, `cu_seqlens`) are `i32` on the call's
/// device.
///
/// | source | `q` | `k` (`v`: last dim `Dv`) | query row `i` of sequence `b` sits at |
/// | --- | --- | --- | --- |
/// | dense | `[B, Hq, Sq, D]` | `[B or 1, Hkv, Sk, D]` | `i + Sk − Sq` |
/// | cache | `[B, Hq, Sq, D]` | `[B, Hkv, capacity, D]`, `lengths [B]` | `i + lengths[b] − Sq` |
/// | paged | `[B, Hq, Sq, D]` | `[pages, Hkv, page_size, D]`, `page_table [B, max_pages]`, `lengths [B]` | `i + lengths[b] − Sq` |
/// | padded | `[B, Hq, Sq, D]`, `q_lengths [B]` | `[B, Hkv, Sk, D]`, `kv_lengths [B]` | `i + kv_lengths[b] − q_lengths[b]` |
/// | varlen | `[total_q, Hq, D]`, `cu_seqlens_q [n + 1]` | `[total_k, Hkv, D]`, `cu_seqlens_k [n + 1]` | `i + len_k[b] − len_q[b]` |
///
/// Every source is bottom-right aligned per sequence, as FlashAttention's
/// (≥ 2.1): a padded or packed sequence with as many queries as keys has
/// row `i` at position `i`, so `kv <= q` is causal in each. Keys past a
/// sequence's length are never read (they may hold NaN); rows past a
/// padded sequence's query length get `out = 0`, `lse = -inf` and zero
/// gradients, and their tiles are skipped. Outputs and gradients have the
/// shapes of their inputs: `out` as `q` with `Dv`, `lse [B, Hq, Sq]` (a
/// packed call's `[Hq, total_q]`, FlashAttention's), `dk` and `dv` as `k`
/// and `v` (pages included: a page's gradient is the sum of its readers').
#[derive(Debug)]
#[non_exhaustive]
pub enum Keys<'a, R: Runtime, T = Tensor<R>> {
    /// Every sequence has all `Sk` keys. `k` and `v` of batch 1 with `q` of
    /// batch `B` are one sequence of keys shared by every query sequence
    /// (a common prefix), as PyTorch broadcasts them; their gradients are
    /// the sums over the batch, shaped `[1, ..]`.
    #[non_exhaustive]
    Dense {
        /// `k [B, Hkv, Sk, D]`.
        k: &'a T,
        /// `v [B, Hkv, Sk, Dv]`.
        v: &'a T,
        /// fp8 keys' scales.
        scales: Option<KvScales<'a, R>>,
    },
    /// A KV cache with spare capacity: sequence `b` holds its keys in slots
    /// `0 .. lengths[b]`, and its queries are its last `Sq` positions
    /// (decode, chunked prefill).
    #[non_exhaustive]
    Cache {
        /// `k [B, Hkv, capacity, D]`.
        k: &'a T,
        /// `v [B, Hkv, capacity, Dv]`.
        v: &'a T,
        /// `lengths [B]`, each in `0 ..= capacity`.
        lengths: &'a Tensor<R>,
        /// fp8 keys' scales.
        scales: Option<KvScales<'a, R>>,
    },
    /// Keys in pages: logical key `j` of sequence `b` is slot `j %
    /// page_size` of page `page_table[b][j / page_size]`; queries as in a
    /// [`Cache`](Keys::Cache). Entries past a sequence's length, and pages
    /// no entry names, are never read.
    #[non_exhaustive]
    Paged {
        /// `k_pages [pages, Hkv, page_size, D]`.
        k_pages: &'a T,
        /// `v_pages [pages, Hkv, page_size, Dv]`.
        v_pages: &'a T,
        /// `page_table [B, max_pages]`.
        page_table: &'a Tensor<R>,
        /// `lengths [B]`, each at most `max_pages · page_size`.
        lengths: &'a Tensor<R>,
        /// Packed queries ([`Keys::paged_packed`]): `cu_seqlens_q
        /// [B + 1]`, sequence `b`'s query rows `cu_seqlens_q[b] ..
        /// cu_seqlens_q[b + 1]` of `q [total_q, Hq, D]`.
        cu_seqlens_q: Option<&'a Tensor<R>>,
        /// fp8 pages' scales.
        scales: Option<KvScales<'a, R>>,
    },
    /// A right-padded batch: sequence `b` has `q_lengths[b]` query rows
    /// and `kv_lengths[b]` keys, each at the start of its padded rows.
    #[non_exhaustive]
    Padded {
        /// `k [B, Hkv, Sk, D]`.
        k: &'a T,
        /// `v [B, Hkv, Sk, Dv]`.
        v: &'a T,
        /// `q_lengths [B]`, each in `0 ..= Sq`.
        q_lengths: &'a Tensor<R>,
        /// `kv_lengths [B]`, each in `0 ..= Sk`.
        kv_lengths: &'a Tensor<R>,
        /// fp8 keys' scales.
        scales: Option<KvScales<'a, R>>,
    },
    /// Packed sequences without padding (FlashAttention's varlen layout):
    /// sequence `b`'s query rows are rows `cu_seqlens_q[b] ..
    /// cu_seqlens_q[b + 1]` of `q [total_q, Hq, D]`, its keys rows
    /// `cu_seqlens_k[b] .. cu_seqlens_k[b + 1]` of `k [total_k, Hkv, D]`.
    /// The variant sees sequence `b` as batch `b`, at its own positions.
    #[non_exhaustive]
    Varlen {
        /// `k [total_k, Hkv, D]`.
        k: &'a T,
        /// `v [total_k, Hkv, Dv]`.
        v: &'a T,
        /// `cu_seqlens_q [n + 1]`: 0, then non-decreasing, ending at `total_q`.
        cu_seqlens_q: &'a Tensor<R>,
        /// `cu_seqlens_k [n + 1]`: 0, then non-decreasing, ending at `total_k`.
        cu_seqlens_k: &'a Tensor<R>,
        /// fp8 keys' scales.
        scales: Option<KvScales<'a, R>>,
    },
}

/// The dequantization scales of fp8 keys and values, `f32`, finite and not
/// negative: a stored element's value is its fp8 value times the scale of
/// its kv head (and page); a scale of 0 (a page not written yet) holds
/// zeros. The variant names the layout.
#[derive(Debug)]
#[non_exhaustive]
pub enum KvScales<'a, R: Runtime> {
    /// One scale per kv head: `k` and `v` each `[Hkv]`.
    PerHead {
        /// K's scales.
        k: &'a Tensor<R>,
        /// V's scales.
        v: &'a Tensor<R>,
    },
    /// One scale per page and kv head, for [`Keys::Paged`]: `k` and `v`
    /// each `[pages, Hkv]`.
    PerPage {
        /// K's scales.
        k: &'a Tensor<R>,
        /// V's scales.
        v: &'a Tensor<R>,
    },
}

impl<R: Runtime> Clone for KvScales<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: Runtime> Copy for KvScales<'_, R> {}

impl<R: Runtime, T> Clone for Keys<'_, R, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: Runtime, T> Copy for Keys<'_, R, T> {}

impl<'a, R: Runtime, T: KeyTensor<R>> Keys<'a, R, T> {
    /// Every sequence's keys in `k [B, Hkv, Sk, D]` and `v [B, Hkv, Sk,
    /// Dv]` (or of batch 1, shared by every sequence).
    pub fn dense(k: &'a T, v: &'a T) -> Self {
        Keys::Dense { k, v, scales: None }
    }

    /// A KV cache: sequence `b`'s keys in slots `0 .. lengths[b]` of `k
    /// [B, Hkv, capacity, D]` and `v`, its query rows its last positions.
    pub fn cache(k: &'a T, v: &'a T, lengths: &'a Tensor<R>) -> Self {
        Keys::Cache {
            k,
            v,
            lengths,
            scales: None,
        }
    }

    /// Keys in pages `k_pages [pages, Hkv, page_size, D]`, `v_pages`,
    /// found through `page_table [B, max_pages]`; sequence `b` has
    /// `lengths[b]` keys.
    pub fn paged(
        k_pages: &'a T,
        v_pages: &'a T,
        page_table: &'a Tensor<R>,
        lengths: &'a Tensor<R>,
    ) -> Self {
        Keys::Paged {
            k_pages,
            v_pages,
            page_table,
            lengths,
            cu_seqlens_q: None,
            scales: None,
        }
    }

    /// Pages read by packed queries of any lengths, one call for a batch
    /// that mixes decodes (one row) and chunks of prefill (hundreds): the
    /// pages as [`Keys::paged`]'s, `q [total_q, Hq, D]` with sequence
    /// `b`'s rows `cu_seqlens_q[b] .. cu_seqlens_q[b + 1]` (`[B + 1]`
    /// `i32`), its row `i` at position `i + lengths[b] − rows`. `out` is
    /// `[total_q, Hq, Dv]` and `lse` `[Hq, total_q]`, as
    /// [`Keys::varlen`]'s.
    pub fn paged_packed(
        k_pages: &'a T,
        v_pages: &'a T,
        page_table: &'a Tensor<R>,
        lengths: &'a Tensor<R>,
        cu_seqlens_q: &'a Tensor<R>,
    ) -> Self {
        Keys::Paged {
            k_pages,
            v_pages,
            page_table,
            lengths,
            cu_seqlens_q: Some(cu_seqlens_q),
            scales: None,
        }
    }

    /// A right-padded batch: sequence `b` has `q_lengths[b]` rows of `q
    /// [B, Hq, Sq, D]` and `kv_lengths[b]` keys of `k [B, Hkv, Sk, D]`.
    pub fn padded(k: &'a T, v: &'a T, q_lengths: &'a Tensor<R>, kv_lengths: &'a Tensor<R>) -> Self {
        Keys::Padded {
            k,
            v,
            q_lengths,
            kv_lengths,
            scales: None,
        }
    }

    /// Packed sequences: `q [total_q, Hq, D]`, `k [total_k, Hkv, D]`, `v
    /// [total_k, Hkv, Dv]`, sequence `b`'s rows from `cu_seqlens_q[b]` and
    /// `cu_seqlens_k[b]`.
    pub fn varlen(
        k: &'a T,
        v: &'a T,
        cu_seqlens_q: &'a Tensor<R>,
        cu_seqlens_k: &'a Tensor<R>,
    ) -> Self {
        Keys::Varlen {
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            scales: None,
        }
    }

    /// These keys read as fp8 (`k` and `v` both `FP8E4M3` or both
    /// `FP8E5M2`) with `scales`: forward only, on the CPU and CUDA; or as
    /// int8 (both `I8`), forward only, on the CPU.
    pub fn with_scales(mut self, scales: KvScales<'a, R>) -> Self {
        match &mut self {
            Keys::Dense { scales: s, .. }
            | Keys::Cache { scales: s, .. }
            | Keys::Paged { scales: s, .. }
            | Keys::Padded { scales: s, .. }
            | Keys::Varlen { scales: s, .. } => *s = Some(scales),
        }
        self
    }

    /// The keys (`k`, or `k_pages`) and values.
    pub fn kv(&self) -> (&'a T, &'a T) {
        match *self {
            Keys::Dense { k, v, .. }
            | Keys::Cache { k, v, .. }
            | Keys::Padded { k, v, .. }
            | Keys::Varlen { k, v, .. } => (k, v),
            Keys::Paged {
                k_pages, v_pages, ..
            } => (k_pages, v_pages),
        }
    }

    /// The fp8 scales, if given.
    pub fn scales(&self) -> Option<KvScales<'a, R>> {
        match *self {
            Keys::Dense { scales, .. }
            | Keys::Cache { scales, .. }
            | Keys::Paged { scales, .. }
            | Keys::Padded { scales, .. }
            | Keys::Varlen { scales, .. } => scales,
        }
    }

    /// The same source over other tensors `k`, `v` (the autograd op's
    /// saved tensors, the tensors of a `Var`).
    pub(crate) fn over<'b, U>(&self, k: &'b U, v: &'b U) -> Keys<'b, R, U>
    where
        'a: 'b,
    {
        match *self {
            Keys::Dense { scales, .. } => Keys::Dense { k, v, scales },
            Keys::Cache {
                lengths, scales, ..
            } => Keys::Cache {
                k,
                v,
                lengths,
                scales,
            },
            Keys::Paged {
                page_table,
                lengths,
                cu_seqlens_q,
                scales,
                ..
            } => Keys::Paged {
                k_pages: k,
                v_pages: v,
                page_table,
                lengths,
                cu_seqlens_q,
                scales,
            },
            Keys::Padded {
                q_lengths,
                kv_lengths,
                scales,
                ..
            } => Keys::Padded {
                k,
                v,
                q_lengths,
                kv_lengths,
                scales,
            },
            Keys::Varlen {
                cu_seqlens_q,
                cu_seqlens_k,
                scales,
                ..
            } => Keys::Varlen {
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                scales,
            },
        }
    }

    /// The source's name, for errors.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Keys::Dense { .. } => "dense keys",
            Keys::Cache { .. } => "a KV cache",
            Keys::Paged { .. } => "pages",
            Keys::Padded { .. } => "a padded batch",
            Keys::Varlen { .. } => "packed sequences (varlen)",
        }
    }
}

/// The index tensors of a validated call, owned (cheap: numr tensors
/// share their storage), with their values on the host.
#[derive(Clone, Debug)]
pub(crate) enum Layout<R: Runtime> {
    Dense,
    Cache(Lengths<R>),
    Paged(Lengths<R>, Table<R>, Option<Lengths<R>>),
    Padded { q: Lengths<R>, kv: Lengths<R> },
    Varlen { q: Lengths<R>, kv: Lengths<R> },
}

/// Per-sequence counts (lengths, or `cu_seqlens`), as given and as values.
#[derive(Clone, Debug)]
pub(crate) struct Lengths<R: Runtime> {
    tensor: Tensor<R>,
    host: Vec<usize>,
}

/// A page table, as given and as values (entries no length reaches are 0).
#[derive(Clone, Debug)]
pub(crate) struct Table<R: Runtime> {
    tensor: Tensor<R>,
    host: Vec<usize>,
    page_size: usize,
}

/// How a call's results reach its caller.
#[derive(Clone, Debug)]
enum Form<R: Runtime> {
    /// As the kernels write them (`[B, H, S, ·]`); with `shared`, `k` and
    /// `v` were of batch 1, broadcast to `q`'s, and their gradients are
    /// summed back.
    Batched { shared: bool },
    /// Packed, read in place: the kernels' `[1, H, total, ·]` as `[total,
    /// H, ·]`, and lse `[1, Hq, total]` as `[Hq, total]`.
    Packed,
    /// Packed, gathered into a padded batch for kernels that do not read
    /// packed rows in place, and scattered back.
    Repacked {
        q: Box<RowMap<R>>,
        kv: Box<RowMap<R>>,
    },
    /// Packed queries over keys in place (pages): the queries gathered
    /// into a padded batch and their results scattered back.
    QueriesPacked(Box<RowMap<R>>),
}

/// Where the rows of a packed tensor go in a padded batch (`n` sequences
/// of `len` rows), and back.
#[derive(Clone, Debug)]
struct RowMap<R: Runtime> {
    /// Per padded row `b · len + i`, the packed row it holds (the zero row
    /// `total` past the sequence's own).
    gather: Tensor<R>,
    /// Per packed row, its padded row.
    scatter: Tensor<R>,
    total: usize,
    n: usize,
    len: usize,
}

impl<R: AttentionRuntime> RowMap<R> {
    /// The rows of `cu` (`n + 1` validated offsets) on `device`.
    fn new(cu: &[usize], device: &R::Device) -> Result<Self> {
        let (n, total) = (cu.len() - 1, cu[cu.len() - 1]);
        let len = longest(cu);
        let index = |x: usize| i32::try_from(x).expect("rows fit i32 (validated)");
        let mut gather = vec![index(total); n * len];
        let mut scatter = Vec::with_capacity(total);
        for (b, w) in cu.windows(2).enumerate() {
            for (i, row) in (w[0]..w[1]).enumerate() {
                gather[b * len + i] = index(row);
                scatter.push(index(b * len + i));
            }
        }
        Ok(RowMap {
            gather: Tensor::<R>::from_slice(&gather, &[n * len], device)?,
            scatter: Tensor::<R>::from_slice(&scatter, &[total], device)?,
            total,
            n,
            len,
        })
    }

    /// `t [total, H, dim]` as `[n, H, len, dim]`, zeros past each
    /// sequence's rows.
    fn pad(&self, t: &Tensor<R>) -> Result<Tensor<R>> {
        let [total, h, dim] = dims3(t);
        let flat = t.contiguous()?.reshape(&[total, h * dim])?;
        let rows = R::select_rows(&flat, 0, &self.gather)?;
        Ok(rows
            .reshape(&[self.n, self.len, h, dim])?
            .permute(&[0, 2, 1, 3])?)
    }

    /// `t [n, H, len, dim]` as `[total, H, dim]`: each sequence's rows.
    fn unpad(&self, t: &Tensor<R>) -> Result<Tensor<R>> {
        let (h, dim) = (t.shape()[1], t.shape()[3]);
        let rows = t.permute(&[0, 2, 1, 3])?.contiguous()?;
        let rows = rows.reshape(&[self.n * self.len, h * dim])?;
        Ok(R::select_rows(&rows, 0, &self.scatter)?.reshape(&[self.total, h, dim])?)
    }

    /// lse-shaped `t [H, total]` as `[n, H, len]` (zeros past each
    /// sequence's rows, which see nothing and are never read).
    fn pad_lse(&self, t: &Tensor<R>) -> Result<Tensor<R>> {
        let h = t.shape()[0];
        let cols = R::select_rows(&t.contiguous()?, 1, &self.gather)?;
        Ok(cols.reshape(&[h, self.n, self.len])?.permute(&[1, 0, 2])?)
    }

    /// lse-shaped `t [n, H, len]` as `[H, total]`.
    fn unpad_lse(&self, t: &Tensor<R>) -> Result<Tensor<R>> {
        let h = t.shape()[1];
        let cols = t.permute(&[1, 0, 2])?.contiguous()?;
        let cols = cols.reshape(&[h, self.n * self.len])?;
        R::select_rows(&cols, 1, &self.scatter)
    }
}

/// The dims of a rank-3 tensor (validated).
fn dims3<R: Runtime>(t: &Tensor<R>) -> [usize; 3] {
    t.shape().try_into().expect("rank 3 (validated)")
}

/// The longest of the sequences `cu` delimits, at least 1 (so that a batch
/// of empty sequences still has a shape).
fn longest(cu: &[usize]) -> usize {
    cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0).max(1)
}

/// One validated call: the problem the kernels run, `q`, `k` and `v` as
/// they take them, where the keys are, and how the results go back.
#[derive(Debug)]
pub(crate) struct Call<R: Runtime> {
    pub(crate) problem: Problem,
    pub(crate) q: Tensor<R>,
    pub(crate) k: Tensor<R>,
    pub(crate) v: Tensor<R>,
    layout: Layout<R>,
    scales: Option<(Vec<f32>, Vec<f32>)>,
    form: Form<R>,
}

impl<R: AttentionRuntime> Call<R> {
    /// Validate `q` against `keys` for `variant` under `opts`: every rule
    /// of the source, each an [`Error`] naming the value.
    pub(crate) fn new<V: Variant, T: KeyTensor<R>>(
        variant: &V,
        q: &Tensor<R>,
        keys: &Keys<'_, R, T>,
        opts: &AttentionOptions,
    ) -> Result<Self> {
        let (k, v) = keys.kv();
        let (k, v) = (k.tensor(), v.tensor());
        let scale = opts.scale;
        let mut pages = None;
        let (problem, q, k, v, layout, form) = match *keys {
            Keys::Dense { .. } => {
                let shared = shares_keys(q, k, v);
                let (k, v) = widen_shared(q, k, v)?;
                let p = validate::problem(q, &k, &v, scale)?;
                (p, q.clone(), k, v, Layout::Dense, Form::Batched { shared })
            }
            Keys::Cache { lengths, .. } => {
                let p = validate::problem(q, k, v, scale)?;
                let lens = Lengths::per_sequence("lengths", lengths, p.batch, p.seq_k)?;
                let form = Form::Batched { shared: false };
                (
                    p,
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    Layout::Cache(lens),
                    form,
                )
            }
            Keys::Paged {
                page_table,
                lengths,
                cu_seqlens_q,
                ..
            } => {
                // Packed queries: gathered into a padded batch of the
                // sequences, their rows counted as a padded batch's.
                let packed = match cu_seqlens_q {
                    None => None,
                    Some(cu) => {
                        let total = validate::packed_queries(q)?;
                        let n = page_table.shape().first().copied().unwrap_or(0);
                        let cq = Lengths::cumulative("cu_seqlens_q", cu, total, Some(n))?;
                        let map = RowMap::new(&cq.host, q.device())?;
                        Some((map.pad(q)?, Lengths::of_offsets(&cq.host, q.device())?, map))
                    }
                };
                let q = packed
                    .as_ref()
                    .map_or_else(|| q.clone(), |(qp, _, _)| qp.clone());
                let q = &q;
                let (p, page_size) = validate::paged_problem(q, k, v, page_table, scale)?;
                let lens = Lengths::per_sequence("lengths", lengths, p.batch, p.seq_k)?;
                let n_pages = k.shape()[0];
                let host = validate::page_table(page_table, &lens.host, page_size, n_pages)?;
                pages = Some(n_pages);
                let table = Table {
                    tensor: page_table.clone(),
                    host,
                    page_size,
                };
                let (rows, form) = match packed {
                    None => (None, Form::Batched { shared: false }),
                    Some((_, rows, map)) => (Some(rows), Form::QueriesPacked(Box::new(map))),
                };
                let layout = Layout::Paged(lens, table, rows);
                (p, q.clone(), k.clone(), v.clone(), layout, form)
            }
            Keys::Padded {
                q_lengths,
                kv_lengths,
                ..
            } => {
                let p = validate::problem(q, k, v, scale)?;
                let ql = Lengths::per_sequence("q_lengths", q_lengths, p.batch, p.seq_q)?;
                let kl = Lengths::per_sequence("kv_lengths", kv_lengths, p.batch, p.seq_k)?;
                let layout = Layout::Padded { q: ql, kv: kl };
                let form = Form::Batched { shared: false };
                (p, q.clone(), k.clone(), v.clone(), layout, form)
            }
            Keys::Varlen {
                cu_seqlens_q,
                cu_seqlens_k,
                ..
            } => {
                let [tq, tk] = validate::packed_totals(q, k, v)?;
                let cq = Lengths::cumulative("cu_seqlens_q", cu_seqlens_q, tq, None)?;
                let n = cq.host.len() - 1;
                let ck = Lengths::cumulative("cu_seqlens_k", cu_seqlens_k, tk, Some(n))?;
                let (q4, k4, v4) = (unpack(q)?, unpack(k)?, unpack(v)?);
                let p = validate::problem(&q4, &k4, &v4, scale)?;
                if R::PACKED_IN_PLACE {
                    let layout = Layout::Varlen { q: cq, kv: ck };
                    (p, q4, k4, v4, layout, Form::Packed)
                } else {
                    // Gathered into a padded batch of the sequences.
                    let device = q.device();
                    let (mq, mk) = (
                        RowMap::new(&cq.host, device)?,
                        RowMap::new(&ck.host, device)?,
                    );
                    let (qp, kp, vp) = (mq.pad(q)?, mk.pad(k)?, mk.pad(v)?);
                    let p = validate::problem(&qp, &kp, &vp, scale)?;
                    let layout = Layout::Padded {
                        q: Lengths::of_offsets(&cq.host, device)?,
                        kv: Lengths::of_offsets(&ck.host, device)?,
                    };
                    (
                        p,
                        qp,
                        kp,
                        vp,
                        layout,
                        Form::Repacked {
                            q: Box::new(mq),
                            kv: Box::new(mk),
                        },
                    )
                }
            }
        };
        let scales = cache_scales(&k, &v, keys.scales(), pages)?;
        let mut call = Call {
            problem,
            q,
            k,
            v,
            layout,
            scales,
            form,
        };
        // The dropout draw is keyed by the variant's batches and heads.
        let seen = validate::call(variant, call.seen(), opts)?;
        call.problem.dropout = seen.dropout;
        call.problem.max_scores = seen.max_scores;
        Ok(call)
    }

    /// The keys as the backends read them.
    pub(crate) fn keys(&self) -> CallKeys<'_, R> {
        CallKeys {
            k: &self.k,
            v: &self.v,
            layout: self.layout.view(),
            scales: self.scales.as_ref().map(|(k, v)| CacheScales { k, v }),
        }
    }

    /// Whether the keys are fp8 (with their scales).
    pub(crate) fn is_fp8(&self) -> bool {
        self.scales.is_some()
    }

    /// The problem the variant sees (its captured tensors are checked
    /// against it): the kernels', but for packed sequences (see
    /// [`KeyLayout::seen`]).
    pub(crate) fn seen(&self) -> Problem {
        self.layout.view().seen(&self.problem)
    }

    /// A `[.., H, rows, dim]` result of the kernels (`out`, `dq`) in the
    /// caller's layout.
    pub(crate) fn rows_out(&self, t: Tensor<R>) -> Result<Tensor<R>> {
        match &self.form {
            Form::Batched { .. } => Ok(t),
            Form::Packed => Ok(t.squeeze(Some(0)).permute(&[1, 0, 2])?.contiguous()?),
            Form::Repacked { q, .. } | Form::QueriesPacked(q) => q.unpad(&t),
        }
    }

    /// The kernels' forward result in the caller's layout.
    pub(crate) fn output(&self, y: Output<R>) -> Result<Output<R>> {
        Ok(Output {
            out: self.rows_out(y.out)?,
            lse: self.lse_out(y.lse)?,
            max_scores: y.max_scores.map(|m| self.lse_out(m)).transpose()?,
        })
    }

    /// An lse-shaped result of the kernels in the caller's layout.
    pub(crate) fn lse_out(&self, t: Tensor<R>) -> Result<Tensor<R>> {
        match &self.form {
            Form::Batched { .. } => Ok(t),
            Form::Packed => Ok(t.squeeze(Some(0))),
            Form::Repacked { q, .. } | Form::QueriesPacked(q) => q.unpad_lse(&t),
        }
    }

    /// A gradient of the kernels' `k` or `v` in the caller's layout:
    /// summed over the batch where the keys were shared, unpacked where
    /// packed.
    pub(crate) fn keys_out(&self, t: Tensor<R>) -> Result<Tensor<R>> {
        match &self.form {
            Form::Batched { shared: true } => R::sum_batch(&t),
            Form::Batched { shared: false } | Form::QueriesPacked(_) => Ok(t),
            Form::Packed => Ok(t.squeeze(Some(0)).permute(&[1, 0, 2])?.contiguous()?),
            Form::Repacked { kv, .. } => kv.unpad(&t),
        }
    }

    /// A caller's `[.., H, rows, dim]` tensor (`out`, `dout`) as the
    /// kernels take it, checked against the call's shape.
    pub(crate) fn rows_in(&self, name: &'static str, t: &Tensor<R>) -> Result<Tensor<R>> {
        let want = self.problem.out_shape();
        match &self.form {
            Form::Batched { .. } => {
                validate::shape_of(name, t, &want)?;
                Ok(t.clone())
            }
            Form::Packed => {
                validate::shape_of(name, t, &[want[2], want[1], want[3]])?;
                unpack(t)
            }
            Form::Repacked { q, .. } | Form::QueriesPacked(q) => {
                validate::shape_of(name, t, &[q.total, want[1], want[3]])?;
                q.pad(t)
            }
        }
    }

    /// A caller's lse-shaped tensor (`lse`, `dlse`) as the kernels take
    /// it, checked against the call's shape.
    pub(crate) fn lse_in(&self, name: &'static str, t: &Tensor<R>) -> Result<Tensor<R>> {
        let want = self.problem.lse_shape();
        match &self.form {
            Form::Batched { .. } => {
                validate::shape_of(name, t, &want)?;
                Ok(t.clone())
            }
            Form::Packed => {
                validate::shape_of(name, t, &want[1..])?;
                Ok(t.unsqueeze(0)?)
            }
            Form::Repacked { q, .. } | Form::QueriesPacked(q) => {
                validate::shape_of(name, t, &[want[1], q.total])?;
                q.pad_lse(t)
            }
        }
    }
}

/// `k` and `v` of batch 1 with `q` of a larger batch: keys every sequence
/// shares.
pub(crate) fn shares_keys<R: Runtime>(q: &Tensor<R>, k: &Tensor<R>, v: &Tensor<R>) -> bool {
    let batch = |t: &Tensor<R>| (t.ndim() == 4).then(|| t.shape()[0]);
    matches!((batch(q), batch(k), batch(v)), (Some(b), Some(1), Some(1)) if b != 1)
}

/// `t [1, ..]` broadcast to `q`'s batch (a zero stride).
fn widen<R: Runtime>(q: &Tensor<R>, t: &Tensor<R>) -> Result<Tensor<R>> {
    let s = t.shape();
    Ok(t.broadcast_to(&[q.shape()[0], s[1], s[2], s[3]])?)
}

/// `k` and `v` as `q`'s batch sees them: broadcast where shared
/// ([`shares_keys`]), else themselves.
pub(crate) fn widen_shared<R: Runtime>(
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
) -> Result<(Tensor<R>, Tensor<R>)> {
    if shares_keys(q, k, v) {
        Ok((widen(q, k)?, widen(q, v)?))
    } else {
        Ok((k.clone(), v.clone()))
    }
}

/// A packed `[total, H, dim]` tensor as the kernels' `[1, H, total, dim]`
/// (a view).
fn unpack<R: Runtime>(t: &Tensor<R>) -> Result<Tensor<R>> {
    Ok(t.permute(&[1, 0, 2])?.unsqueeze(0)?)
}

impl<R: Runtime<DType = DType>> Lengths<R> {
    /// `[batch]` `i32` counts, each in `0 ..= max`.
    fn per_sequence(name: &'static str, t: &Tensor<R>, batch: usize, max: usize) -> Result<Self> {
        let values = index_values(name, t, &[batch])?;
        let host = values
            .iter()
            .enumerate()
            .map(|(b, &l)| {
                usize::try_from(l)
                    .ok()
                    .filter(|&l| l <= max)
                    .ok_or(Error::Lengths {
                        name,
                        rule: "each length lies in 0 ..=",
                        at: b,
                        value: i64::from(l),
                        bound: max,
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Lengths {
            tensor: t.clone(),
            host,
        })
    }

    /// `[n + 1]` `i32` offsets: 0, non-decreasing, ending at `total`; `n`
    /// sequences where given.
    fn cumulative(
        name: &'static str,
        t: &Tensor<R>,
        total: usize,
        n: Option<usize>,
    ) -> Result<Self> {
        let shape = t.shape();
        if shape.len() != 1 || shape[0] < 1 || n.is_some_and(|n| shape[0] != n + 1) {
            return Err(Error::ShapeOf {
                name,
                expected: vec![n.map_or(2, |n| n + 1)],
                got: shape.to_vec(),
            });
        }
        let values = index_values(name, t, &[shape[0]])?;
        let bad = |at: usize, rule, bound| Error::Lengths {
            name,
            rule,
            at,
            value: i64::from(values[at]),
            bound,
        };
        if values[0] != 0 {
            return Err(bad(0, "the first offset is", 0));
        }
        let mut host = Vec::with_capacity(values.len());
        for (at, &x) in values.iter().enumerate() {
            let prev = host.last().copied().unwrap_or(0);
            match usize::try_from(x) {
                Ok(x) if x >= prev && x <= total => host.push(x),
                Ok(x) if x < prev => {
                    return Err(bad(at, "each offset is at least the one before,", prev));
                }
                _ => return Err(bad(at, "each offset lies in 0 ..= the packed rows,", total)),
            }
        }
        let last = values.len() - 1;
        if host[last] != total {
            return Err(bad(
                last,
                "the last offset is the packed rows' count,",
                total,
            ));
        }
        Ok(Lengths {
            tensor: t.clone(),
            host,
        })
    }
}

impl<R: Runtime<DType = DType>> Lengths<R> {
    /// The lengths of the sequences `cu` delimits, as a `[n]` `i32` tensor
    /// on `device` and as values.
    fn of_offsets(cu: &[usize], device: &R::Device) -> Result<Self> {
        let host: Vec<usize> = cu.windows(2).map(|w| w[1] - w[0]).collect();
        let values: Vec<i32> = host.iter().map(|&l| l as i32).collect();
        Ok(Lengths {
            tensor: Tensor::<R>::from_slice(&values, &[values.len()], device)?,
            host,
        })
    }
}

/// The values of an `i32` index tensor of shape `shape`.
pub(crate) fn index_values<R: Runtime<DType = DType>>(
    name: &'static str,
    t: &Tensor<R>,
    shape: &[usize],
) -> Result<Vec<i32>> {
    if t.dtype() != DType::I32 {
        return Err(Error::CacheIndexDType {
            name,
            got: t.dtype(),
        });
    }
    if t.shape() != shape {
        return Err(Error::ShapeOf {
            name,
            expected: shape.to_vec(),
            got: t.shape().to_vec(),
        });
    }
    if shape.iter().any(|&n| n > MAX_INDEX) {
        return Err(Error::TooLarge {
            name,
            value: shape.iter().copied().max().unwrap_or(0),
            max: MAX_INDEX,
        });
    }
    Ok(t.contiguous()?.to_vec::<i32>())
}

impl<R: Runtime> Layout<R> {
    fn view(&self) -> KeyLayout<'_, R> {
        match self {
            Layout::Dense => KeyLayout::Dense,
            Layout::Cache(l) => KeyLayout::Cache(l.view()),
            Layout::Paged(l, t, q) => KeyLayout::Paged(
                l.view(),
                PageTable {
                    tensor: &t.tensor,
                    host: &t.host,
                    page_size: t.page_size,
                },
                q.as_ref().map(Lengths::view),
            ),
            Layout::Padded { q, kv } => KeyLayout::Padded {
                q: q.view(),
                kv: kv.view(),
            },
            Layout::Varlen { q, kv } => KeyLayout::Varlen(SeqMap {
                q: q.view(),
                kv: kv.view(),
            }),
        }
    }
}

impl<R: Runtime> Lengths<R> {
    fn view(&self) -> CacheLengths<'_, R> {
        CacheLengths {
            tensor: &self.tensor,
            host: &self.host,
        }
    }
}

/// A quantised cache's dtype (the only ones a cache's scales apply to):
/// fp8, or int8 (on the CPU).
pub(crate) fn is_quantised(dtype: DType) -> bool {
    matches!(dtype, DType::FP8E4M3 | DType::FP8E5M2 | DType::I8)
}

/// The values of an fp8 cache's scales (K's, V's), checked against `k` and
/// `v` (`[B or pages, Hkv, .., ..]`): fp8 keys and values need scales and
/// others take none; each scale tensor is `f32`, `[Hkv]` for
/// [`KvScales::PerHead`] or, for a paged cache of `pages` pages (`paged`),
/// `[pages, Hkv]` for [`KvScales::PerPage`]; every scale finite and not
/// negative.
pub(crate) fn cache_scales<R: Runtime<DType = DType>>(
    k: &Tensor<R>,
    v: &Tensor<R>,
    scales: Option<KvScales<'_, R>>,
    paged: Option<usize>,
) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
    let err = |rule, got: String| Err(Error::CacheScales { rule, got });
    let dtypes = format!("k {:?}, v {:?}", k.dtype(), v.dtype());
    let (k_q, v_q) = (is_quantised(k.dtype()), is_quantised(v.dtype()));
    let Some(scales) = scales else {
        if k_q || v_q {
            return err("an fp8 or int8 cache needs its scales (KvScales)", dtypes);
        }
        return Ok(None);
    };
    if !(k_q && v_q) {
        return err(
            "scales apply to fp8 caches and int8 caches: k and v both FP8E4M3, FP8E5M2 or I8",
            dtypes,
        );
    }
    if k.dtype() != v.dtype() {
        return err("k and v of an fp8 or int8 cache share one format", dtypes);
    }
    let hkv = k.shape().get(1).copied().unwrap_or(0);
    let (ks, vs, shape) = match scales {
        KvScales::PerHead { k, v } => (k, v, vec![hkv]),
        KvScales::PerPage { k, v } => match paged {
            Some(pages) => (k, v, vec![pages, hkv]),
            None => {
                return err(
                    "scales per page need pages (Keys::paged); use PerHead",
                    "PerPage".into(),
                );
            }
        },
    };
    let mut values = Vec::with_capacity(2);
    for (name, t) in [("k", ks), ("v", vs)] {
        if t.dtype() != DType::F32 {
            return err(
                "scales are f32",
                format!("{name} scales of {:?}", t.dtype()),
            );
        }
        if t.shape() != shape.as_slice() {
            let rule = if shape.len() == 1 {
                "per-head scales are [Hkv]"
            } else {
                "per-page scales are [pages, Hkv]"
            };
            return err(
                rule,
                format!("{name} scales of shape {:?}, want {shape:?}", t.shape()),
            );
        }
        let host = t.contiguous()?.to_vec::<f32>();
        if let Some(bad) = host.iter().position(|x| !(x.is_finite() && *x >= 0.0)) {
            return err(
                "every scale is finite and not negative",
                format!("{name} scale {bad} = {}", host[bad]),
            );
        }
        values.push(host);
    }
    let v = values.pop().expect("two");
    Ok(Some((values.pop().expect("two"), v)))
}
