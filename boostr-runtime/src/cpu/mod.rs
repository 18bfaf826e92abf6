//! Fused attention kernels for the CPU: FlashAttention-2 forward and backward
//! over contiguous f32 slices, generic over the variant's [`HostVariant`](crate::HostVariant)
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
//! Layout and semantics are those of [`Problem`](crate::Problem): `q, out [B, Hq, Sq, D]`,
//! `k, v [B, Hkv, Sk, D]`, `lse [B, Hq, Sq]`, query head `h` reads kv head
//! `h / (Hq / Hkv)`, query row `i` sits at position `i + Sk − Sq`.
//!
//! How the work is organised, room by room (see each module for details):
//! - `kernels`: `tile` ([`CpuTiles`], the tile sizes and why); `forward`,
//!   one task per (batch, query head, query tile, or group of query tiles
//!   for long sequences), key/value tiles streamed through with an online
//!   softmax; `backward`, one task per (batch, kv head, chunk of key
//!   tiles), query tiles streamed through, dQ reduced in a fixed order for
//!   determinism; `grads`, the learnable tensors' gradients; `decode`, a
//!   few query rows against long keys, split across workers.
//! - `bf16`: AMX tiles (`amx`, `amx_forward`, `amx_backward`) and
//!   `vdpbf16ps` (`bf16_dot`).
//! - `linalg`: the tile products (`gemm`: bounds-checked views, and
//!   `microkernel`, an AVX-512 register-blocked kernel that needs no
//!   packing, or the `gemm` crate where AVX-512 is missing; single-threaded
//!   per task), the decode's matrix-vector products (`gemv`, `gemv_i8`),
//!   strided operands (`operand`), and `simd`, the run-time AVX2/AVX-512
//!   dispatch.
//! - `rows`: `weights` and `math` (the softmax's weights, a vectorizable
//!   `exp` and row reductions), `dropout`, `elem` (stored elements and their
//!   widening), `keys` (caches' and pages' key addressing).
//! - Here: the entry points (`entry`), the runtime (`runtime`), the cache
//!   writer (`append`), threads and the aligned buffers.
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
mod append;
mod bf16;
mod entry;
mod kernels;
mod linalg;
pub(crate) mod par;
mod rows;
mod runtime;
mod threads;

use bf16::{amx, amx_backward, amx_forward, bf16_dot};
use kernels::{backward, decode, forward, grads, tile};
#[cfg(target_arch = "x86_64")]
use linalg::microkernel;
use linalg::{gemm, gemv, gemv_i8, operand, simd};
#[doc(hidden)] // public for the code `#[attention]` generates (`score` in f32)
pub use rows::math;
pub(crate) use rows::weights;
use rows::{dropout, elem, keys};

#[cfg(test)]
pub(crate) mod tests;

pub use aligned::release_pool;
pub use elem::KvElem;
#[cfg(test)]
pub(crate) use elem::{e4m3_to_f32, e5m2_to_f32, f32_to_e4m3, f32_to_e5m2};
pub use entry::{
    BackwardInputs, Bf16BackwardInputs, backward, backward_bf16, backward_tiled, bf16_tiles,
    forward, forward_bf16, forward_cache, forward_cache_tiled, forward_stored, forward_tiled,
    is_decode,
};
#[doc(hidden)] // for the benchmark examples
pub use gemm::{
    time_amx_peak, time_bf16_dot_peak_all, time_fma_peak, time_fma_peak_all, time_tile_products,
};
pub use keys::{CacheLayout, Pages};
pub use threads::pin_threads;
pub use tile::CpuTiles;

pub(crate) use entry::{
    ForwardInputs, backward_stored, forward_bf16_inputs, forward_stored_inputs, runs_decode,
};
pub(crate) use keys::Seqs;
use tile::{
    Axis, BAND_ROWS, Band, L2_BUDGET, Positions, all_finite, all_finite_bits, band_products,
    class_bands, mean_visits, tile_class, zero_unused_rows,
};
