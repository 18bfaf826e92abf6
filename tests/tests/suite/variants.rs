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

/// Python's `//` and `%` (`div_floor`, `rem_floor`: toward −∞, the
/// remainder with the divisor's sign) on negative operands, and the
/// trigonometric functions, as FlexAttention mods use them: a periodic
/// relative bias, and a mask that drops every `period`-th key behind the
/// query and keeps `blocks` blocks of keys behind it.
#[attention(
    score = |s, _b, h, q, kv| {
        let rel = (kv - q) as f32;
        s + self.gain * (sin(self.freq * rel) + cos(self.freq * (kv as f32)) * tan(0.1 * (h + 1) as f32))
            + 0.01 * div_floor(rel, 3.5) + 0.1 * rem_floor(rel, -2.5)
    },
    mask = |_b, _h, q, kv| {
        div_floor(kv - q, self.block) >= -self.blocks && rem_floor(kv - q, self.period) != 1
    },
    tests = [Periodic { gain: 0.5, freq: 0.37, block: 8, blocks: 3, period: 5 }, Periodic { gain: 1.5, freq: 2.1, block: -6, blocks: -2, period: -4 }],
)]
#[derive(Clone, Debug)]
pub struct Periodic {
    pub gain: f32,
    pub freq: f32,
    pub block: i32,
    pub blocks: i32,
    pub period: i32,
}

/// `div_floor` / `rem_floor` as Python evaluates `//` and `%`, for every
/// sign of either operand and a zero divisor (0, as `/` and `%`), in i32
/// and f32; `sin`, `cos`, `tan` as f64 does, within f32 rounding.
#[test]
fn floored_division_and_trigonometry_follow_python() {
    use boostr_runtime::HostVariant;
    // score = floor division and remainder of (q − kv) by `w`, in i32 and
    // in f32, packed into one number each.
    #[attention(
        score = |s, _b, _h, q, kv| {
            (div_floor(q - kv, self.w) * 1000 + rem_floor(q - kv, self.w)) as f32
                + s * (div_floor((q - kv) as f32, self.x) * 1000.0 + rem_floor((q - kv) as f32, self.x))
        },
    )]
    #[derive(Clone, Debug)]
    struct Floors {
        w: i32,
        x: f32,
    }
    let python = |a: f64, b: f64| {
        if b == 0.0 {
            return (0.0, 0.0);
        }
        let q = (a / b).floor();
        (q, a - b * q)
    };
    for w in [-7, -3, -1, 0, 1, 3, 7] {
        let x = if w == 0 { 1.25 } else { w as f32 * 0.5 };
        let v = Floors { w, x };
        for (q, kv) in [
            (0, 0),
            (3, 10),
            (10, 3),
            (-5, 2),
            (17, 17),
            (2, -9),
            (-8, -1),
        ] {
            let (qi, ri) = python((q - kv) as f64, w as f64);
            let int = v.score(0.0, 0, 0, q, kv);
            assert_eq!(
                int,
                (qi * 1000.0 + ri) as f32,
                "div/rem_floor({}, {w})",
                q - kv
            );
            let (qf, rf) = python((q - kv) as f64, x as f64);
            let float = v.score(1.0, 0, 0, q, kv) - int;
            assert_eq!(
                float,
                (qf * 1000.0 + rf) as f32,
                "div/rem_floor({}, {x})",
                q - kv
            );
        }
    }

    #[attention(score = |s, _b, _h, q, _kv| s * sin(q as f32 * self.f) + cos(q as f32 * self.f) + tan(q as f32 * self.g))]
    #[derive(Clone, Debug)]
    struct Trig {
        f: f32,
        g: f32,
    }
    let v = Trig {
        f: 0.731,
        g: 0.0137,
    };
    for q in [0, 1, 5, 100, 1000, 20000] {
        let (a, b) = ((q as f32 * 0.731) as f64, (q as f32 * 0.0137) as f64);
        let got = (v.score(1.0, 0, 0, q, 0) - v.score(0.0, 0, 0, q, 0)) as f64;
        assert!(
            (got - a.sin()).abs() <= 1e-6,
            "sin at {q}: {got} vs {}",
            a.sin()
        );
        let got = v.score(0.0, 0, 0, q, 0) as f64;
        let want = a.cos() + b.tan();
        assert!(
            (got - want).abs() <= 1e-6 * (1.0 + want.abs()) * 4.0,
            "cos + tan at {q}: {got} vs {want}"
        );
    }
}

/// A mask written as a score, as FlexAttention's `score_mod` returns
/// `-inf`: `f32::NEG_INFINITY` hides the pair (a row whose keys are all
/// hidden gets zeros, as under a mask).
#[attention(
    score = |s, _b, _h, q, kv| if kv > q + self.ahead { f32::NEG_INFINITY } else { s },
    tests = [ScoreMask { ahead: 2 }, ScoreMask { ahead: -3 }],
)]
#[derive(Clone, Debug)]
pub struct ScoreMask {
    pub ahead: i32,
}

