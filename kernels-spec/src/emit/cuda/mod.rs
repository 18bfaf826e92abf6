//! The CUDA target: IR → self-contained CUDA C translation units for NVRTC.
//!
//! - [`dialect`]: how CUDA C writes the shared GPU lowering
//!   ([`crate::emit::gpu`]), and the helpers that give it the IR's semantics;
//! - [`interface`]: how a kernel is described (arguments, launch geometry);
//! - [`kernels`]: the kernels, each a description and a text template.
//!
//! The sources include no header (NVRTC ships none of `cuda_fp16.h`,
//! `cuda_bf16.h` or `mma.h` without a CUDA toolkit): half and bfloat16
//! values are their 16-bit patterns (`unsigned short`, binary-compatible
//! with `__half`/`__nv_bfloat16`), converted with `cvt` PTX, and the tensor
//! cores are driven with inline `mma.sync.aligned.m16n8k16` PTX. Compile
//! with `--gpu-architecture=compute_80` (or `sm_80`) or newer, `-std=c++17`,
//! and without `-use_fast_math`.
//!
//! # Building and launching a module for (variant, head dims, dtype)
//!
//! ```text
//! let section = variant_section::<Cuda>(&program);     // or the variant's CUDA lowering
//! let cfg = choose_tiles(CudaTiles::for_problem(d, dv, dtype), tile_q, tile_kv)?;
//! let src = source(&section, &[&kernels::FORWARD_MODULE], &cfg)?;
//! for kernel in kernels::FORWARD_MODULE.interfaces() {
//!     let dims = kernel.launch_dims(&cfg, &sizes)?;   // grid, block, shared memory
//!     // arguments: kernel.args, in order, by role
//! }
//! ```
//!
//! Every kernel's launch contract is its [`interface::Kernel`] (`Display`
//! writes it): [`kernels::FORWARD`], and for the backward [`kernels::DELTA`]
//! (first), then [`kernels::DQ`] and [`kernels::DKDV`]. Buffers are
//! contiguous; q, k, dq, dk rows hold `D` elements, v, out, dout, dv and
//! the split-KV partial outputs `Dv` (see [`kernels`]). `E` is the element
//! type: `float` for [`CudaDType::F32`], the 16-bit pattern (`unsigned
//! short`) for [`CudaDType::F16`]/[`CudaDType::Bf16`]; `lse` and `delta`
//! are f32. `int` arguments are 32-bit, pointers 64-bit;
//! `params` is the 128-byte `Params` struct by value
//! ([`ParamWords`](crate::params::ParamWords)). `B, Hq, Hkv ≤ 65535` (grid
//! y/z), `Hq % Hkv == 0`.
//!
//! # fp8 and int8 KV caches (forward)
//!
//! With [`CudaTiles::kv`] a one-byte format ([`CudaKv::E4m3`],
//! [`CudaKv::E5m2`], [`CudaKv::I8`]), the forward reads `k` and `v` as the
//! cache stores them, one byte an element (`kv_t`), and converts each row
//! to `E` while staging it into shared memory (exact: every E4M3, E5M2 and
//! int8 value is an f16, a bf16 and an f32), so the tiles, the products and the shared
//! memory sizes are those of `E`. The dequantization scales come as two
//! f32 arguments, `k_scale` and `v_scale`: `[Hkv]` for keys in place,
//! `[pages, Hkv]` for pages (`page · Hkv + h`; per-head scales repeated per
//! page). A key's K scale multiplies its column of raw scores, its V scale
//! its column of `P` before `P·V` (relative to the block's first key's, which
//! multiplies the output: `P` stays in range in f16 whatever the scales),
//! never the row sums. Without them both are null and never read. The
//! backward reads K and V in `E` only (quantised caches are for inference).
//!
//! Dynamic shared memory may exceed 48 KiB: before the first launch set
//! `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` to it
//! (`cuFuncSetAttribute`); [`CudaTiles::validate`] keeps it within
//! [`MAX_SMEM_BYTES`]. No kernel uses atomics: the backward is
//! deterministic.

pub mod dialect;
pub mod interface;
pub mod kernels;

use self::interface::{Module, Size};
use super::{Tiling, TilingError};

/// The CUDA C dialect of the GPU lowering (see [`dialect`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Cuda;

