//! A variant seen from a call whose positions are not the variant's own.
//!
//! The tile kernels count positions from the start of their call: query
//! row `i` at `i + Sk − Sq`, key `j` at `j`, every pair visible but for
//! the variant's mask. Several kinds of call see the variant's sequences
//! from elsewhere, and all of them reach it through [`Shifted`]:
//!
//! - a KV cache or a right-padded batch ([`SeqWindow`]): sequence `b`'s
//!   rows sit at its own lengths, so every query position moves by a
//!   per-sequence shift, and the spare slots (and a padded batch's spare
//!   rows) are hidden;
//! - packed sequences ([`PackedWindow`]): one long row of the kernels
//!   holding every sequence, each row and key moved to its sequence (the
//!   variant's batch) and its position in it, pairs of two sequences
//!   hidden;
//! - one call of a ring ([`RingWindow`](crate::ring)): a chunk of queries
//!   against a chunk of keys somewhere in a longer sequence, whose
//!   positions move forward to the global ones, and whose rows carry the
//!   sink in one call only.
//!
//! Every function of the variant is called at the moved batch and
//! positions; the tile classifier sees the moved tile (a tile the window
//! hides entirely is `Empty`, one it hides in part `Partial`); the dropout
//! draw is keyed by [`dropout_site`](HostVariant::dropout_site), so a pair
//! drops alike however it is reached.

use crate::variant::{HostVariant, TileClass, Weights};
use std::ops::Deref;

/// A tile of a call as the variant sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tile {
    /// The window hides every pair of the tile.
    Hidden,
    /// Every row of the tile is in the variant's batch `b`, at positions
    /// `q`, and every key at `kv` (inclusive ranges); `whole`: the window
    /// shows every pair (else some only).
    Seen {
        b: i32,
        q: (i32, i32),
        kv: (i32, i32),
        whole: bool,
    },
    /// Rows or keys of the tile lie in different batches of the variant
    /// (packed sequences): some pairs may be shown.
    Mixed,
}

/// Where a call sits in the variant's sequences. Positions are the
/// call's: query row `i` at `i + Sk − Sq`, key `j` at `j`.
pub(crate) trait Window: Send + Sync {
    /// The window hides some pairs from the kernels (spare keys or rows,
    /// pairs of two sequences): the call then has a mask.
    const HIDES: bool;
    /// The rows of one tile may lie in different sequences of the variant
    /// (packed sequences): a tile's diagonal is then no one difference of
    /// positions.
    const MOVES_ROWS: bool = false;

    /// The variant's batch and query position of the call's row at `q` in
    /// batch `b`.
    fn row(&self, b: i32, q: i32) -> (i32, i32);

    /// What the variant's key positions are ahead of the call's, for that
    /// row.
    fn key_shift(&self, b: i32, q: i32) -> i32;

    /// Whether the window shows the pair (a hidden pair is invisible
    /// whatever the variant says).
    fn shows(&self, b: i32, q: i32, kv: i32) -> bool {
        let _ = (b, q, kv);
        true
    }

    /// Whether the call's row at `q` is one of the variant's (a padded
    /// batch's spare rows are not: they see nothing and carry no sink).
    fn has_row(&self, b: i32, q: i32) -> bool {
        let _ = (b, q);
        true
    }

    /// The tile `q.0 ..= q.1` × `kv.0 ..= kv.1` of batch `b` as the
    /// variant sees it.
    fn tile(&self, b: i32, q: (i32, i32), kv: (i32, i32)) -> Tile;

    /// Whether the call's rows carry the variant's sink.
    fn carries_sink(&self) -> bool {
        true
    }
}

/// Sequences in padded slots and rows: a KV cache (each sequence's keys in
/// the first `len[b]` of the `Sk` slots, its query rows the last
/// positions) or a right-padded batch (also each sequence's query rows the
/// first `q_len[b]` of the `Sq`, row `i` at `i + len[b] − q_len[b]`).
pub(crate) struct SeqWindow {
    /// Per sequence, what the variant's query positions are ahead of the
    /// call's.
    shift: Vec<i32>,
    /// Per sequence, the call's position of its first spare row
    /// (`i32::MAX` for a cache).
    q_end: Vec<i32>,
    /// Per sequence, its keys.
    kv_end: Vec<i32>,
}

