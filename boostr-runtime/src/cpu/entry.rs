//! The CPU kernels' entry points: slices in, results out, and the kernel
//! that each shape, element type and key layout runs. Every entry point
//! describes its keys as one [`KeyRows`] (dense, a cache's slots, pages;
//! any strides; fp8 with scales); the tile kernels run a cache through
//! [`Cached`], each sequence at its own length's
//! positions.

use super::aligned::{Aligned, Plain};
use super::keys::{CacheLayout, Gathered, KeyRows, OnHost, Seqs, fold_pages, windowed};
use super::operand::Operand;
use super::par::in_pool;
use super::{CpuTiles, KvElem, amx_backward, amx_forward, decode, elem};
use crate::error::Result;
use crate::problem::Problem;
use crate::variant::{HostVariant, Variant};

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
    /// Gradient of the loss with respect to `lse`, `[B, Hq, Sq]`, where
    /// the loss reads it (`None`: zero).
    pub dlse: Option<&'a [f32]>,
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
pub(super) fn on_host<V: Variant, R>(
    variant: &V,
    p: &Problem,
    run: impl FnOnce(&V::Host) -> R,
) -> Result<R> {
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

/// What a forward reads, as stored: `q` in the layout of [`Problem`] (any
/// strides between rows, heads and batches, each row contiguous), and the
/// keys and values where [`KeyRows`] says.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ForwardInputs<'a> {
    pub(crate) q: Operand<'a>,
    pub(crate) keys: KeyRows<'a>,
    /// Where each sequence's rows and keys are.
    pub(crate) seqs: Seqs<'a>,
}

impl<'a> ForwardInputs<'a> {
    /// Contiguous `q`, and `k`, `v` in the layout of `p` or of `cache`
    /// (pages of `[Hkv, page_size, D]`).
    ///
    /// # Panics
    /// If a slice's length disagrees with `p`, or `cache` with the keys.
    pub(crate) fn packed<Q: KvElem, E: KvElem>(
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
        let k = Operand::packed(E::stored(k), [p.heads_kv, rows, p.head_dim]);
        let v = Operand::packed(E::stored(v), [p.heads_kv, rows, p.head_dim_v]);
        Self {
            q: Operand::packed(Q::stored(q), [p.heads_q, p.seq_q, p.head_dim]),
            keys: KeyRows::new(k, v, cache, p),
            seqs: Seqs::of_cache(cache),
        }
    }
}

/// What a forward writes: `out`, `lse` and, where the call returns it,
/// each row's largest score (lse-shaped).
pub(crate) type Outputs<'o> = (&'o mut [f32], &'o mut [f32], Option<&'o mut [f32]>);

/// The output slices of a forward have the problem's lengths.
fn check_outputs(p: &Problem, (out, lse, max): &Outputs<'_>) {
    assert_eq!(out.len(), p.out_len(), "out length");
    assert_eq!(lse.len(), p.lse_len(), "lse length");
    if let Some(max) = max {
        assert_eq!(max.len(), p.lse_len(), "max length");
    }
}

/// The forward of [`ForwardInputs`], reading each as stored: the decode
/// kernel for decode shapes (of dense keys or a cache), or where `chunks`
/// (keys per (batch, kv head) cut into that many chunks) is given; else
/// the tile kernel, through the window of the call's sequences.
pub(super) fn forward_inputs<V: HostVariant>(
    variant: &V,
    p: &Problem,
    (tiles, chunks): (CpuTiles, Option<usize>),
    x: ForwardInputs<'_>,
    outputs: Outputs<'_>,
) {
    check_outputs(p, &outputs);
    let tiles = CpuTiles::new(tiles.q, tiles.kv);
    let threads = rayon::current_num_threads();
    if chunks.is_none() && !runs_decode(p, x.seqs) {
        let run = TileForward {
            p,
            tiles,
            x,
            outputs,
        };
        return windowed(variant, p, x.seqs, run);
    }
    assert!(
        x.seqs.decodes(),
        "the decode kernel runs dense keys and caches"
    );
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
    let chunks = chunks.unwrap_or_else(|| decode::chunks(p, tiles, threads));
    in_pool(|| decode::forward(variant, p, tiles, chunks, q, x.keys, outputs));
}

/// Whether a forward of `p` over `seqs` runs the decode kernel.
pub(crate) fn runs_decode(p: &Problem, seqs: Seqs<'_>) -> bool {
    decode::applies(p) && seqs.decodes()
}

/// The f32 tile kernel of a call, on its variant seen through the call's
/// window.
struct TileForward<'a, 'o> {
    p: &'a Problem,
    tiles: CpuTiles,
    x: ForwardInputs<'a>,
    outputs: Outputs<'o>,
}

impl OnHost for TileForward<'_, '_> {
    type Out = ();

    fn run<H: HostVariant>(self, host: &H) {
        tile_forward(host, self.p, self.tiles, self.x, self.outputs);
    }
}