/// Captured data as PyTorch code holds it: a boolean mask as data, an
/// `i64` index tensor and a 0-d scalar tensor, each passed as it is.
#[attention(
    score = |s, _b, h, _q, kv| s * self.temperature + 0.25 * (self.bucket[h][kv] as f32),
    mask = |b, _h, q, kv| kv <= q && (self.keep[b][kv] || kv == q),
    tests = [|data| TorchData {
        keep: data.bools(&[data.batch(), data.seq_k()], 0.7),
        bucket: data.i64s(&[data.heads_q(), data.seq_k()], -3, 3),
        temperature: data.f32s(&[], 0.5, 1.5),
    }],
)]
#[derive(Clone, Debug)]
pub struct TorchData<R: numr::runtime::Runtime> {
    #[tensor(bool, [B, Sk])]
    pub keep: numr::tensor::Tensor<R>,
    #[tensor(i64, [Hq, Sk])]
    pub bucket: numr::tensor::Tensor<R>,
    #[tensor(f32, [])]
    pub temperature: numr::tensor::Tensor<R>,
}

/// A `bool` tensor may come as numr's `U8` too; an `i64` value outside
/// i32 is an error naming the field and the element, never a wrapped
/// index.
#[test]
fn bool_and_i64_tensors_convert_or_fail_clearly() {
    use boostr_runtime::testing::CpuRuntime;
    use boostr_runtime::{AttentionOptions, Error, Keys};
    use numr::dtype::DType;
    use numr::runtime::cpu::CpuDevice;
    use numr::tensor::Tensor;
    let device = CpuDevice::new();
    let (b, h, s, d) = (1, 2, 5, 8);
    let x = |seed: f32, n: usize| -> Vec<f32> { (0..n).map(|i| (i as f32 * seed).sin()).collect() };
    let t = |v: &[f32]| Tensor::<CpuRuntime>::from_slice(v, &[b, h, s, d], &device).unwrap();
    let (q, k, v) = (
        t(&x(0.3, b * h * s * d)),
        t(&x(0.7, b * h * s * d)),
        t(&x(1.1, b * h * s * d)),
    );
    let keep = |dtype| {
        Tensor::<CpuRuntime>::from_bytes(&[1, 0, 1, 1, 0], &[b, s], dtype, &device).unwrap()
    };
    let bucket = |top: i64| {
        let mut values = vec![0i64; h * s];
        values[7] = top;
        Tensor::<CpuRuntime>::from_slice(&values, &[h, s], &device).unwrap()
    };
    let temperature = Tensor::<CpuRuntime>::from_slice(&[0.5f32], &[], &device).unwrap();
    let opts = AttentionOptions::default();
    let run = |keep, bucket| {
        let variant = TorchData {
            keep,
            bucket,
            temperature: temperature.clone(),
        };
        attention(&variant, &q, Keys::dense(&k, &v), &opts).map(|y| (y.out, y.lse))
    };
    let (out_bool, _) = run(keep(DType::Bool), bucket(3)).unwrap();
    let (out_u8, _) = run(keep(DType::U8), bucket(3)).unwrap();
    assert_eq!(out_bool.to_vec::<f32>(), out_u8.to_vec::<f32>());
    match run(keep(DType::Bool), bucket(1 << 40)) {
        Err(Error::CaptureValue {
            field, at, value, ..
        }) => {
            assert_eq!((field, at, value), ("bucket", 7, 1 << 40));
        }
        other => panic!("expected a CaptureValue error, got {other:?}"),
    }
    match run(keep(DType::I32), bucket(3)) {
        Err(Error::CaptureDType {
            field, expected, ..
        }) => {
            assert_eq!((field, expected), ("keep", DType::Bool));
        }
        other => panic!("expected a CaptureDType error, got {other:?}"),
    }
}

/// A gradient of the user's own in place of the derivative of `score`: a
/// hard clamp whose gradient passes straight through (`leak = 0`) or fades
/// past the cap (the derivative of `score` is 0 there). Continuous in `s`,
/// so that a logit's rounding cannot flip it.
#[attention(
    score = |s, _b, _h, _q, _kv| clamp(s, -self.cap, self.cap),
    score_grad = |s, _b, h, _q, _kv| {
        (1.0 + 0.1 * h as f32) / (1.0 + self.leak * max(abs(s) - self.cap, 0.0))
    },
    mask = |_b, _h, q, kv| kv <= q,
    tests = [StraightThrough { cap: 0.5, leak: 0.0 }, StraightThrough { cap: 1.0, leak: 0.25 }],
)]
#[derive(Clone, Debug)]
pub struct StraightThrough {
    pub cap: f32,
    pub leak: f32,
}

