//! Buffers aligned to a cache line, for the kernels' copies and scratch,
//! and a small pool that hands large ones from one call to the next.
//!
//! Why aligned: a 64-byte vector load or store that straddles two cache
//! lines costs two L1 accesses, and the tile products issue one or more per
//! FMA pair. Measured on a 2-core AVX-512 Xeon: a 64 × 64 × 128 tile product
//! whose operands sit in L2 ran at 0.86 of the FMA peak with 64-byte
//! aligned rows and 0.69 with rows 16 bytes off, which is what `Vec<f32>`
//! gives (the allocator aligns to 16). numr's CPU tensors are 64-byte
//! aligned; everything the kernels allocate themselves (transposed keys,
//! widened inputs and outputs, score tiles, packed operands) comes from
//! here.
//!
//! Why pooled: a call's large buffers (a transposed K, widened inputs, the
//! backward's dQ partials: megabytes each) would otherwise be fresh
//! `mmap`s every call. Each of their pages then faults once and is zeroed
//! by the kernel, and freeing them unmaps the pages, which on a
//! multi-core machine interrupts every core to flush its TLB. A `perf`
//! profile of a causal bf16 forward at S = 1024 spent 17% of its time in
//! those kernel paths. Buffers of at least [`POOLED_BYTES`] therefore
//! return to a process-wide pool when dropped, up to [`POOL_BYTES`] in
//! all, and the next request of a similar size takes one back.
//!
//! Guarantees: every buffer is [`ALIGN`]-aligned and holds initialised
//! values of `T` (all bits of a `Plain` type are a value): zeros from
//! [`Aligned::zeroed`], unspecified ones from [`Aligned::scratch`]. The
//! pool never holds more than [`POOL_BYTES`] (plus the one buffer being
//! returned, which is then freed instead) and is safe to use from any
//! thread; [`release_pool`] frees what it holds.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Mutex;

/// Bytes of alignment: one cache line, one AVX-512 vector.
pub(crate) const ALIGN: usize = 64;

/// Buffers of at least this many bytes go back to the pool when dropped;
/// smaller ones come from the allocator's per-thread caches cheaply.
pub(crate) const POOLED_BYTES: usize = 1 << 16;

/// The most bytes the pool keeps.
pub(crate) const POOL_BYTES: usize = 256 << 20;

/// The most buffers the pool keeps.
const POOL_BUFFERS: usize = 32;

/// Element types for which any bits are a value and that need no drop.
///
/// # Safety
/// Implementors are `Copy`, have no padding and no invalid bit patterns.
pub(crate) unsafe trait Plain: Copy + Send + Sync + 'static {}
// SAFETY: primitive numbers: every bit pattern is a value.
unsafe impl Plain for f32 {}
// SAFETY: as above.
unsafe impl Plain for u16 {}
// SAFETY: as above.
unsafe impl Plain for u32 {}
// SAFETY: a 16-bit float: every bit pattern is a value.
unsafe impl Plain for half::bf16 {}

/// One allocation: `bytes` bytes at `ptr`, aligned to [`ALIGN`].
struct Block {
    ptr: NonNull<u8>,
    bytes: usize,
}

// SAFETY: a `Block` is an owned allocation with no thread affinity.
unsafe impl Send for Block {}

impl Block {
    fn layout(bytes: usize) -> Layout {
        Layout::from_size_align(bytes, ALIGN).expect("buffer size overflows isize")
    }

    /// A fresh zeroed block of `bytes > 0` bytes.
    fn fresh(bytes: usize) -> Self {
        let layout = Self::layout(bytes);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { ptr, bytes }
    }

    fn free(self) {
        // SAFETY: allocated by `fresh` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.bytes)) };
    }
}

/// Freed large blocks, oldest first, for reuse.
struct Pool(Mutex<Vec<Block>>);

/// The process's pool.
static POOL: Pool = Pool(Mutex::new(Vec::new()));

