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

/// Tile sizes of the WGSL kernels for one head dim (see [`kernels`] for the
/// schedule: one row per invocation, the other side staged in workgroup
/// memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WgslTiles {
    /// Head dim `D` (elements per q/k/v row).
    pub head_dim: u32,
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

    /// 64 rows per workgroup and the most staged rows that fit the
    /// workgroup memory: `BKV = ⌊16384 / (8·D)⌋` (K and V rows),
    /// `BQ = ⌊16384 / (8·D + 8)⌋` (Q and dO rows, lse and `D_i`), both at
    /// most [`Self::MAX_STAGED`]. D = 64 → BKV 32, BQ 31; D = 128 → 16, 15.
    pub fn for_head_dim(head_dim: u32) -> WgslTiles {
        let d = head_dim.max(1);
        let fit = |per_row: u32| (MAX_WORKGROUP_BYTES / per_row).clamp(1, Self::MAX_STAGED);
        WgslTiles {
            head_dim,
            block_q: fit(8 * d + 8),
            block_kv: fit(8 * d),
            workgroup_size: Self::ROWS,
        }
    }

    /// `var<workgroup>` bytes of the forward, `D_i` and dQ kernels: the
    /// staged K and V rows (2·BKV·D f32).
    pub fn forward_workgroup_bytes(&self) -> u64 {
        let (d, _, kv) = self.dims();
        4 * 2 * kv * d
    }

    /// `var<workgroup>` bytes of the dK/dV kernel: the staged Q and dO rows
    /// (2·BQ·D) and their lse and `D_i` (2·BQ), f32.
    pub fn backward_workgroup_bytes(&self) -> u64 {
        let (d, q, _) = self.dims();
        4 * (2 * q * d + 2 * q)
    }

    /// The larger of the two layouts.
    pub fn workgroup_bytes(&self) -> u64 {
        self.forward_workgroup_bytes()
            .max(self.backward_workgroup_bytes())
    }

    /// An upper bound on the loop iterations one invocation runs per tile of
    /// its tile loop, in the kernel that runs the most (`N_KV =
    /// ⌈BKV·D/WG⌉`, `N_Q = ⌈BQ·D/WG⌉`; `R` = 0 where the head-dim loops are
    /// unrolled, see [`UNROLL_MAX_HEAD_DIM`], else `D`):
    ///
    /// - forward, per key tile: staging (N_KV), scores (BKV·(1 + R)),
    ///   rescale (R), `P·V` (BKV·(1 + R));
    /// - `D_i`, per key tile: staging, `P` and `dP` (BKV·(1 + R));
    /// - dQ, per key tile: staging, `P` and `dP`, `dS·K` (BKV·(1 + 2R));
    /// - dK/dV, per query tile: staging (N_Q + ⌈BQ/WG⌉), `P` and `dP`,
    ///   `dSᵀ·Q` and `Pᵀ·dO` (BQ·(1 + 2R));
    ///
    /// plus one for the tile loop itself.
    pub fn loop_iterations_per_tile(&self) -> u64 {
        let (d, q, kv) = self.dims();
        let wg = u64::from(self.workgroup_size);
        let r = if self.head_dim <= UNROLL_MAX_HEAD_DIM {
            0
        } else {
            d
        };
        let (n_q, n_kv) = ((q * d).div_ceil(wg), (kv * d).div_ceil(wg));
        let forward = n_kv + 2 * kv * (1 + r) + r;
        let delta = n_kv + kv * (1 + r);
        let dq = n_kv + kv * (1 + 2 * r);
        let dkdv = n_q + q.div_ceil(wg) + q * (1 + 2 * r);
        1 + forward.max(delta).max(dq).max(dkdv)
    }

    /// Tiles one dispatch may loop over so that an invocation stays within
    /// `budget` loop iterations (at least one).
    pub fn tiles_within(&self, budget: u64) -> u32 {
        u32::try_from(budget / self.loop_iterations_per_tile())
            .unwrap_or(u32::MAX)
            .max(1)
    }

    fn dims(&self) -> (u64, u64, u64) {
        (
            self.head_dim.into(),
            self.block_q.into(),
            self.block_kv.into(),
        )
    }

    /// Checks every derived size against the WebGPU default limits; both
    /// layouts must fit, since one configuration is chosen per (program,
    /// head dim).
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
        let bytes = self.workgroup_bytes();
        if bytes > MAX_WORKGROUP_BYTES.into() {
            return Err(format!(
                "{self:?}: {bytes} bytes of var<workgroup> (forward {}, dK/dV {}) exceed \
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
        if cfg.head_dim <= UNROLL_MAX_HEAD_DIM {
            s.push_str(&unroll_head_dim(p, cfg.head_dim));
        } else {
            s.push_str(p);
        }
    }
    s
}

/// Head dims up to which the head-dim loops are unrolled. Unrolled, the
/// kernels run about twice as fast on llvmpipe (private arrays addressed
/// with constants); but its compile time grows faster than the code: at
/// D = 128 the backward modules take ~25 s to compile on a 2-core machine,
/// against ~5 s rolled.
pub const UNROLL_MAX_HEAD_DIM: u32 = 64;

/// The loop header the templates use for loops over the head dim.
const HEAD_DIM_LOOP: &str = "for (var d = 0u; d < D; d++) {";

/// Every loop over the head dim in `template`, fully unrolled: its body
/// once per `d` in `0..head_dim`, each copy in its own block with `d`
/// replaced by the literal. Private arrays indexed by `d` then have constant
/// indices, so compilers keep them in registers (or address them directly)
/// instead of gathering per invocation, and the loops no longer count
/// against llvmpipe's iteration limit.
pub fn unroll_head_dim(template: &str, head_dim: u32) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(at) = rest.find(HEAD_DIM_LOOP) {
        out.push_str(&rest[..at]);
        let body_start = at + HEAD_DIM_LOOP.len();
        let body_end = matching_brace(rest, body_start - 1)
            .unwrap_or_else(|| panic!("unbalanced head-dim loop in a WGSL template"));
        let body = &rest[body_start..body_end];
        out.push('{');
        for d in 0..head_dim {
            out.push_str(" { ");
            out.push_str(&replace_word(body.trim(), "d", &format!("{d}u")));
            out.push_str(" }");
        }
        out.push_str(" }");
        rest = &rest[body_end + 1..];
    }
    out.push_str(rest);
    out
}

/// The index of the `}` closing the `{` at `open`.
fn matching_brace(s: &str, open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + i);
                }
            }
            _ => {}
        }
    }
    None
}

/// `s` with every whole-word occurrence of the identifier `word` replaced.
fn replace_word(s: &str, word: &str, with: &str) -> String {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(word) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + word.len()..].chars().next();
        out.push_str(&rest[..at]);
        if before.is_some_and(is_ident) || after.is_some_and(is_ident) {
            out.push_str(word);
        } else {
            out.push_str(with);
        }
        rest = &rest[at + word.len()..];
    }
    out.push_str(rest);
    out
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
    module(variant_fns, cfg, &[kernels::FORWARD, kernels::STAGE_KV])
}

/// The backward modules: `(dq, dkdv)`. The first has entry points
/// `attn_bwd_delta` (`D_i`, run first) and `attn_bwd_dq`; the second has
/// `attn_bwd_dkdv`.
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
        module(variant_fns, cfg, &[kernels::BACKWARD_DQ, kernels::STAGE_KV]),
        module(variant_fns, cfg, &[kernels::BACKWARD_DKDV]),
    )
}
