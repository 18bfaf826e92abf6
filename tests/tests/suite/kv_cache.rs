//! KV caches with per-sequence lengths through the public op: each sequence
//! of a cache call against `attention_fwd` on that sequence's keys alone,
//! spare slots full of NaN, and every bad length an `Err`.

use boostr_runtime::stock::{Causal, CausalSlidingWindow, CausalSoftcap};
use boostr_runtime::testing::{CpuRuntime, Rng};
use boostr_runtime::{
    AttentionOptions, Backward, Error, Keys, Variant, attention, attention_backward,
};
use numr::runtime::cpu::CpuDevice;
use numr::tensor::Tensor;

const HQ: usize = 8;
const HKV: usize = 1;
const D: usize = 64;
const CAP: usize = 150;

struct Case {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    lens: Vec<i32>,
    sq: usize,
}

impl Case {
    /// Random q, k, v; the slots past each length hold NaN and infinities.
    fn new(lens: &[i32], sq: usize, seed: u64) -> Case {
        let b = lens.len();
        let mut rng = Rng::new(seed, 0);
        let q = rng.normal_f32(b * HQ * sq * D, 1.0);
        let mut k = rng.normal_f32(b * HKV * CAP * D, 1.0);
        let mut v = rng.normal_f32(b * HKV * CAP * D, 1.0);
        for (row, (kr, vr)) in k.chunks_mut(D).zip(v.chunks_mut(D)).enumerate() {
            if row % CAP >= lens[row / (HKV * CAP)] as usize {
                kr.fill(f32::NAN);
                vr.fill(f32::INFINITY);
            }
        }
        Case {
            q,
            k,
            v,
            lens: lens.to_vec(),
            sq,
        }
    }

    fn tensor(&self, data: &[f32], shape: &[usize]) -> Tensor<CpuRuntime> {
        Tensor::from_slice(data, shape, &CpuDevice::new()).expect("a host tensor")
    }

    /// The cache call.
    fn cached<V: Variant>(&self, variant: &V) -> Result<(Vec<f32>, Vec<f32>), Error> {
        let b = self.lens.len();
        let q = self.tensor(&self.q, &[b, HQ, self.sq, D]);
        let k = self.tensor(&self.k, &[b, HKV, CAP, D]);
        let v = self.tensor(&self.v, &[b, HKV, CAP, D]);
        let lengths = Tensor::<CpuRuntime>::from_slice(&self.lens, &[b], &CpuDevice::new())
            .expect("a host tensor");
        let cache = Keys::cache(&k, &v, &lengths);
        let (out, lse) =
            attention(variant, &q, cache, &AttentionOptions::default()).map(|y| (y.out, y.lse))?;
        Ok((out.to_vec(), lse.to_vec()))
    }

    /// Sequence `b` alone through `attention_fwd`, with only its keys
    /// (`None` for a sequence without keys).
    fn alone<V: Variant>(&self, variant: &V, b: usize) -> Option<(Vec<f32>, Vec<f32>)> {
        let len = self.lens[b] as usize;
        if len == 0 {
            return None;
        }
        let rows = HQ * self.sq * D;
        let q = self.tensor(&self.q[b * rows..(b + 1) * rows], &[1, HQ, self.sq, D]);
        let keys = |x: &[f32]| -> Vec<f32> {
            (0..HKV)
                .flat_map(|h| {
                    let at = (b * HKV + h) * CAP * D;
                    x[at..at + len * D].to_vec()
                })
                .collect()
        };
        let k = self.tensor(&keys(&self.k), &[1, HKV, len, D]);
        let v = self.tensor(&keys(&self.v), &[1, HKV, len, D]);
        let (out, lse) = attention(
            variant,
            &q,
            Keys::dense(&k, &v),
            &AttentionOptions::default(),
        )
        .map(|y| (y.out, y.lse))
        .expect("the sequence alone");
        Some((out.to_vec(), lse.to_vec()))
    }
}

