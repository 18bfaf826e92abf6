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

/// A neighbourhood in units of `w` positions, by float division (NATTEN's
/// 2-D neighbourhoods with a width that is no power of two): at `w = 6,
/// window = 3` the quotients of query 2 and key 20 differ by exactly 3, a
/// tie that a product with the reciprocal of `w` breaks. The key is
/// visible, in f32 as in f64, on every backend.
#[attention(
    mask = |_b, _h, q, kv| {
        abs((q as f32) / (self.w as f32) - (kv as f32) / (self.w as f32)) <= (self.window as f32)
    },
    tests = [Neighbourhood { w: 6, window: 3 }, Neighbourhood { w: 7, window: 2 }],
)]
#[derive(Clone, Debug)]
pub struct Neighbourhood {
    pub w: i32,
    pub window: i32,
}

#[test]
fn a_mask_divides_exactly_at_ties() {
    use boostr_runtime::HostVariant;
    let v = Neighbourhood { w: 6, window: 3 };
    // Every pair of 97 positions: the mask the kernels evaluate is the
    // language's f32 arithmetic, as the reference's is; a product with the
    // reciprocal decides 46 of these pairs otherwise, (2, 20) among them.
    let (w, window) = (6.0f32, 3.0f32);
    let mut broken_by_reciprocal = 0;
    for q in 0..97 {
        for kv in 0..97 {
            let (qf, kf) = (q as f32, kv as f32);
            let exact = (qf / w - kf / w).abs() <= window;
            assert_eq!(v.mask(0, 0, q, kv), exact, "q {q}, kv {kv}");
            assert_eq!(v.mask_exact(0, 0, q, kv), exact, "q {q}, kv {kv}");
            let r = 1.0 / w;
            broken_by_reciprocal += usize::from(((qf * r - kf * r).abs() <= window) != exact);
        }
    }
    assert_eq!(broken_by_reciprocal, 46);
    let r = 1.0 / w;
    assert!((2.0 * r - 20.0 * r).abs() > window && v.mask(0, 0, 2, 20));
}