/// Threads per block of [`kernels::DELTA`] (one warp per row).
pub const DELTA_THREADS: u32 = 256;
/// Rows per block of [`kernels::DELTA`].
pub const DELTA_ROWS_PER_BLOCK: u32 = DELTA_THREADS / 32;

/// The dynamic shared memory a block may use: 99 KiB, the opt-in maximum of
/// sm_86/sm_89, the smallest among the sm_80+ GPUs these kernels target
/// (sm_80: 163 KiB, sm_90: 227 KiB). Keeping under it lets one configuration
/// run everywhere, and two 48 KiB-ish blocks per SM on the larger parts.
pub const MAX_SMEM_BYTES: u64 = 99 * 1024;

/// f32 accumulators one thread may hold across a tile loop (the output, or
/// dK and dV together), so that with the score-tile temporaries a thread
/// stays well within the 255 registers `__launch_bounds__` leaves it and
/// never spills.
pub const MAX_ACCUMULATORS_PER_THREAD: u32 = 64;

/// The largest head dim, of keys or of values: 576, absorbed MLA's `D`
/// (the 512 latent columns, which are also its `Dv`, and 64 rotary ones).
pub const MAX_HEAD_DIM: u32 = 576;

/// Element type of q, k, v, out, dout, dq, dk, dv. Accumulation is f32 in
/// every case; `lse` and `delta` are f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaDType {
    /// `float`: CUDA-core FFMA (no TF32, to keep f32 accuracy).
    F32,
    /// IEEE half: tensor cores, `mma.sync.m16n8k16` with f32 accumulation.
    F16,
    /// bfloat16: tensor cores, `mma.sync.m16n8k16` with f32 accumulation.
    Bf16,
}

impl CudaDType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            CudaDType::F32 => 4,
            CudaDType::F16 | CudaDType::Bf16 => 2,
        }
    }

    /// Whether the kernels use tensor cores (`mma.sync`) for this type.
    pub fn tensor_cores(self) -> bool {
        self != CudaDType::F32
    }

    /// Lower-case name (`f32`, `f16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            CudaDType::F32 => "f32",
            CudaDType::F16 => "f16",
            CudaDType::Bf16 => "bf16",
        }
    }
}

/// How the forward's `k` and `v` are stored: in the element type, or as
/// the bytes of an fp8 KV cache (converted to the element type per tile,
/// with per kv head or per page scales; see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CudaKv {
    /// The element type ([`CudaDType`]), as q.
    #[default]
    Elem,
    /// fp8 E4M3 (bias 7, no infinities, NaN `S.1111.111`).
    E4m3,
    /// fp8 E5M2 (bias 15: the upper byte of an f16).
    E5m2,
    /// int8 (two's complement, −128 ..= 127).
    I8,
}

impl CudaKv {
    /// Every format, the element type first.
    pub const ALL: [CudaKv; 4] = [CudaKv::Elem, CudaKv::E4m3, CudaKv::E5m2, CudaKv::I8];

    /// Whether K and V are one-byte codes with scales (fp8 or int8).
    pub fn bytes(self) -> bool {
        self != CudaKv::Elem
    }

    /// Lower-case name (`elem`, `e4m3`, `e5m2`, `i8`).
    pub fn name(self) -> &'static str {
        match self {
            CudaKv::Elem => "elem",
            CudaKv::E4m3 => "e4m3",
            CudaKv::E5m2 => "e5m2",
            CudaKv::I8 => "i8",
        }
    }
}

/// One named region of a kernel's dynamic shared memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SmemBuffer {
    /// The offset constant's name in the source (`FWD_Q`, ...).
    pub name: &'static str,
    /// Byte offset from the start of dynamic shared memory (16-aligned).
    pub offset: u64,
    /// Size in bytes.
    pub bytes: u64,
}

/// A kernel's dynamic shared memory: its buffers in order.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct SmemLayout {
    /// The buffers, 16-byte aligned, in order.
    pub buffers: Vec<SmemBuffer>,
}

impl SmemLayout {
    fn push(&mut self, name: &'static str, bytes: u64) {
        let offset = self.bytes().next_multiple_of(16);
        self.buffers.push(SmemBuffer {
            name,
            offset,
            bytes,
        });
    }

    /// Total bytes (the launch's dynamic shared memory).
    pub fn bytes(&self) -> u64 {
        self.buffers
            .last()
            .map_or(0, |b| (b.offset + b.bytes).next_multiple_of(16))
    }
}