impl Pool {
    /// The blocks, even if a thread panicked while holding them (the list
    /// is valid at every step).
    fn blocks(&self) -> std::sync::MutexGuard<'_, Vec<Block>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A block of at least `bytes` bytes: the smallest pooled one that
    /// holds them without wasting more than half, else a fresh one.
    fn take(&self, bytes: usize) -> Block {
        if bytes < POOLED_BYTES {
            return Block::fresh(bytes);
        }
        let mut blocks = self.blocks();
        let best = blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.bytes >= bytes && b.bytes <= 2 * bytes)
            .min_by_key(|(_, b)| b.bytes)
            .map(|(i, _)| i);
        match best {
            Some(i) => blocks.remove(i),
            None => {
                drop(blocks);
                Block::fresh(size_class(bytes))
            }
        }
    }

    /// Keep `block`, freeing the oldest blocks where that would exceed
    /// [`POOL_BYTES`] or [`POOL_BUFFERS`]; blocks too small or too large
    /// for the pool are freed.
    fn give_back(&self, block: Block) {
        if block.bytes < POOLED_BYTES || block.bytes > POOL_BYTES {
            return block.free();
        }
        let mut evicted = Vec::new();
        {
            let mut blocks = self.blocks();
            let mut held: usize = blocks.iter().map(|b| b.bytes).sum();
            while !blocks.is_empty()
                && (held + block.bytes > POOL_BYTES || blocks.len() >= POOL_BUFFERS)
            {
                let old = blocks.remove(0);
                held -= old.bytes;
                evicted.push(old);
            }
            blocks.push(block);
        }
        // Freed outside the lock: unmapping can take a while.
        evicted.into_iter().for_each(Block::free);
    }

    /// Frees every block held.
    fn release(&self) {
        let blocks = std::mem::take(&mut *self.blocks());
        blocks.into_iter().for_each(Block::free);
    }

    /// Bytes and blocks held.
    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        let blocks = self.blocks();
        (blocks.iter().map(|b| b.bytes).sum(), blocks.len())
    }
}

/// `bytes` rounded up to a size class: the next multiple of an eighth of
/// its power of two (at most 12.5% more), so that requests of nearly the
/// same size share blocks.
fn size_class(bytes: usize) -> usize {
    let step = (bytes.next_power_of_two() / 8).max(ALIGN);
    bytes.div_ceil(step) * step
}

/// Frees every scratch buffer the CPU kernels keep for their next call
/// (see the module docs); buffers in use are not affected.
pub fn release_pool() {
    POOL.release();
}

/// A fixed-length, [`ALIGN`]-aligned buffer of `T`.
pub(crate) struct Aligned<T: Plain> {
    /// `None` for an empty buffer.
    block: Option<Block>,
    len: usize,
    _owns: PhantomData<T>,
}

// SAFETY: `Aligned` owns its elements like a `Box<[T]>`, and `T: Plain`
// is `Send + Sync`.
unsafe impl<T: Plain> Send for Aligned<T> {}
// SAFETY: as above.
unsafe impl<T: Plain> Sync for Aligned<T> {}

impl<T: Plain> Aligned<T> {
    /// `len` elements of unspecified values (a pooled buffer's old
    /// contents, or zeros): for buffers the caller writes before reading.
    ///
    /// # Panics
    /// If the size overflows `isize`, or the allocation fails (as `vec!`).
    pub(crate) fn scratch(len: usize) -> Self {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .expect("buffer size overflows usize");
        Self {
            block: (bytes > 0).then(|| POOL.take(bytes)),
            len,
            _owns: PhantomData,
        }
    }

    /// `len` zeros.
    pub(crate) fn zeroed(len: usize) -> Self {
        let mut a = Self::scratch(len);
        // SAFETY: zero bits are a value of every `Plain` type.
        unsafe { std::ptr::write_bytes(a.as_mut_ptr(), 0, len) };
        a
    }
}

impl<T: Plain> Drop for Aligned<T> {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            POOL.give_back(block);
        }
    }
}

