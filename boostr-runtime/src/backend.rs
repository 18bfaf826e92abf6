//! The numr runtimes that attention runs on. Each backend owns its launch
//! (the CPU's in [`crate::cpu`], the GPUs' in their modules): there is no
//! dispatch table over targets in shared code. What they share is the
//! description of a call: the problem, and where its keys are
//! ([`CallKeys`]), one type for every key layout, so that a new layout is
//! written once per backend, not once per entry point.

use crate::error::Result;
use crate::problem::Problem;
use crate::variant::Variant;
use numr::dtype::DType;
use numr::ops::{IndexingOps, ReduceOps, ShapeOps};
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// A numr runtime with fused attention kernels. (`Debug`, as numr's
/// runtimes are: a variant generic over its runtime derives `Debug`, which
/// then holds for every `R: AttentionRuntime`.)
pub trait AttentionRuntime:
    Runtime<DType = DType, Client: ReduceOps<Self> + IndexingOps<Self> + ShapeOps<Self>>
    + std::fmt::Debug
    + sealed::Sealed
{
    /// Whether `comm` reads and writes this runtime's tensors where they
    /// are: the CPU's with any communicator, CUDA's with NCCL. Where it
    /// does not (wgpu's, or CUDA's over a host communicator), ring
    /// attention stages its traffic through host memory.
    fn communicator_reads_tensors(comm: &dyn numr::runtime::Communicator) -> bool {
        let _ = comm;
        false
    }

    /// Run the forward kernel on validated inputs, its keys laid out as
    /// `keys.layout` says (every backend runs every layout); returns `out`,
    /// `lse` and, where [`Problem::max_scores`] asks, each row's largest
    /// score, in the kernels' layout.
    fn attention_forward<V: Variant>(
        variant: &V,
        problem: &Problem,
        q: &Tensor<Self>,
        keys: CallKeys<'_, Self>,
    ) -> Result<crate::op::Output<Self>>;

    /// Run the backward kernels on validated inputs; returns `dq, dk, dv`
    /// (`dk, dv` shaped as the keys) and the gradient of each learnable
    /// tensor that [`BackwardTensors::tensor_grads`] asks for.
    fn attention_backward<V: Variant>(
        variant: &V,
        problem: &Problem,
        tensors: BackwardTensors<'_, Self>,
    ) -> Result<AttentionGrads<Self>>;

    /// Write new keys and values into a cache's rows, in place, as the
    /// validated `write` says ([`crate::append_kv`]).
    fn write_kv(write: &KvWrite<'_, Self>) -> Result<()>;

    /// `t [B, ..]` summed over its batch into `[1, ..]`: the gradient of
    /// keys shared by every sequence of a batch.
    fn sum_batch(t: &Tensor<Self>) -> Result<Tensor<Self>> {
        Ok(Self::default_client(t.device()).sum(t, &[0], true)?)
    }

    /// Whether the kernels read packed sequences in place, as one row of
    /// the kernels ([`KeyLayout::Varlen`]); where they do not, a packed
    /// call gathers its sequences into a padded batch
    /// ([`KeyLayout::Padded`]) and its results back.
    const PACKED_IN_PLACE: bool = false;

    /// The entries `index` (`i32`, on the device) of `t` along `dim`, an
    /// index equal to `t`'s extent there selecting zeros.
    fn select_rows(t: &Tensor<Self>, dim: usize, index: &Tensor<Self>) -> Result<Tensor<Self>> {
        let mut zero = t.shape().to_vec();
        zero[dim] = 1;
        let zero = Tensor::<Self>::zeros(&zero, t.dtype(), t.device())?;
        let with_zero = Tensor::cat(&[t, &zero], dim as isize)?;
        Ok(with_zero.index_select(dim, index)?)
    }
}

/// The runtimes with attention kernels, this crate's: a runtime of its
/// own needs its kernels written here.
mod sealed {
    pub trait Sealed {}
    impl Sealed for numr::runtime::cpu::CpuRuntime {}
    #[cfg(feature = "wgpu")]
    impl Sealed for numr::runtime::wgpu::WgpuRuntime {}
    #[cfg(feature = "cuda")]
    impl Sealed for numr::runtime::cuda::CudaRuntime {}
}

/// A call's validated keys and values, and which slots hold which
/// sequence's keys.
#[derive(Debug)]
pub struct CallKeys<'a, R: Runtime> {
    /// `k [B, Hkv, Sk, D]`, or `[pages, Hkv, page_size, D]` when paged.
    pub k: &'a Tensor<R>,
    /// `v`, laid out as `k` but for its last dim, `Dv`.
    pub v: &'a Tensor<R>,
    /// Where sequence `b`'s key `j` is.
    pub layout: KeyLayout<'a, R>,
    /// An fp8 cache's validated dequantization scales (`None` for other
    /// element types).
    pub scales: Option<CacheScales<'a>>,
}

