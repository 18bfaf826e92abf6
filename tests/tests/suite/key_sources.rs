//! Every key source under random shapes, lengths, page tables and
//! offsets, valid and not (proptest, on the CPU): a valid call equals the
//! f64 reference of each sequence run alone, in every dtype (and in f32 its
//! backward too), the rows and keys past each sequence's own exactly 0; an
//! invalid one is an `Err` that names the offending value; none panics. A
//! failing case shrinks to a small batch (`PROPTEST_CASES` runs more).

use boostr_runtime::stock::{Causal, CausalSoftcap};
use boostr_runtime::testing::{CpuRuntime, Rng, reference_backward, reference_forward};
use boostr_runtime::{
    AttentionOptions, Backward, Keys, Problem, Variant, attention, attention_backward,
};
use numr::dtype::DType;
use numr::runtime::cpu::CpuDevice;
use numr::tensor::Tensor;
use proptest::prelude::*;

type T = Tensor<CpuRuntime>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Dense,
    Cache,
    Paged,
    Padded,
    Varlen,
}

/// One broken rule, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// A key length one past its slots (a cache's, pages', a padded
    /// batch's).
    LengthPast,
    /// A negative key length.
    NegativeLength,
    /// A padded batch's query length one past its rows.
    QueryLengthPast,
    /// `cu_seqlens_k` that decrease.
    OffsetsDecrease,
    /// `cu_seqlens_q` that end before the packed rows do.
    OffsetsEndEarly,
    /// `cu_seqlens_k` that start past 0.
    OffsetsStart,
    /// `cu_seqlens_k` of one more sequence than `cu_seqlens_q`.
    CountMismatch,
    /// A page table entry a length reaches that is no page.
    PageIndex,
}

/// A batch of sequences and how its keys are given.
#[derive(Clone, Debug)]
struct Case {
    source: Source,
    heads_kv: usize,
    group: usize,
    d: usize,
    dv: usize,
    /// Query rows per sequence in the tensors (`Sq`; packed: unused).
    rows: usize,
    /// Key slots per sequence (`Sk`, a cache's capacity; packed: unused).
    slots: usize,
    /// Per sequence, its own query rows and keys.
    seqs: Vec<(usize, usize)>,
    page_size: usize,
    dtype: DType,
    softcap: bool,
    fault: Fault,
    seed: u64,
}

fn source() -> impl Strategy<Value = Source> {
    prop_oneof![
        Just(Source::Dense),
        Just(Source::Cache),
        Just(Source::Paged),
        Just(Source::Padded),
        Just(Source::Varlen),
    ]
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        4 => Just(Fault::None),
        1 => Just(Fault::LengthPast),
        1 => Just(Fault::NegativeLength),
        1 => Just(Fault::QueryLengthPast),
        1 => Just(Fault::OffsetsDecrease),
        1 => Just(Fault::OffsetsEndEarly),
        1 => Just(Fault::OffsetsStart),
        1 => Just(Fault::CountMismatch),
        1 => Just(Fault::PageIndex),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    let sizes = (
        source(),
        1..=2usize,
        1..=3usize,
        prop_oneof![Just(8usize), Just(16)],
        prop_oneof![Just(8usize), Just(12)],
        1..=12usize,
        1..=20usize,
        1..=3usize,
        prop_oneof![Just(1usize), Just(4), Just(8)],
    );
    let rest = (
        prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)],
        any::<bool>(),
        fault(),
        any::<u64>(),
    );
    (sizes, rest)
        .prop_flat_map(
            |((source, heads_kv, group, d, dv, rows, slots, n, page_size), rest)| {
                let seqs = proptest::collection::vec((0..=rows, 0..=slots), n);
                (
                    Just((source, heads_kv, group, d, dv, rows, slots, page_size)),
                    seqs,
                    Just(rest),
                )
            },
        )
        .prop_map(
            |((source, heads_kv, group, d, dv, rows, slots, page_size), seqs, rest)| {
                let (dtype, softcap, fault, seed) = rest;
                Case {
                    source,
                    heads_kv,
                    group,
                    d,
                    dv,
                    rows,
                    slots,
                    seqs,
                    page_size,
                    dtype,
                    softcap,
                    fault,
                    seed,
                }
                .normalized()
            },
        )
}

