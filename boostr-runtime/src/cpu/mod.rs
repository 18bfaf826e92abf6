//! Fused attention kernels for the CPU: FlashAttention-2 forward and backward
//! over contiguous f32 slices, generic over the variant's [`HostVariant`]
//! functions so that `score`,
//! `score_grad`, `mask` and `classify_tile` inline into the tile loops.
//!
//! Element types: the kernels compute in f32. f16 tensors, and bf16 ones
//! where the bf16 kernels below do not run, are widened to f32 by the CPU
//! backend (exactly) and the results rounded once. The bf16 forward and
//! backward run on bf16 tile products (`amx_forward`: `Q Kᵀ` and `P V`,
//! `P` rounded to bf16; `amx_backward`: its five products, `P` and
//! `scale·dS` rounded to bf16; the rest f32) where [`bf16_tiles`] says so:
//! the head dim is at most 256 (padded inside to a multiple of 32), and the CPU has
//! AMX-BF16 with the tile state granted by Linux (`tdpbf16ps`), or, without
//! AMX, is an AMD CPU with AVX512-BF16 (Zen 4/5: `vdpbf16ps` at the f32
//! FMA rate, twice the products per cycle; `bf16_dot`). Intel's
//! `vdpbf16ps` issues at half that rate, no faster than the f32 kernels,
//! so an Intel CPU without AMX widens. The choice is made per call from
//! CPUID, and tests cap it to run each path (the `vdpbf16ps` one on any
//! CPU that has the instruction) and the widened one.
//!
//! Layout and semantics are those of [`Problem`]: `q, out [B, Hq, Sq, D]`,
//! `k, v [B, Hkv, Sk, D]`, `lse [B, Hq, Sq]`, query head `h` reads kv head
//! `h / (Hq / Hkv)`, query row `i` sits at position `i + Sk − Sq`.
//!
//! How the work is organised (see each module for details):
//! - `tile`: [`CpuTiles`], the tile sizes and why.
//! - `forward`: one task per (batch, query head, query tile, or group of
//!   query tiles for long sequences), key/value tiles streamed through with
//!   an online softmax.
//! - `backward`: one task per (batch, kv head, chunk of key tiles), query
//!   tiles streamed through; dQ reduced in a fixed order for determinism.
//! - `gemm`: the tile products: bounds-checked views, and `microkernel` (an
//!   AVX-512 register-blocked kernel that needs no packing) or the `gemm` crate
//!   where AVX-512 is missing; single-threaded per task.
//! - `math`: vectorizable `exp` and row reductions for the softmax.
//! - `simd`: runtime AVX2/AVX-512 dispatch of the softmax passes.
//!
//! Guarantees, for finite inputs:
//! - Every element of every output slice is written (they may arrive
//!   uninitialised or poisoned).
//! - No NaN: a query row with no visible key gets `out = 0`, `lse = -inf`,
//!   `dq = 0`, and contributes nothing to `dk`/`dv`; logits of any finite
//!   magnitude are handled by the running max.
//! - Extra memory is never `O(Sq × Sk)`: the forward uses one transposed
//!   copy of K plus per-task tile scratch; the backward `D_i` per query row,
//!   the dQ partials (`O(Sq·D·group)` per extra key chunk, none when
//!   `B·Hkv ≥ 2·threads`) and per-task tile scratch.
//! - Tiles that `classify_tile` proves `Empty` are skipped without any
//!   arithmetic; `Full` tiles never evaluate the mask.
//! - Deterministic: the forward always, and the backward for a given rayon
//!   thread count (its key chunking depends on it), give the same bits from
//!   run to run; no summation order depends on scheduling. With learnable
//!   tensors the backward's chunking is fixed by the shape, and every
//!   gradient has the same bits for any thread count. The elementwise
//!   passes agree bit for bit on every instruction set; the tile products
//!   use our AVX-512 kernel (`microkernel`) where the CPU has AVX-512 and
//!   the `gemm` crate elsewhere, which round differently.

pub(crate) mod aligned;
mod amx;
mod amx_backward;
mod amx_forward;
mod backward;
mod bf16_dot;
mod cached;
mod decode;
mod dropout;
mod elem;
mod forward;
mod gemm;
mod gemv;
#[doc(hidden)] // public for the code `#[attention]` generates (`score` in f32)
pub mod math;
#[cfg(target_arch = "x86_64")]
mod microkernel;
mod operand;
pub(crate) mod par;
mod runtime;
mod simd;
mod threads;
mod tile;
pub(crate) mod weights;

#[cfg(test)]
pub(crate) mod tests;

pub use aligned::release_pool;
pub use elem::KvElem;
#[doc(hidden)] // for the benchmark examples
pub use gemm::{time_amx_peak, time_fma_peak, time_fma_peak_all, time_tile_products};
pub use threads::pin_threads;
pub use tile::CpuTiles;

