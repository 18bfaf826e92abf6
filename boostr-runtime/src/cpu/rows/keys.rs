//! Where the keys and values of one call are, for every CPU kernel: one
//! type, [`KeyRows`], for keys in place (`[B, Hkv, Sk, ·]`, any strides, any
//! element type, fp8 with its scales), in a KV cache's slots (each sequence
//! its own length) and in pages (a page table).
//!
//! A kernel asks it for runs of rows ([`KeyRows::run`]: consecutive keys
//! of one (batch, kv head), never past a page), or for all of a head's
//! keys where they lie in place ([`KeyRows::head`]); the backward, which
//! visits each key tile once per query tile, reads paged keys gathered
//! into their sequences' slots ([`Gathered`]) and writes their gradients
//! back into pages ([`fold_pages`]).

use crate::cpu::aligned::{Aligned, Plain};
use crate::cpu::elem::Stored;
use crate::cpu::operand::{Operand, Rows};
use crate::problem::Problem;
use crate::shifted::{Cached, Packed, PackedWindow};
use crate::variant::HostVariant;
use rayon::prelude::*;

/// Where a KV cache's keys are, for [`forward_cache`](crate::cpu::forward_cache)
/// and [`backward`](crate::cpu::backward): each sequence's length, and its pages
/// (`None`: each sequence's keys in its own slots of `k [B, Hkv, Sk, D]`,
/// `v [B, Hkv, Sk, Dv]`).
#[derive(Clone, Copy, Debug)]
pub struct CacheLayout<'a> {
    /// Keys per sequence, each at most `Sk`: sequence `b` holds keys `0 ..
    /// lens[b]`, and its query row `i` sits at position `i + lens[b] − Sq`.
    pub lens: &'a [usize],
    /// Paged: `k [pages, Hkv, page_size, D]`, `v [pages, Hkv, page_size,
    /// Dv]` (see [`Pages`]).
    pub pages: Option<Pages<'a>>,
}

/// A paged cache's page table: logical key `j` of sequence `b` is in slot
/// `j % page_size` of page `table[b · max_pages + j / page_size]`, with
/// `p.seq_k = max_pages · page_size`.
#[derive(Clone, Copy, Debug)]
pub struct Pages<'a> {
    /// `[B, max_pages]` page indices.
    pub table: &'a [usize],
    /// Keys per page.
    pub page_size: usize,
}

impl<'a> CacheLayout<'a> {
    /// Sequence `b` holds keys `0 .. lens[b]` of its `Sk` slots of `k [B,
    /// Hkv, Sk, D]` and `v [B, Hkv, Sk, Dv]`.
    pub fn lengths(lens: &'a [usize]) -> Self {
        Self { lens, pages: None }
    }

    /// The CPU kernels' view of a call's key layout (`None`: keys in
    /// place, every sequence all of them).
    pub(crate) fn of<R: numr::runtime::Runtime>(
        layout: &crate::backend::KeyLayout<'a, R>,
    ) -> Option<Self> {
        let lens = layout.lengths()?.host;
        let pages = layout.pages().map(|t| Pages {
            table: t.host,
            page_size: t.page_size,
        });
        Some(CacheLayout { lens, pages })
    }
}

/// How a call's sequences sit in its rows, as the tile kernels see them
/// through a window ([`windowed`]).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Seqs<'a> {
    /// Every sequence has every row and key.
    Whole,
    /// Keys per sequence (a cache's, or pages'), the rows last-aligned.
    Cache(&'a [usize]),
    /// A right-padded batch: query rows and keys per sequence.
    Padded { q: &'a [usize], kv: &'a [usize] },
    /// Packed sequences in one row: the `cu_seqlens` of queries and keys.
    Packed { q: &'a [usize], kv: &'a [usize] },
}