fn check<V: Variant>(variant: &V, lens: &[i32], sq: usize) {
    let case = Case::new(lens, sq, 0x5eed ^ sq as u64);
    let (out, lse) = case.cached(variant).expect("the cache call");
    let (rows, lse_rows) = (HQ * sq * D, HQ * sq);
    for b in 0..lens.len() {
        let (got, got_lse) = (
            &out[b * rows..(b + 1) * rows],
            &lse[b * lse_rows..(b + 1) * lse_rows],
        );
        match case.alone(variant, b) {
            None => {
                assert!(got.iter().all(|&x| x == 0.0), "length 0: out is 0");
                assert!(
                    got_lse.iter().all(|&x| x == f32::NEG_INFINITY),
                    "length 0: lse is -inf"
                );
            }
            Some((want, want_lse)) => {
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "{} lens {lens:?} Sq {sq}: sequence {b} out[{i}] = {g}, alone {w}",
                        V::NAME
                    );
                }
                for (i, (g, w)) in got_lse.iter().zip(&want_lse).enumerate() {
                    assert!(
                        g == w || (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "{} lens {lens:?} Sq {sq}: sequence {b} lse[{i}] = {g}, alone {w}",
                        V::NAME
                    );
                }
            }
        }
    }
}

#[test]
fn each_sequence_sees_its_own_keys_at_its_own_positions() {
    // Lengths 0, 1, a key-tile boundary, the capacity and between, in one
    // batch; GQA 8:1; Sq 1, 4 and 17 (rows before a short sequence's first
    // key see nothing under a causal mask).
    let lens = [0, 1, 64, 150, 97];
    for sq in [1, 4, 17] {
        check(&Causal, &lens, sq);
        check(&CausalSlidingWindow { window: 20 }, &lens, sq);
        check(&CausalSoftcap { cap: 15.0 }, &lens, sq);
    }
}

#[test]
fn bad_lengths_are_errors() {
    let case = |lens: &[i32]| Case::new(&[3, 3], 1, 1).with_lens(lens);
    for bad in [[-1, 3], [3, CAP as i32 + 1]] {
        match case(&bad).cached(&Causal) {
            Err(Error::Lengths {
                name: "lengths",
                value,
                bound,
                ..
            }) => {
                assert!(value < 0 || value > bound as i64, "{bad:?}");
                assert_eq!(bound, CAP);
            }
            other => panic!("lengths {bad:?}: {other:?}"),
        }
    }
    // One length per sequence.
    let c = Case::new(&[3, 3], 1, 1);
    let q = c.tensor(&c.q, &[2, HQ, 1, D]);
    let k = c.tensor(&c.k, &[2, HKV, CAP, D]);
    let v = c.tensor(&c.v, &[2, HKV, CAP, D]);
    let three = Tensor::<CpuRuntime>::from_slice(&[1i32, 2, 3], &[3], &CpuDevice::new()).unwrap();
    let cache = Keys::cache(&k, &v, &three);
    let err = attention(&Causal, &q, cache, &AttentionOptions::default())
        .map(|y| (y.out, y.lse))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::ShapeOf {
                name: "lengths",
                ..
            }
        ),
        "{err}"
    );
    // i32 only.
    let float = Tensor::<CpuRuntime>::from_slice(&[1.0f32, 2.0], &[2], &CpuDevice::new()).unwrap();
    let cache = Keys::cache(&k, &v, &float);
    let err = attention(&Causal, &q, cache, &AttentionOptions::default())
        .map(|y| (y.out, y.lse))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::CacheIndexDType {
                name: "lengths",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("I32"), "{err}");
}

impl Case {
    fn with_lens(mut self, lens: &[i32]) -> Case {
        self.lens = lens.to_vec();
        self
    }
}

