//! The WGSL target: IR → WGSL compute shaders.
//!
//! - [`dialect`]: how WGSL writes the shared GPU lowering
//!   ([`crate::emit::gpu`]), and the helpers that give it the IR's semantics;
//! - [`interface`]: how a module is described (bindings, entry points,
//!   launch geometry);
//! - [`template`]: template text and the head-dim loops the emitter rolls
//!   or unrolls;
//! - [`kernels`]: the modules, each a description and its templates.
//!
//! One module per (variant, head dims, [`Module`]): [`module_source`] of
//! [`kernels::FORWARD`], and for the backward [`kernels::BACKWARD_DQ`] then
//! [`kernels::BACKWARD_DKDV`]. Every binding of group 0 is declared from the
//! module's description: the variant's parameter block, the `shape` uniform
//! ([`interface::SHAPE`]), then the tensors.

pub mod dialect;
pub mod interface;
pub mod kernels;
pub mod template;

use self::interface::{Module, Size};
use self::template::{Loops, render};
use super::{Tiling, TilingError};

/// The WGSL dialect of the GPU lowering (see [`dialect`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Wgsl;

/// `shape.flags` bit of the dispatch whose range starts a tile loop (the
/// kernels start from zero).
pub const FLAG_FIRST: u32 = 1;
/// `shape.flags` bit of the dispatch whose range ends a tile loop (the
/// kernels finish: normalise, scale).
pub const FLAG_LAST: u32 = 2;

/// The workgroup memory WebGPU guarantees
/// (`maxComputeWorkgroupStorageSize`).
pub const MAX_WORKGROUP_BYTES: u32 = 16384;
/// The invocations per workgroup WebGPU guarantees
/// (`maxComputeInvocationsPerWorkgroup`, and `maxComputeWorkgroupSizeX`).
pub const MAX_INVOCATIONS: u32 = 256;

/// Tile sizes of the WGSL kernels for one pair of head dims (see
/// [`kernels`] for the schedule: one row per invocation, the other side
/// staged in workgroup memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WgslTiles {
    /// Head dim `D` (elements per q/k row).
    pub head_dim: u32,
    /// Value head dim `DV` (elements per v/out row).
    pub value_dim: u32,
    /// Query rows staged per tile by the dK/dV kernel (`BQ`).
    pub block_q: u32,
    /// Key rows staged per tile by the forward, `D_i` and dQ kernels (`BKV`).
    pub block_kv: u32,
    /// Invocations per workgroup (`WG`), one row each: the query tile of the
    /// forward, `D_i` and dQ kernels, the key tile of the dK/dV kernel.
    pub workgroup_size: u32,
}

impl WgslTiles {
    /// Invocations per workgroup: 64 rows.
    pub const ROWS: u32 = 64;
    /// Staged rows are capped here: past it, a tile only delays the skipping
    /// of empty tiles.
    pub const MAX_STAGED: u32 = 64;

    /// [`Self::for_head_dims`] with values as wide as the keys.
    pub fn for_head_dim(head_dim: u32) -> WgslTiles {
        Self::for_head_dims(head_dim, head_dim)
    }

    /// 64 rows per workgroup and the most staged rows that fit the
    /// workgroup memory: `BKV = ⌊16384 / (4·(D + DV))⌋` (K and V rows),
    /// `BQ = ⌊16384 / (4·(D + DV) + 8)⌋` (Q and dO rows, lse and `D_i`),
    /// both at most [`Self::MAX_STAGED`]. D = DV = 64 → BKV 32, BQ 31;
    /// 128 → 16, 15; 192/128 → 12, 12; 576/512 → 3, 3.
    pub fn for_head_dims(head_dim: u32, value_dim: u32) -> WgslTiles {
        let width = u64::from(head_dim.max(1)) + u64::from(value_dim.max(1));
        // In u64: `4·(D + DV)` of head dims near u32::MAX still has a value
        // (one staged row, which then fails validation).
        let fit = |per_row: u64| {
            (u64::from(MAX_WORKGROUP_BYTES) / per_row).clamp(1, Self::MAX_STAGED.into()) as u32
        };
        WgslTiles {
            head_dim,
            value_dim,
            block_q: fit(4 * width + 8),
            block_kv: fit(4 * width),
            workgroup_size: Self::ROWS,
        }
    }