impl Case {
    /// The sequences as the source allows them, and the fault where it
    /// applies (else none).
    fn normalized(mut self) -> Self {
        match self.source {
            Source::Dense => {
                for s in &mut self.seqs {
                    *s = (self.rows, self.slots);
                }
            }
            Source::Cache | Source::Paged => {
                if self.source == Source::Paged {
                    self.slots = self.slots.div_ceil(self.page_size) * self.page_size;
                }
                for s in &mut self.seqs {
                    s.0 = self.rows;
                }
            }
            Source::Padded | Source::Varlen => {}
        }
        let applies = match self.fault {
            Fault::None => true,
            Fault::LengthPast | Fault::NegativeLength => {
                matches!(self.source, Source::Cache | Source::Paged | Source::Padded)
            }
            Fault::QueryLengthPast => self.source == Source::Padded,
            Fault::OffsetsEndEarly => {
                let (tq, last) = (self.total(0), self.seqs.last().map_or(0, |s| s.0));
                self.source == Source::Varlen && tq >= 1 && last >= 1
            }
            Fault::OffsetsDecrease => {
                self.source == Source::Varlen
                    && self.seqs[..self.seqs.len() - 1].iter().any(|s| s.1 > 0)
            }
            Fault::OffsetsStart | Fault::CountMismatch => self.source == Source::Varlen,
            Fault::PageIndex => self.source == Source::Paged && self.seqs.iter().any(|s| s.1 > 0),
        };
        if !applies {
            self.fault = Fault::None;
        }
        self
    }

    fn heads_q(&self) -> usize {
        self.heads_kv * self.group
    }

    /// The packed rows (`at` 0) or keys (1).
    fn total(&self, at: usize) -> usize {
        self.seqs.iter().map(|s| [s.0, s.1][at]).sum()
    }

    /// A valid packed call with no rows or no keys at all has a zero-size
    /// tensor: an error too.
    fn empty_packed(&self) -> bool {
        self.source == Source::Varlen && (self.total(0) == 0 || self.total(1) == 0)
    }

    /// The tolerance of a result in the case's dtype, relative to the
    /// largest reference value (plus 1).
    fn tolerance(&self) -> f64 {
        match self.dtype {
            DType::F32 => 1e-4,
            DType::F16 => 5e-3,
            _ => 3e-2,
        }
    }
}

/// The tensors of one call and the values the kernels see (after rounding
/// to the dtype), per sequence: `q` rows `[Hq, rows, D]`, `k` `[Hkv, keys,
/// D]`, `v` `[Hkv, keys, Dv]`, `dout` `[Hq, rows, Dv]`.
struct Built {
    q: T,
    k: T,
    v: T,
    dout: T,
    index: Vec<T>,
    seq_values: Vec<[Vec<f64>; 4]>,
}

/// `x` of `shape` in `dtype` (its values rounded).
fn rounded(x: &[f32], shape: &[usize], dtype: DType, device: &CpuDevice) -> T {
    let t = T::from_slice(x, shape, device).expect("a tensor");
    if dtype == DType::F32 {
        t
    } else {
        t.to_dtype(dtype).expect("the dtype")
    }
}

