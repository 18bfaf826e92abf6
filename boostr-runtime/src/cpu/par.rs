//! Rayon's parallel loops with the loop body behind a trait object.
//!
//! A kernel's loop body is generic over the variant, and rayon's splitting,
//! joining and job code is generic over the body's closure type. Handed a
//! closure, every parallel loop of every kernel copies all of that code
//! once per variant: in a test build with a few dozen variants, rayon's
//! machinery was nearly half of the crate's LLVM IR (measured with
//! `cargo llvm-lines`). Handed `&dyn Fn`, rayon is instantiated once per
//! loop shape (what it iterates over), whatever the variant; the body is
//! still compiled once per variant, with the variant's functions inlined
//! into it. The price is one indirect call per chunk of work, which is
//! nothing next to a chunk.

use rayon::iter::{IndexedParallelIterator, ParallelIterator};

/// [`ParallelIterator::for_each`], [`ParallelIterator::for_each_init`] and
/// `map(..).collect()` with the body as a trait object (see the module docs). The closure's
/// argument types are inferred from the iterator's items.
pub(crate) trait ForEachDyn: ParallelIterator {
    /// `body` for every item, in parallel.
    fn for_each_dyn(self, body: &(dyn Fn(Self::Item) + Sync)) {
        self.for_each(body);
    }

    /// `body` for every item, in parallel, with a scratch value made by
    /// `init` once per rayon job (not per item).
    fn for_each_init_dyn<S>(
        self,
        init: &(dyn Fn() -> S + Sync),
        body: &(dyn Fn(&mut S, Self::Item) + Sync),
    ) {
        self.for_each_init(init, body);
    }

    /// `f` of every item, in parallel, collected in order.
    fn map_collect_dyn<T: Send>(self, f: &(dyn Fn(Self::Item) -> T + Sync)) -> Vec<T>
    where
        Self: IndexedParallelIterator,
    {
        self.map(f).collect()
    }
}

impl<I: ParallelIterator> ForEachDyn for I {}

/// Run `f` on a thread of rayon's pool (inline when already on one).
///
/// Why: each kernel runs several parallel loops in a row (in the forward,
/// per kv head, the transpose of its K, then its query tiles; the
/// backward's three phases). Started from a thread outside the pool, each
/// loop hands its work over to the pool and puts the caller to sleep until
/// it is done; inside the pool the loops follow one another without a
/// hand-over. Measured on a 2-core virtual machine: a causal
/// forward+backward at B = 1, H = 8, S = 256, D = 64 ran 1.2× faster this
/// way; long runs did not change.
pub(crate) fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let mut f = Some(f);
    let mut result = None;
    run_in_pool(&mut || result = f.take().map(|f| f()));
    result.expect("the pool ran the call")
}

/// [`in_pool`] behind a trait object: rayon's scope code once.
fn run_in_pool(f: &mut (dyn FnMut() + Send)) {
    rayon::scope(|_| f());
}