use crate::error::Result;
use crate::problem::Problem;
use crate::variant::{HostVariant, TileClass, Variant};
use aligned::Aligned;
use operand::Operand;
use par::in_pool;

/// The tensors the backward reads; all contiguous, in the layout of
/// [`Problem`] (`out`, `dout` like `q`; `lse` as the forward wrote it), of
/// element type `E` but `lse` (f32).
#[derive(Clone, Copy, Debug)]
pub struct BackwardInputs<'a, E = f32> {
    /// Queries `[B, Hq, Sq, D]`.
    pub q: &'a [E],
    /// Keys `[B, Hkv, Sk, D]`.
    pub k: &'a [E],
    /// Values `[B, Hkv, Sk, D]`.
    pub v: &'a [E],
    /// The forward's output `[B, Hq, Sq, D]`.
    pub out: &'a [E],
    /// The forward's log-sum-exp `[B, Hq, Sq]` (`-inf` for fully masked rows).
    pub lse: &'a [f32],
    /// Gradient of the loss with respect to `out`, `[B, Hq, Sq, D]`.
    pub dout: &'a [E],
}

/// Attention forward with the variant's [`CpuTiles`]: writes `out` and `lse`.
///
/// The variant's captured tensors are checked against `p` and read on the
/// host first ([`Variant::host`]); an index out of range in a checked read
/// is the `Err` of the call (and `out`, `lse` are then unspecified).
pub fn forward<V: Variant>(
    variant: &V,
    p: &Problem,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    forward_stored(variant, p, q, k, v, out, lse)
}

/// `run` on the variant's tensors read on the host for `p`
/// ([`Variant::host`]); an index out of range in one of `run`'s checked
/// reads is the `Err`.
fn on_host<V: Variant, R>(variant: &V, p: &Problem, run: impl FnOnce(&V::Host) -> R) -> Result<R> {
    let host = variant.host(p)?;
    let ran = run(&host);
    host.out_of_range().map_or(Ok(ran), Err)
}

/// Whether [`forward`] runs `p` on the decode kernel (at most 32 query rows
/// per head; split-KV, GQA packed), which also reads 16-bit keys and values
/// as stored ([`forward_cache`]).
pub fn is_decode(p: &Problem) -> bool {
    decode::applies(p)
}

/// Whether [`forward_bf16`] (and, without learnable gradients of `score`'s
/// tensors, [`backward_bf16`]) runs `p` on this CPU: it has AMX-BF16 (and
/// the OS grants the process its tiles) or is an AMD CPU with AVX512-BF16,
/// and the head dim is at most 256.
pub fn bf16_tiles(p: &Problem) -> bool {
    amx_forward::applies(p)
}

/// What a forward reads, as stored: `q`, `k` and `v` in one element type,
/// each `[.., heads, rows, dim]` with contiguous rows and any distance
/// between rows, heads and batches; `k` and `v` over a KV cache's slots or
/// pages where `cache` says (then `[pages, Hkv, page_size, dim]` when
/// paged).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ForwardInputs<'a> {
    pub(crate) q: Operand<'a>,
    pub(crate) k: Operand<'a>,
    pub(crate) v: Operand<'a>,
    pub(crate) cache: Option<CacheLayout<'a>>,
}

impl<'a> ForwardInputs<'a> {
    /// Contiguous `q`, and `k`, `v` in the layout of `p` or of `cache`
    /// (pages of `[Hkv, page_size, D]`, checked against `p` by the decode
    /// kernel).
    ///
    /// # Panics
    /// If a slice's length disagrees with `p`.
    fn packed<Q: KvElem, E: KvElem>(
        p: &Problem,
        q: &'a [Q],
        (k, v): (&'a [E], &'a [E]),
        cache: Option<CacheLayout<'a>>,
    ) -> Self {
        assert_eq!(q.len(), p.q_len(), "q length");
        let pages = cache.and_then(|c| c.pages);
        if pages.is_none() {
            assert_eq!((k.len(), v.len()), (p.k_len(), p.v_len()), "k/v length");
        }
        let rows = pages.map_or(p.seq_k, |pages| pages.page_size.max(1));
        Self {
            q: Operand::packed(Q::stored(q), [p.heads_q, p.seq_q, p.head_dim]),
            k: Operand::packed(E::stored(k), [p.heads_kv, rows, p.head_dim]),
            v: Operand::packed(E::stored(v), [p.heads_kv, rows, p.head_dim_v]),
            cache,
        }
    }
}

/// The output slices of a forward have the problem's lengths.
fn check_outputs(p: &Problem, out: &[f32], lse: &[f32]) {
    assert_eq!(out.len(), p.out_len(), "out length");
    assert_eq!(lse.len(), p.lse_len(), "lse length");
}

