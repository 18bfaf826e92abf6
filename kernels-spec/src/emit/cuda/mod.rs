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
//! # Building and launching a module for (variant, head dim, dtype)
//!
//! ```text
//! let section = variant_section::<Cuda>(&program);     // or the variant's CUDA lowering
//! let cfg = choose_tiles(CudaTiles::for_problem(d, dtype), tile_q, tile_kv)?;
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
//! contiguous; `E` is the element type: `float` for [`CudaDType::F32`], the
//! 16-bit pattern (`unsigned short`) for [`CudaDType::F16`]/[`CudaDType::Bf16`];
//! `lse` and `delta` are f32. `int` arguments are 32-bit, pointers 64-bit;
//! `params` is the 128-byte `Params` struct by value
//! ([`ParamWords`](crate::params::ParamWords)). `B, Hq, Hkv ≤ 65535` (grid
//! y/z), `Hq % Hkv == 0`.
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

/// Tile configuration of the CUDA kernels for one (head dim, dtype).
///
/// Derived sizes (padded head dim, row strides, shared memory per kernel,
/// threads, accumulators per thread) are computed by the methods here and
/// checked in [`CudaTiles::validate`]; the header of every source writes them
/// as constants, so the kernels and the launcher cannot disagree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaTiles {
    /// Head dim `D` (elements per q/k/v row), a multiple of 8 in 8..=256.
    pub head_dim: u32,
    /// Element type.
    pub dtype: CudaDType,
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
    /// Defaults for `head_dim` (a multiple of 8 in 8..=256) and `dtype`:
    ///
    /// | dtype | D | forward BQ×BKV, warps | backward BBQ×BBKV, warps |
    /// |---|---|---|---|
    /// | f16/bf16 | ≤ 64 | 64×64, 4 | 64×64, 4 |
    /// | f16/bf16 | ≤ 128 | 64×64, 4 | 64×32, 4 |
    /// | f16/bf16 | ≤ 256 | 64×32, 8 | 32×32, 8 |
    /// | f32 | ≤ 128 | 32×32, 4 | 32×32, 4 |
    /// | f32 | ≤ 256 | 16×32, 4 | 16×16, 4 |
    ///
    /// Chosen so every kernel fits [`MAX_SMEM_BYTES`] and
    /// [`MAX_ACCUMULATORS_PER_THREAD`] (the bound that binds at D = 128 and
    /// 256); f16/bf16 tiles are multiples of the 16-row MMA shape.
    pub fn for_problem(head_dim: u32, dtype: CudaDType) -> CudaTiles {
        let (fwd, bwd) = match (dtype.tensor_cores(), head_dim) {
            (true, 0..=64) => ((64, 64, 4), (64, 64, 4)),
            (true, 65..=128) => ((64, 64, 4), (64, 32, 4)),
            (true, _) => ((64, 32, 8), (32, 32, 8)),
            (false, 0..=128) => ((32, 32, 4), (32, 32, 4)),
            (false, _) => ((16, 32, 4), (16, 16, 4)),
        };
        CudaTiles {
            head_dim,
            dtype,
            block_q: fwd.0,
            block_kv: fwd.1,
            warps: fwd.2,
            bwd_block_q: bwd.0,
            bwd_block_kv: bwd.1,
            bwd_warps: bwd.2,
        }
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

    /// The head dim as the tiles store it (`DP`): rounded up to the MMA
    /// k-step of 16 on tensor cores (the padding columns hold zeros, so they
    /// add nothing to any dot product), `D` itself on CUDA cores.
    pub fn padded_head_dim(&self) -> u32 {
        if self.dtype.tensor_cores() {
            self.head_dim.next_multiple_of(16)
        } else {
            self.head_dim
        }
    }

    /// Row stride in elements of q/k/v/dO tiles in shared memory (`LDE`):
    /// on tensor cores `DP + 8` (rows 16 bytes apart modulo 128, so the eight
    /// rows a fragment load touches hit distinct banks); on CUDA cores
    /// `D + 1` (odd: threads reading one element of each of 32 rows hit 32
    /// banks).
    pub fn row_stride(&self) -> u32 {
        if self.dtype.tensor_cores() {
            self.padded_head_dim() + 8
        } else {
            self.head_dim + 1
        }
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

    fn tile_bytes(&self, rows: u32) -> u64 {
        u64::from(rows) * u64::from(self.row_stride()) * self.dtype.size()
    }

    /// The forward kernel's shared memory: Q (`BQ` rows), K and V (`BKV`
    /// rows each, both resident for the tile), the f32 score/probability
    /// tile, on tensor cores its 16-bit copy (the A operand of P·V), per
    /// row the running max, sum and rescale factor, and per key whether any
    /// row of the tile sees it.
    pub fn forward_layout(&self) -> SmemLayout {
        let (bq, bkv) = (self.block_q, self.block_kv);
        let mut l = SmemLayout::default();
        l.push("FWD_Q", self.tile_bytes(bq));
        l.push("FWD_K", self.tile_bytes(bkv));
        l.push("FWD_V", self.tile_bytes(bkv));
        l.push("FWD_S", 4 * u64::from(bq * Self::score_stride(bkv)));
        if self.dtype.tensor_cores() {
            l.push("FWD_P", 2 * u64::from(bq * Self::prob_stride(bkv)));
        }
        l.push("FWD_ROW_M", 4 * u64::from(bq));
        l.push("FWD_ROW_L", 4 * u64::from(bq));
        l.push("FWD_ROW_A", 4 * u64::from(bq));
        l.push("FWD_SEEN", 4 * u64::from(bkv));
        l
    }

    /// The backward tile kernels' shared memory (dQ and dK/dV use the same
    /// layout): Q and dO (`BBQ` rows), K and V (`BBKV` rows), the f32 S→P and
    /// dP→dS tiles, on tensor cores their 16-bit copies (MMA operands), per
    /// query row lse and `D_i`, and per key whether any row of the tile
    /// sees it.
    pub fn backward_layout(&self) -> SmemLayout {
        let (bq, bkv) = (self.bwd_block_q, self.bwd_block_kv);
        let mut l = SmemLayout::default();
        l.push("BWD_Q", self.tile_bytes(bq));
        l.push("BWD_DO", self.tile_bytes(bq));
        l.push("BWD_K", self.tile_bytes(bkv));
        l.push("BWD_V", self.tile_bytes(bkv));
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

    /// f32 accumulators per thread holding a `rows × DP` tile over `threads`
    /// threads: on tensor cores 4 per 16×8 MMA tile, the tiles dealt round
    /// robin to the warps; on CUDA cores the elements dealt round robin.
    fn accumulators(&self, rows: u32, threads: u32) -> u32 {
        let dp = self.padded_head_dim();
        if self.dtype.tensor_cores() {
            4 * ((rows / 16) * (dp / 8)).div_ceil(threads / 32)
        } else {
            (rows * dp).div_ceil(threads)
        }
    }

    /// f32 accumulators per thread of the forward kernel (`BQ × DP`).
    pub fn forward_accumulators(&self) -> u32 {
        self.accumulators(self.block_q, self.threads())
    }

    /// f32 accumulators per thread of the dQ kernel (`BBQ × DP`).
    pub fn dq_accumulators(&self) -> u32 {
        self.accumulators(self.bwd_block_q, self.bwd_threads())
    }

    /// f32 accumulators per thread of the dK/dV kernel (two `BBKV × DP`).
    pub fn dkdv_accumulators(&self) -> u32 {
        2 * self.accumulators(self.bwd_block_kv, self.bwd_threads())
    }

    /// Checks every derived size: the head dim, the tile shapes the MMA
    /// needs, threads per block, shared memory per kernel against
    /// [`MAX_SMEM_BYTES`] and accumulators per thread against
    /// [`MAX_ACCUMULATORS_PER_THREAD`].
    pub fn validate(&self) -> Result<(), TilingError> {
        let d = self.head_dim;
        if d == 0 || d > 256 || !d.is_multiple_of(8) {
            return Err(TilingError::HeadDim {
                head_dim: d,
                rule: "a multiple of 8 in 8..=256",
            });
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
/// blocks, then each module's preamble (once, where modules share one) and
/// each of its kernels' signature (from its description) and body.
pub fn source(
    variant_section: &str,
    modules: &[&Module],
    cfg: &CudaTiles,
) -> Result<String, TilingError> {
    cfg.validate()?;
    let mut s = kernels::header(cfg);
    s.push_str(variant_section);
    s.push_str(kernels::COMMON);
    let mut preambles: Vec<&str> = Vec::new();
    for module in modules {
        if !preambles.contains(&module.preamble) {
            preambles.push(module.preamble);
            s.push_str(module.preamble);
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

    #[test]
    fn default_tiles_validate_for_every_head_dim_and_dtype() {
        for dtype in [CudaDType::F32, CudaDType::F16, CudaDType::Bf16] {
            for d in (32..=256).step_by(8) {
                let cfg = CudaTiles::for_problem(d, dtype);
                cfg.validate()
                    .unwrap_or_else(|e| panic!("D={d} {dtype:?}: {e}"));
                assert!(cfg.forward_smem_bytes() <= MAX_SMEM_BYTES);
                assert!(cfg.padded_head_dim() >= d);
            }
        }
    }

    #[test]
    fn validate_rejects_bad_configurations() {
        let good = CudaTiles::for_problem(128, CudaDType::F16);
        let bad = [
            CudaTiles {
                head_dim: 36,
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
        ];
        for cfg in bad {
            assert!(cfg.validate().is_err(), "{cfg:?} should not validate");
        }
    }

    #[test]
    fn layout_offsets_are_aligned_and_disjoint() {
        let cfg = CudaTiles::for_problem(40, CudaDType::Bf16);
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