/// Tile configuration of the CUDA kernels for one (head dim, value head
/// dim, dtype).
///
/// Derived sizes (padded head dims, row strides, shared memory per kernel,
/// threads, accumulators per thread) are computed by the methods here and
/// checked in [`CudaTiles::validate`]; the header of every source writes them
/// as constants, so the kernels and the launcher cannot disagree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaTiles {
    /// Head dim `D` of q and k rows (and dq, dk), a multiple of 8 in
    /// 8..=[`MAX_HEAD_DIM`].
    pub head_dim: u32,
    /// Head dim `Dv` of v rows and of out, dout, dv (MLA: 128 against
    /// `D` = 192, 512 against 576), a multiple of 8 in 8..=[`MAX_HEAD_DIM`].
    pub value_dim: u32,
    /// Element type.
    pub dtype: CudaDType,
    /// How the forward's K and V are stored (the element type unless an
    /// fp8 cache's). K and V tiles hold the element type either way.
    pub kv: CudaKv,
    /// Forward: query rows per block (`BQ`).
    pub block_q: u32,
    /// Forward: keys per tile (`BKV`).
    pub block_kv: u32,
    /// Forward: warps per block.
    pub warps: u32,
    /// Backward: query rows per tile (`BBQ`; the dQ kernel's block).
    pub bwd_block_q: u32,
    /// Backward: keys per tile (`BBKV`; the dK/dV kernel's block).
    pub bwd_block_kv: u32,
    /// Backward (dQ and dK/dV): warps per block.
    pub bwd_warps: u32,
}

impl CudaTiles {
    /// Defaults for head dims `head_dim` (`D`) and `value_dim` (`Dv`), each
    /// a multiple of 8 in 8..=[`MAX_HEAD_DIM`], and `dtype`, by the wider
    /// of the two (`W = max(D, Dv)`; every size grows with each dim, so a
    /// row that fits `W × W` fits every pair under it):
    ///
    /// | dtype | W | forward BQ×BKV, warps | backward BBQ×BBKV, warps |
    /// |---|---|---|---|
    /// | f16/bf16 | ≤ 64 | 64×64, 4 | 64×64, 4 |
    /// | f16/bf16 | ≤ 128 | 64×64, 4 | 64×32, 4 |
    /// | f16/bf16 | ≤ 256 | 64×32, 8 | 32×32, 8 |
    /// | f16/bf16 | ≤ 576 | 16×32, 8 | 16×16, 16 |
    /// | f32 | ≤ 128 | 32×32, 4 | 32×32, 4 |
    /// | f32 | ≤ 256 | 16×32, 4 | 16×16, 4 |
    /// | f32 | ≤ 576 | 16×8, 8 | 8×8, 8 |
    ///
    /// Chosen so every kernel fits [`MAX_SMEM_BYTES`] and
    /// [`MAX_ACCUMULATORS_PER_THREAD`] (the bound that binds at W = 128 and
    /// 256); f16/bf16 tiles are multiples of the 16-row MMA shape. The
    /// forward's accumulators hold `BQ × Dv`, dQ's `BBQ × D`, dK/dV's
    /// `BBKV × D` and `BBKV × Dv`. The standard pairs (MLA prefill 192/128,
    /// absorbed MLA decode 576/512, and 128/64, 64/32):
    ///
    /// | D/Dv | dtype | forward: smem, acc./thread | backward: smem, dQ acc., dK+dV acc. |
    /// |---|---|---|---|
    /// | 192/128 | f16/bf16 | 60.9 KiB, 32 | 56.4 KiB, 24, 24 + 16 |
    /// | 192/128 | f32 | 54.9 KiB, 16 | 42.9 KiB, 24, 24 + 16 |
    /// | 576/512 | f16/bf16 | 91.1 KiB, 32 | 73.2 KiB, 20, 20 + 16 |
    /// | 576/512 | f32 | 71.1 KiB, 32 | 69.0 KiB, 18, 18 + 16 |
    /// | 128/64 | f16/bf16 | 70.0 KiB, 32 | 67.6 KiB, 64, 32 + 16 |
    /// | 128/64 | f32 | 45.4 KiB, 16 | 57.9 KiB, 32, 32 + 16 |
    /// | 64/32 | f16/bf16 | 50.0 KiB, 16 | 80.8 KiB, 32, 32 + 16 |
    /// | 64/32 | f32 | 25.4 KiB, 8 | 33.9 KiB, 16, 16 + 8 |
    ///
    /// Past 256 the forward keeps 16 query rows: absorbed decode packs the
    /// `Hq·Sq` rows of a kv head's group into a block, 16 for one token of
    /// 16 query heads, and 16 rows of 512 values over 8 warps are 32
    /// accumulators a thread; K and V tiles of 32 (f16/bf16) or 8 (f32) keys
    /// then fit beside them. The backward fits with 16 × 16 tiles over 16
    /// warps (f16/bf16; a 16-row MMA tile is the least) and 8 × 8 over 8
    /// (f32).
    pub fn for_problem(head_dim: u32, value_dim: u32, dtype: CudaDType) -> CudaTiles {
        let (fwd, bwd) = match (dtype.tensor_cores(), head_dim.max(value_dim)) {
            (true, 0..=64) => ((64, 64, 4), (64, 64, 4)),
            (true, 65..=128) => ((64, 64, 4), (64, 32, 4)),
            (true, 129..=256) => ((64, 32, 8), (32, 32, 8)),
            (true, _) => ((16, 32, 8), (16, 16, 16)),
            (false, 0..=128) => ((32, 32, 4), (32, 32, 4)),
            (false, 129..=256) => ((16, 32, 4), (16, 16, 4)),
            (false, _) => ((16, 8, 8), (8, 8, 8)),
        };
        CudaTiles {
            head_dim,
            value_dim,
            dtype,
            kv: CudaKv::Elem,
            block_q: fwd.0,
            block_kv: fwd.1,
            warps: fwd.2,
            bwd_block_q: bwd.0,
            bwd_block_kv: bwd.1,
            bwd_warps: bwd.2,
        }
    }