/// The declared derivative is what the backward multiplies by, not the
/// derivative of `score` (which is 0 past the cap).
#[test]
fn a_declared_score_grad_replaces_the_derived_one() {
    use boostr_runtime::HostVariant;
    let v = StraightThrough {
        cap: 0.5,
        leak: 0.25,
    };
    const { assert!(<StraightThrough as HostVariant>::SCORE_GRAD_GIVEN) };
    assert_eq!(v.score(3.0, 0, 1, 4, 2), 0.5);
    assert!((v.score_grad(3.0, 0, 1, 4, 2) - 1.1 / 1.625).abs() < 1e-6);
    assert!((v.score_grad(0.2, 0, 1, 4, 2) - 1.1).abs() < 1e-6);
    let summary = <StraightThrough as boostr_runtime::Variant>::compiled().summary;
    assert!(summary.contains("(declared)"), "{summary}");
}

/// Hand-given block sparsity, as FlexAttention's `BlockMask` carries it: a
/// `[B, Hq, query blocks, key blocks]` map of the blocks to compute, read in
/// the mask (each block `block` positions on a side), with a rule of the
/// variant's own inside the blocks kept.
#[attention(
    mask = |b, h, q, kv| kv <= q && self.blocks[b][h][q / self.block][kv / self.block],
    tests = [
        |data| {
            let n = data.seq_k().div_ceil(16);
            BlockSparse { block: 16, blocks: data.bools(&[data.batch(), data.heads_q(), n, n], 0.6) }
        },
        |data| {
            let n = data.seq_k().div_ceil(64);
            BlockSparse { block: 64, blocks: data.bools(&[data.batch(), data.heads_q(), n, n], 0.5) }
        },
    ],
)]
#[derive(Clone, Debug)]
pub struct BlockSparse<R: numr::runtime::Runtime> {
    pub block: i32,
    #[tensor(bool, [B, Hq, _, _])]
    pub blocks: numr::tensor::Tensor<R>,
}

/// The classifier reads a block map's element wherever a tile lies within
/// one block (blocks at least a tile, as FlexAttention's 128), so whole
/// tiles of false blocks are skipped; a tile across blocks is bounded by
/// the map's summaries, or stays `Partial` (never wrong).
#[test]
fn a_block_map_skips_the_tiles_of_its_false_blocks() {
    use boostr_runtime::testing::CpuRuntime;
    use boostr_runtime::variant::TileClass;
    use boostr_runtime::{HostVariant, Problem, Variant};
    use numr::dtype::DType;
    use numr::runtime::cpu::CpuDevice;
    use numr::tensor::Tensor;
    // 4 × 4 blocks of 32: the diagonal, and query block 3 against key block 0.
    let mut map = [0u8; 16];
    for qb in 0..4 {
        map[qb * 4 + qb] = 1;
    }
    map[3 * 4] = 1;
    let blocks =
        Tensor::<CpuRuntime>::from_bytes(&map, &[1, 1, 4, 4], DType::Bool, &CpuDevice::new())
            .unwrap();
    let v = BlockSparse { block: 32, blocks };
    let host = v.host(&Problem::new(1, (1, 1), (128, 128), 16)).unwrap();
    let tile = |q: (i32, i32), kv: (i32, i32)| host.classify_tile(0, 0, q.0, q.1, kv.0, kv.1);
    assert_eq!(tile((64, 95), (0, 31)), TileClass::Empty);
    assert_eq!(tile((96, 127), (0, 31)), TileClass::Full);
    assert_eq!(tile((96, 127), (32, 63)), TileClass::Empty);
    assert_ne!(tile((96, 127), (32, 95)), TileClass::Full);
    assert_eq!(tile((32, 63), (32, 63)), TileClass::Partial);
    assert_eq!(tile((64, 127), (0, 31)), TileClass::Partial);
    // Pair by pair, the map and the causal rule.
    for (q, kv, seen) in [
        (100, 5, true),
        (70, 5, false),
        (40, 33, true),
        (40, 50, false),
    ] {
        assert_eq!(host.mask(0, 0, q, kv), seen, "q {q}, kv {kv}");
    }
}

/// A variant declared through the runtime crate under another name
/// (`crate = ".."`, as a crate that re-exports it would): its items and
/// generated tests name the runtime by that path.
mod renamed_runtime {
    use boostr_runtime as br;

    #[br::attention(
        score = |s, _b, _h, q, kv| s - 0.125 * ((q - kv) as f32),
        mask = |_b, _h, q, kv| kv <= q,
        crate = "br",
        tests = [Renamed],
    )]
    #[derive(Clone, Debug)]
    pub struct Renamed;
}
