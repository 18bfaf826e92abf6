//! The key sources of the generated tests: every variant over a KV cache,
//! pages, a right-padded batch and packed sequences (varlen), forward,
//! backward (with `dlse` and the learnable tensors' gradients) and
//! autograd, on each backend, against the f64 reference of each sequence
//! at its own lengths (the reference through the window the source gives
//! the kernels: [`Cached`]).
//!
//! One batch of three sequences, of 0, 29 and 48 keys in 48 slots: an
//! empty one, one that ends inside a page, one that fills its slots. Their
//! spare slots hold NaN and infinities. As pages of 16 in shuffled order,
//! the last two sequences share their first page (a common prefix: their
//! first 16 keys are the same), with spare pages of NaN and garbage in the
//! table entries no length reaches; each page's gradient must be the sum of
//! its readers'. As a padded batch and packed, the sequences have their
//! own query rows too (see [`query_lengths`]): rows with no keys, a
//! sequence with no rows, rows past a sequence's own (padding, which must
//! come out exactly 0), and the packed batch must equal the padded one.

use super::backends::TestBackend;
use super::cases::{Case, Logits};
use super::data::TestData;
use super::exact_zeros::exact_zeros;
use super::inputs::{Expected, Inputs, learnable_names};
use super::reference::{Forward, Gradients};
use super::report::CaseReport;
use super::run_backend::{BackendResults, through_autograd};
use super::tolerance::{Layout, NAIVE_FACTOR, compare, compare_results};
use crate::cpu::weights::RowWeights as _;
use crate::keys::Keys;
use crate::op::{Backward, attention, attention_backward};
use crate::problem::Problem;
use crate::shifted::Cached;
use crate::validate;
use crate::variant::{HostVariant as _, Variant};
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// Each sequence's keys.
const LENS: [usize; 3] = [0, 29, 48];
/// Keys per page.
const PAGE: usize = 16;

/// Each sequence's query rows in a padded or packed batch of `sq` rows
/// per sequence: 3 rows that see no key (the first has none), none (or,
/// with 29 rows to spare, as many as its keys), and all but 2 (padding).
pub(crate) fn query_lengths(sq: usize) -> [usize; 3] {
    [sq.min(3), if sq >= LENS[1] { LENS[1] } else { 0 }, sq - 2]
}

/// The shapes the sources are checked on: a decode block (the CPU's decode
/// kernel) and a prefill block of more rows than keys in some sequences
/// (the tile kernels over a cache). At the head dims of
/// [`SMALL_CASES`](super::SMALL_CASES), 80/56, whose pipelines a GPU
/// backend has built for them already (a software adapter spends most of
/// a check compiling).
pub(crate) const LAYOUT_CASES: &[Case] = &[
    layout_case(5, "key sources, 5 rows"),
    layout_case(37, "key sources, 37 rows"),
];

const fn layout_case(seq_q: usize, name: &'static str) -> Case {
    Case {
        batch: LENS.len(),
        heads_q: 4,
        heads_kv: 2,
        seq_q,
        seq_k: 48,
        head_dim: 80,
        head_dim_v: 56,
        logit_scale: 1.0,
        logits: Logits::Random,
        scale: None,
        name,
    }
}

/// Which logical pages of which sequence each page holds: sequences 1 and
/// 2 share their first page; pages 1 and 4 are spare.
const TABLE: [[usize; 3]; 3] = [[0, 0, 0], [3, 5, 0], [3, 2, 0]];
const PAGES: usize = 6;

/// The key sources.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Cache,
    Pages,
    Padded,
    Varlen,
    /// Pages read by packed queries (a batch of mixed decodes and
    /// prefills).
    PagesPacked,
}

impl Source {
    const ALL: [Source; 5] = [
        Source::Cache,
        Source::Pages,
        Source::Padded,
        Source::Varlen,
        Source::PagesPacked,
    ];

    fn name(self) -> &'static str {
        match self {
            Source::Cache => "cache",
            Source::Pages => "pages",
            Source::Padded => "padded",
            Source::Varlen => "varlen",
            Source::PagesPacked => "pages, packed queries",
        }
    }

    /// Whether each sequence has its own query rows.
    fn own_rows(self) -> bool {
        matches!(self, Source::Padded | Source::Varlen | Source::PagesPacked)
    }

    /// Whether the keys are in pages.
    fn paged(self) -> bool {
        matches!(self, Source::Pages | Source::PagesPacked)
    }

    /// Whether the queries are packed.
    fn packed_queries(self) -> bool {
        matches!(self, Source::Varlen | Source::PagesPacked)
    }
}