/// The validated scales of an fp8 KV cache, on the host: a stored value of
/// `k` is worth its fp8 value times `k[h]` (`[Hkv]`, per kv head) or
/// `k[page · Hkv + h]` (`[pages, Hkv]`, per page and kv head); `v` alike.
#[derive(Clone, Copy, Debug)]
pub struct CacheScales<'a> {
    /// K's scales.
    pub k: &'a [f32],
    /// V's scales.
    pub v: &'a [f32],
}

/// Where sequence `b`'s key `j` is in a call's `k` and `v`.
#[derive(Debug)]
pub enum KeyLayout<'a, R: Runtime> {
    /// Slot `j` of `k, v [B, Hkv, Sk, D]`: every sequence has all `Sk`
    /// keys.
    Dense,
    /// Slot `j` of `k, v [B, Hkv, capacity, D]` (`Sk` is the capacity),
    /// for `j < lengths.host[b]` (see [`Keys::Cache`](crate::Keys::Cache)).
    Cache(CacheLengths<'a, R>),
    /// Slot `j % page_size` of page `table.host[b · max_pages + j /
    /// page_size]` of `k, v [pages, Hkv, page_size, D]`, for `j <
    /// lengths.host[b]` (`Sk` is `max_pages · page_size`; see
    /// [`Keys::Paged`](crate::Keys::Paged)).
    ///
    /// With query lengths (packed queries over pages, gathered into a
    /// padded batch), query rows `i < q.host[b]` of `q [B, Hq, Sq, D]`
    /// at position `i + lengths.host[b] − q.host[b]`, as a padded batch's.
    Paged(
        CacheLengths<'a, R>,
        PageTable<'a, R>,
        Option<CacheLengths<'a, R>>,
    ),
    /// A right-padded batch: slot `j` of `k, v [B, Hkv, Sk, D]` for `j <
    /// kv.host[b]`, and query rows `i < q.host[b]` of `q [B, Hq, Sq, D]`,
    /// row `i` at position `i + kv.host[b] − q.host[b]`; the other rows
    /// see no key (and carry no sink).
    Padded {
        /// Query rows per sequence, each at most `Sq`.
        q: CacheLengths<'a, R>,
        /// Keys per sequence, each at most `Sk`.
        kv: CacheLengths<'a, R>,
    },
    /// Packed sequences, as one row of the kernels (`B = 1`, `Sq` and
    /// `Sk` the packed totals): query row `t` belongs to the sequence `b`
    /// with `q[b] <= t < q[b + 1]` and sees the keys `kv[b] .. kv[b + 1]`
    /// only, the variant seeing batch `b` at the sequence's own positions
    /// (see [`SeqMap`]).
    Varlen(SeqMap<'a, R>),
}

/// The sequences of a packed call: the `cu_seqlens` of its queries and
/// keys (`n + 1` offsets each).
#[derive(Debug)]
pub struct SeqMap<'a, R: Runtime> {
    /// The queries' offsets.
    pub q: CacheLengths<'a, R>,
    /// The keys' offsets.
    pub kv: CacheLengths<'a, R>,
}

