//! The WGSL target: IR → WGSL compute shaders.
//!
//! - [`ast`]: a small typed WGSL representation with `Display`;
//! - [`lower`]: the four variant functions (`score`, `score_grad`, `mask`,
//!   `classify`) and the helpers that give WGSL the IR's semantics;
//! - [`kernels`]: the attention kernels, text templates around them.
//!
//! One module per (program, head dim): [`forward_module`] and
//! [`backward_modules`]. Bindings (group 0): 0 `params: Params` (uniform, the
//! variant's fields, bool as u32), 1 `shape: Shape` (uniform: batch, heads_q,
//! heads_kv, seq_q, seq_k, scale), then the storage buffers listed in
//! [`kernels`].

pub mod ast;
pub mod kernels;
pub mod lower;

use crate::ir::Program;

/// The workgroup memory WebGPU guarantees
/// (`maxComputeWorkgroupStorageSize`).
pub const MAX_WORKGROUP_BYTES: u32 = 16384;
/// The invocations per workgroup WebGPU guarantees
/// (`maxComputeInvocationsPerWorkgroup`, and `maxComputeWorkgroupSizeX`).
pub const MAX_INVOCATIONS: u32 = 256;

/// Tile sizes of the WGSL kernels for one head dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WgslTiles {
    /// Head dim `D` (elements per q/k/v row).
    pub head_dim: u32,
    /// Query rows per tile (`BQ`).
    pub block_q: u32,
    /// Key rows per tile (`BKV`).
    pub block_kv: u32,
    /// Invocations per workgroup (`WG`, one-dimensional).
    pub workgroup_size: u32,
}

impl WgslTiles {
    /// The largest tiles, among a fixed list, whose kernels fit the limits,
    /// with 64 invocations: D ≤ 40 → 16×16, D ≤ 64 → 16×8, D ≤ 96 → 8×8,
    /// D ≤ 128 → 8×4. The backward layout (four row tiles) is what binds.
    pub fn for_head_dim(head_dim: u32) -> WgslTiles {
        const CANDIDATES: [(u32, u32); 7] =
            [(16, 16), (16, 8), (8, 8), (8, 4), (4, 4), (2, 2), (1, 1)];
        let make = |(block_q, block_kv)| WgslTiles {
            head_dim,
            block_q,
            block_kv,
            workgroup_size: 64,
        };
        CANDIDATES
            .into_iter()
            .map(make)
            .find(|t| t.validate().is_ok())
            .unwrap_or_else(|| make((1, 1)))
    }

    /// `var<workgroup>` bytes of the forward kernel: Q tile (BQ·D), one K-then-V
    /// tile (BKV·D: V is loaded once the scores are done), scores/probabilities
    /// (BQ·BKV), and per-row max, sum and rescale factor (3·BQ), all f32.
    pub fn forward_workgroup_bytes(&self) -> u64 {
        let (d, q, kv) = self.dims();
        4 * (q * d + kv * d + q * kv + 3 * q)
    }

    /// `var<workgroup>` bytes of the largest backward kernel: Q and dO tiles
    /// (2·BQ·D), K and V tiles (2·BKV·D: dQ needs K after dP, dK/dV needs all
    /// four at once), P and dS (2·BQ·BKV), and lse, D_i and `Σ_j P_ij` (3·BQ,
    /// the last only in the D_i kernel).
    pub fn backward_workgroup_bytes(&self) -> u64 {
        let (d, q, kv) = self.dims();
        4 * (2 * q * d + 2 * kv * d + 2 * q * kv + 3 * q)
    }

    /// An upper bound on the loop iterations one invocation runs per tile of
    /// its tile loop, in the kernel that runs the most: every loop counted,
    /// none assumed unrolled (`N_Q`, `N_KV`, `N_PAIRS` as in
    /// [`kernels::COMMON`]):
    ///
    /// - forward, per key tile: K and V loads (2·N_KV), scores
    ///   (N_PAIRS·(1 + D)), online softmax (2·BKV), `P·V` (N_Q·(1 + BKV));
    /// - `D_i`, per key tile: K/V load (N_KV), `P` and `dP` (N_PAIRS·(1 + D)),
    ///   row sums (BKV);
    /// - dQ, per key tile: K/V load, `dS` (N_PAIRS·(1 + D)), `dS·K`
    ///   (N_Q·(1 + BKV));
    /// - dK/dV, per query tile: Q/dO load (N_Q), `P` and `dS`, `dSᵀ·Q` and
    ///   `Pᵀ·dO` (N_KV·(1 + BQ));
    ///
    /// plus one for the tile loop itself.
    pub fn loop_iterations_per_tile(&self) -> u64 {
        let (d, q, kv) = self.dims();
        let wg = u64::from(self.workgroup_size);
        let (n_q, n_kv, n_pairs) = (
            (q * d).div_ceil(wg),
            (kv * d).div_ceil(wg),
            (q * kv).div_ceil(wg),
        );
        let scores = n_pairs * (1 + d);
        let forward = 2 * n_kv + scores + 2 * kv + n_q * (1 + kv);
        let delta = n_kv + scores + kv;
        let dq = n_kv + scores + n_q * (1 + kv);
        let dkdv = n_q + scores + n_kv * (1 + q);
        1 + forward.max(delta).max(dq).max(dkdv)
    }