/// `lens` sequences of up to 192 keys, as a contiguous cache and as pages
/// of 64 in reverse order (one spare page of NaN, unused table entries
/// garbage): the paged op's results against the contiguous op's.
#[test]
fn pages_are_the_contiguous_cache_in_place() {
    let device = CpuDevice::new();
    let (cap, ps) = (192usize, 64usize);
    let lens = [5i32, 192, 0, 64, 100];
    let b = lens.len();
    let mut rng = Rng::new(99, 0);
    let q = rng.normal_f32(b * HQ * 3 * D, 1.0);
    let k = rng.normal_f32(b * HKV * cap * D, 1.0);
    let v = rng.normal_f32(b * HKV * cap * D, 1.0);
    let max_pages = cap / ps;
    let pages = b * max_pages + 1;
    let mut kp = vec![f32::NAN; pages * HKV * ps * D];
    let mut vp = vec![f32::NAN; pages * HKV * ps * D];
    let mut table = vec![-7i32; b * max_pages];
    for s in 0..b {
        for lp in 0..max_pages {
            let page = pages - 1 - (s * max_pages + lp); // page 0 is spare
            if lp * ps < lens[s] as usize {
                table[s * max_pages + lp] = page as i32;
            }
            for h in 0..HKV {
                let from = ((s * HKV + h) * cap + lp * ps) * D;
                let to = (page * HKV + h) * ps * D;
                kp[to..to + ps * D].copy_from_slice(&k[from..from + ps * D]);
                vp[to..to + ps * D].copy_from_slice(&v[from..from + ps * D]);
            }
        }
    }
    let t = |data: &[f32], shape: &[usize]| {
        Tensor::<CpuRuntime>::from_slice(data, shape, &device).expect("a host tensor")
    };
    let ti = |data: &[i32], shape: &[usize]| {
        Tensor::<CpuRuntime>::from_slice(data, shape, &device).expect("a host tensor")
    };
    let q = t(&q, &[b, HQ, 3, D]);
    let lengths = ti(&lens, &[b]);
    let opts = AttentionOptions::default();
    let variant = CausalSoftcap { cap: 10.0 };
    let (k, v) = (t(&k, &[b, HKV, cap, D]), t(&v, &[b, HKV, cap, D]));
    let contiguous = Keys::cache(&k, &v, &lengths);
    let (out, lse) = attention(&variant, &q, contiguous, &opts)
        .map(|y| (y.out, y.lse))
        .expect("contiguous");
    let (kp, vp) = (t(&kp, &[pages, HKV, ps, D]), t(&vp, &[pages, HKV, ps, D]));
    let page_table = ti(&table, &[b, max_pages]);
    let paged = Keys::paged(&kp, &vp, &page_table, &lengths);
    let (pout, plse) = attention(&variant, &q, paged, &opts)
        .map(|y| (y.out, y.lse))
        .expect("paged");
    let bits = |x: Tensor<CpuRuntime>| {
        x.to_vec::<f32>()
            .into_iter()
            .map(f32::to_bits)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        bits(pout),
        bits(out),
        "out: pages of whole key tiles, same blocks"
    );
    assert_eq!(bits(plse), bits(lse), "lse");

    // A table entry a length reaches that is no page, and a length past
    // the table: errors.
    let mut bad = table.clone();
    bad[max_pages + 2] = pages as i32; // sequence 1 uses all three pages
    let bad = ti(&bad, &[b, max_pages]);
    let cache = Keys::paged(&kp, &vp, &bad, &lengths);
    match attention(&variant, &q, cache, &opts).map(|y| (y.out, y.lse)) {
        Err(Error::PageIndex {
            batch: 1, page: 2, ..
        }) => {}
        other => panic!("bad page: {other:?}"),
    }
    let long = ti(&[5, 193, 0, 64, 100], &[b]);
    let cache = Keys::paged(&kp, &vp, &page_table, &long);
    match attention(&variant, &q, cache, &opts).map(|y| (y.out, y.lse)) {
        Err(Error::Lengths {
            name: "lengths",
            at: 1,
            bound: 192,
            ..
        }) => {}
        other => panic!("long length: {other:?}"),
    }
}