/// The validated per-sequence key lengths of a KV cache: the `[B]` `i32`
/// tensor on the call's device, and its values on the host (each in
/// `0 ..= capacity`).
#[derive(Debug)]
pub struct CacheLengths<'a, R: Runtime> {
    /// The lengths as given.
    pub tensor: &'a Tensor<R>,
    /// Their values.
    pub host: &'a [usize],
}

/// The validated page table of a paged KV cache.
#[derive(Debug)]
pub struct PageTable<'a, R: Runtime> {
    /// The `[B, max_pages]` `i32` page table as given.
    pub tensor: &'a Tensor<R>,
    /// Its values, every entry a length reaches a valid page (the others
    /// 0, never read).
    pub host: &'a [usize],
    /// Keys per page.
    pub page_size: usize,
}

impl<'a, R: Runtime> KeyLayout<'a, R> {
    /// The keys each sequence holds of its slots: a cache's (paged or not)
    /// and a padded batch's.
    pub fn lengths(&self) -> Option<CacheLengths<'a, R>> {
        match *self {
            Self::Dense | Self::Varlen(_) => None,
            Self::Cache(lengths) | Self::Paged(lengths, ..) | Self::Padded { kv: lengths, .. } => {
                Some(lengths)
            }
        }
    }

    /// The query rows each sequence holds of its padded rows.
    pub fn query_lengths(&self) -> Option<CacheLengths<'a, R>> {
        match *self {
            Self::Padded { q, .. } | Self::Paged(_, _, Some(q)) => Some(q),
            _ => None,
        }
    }

    /// The problem the variant's functions see in a call of problem `p`
    /// over these keys, which its captured tensors are checked against:
    /// `p`, but for packed sequences, whose variant sees `n` sequences (its
    /// batch) of at most the longest one's query rows and keys.
    pub fn seen(&self, p: &Problem) -> Problem {
        match *self {
            Self::Varlen(map) => {
                // At least 1 each, so that a batch of empty sequences
                // still has a shape.
                let longest = |cu: &[usize]| {
                    let most = cu.windows(2).map(|w| w[1] - w[0]).max();
                    most.unwrap_or(0).max(1)
                };
                Problem {
                    batch: map.q.host.len().saturating_sub(1).max(1),
                    seq_q: longest(map.q.host),
                    seq_k: longest(map.kv.host),
                    ..*p
                }
            }
            _ => *p,
        }
    }

    /// The sequences of a packed call.
    pub fn packed(&self) -> Option<SeqMap<'a, R>> {
        match *self {
            Self::Varlen(map) => Some(map),
            _ => None,
        }
    }

    /// The page table, for a paged cache.
    pub fn pages(&self) -> Option<PageTable<'a, R>> {
        match *self {
            Self::Paged(_, table, _) => Some(table),
            _ => None,
        }
    }
}

/// A validated write of new keys and values into a KV cache's rows (see
/// [`crate::append_kv`]): the same pairs of rows for `k` and `v`, in
/// groups that share a scale.
#[derive(Debug)]
pub struct KvWrite<'a, R: Runtime> {
    /// The cache's keys (a cache or pages), contiguous: rows of `D`.
    pub k: &'a Tensor<R>,
    /// The cache's values, contiguous: rows of `Dv`.
    pub v: &'a Tensor<R>,
    /// The new keys, contiguous: rows of `D`, f32, f16 or bf16.
    pub k_new: &'a Tensor<R>,
    /// The new values, contiguous, of `k_new`'s dtype: rows of `Dv`.
    pub v_new: &'a Tensor<R>,
    /// Per group: its first pair, its end pair, its scale's index (or −1
    /// without scales), and the first row of the page whose rows are
    /// requantised when its scale grows (or −1).
    pub groups: &'a [[i32; 4]],
    /// Per pair: the new row (of `k_new`, `v_new`) and the cache row it
    /// goes to; every destination row once.
    pub pairs: &'a [[i32; 2]],
    /// Rows per page (what a growing scale requantises).
    pub page_rows: usize,
    /// An fp8 cache's scales.
    pub scales: Option<WriteScales<'a, R>>,
}