impl SeqWindow {
    /// `p.batch` sequences of `kv_lens` keys in `p.seq_k` slots, of
    /// `q_lens` query rows in `p.seq_q` where given (a padded batch), else
    /// every row, last-aligned (a cache).
    ///
    /// # Panics
    /// If a length is past its slots or rows (the ops validate them).
    pub(crate) fn new(p: &crate::Problem, q_lens: Option<&[usize]>, kv_lens: &[usize]) -> Self {
        assert_eq!(kv_lens.len(), p.batch, "one length per sequence");
        let i32_of = |x: usize| i32::try_from(x).expect("lengths fit i32");
        let (sq, sk) = (i32_of(p.seq_q), i32_of(p.seq_k));
        let mut w = SeqWindow {
            shift: Vec::with_capacity(p.batch),
            q_end: Vec::with_capacity(p.batch),
            kv_end: Vec::with_capacity(p.batch),
        };
        for (b, &kv) in kv_lens.iter().enumerate() {
            assert!(kv <= p.seq_k, "lengths within Sk");
            let kv = i32_of(kv);
            // The call's row i is at i + Sk − Sq; the variant's at i + kv −
            // (its rows: Sq for a cache, q_len for a padded batch).
            let (rows, end) = match q_lens {
                Some(q) => {
                    assert!(q[b] <= p.seq_q, "query lengths within Sq");
                    let rows = i32_of(q[b]);
                    (rows, rows + sk - sq)
                }
                None => (sq, i32::MAX),
            };
            w.shift.push((kv - rows) - (sk - sq));
            w.q_end.push(end);
            w.kv_end.push(kv);
        }
        w
    }
}

impl Window for SeqWindow {
    const HIDES: bool = true;

    #[inline(always)]
    fn row(&self, b: i32, q: i32) -> (i32, i32) {
        (b, q + self.shift[b as usize])
    }

    #[inline(always)]
    fn key_shift(&self, _: i32, _: i32) -> i32 {
        0
    }

    #[inline(always)]
    fn shows(&self, b: i32, q: i32, kv: i32) -> bool {
        kv < self.kv_end[b as usize] && q < self.q_end[b as usize]
    }

    #[inline(always)]
    fn has_row(&self, b: i32, q: i32) -> bool {
        q < self.q_end[b as usize]
    }

    #[inline]
    fn tile(&self, b: i32, q: (i32, i32), kv: (i32, i32)) -> Tile {
        let (q_end, kv_end) = (self.q_end[b as usize], self.kv_end[b as usize]);
        if kv.0 >= kv_end || q.0 >= q_end {
            return Tile::Hidden;
        }
        let shift = self.shift[b as usize];
        Tile::Seen {
            b,
            q: (q.0 + shift, q.1 + shift),
            kv,
            whole: kv.1 < kv_end && q.1 < q_end,
        }
    }
}

/// Packed sequences as one row of the kernels (`B = 1`): query row `t`
/// and key `u` belong to the sequences their `cu_seqlens` place them in,
/// and a sequence's rows see its own keys only, the variant seeing batch
/// `b` (the sequence) at the sequence's own positions, bottom-right
/// aligned (row `i` at `i + len_k − len_q`).
pub(crate) struct PackedWindow {
    /// Per query row, its sequence.
    seq_q: Vec<i32>,
    /// Per key, its sequence.
    seq_k: Vec<i32>,
    /// Per sequence, the call's position of its first query row minus the
    /// variant's position of it.
    q_ahead: Vec<i32>,
    /// Per sequence, its first key.
    kv_start: Vec<i32>,
    /// The call's position of query row 0: `Sk − Sq` of the packed call.
    base: i32,
}

impl PackedWindow {
    /// The sequences of `cu_q` and `cu_k` (`n + 1` offsets each, validated:
    /// from 0, non-decreasing).
    pub(crate) fn new(cu_q: &[usize], cu_k: &[usize]) -> Self {
        let i32_of = |x: usize| i32::try_from(x).expect("offsets fit i32");
        let owners = |cu: &[usize]| -> Vec<i32> {
            let mut out = Vec::with_capacity(cu.last().copied().unwrap_or(0));
            for (s, w) in cu.windows(2).enumerate() {
                out.extend(std::iter::repeat_n(i32_of(s), w[1] - w[0]));
            }
            out
        };
        let (tq, tk) = (
            cu_q.last().copied().unwrap_or(0),
            cu_k.last().copied().unwrap_or(0),
        );
        let base = i32_of(tk) - i32_of(tq);
        let q_ahead = cu_q
            .windows(2)
            .zip(cu_k.windows(2))
            .map(|(q, k)| {
                // Row i of the sequence: the call's position base + q[0] +
                // i, the variant's i + len_k − len_q.
                let own = i32_of(k[1] - k[0]) - i32_of(q[1] - q[0]);
                base + i32_of(q[0]) - own
            })
            .collect();
        PackedWindow {
            seq_q: owners(cu_q),
            seq_k: owners(cu_k),
            q_ahead,
            kv_start: cu_k[..cu_k.len() - 1].iter().map(|&x| i32_of(x)).collect(),
            base,
        }
    }