fn build(c: &Case, device: &CpuDevice) -> Built {
    let mut rng = Rng::new(c.seed, 0);
    let (hq, hk, d, dv) = (c.heads_q(), c.heads_kv, c.d, c.dv);
    let n = c.seqs.len();
    // Per sequence, its own values: q and dout rows, k and v keys.
    let own: Vec<[Vec<f32>; 4]> = c
        .seqs
        .iter()
        .map(|&(r, k)| {
            [
                rng.normal_f32(hq * r * d, 1.0),
                rng.normal_f32(hk * k * d, 1.0),
                rng.normal_f32(hk * k * dv, 1.0),
                rng.normal_f32(hq * r * dv, 1.0),
            ]
        })
        .collect();
    // Row `i` of head `h` of sequence `s`'s part `part` (`width` wide,
    // `count` rows per head).
    let row = |s: usize, part: usize, h: usize, i: usize, count: usize, width: usize| {
        &own[s][part][(h * count + i) * width..(h * count + i + 1) * width]
    };
    let mut q_data;
    let mut k_data;
    let mut v_data;
    let mut dout_data;
    let shapes: [Vec<usize>; 4];
    let mut index = Vec::new();
    let mut pages = 0;
    let i32s = |x: &[i32]| T::from_slice(x, &[x.len()], device).expect("an index tensor");
    if c.source == Source::Varlen {
        let (tq, tk) = (c.total(0), c.total(1));
        q_data = vec![0.0f32; tq * hq * d];
        dout_data = vec![0.0f32; tq * hq * dv];
        k_data = vec![0.0f32; tk * hk * d];
        v_data = vec![0.0f32; tk * hk * dv];
        let (mut t0, mut u0) = (0, 0);
        for (s, &(r, kk)) in c.seqs.iter().enumerate() {
            for i in 0..r {
                for h in 0..hq {
                    let at = (t0 + i) * hq + h;
                    q_data[at * d..(at + 1) * d].copy_from_slice(row(s, 0, h, i, r, d));
                    dout_data[at * dv..(at + 1) * dv].copy_from_slice(row(s, 3, h, i, r, dv));
                }
            }
            for j in 0..kk {
                for h in 0..hk {
                    let at = (u0 + j) * hk + h;
                    k_data[at * d..(at + 1) * d].copy_from_slice(row(s, 1, h, j, kk, d));
                    v_data[at * dv..(at + 1) * dv].copy_from_slice(row(s, 2, h, j, kk, dv));
                }
            }
            t0 += r;
            u0 += kk;
        }
        shapes = [
            vec![tq, hq, d],
            vec![tk, hk, d],
            vec![tk, hk, dv],
            vec![tq, hq, dv],
        ];
        let mut cu_q: Vec<i32> = std::iter::once(0)
            .chain(c.seqs.iter().scan(0, |a, s| {
                *a += s.0 as i32;
                Some(*a)
            }))
            .collect();
        let mut cu_k: Vec<i32> = std::iter::once(0)
            .chain(c.seqs.iter().scan(0, |a, s| {
                *a += s.1 as i32;
                Some(*a)
            }))
            .collect();
        match c.fault {
            Fault::OffsetsDecrease => {
                let at = (1..n).find(|&at| cu_k[at] > 0).expect("applies");
                cu_k[at + 1] = cu_k[at] - 1;
            }
            Fault::OffsetsEndEarly => cu_q[n] -= 1,
            Fault::OffsetsStart => cu_k[0] = 1,
            Fault::CountMismatch => cu_k.push(cu_k[n]),
            _ => {}
        }
        index.push(i32s(&cu_q));
        index.push(i32s(&cu_k));
    } else {
        let (rows, slots) = (c.rows, c.slots);
        // Rows and slots past a sequence's own: finite garbage in q and
        // dout, NaN and infinities in k and v (never read).
        q_data = rng.normal_f32(n * hq * rows * d, 3.0);
        dout_data = rng.normal_f32(n * hq * rows * dv, 3.0);
        k_data = vec![f32::NAN; n * hk * slots * d];
        v_data = vec![f32::INFINITY; n * hk * slots * dv];
        for (s, &(r, kk)) in c.seqs.iter().enumerate() {
            // A cache's rows are its last positions: all `rows` of them.
            let r = if c.source == Source::Padded { r } else { rows };
            for h in 0..hq {
                for i in 0..r {
                    let at = (s * hq + h) * rows + i;
                    q_data[at * d..(at + 1) * d].copy_from_slice(row(s, 0, h, i, r, d));
                    dout_data[at * dv..(at + 1) * dv].copy_from_slice(row(s, 3, h, i, r, dv));
                }
            }
            for h in 0..hk {
                for j in 0..kk {
                    let at = (s * hk + h) * slots + j;
                    k_data[at * d..(at + 1) * d].copy_from_slice(row(s, 1, h, j, kk, d));
                    v_data[at * dv..(at + 1) * dv].copy_from_slice(row(s, 2, h, j, kk, dv));
                }
            }
        }
        let mut lens: Vec<i32> = c.seqs.iter().map(|s| s.1 as i32).collect();
        let mut q_lens: Vec<i32> = c.seqs.iter().map(|s| s.0 as i32).collect();
        match c.fault {
            Fault::LengthPast => lens[n - 1] = slots as i32 + 1,
            Fault::NegativeLength => lens[0] = -3,
            Fault::QueryLengthPast => q_lens[n - 1] = rows as i32 + 1,
            _ => {}
        }
        shapes = [
            vec![n, hq, rows, d],
            vec![n, hk, slots, d],
            vec![n, hk, slots, dv],
            vec![n, hq, rows, dv],
        ];
        if c.source == Source::Paged {
            // Each sequence's pages in reverse order, then one spare page.
            let ps = c.page_size;
            let max_pages = slots / ps;
            pages = n * max_pages + 1;
            let page_of = |s: usize, lp: usize| pages - 2 - (s * max_pages + lp);
            let (mut kp, mut vp) = (
                vec![f32::NAN; pages * hk * ps * d],
                vec![f32::NAN; pages * hk * ps * dv],
            );
            let mut table = vec![-5i32; n * max_pages];
            for s in 0..n {
                for lp in 0..max_pages {
                    table[s * max_pages + lp] = page_of(s, lp) as i32;
                    for h in 0..hk {
                        for slot in 0..ps {
                            let from = (s * hk + h) * slots + lp * ps + slot;
                            let to = (page_of(s, lp) * hk + h) * ps + slot;
                            kp[to * d..(to + 1) * d]
                                .copy_from_slice(&k_data[from * d..(from + 1) * d]);
                            vp[to * dv..(to + 1) * dv]
                                .copy_from_slice(&v_data[from * dv..(from + 1) * dv]);
                        }
                    }
                }
            }
            if c.fault == Fault::PageIndex {
                let s = c.seqs.iter().position(|s| s.1 > 0).expect("applies");
                table[s * max_pages] = pages as i32 + 2;
            }
            k_data = kp;
            v_data = vp;
            index.push(T::from_slice(&table, &[n, max_pages], device).expect("a page table"));
        }
        if c.source == Source::Padded {
            index.push(i32s(&q_lens));
        }
        if c.source != Source::Dense {
            index.push(i32s(&lens));
        }
    }
    let (k_shape, v_shape) = if c.source == Source::Paged {
        (
            vec![pages, hk, c.page_size, d],
            vec![pages, hk, c.page_size, dv],
        )
    } else {
        (shapes[1].clone(), shapes[2].clone())
    };
    let q = rounded(&q_data, &shapes[0], c.dtype, device);
    let k = rounded(&k_data, &k_shape, c.dtype, device);
    let v = rounded(&v_data, &v_shape, c.dtype, device);
    let dout = rounded(&dout_data, &shapes[3], c.dtype, device);
    // The values each sequence's rows and keys have after rounding.
    let seq_values = c
        .seqs
        .iter()
        .enumerate()
        .map(|(s, &(r, _))| {
            let round = |x: &[f32]| -> Vec<f64> {
                rounded(x, &[x.len()], c.dtype, device)
                    .to_dtype(DType::F32)
                    .expect("f32")
                    .to_vec::<f32>()
                    .into_iter()
                    .map(f64::from)
                    .collect()
            };
            let r = if matches!(c.source, Source::Cache | Source::Paged) {
                c.rows
            } else {
                r
            };
            [
                round(&own[s][0][..hq * r * d]),
                round(&own[s][1]),
                round(&own[s][2]),
                round(&own[s][3][..hq * r * dv]),
            ]
        })
        .collect();
    Built {
        q,
        k,
        v,
        dout,
        index,
        seq_values,
    }
}

