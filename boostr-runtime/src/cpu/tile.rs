//! Tile sizes of the CPU kernels, in one place, with the reasoning.
//!
//! A tile is the unit of both scheduling and masking: the forward keeps one
//! query tile resident while key/value tiles stream past it, the backward
//! keeps one key/value tile (and its dK/dV rows) resident while query tiles
//! stream past it, and `classify_tile` is asked once per (query tile, key
//! tile) pair.

/// Rows per query tile (`q`) and keys per key/value tile (`kv`).
///
/// Working set per rayon task, f32, head dim `D` (64 below):
/// - forward: Q tile `q·D`, K and V tiles `kv·D` each, scores `q·kv`, the
///   output accumulator `q·D` — with the defaults 16 + 32 + 32 + 32 + 16 KiB
///   = 128 KiB. That sits in L2 (1–2 MiB per core on current x86) with room
///   for `gemm`'s packed panels, while one score row (512 B) and the running
///   max/sum stay in L1 during the softmax pass.
/// - backward: the same K/V tiles plus dK/dV accumulators (`kv·D` each) and
///   three `q·kv` score-sized buffers (S/P, dP/dS, score_grad) — 224 KiB.
///
/// Why not smaller: each tile product is a `gemm` call whose fixed cost
/// (dispatch, packing) has to be amortised over `2·q·kv·D` flops, and the
/// online-softmax rescale of the accumulator costs `q·D` per key tile. Why not
/// larger: a bigger query tile means fewer parallel tasks for short
/// sequences, and coarser tiles skip less of a causal or sliding-window mask
/// (only whole tiles are skipped). `kv = 128` measured ~10% faster than 64
/// in the forward on a 2-core AVX-512 Xeon (B=1, H=8, S=1024, D=64, causal);
/// 256 was no better.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpuTiles {
    /// Query rows per tile (`Bq`).
    pub q: usize,
    /// Keys per key/value tile (`Bk`).
    pub kv: usize,
}

impl CpuTiles {
    /// The defaults used by [`forward`](super::forward) and
    /// [`backward`](super::backward); see the type's docs for why.
    pub const DEFAULT: Self = Self { q: 64, kv: 128 };

    /// Tiles of `q` query rows and `kv` keys. Panics if either is zero.
    pub fn new(q: usize, kv: usize) -> Self {
        assert!(q > 0 && kv > 0, "tile sizes must be non-zero");
        Self { q, kv }
    }
}

impl Default for CpuTiles {
    fn default() -> Self {
        Self::DEFAULT
    }
}