/// The forward of [`ForwardInputs`], reading each as stored: the decode
/// kernel over a cache, for decode shapes, or where `chunks` (keys per
/// (batch, kv head) cut into that many chunks) is given; else the tile
/// kernel.
fn forward_inputs<V: HostVariant>(
    variant: &V,
    p: &Problem,
    (tiles, chunks): (CpuTiles, Option<usize>),
    x: ForwardInputs<'_>,
    out: &mut [f32],
    lse: &mut [f32],
) {
    check_outputs(p, out, lse);
    let tiles = CpuTiles::new(tiles.q, tiles.kv);
    let threads = rayon::current_num_threads();
    if x.cache.is_none() && chunks.is_none() && !decode::applies(p) {
        let group = forward::group_size(variant, p, tiles, threads);
        return in_pool(|| forward::forward(variant, p, tiles, group, x.q, x.k, x.v, out, lse));
    }
    // The decode kernel packs a GQA group's query rows, as contiguous f32:
    // a call's few rows, widened (or gathered) first unless they are.
    let wide;
    let q = match x.q.contiguous().and_then(|q| q.as_f32()) {
        Some(q) => q,
        None => {
            let mut w = Aligned::<f32>::scratch(p.q_len());
            x.q.widen(&mut w);
            wide = w;
            &wide[..]
        }
    };
    let keys = match x.cache {
        Some(cache) => cache.keys(p, x.k, x.v),
        None => decode::Keys::Contiguous { k: x.k, v: x.v },
    };
    let chunks = chunks.unwrap_or_else(|| decode::chunks(p, tiles, threads));
    let lens = x.cache.map(|c| c.lens);
    in_pool(|| decode::forward(variant, p, tiles, chunks, lens, q, keys, out, lse));
}

/// Attention forward over bf16 `q, k, v` with bf16 tile products (AMX, or
/// `vdpbf16ps`; see `amx_forward`: `P` rounded to bf16 before `P V`,
/// everything else f32), where [`bf16_tiles`] holds. Returns `Ok(false)`,
/// writing nothing, where it does not: the caller then widens the inputs
/// for [`forward`].
pub fn forward_bf16<V: Variant>(
    variant: &V,
    p: &Problem,
    q: &[half::bf16],
    k: &[half::bf16],
    v: &[half::bf16],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<bool> {
    let x = ForwardInputs::packed(p, q, (k, v), None);
    forward_bf16_inputs(variant, p, x, out, lse)
}

/// [`forward_bf16`] of bf16 [`ForwardInputs`] without a cache.
pub(crate) fn forward_bf16_inputs<V: Variant>(
    variant: &V,
    p: &Problem,
    x: ForwardInputs<'_>,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<bool> {
    assert!(x.cache.is_none(), "the bf16 tile forward reads dense keys");
    check_outputs(p, out, lse);
    if !amx_forward::applies(p) {
        return Ok(false);
    }
    on_host(variant, p, |host| {
        in_pool(|| amx_forward::forward(host, p, x.q, x.k, x.v, out, lse))
    })?;
    Ok(true)
}

/// Attention forward with explicit tile sizes (for tuning and tests).
#[allow(clippy::too_many_arguments)]
pub fn forward_tiled<V: HostVariant>(
    variant: &V,
    p: &Problem,
    tiles: CpuTiles,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
) {
    let x = ForwardInputs::packed(p, q, (k, v), None);
    forward_inputs(variant, p, (tiles, None), x, out, lse);
}

/// [`forward`] over `q`, `k` and `v` in one element type, read as stored:
/// a 16-bit tensor is widened a tile (or a kv head of V) at a time inside
/// the kernels, never copied whole (the decode kernel widens only the
/// query rows).
pub fn forward_stored<V: Variant, E: KvElem>(
    variant: &V,
    p: &Problem,
    q: &[E],
    k: &[E],
    v: &[E],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let x = ForwardInputs::packed(p, q, (k, v), None);
    forward_stored_inputs(variant, p, x, out, lse)
}

/// [`forward_stored`] or [`forward_cache`] of [`ForwardInputs`].
pub(crate) fn forward_stored_inputs<V: Variant>(
    variant: &V,
    p: &Problem,
    x: ForwardInputs<'_>,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let tiles = CpuTiles::for_variant::<V>();
    on_host(variant, p, |host| {
        forward_inputs(host, p, (tiles, None), x, out, lse)
    })
}

/// The decode kernel (query rows per head up to 32; see `decode`) with the
/// keys of each (batch, kv head) cut into `chunks` chunks, whatever the
/// shape: for tests and benchmarks of the split against the unsplit path.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn forward_decode<V: HostVariant>(
    variant: &V,
    p: &Problem,
    tiles: CpuTiles,
    chunks: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
) {
    let x = ForwardInputs::packed(p, q, (k, v), None);
    forward_inputs(variant, p, (tiles, Some(chunks)), x, out, lse);
}