/// Check `R`'s ops over every key source for the variant `build` makes,
/// on `case` (one of [`LAYOUT_CASES`]).
pub(crate) fn check_layouts<R: TestBackend, V: Variant>(
    build: &mut impl FnMut(&mut TestData<'_, R::Runtime>) -> V,
    device: &<R::Runtime as Runtime>::Device,
    case: &Case,
    seed: u64,
    stream: u64,
) -> CaseReport {
    let p = case.problem();
    let variant = build(&mut TestData::new(p, device, seed, stream));
    let mut inputs = Inputs::draw(case, seed, stream);
    // Every source returns the rows' largest scores too.
    inputs.opts.max_scores = true;
    inputs.share_prefix(&p, (1, 2), PAGE);
    inputs.poison_slots(&p, &LENS);
    let p = match validate::call(&variant, p, &inputs.opts) {
        Ok(p) => p,
        Err(e) => return CaseReport::error(format!("{}: {e}", V::NAME)),
    };
    let host = match variant.host_copy(&p) {
        Ok(host) => host,
        Err(e) => return CaseReport::error(format!("{}::host: {e}", V::NAME)),
    };
    let q_lens = query_lengths(p.seq_q);
    let names = learnable_names::<V>();
    let cache = Cached::new(&host, &p, (None, &LENS));
    let padded = Cached::new(&host, &p, (Some(&q_lens), &LENS));
    let want_cache = Expected::reference(&cache, &p, &inputs, names.clone());
    let want_padded = Expected::reference(&padded, &p, &inputs, names);
    if let Some(e) = host.out_of_range() {
        return CaseReport::new(Vec::new(), format!("skipped (reads out of range: {e})"));
    }
    let mut failures = Vec::new();
    let mut summary = String::new();
    for source in Source::ALL {
        let got = match run_source::<R, V>(&variant, device, &p, &inputs, source) {
            Ok(got) => got,
            Err(e) => {
                failures.push(format!("{}: {e}", source.name()));
                continue;
            }
        };
        let (want, window) = if source.own_rows() {
            (&want_padded, &padded)
        } else {
            (&want_cache, &cache)
        };
        let mut these = Vec::new();
        let s = if source.paged() {
            compare_pages(&p, &got, want, &mut these)
        } else {
            let s = compare_results(&p, &got, want, NAIVE_FACTOR, &mut these);
            check_zeros(window, &p, want, &got, &mut these);
            s
        };
        failures.extend(these.into_iter().map(|f| format!("{}: {f}", source.name())));
        summary.push_str(&format!("{}: {s}; ", source.name()));
    }
    CaseReport::new(failures, summary)
}

/// Rows that see nothing and keys nothing sees, through the source's
/// `window`, have exactly 0 in every result.
fn check_zeros<H: crate::HostVariant>(
    window: &Cached<'_, H>,
    p: &Problem,
    want: &Expected,
    got: &BackendResults,
    failures: &mut Vec<String>,
) {
    exact_zeros(
        window,
        p,
        &want.fwd.lse,
        [
            ("attention out", &got.fwd.out),
            ("var_attention out", &got.var_out),
            ("attention_backward dq", &got.grads.dq),
            ("GradFn dq", &got.var_grads.dq),
        ],
        [
            ("attention_backward dk", &got.grads.dk),
            ("attention_backward dv", &got.grads.dv),
            ("GradFn dk", &got.var_grads.dk),
            ("GradFn dv", &got.var_grads.dv),
        ],
        failures,
    );
}

/// Pages' results against the reference: `out`, `lse` and `dq` as a
/// cache's, and each page's `dk`, `dv` the sum of its readers' (up to
/// twice a slot's terms).
fn compare_pages(
    p: &Problem,
    got: &BackendResults,
    want: &Expected,
    failures: &mut Vec<String>,
) -> String {
    let mut summary = String::new();
    // The forward's results carry no recomputed scores; the gradients do.
    let (fwd, grad) = (0.0, want.recomputed);
    let mut check = |label: &str, layout, got: &[f32], want: &[f64], naive: &[f32], (m, r)| {
        let c = compare(NAIVE_FACTOR, label, layout, p, got, want, naive, m, r);
        failures.extend(c.failures);
        summary.push_str(&format!("{label} {:.1e}/{:.1e} ", c.err, c.bound));
    };
    let [m_out, m_dq, m_dk, m_dv] = want.magnitudes;
    let (wf, wg, nf, ng) = (&want.fwd, &want.grads, &want.naive_fwd, &want.naive_grads);
    let (q_, o_) = (Layout::Query(p.head_dim), Layout::Query(p.head_dim_v));
    check("out", o_, &got.fwd.out, &wf.out, &nf.out, (m_out, fwd));
    check(
        "lse",
        Layout::Lse,
        &got.fwd.lse,
        &wf.lse,
        &nf.lse,
        (0.0, fwd),
    );
    if !got.fwd.max_scores.is_empty() {
        let (gm, wm, nm) = (&got.fwd.max_scores, &wf.max_scores, &nf.max_scores);
        check("max_scores", Layout::Lse, gm, wm, nm, (0.0, fwd));
    }
    check("var out", o_, &got.var_out, &wf.out, &nf.out, (m_out, fwd));
    let (dk_pages, dv_pages) = (fold(&wg.dk, p, p.head_dim), fold(&wg.dv, p, p.head_dim_v));
    let naive = |x: &[f32], dim| -> Vec<f32> {
        let wide: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        fold(&wide, p, dim).iter().map(|&v| v as f32).collect()
    };
    let (nk, nv) = (naive(&ng.dk, p.head_dim), naive(&ng.dv, p.head_dim_v));
    for (label, g) in [("dq", &got.grads), ("GradFn dq", &got.var_grads)] {
        check(label, q_, &g.dq, &wg.dq, &ng.dq, (m_dq, grad));
    }
    for (what, g) in [("", &got.grads), ("GradFn ", &got.var_grads)] {
        let (dk, dv) = (&g.dk, &g.dv);
        check(
            &format!("{what}dk"),
            Layout::Flat,
            dk,
            &dk_pages,
            &nk,
            (2.0 * m_dk, grad),
        );
        check(
            &format!("{what}dv"),
            Layout::Flat,
            dv,
            &dv_pages,
            &nv,
            (2.0 * m_dv, grad),
        );
        for (slot, want_t) in wg.tensors.iter().enumerate() {
            let (naive, m) = (&ng.tensors[slot], want.tensor_magnitudes[slot]);
            let label = format!("{what}d{}", want.tensor_names[slot]);
            let got_t = g.tensors.get(slot).map_or(&[][..], |t| &t[..]);
            check(&label, Layout::Flat, got_t, want_t, naive, (m, grad));
        }
    }
    summary
}

/// `R`'s ops over `source`, on `inputs` (the slots and rows of a padded
/// batch of `p`): the forward, the backward of `L = sum(out ∘ dout) +
/// sum(lse ∘ dlse)` and the same through autograd, host copies in the
/// layout of `p` (a packed source's unpacked into it; pages' `dk` and
/// `dv` as the pages).
fn run_source<R: TestBackend, V: Variant>(
    variant: &V,
    device: &<R::Runtime as Runtime>::Device,
    p: &Problem,
    inputs: &Inputs,
    source: Source,
) -> Result<BackendResults, String> {
    let [q, k, v, dout] = inputs.slices();
    let upload = |e: numr::error::Error| format!("uploading an input: {e}");
    let f32s = |data: &[f32], shape: &[usize]| {
        Tensor::<R::Runtime>::from_slice(data, shape, device).map_err(upload)
    };
    let i32s = |data: &[usize]| {
        let data: Vec<i32> = data.iter().map(|&x| x as i32).collect();
        Tensor::<R::Runtime>::from_slice(&data, &[data.len()], device).map_err(upload)
    };
    let host = |t: &Tensor<R::Runtime>| t.to_vec::<f32>();
    let err = |what: &'static str| move |e: crate::Error| format!("{what}: {e}");
    let q_lens = query_lengths(p.seq_q);
    let rows = Rows::new(p);
    // The tensors as the source lays them out.
    let (qt, dt, dlse) = match source {
        Source::Varlen | Source::PagesPacked => (
            f32s(
                &rows.pack(q, &q_lens, p.heads_q, p.head_dim),
                &[rows.total(&q_lens), p.heads_q, p.head_dim],
            )?,
            f32s(
                &rows.pack(dout, &q_lens, p.heads_q, p.head_dim_v),
                &[rows.total(&q_lens), p.heads_q, p.head_dim_v],
            )?,
            f32s(
                &rows.pack_lse(&inputs.dlse, &q_lens),
                &[p.heads_q, rows.total(&q_lens)],
            )?,
        ),
        _ => (
            f32s(q, &p.q_shape())?,
            f32s(dout, &p.out_shape())?,
            f32s(&inputs.dlse, &p.lse_shape())?,
        ),
    };
    let (kt, vt) = match source {
        Source::Cache | Source::Padded => (f32s(k, &p.k_shape())?, f32s(v, &p.v_shape())?),
        Source::Pages | Source::PagesPacked => (
            f32s(
                &pages(k, p, p.head_dim),
                &[PAGES, p.heads_kv, PAGE, p.head_dim],
            )?,
            f32s(
                &pages(v, p, p.head_dim_v),
                &[PAGES, p.heads_kv, PAGE, p.head_dim_v],
            )?,
        ),
        Source::Varlen => {
            let total = rows.total(&LENS);
            (
                f32s(
                    &rows.pack_keys(k, &LENS, p.head_dim),
                    &[total, p.heads_kv, p.head_dim],
                )?,
                f32s(
                    &rows.pack_keys(v, &LENS, p.head_dim_v),
                    &[total, p.heads_kv, p.head_dim_v],
                )?,
            )
        }
    };
    let lengths = i32s(&LENS)?;
    let q_lengths = i32s(&q_lens)?;
    let (cu_q, cu_k) = (i32s(&offsets(&q_lens))?, i32s(&offsets(&LENS))?);
    let table: Vec<i32> = (0..LENS.len())
        .flat_map(|b| {
            (0..TABLE[b].len()).map(move |lp| {
                // Entries no length reaches hold garbage.
                if lp * PAGE < LENS[b] {
                    TABLE[b][lp] as i32
                } else {
                    -7
                }
            })
        })
        .collect();
    let page_table =
        Tensor::<R::Runtime>::from_slice(&table, &[LENS.len(), TABLE[0].len()], device)
            .map_err(upload)?;
    let keys_over = |k, v| match source {
        Source::Cache => Keys::cache(k, v, &lengths),
        Source::Pages => Keys::paged(k, v, &page_table, &lengths),
        Source::Padded => Keys::padded(k, v, &q_lengths, &lengths),
        Source::Varlen => Keys::varlen(k, v, &cu_q, &cu_k),
        Source::PagesPacked => Keys::paged_packed(k, v, &page_table, &lengths, &cu_q),
    };
    let opts = &inputs.opts;
    let keys = keys_over(&kt, &vt);
    let y = attention(variant, &qt, keys, opts).map_err(err("attention"))?;
    let grads = Backward::new(&y, &dt).with_dlse(&dlse);
    let g =
        attention_backward(variant, &qt, keys, grads, opts).map_err(err("attention_backward"))?;
    let learned = |t: &[Option<Tensor<R::Runtime>>], what: &str| -> Result<Vec<Vec<f32>>, String> {
        t.iter()
            .enumerate()
            .map(|(slot, g)| {
                g.as_ref()
                    .map(host)
                    .ok_or_else(|| format!("{what}: no gradient for learnable slot {slot}"))
            })
            .collect()
    };
    let tensors = learned(&g.tensors, "attention_backward")?;

    let a = through_autograd::<R, V>(variant, &qt, keys, &y, (&dt, &dlse), opts)?;
    // Back into the layout of `p`.
    let (qd, vd) = (p.head_dim, p.head_dim_v);
    let unpack_q = |x: Vec<f32>, d| match source.packed_queries() {
        true => rows.unpack(&x, &q_lens, p.heads_q, d),
        false => x,
    };
    let unpack_k = |x: Vec<f32>, d| match source {
        Source::Varlen => rows.unpack_keys(&x, &LENS, d),
        _ => x,
    };
    // A row that sees nothing: -inf, or 0 for weights without an lse.
    let empty = <V::Host as crate::HostVariant>::WEIGHTS.lse(f32::NEG_INFINITY, 0.0);
    let unpack_lse = |x: Vec<f32>, empty| match source.packed_queries() {
        true if !x.is_empty() => rows.unpack_lse(&x, &q_lens, empty),
        _ => x,
    };
    Ok(BackendResults {
        fwd: Forward {
            out: unpack_q(host(&y.out), vd),
            lse: unpack_lse(host(&y.lse), empty),
            max_scores: unpack_lse(a.max_scores, f32::NEG_INFINITY),
        },
        grads: Gradients {
            dq: unpack_q(host(&g.dq), qd),
            dk: unpack_k(host(&g.dk), qd),
            dv: unpack_k(host(&g.dv), vd),
            tensors,
        },
        var_out: unpack_q(a.out, vd),
        var_grads: Gradients {
            dq: unpack_q(a.grads.dq, qd),
            dk: unpack_k(a.grads.dk, qd),
            dv: unpack_k(a.grads.dv, vd),
            tensors: a.grads.tensors,
        },
    })
}

/// `0, l0, l0 + l1, ..`: the `cu_seqlens` of `lens`.
fn offsets(lens: &[usize]) -> Vec<usize> {
    std::iter::once(0)
        .chain(lens.iter().scan(0, |s, &l| {
            *s += l;
            Some(*s)
        }))
        .collect()
}

/// Rows of a padded batch of `p` packed (FlashAttention's varlen layout:
/// `[total, H, dim]`, each sequence's first `lens[b]` rows) and back.
struct Rows {
    p: Problem,
}

impl Rows {
    fn new(p: &Problem) -> Self {
        Rows { p: *p }
    }

    fn total(&self, lens: &[usize]) -> usize {
        lens.iter().sum()
    }

    /// `[B, H, S, dim]` (`S` rows per sequence) to `[total, H, dim]`.
    fn pack_rows(&self, x: &[f32], lens: &[usize], (h, s, dim): (usize, usize, usize)) -> Vec<f32> {
        let total = self.total(lens);
        let mut out = vec![0.0; total * h * dim];
        let mut t0 = 0;
        for (b, &len) in lens.iter().enumerate() {
            for hh in 0..h {
                for i in 0..len {
                    let from = ((b * h + hh) * s + i) * dim;
                    let to = ((t0 + i) * h + hh) * dim;
                    out[to..to + dim].copy_from_slice(&x[from..from + dim]);
                }
            }
            t0 += len;
        }
        out
    }

    /// `[total, H, dim]` to `[B, H, S, dim]`, the rows past each
    /// sequence's own 0.
    fn unpack_rows(
        &self,
        x: &[f32],
        lens: &[usize],
        (h, s, dim): (usize, usize, usize),
    ) -> Vec<f32> {
        let mut out = vec![0.0; lens.len() * h * s * dim];
        let mut t0 = 0;
        for (b, &len) in lens.iter().enumerate() {
            for hh in 0..h {
                for i in 0..len {
                    let to = ((b * h + hh) * s + i) * dim;
                    let from = ((t0 + i) * h + hh) * dim;
                    out[to..to + dim].copy_from_slice(&x[from..from + dim]);
                }
            }
            t0 += len;
        }
        out
    }

    fn pack(&self, x: &[f32], lens: &[usize], h: usize, dim: usize) -> Vec<f32> {
        self.pack_rows(x, lens, (h, self.p.seq_q, dim))
    }

    fn unpack(&self, x: &[f32], lens: &[usize], h: usize, dim: usize) -> Vec<f32> {
        self.unpack_rows(x, lens, (h, self.p.seq_q, dim))
    }

    fn pack_keys(&self, x: &[f32], lens: &[usize], dim: usize) -> Vec<f32> {
        self.pack_rows(x, lens, (self.p.heads_kv, self.p.seq_k, dim))
    }

    fn unpack_keys(&self, x: &[f32], lens: &[usize], dim: usize) -> Vec<f32> {
        self.unpack_rows(x, lens, (self.p.heads_kv, self.p.seq_k, dim))
    }

    /// lse `[B, Hq, Sq]` to `[Hq, total]`.
    fn pack_lse(&self, x: &[f32], lens: &[usize]) -> Vec<f32> {
        let (h, s) = (self.p.heads_q, self.p.seq_q);
        let total = self.total(lens);
        let mut out = vec![0.0; h * total];
        let mut t0 = 0;
        for (b, &len) in lens.iter().enumerate() {
            for hh in 0..h {
                for i in 0..len {
                    out[hh * total + t0 + i] = x[(b * h + hh) * s + i];
                }
            }
            t0 += len;
        }
        out
    }

    /// lse `[Hq, total]` to `[B, Hq, Sq]`, the rows past each sequence's
    /// own `empty` (they see nothing).
    fn unpack_lse(&self, x: &[f32], lens: &[usize], empty: f32) -> Vec<f32> {
        let (h, s) = (self.p.heads_q, self.p.seq_q);
        let total = self.total(lens);
        let mut out = vec![empty; lens.len() * h * s];
        let mut t0 = 0;
        for (b, &len) in lens.iter().enumerate() {
            for hh in 0..h {
                for i in 0..len {
                    out[(b * h + hh) * s + i] = x[hh * total + t0 + i];
                }
            }
            t0 += len;
        }
        out
    }
}

/// Slot rows (`[B, Hkv, Sk, dim]`) as [`TABLE`]'s pages (`[PAGES, Hkv,
/// PAGE, dim]`); the spare pages NaN.
fn pages(slots: &[f32], p: &Problem, dim: usize) -> Vec<f32> {
    let h = p.heads_kv;
    let mut out = vec![f32::NAN; PAGES * h * PAGE * dim];
    for (b, row) in TABLE.iter().enumerate() {
        for (lp, &page) in row.iter().enumerate().filter(|(lp, _)| lp * PAGE < LENS[b]) {
            for hh in 0..h {
                let from = ((b * h + hh) * p.seq_k + lp * PAGE) * dim;
                let to = (page * h + hh) * PAGE * dim;
                out[to..to + PAGE * dim].copy_from_slice(&slots[from..from + PAGE * dim]);
            }
        }
    }
    out
}

/// Slot gradients (`[B, Hkv, Sk, dim]`) folded into [`TABLE`]'s pages: each
/// page row the sum of its readers' rows within their lengths, in sequence
/// order, 0 for spare pages.
fn fold(slots: &[f64], p: &Problem, dim: usize) -> Vec<f64> {
    let h = p.heads_kv;
    let mut out = vec![0.0; PAGES * h * PAGE * dim];
    for (b, row) in TABLE.iter().enumerate() {
        for (lp, &page) in row.iter().enumerate() {
            for hh in 0..h {
                for slot in 0..PAGE {
                    let j = lp * PAGE + slot;
                    if j >= LENS[b] {
                        continue;
                    }
                    let from = ((b * h + hh) * p.seq_k + j) * dim;
                    let to = ((page * h + hh) * PAGE + slot) * dim;
                    for d in 0..dim {
                        out[to + d] += slots[from + d];
                    }
                }
            }
        }
    }
    out
}

impl Inputs {
    /// Sequence `b`'s first `keys` keys and values are sequence `a`'s (a
    /// shared prefix).
    pub(crate) fn share_prefix(&mut self, p: &Problem, (a, b): (usize, usize), keys: usize) {
        let h = p.heads_kv;
        let [_, k, v, _] = self.slices_mut();
        for (x, dim) in [(k, p.head_dim), (v, p.head_dim_v)] {
            for hh in 0..h {
                let from = (a * h + hh) * p.seq_k * dim;
                let to = (b * h + hh) * p.seq_k * dim;
                x.copy_within(from..from + keys * dim, to);
            }
        }
    }

    /// NaN in the K rows and infinities in the V rows of every slot past
    /// its sequence's length: slots a cache never reads.
    pub(crate) fn poison_slots(&mut self, p: &Problem, lens: &[usize]) {
        let h = p.heads_kv;
        let [_, k, v, _] = self.slices_mut();
        for (x, dim, bad) in [(k, p.head_dim, f32::NAN), (v, p.head_dim_v, f32::INFINITY)] {
            for (row, slot) in x.chunks_mut(dim).enumerate() {
                if row % p.seq_k >= lens[row / (h * p.seq_k)] {
                    slot.fill(bad);
                }
            }
        }
    }
}
