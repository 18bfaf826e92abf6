//! Variants beyond the stock ones, declared here with generated tests: the
//! language's corners (let blocks, if/else, casts, u32 and bool parameters)
//! and a document (block-diagonal) mask that the tile classifier must get
//! exactly right.

use boostr_runtime::attention;

/// Block-diagonal (document) masking: queries see keys of their own block.
#[attention(
    mask = |_b, _h, q, kv| q / self.block == kv / self.block,
    tests = [Documents { block: 16 }, Documents { block: 5 }],
)]
#[derive(Clone, Debug)]
pub struct Documents {
    pub block: i32,
}

/// Documents with a shared prefix and a per-head distance penalty.
#[attention(
    score = |s, _b, h, q, kv| s - (h + 1) as f32 * self.slope * (q - kv) as f32,
    mask = |_b, _h, q, kv| kv < self.prefix || (q / self.doc == kv / self.doc && kv <= q),
    tests = [PrefixDocuments { prefix: 8, doc: 24, slope: 0.05 }],
)]
#[derive(Clone, Debug)]
pub struct PrefixDocuments {
    pub prefix: i32,
    pub doc: i32,
    pub slope: f32,
}

/// Every corner of the language in one variant.
#[attention(
    score = |s, b, h, q, kv| {
        let d = (q - kv) as f32;
        let bend = if self.smooth { sigmoid(s) * 2.0 - 1.0 } else { clamp(s, -3.0, 3.0) };
        let t = max(abs(d), 1.0);
        bend * self.gain + s * 0.5 - log(t) * 0.1 + (b as f32) * 0.01 - floor(sqrt(t)) * 0.0 + exp(-t) * 0.2 + (h % 2) as f32 * 0.1
    },
    mask = |_b, h, q, kv| (kv as u32) % self.stride != 1u32 || (h == 0 && kv <= q),
    tests = [
        Kitchen { smooth: true, gain: 1.5, stride: 3 },
        Kitchen { smooth: false, gain: 0.5, stride: 2 },
    ],
)]
#[derive(Clone, Debug)]
pub struct Kitchen {
    pub smooth: bool,
    pub gain: f32,
    pub stride: u32,
}

/// Odd tile sizes from the attribute: every tiling must give the same answers.
#[attention(
    mask = |_b, _h, q, kv| kv <= q && q - kv < self.window,
    tile(q = 7, kv = 13),
    tests = [OddTiles { window: 20 }],
)]
#[derive(Clone, Debug)]
pub struct OddTiles {
    pub window: i32,
}

#[test]
fn tile_overrides_reach_the_variant() {
    use boostr_runtime::Variant;
    assert_eq!(OddTiles::TILE_Q, Some(7));
    assert_eq!(OddTiles::TILE_KV, Some(13));
    assert_eq!(Documents::TILE_Q, None);
}
