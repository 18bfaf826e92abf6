//! The key layouts of the generated tests: every variant's KV cache and
//! paged ops, forward and backward, on each backend, against the f64
//! reference of each sequence at its own length (the reference through
//! [`Cached`], the positions and mask a cache gives the kernels).
//!
//! One batch of three sequences, of 0, 29 and 48 keys in 48 slots: an
//! empty one, one that ends inside a page, one that fills its slots. Their
//! spare slots hold NaN and infinities. As pages of 16 in shuffled order,
//! the last two sequences share their first page (a common prefix: their
//! first 16 keys are the same), with spare pages of NaN and garbage in the
//! table entries no length reaches; each page's gradient must be the sum of
//! its readers'.

use super::backends::TestBackend;
use super::cases::{Case, Logits};
use super::data::TestData;
use super::inputs::{Expected, Inputs};
use super::report::CaseReport;
use super::tolerance::{Layout, NAIVE_FACTOR, compare};
use crate::op::{
    KvCache, PagedKvCache, attention_bwd_cache, attention_bwd_paged, attention_fwd_cache,
    attention_fwd_paged,
};
use crate::shifted::Cached;
use crate::validate;
use crate::variant::{HostVariant as _, Variant};
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// Each sequence's keys.
const LENS: [usize; 3] = [0, 29, 48];
/// Keys per page.
const PAGE: usize = 16;

/// The shapes the layouts are checked on: a decode block (the CPU's decode
/// kernel) and a prefill block of more rows than keys in some sequences
/// (the tile kernels over a cache). At the head dims of
/// [`SMALL_CASES`](super::SMALL_CASES), 80/56, whose pipelines a GPU
/// backend has built for them already (a software adapter spends most of
/// a check compiling).
pub(crate) const LAYOUT_CASES: &[Case] = &[
    layout_case(5, "cache, 5 rows"),
    layout_case(37, "cache, 37 rows"),
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

/// Check `R`'s cache and paged ops for the variant `build` makes, on
/// `case` (one of [`LAYOUT_CASES`]).
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
    inputs.share_prefix(&p, (1, 2), PAGE);
    inputs.poison_slots(&p, &LENS);
    // The cache and page ops take no `dlse`.
    inputs.dlse.fill(0.0);
    let p = match validate::call(&variant, p, &inputs.opts) {
        Ok(p) => p,
        Err(e) => return CaseReport::error(format!("{}: {e}", V::NAME)),
    };
    let host = match variant.host_copy(&p) {
        Ok(host) => host,
        Err(e) => return CaseReport::error(format!("{}::host: {e}", V::NAME)),
    };
    let cached = Cached::new(&host, &p, &LENS);
    let want = Expected::reference(&cached, &p, &inputs, Vec::new());
    if let Some(e) = host.out_of_range() {
        return CaseReport::new(Vec::new(), format!("skipped (reads out of range: {e})"));
    }
    let got = match run_layouts::<R, V>(&variant, device, &p, &inputs) {
        Ok(got) => got,
        Err(e) => return CaseReport::error(e),
    };
    let mut failures = Vec::new();
    let mut summary = String::new();
    let mut check = |label: &str, layout, got: &[f32], want: &[f64], naive: &[f32], m: f64| {
        let c = compare(NAIVE_FACTOR, label, layout, &p, got, want, naive, m);
        failures.extend(c.failures);
        summary.push_str(&format!("{label} {:.1e}/{:.1e} ", c.err, c.bound));
    };
    let [m_out, m_dq, m_dk, m_dv] = want.magnitudes;
    let (wf, wg, nf, ng) = (&want.fwd, &want.grads, &want.naive_fwd, &want.naive_grads);
    let (q_, o_) = (Layout::Query(p.head_dim), Layout::Query(p.head_dim_v));
    let (k_, v_) = (Layout::Key(p.head_dim), Layout::Key(p.head_dim_v));
    for (name, r) in [("cache", &got.cache), ("pages", &got.paged)] {
        check(&format!("{name} out"), o_, &r.out, &wf.out, &nf.out, m_out);
        check(
            &format!("{name} lse"),
            Layout::Lse,
            &r.lse,
            &wf.lse,
            &nf.lse,
            0.0,
        );
        check(&format!("{name} dq"), q_, &r.dq, &wg.dq, &ng.dq, m_dq);
    }
    check("cache dk", k_, &got.cache.dk, &wg.dk, &ng.dk, m_dk);
    check("cache dv", v_, &got.cache.dv, &wg.dv, &ng.dv, m_dv);
    // A page's gradient is its readers' sum: up to twice a slot's terms.
    let (dk_pages, dv_pages) = (fold(&wg.dk, &p, p.head_dim), fold(&wg.dv, &p, p.head_dim_v));
    let naive = |x: &[f32], dim| -> Vec<f32> {
        let wide: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        fold(&wide, &p, dim).iter().map(|&v| v as f32).collect()
    };
    let (nk, nv) = (naive(&ng.dk, p.head_dim), naive(&ng.dv, p.head_dim_v));
    check(
        "pages dk",
        Layout::Flat,
        &got.paged.dk,
        &dk_pages,
        &nk,
        2.0 * m_dk,
    );
    check(
        "pages dv",
        Layout::Flat,
        &got.paged.dv,
        &dv_pages,
        &nv,
        2.0 * m_dv,
    );
    CaseReport::new(failures, summary)
}

