//! Tile sizes of the CPU kernels, in one place, with the reasoning.
//!
//! A tile is the unit of both scheduling and masking: the forward keeps one
//! query tile resident while key/value tiles stream past it, the backward
//! keeps one key/value tile (and its dK/dV rows) resident while query tiles
//! stream past it, and `classify_tile` is asked once per (query tile, key
//! tile) pair.

/// Rows per query tile (`q`) and keys per key/value tile (`kv`).
///
/// Working set per rayon task, f32, with the defaults and head dim `D = 64`
/// (each `64 × 64` tile is 16 KiB):
/// - forward: Q tile, Kᵀ and V tiles, the score tile and the output
///   accumulator — 80 KiB. That sits in L2 (1–2 MiB per core on current
///   x86) with room for `gemm`'s packed panels, and one score row (256 B)
///   plus the running max/sum stay in L1 during the softmax pass.
/// - backward: K, Kᵀ, Vᵀ, dK and dV tiles resident, three score-sized tiles
///   (S/P, dP/dS, score_grad), Q and dO tiles streaming — about 160 KiB.
///
/// Why not smaller: each key tile costs every query row a pass of the
/// online softmax's bookkeeping (row max, rescale of `D` accumulators), and
/// the tile kernel keeps `6 × 64` blocks of the product in registers, so
/// fewer rows or keys per tile leave more of it in remainders. Why not
/// larger: fewer parallel tasks for short sequences, and coarser tiles skip
/// less of a causal or sliding-window mask (only whole tiles are skipped)
/// while evaluating the mask on bigger diagonal tiles.
///
/// Measured on a 2-core AVX-512 Xeon (B=1, H=8, S=1024, D=64, and
/// S=2048, D=128), sweeping q ∈ {32, 64, 128} × kv ∈ {64, 128, 256}: every
/// choice from 32×64 to 128×128 is within ~10% (run-to-run noise on that
/// machine); 64×64 was at or near the best for causal forward and backward,
/// which is the common case, and has the smallest working set for larger
/// head dims. kv = 256 was slower for causal masks. Measured again with the
/// AVX-512 tile kernel (`bench/ab_cpu.py`, paired): q = 32 ran the full
/// forward at 8 8 2048 128 0.87× as fast, and a causal sliding window of
/// 256 (whose 64-wide tiles are at best 80% useful) no faster (0.97–0.99×).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpuTiles {
    /// Query rows per tile (`Bq`).
    pub q: usize,
    /// Keys per key/value tile (`Bk`).
    pub kv: usize,
}

impl CpuTiles {
    /// The defaults used by [`forward`](super::forward()) and
    /// [`backward`](super::backward()); see the type's docs for why.
    pub const DEFAULT: Self = Self { q: 64, kv: 64 };

    /// Tiles of `q` query rows and `kv` keys. Panics if either is zero.
    pub fn new(q: usize, kv: usize) -> Self {
        assert!(q > 0 && kv > 0, "tile sizes must be non-zero");
        Self { q, kv }
    }
}

impl CpuTiles {
    /// The tiles for variant `V`: its `tile(q = .., kv = ..)` overrides, else
    /// the defaults.
    pub fn for_variant<V: crate::Variant>() -> Self {
        let pick = |size: Option<u32>, default: usize| size.map_or(default, |s| s as usize);
        Self::new(
            pick(V::TILE_Q, Self::DEFAULT.q),
            pick(V::TILE_KV, Self::DEFAULT.kv),
        )
    }
}

impl Default for CpuTiles {
    fn default() -> Self {
        Self::DEFAULT
    }
}