    /// `var<workgroup>` bytes of the forward, `D_i` and dQ kernels: the
    /// staged K and V rows (BKV·(D + DV) f32).
    pub fn forward_workgroup_bytes(&self) -> u64 {
        let (d, dv, _, kv) = self.dims();
        4 * kv * (d + dv)
    }

    /// `var<workgroup>` bytes of the dK/dV kernel: the staged Q and dO rows
    /// (BQ·(D + DV)) and their lse and `D_i` (2·BQ), f32.
    pub fn backward_workgroup_bytes(&self) -> u64 {
        let (d, dv, q, _) = self.dims();
        4 * (q * (d + dv) + 2 * q)
    }

    /// The larger of the two layouts.
    pub fn workgroup_bytes(&self) -> u64 {
        self.forward_workgroup_bytes()
            .max(self.backward_workgroup_bytes())
    }

    /// Whether the head-dim loops are unrolled (both dims at most
    /// [`UNROLL_MAX_HEAD_DIM`]).
    pub fn unrolled(&self) -> bool {
        self.head_dim.max(self.value_dim) <= UNROLL_MAX_HEAD_DIM
    }

    /// An upper bound on the loop iterations one invocation runs per tile of
    /// its tile loop, in the kernel that runs the most. With `N_K =
    /// ⌈BKV·D/WG⌉`, `N_V = ⌈BKV·DV/WG⌉`, `N_Q = ⌈BQ·D/WG⌉`, `N_O =
    /// ⌈BQ·DV/WG⌉`, and `R`, `RV`, `RM` = 0 where the head-dim loops are
    /// unrolled (see [`Self::unrolled`]), else `D`, `DV` and `max(D, DV)`:
    ///
    /// - forward, per key tile: staging (N_K + N_V), scores (BKV·(1 + R)),
    ///   rescale (RV), `P·V` (BKV·(1 + RV));
    /// - `D_i`, per key tile: staging, `P` and `dP` (BKV·(1 + RM));
    /// - dQ, per key tile: staging, `P` and `dP`, `dS·K` (BKV·(1 + RM + R));
    /// - dK/dV, per query tile: staging (N_Q + N_O + ⌈BQ/WG⌉), `P` and
    ///   `dP`, `dSᵀ·Q` and `Pᵀ·dO` (BQ·(1 + 2·RM));
    ///
    /// plus one for the tile loop itself.
    pub fn loop_iterations_per_tile(&self) -> u64 {
        let (d, dv, q, kv) = self.dims();
        let wg = u64::from(self.workgroup_size);
        let (r, rv) = if self.unrolled() { (0, 0) } else { (d, dv) };
        let rm = r.max(rv);
        let stage_kv = (kv * d).div_ceil(wg) + (kv * dv).div_ceil(wg);
        let stage_q = (q * d).div_ceil(wg) + (q * dv).div_ceil(wg) + q.div_ceil(wg);
        let forward = stage_kv + kv * (1 + r) + rv + kv * (1 + rv);
        let delta = stage_kv + kv * (1 + rm);
        let dq = stage_kv + kv * (1 + rm + r);
        let dkdv = stage_q + q * (1 + 2 * rm);
        1 + forward.max(delta).max(dq).max(dkdv)
    }

    /// Tiles one dispatch may loop over so that an invocation stays within
    /// `budget` loop iterations (at least one), where the variant's tile
    /// classifier itself runs `classify` iterations per tile (its summary
    /// reads, [`crate::ir::Program::classify_loop_iterations`]).
    pub fn tiles_within(&self, budget: u64, classify: u64) -> u32 {
        u32::try_from(budget / (self.loop_iterations_per_tile() + classify))
            .unwrap_or(u32::MAX)
            .max(1)
    }