/// The cache backward, sequence by sequence against `attention_bwd` on the
/// sequence's own keys; the spare slots' dk, dv are zero.
#[test]
fn the_cache_backward_is_each_sequence_alone() {
    let lens = [0, 1, 64, 150, 97];
    let sq = 40;
    let variant = CausalSoftcap { cap: 15.0 };
    let case = Case::new(&lens, sq, 0xbac);
    let device = CpuDevice::new();
    let b = lens.len();
    let mut rng = Rng::new(0xd0, 0);
    let dout = rng.normal_f32(b * HQ * sq * D, 1.0);
    let q = case.tensor(&case.q, &[b, HQ, sq, D]);
    let k = case.tensor(&case.k, &[b, HKV, CAP, D]);
    let v = case.tensor(&case.v, &[b, HKV, CAP, D]);
    let dout_t = case.tensor(&dout, &[b, HQ, sq, D]);
    let lengths = Tensor::<CpuRuntime>::from_slice(&lens, &[b], &device).unwrap();
    let cache = Keys::cache(&k, &v, &lengths);
    let opts = AttentionOptions::default();
    let (out, lse) = attention(&variant, &q, cache, &opts)
        .map(|y| (y.out, y.lse))
        .unwrap();
    let (dq, dk, dv) = attention_backward(
        &variant,
        &q,
        cache,
        Backward::from_tensors(&out, &lse, &dout_t),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .unwrap();
    let (dq, dk, dv) = (dq.to_vec::<f32>(), dk.to_vec::<f32>(), dv.to_vec::<f32>());
    let close = |what: &str, got: &[f32], want: &[f32]| {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 2e-5 * (1.0 + w.abs()),
                "{what}[{i}] = {g}, alone {w}"
            );
        }
    };
    let rows = HQ * sq * D;
    for s in 0..b {
        let len = lens[s] as usize;
        let dk_s = &dk[s * HKV * CAP * D..(s + 1) * HKV * CAP * D];
        let dv_s = &dv[s * HKV * CAP * D..(s + 1) * HKV * CAP * D];
        assert!(
            dk_s[len * D..]
                .iter()
                .chain(&dv_s[len * D..])
                .all(|&g| g == 0.0),
            "sequence {s}: spare slots have gradients"
        );
        if len == 0 {
            assert!(dq[s * rows..(s + 1) * rows].iter().all(|&g| g == 0.0));
            continue;
        }
        let q1 = case.tensor(&case.q[s * rows..(s + 1) * rows], &[1, HQ, sq, D]);
        let at = s * HKV * CAP * D;
        let k1 = case.tensor(&case.k[at..at + len * D], &[1, HKV, len, D]);
        let v1 = case.tensor(&case.v[at..at + len * D], &[1, HKV, len, D]);
        let do1 = case.tensor(&dout[s * rows..(s + 1) * rows], &[1, HQ, sq, D]);
        let (o1, l1) = attention(&variant, &q1, Keys::dense(&k1, &v1), &opts)
            .map(|y| (y.out, y.lse))
            .unwrap();
        let (dq1, dk1, dv1) = attention_backward(
            &variant,
            &q1,
            Keys::dense(&k1, &v1),
            Backward::from_tensors(&o1, &l1, &do1),
            &opts,
        )
        .map(|g| (g.dq, g.dk, g.dv))
        .unwrap();
        close(
            &format!("sequence {s} dq"),
            &dq[s * rows..(s + 1) * rows],
            &dq1.to_vec::<f32>(),
        );
        close(
            &format!("sequence {s} dk"),
            &dk_s[..len * D],
            &dk1.to_vec::<f32>(),
        );
        close(
            &format!("sequence {s} dv"),
            &dv_s[..len * D],
            &dv1.to_vec::<f32>(),
        );
    }
}

/// An fp8 format: numr's conversions, independent of the kernels'.
#[derive(Clone, Copy, Debug)]
enum Fp8 {
    E4m3,
    E5m2,
}

impl Fp8 {
    fn dtype(self) -> numr::dtype::DType {
        match self {
            Fp8::E4m3 => numr::dtype::DType::FP8E4M3,
            Fp8::E5m2 => numr::dtype::DType::FP8E5M2,
        }
    }

    fn quantize(self, x: f32) -> u8 {
        match self {
            Fp8::E4m3 => numr::dtype::FP8E4M3::from_f32(x).0,
            Fp8::E5m2 => numr::dtype::FP8E5M2::from_f32(x).0,
        }
    }

    fn value(self, b: u8) -> f64 {
        f64::from(match self {
            Fp8::E4m3 => numr::dtype::FP8E4M3(b).to_f32(),
            Fp8::E5m2 => numr::dtype::FP8E5M2(b).to_f32(),
        })
    }
}