impl<T: Plain> std::ops::Deref for Aligned<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.block {
            // SAFETY: the block holds at least `len` values of `T` (its
            // bytes were zeroed when allocated, and any bits are a `T`),
            // is aligned for `T`, and is owned by `self`.
            Some(b) => unsafe { std::slice::from_raw_parts(b.ptr.as_ptr().cast(), self.len) },
            None => &[],
        }
    }
}

impl<T: Plain> std::ops::DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.block {
            // SAFETY: as in `deref`, and `&mut self` is unique.
            Some(b) => unsafe { std::slice::from_raw_parts_mut(b.ptr.as_ptr().cast(), self.len) },
            None => &mut [],
        }
    }
}

impl<T: Plain> std::fmt::Debug for Aligned<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Aligned").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_writable() {
        for len in [0, 1, 15, 16, 17, 1000, 1 << 20] {
            let mut a = Aligned::<f32>::zeroed(len);
            assert_eq!(a.len(), len);
            if len > 0 {
                assert_eq!(a.as_ptr() as usize % ALIGN, 0, "len {len}");
            }
            assert!(a.iter().all(|&x| x == 0.0));
            for (i, x) in a.iter_mut().enumerate() {
                *x = i as f32;
            }
            assert!(a.iter().enumerate().all(|(i, &x)| x == i as f32));
        }
        let b = Aligned::<u16>::zeroed(33);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
    }

    #[test]
    fn a_returned_block_is_taken_again_when_its_size_fits() {
        let pool = Pool(Mutex::new(Vec::new()));
        let block = pool.take(3 << 20);
        let at = block.ptr;
        assert!(block.bytes >= 3 << 20);
        pool.give_back(block);
        // A request of nearly the same size takes it back; one of under
        // half its size does not.
        let small = pool.take(1 << 20);
        assert_ne!(small.ptr, at);
        let again = pool.take((3 << 20) - 1000);
        assert_eq!(again.ptr, at);
        pool.give_back(small);
        pool.give_back(again);
        assert_eq!(pool.held().1, 2);
        // Small blocks are not kept.
        pool.give_back(pool.take(100));
        assert_eq!(pool.held().1, 2);
        pool.release();
        assert_eq!(pool.held(), (0, 0));
    }

    #[test]
    fn the_pool_stays_within_its_bounds() {
        let pool = Pool(Mutex::new(Vec::new()));
        let blocks: Vec<Block> = (0..POOL_BUFFERS + 5)
            .map(|i| pool.take(POOLED_BYTES + i * ALIGN))
            .collect();
        blocks.into_iter().for_each(|b| pool.give_back(b));
        assert_eq!(pool.held().1, POOL_BUFFERS);
        let big: Vec<Block> = (0..3).map(|_| pool.take(POOL_BYTES / 2)).collect();
        big.into_iter().for_each(|b| pool.give_back(b));
        assert!(pool.held().0 <= POOL_BYTES);
        pool.release();
    }

    #[test]
    fn threads_share_the_pool_without_losing_buffers() {
        let lens = [1 << 16, 3 << 15, 1 << 18, (1 << 20) + 77];
        std::thread::scope(|s| {
            for t in 0..4usize {
                s.spawn(move || {
                    for i in 0..200usize {
                        let len = lens[(t + i) % lens.len()];
                        let mut a = Aligned::<u32>::scratch(len);
                        assert_eq!(a.len(), len);
                        assert_eq!(a.as_ptr() as usize % ALIGN, 0);
                        let tag = (t * 1000 + i) as u32;
                        a[0] = tag;
                        a[len - 1] = tag;
                        std::hint::black_box(&mut a);
                        assert_eq!((a[0], a[len - 1]), (tag, tag));
                    }
                });
            }
        });
        let (bytes, blocks) = POOL.held();
        assert!(bytes <= POOL_BYTES && blocks <= POOL_BUFFERS);
    }
}