    /// These tiles over K and V stored as `kv` (the same tiles: fp8 rows
    /// are converted to the element type as they are staged).
    pub fn with_kv(self, kv: CudaKv) -> CudaTiles {
        CudaTiles { kv, ..self }
    }

    /// The tile size `size` counts in.
    pub fn size(&self, size: Size) -> u32 {
        match size {
            Size::BlockQ => self.block_q,
            Size::BwdBlockQ => self.bwd_block_q,
            Size::BwdBlockKv => self.bwd_block_kv,
            Size::DeltaRows => DELTA_ROWS_PER_BLOCK,
        }
    }

    /// Threads per block of the forward kernel.
    pub fn threads(&self) -> u32 {
        32 * self.warps
    }

    /// Threads per block of the dQ and dK/dV kernels.
    pub fn bwd_threads(&self) -> u32 {
        32 * self.bwd_warps
    }

    /// `dim` as the tiles store it (see [`Self::padded_head_dim`]).
    fn padded(&self, dim: u32) -> u32 {
        if self.dtype.tensor_cores() {
            dim.next_multiple_of(16)
        } else {
            dim
        }
    }

    /// Row stride in elements of a shared-memory tile of `dim`-wide rows
    /// (see [`Self::row_stride`]).
    fn stride(&self, dim: u32) -> u32 {
        if self.dtype.tensor_cores() {
            self.padded(dim) + 8
        } else {
            dim + 1
        }
    }

    /// The head dim as the q/k tiles store it (`DP`): rounded up to the MMA
    /// k-step of 16 on tensor cores (the padding columns hold zeros, so they
    /// add nothing to any dot product), `D` itself on CUDA cores.
    pub fn padded_head_dim(&self) -> u32 {
        self.padded(self.head_dim)
    }

    /// The value head dim as the v/dO tiles store it (`DVP`), padded as
    /// [`Self::padded_head_dim`].
    pub fn padded_value_dim(&self) -> u32 {
        self.padded(self.value_dim)
    }

    /// Row stride in elements of q/k tiles in shared memory (`LDE`): on
    /// tensor cores `DP + 8` (rows 16 bytes apart modulo 128, so the eight
    /// rows a fragment load touches hit distinct banks); on CUDA cores
    /// `D + 1` (odd: threads reading one element of each of 32 rows hit 32
    /// banks).
    pub fn row_stride(&self) -> u32 {
        self.stride(self.head_dim)
    }

    /// Row stride in elements of v/dO tiles in shared memory (`LDV`), as
    /// [`Self::row_stride`] for `Dv`.
    pub fn value_row_stride(&self) -> u32 {
        self.stride(self.value_dim)
    }