    /// The sequence of the call's query row at position `q`.
    #[inline(always)]
    fn seq_of_row(&self, q: i32) -> i32 {
        let t = (q - self.base).clamp(0, self.seq_q.len() as i32 - 1);
        self.seq_q[t as usize]
    }

    /// The sequence of key `kv`.
    #[inline(always)]
    fn seq_of_key(&self, kv: i32) -> i32 {
        let u = kv.clamp(0, self.seq_k.len() as i32 - 1);
        self.seq_k[u as usize]
    }
}

impl Window for PackedWindow {
    const HIDES: bool = true;
    const MOVES_ROWS: bool = true;

    #[inline(always)]
    fn row(&self, _: i32, q: i32) -> (i32, i32) {
        let s = self.seq_of_row(q);
        (s, q - self.q_ahead[s as usize])
    }

    #[inline(always)]
    fn key_shift(&self, _: i32, q: i32) -> i32 {
        -self.kv_start[self.seq_of_row(q) as usize]
    }

    #[inline(always)]
    fn shows(&self, _: i32, q: i32, kv: i32) -> bool {
        self.seq_of_key(kv) == self.seq_of_row(q)
    }

    #[inline]
    fn tile(&self, _: i32, q: (i32, i32), kv: (i32, i32)) -> Tile {
        let (r0, r1) = (self.seq_of_row(q.0), self.seq_of_row(q.1));
        let (k0, k1) = (self.seq_of_key(kv.0), self.seq_of_key(kv.1));
        if r1 < k0 || k1 < r0 {
            return Tile::Hidden;
        }
        if r0 != r1 || k0 != k1 {
            return Tile::Mixed;
        }
        let (ahead, start) = (self.q_ahead[r0 as usize], self.kv_start[r0 as usize]);
        Tile::Seen {
            b: r0,
            q: (q.0 - ahead, q.1 - ahead),
            kv: (kv.0 - start, kv.1 - start),
            whole: true,
        }
    }
}

/// `inner`, reached through `window`. `I` is a reference to the variant
/// or a box that owns it.
pub(crate) struct Shifted<I, W> {
    pub inner: I,
    pub window: W,
}

/// A KV cache or padded batch over `inner`: the tile kernels run over
/// sequences of their own lengths unchanged.
pub(crate) type Cached<'a, V> = Shifted<&'a V, SeqWindow>;

/// Packed sequences over `inner`.
pub(crate) type Packed<'a, V> = Shifted<&'a V, PackedWindow>;

impl<'a, V: HostVariant> Cached<'a, V> {
    /// `inner` over `p.batch` sequences of `kv_lens` keys in `p.seq_k`
    /// slots (and `q_lens` rows in `p.seq_q`, for a padded batch).
    pub(crate) fn new(
        inner: &'a V,
        p: &crate::Problem,
        (q_lens, kv_lens): (Option<&[usize]>, &[usize]),
    ) -> Self {
        Shifted {
            inner,
            window: SeqWindow::new(p, q_lens, kv_lens),
        }
    }
}

impl<I, W> Shifted<I, W>
where
    I: Deref + Send + Sync,
    I::Target: HostVariant,
    W: Window,
{
    /// The variant's batch, query and key positions of a pair.
    #[inline(always)]
    fn at(&self, b: i32, q: i32, kv: i32) -> (i32, i32, i32) {
        let (b2, q2) = self.window.row(b, q);
        (b2, q2, kv + self.window.key_shift(b, q))
    }

    /// The row carries the variant's sink.
    #[inline(always)]
    fn sinks(&self, b: i32, q: i32) -> bool {
        self.window.carries_sink() && self.window.has_row(b, q)
    }

    /// Whether the variant's functions are defined at the pair. The
    /// kernels evaluate `score` across whole tiles and discard it where a
    /// pair is hidden; a window that moves rows would hand the variant a
    /// key of another sequence there, at a position outside its own (and
    /// outside the tensors its reads are proved in range for), so such a
    /// pair never reaches it.
    #[inline(always)]
    fn defined(&self, b: i32, q: i32, kv: i32) -> bool {
        !W::MOVES_ROWS || self.window.shows(b, q, kv)
    }
}