/// The case's keys over `b`'s tensors.
fn keys<'a>(c: &Case, b: &'a Built) -> Keys<'a, CpuRuntime> {
    let ix = &b.index;
    match c.source {
        Source::Dense => Keys::dense(&b.k, &b.v),
        Source::Cache => Keys::cache(&b.k, &b.v, &ix[0]),
        Source::Paged => Keys::paged(&b.k, &b.v, &ix[0], &ix[1]),
        Source::Padded => Keys::padded(&b.k, &b.v, &ix[0], &ix[1]),
        Source::Varlen => Keys::varlen(&b.k, &b.v, &ix[0], &ix[1]),
    }
}

/// The value a fault's error must name.
fn faulty_value(c: &Case) -> String {
    let n = c.seqs.len();
    match c.fault {
        Fault::LengthPast => format!("= {}", c.slots + 1),
        Fault::NegativeLength => "= -3".into(),
        Fault::QueryLengthPast => format!("= {}", c.rows + 1),
        Fault::OffsetsDecrease => {
            let cu: Vec<usize> = std::iter::once(0)
                .chain(c.seqs.iter().scan(0, |a, s| {
                    *a += s.1;
                    Some(*a)
                }))
                .collect();
            let at = (1..n).find(|&at| cu[at] > 0).expect("applies");
            format!("cu_seqlens_k[{}] = {}", at + 1, cu[at] - 1)
        }
        Fault::OffsetsEndEarly => format!("cu_seqlens_q[{n}] = {}", c.total(0) - 1),
        Fault::OffsetsStart => "cu_seqlens_k[0] = 1".into(),
        Fault::CountMismatch => format!("[{}]", n + 2),
        Fault::PageIndex => format!("is {}", n * (c.slots / c.page_size) + 3),
        Fault::None => unreachable!("no fault"),
    }
}