    /// Row stride in floats of an f32 score tile with `cols` keys: `cols + 4`
    /// (keeps 16-byte row alignment, spreads rows over banks).
    pub fn score_stride(cols: u32) -> u32 {
        cols + 4
    }

    /// Row stride in elements of a 16-bit P or dS tile with `cols` keys
    /// (tensor cores only): `cols + 8`.
    pub fn prob_stride(cols: u32) -> u32 {
        cols + 8
    }

    /// Bytes of a tile of `rows` q/k rows.
    fn tile_bytes(&self, rows: u32) -> u64 {
        u64::from(rows) * u64::from(self.row_stride()) * self.dtype.size()
    }

    /// Bytes of a tile of `rows` v/dO rows.
    fn value_tile_bytes(&self, rows: u32) -> u64 {
        u64::from(rows) * u64::from(self.value_row_stride()) * self.dtype.size()
    }

    /// The forward kernel's shared memory: Q (`BQ` rows of `D`), K and V
    /// (`BKV` rows each, of `D` and `Dv`, both resident for the tile), the
    /// f32 score/probability tile, on tensor cores its 16-bit copy (the A
    /// operand of P·V), per row the running max, sum, rescale factor and
    /// largest score (the sink apart),
    /// per key whether any row of the tile sees it, and over an fp8 cache
    /// per key its score factor (K scale) and `P` column factor (V scale).
    pub fn forward_layout(&self) -> SmemLayout {
        let (bq, bkv) = (self.block_q, self.block_kv);
        let mut l = SmemLayout::default();
        l.push("FWD_Q", self.tile_bytes(bq));
        l.push("FWD_K", self.tile_bytes(bkv));
        l.push("FWD_V", self.value_tile_bytes(bkv));
        l.push("FWD_S", 4 * u64::from(bq * Self::score_stride(bkv)));
        if self.dtype.tensor_cores() {
            l.push("FWD_P", 2 * u64::from(bq * Self::prob_stride(bkv)));
        }
        l.push("FWD_ROW_M", 4 * u64::from(bq));
        l.push("FWD_ROW_L", 4 * u64::from(bq));
        l.push("FWD_ROW_A", 4 * u64::from(bq));
        l.push("FWD_ROW_X", 4 * u64::from(bq));
        l.push("FWD_SEEN", 4 * u64::from(bkv));
        if self.kv.bytes() {
            l.push("FWD_KF", 4 * u64::from(bkv));
            l.push("FWD_VF", 4 * u64::from(bkv));
        }
        l
    }

    /// The backward tile kernels' shared memory (dQ and dK/dV use the same
    /// layout): Q and dO (`BBQ` rows of `D` and `Dv`), K and V (`BBKV` rows
    /// of `D` and `Dv`), the f32 S→P and dP→dS tiles, on tensor cores their
    /// 16-bit copies (MMA operands), per query row lse and `D_i`, and per
    /// key whether any row of the tile sees it.
    pub fn backward_layout(&self) -> SmemLayout {
        let (bq, bkv) = (self.bwd_block_q, self.bwd_block_kv);
        let mut l = SmemLayout::default();
        l.push("BWD_Q", self.tile_bytes(bq));
        l.push("BWD_DO", self.value_tile_bytes(bq));
        l.push("BWD_K", self.tile_bytes(bkv));
        l.push("BWD_V", self.value_tile_bytes(bkv));
        l.push("BWD_S", 4 * u64::from(bq * Self::score_stride(bkv)));
        l.push("BWD_DP", 4 * u64::from(bq * Self::score_stride(bkv)));
        if self.dtype.tensor_cores() {
            l.push("BWD_PE", 2 * u64::from(bq * Self::prob_stride(bkv)));
            l.push("BWD_DSE", 2 * u64::from(bq * Self::prob_stride(bkv)));
        }
        l.push("BWD_LSE", 4 * u64::from(bq));
        l.push("BWD_DELTA", 4 * u64::from(bq));
        l.push("BWD_SEEN", 4 * u64::from(bkv));
        l
    }

    /// Dynamic shared memory of [`kernels::FORWARD`] in bytes.
    pub fn forward_smem_bytes(&self) -> u64 {
        self.forward_layout().bytes()
    }

    /// Dynamic shared memory of [`kernels::DQ`] in bytes.
    pub fn dq_smem_bytes(&self) -> u64 {
        self.backward_layout().bytes()
    }