/// Where a KV cache's keys are, for [`forward_cache`] and [`backward`].
#[derive(Clone, Copy, Debug)]
pub struct CacheLayout<'a> {
    /// Keys per sequence, each at most `Sk`: sequence `b` holds keys `0 ..
    /// lens[b]`, and its query row `i` sits at position `i + lens[b] − Sq`.
    pub lens: &'a [usize],
    /// `None`: `k [B, Hkv, Sk, D]`, `v [B, Hkv, Sk, Dv]`, key `j` of
    /// sequence `b` in its slot `j` (the other slots are never read).
    /// Paged: `k [pages, Hkv, page_size, D]`, `v [pages, Hkv, page_size,
    /// Dv]` (see [`PageTable`]).
    pub pages: Option<PageTable<'a>>,
}

/// A paged cache's page table: logical key `j` of sequence `b` is in slot
/// `j % page_size` of page `table[b · max_pages + j / page_size]`, with
/// `p.seq_k = max_pages · page_size`.
#[derive(Clone, Copy, Debug)]
pub struct PageTable<'a> {
    /// `[B, max_pages]` page indices.
    pub table: &'a [usize],
    /// Keys per page.
    pub page_size: usize,
}

impl<'a> CacheLayout<'a> {
    /// Sequence `b` holds keys `0 .. lens[b]` of its `Sk` slots of `k [B,
    /// Hkv, Sk, D]` and `v [B, Hkv, Sk, Dv]`.
    pub fn lengths(lens: &'a [usize]) -> Self {
        Self { lens, pages: None }
    }

    /// The keys of `k, v` for the decode kernel, checked against `p`:
    /// one length per sequence, each within the keys; every page a length
    /// reaches a valid page (the op checks; here it is a panic).
    fn keys<'k>(&self, p: &Problem, k: Operand<'k>, v: Operand<'k>) -> decode::Keys<'k>
    where
        'a: 'k,
    {
        assert_eq!(self.lens.len(), p.batch, "one length per sequence");
        assert!(self.lens.iter().all(|&l| l <= p.seq_k), "lengths within Sk");
        let [h, d, dv] = [p.heads_kv, p.head_dim, p.head_dim_v];
        let Some(PageTable { table, page_size }) = self.pages else {
            assert_eq!(k.shape(), [p.batch, h, p.seq_k, d], "k shape");
            assert_eq!(v.shape(), [p.batch, h, p.seq_k, dv], "v shape");
            return decode::Keys::Contiguous { k, v };
        };
        assert!(
            page_size > 0 && p.seq_k.is_multiple_of(page_size),
            "whole pages"
        );
        let pages = k.shape()[0];
        assert_eq!(k.shape(), [pages, h, page_size, d], "k pages");
        assert_eq!(v.shape(), [pages, h, page_size, dv], "v pages");
        let max_pages = p.seq_k / page_size;
        assert_eq!(
            table.len(),
            p.batch * max_pages,
            "a page table row per sequence"
        );
        for (b, &len) in self.lens.iter().enumerate() {
            let used = &table[b * max_pages..b * max_pages + len.div_ceil(page_size)];
            assert!(used.iter().all(|&page| page < pages), "valid pages");
        }
        decode::Keys::Paged {
            k,
            v,
            table,
            max_pages,
            page_size,
        }
    }
}

/// Attention forward over a KV cache with spare capacity, or paged, as
/// `cache` says. Runs the decode kernel (split-KV, GQA packed) whatever
/// `Sq`, reading 16-bit keys as stored. Captured tensors and out-of-range
/// reads as in [`forward`].
#[allow(clippy::too_many_arguments)]
pub fn forward_cache<V: Variant, E: KvElem>(
    variant: &V,
    p: &Problem,
    cache: CacheLayout<'_>,
    q: &[f32],
    k: &[E],
    v: &[E],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let tiles = CpuTiles::for_variant::<V>();
    on_host(variant, p, |host| {
        forward_cache_tiled(host, p, tiles, cache, q, k, v, out, lse)
    })
}

/// [`forward_cache`] with explicit tile sizes (for tuning and tests).
#[allow(clippy::too_many_arguments)]
pub fn forward_cache_tiled<V: HostVariant, E: KvElem>(
    variant: &V,
    p: &Problem,
    tiles: CpuTiles,
    cache: CacheLayout<'_>,
    q: &[f32],
    k: &[E],
    v: &[E],
    out: &mut [f32],
    lse: &mut [f32],
) {
    let x = ForwardInputs::packed(p, q, (k, v), Some(cache));
    forward_inputs(variant, p, (tiles, None), x, out, lse);
}