/// Row `i` of head `h` of sequence `s` in a result `[.., H, rows, width]`
/// (packed: `[total, H, width]`) of the case.
fn result_row<'x>(
    c: &Case,
    x: &'x [f32],
    (s, h, i): (usize, usize, usize),
    heads: usize,
    width: usize,
) -> &'x [f32] {
    let at = if c.source == Source::Varlen {
        let t0: usize = c.seqs[..s].iter().map(|q| q.0).sum();
        (t0 + i) * heads + h
    } else {
        (s * heads + h) * c.rows + i
    };
    &x[at * width..(at + 1) * width]
}

/// The lse of row `i` of head `h` of sequence `s` (packed: of `[Hq,
/// total]`).
fn lse_at(c: &Case, lse: &[f32], (s, h, i): (usize, usize, usize)) -> f32 {
    if c.source == Source::Varlen {
        let t0: usize = c.seqs[..s].iter().map(|q| q.0).sum();
        lse[h * c.total(0) + t0 + i]
    } else {
        lse[(s * c.heads_q() + h) * c.rows + i]
    }
}

/// Key `j` of head `h` of sequence `s` in a gradient of `k` or `v`.
fn key_row(c: &Case, x: &[f32], (s, h, j): (usize, usize, usize), width: usize) -> Vec<f32> {
    let at = match c.source {
        Source::Varlen => {
            let u0: usize = c.seqs[..s].iter().map(|q| q.1).sum();
            (u0 + j) * c.heads_kv + h
        }
        Source::Paged => {
            let (ps, max_pages) = (c.page_size, c.slots / c.page_size);
            let page = c.seqs.len() * max_pages + 1 - 2 - (s * max_pages + j / ps);
            (page * c.heads_kv + h) * ps + j % ps
        }
        _ => (s * c.heads_kv + h) * c.slots + j,
    };
    x[at * width..(at + 1) * width].to_vec()
}