impl<'a> Seqs<'a> {
    /// The sequences of a call's key layout.
    pub(crate) fn of<R: numr::runtime::Runtime>(layout: &crate::backend::KeyLayout<'a, R>) -> Self {
        use crate::backend::KeyLayout;
        match *layout {
            KeyLayout::Dense => Seqs::Whole,
            KeyLayout::Cache(l) | KeyLayout::Paged(l, _, None) => Seqs::Cache(l.host),
            KeyLayout::Paged(kv, _, Some(q)) => Seqs::Padded {
                q: q.host,
                kv: kv.host,
            },
            KeyLayout::Padded { q, kv } => Seqs::Padded {
                q: q.host,
                kv: kv.host,
            },
            KeyLayout::Varlen(map) => Seqs::Packed {
                q: map.q.host,
                kv: map.kv.host,
            },
        }
    }

    /// The sequences of a cache layout given to the CPU kernels directly.
    pub(crate) fn of_cache(cache: Option<CacheLayout<'a>>) -> Self {
        cache.map_or(Seqs::Whole, |c| Seqs::Cache(c.lens))
    }

    /// The problem the variant sees in a call of `p` over these sequences
    /// (its captured tensors are checked against it): `p`, but for packed
    /// sequences, `n` sequences of at most the longest one's rows and keys
    /// (as `KeyLayout::seen`).
    pub(crate) fn seen(self, p: &Problem) -> Problem {
        match self {
            Seqs::Packed { q, kv } => {
                let longest = |cu: &[usize]| {
                    let most = cu.windows(2).map(|w| w[1] - w[0]).max();
                    most.unwrap_or(0).max(1)
                };
                Problem {
                    batch: q.len().saturating_sub(1).max(1),
                    seq_q: longest(q),
                    seq_k: longest(kv),
                    ..*p
                }
            }
            _ => *p,
        }
    }

    /// Whether the decode kernel, which places each sequence's rows at its
    /// key count itself, runs these sequences (a padded batch's and packed
    /// sequences' rows go through the tile kernels' window).
    pub(crate) fn decodes(self) -> bool {
        matches!(self, Seqs::Whole | Seqs::Cache(_))
    }
}

/// A kernel run on a variant seen through a window.
pub(crate) trait OnHost {
    /// What the kernel returns.
    type Out;

    /// Run on `host`.
    fn run<H: HostVariant>(self, host: &H) -> Self::Out;
}

/// `kernel` on `host` as the call's sequences `seqs` place it: itself, or
/// through a [`Cached`] or [`Packed`] window.
pub(crate) fn windowed<H: HostVariant, K: OnHost>(
    host: &H,
    p: &Problem,
    seqs: Seqs<'_>,
    kernel: K,
) -> K::Out {
    match seqs {
        Seqs::Whole => kernel.run(host),
        Seqs::Cache(kv) => kernel.run(&Cached::new(host, p, (None, kv))),
        Seqs::Padded { q, kv } => kernel.run(&Cached::new(host, p, (Some(q), kv))),
        Seqs::Packed { q, kv } => kernel.run(&Packed {
            inner: host,
            window: PackedWindow::new(q, kv),
        }),
    }
}

/// The keys and values of one call as the kernels read them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KeyRows<'a> {
    /// `[B, Hkv, Sk, D]`, or `[pages, Hkv, page_size, D]`.
    pub(crate) k: Operand<'a>,
    /// As `k`, rows of `Dv`.
    pub(crate) v: Operand<'a>,
    /// Each sequence's keys (`None`: all `Sk`).
    lens: Option<&'a [usize]>,
    /// The page table, for pages.
    pages: Option<Paged<'a>>,
    seq_k: usize,
}

/// A page table with its row length.
#[derive(Clone, Copy, Debug)]
struct Paged<'a> {
    table: &'a [usize],
    page_size: usize,
    max_pages: usize,
}

impl<'a> KeyRows<'a> {
    /// Keys `k`, `v` in place: every sequence has all `p.seq_k`.
    pub(crate) fn dense(k: Operand<'a>, v: Operand<'a>, p: &Problem) -> Self {
        Self {
            k,
            v,
            lens: None,
            pages: None,
            seq_k: p.seq_k,
        }
    }