/// Attention backward with the variant's [`CpuTiles`]: writes `dq`, `dk`, `dv`,
/// and returns the gradient of each learnable tensor whose slot
/// `tensor_grads` marks (`None` for the others). Captured tensors and
/// out-of-range reads as in [`forward`].
///
/// Over a KV cache (`lens`: sequence `b` has `lens[b]` of the `Sk` slots,
/// as in [`CacheLayout::lengths`]), the other slots get `dk = dv = 0` and
/// are never part of a product: the tile kernels run unchanged over the
/// cache's positions and mask (`cached::Cached`), so every variant works.
#[allow(clippy::too_many_arguments)]
pub fn backward<V: Variant>(
    variant: &V,
    p: &Problem,
    lens: Option<&[usize]>,
    inputs: BackwardInputs<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    tensor_grads: &[bool],
) -> Result<Vec<Option<Vec<f32>>>> {
    let grads = backward_stored(variant, p, lens, inputs, (dq, dk, dv), tensor_grads)?;
    Ok(grads.expect("the f32 backward runs on every CPU"))
}

/// The bf16 tensors [`backward_bf16`] reads; `lse` is the forward's, f32.
pub type Bf16BackwardInputs<'a> = BackwardInputs<'a, half::bf16>;

/// Attention backward over bf16 inputs with its five tile products on AMX
/// or `vdpbf16ps` (see `amx_backward`: `P` and `dS` rounded to bf16 before
/// their products, everything else f32), where [`bf16_tiles`] holds.
/// Returns `Ok(None)`, writing nothing, where it does not: the caller then
/// widens the inputs for [`backward`]. Otherwise as [`backward`], KV
/// caches and learnable tensors' gradients included.
#[allow(clippy::too_many_arguments)]
pub fn backward_bf16<V: Variant>(
    variant: &V,
    p: &Problem,
    lens: Option<&[usize]>,
    inputs: Bf16BackwardInputs<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    tensor_grads: &[bool],
) -> Result<Option<Vec<Option<Vec<f32>>>>> {
    backward_stored(variant, p, lens, inputs, (dq, dk, dv), tensor_grads)
}

/// The gradients a backward writes: `dq`, `dk`, `dv`.
type GradSlices<'g> = (&'g mut [f32], &'g mut [f32], &'g mut [f32]);

/// An element type the backward reads as stored, with the kernels that
/// read it.
trait BackwardElem: Copy {
    /// Whether [`Self::backward`] runs `p` on this CPU.
    fn runs(p: &Problem) -> bool;

    /// The backward of `host`, the tile sizes the variant's `V`, into
    /// `grads` and the learnable tensors' gradients `tensor_grads` (one
    /// zeroed slice per wanted slot, empty for the others).
    fn backward<V: Variant, H: HostVariant>(
        host: &H,
        p: &Problem,
        inputs: BackwardInputs<'_, Self>,
        grads: GradSlices<'_>,
        tensor_grads: &mut [Vec<f32>],
    );
}

impl BackwardElem for f32 {
    fn runs(_: &Problem) -> bool {
        true
    }

    fn backward<V: Variant, H: HostVariant>(
        host: &H,
        p: &Problem,
        inputs: BackwardInputs<'_>,
        (dq, dk, dv): GradSlices<'_>,
        tensor_grads: &mut [Vec<f32>],
    ) {
        let tiles = CpuTiles::for_variant::<V>();
        backward_tiled(host, p, tiles, inputs, dq, dk, dv, tensor_grads);
    }
}

impl BackwardElem for half::bf16 {
    fn runs(p: &Problem) -> bool {
        amx_backward::applies(p)
    }

    /// The chunking as in [`backward_tiled`].
    fn backward<V: Variant, H: HostVariant>(
        host: &H,
        p: &Problem,
        i: Bf16BackwardInputs<'_>,
        (dq, dk, dv): GradSlices<'_>,
        grads: &mut [Vec<f32>],
    ) {
        use half::slice::HalfFloatSliceExt as _;
        let x = amx_backward::Inputs {
            q: i.q.reinterpret_cast(),
            k: i.k.reinterpret_cast(),
            v: i.v.reinterpret_cast(),
            out: i.out.reinterpret_cast(),
            dout: i.dout.reinterpret_cast(),
            lse: i.lse,
        };
        let learn = H::SCORE_READS_LEARNABLE && grads.iter().any(|g| !g.is_empty());
        let chunks = backward::key_chunks(p, amx_backward::TILES, chunk_threads(learn));
        let kv_group = backward::kv_group_size(host, p, amx_backward::TILES);
        in_pool(|| amx_backward::backward(host, p, chunks, kv_group, x, dq, dk, dv, grads));
    }
}