/// The worst error of `got` against `want`, relative to `1 + max |want|`.
fn error(got: &[f32], want: &[f64]) -> f64 {
    let top = want.iter().fold(
        0.0f64,
        |m, x| if x.is_finite() { m.max(x.abs()) } else { m },
    );
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            let g = f64::from(g);
            if w.is_finite() {
                (g - w).abs()
            } else if g == w {
                0.0
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
        / (1.0 + top)
}

fn check<V: Variant>(variant: &V, c: &Case) -> Result<(), TestCaseError> {
    let device = CpuDevice::new();
    let b = build(c, &device);
    let opts = AttentionOptions::default().with_max_scores();
    let result = attention(variant, &b.q, keys(c, &b), &opts);
    if c.fault != Fault::None || c.empty_packed() {
        let e = match result {
            Err(e) => e.to_string(),
            Ok(_) => return Err(TestCaseError::fail(format!("{:?}: no error", c.fault))),
        };
        if c.fault != Fault::None {
            let want = faulty_value(c);
            prop_assert!(e.contains(&want), "{:?}: `{e}` names no `{want}`", c.fault);
        }
        return Ok(());
    }
    let y = result.map_err(|e| TestCaseError::fail(format!("attention: {e}")))?;
    let f32s = |t: &T| t.to_dtype(DType::F32).expect("f32").to_vec::<f32>();
    let (out, lse) = (f32s(&y.out), y.lse.to_vec::<f32>());
    let max = y.max_scores.as_ref().expect("asked for");
    prop_assert_eq!(max.shape(), y.lse.shape());
    let max = max.to_vec::<f32>();
    let grads = if c.dtype == DType::F32 {
        let g = attention_backward(
            variant,
            &b.q,
            keys(c, &b),
            Backward::new(&y, &b.dout),
            &opts,
        )
        .map_err(|e| TestCaseError::fail(format!("attention_backward: {e}")))?;
        Some((f32s(&g.dq), f32s(&g.dk), f32s(&g.dv)))
    } else {
        None
    };
    let (hq, hk, d, dv) = (c.heads_q(), c.heads_kv, c.d, c.dv);
    let tol = c.tolerance();
    for (s, &(own_rows, kk)) in c.seqs.iter().enumerate() {
        let r = if matches!(c.source, Source::Cache | Source::Paged) {
            c.rows
        } else {
            own_rows
        };
        let [qv, kv_, vv, dov] = &b.seq_values[s];
        let p = Problem::new(1, (hq, hk), (r, kk), d).with_head_dim_v(dv);
        let host = variant.host(&p).expect("a variant without tensors");
        let (want_out, want_lse, want_max) = if kk == 0 || r == 0 {
            let none = vec![f64::NEG_INFINITY; hq * r];
            (vec![0.0; hq * r * dv], none.clone(), none)
        } else {
            let f = reference_forward(&host, &p, qv, kv_, vv);
            (f.out, f.lse, f.max_scores)
        };
        for h in 0..hq {
            for i in 0..r {
                let got = result_row(c, &out, (s, h, i), hq, dv);
                let want = &want_out[(h * r + i) * dv..(h * r + i + 1) * dv];
                let e = error(got, want);
                prop_assert!(
                    e <= tol,
                    "out of sequence {s}, head {h}, row {i}: error {e:.2e}"
                );
                let got_l = lse_at(c, &lse, (s, h, i));
                let want_l = want_lse[h * r + i];
                prop_assert!(
                    error(&[got_l], &[want_l]) <= tol,
                    "lse of sequence {s}, head {h}, row {i}: {got_l}, want {want_l}"
                );
                let (got_m, want_m) = (lse_at(c, &max, (s, h, i)), want_max[h * r + i]);
                prop_assert!(
                    error(&[got_m], &[want_m]) <= tol,
                    "max score of sequence {s}, head {h}, row {i}: {got_m}, want {want_m}"
                );
            }
            // A padded batch's rows past the sequence's own: exactly 0.
            if c.source == Source::Padded {
                for i in r..c.rows {
                    let got = result_row(c, &out, (s, h, i), hq, dv);
                    prop_assert!(
                        got.iter().all(|&x| x == 0.0),
                        "padded row {i} of {s}: {got:?}"
                    );
                    let got_l = lse_at(c, &lse, (s, h, i));
                    prop_assert!(
                        got_l == f32::NEG_INFINITY,
                        "padded row {i} of {s}: lse {got_l}"
                    );
                    let got_m = lse_at(c, &max, (s, h, i));
                    prop_assert!(
                        got_m == f32::NEG_INFINITY,
                        "padded row {i} of {s}: max score {got_m}"
                    );
                }
            }
        }
        let Some((dq, dk, dvg)) = &grads else {
            continue;
        };
        let want = if kk == 0 || r == 0 {
            None
        } else {
            Some(reference_backward(&host, &p, qv, kv_, vv, dov))
        };
        for h in 0..hq {
            for i in 0..c.rows.max(r) {
                if c.source == Source::Varlen && i >= r {
                    break;
                }
                let got = result_row(c, dq, (s, h, i), hq, d);
                match &want {
                    Some(g) if i < r => {
                        let e = error(got, &g.dq[(h * r + i) * d..(h * r + i + 1) * d]);
                        prop_assert!(e <= tol, "dq of sequence {s}, head {h}, row {i}: {e:.2e}");
                    }
                    _ => prop_assert!(got.iter().all(|&x| x == 0.0), "dq row {i} of {s}: {got:?}"),
                }
            }
        }
        for h in 0..hk {
            for j in 0..kk {
                for (what, g, width) in [("dk", dk, d), ("dv", dvg, dv)] {
                    let got = key_row(c, g, (s, h, j), width);
                    match &want {
                        Some(w) => {
                            let wt = if what == "dk" { &w.dk } else { &w.dv };
                            let e =
                                error(&got, &wt[(h * kk + j) * width..(h * kk + j + 1) * width]);
                            prop_assert!(e <= tol, "{what} of sequence {s}, key {j}: {e:.2e}");
                        }
                        None => {
                            prop_assert!(got.iter().all(|&x| x == 0.0), "{what} key {j} of {s}")
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_key_source_equals_each_sequence_alone(c in case()) {
        if c.softcap {
            check(&CausalSoftcap { cap: 4.0 }, &c)?;
        } else {
            check(&Causal, &c)?;
        }
    }
}