    fn dims(&self) -> (u64, u64, u64, u64) {
        (
            self.head_dim.into(),
            self.value_dim.into(),
            self.block_q.into(),
            self.block_kv.into(),
        )
    }

    /// The tile size `size` counts in.
    pub fn size(&self, size: Size) -> u32 {
        match size {
            Size::Workgroup => self.workgroup_size,
            Size::BlockQ => self.block_q,
            Size::BlockKv => self.block_kv,
        }
    }

    /// Checks every derived size against the WebGPU default limits; both
    /// layouts must fit, since one configuration is chosen per (program,
    /// head dims).
    pub fn validate(&self) -> Result<(), TilingError> {
        if self.head_dim == 0 || self.value_dim == 0 {
            return Err(TilingError::HeadDim {
                head_dim: 0,
                rule: "positive",
            });
        }
        for (what, value) in [("block_q", self.block_q), ("block_kv", self.block_kv)] {
            if value == 0 {
                return Err(TilingError::Size {
                    what,
                    value,
                    rule: "positive".into(),
                });
            }
        }
        if self.workgroup_size == 0 || self.workgroup_size > MAX_INVOCATIONS {
            return Err(TilingError::Size {
                what: "workgroup_size",
                value: self.workgroup_size,
                rule: format!("in 1..={MAX_INVOCATIONS} (maxComputeInvocationsPerWorkgroup)"),
            });
        }
        for (kernel, bytes) in [
            ("forward", self.forward_workgroup_bytes()),
            ("dK/dV", self.backward_workgroup_bytes()),
        ] {
            if bytes > MAX_WORKGROUP_BYTES.into() {
                return Err(TilingError::Memory {
                    kernel,
                    memory: "var<workgroup> memory",
                    bytes,
                    max: MAX_WORKGROUP_BYTES.into(),
                    limit: "maxComputeWorkgroupStorageSize",
                });
            }
        }
        Ok(())
    }
}

impl Tiling for WgslTiles {
    /// The override sets the staged rows: `BQ` (query rows, dK/dV) and
    /// `BKV` (key rows, the others); a workgroup keeps 64 rows.
    fn with_override(self, q: Option<u32>, kv: Option<u32>) -> WgslTiles {
        WgslTiles {
            block_q: q.unwrap_or(self.block_q),
            block_kv: kv.unwrap_or(self.block_kv),
            ..self
        }
    }

    fn validate(&self) -> Result<(), TilingError> {
        WgslTiles::validate(self)
    }
}

/// Head dims up to which the head-dim loops are unrolled (both `D` and
/// `DV`). Unrolled, the
/// kernels run about twice as fast on llvmpipe (private arrays addressed
/// with constants); but its compile time grows faster than the code: at
/// D = 128 the backward modules take ~25 s to compile on a 2-core machine,
/// against ~5 s rolled.
pub const UNROLL_MAX_HEAD_DIM: u32 = 64;

/// The source of `module` for tiles `cfg`, around `variant_section` (the
/// variant's WGSL lowering,
/// [`variant_section::<Wgsl>`](crate::emit::gpu::variant_section)): the
/// configuration header, the binding declarations from the module's
/// description, the shared helpers, the variant section, then the module's
/// templates, their head-dim loops unrolled up to [`UNROLL_MAX_HEAD_DIM`].
pub fn module_source(
    variant_section: &str,
    module: &Module,
    cfg: &WgslTiles,
) -> Result<String, TilingError> {
    cfg.validate()?;
    let mut s = kernels::header(cfg);
    s.push_str(&module.declarations());
    s.push_str(kernels::COMMON);
    s.push('\n');
    s.push_str(variant_section);
    let loops = Loops {
        head_dim: cfg.head_dim,
        value_dim: cfg.value_dim,
        unrolled: cfg.unrolled(),
    };
    for template in module.templates {
        render(&mut s, template, loops);
    }
    Ok(s)
}