/// [`backward`] and [`backward_bf16`]: `None`, writing nothing, where
/// `E`'s kernels do not run `p`; the lengths checked, the variant's
/// tensors read on the host and wrapped for a cache's `lens`.
fn backward_stored<V: Variant, E: BackwardElem>(
    variant: &V,
    p: &Problem,
    lens: Option<&[usize]>,
    i: BackwardInputs<'_, E>,
    grads: GradSlices<'_>,
    tensor_grads: &[bool],
) -> Result<Option<Vec<Option<Vec<f32>>>>> {
    check_backward_lengths(
        p,
        (i.q.len(), i.k.len(), i.v.len()),
        (i.out.len(), i.dout.len(), i.lse.len()),
        (&*grads.0, &*grads.1, &*grads.2),
    );
    if !E::runs(p) {
        return Ok(None);
    }
    on_host(variant, p, |host| {
        let mut slots = grad_slots(host, tensor_grads);
        match lens {
            None => E::backward::<V, _>(host, p, i, grads, &mut slots),
            Some(lens) => {
                let cached = cached::Cached::new(host, p, lens);
                E::backward::<V, _>(&cached, p, i, grads, &mut slots);
            }
        }
        Some(wanted_grads(slots, tensor_grads))
    })
}

/// The thread count the backward's key chunking assumes: the pool's, or,
/// with gradients of learnable tensors read by `score` (`learn`), a fixed
/// one, so that every gradient is the same for any thread count (the
/// sinks' gradients come from a row pass in row order).
fn chunk_threads(learn: bool) -> usize {
    if learn {
        backward::GRAD_CHUNK_THREADS
    } else {
        rayon::current_num_threads()
    }
}

/// One zeroed gradient per learnable tensor of `host` that `tensor_grads`
/// marks, empty for the others.
fn grad_slots<H: HostVariant>(host: &H, tensor_grads: &[bool]) -> Vec<Vec<f32>> {
    (0..H::LEARNABLE)
        .map(|slot| match tensor_grads.get(slot) {
            Some(true) => vec![0.0; host.learnable_numel(slot)],
            _ => Vec::new(),
        })
        .collect()
}

/// The gradients `tensor_grads` marks, `None` for the others.
fn wanted_grads(grads: Vec<Vec<f32>>, tensor_grads: &[bool]) -> Vec<Option<Vec<f32>>> {
    grads
        .into_iter()
        .enumerate()
        .map(|(slot, g)| {
            tensor_grads
                .get(slot)
                .copied()
                .unwrap_or(false)
                .then_some(g)
        })
        .collect()
}

/// The slices of a backward have the problem's lengths.
fn check_backward_lengths(
    p: &Problem,
    (q, k, v): (usize, usize, usize),
    (out, dout, lse): (usize, usize, usize),
    (dq, dk, dv): (&[f32], &[f32], &[f32]),
) {
    assert_eq!(q, p.q_len(), "q length");
    assert_eq!((k, v), (p.k_len(), p.v_len()), "k/v length");
    assert_eq!((out, dout), (p.out_len(), p.out_len()), "out/dout length");
    assert_eq!(lse, p.lse_len(), "lse length");
    assert_eq!(dq.len(), p.q_len(), "dq length");
    assert_eq!((dk.len(), dv.len()), (p.k_len(), p.v_len()), "dk/dv length");
}

/// Attention backward with explicit tile sizes (for tuning and tests);
/// `tensor_grads` holds one zeroed slice per learnable tensor whose
/// gradient is wanted (empty for the others).
#[allow(clippy::too_many_arguments)]
pub fn backward_tiled<V: HostVariant>(
    variant: &V,
    p: &Problem,
    tiles: CpuTiles,
    inputs: BackwardInputs<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    tensor_grads: &mut [Vec<f32>],
) {
    let i = &inputs;
    check_backward_lengths(
        p,
        (i.q.len(), i.k.len(), i.v.len()),
        (i.out.len(), i.dout.len(), i.lse.len()),
        (dq, dk, dv),
    );
    let tiles = CpuTiles::new(tiles.q, tiles.kv);
    let learn = V::SCORE_READS_LEARNABLE && tensor_grads.iter().any(|g| !g.is_empty());
    let chunks = backward::key_chunks(p, tiles, chunk_threads(learn));
    let kv_group = backward::kv_group_size(variant, p, tiles);
    in_pool(|| {
        backward::backward(
            variant,
            p,
            tiles,
            chunks,
            kv_group,
            inputs,
            dq,
            dk,
            dv,
            tensor_grads,
        )
    });
}