    /// Keys `k`, `v` of `p` laid out as `cache` says (in place without
    /// one).
    ///
    /// # Panics
    /// If a length or a page table disagrees with `p` or with the shapes:
    /// one length per sequence, each within `Sk`; whole pages; every page
    /// a length reaches a valid page (the ops check all of this first).
    pub(crate) fn new(
        k: Operand<'a>,
        v: Operand<'a>,
        cache: Option<CacheLayout<'a>>,
        p: &Problem,
    ) -> Self {
        let [h, d, dv] = [p.heads_kv, p.head_dim, p.head_dim_v];
        let Some(cache) = cache else {
            return Self::dense(k, v, p);
        };
        let lens = cache.lens;
        assert_eq!(lens.len(), p.batch, "one length per sequence");
        assert!(lens.iter().all(|&l| l <= p.seq_k), "lengths within Sk");
        let Some(Pages { table, page_size }) = cache.pages else {
            assert_eq!(k.shape(), [p.batch, h, p.seq_k, d], "k shape");
            assert_eq!(v.shape(), [p.batch, h, p.seq_k, dv], "v shape");
            return Self {
                lens: Some(lens),
                ..Self::dense(k, v, p)
            };
        };
        assert!(
            page_size > 0 && p.seq_k.is_multiple_of(page_size),
            "whole pages"
        );
        let pages = k.shape()[0];
        assert_eq!(k.shape(), [pages, h, page_size, d], "k pages");
        assert_eq!(v.shape(), [pages, h, page_size, dv], "v pages");
        let max_pages = p.seq_k / page_size;
        assert_eq!(
            table.len(),
            p.batch * max_pages,
            "a page table row per sequence"
        );
        for (b, &len) in lens.iter().enumerate() {
            let used = &table[b * max_pages..b * max_pages + len.div_ceil(page_size)];
            assert!(used.iter().all(|&page| page < pages), "valid pages");
        }
        Self {
            k,
            v,
            lens: Some(lens),
            pages: Some(Paged {
                table,
                page_size,
                max_pages,
            }),
            seq_k: p.seq_k,
        }
    }

    /// The keys sequence `b` holds.
    #[inline]
    pub(crate) fn len(&self, b: usize) -> usize {
        self.lens.map_or(self.seq_k, |l| l[b].min(self.seq_k))
    }

    /// K's and V's rows of keys `kv0 ..` of `(b, hkv)`: at most `cols` of
    /// them, and never past a page.
    #[inline]
    pub(crate) fn run(
        &self,
        b: usize,
        hkv: usize,
        kv0: usize,
        cols: usize,
    ) -> (Rows<'a>, Rows<'a>) {
        match self.pages {
            None => {
                let keys = kv0..kv0 + cols;
                (
                    self.k.at(b, hkv).sub(keys.clone()),
                    self.v.at(b, hkv).sub(keys),
                )
            }
            Some(Paged {
                table,
                page_size,
                max_pages,
            }) => {
                let (page, slot) = (kv0 / page_size, kv0 % page_size);
                let slots = slot..slot + cols.min(page_size - slot);
                let page = table[b * max_pages + page];
                (
                    self.k.at(page, hkv).sub(slots.clone()),
                    self.v.at(page, hkv).sub(slots),
                )
            }
        }
    }

    /// K's and V's rows of all `Sk` slots of `(b, hkv)`, where they are in
    /// place (`None` for pages).
    #[inline]
    pub(crate) fn head(&self, b: usize, hkv: usize) -> Option<(Rows<'a>, Rows<'a>)> {
        self.pages
            .is_none()
            .then(|| (self.k.at(b, hkv), self.v.at(b, hkv)))
    }

    /// `f(run of K, run of V, first key)` for each run of keys `keys` of
    /// `(b, hkv)`, in order.
    #[inline]
    pub(crate) fn each_run(
        &self,
        b: usize,
        hkv: usize,
        keys: std::ops::Range<usize>,
        mut f: impl FnMut(Rows<'a>, Rows<'a>, usize),
    ) {
        let mut at = keys.start;
        while at < keys.end {
            let (k, v) = self.run(b, hkv, at, keys.end - at);
            let n = k.len();
            f(k, v, at);
            at += n;
        }
    }
}