    /// Tiles one dispatch may loop over so that an invocation stays within
    /// `budget` loop iterations (at least one).
    pub fn tiles_within(&self, budget: u64) -> u32 {
        u32::try_from(budget / self.loop_iterations_per_tile())
            .unwrap_or(u32::MAX)
            .max(1)
    }

    /// The larger of the two layouts.
    pub fn workgroup_bytes(&self) -> u64 {
        self.forward_workgroup_bytes()
            .max(self.backward_workgroup_bytes())
    }

    fn dims(&self) -> (u64, u64, u64) {
        (
            self.head_dim.into(),
            self.block_q.into(),
            self.block_kv.into(),
        )
    }

    /// Checks every derived size against the WebGPU default limits; both the
    /// forward and the backward layout must fit, since one configuration is
    /// chosen per (program, head dim).
    pub fn validate(&self) -> Result<(), String> {
        if self.head_dim == 0 || self.block_q == 0 || self.block_kv == 0 {
            return Err(format!(
                "{self:?}: head dim and block sizes must be positive"
            ));
        }
        if self.workgroup_size == 0 || self.workgroup_size > MAX_INVOCATIONS {
            return Err(format!(
                "{self:?}: workgroup size {} is outside 1..={MAX_INVOCATIONS} \
                 (maxComputeInvocationsPerWorkgroup)",
                self.workgroup_size
            ));
        }
        // The online softmax and the row loads give one invocation per row.
        if self.workgroup_size < self.block_q {
            return Err(format!(
                "{self:?}: workgroup size {} is below block_q {} (one invocation per query row)",
                self.workgroup_size, self.block_q
            ));
        }
        let bytes = self.workgroup_bytes();
        if bytes > MAX_WORKGROUP_BYTES.into() {
            return Err(format!(
                "{self:?}: {bytes} bytes of var<workgroup> (forward {}, backward {}) exceed \
                 the {MAX_WORKGROUP_BYTES}-byte limit (maxComputeWorkgroupStorageSize)",
                self.forward_workgroup_bytes(),
                self.backward_workgroup_bytes()
            ));
        }
        Ok(())
    }
}

/// The variant section every module shares: the semantic helpers, the
/// `Params` uniform at binding 0, and the four lowered variant functions.
pub fn variant_functions(program: &Program) -> String {
    let mut s = String::from(lower::HELPERS);
    s.push_str("\n// ---- variant ");
    s.push_str(&program.name);
    s.push_str(" ----\n");
    s.push_str(&lower::params_struct(program).to_string());
    s.push_str("@group(0) @binding(0) var<uniform> params: Params;\n\n");
    for f in [
        &program.score,
        &program.score_grad,
        &program.mask,
        &program.classify,
    ] {
        s.push_str(&lower::function(program, f).to_string());
        s.push('\n');
    }
    s
}

fn module(variant_fns: &str, cfg: &WgslTiles, parts: &[&str]) -> String {
    if let Err(e) = cfg.validate() {
        panic!("invalid WGSL tile configuration: {e}");
    }
    let mut s = kernels::header(cfg);
    s.push_str(kernels::COMMON);
    s.push('\n');
    s.push_str(variant_fns);
    for p in parts {
        s.push_str(p);
    }
    s
}

/// The forward module (entry point `attn_fwd`).
///
/// # Panics
/// If `cfg` does not [validate](WgslTiles::validate).
pub fn forward_module(program: &Program, cfg: &WgslTiles) -> String {
    forward_module_from(&variant_functions(program), cfg)
}

/// [`forward_module`] from the text of [`variant_functions`], for runtimes
/// that assemble modules per head dim without the [`Program`].
///
/// # Panics
/// If `cfg` does not [validate](WgslTiles::validate).
pub fn forward_module_from(variant_fns: &str, cfg: &WgslTiles) -> String {
    module(variant_fns, cfg, &[kernels::FORWARD])
}

/// The backward modules: `(dq, dkdv)`. The first has entry points
/// `attn_bwd_delta` (`D_i = rowsum(dO ∘ O)`, run first) and `attn_bwd_dq`; the
/// second has `attn_bwd_dkdv`.
///
/// # Panics
/// If `cfg` does not [validate](WgslTiles::validate).
pub fn backward_modules(program: &Program, cfg: &WgslTiles) -> (String, String) {
    backward_modules_from(&variant_functions(program), cfg)
}

/// [`backward_modules`] from the text of [`variant_functions`].
///
/// # Panics
/// If `cfg` does not [validate](WgslTiles::validate).
pub fn backward_modules_from(variant_fns: &str, cfg: &WgslTiles) -> (String, String) {
    (
        module(
            variant_fns,
            cfg,
            &[kernels::BACKWARD_DQ, kernels::BACKWARD_PAIR],
        ),
        module(
            variant_fns,
            cfg,
            &[kernels::BACKWARD_DKDV, kernels::BACKWARD_PAIR],
        ),
    )
}