    /// Dynamic shared memory of [`kernels::DKDV`] in bytes.
    pub fn dkdv_smem_bytes(&self) -> u64 {
        self.backward_layout().bytes()
    }

    /// f32 accumulators per thread holding a `rows × padded` tile over
    /// `threads` threads: on tensor cores 4 per 16×8 MMA tile, the tiles
    /// dealt round robin to the warps; on CUDA cores the elements dealt
    /// round robin.
    fn accumulators(&self, rows: u32, padded: u32, threads: u32) -> u32 {
        if self.dtype.tensor_cores() {
            4 * ((rows / 16) * (padded / 8)).div_ceil(threads / 32)
        } else {
            (rows * padded).div_ceil(threads)
        }
    }

    /// f32 accumulators per thread of the forward kernel (`BQ × DVP`).
    pub fn forward_accumulators(&self) -> u32 {
        self.accumulators(self.block_q, self.padded_value_dim(), self.threads())
    }

    /// f32 accumulators per thread of the dQ kernel (`BBQ × DP`).
    pub fn dq_accumulators(&self) -> u32 {
        self.accumulators(self.bwd_block_q, self.padded_head_dim(), self.bwd_threads())
    }

    /// f32 accumulators per thread of the dK/dV kernel (`BBKV × DP` and
    /// `BBKV × DVP`).
    pub fn dkdv_accumulators(&self) -> u32 {
        let (rows, threads) = (self.bwd_block_kv, self.bwd_threads());
        self.accumulators(rows, self.padded_head_dim(), threads)
            + self.accumulators(rows, self.padded_value_dim(), threads)
    }

    /// Checks every derived size: the head dims, the tile shapes the MMA
    /// needs, threads per block, shared memory per kernel against
    /// [`MAX_SMEM_BYTES`] and accumulators per thread against
    /// [`MAX_ACCUMULATORS_PER_THREAD`].
    pub fn validate(&self) -> Result<(), TilingError> {
        // Rows are whole 16-byte chunks of 16-bit elements (the loaders'
        // vector path), and a padded row whole MMA k-steps.
        for (d, rule) in [
            (self.head_dim, "a multiple of 8 in 8..=576"),
            (
                self.value_dim,
                "a value head dim: a multiple of 8 in 8..=576",
            ),
        ] {
            if d == 0 || d > MAX_HEAD_DIM || !d.is_multiple_of(8) {
                return Err(TilingError::HeadDim { head_dim: d, rule });
            }
        }
        for (what, w) in [("warps", self.warps), ("bwd_warps", self.bwd_warps)] {
            // 1024 threads per block at most.
            if w == 0 || w > 32 {
                return Err(TilingError::Size {
                    what,
                    value: w,
                    rule: "in 1..=32".into(),
                });
            }
        }
        // Rows and keys per tile: multiples of 16 (the MMA's M and K, and the
        // score tile's 16×8 blocks) on tensor cores, of 8 on CUDA cores.
        let unit = if self.dtype.tensor_cores() { 16 } else { 8 };
        for (what, b) in [
            ("block_q", self.block_q),
            ("block_kv", self.block_kv),
            ("bwd_block_q", self.bwd_block_q),
            ("bwd_block_kv", self.bwd_block_kv),
        ] {
            if b == 0 || !b.is_multiple_of(unit) || b > 256 {
                return Err(TilingError::Size {
                    what,
                    value: b,
                    rule: format!(
                        "a positive multiple of {unit} up to 256 ({} tiles)",
                        self.dtype.name()
                    ),
                });
            }
        }
        for (kernel, needed) in [
            ("forward", self.forward_accumulators()),
            ("dQ", self.dq_accumulators()),
            ("dK/dV", self.dkdv_accumulators()),
        ] {
            if needed > MAX_ACCUMULATORS_PER_THREAD {
                return Err(TilingError::Registers {
                    kernel,
                    needed,
                    max: MAX_ACCUMULATORS_PER_THREAD,
                });
            }
        }
        for (kernel, bytes) in [
            ("forward", self.forward_smem_bytes()),
            ("backward", self.dq_smem_bytes()),
        ] {
            if bytes > MAX_SMEM_BYTES {
                return Err(TilingError::Memory {
                    kernel,
                    memory: "dynamic shared memory",
                    bytes,
                    max: MAX_SMEM_BYTES,
                    limit: "the opt-in maximum of sm_86 and sm_89",
                });
            }
        }
        Ok(())
    }
}