/// `data` quantized to `fmt` against `scale(row)` per row of `dim`: the
/// bytes, and the dequantized values (f64).
fn quantized(
    fmt: Fp8,
    data: &[f32],
    dim: usize,
    scale: impl Fn(usize) -> f32,
) -> (Vec<u8>, Vec<f64>) {
    let mut bytes = Vec::with_capacity(data.len());
    let mut values = Vec::with_capacity(data.len());
    for (r, row) in data.chunks(dim).enumerate() {
        let s = scale(r);
        for &x in row {
            let b = fmt.quantize(x / s);
            bytes.push(b);
            values.push(fmt.value(b) * f64::from(s));
        }
    }
    (bytes, values)
}

fn fp8_tensor(fmt: Fp8, bytes: &[u8], shape: &[usize]) -> Tensor<CpuRuntime> {
    Tensor::from_bytes(bytes, shape, fmt.dtype(), &CpuDevice::new()).expect("an fp8 tensor")
}

/// fp8 caches, E4M3 and E5M2, values of their own head dim, against the
/// f64 reference on the dequantized values: a contiguous cache with a
/// scale per kv head, and the same keys in shuffled pages with a scale per
/// kv head and per page and kv head; one query row per head (the
/// matrix-vector products) and five (40 packed rows: the tile products).
#[test]
fn fp8_caches_match_the_reference_on_their_dequantized_values() {
    use boostr_runtime::testing::{Forward, reference_forward};
    use boostr_runtime::{KvScales, Problem};
    let (b, hq, hkv, sk, d, dv, ps) = (2, 8, 2, 96, 64, 48, 16);
    let dev = CpuDevice::new();
    let f32s =
        |x: &[f32], shape: &[usize]| Tensor::<CpuRuntime>::from_slice(x, shape, &dev).unwrap();
    // K's scales (`kind` 0) and V's (3): per kv head, and per page too.
    let head_scale = |kind: usize, h: usize| 0.01 * (1 + kind + h) as f32;
    let page_scale =
        |kind: usize, page: usize, h: usize| head_scale(kind, h) * (1.0 + 0.25 * (page % 3) as f32);
    // The pages of both sequences, shuffled: `(sequence row, page row)` of
    // every key row, each `[.., Hkv, rows, ..]` flattened to rows.
    let (per_seq, pages) = (sk / ps, b * sk / ps);
    let order: Vec<usize> = (0..pages).map(|i| (i * 5 + 3) % pages).collect();
    let table: Vec<i32> = (0..pages).map(|slot| order[slot] as i32).collect();
    let mut placed = Vec::new();
    for (slot, &page) in order.iter().enumerate() {
        let (seq, j) = (slot / per_seq, slot % per_seq);
        for h in 0..hkv {
            for r in 0..ps {
                placed.push(((seq * hkv + h) * sk + j * ps + r, (page * hkv + h) * ps + r));
            }
        }
    }
    // `x` (rows of `dim`) moved from `from` rows to `to` rows.
    fn moved<T: Copy + Default>(
        x: &[T],
        dim: usize,
        pairs: impl Iterator<Item = (usize, usize)>,
    ) -> Vec<T> {
        let mut out = vec![T::default(); x.len()];
        for (from, to) in pairs {
            out[to * dim..(to + 1) * dim].copy_from_slice(&x[from * dim..(from + 1) * dim]);
        }
        out
    }
    let mut rng = Rng::new(0xf8, 0);
    for fmt in [Fp8::E4m3, Fp8::E5m2] {
        for sq in [1, 5] {
            let p = Problem::new(b, (hq, hkv), (sq, sk), d).with_head_dim_v(dv);
            let q = rng.normal_f32(p.q_len(), 1.0);
            let (k, v) = (
                rng.normal_f32(p.k_len(), 3.0),
                rng.normal_f32(p.v_len(), 2.0),
            );
            let qd: Vec<f64> = q.iter().map(|&x| f64::from(x)).collect();
            let host = Causal.host(&p).unwrap();
            let check =
                |what: &str,
                 want: &Forward<f64>,
                 (out, lse): (Tensor<CpuRuntime>, Tensor<CpuRuntime>)| {
                    for (name, got, want) in [("out", out, &want.out), ("lse", lse, &want.lse)] {
                        for (i, (g, w)) in got.to_vec::<f32>().iter().zip(want).enumerate() {
                            let g = f64::from(*g);
                            assert!(
                                (g - w).abs() <= 2e-5 * (1.0 + w.abs()),
                                "{what} {fmt:?} Sq {sq} {name}[{i}] {g} vs {w}"
                            );
                        }
                    }
                };
            let qt = f32s(&q, &p.q_shape());
            let opts = AttentionOptions::default();
            let lengths =
                Tensor::<CpuRuntime>::from_slice(&[sk as i32, sk as i32], &[b], &dev).unwrap();

            // A contiguous cache, a scale per kv head.
            let row_head = |kind: usize| move |row: usize| head_scale(kind, (row / sk) % hkv);
            let (kb, kd) = quantized(fmt, &k, d, row_head(0));
            let (vb, vd) = quantized(fmt, &v, dv, row_head(3));
            let want = reference_forward::<f64, _>(&host, &p, &qd, &kd, &vd);
            let scales = |kind: usize| {
                f32s(
                    &(0..hkv).map(|h| head_scale(kind, h)).collect::<Vec<_>>(),
                    &[hkv],
                )
            };
            let (ks, vs) = (scales(0), scales(3));
            let (kt, vt) = (
                fp8_tensor(fmt, &kb, &p.k_shape()),
                fp8_tensor(fmt, &vb, &p.v_shape()),
            );
            let cache =
                Keys::cache(&kt, &vt, &lengths).with_scales(KvScales::PerHead { k: &ks, v: &vs });
            let got = attention(&Causal, &qt, cache, &opts)
                .map(|y| (y.out, y.lse))
                .expect("an fp8 cache");
            check("contiguous", &want, got);

            // The same keys in the shuffled pages, quantized against each
            // page's scales (or its head's).
            let (kp, vp) = (
                moved(&k, d, placed.iter().copied()),
                moved(&v, dv, placed.iter().copied()),
            );
            for per_page in [false, true] {
                let row_scale = |kind: usize| {
                    move |row: usize| {
                        let (page, h) = (row / (hkv * ps), (row / ps) % hkv);
                        if per_page {
                            page_scale(kind, page, h)
                        } else {
                            head_scale(kind, h)
                        }
                    }
                };
                let (kpb, kpd) = quantized(fmt, &kp, d, row_scale(0));
                let (vpb, vpd) = quantized(fmt, &vp, dv, row_scale(3));
                // The reference reads the pages' dequantized values back in
                // sequence order.
                let back = || {
                    placed
                        .iter()
                        .map(|&(seq_row, page_row)| (page_row, seq_row))
                };
                let (kd, vd) = (moved(&kpd, d, back()), moved(&vpd, dv, back()));
                let want = reference_forward::<f64, _>(&host, &p, &qd, &kd, &vd);
                let kt = fp8_tensor(fmt, &kpb, &[pages, hkv, ps, d]);
                let vt = fp8_tensor(fmt, &vpb, &[pages, hkv, ps, dv]);
                let tt = Tensor::<CpuRuntime>::from_slice(&table, &[b, per_seq], &dev).unwrap();
                let per = |kind: usize| -> Vec<f32> {
                    (0..pages * hkv)
                        .map(|i| page_scale(kind, i / hkv, i % hkv))
                        .collect()
                };
                let (kps, vps) = (f32s(&per(0), &[pages, hkv]), f32s(&per(3), &[pages, hkv]));
                let scales = if per_page {
                    KvScales::PerPage { k: &kps, v: &vps }
                } else {
                    KvScales::PerHead { k: &ks, v: &vs }
                };
                let paged = Keys::paged(&kt, &vt, &tt, &lengths).with_scales(scales);
                let got = attention(&Causal, &qt, paged, &opts)
                    .map(|y| (y.out, y.lse))
                    .expect("fp8 pages");
                check(&format!("paged, per page {per_page}"), &want, got);
            }
        }
    }
}