/// A paged cache's keys and values gathered into their sequences' slots,
/// `[B, Hkv, Sk, ·]` contiguous in `E` (the backward's element type), the
/// slots past each length zero (never read: the backward sees each
/// sequence's length).
pub(crate) struct Gathered<E: Plain> {
    pub(crate) k: Aligned<E>,
    pub(crate) v: Aligned<E>,
}

impl<E: Plain> Gathered<E> {
    /// `keys`' pages in slots, each element `read` from its stored form.
    pub(crate) fn new(keys: &KeyRows<'_>, p: &Problem, read: fn(Stored<'_>, &mut [E])) -> Self {
        let (d, dv, sk) = (p.head_dim, p.head_dim_v, p.seq_k);
        let mut k = Aligned::<E>::zeroed(p.k_len());
        let mut v = Aligned::<E>::zeroed(p.v_len());
        k.par_chunks_mut(sk * d)
            .zip(v.par_chunks_mut(sk * dv))
            .enumerate()
            .for_each(|(bkv, kv)| {
                keys.gather_head(bkv / p.heads_kv, bkv % p.heads_kv, kv, read);
            });
        Self { k, v }
    }
}

impl KeyRows<'_> {
    /// The keys and values of `(b, hkv)` into its sequence's slots, `k`
    /// (rows of `D`) and `v` (rows of `Dv`), contiguous, each element
    /// `read` from its stored form; the slots past its length are left as
    /// they are.
    pub(crate) fn gather_head<E>(
        &self,
        b: usize,
        hkv: usize,
        (k, v): (&mut [E], &mut [E]),
        read: fn(Stored<'_>, &mut [E]),
    ) {
        let (d, dv) = (self.k.dim(), self.v.dim());
        self.each_run(b, hkv, 0..self.len(b), |kr, vr, at| {
            for i in 0..kr.len() {
                read(kr.row(i), &mut k[(at + i) * d..(at + i + 1) * d]);
                read(vr.row(i), &mut v[(at + i) * dv..(at + i + 1) * dv]);
            }
        });
    }
}

/// The gradients of pages from those of their sequences' slots: `dense`
/// (`[B, Hkv, Sk, dim]`) into `pages` (`[pages, Hkv, page_size, dim]`),
/// each page's slot the sum, in sequence order, of the slots that read it
/// (a page shared by several sequences, a prefix, gets all of theirs), 0
/// where no sequence's length reaches it.
pub(crate) fn fold_pages(
    keys: &KeyRows<'_>,
    p: &Problem,
    dim: usize,
    dense: &[f32],
    pages: &mut [f32],
) {
    let Some(Paged {
        table,
        page_size,
        max_pages,
    }) = keys.pages
    else {
        unreachable!("only pages fold");
    };
    let (h, sk) = (p.heads_kv, p.seq_k);
    // Per page, the (sequence, logical page) that read it, in order.
    let n_pages = pages.len() / (h * page_size * dim).max(1);
    let mut readers: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n_pages];
    for b in 0..p.batch {
        for lp in 0..keys.len(b).div_ceil(page_size) {
            readers[table[b * max_pages + lp]].push((b, lp));
        }
    }
    pages
        .par_chunks_mut(h * page_size * dim)
        .zip(readers.par_iter())
        .for_each(|(page, readers)| {
            page.fill(0.0);
            for &(b, lp) in readers {
                for hkv in 0..h {
                    for slot in 0..page_size {
                        let j = lp * page_size + slot;
                        if j >= keys.len(b) {
                            break;
                        }
                        let src = &dense[((b * h + hkv) * sk + j) * dim..][..dim];
                        let dst = &mut page[(hkv * page_size + slot) * dim..][..dim];
                        crate::cpu::math::add_assign(dst, src);
                    }
                }
            }
        });
}