impl Tiling for CudaTiles {
    /// The override applies to the forward and backward tiles alike.
    fn with_override(self, q: Option<u32>, kv: Option<u32>) -> CudaTiles {
        CudaTiles {
            block_q: q.unwrap_or(self.block_q),
            bwd_block_q: q.unwrap_or(self.bwd_block_q),
            block_kv: kv.unwrap_or(self.block_kv),
            bwd_block_kv: kv.unwrap_or(self.bwd_block_kv),
            ..self
        }
    }

    fn validate(&self) -> Result<(), TilingError> {
        CudaTiles::validate(self)
    }
}

/// The translation unit of `modules` for tiles `cfg`, around
/// `variant_section` (the variant's CUDA lowering,
/// [`variant_section::<Cuda>`](crate::emit::gpu::variant_section)): the
/// configuration header, the variant section, the shared tile building
/// blocks, then each module's preamble (each piece once, where modules
/// share it) and each of its kernels' signature (from its description) and
/// body.
pub fn source(
    variant_section: &str,
    modules: &[&Module],
    cfg: &CudaTiles,
) -> Result<String, TilingError> {
    cfg.validate()?;
    let mut s = kernels::header(cfg);
    s.push_str(variant_section);
    s.push_str(kernels::COMMON);
    let mut written: Vec<&str> = Vec::new();
    for module in modules {
        for piece in module.preamble {
            if !written.contains(piece) {
                written.push(piece);
                s.push_str(piece);
            }
        }
        for (kernel, body) in module.kernels {
            s.push('\n');
            s.push_str(&kernel.signature().to_string());
            s.push_str(body);
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_kernel_follows_the_arena_layout() {
        let src = kernels::SUMMARY_SOURCE;
        assert!(src.contains(&format!(
            "constexpr unsigned BX_SUMMARY_BLOCK = {};",
            crate::params::SUMMARY_BLOCK
        )));
        assert!(src.contains(&format!("__launch_bounds__({})", kernels::SUMMARY_THREADS)));
    }

    const DTYPES: [CudaDType; 3] = [CudaDType::F32, CudaDType::F16, CudaDType::Bf16];

    #[test]
    fn default_tiles_validate_for_every_pair_of_head_dims_and_dtype() {
        for dtype in DTYPES {
            for d in (8..=MAX_HEAD_DIM).step_by(8) {
                for dv in (8..=MAX_HEAD_DIM).step_by(8) {
                    for kv in CudaKv::ALL {
                        let cfg = CudaTiles::for_problem(d, dv, dtype).with_kv(kv);
                        cfg.validate()
                            .unwrap_or_else(|e| panic!("D={d} Dv={dv} {dtype:?} {kv:?}: {e}"));
                        assert!(cfg.padded_head_dim() >= d && cfg.padded_value_dim() >= dv);
                    }
                }
            }
        }
    }

    /// fp8 K and V are staged into tiles of the element type: the tiles
    /// and the backward's layout are those of the element type, the
    /// forward has two per-key factor arrays more; the header declares
    /// the stored type and its conversion, and the forward takes the bytes
    /// and the scales.
    #[test]
    fn fp8_caches_keep_the_element_tiles() {
        for dtype in DTYPES {
            for (d, dv) in [(40, 24), (64, 64), (128, 128), (576, 512)] {
                let base = CudaTiles::for_problem(d, dv, dtype);
                for (kv, unit) in [
                    (CudaKv::E4m3, "256.0f"),
                    (CudaKv::E5m2, "1.0f"),
                    (CudaKv::I8, "1.0f"),
                ] {
                    let cfg = base.with_kv(kv);
                    cfg.validate().expect("fp8 tiles validate");
                    assert_eq!(
                        cfg.forward_smem_bytes(),
                        base.forward_smem_bytes() + 8 * u64::from(cfg.block_kv)
                    );
                    assert_eq!(cfg.backward_layout(), base.backward_layout());
                    let header = kernels::header(&cfg);
                    for line in [
                        "#define BX_KV_BYTES 1",
                        "typedef unsigned char kv_t;",
                        &format!("constexpr float KV_UNIT = {unit};"),
                        "elem_t bx_staged(unsigned char b)",
                    ] {
                        assert!(header.contains(line), "{kv:?} {dtype:?}: no `{line}`");
                    }
                }
                let header = kernels::header(&base);
                assert!(header.contains("#define BX_KV_BYTES 0\ntypedef elem_t kv_t;"));
            }
        }
        let signature = kernels::FORWARD.signature().to_string();
        for arg in [
            "const kv_t* __restrict__ k,",
            "const kv_t* __restrict__ v,",
            "const float* __restrict__ k_scale,",
            "const float* __restrict__ v_scale,",
        ] {
            assert!(signature.contains(arg), "{signature}");
        }
    }

    /// DeepSeek MLA (prefill 192/128, absorbed decode 576/512) and two
    /// halved pairs: the defaults validate, and the value tiles and
    /// accumulators are counted at `Dv`.
    #[test]
    fn mla_head_dims_have_tiles() {
        for (d, dv) in [(192, 128), (576, 512), (128, 64), (64, 32)] {
            for dtype in DTYPES {
                let cfg = CudaTiles::for_problem(d, dv, dtype);
                cfg.validate()
                    .unwrap_or_else(|e| panic!("D={d} Dv={dv} {dtype:?}: {e}"));
                let same = CudaTiles::for_problem(d, d, dtype);
                assert_eq!((cfg.block_q, cfg.block_kv), (same.block_q, same.block_kv));
                let v_tile = |l: SmemLayout, name| {
                    l.buffers.iter().find(|b| b.name == name).expect(name).bytes
                };
                let row = u64::from(cfg.value_row_stride()) * dtype.size();
                assert_eq!(
                    v_tile(cfg.forward_layout(), "FWD_V"),
                    u64::from(cfg.block_kv) * row
                );
                assert_eq!(
                    v_tile(cfg.backward_layout(), "BWD_DO"),
                    u64::from(cfg.bwd_block_q) * row
                );
                assert!(cfg.forward_layout().bytes() < same.forward_layout().bytes());
                assert!(cfg.forward_accumulators() <= same.forward_accumulators());
                assert_eq!(cfg.dq_accumulators(), same.dq_accumulators());
            }
        }
        // Absorbed decode: the 16 rows of one token of 16 query heads in one
        // block of the forward.
        for dtype in DTYPES {
            assert_eq!(CudaTiles::for_problem(576, 512, dtype).block_q, 16);
        }
    }

    #[test]
    fn validate_rejects_bad_configurations() {
        let good = CudaTiles::for_problem(128, 128, CudaDType::F16);
        let bad = [
            CudaTiles {
                head_dim: 36,
                ..good
            },
            CudaTiles {
                value_dim: 36,
                ..good
            },
            CudaTiles {
                value_dim: 0,
                ..good
            },
            CudaTiles {
                head_dim: MAX_HEAD_DIM + 8,
                ..good
            },
            CudaTiles {
                block_q: 24,
                ..good
            },
            CudaTiles { warps: 0, ..good },
            CudaTiles {
                bwd_block_kv: 128,
                ..good
            },
            CudaTiles {
                block_q: 256,
                block_kv: 256,
                ..good
            },
            // 256-wide values on the 128 tier's tiles: the forward's
            // accumulators, 64 × 256 over four warps.
            CudaTiles {
                value_dim: 256,
                ..good
            },
        ];
        for cfg in bad {
            assert!(cfg.validate().is_err(), "{cfg:?} should not validate");
        }
        // 576/512 with the backward of the 256 tier: over the accumulators
        // (and the shared memory).
        let mla = CudaTiles::for_problem(576, 512, CudaDType::Bf16);
        let over = CudaTiles {
            bwd_block_q: 32,
            bwd_block_kv: 32,
            bwd_warps: 8,
            ..mla
        };
        assert!(matches!(
            over.validate(),
            Err(TilingError::Registers { .. } | TilingError::Memory { .. })
        ));
    }

    #[test]
    fn layout_offsets_are_aligned_and_disjoint() {
        for cfg in [
            CudaTiles::for_problem(40, 40, CudaDType::Bf16),
            CudaTiles::for_problem(40, 24, CudaDType::Bf16),
            CudaTiles::for_problem(576, 512, CudaDType::F32),
        ] {
            for l in [cfg.forward_layout(), cfg.backward_layout()] {
                let mut end = 0;
                for b in &l.buffers {
                    assert_eq!(b.offset % 16, 0, "{b:?}");
                    assert!(b.offset >= end, "{b:?} overlaps");
                    end = b.offset + b.bytes;
                }
                assert!(l.bytes() >= end);
            }
        }
    }
}