/// One layout's results, host side: `dk` and `dv` as the keys are laid
/// out (slots, or pages).
struct LayoutResults {
    out: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// The cache's and the pages' results.
struct Results {
    cache: LayoutResults,
    paged: LayoutResults,
}

/// `R`'s cache and paged ops on `inputs` (the slots of a cache of `p`).
fn run_layouts<R: TestBackend, V: Variant>(
    variant: &V,
    device: &<R::Runtime as Runtime>::Device,
    p: &crate::Problem,
    inputs: &Inputs,
) -> Result<Results, String> {
    let [q, k, v, dout] = inputs.slices();
    let upload = |e: numr::error::Error| format!("uploading an input: {e}");
    let f32s = |data: &[f32], shape: &[usize]| {
        Tensor::<R::Runtime>::from_slice(data, shape, device).map_err(upload)
    };
    let i32s = |data: &[i32], shape: &[usize]| {
        Tensor::<R::Runtime>::from_slice(data, shape, device).map_err(upload)
    };
    let host = |t: &Tensor<R::Runtime>| t.to_vec::<f32>();
    let err = |what: &'static str| move |e: crate::Error| format!("{what}: {e}");
    let (qt, dt) = (f32s(q, &p.q_shape())?, f32s(dout, &p.out_shape())?);
    let (kt, vt) = (f32s(k, &p.k_shape())?, f32s(v, &p.v_shape())?);
    let lens: Vec<i32> = LENS.iter().map(|&l| l as i32).collect();
    let lengths = i32s(&lens, &[LENS.len()])?;
    let opts = &inputs.opts;
    let cache = KvCache {
        k: &kt,
        v: &vt,
        lengths: &lengths,
        scales: None,
    };
    let (out, lse) =
        attention_fwd_cache(variant, &qt, &cache, opts).map_err(err("attention_fwd_cache"))?;
    let (dq, dk, dv) = attention_bwd_cache(variant, &dt, &qt, &cache, &out, &lse, opts)
        .map_err(err("attention_bwd_cache"))?;
    let cached = LayoutResults {
        out: host(&out),
        lse: host(&lse),
        dq: host(&dq),
        dk: host(&dk),
        dv: host(&dv),
    };
    let (kp, vp) = (pages(k, p, p.head_dim), pages(v, p, p.head_dim_v));
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
    let (kp, vp) = (
        f32s(&kp, &[PAGES, p.heads_kv, PAGE, p.head_dim])?,
        f32s(&vp, &[PAGES, p.heads_kv, PAGE, p.head_dim_v])?,
    );
    let page_table = i32s(&table, &[LENS.len(), TABLE[0].len()])?;
    let paged = PagedKvCache {
        k_pages: &kp,
        v_pages: &vp,
        page_table: &page_table,
        lengths: &lengths,
        scales: None,
    };
    let (out, lse) =
        attention_fwd_paged(variant, &qt, &paged, opts).map_err(err("attention_fwd_paged"))?;
    let (dq, dk, dv) = attention_bwd_paged(variant, &dt, &qt, &paged, &out, &lse, opts)
        .map_err(err("attention_bwd_paged"))?;
    Ok(Results {
        cache: cached,
        paged: LayoutResults {
            out: host(&out),
            lse: host(&lse),
            dq: host(&dq),
            dk: host(&dk),
            dv: host(&dv),
        },
    })
}

/// Slot rows (`[B, Hkv, Sk, dim]`) as [`TABLE`]'s pages (`[PAGES, Hkv,
/// PAGE, dim]`); the spare pages NaN.
fn pages(slots: &[f32], p: &crate::Problem, dim: usize) -> Vec<f32> {
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
fn fold(slots: &[f64], p: &crate::Problem, dim: usize) -> Vec<f64> {
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
    pub(crate) fn share_prefix(&mut self, p: &crate::Problem, (a, b): (usize, usize), keys: usize) {
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
    pub(crate) fn poison_slots(&mut self, p: &crate::Problem, lens: &[usize]) {
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