/// The scales an fp8 cache write quantises with (`f32`, one per group's
/// scale index).
#[derive(Debug)]
pub struct WriteScales<'a, R: Runtime> {
    /// K's scales.
    pub k: &'a Tensor<R>,
    /// V's scales.
    pub v: &'a Tensor<R>,
    /// Scales per page, which grow to each write's largest value (written
    /// back in place); otherwise scales per head, fixed, and values past
    /// their range saturate.
    pub grow: bool,
}

impl<R: Runtime> Clone for WriteScales<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: Runtime> Copy for WriteScales<'_, R> {}

/// What the backward returns: the gradients of the loss with respect to
/// `q, k, v`, and to the variant's learnable tensors.
#[derive(Debug)]
#[non_exhaustive]
pub struct AttentionGrads<R: Runtime> {
    /// `d loss / d q [B, Hq, Sq, D]`.
    pub dq: Tensor<R>,
    /// `d loss / d k`, shaped as `k`.
    pub dk: Tensor<R>,
    /// `d loss / d v`, shaped as `v`.
    pub dv: Tensor<R>,
    /// Per learnable tensor, in slot order ([`Variant::LEARNABLE`]): its
    /// gradient (f32, its shape), or `None` where it was not asked for.
    pub tensors: Vec<Option<Tensor<R>>>,
}

/// What the backward reads: the forward's inputs and results, and the
/// gradient of the loss with respect to `out`. Shapes as in [`Problem`].
#[derive(Debug)]
pub struct BackwardTensors<'a, R: Runtime> {
    /// `q [B, Hq, Sq, D]`.
    pub q: &'a Tensor<R>,
    /// The keys and values, in any layout: over a cache, `k, v` (and `dk,
    /// dv`) hold `Sk` slots per sequence, of which sequence `b` has
    /// `lengths.host[b]`, and spare slots get zero gradients; over pages,
    /// `dk, dv` are shaped as the pages, each page's gradient the sum of
    /// its readers'.
    pub keys: CallKeys<'a, R>,
    /// The forward's `out [B, Hq, Sq, Dv]`.
    pub out: &'a Tensor<R>,
    /// The forward's `lse [B, Hq, Sq]` (f32).
    pub lse: &'a Tensor<R>,
    /// `d loss / d out [B, Hq, Sq, Dv]`.
    pub dout: &'a Tensor<R>,
    /// `d loss / d lse [B, Hq, Sq]` (f32) where the loss reads the
    /// forward's lse too (a merge of partial attentions by lse): it joins
    /// every row's `D_i` as `D_i − dlse_i`, since `∂lse_i / ∂z_ij = P_ij`.
    /// `None` is a zero gradient.
    pub dlse: Option<&'a Tensor<R>>,
    /// Which learnable tensors' gradients to compute, by slot
    /// ([`Variant::LEARNABLE`]); missing slots are not computed (`&[]`: no
    /// tensor gradient, no extra work).
    pub tensor_grads: &'a [bool],
}

// Borrowed views: `Copy` whatever the runtime (a derive would ask `R:
// Copy`).
macro_rules! copy_views {
    ($($view:ident),*) => {$(
        impl<R: Runtime> Clone for $view<'_, R> {
            fn clone(&self) -> Self {
                *self
            }
        }

        impl<R: Runtime> Copy for $view<'_, R> {}
    )*};
}

copy_views!(
    CallKeys,
    KeyLayout,
    CacheLengths,
    PageTable,
    SeqMap,
    BackwardTensors
);