/// Positions of rows and keys as the variant sees them (bottom-right aligned).
#[derive(Clone, Copy, Debug)]
pub(super) struct Positions {
    /// `Sk − Sq`: query row `i` is at position `i + q_offset`.
    q_offset: i32,
}

impl Positions {
    fn new(p: &Problem) -> Self {
        // Positions are i32 in the variant's signature; sequences beyond
        // 2^31 would not fit any of its index arguments.
        Self::to_i32(p.seq_q.max(p.seq_k));
        let q_offset = i32::try_from(p.q_offset()).expect("sequence length fits i32");
        Self { q_offset }
    }

    /// An index (batch, head, position) as the variant's `i32`.
    fn to_i32(x: usize) -> i32 {
        i32::try_from(x).expect("index fits i32")
    }

    /// Inclusive positions of `rows` query rows starting at row `row0`.
    fn query_range(self, row0: usize, rows: usize) -> (i32, i32) {
        let lo = Self::to_i32(row0) + self.q_offset;
        (lo, lo + Self::to_i32(rows) - 1)
    }
}

/// The class of the tile (query positions `q_lo..=q_hi`) × (`cols` keys from
/// `kv0`). Without a mask every tile is `Full` and `classify_tile` is not called.
#[inline]
fn tile_class<V: HostVariant>(
    variant: &V,
    b: i32,
    h: i32,
    (q_lo, q_hi): (i32, i32),
    kv0: usize,
    cols: usize,
) -> TileClass {
    if !V::HAS_MASK {
        return TileClass::Full;
    }
    let kv_lo = Positions::to_i32(kv0);
    variant.classify_tile(b, h, q_lo, q_hi, kv_lo, kv_lo + Positions::to_i32(cols) - 1)
}

/// Bytes of a tile's partners (K and V for a query tile in the forward;
/// Q, dO and dQ for a key tile in the backward) that one tile's pass may
/// read before tiles are grouped to share passes: up to this much stays in a
/// core's L2 from one tile to the next. Three quarters of the 2 MiB L2 of
/// recent Xeons, leaving room for everything else.
const L2_BUDGET: usize = 3 << 19;

/// Tiles sampled by [`mean_visits`].
const SAMPLED_TILES: usize = 8;

/// Which tiles [`mean_visits`] samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Axis {
    /// Query tiles, counting the key tiles each visits.
    Query,
    /// Key tiles, counting the query tiles that visit each.
    Key,
}

/// How many tiles of the other axis a tile of `axis` meets that are not
/// `Empty`, averaged over up to [`SAMPLED_TILES`] evenly spaced tiles of
/// batch 0, head 0. It only sizes groups of tiles (any grouping gives the
/// same results), so an estimate is enough.
fn mean_visits<V: HostVariant>(variant: &V, p: &Problem, tiles: CpuTiles, axis: Axis) -> f64 {
    let pos = Positions::new(p);
    let (q_tiles, kv_tiles) = (p.seq_q.div_ceil(tiles.q), p.seq_k.div_ceil(tiles.kv));
    let visible = |qt: usize, kt: usize| {
        let (row0, kv0) = (qt * tiles.q, kt * tiles.kv);
        let range = pos.query_range(row0, tiles.q.min(p.seq_q - row0));
        let cols = tiles.kv.min(p.seq_k - kv0);
        tile_class(variant, 0, 0, range, kv0, cols) != TileClass::Empty
    };
    let (n, others) = match axis {
        Axis::Query => (q_tiles, kv_tiles),
        Axis::Key => (kv_tiles, q_tiles),
    };
    if n == 0 {
        return 0.0;
    }
    let samples = n.min(SAMPLED_TILES);
    let mut visits = 0;
    for i in 0..samples {
        let t = i * (n - 1) / (samples - 1).max(1);
        visits += (0..others)
            .filter(|&o| match axis {
                Axis::Query => visible(t, o),
                Axis::Key => visible(o, t),
            })
            .count();
    }
    visits as f64 / samples as f64
}

/// Query rows per band when the products of a `Partial` tile are trimmed
/// to the keys its rows can see.
///
/// A diagonal causal tile computed whole wastes half of its products, and so
/// do both edge tiles of a sliding window. Cut into bands of 16 rows, and
/// each band's keys trimmed to the chunks classification does not prove
/// empty ([`class_bands`]), the forward's and the backward's products and
/// elementwise passes cover about 60% of a causal diagonal tile. Measured
/// on the forward (`bench/ab_cpu.py`, one thread), against trimming only
/// `P V` to each band's nonzero probabilities: 1.07× as fast for causal at
/// S = 1024, 1.08× for a sliding window at S = 4096.
const BAND_ROWS: usize = 16;

/// Rows `rows` of a tile and the columns `cols` (relative to the tile)
/// outside which every pair of those rows is hidden.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Band {
    pub(super) rows: std::ops::Range<usize>,
    pub(super) cols: std::ops::Range<usize>,
}