/// The f32 tile kernel of `x`.
fn tile_forward<V: HostVariant>(
    variant: &V,
    p: &Problem,
    tiles: CpuTiles,
    x: ForwardInputs<'_>,
    outputs: Outputs<'_>,
) {
    let group = super::forward::group_size(variant, p, tiles, rayon::current_num_threads());
    in_pool(|| super::forward::forward(variant, p, tiles, group, x.q, x.keys, outputs));
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
    forward_bf16_inputs(variant, p, x, (out, lse, None))
}

/// [`forward_bf16`] of bf16 [`ForwardInputs`] (over a cache through
/// [`Cached`]).
pub(crate) fn forward_bf16_inputs<V: Variant>(
    variant: &V,
    p: &Problem,
    x: ForwardInputs<'_>,
    outputs: Outputs<'_>,
) -> Result<bool> {
    check_outputs(p, &outputs);
    if !amx_forward::applies(p) {
        return Ok(false);
    }
    on_host(variant, &x.seqs.seen(p), |host| {
        let run = Bf16Forward { p, x, outputs };
        in_pool(|| windowed(host, p, x.seqs, run))
    })?;
    Ok(true)
}

/// The bf16 tile kernel of a call, through its window.
struct Bf16Forward<'a, 'o> {
    p: &'a Problem,
    x: ForwardInputs<'a>,
    outputs: Outputs<'o>,
}

impl OnHost for Bf16Forward<'_, '_> {
    type Out = ();

    fn run<H: HostVariant>(self, host: &H) {
        amx_forward::forward(host, self.p, self.x.q, self.x.keys, self.outputs);
    }
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
    forward_inputs(variant, p, (tiles, None), x, (out, lse, None));
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
    forward_stored_inputs(variant, p, x, (out, lse, None))
}

/// [`forward_stored`] or [`forward_cache`] of [`ForwardInputs`].
pub(crate) fn forward_stored_inputs<V: Variant>(
    variant: &V,
    p: &Problem,
    x: ForwardInputs<'_>,
    outputs: Outputs<'_>,
) -> Result<()> {
    let tiles = CpuTiles::for_variant::<V>();
    on_host(variant, &x.seqs.seen(p), |host| {
        forward_inputs(host, p, (tiles, None), x, outputs)
    })
}

/// Attention forward over a KV cache with spare capacity, or paged, as
/// `cache` says, reading 16-bit and fp8 keys as stored: the decode kernel
/// (split-KV, GQA packed) for decode shapes, the tile kernel for longer
/// query blocks (a chunked prefill), each sequence's rows at its own
/// length's positions. Captured tensors and out-of-range reads as in
/// [`forward`].
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
    forward_inputs(variant, p, (tiles, None), x, (out, lse, None));
}

/// Attention backward with the variant's [`CpuTiles`]: writes `dq`, `dk`, `dv`,
/// and returns the gradient of each learnable tensor whose slot
/// `tensor_grads` marks (`None` for the others). Captured tensors and
/// out-of-range reads as in [`forward`].
///
/// Over a KV cache (`cache`: sequence `b` has `lens[b]` of the `Sk`
/// slots, as in [`CacheLayout::lengths`]), the other slots get `dk = dv =
/// 0` and are never part of a product: the tile kernels run unchanged over
/// the cache's positions and mask (`Cached`), so every variant
/// works. Over pages, `k`, `v`, `dk` and `dv` are `[pages, Hkv, page_size,
/// ·]`: the keys are gathered into their sequences' slots first, and each
/// page's gradient is the sum, in sequence order, of those of the slots
/// that read it (0 where no length reaches it).
#[allow(clippy::too_many_arguments)]
pub fn backward<V: Variant>(
    variant: &V,
    p: &Problem,
    cache: Option<CacheLayout<'_>>,
    inputs: BackwardInputs<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    tensor_grads: &[bool],
) -> Result<Vec<Option<Vec<f32>>>> {
    let layout = (cache, Seqs::of_cache(cache));
    let grads = backward_stored(variant, p, layout, inputs, (dq, dk, dv), tensor_grads)?;
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
    cache: Option<CacheLayout<'_>>,
    inputs: Bf16BackwardInputs<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    tensor_grads: &[bool],
) -> Result<Option<Vec<Option<Vec<f32>>>>> {
    let layout = (cache, Seqs::of_cache(cache));
    backward_stored(variant, p, layout, inputs, (dq, dk, dv), tensor_grads)
}

/// The gradients a backward writes: `dq`, `dk`, `dv`.
pub(crate) type GradSlices<'g> = (&'g mut [f32], &'g mut [f32], &'g mut [f32]);

/// Where a backward's keys are (a cache's lengths or pages) and its
/// sequences.
pub(crate) type BackwardLayout<'a> = (Option<CacheLayout<'a>>, Seqs<'a>);

/// An element type the backward reads as stored, with the kernels that
/// read it.
pub(crate) trait BackwardElem: KvElem + Plain {
    /// Whether [`Self::backward`] runs `p` on this CPU.
    fn runs(p: &Problem) -> bool;