impl<I, W> HostVariant for Shifted<I, W>
where
    I: Deref + Send + Sync,
    I::Target: HostVariant,
    W: Window,
{
    const NAME: &'static str = <I::Target as HostVariant>::NAME;
    const SCORE_IS_IDENTITY: bool = <I::Target as HostVariant>::SCORE_IS_IDENTITY;
    const HAS_MASK: bool = W::HIDES || <I::Target as HostVariant>::HAS_MASK;
    const SCORE_GRAD_IS_ONE: bool = <I::Target as HostVariant>::SCORE_GRAD_IS_ONE;
    const SCORE_GRAD_GIVEN: bool = <I::Target as HostVariant>::SCORE_GRAD_GIVEN;
    const WEIGHTS: Weights = <I::Target as HostVariant>::WEIGHTS;
    const SCORE_CHECKS_READS: bool = <I::Target as HostVariant>::SCORE_CHECKS_READS;
    const LEARNABLE: usize = <I::Target as HostVariant>::LEARNABLE;
    const SCORE_READS_LEARNABLE: bool = <I::Target as HostVariant>::SCORE_READS_LEARNABLE;
    // The shifts are constant over a sequence, so a function of `kv − q`
    // stays one, unless a tile's rows lie in several sequences.
    const SCORE_GRADS_BY_DIFFERENCE: bool =
        <I::Target as HostVariant>::SCORE_GRADS_BY_DIFFERENCE && !W::MOVES_ROWS;

    #[inline(always)]
    fn score(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 {
        if !self.defined(b, q, kv) {
            return s;
        }
        let (b, q, kv) = self.at(b, q, kv);
        self.inner.score(s, b, h, q, kv)
    }

    #[inline(always)]
    fn score_grad(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 {
        if !self.defined(b, q, kv) {
            return 1.0;
        }
        let (b, q, kv) = self.at(b, q, kv);
        self.inner.score_grad(s, b, h, q, kv)
    }

    #[inline(always)]
    fn mask(&self, b: i32, h: i32, q: i32, kv: i32) -> bool {
        let shown = !W::HIDES || self.window.shows(b, q, kv);
        shown
            && (!<I::Target as HostVariant>::HAS_MASK || {
                let (b, q, kv) = self.at(b, q, kv);
                self.inner.mask(b, h, q, kv)
            })
    }

    #[inline]
    fn classify_tile(
        &self,
        b: i32,
        h: i32,
        q_lo: i32,
        q_hi: i32,
        kv_lo: i32,
        kv_hi: i32,
    ) -> TileClass {
        let (vb, (q_lo, q_hi), (kv_lo, kv_hi), whole) =
            match self.window.tile(b, (q_lo, q_hi), (kv_lo, kv_hi)) {
                Tile::Hidden => return TileClass::Empty,
                Tile::Mixed => return TileClass::Partial,
                Tile::Seen { b, q, kv, whole } => (b, q, kv, whole),
            };
        let inner = if <I::Target as HostVariant>::HAS_MASK {
            self.inner.classify_tile(vb, h, q_lo, q_hi, kv_lo, kv_hi)
        } else {
            TileClass::Full
        };
        match inner {
            TileClass::Full if !whole => TileClass::Partial,
            class => class,
        }
    }

    fn score_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 {
        if !self.defined(b, q, kv) {
            return s;
        }
        let (b, q, kv) = self.at(b, q, kv);
        self.inner.score_f64(s, b, h, q, kv)
    }

    fn score_grad_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 {
        if !self.defined(b, q, kv) {
            return 1.0;
        }
        let (b, q, kv) = self.at(b, q, kv);
        self.inner.score_grad_f64(s, b, h, q, kv)
    }

    fn mask_exact(&self, b: i32, h: i32, q: i32, kv: i32) -> bool {
        let shown = !W::HIDES || self.window.shows(b, q, kv);
        shown
            && (!<I::Target as HostVariant>::HAS_MASK || {
                let (b, q, kv) = self.at(b, q, kv);
                self.inner.mask_exact(b, h, q, kv)
            })
    }

    #[inline(always)]
    fn dropout_site(&self, b: i32, q: i32) -> (i32, i32, i32) {
        let (vb, vq) = self.window.row(b, q);
        let (ib, iq, ik) = self.inner.dropout_site(vb, vq);
        (ib, iq, ik + self.window.key_shift(b, q))
    }

    fn sink(&self, b: i32, h: i32, q: i32) -> f32 {
        if self.sinks(b, q) {
            let (b, q) = self.window.row(b, q);
            self.inner.sink(b, h, q)
        } else {
            f32::NEG_INFINITY
        }
    }

    fn sink_f64(&self, b: i32, h: i32, q: i32) -> f64 {
        if self.sinks(b, q) {
            let (b, q) = self.window.row(b, q);
            self.inner.sink_f64(b, h, q)
        } else {
            f64::NEG_INFINITY
        }
    }

    fn learnable_numel(&self, slot: usize) -> usize {
        self.inner.learnable_numel(slot)
    }

    #[inline(always)]
    fn score_tensor_grads(
        &self,
        s: f32,
        b: i32,
        h: i32,
        q: i32,
        kv: i32,
        dz: f32,
        grads: &mut [&mut [f32]],
    ) {
        if !self.defined(b, q, kv) {
            return;
        }
        let (b, q, kv) = self.at(b, q, kv);
        self.inner.score_tensor_grads(s, b, h, q, kv, dz, grads);
    }

    fn score_tensor_grads_f64(
        &self,
        s: f64,
        b: i32,
        h: i32,
        q: i32,
        kv: i32,
        dz: f64,
        abs: bool,
        grads: &mut [&mut [f64]],
    ) {
        if !self.defined(b, q, kv) {
            return;
        }
        let (b, q, kv) = self.at(b, q, kv);
        self.inner
            .score_tensor_grads_f64(s, b, h, q, kv, dz, abs, grads);
    }

    fn sink_tensor_grads(&self, b: i32, h: i32, q: i32, dz: f32, grads: &mut [&mut [f32]]) {
        if self.sinks(b, q) {
            let (b, q) = self.window.row(b, q);
            self.inner.sink_tensor_grads(b, h, q, dz, grads);
        }
    }

    fn sink_tensor_grads_f64(
        &self,
        b: i32,
        h: i32,
        q: i32,
        dz: f64,
        abs: bool,
        grads: &mut [&mut [f64]],
    ) {
        if self.sinks(b, q) {
            let (b, q) = self.window.row(b, q);
            self.inner.sink_tensor_grads_f64(b, h, q, dz, abs, grads);
        }
    }

    fn out_of_range(&self) -> Option<crate::Error> {
        self.inner.out_of_range()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_padded_batch_places_each_sequence_at_its_own_lengths() {
        // Sq = 4, Sk = 6: the call's row i at i + 2.
        let p = crate::Problem::new(2, (1, 1), (4, 6), 8);
        let w = SeqWindow::new(&p, Some(&[3, 0]), &[5, 2]);
        // Sequence 0: row i at i + 5 − 3 = i + 2, rows 3.. spare.
        assert_eq!(w.row(0, 2), (0, 2));
        assert!(w.has_row(0, 4) && !w.has_row(0, 5));
        assert!(w.shows(0, 4, 4) && !w.shows(0, 4, 5) && !w.shows(0, 5, 0));
        // Sequence 1 has no rows: every tile is hidden.
        assert_eq!(w.tile(1, (2, 5), (0, 5)), Tile::Hidden);
        assert_eq!(
            w.tile(0, (2, 5), (0, 3)),
            Tile::Seen {
                b: 0,
                q: (2, 5),
                kv: (0, 3),
                whole: false
            }
        );
        // A cache: every row, last-aligned to the length.
        let c = SeqWindow::new(&p, None, &[5, 2]);
        assert_eq!(c.row(1, 2), (1, -2));
        assert!(c.has_row(1, 5));
    }

    #[test]
    fn packed_sequences_move_rows_and_keys_to_their_sequences() {
        // Queries 2, 0, 3 rows; keys 3, 1, 3: totals 5 and 7, row t at t + 2.
        let w = PackedWindow::new(&[0, 2, 2, 5], &[0, 3, 4, 7]);
        // Row 0 of sequence 0 (call position 2) at 0 + 3 − 2 = 1.
        assert_eq!(w.row(0, 2), (0, 1));
        assert_eq!(w.key_shift(0, 2), 0);
        // Row 1 of sequence 2 (t = 3, call position 5) at 1 + 3 − 3 = 1,
        // its keys from 4.
        assert_eq!(w.row(0, 5), (2, 1));
        assert_eq!(w.key_shift(0, 5), -4);
        assert!(w.shows(0, 5, 4) && !w.shows(0, 5, 3));
        assert_eq!(w.tile(0, (2, 3), (4, 6)), Tile::Hidden);
        assert_eq!(w.tile(0, (3, 5), (0, 6)), Tile::Mixed);
        assert_eq!(
            w.tile(0, (5, 6), (4, 5)),
            Tile::Seen {
                b: 2,
                q: (1, 2),
                kv: (0, 1),
                whole: true
            }
        );
    }
}