/// Fill `bands` with the bands of the tile of query rows at positions
/// `q_lo ..` and `cols` keys from `kv0`: one band of the whole tile unless
/// it is `Partial`, else one per [`BAND_ROWS`] rows, each with the keys from
/// the first to the last `LANES`-wide chunk that `classify_tile` does not
/// prove `Empty` for those rows (empty when it proves them all). Computing
/// a tile's products and elementwise passes only there is exact: every
/// pair outside is hidden. (Chunks of `LANES` keys keep the softmax's lane
/// sums aligned with the columns.)
fn class_bands<V: HostVariant>(
    variant: &V,
    (b, h): (i32, i32),
    class: TileClass,
    (q_lo, kv0): (i32, usize),
    (rows, cols): (usize, usize),
    bands: &mut Vec<Band>,
) {
    bands.clear();
    if class != TileClass::Partial {
        bands.push(Band {
            rows: 0..rows,
            cols: 0..cols,
        });
        return;
    }
    for r0 in (0..rows).step_by(BAND_ROWS) {
        let r1 = rows.min(r0 + BAND_ROWS);
        let pos = (q_lo + r0 as i32, q_lo + r1 as i32 - 1);
        let (mut lo, mut hi) = (cols, 0);
        for c0 in (0..cols).step_by(math::LANES) {
            let c1 = cols.min(c0 + math::LANES);
            if tile_class(variant, b, h, pos, kv0 + c0, c1 - c0) != TileClass::Empty {
                lo = lo.min(c0);
                hi = c1;
            }
        }
        bands.push(Band {
            rows: r0..r1,
            cols: lo..hi.max(lo),
        });
    }
}

/// `dst = beta · A Bᵀ` on each band of the `rows × cols` tile `dst`: the
/// band's rows of `a` (rows of `d`, `a_rs` apart) against its columns of `bt` (`Bᵀ`,
/// `d × cols`). Elements outside the bands are not written.
fn band_products(
    dst: &mut [f32],
    cols: usize,
    bands: &[Band],
    (a, a_rs): (&[f32], usize),
    bt: &[f32],
    d: usize,
    beta: f32,
) {
    for Band { rows: r, cols: c } in bands.iter().filter(|b| !b.cols.is_empty()) {
        gemm::matmul(
            gemm::MatMut::strided(&mut dst[r.start * cols + c.start..], r.len(), c.len(), cols),
            gemm::Write::Overwrite,
            gemm::MatRef::strided(&a[r.start * a_rs..], r.len(), d, a_rs),
            gemm::MatRef::strided(&bt[c.start..], d, c.len(), cols),
            beta,
        );
    }
}

/// Whether every element of `x` is finite (no NaN, no infinity).
/// [`all_finite`] of bf16 bits.
fn all_finite_bits(x: &[u16]) -> bool {
    x.iter()
        .fold(0u16, |acc, v| acc | u16::from(v & 0x7f80 == 0x7f80))
        == 0
}

fn all_finite(x: &[f32]) -> bool {
    // Branch-free over the bits, so it vectorises: an exponent of all ones
    // is an infinity or a NaN.
    x.iter().fold(0u32, |acc, v| {
        acc | u32::from(v.to_bits() & 0x7f80_0000 == 0x7f80_0000)
    }) == 0
}

/// The right operand `b` of a band's product (`c.len()` rows of `d`, `b_rs`
/// apart, row
/// `j` meeting column `c.start + j` of the band's left operand `a`, a tile
/// of `cols` columns) with every row zeroed whose column of `a` is zero in
/// all of the band's rows, in `scratch` (rows of `d`, contiguous).
///
/// Why: a key that no row of the band sees has probability (and `dS`)
/// exactly 0 in that column, but `0 · NaN` is NaN, so a NaN or infinity
/// in its K or V row (an unwritten cache slot, garbage padding) would
/// reach rows that cannot see it. Taking the key's row as zero instead is
/// exact for finite rows (they contribute 0 either way), so the kernels
/// only do it where the operand has a non-finite element.
fn zero_unused_rows<'s>(
    a: &[f32],
    cols: usize,
    band: &Band,
    (b, b_rs): (&[f32], usize),
    d: usize,
    scratch: &'s mut Vec<f32>,
) -> &'s [f32] {
    let c = &band.cols;
    scratch.clear();
    for j in 0..c.len() {
        scratch.extend_from_slice(&b[j * b_rs..j * b_rs + d]);
    }
    for j in 0..c.len() {
        let unused = band.rows.clone().all(|i| a[i * cols + c.start + j] == 0.0);
        if unused {
            scratch[j * d..(j + 1) * d].fill(0.0);
        }
    }
    scratch
}