/// Every broken rule of an fp8 cache's scales is an `Err` naming it.
#[test]
fn fp8_cache_scales_break_rules_as_errors() {
    use boostr_runtime::KvScales;
    let dev = CpuDevice::new();
    let (b, hq, hkv, cap, d) = (1, 4, 2, 8, 16);
    let t = |x: &[f32], shape: &[usize]| Tensor::<CpuRuntime>::from_slice(x, shape, &dev).unwrap();
    let q = t(&vec![0.5; b * hq * d], &[b, hq, 1, d]);
    let kv = fp8_tensor(Fp8::E4m3, &vec![0x38; b * hkv * cap * d], &[b, hkv, cap, d]);
    let kv32 = t(&vec![1.0; b * hkv * cap * d], &[b, hkv, cap, d]);
    let lengths = Tensor::<CpuRuntime>::from_slice(&[cap as i32], &[b], &dev).unwrap();
    let good = t(&[0.5, 2.0], &[hkv]);
    let opts = AttentionOptions::default();
    let run_kv = |k: &Tensor<CpuRuntime>,
                  v: &Tensor<CpuRuntime>,
                  scales: Option<KvScales<'_, CpuRuntime>>| {
        let cache = Keys::cache(k, v, &lengths);
        let cache = match scales {
            Some(scales) => cache.with_scales(scales),
            None => cache,
        };
        attention(&Causal, &q, cache, &opts).map(|y| (y.out, y.lse))
    };
    let run =
        |k: &Tensor<CpuRuntime>, scales: Option<KvScales<'_, CpuRuntime>>| run_kv(k, k, scales);
    let e5m2 = fp8_tensor(Fp8::E5m2, &vec![0x3c; b * hkv * cap * d], &[b, hkv, cap, d]);
    run(&kv, Some(KvScales::PerHead { k: &good, v: &good })).expect("a good fp8 cache");
    let f64s = good.to_dtype(numr::dtype::DType::F64).unwrap();
    let wrong_shape = t(&[0.5, 2.0, 1.0], &[3]);
    let negative = t(&[0.5, -0.25], &[hkv]);
    let nan = t(&[f32::NAN, 1.0], &[hkv]);
    let per_page = t(&[1.0; 2], &[1, hkv]);
    let cases: [(&str, Result<_, _>); 8] = [
        ("needs its scales", run(&kv, None)),
        (
            "share one format",
            run_kv(&kv, &e5m2, Some(KvScales::PerHead { k: &good, v: &good })),
        ),
        (
            "apply to fp8 caches",
            run(&kv32, Some(KvScales::PerHead { k: &good, v: &good })),
        ),
        (
            "are f32",
            run(&kv, Some(KvScales::PerHead { k: &f64s, v: &good })),
        ),
        (
            "are [Hkv]",
            run(
                &kv,
                Some(KvScales::PerHead {
                    k: &good,
                    v: &wrong_shape,
                }),
            ),
        ),
        (
            "finite and not negative",
            run(
                &kv,
                Some(KvScales::PerHead {
                    k: &negative,
                    v: &good,
                }),
            ),
        ),
        (
            "finite and not negative",
            run(&kv, Some(KvScales::PerHead { k: &good, v: &nan })),
        ),
        (
            "need pages",
            run(
                &kv,
                Some(KvScales::PerPage {
                    k: &per_page,
                    v: &per_page,
                }),
            ),
        ),
    ];
    for (rule, got) in cases {
        match got {
            Err(e @ Error::CacheScales { .. }) => {
                assert!(e.to_string().contains(rule), "{rule}: {e}")
            }
            other => panic!("{rule}: {other:?}"),
        }
    }
    // The backward of an fp8 cache.
    let (out, lse) = run(&kv, Some(KvScales::PerHead { k: &good, v: &good })).unwrap();
    let cache =
        Keys::cache(&kv, &kv, &lengths).with_scales(KvScales::PerHead { k: &good, v: &good });
    let err = attention_backward(
        &Causal,
        &q,
        cache,
        Backward::from_tensors(&out, &lse, &out),
        &opts,
    )
    .map(|g| (g.dq, g.dk, g.dv))
    .expect_err("fp8 backward");
    assert!(err.to_string().contains("fp8"), "{err}");
}