    /// Stored elements (of this type) into `dst`.
    fn read(x: elem::Stored<'_>, dst: &mut [Self]);

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

    fn read(x: elem::Stored<'_>, dst: &mut [f32]) {
        elem::widen(x, dst);
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

    fn read(x: elem::Stored<'_>, dst: &mut [half::bf16]) {
        match x {
            elem::Stored::Bf16(bits) => {
                for (d, &b) in dst.iter_mut().zip(bits) {
                    *d = half::bf16::from_bits(b);
                }
            }
            _ => unreachable!("bf16 keys are bf16"),
        }
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
            dlse: i.dlse,
        };
        let learn = H::SCORE_READS_LEARNABLE && grads.iter().any(|g| !g.is_empty());
        let chunks = super::backward::key_chunks(p, amx_backward::TILES, chunk_threads(learn));
        let kv_group = super::backward::kv_group_size(host, p, amx_backward::TILES);
        in_pool(|| amx_backward::backward(host, p, chunks, kv_group, x, dq, dk, dv, grads));
    }
}

/// [`backward`] and [`backward_bf16`] over any layout: `None`, writing
/// nothing, where `E`'s kernels do not run `p`; pages gathered into
/// slots, and their gradients folded back.
pub(crate) fn backward_stored<V: Variant, E: BackwardElem>(
    variant: &V,
    p: &Problem,
    (cache, seqs): BackwardLayout<'_>,
    i: BackwardInputs<'_, E>,
    (dq, dk, dv): GradSlices<'_>,
    tensor_grads: &[bool],
) -> Result<Option<Vec<Option<Vec<f32>>>>> {
    let Some(pages) = cache.and_then(|c| c.pages) else {
        return backward_slots(variant, p, seqs, i, (dq, dk, dv), tensor_grads);
    };
    if !E::runs(p) {
        return Ok(None);
    }
    let rows = |dim| [p.heads_kv, pages.page_size, dim];
    let k = Operand::packed(E::stored(i.k), rows(p.head_dim));
    let v = Operand::packed(E::stored(i.v), rows(p.head_dim_v));
    let keys = KeyRows::new(k, v, cache, p);
    assert_eq!(
        (dk.len(), dv.len()),
        (i.k.len(), i.v.len()),
        "dk/dv shaped as the pages"
    );
    let slots = Gathered::<E>::new(&keys, p, E::read);
    let mut dk_slots = Aligned::<f32>::zeroed(p.k_len());
    let mut dv_slots = Aligned::<f32>::zeroed(p.v_len());
    let inputs = BackwardInputs {
        k: &slots.k[..],
        v: &slots.v[..],
        ..i
    };
    let grads = (&mut *dq, &mut dk_slots[..], &mut dv_slots[..]);
    let tensors = backward_slots(variant, p, seqs, inputs, grads, tensor_grads)?;
    if tensors.is_some() {
        fold_pages(&keys, p, p.head_dim, &dk_slots, dk);
        fold_pages(&keys, p, p.head_dim_v, &dv_slots, dv);
    }
    Ok(tensors)
}

/// [`backward_stored`] over keys in their sequences' slots, through the
/// window of the call's sequences.
fn backward_slots<V: Variant, E: BackwardElem>(
    variant: &V,
    p: &Problem,
    seqs: Seqs<'_>,
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
    on_host(variant, &seqs.seen(p), |host| {
        let mut slots = grad_slots(host, tensor_grads);
        let run = BackwardRun::<V, E> {
            p,
            i,
            grads,
            slots: &mut slots,
            variant: std::marker::PhantomData,
        };
        windowed(host, p, seqs, run);
        Some(wanted_grads(slots, tensor_grads))
    })
}

/// `E`'s backward kernels, with `V`'s tiles, through a call's window.
struct BackwardRun<'a, 'g, V, E: BackwardElem> {
    p: &'a Problem,
    i: BackwardInputs<'a, E>,
    grads: GradSlices<'g>,
    slots: &'g mut [Vec<f32>],
    variant: std::marker::PhantomData<V>,
}

impl<V: Variant, E: BackwardElem> OnHost for BackwardRun<'_, '_, V, E> {
    type Out = ();

    fn run<H: HostVariant>(self, host: &H) {
        E::backward::<V, H>(host, self.p, self.i, self.grads, self.slots);
    }
}

/// The thread count the backward's key chunking assumes: the pool's, or,
/// with gradients of learnable tensors read by `score` (`learn`), a fixed
/// one, so that every gradient is the same for any thread count (the
/// sinks' gradients come from a row pass in row order).
fn chunk_threads(learn: bool) -> usize {
    if learn {
        super::backward::GRAD_CHUNK_THREADS
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
    let chunks = super::backward::key_chunks(p, tiles, chunk_threads(learn));
    let kv_group = super::backward::kv_group_size(variant, p, tiles);
    in_pool(|| {
        super::backward::backward(
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
