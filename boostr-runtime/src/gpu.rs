//! What the GPU backends (wgpu, CUDA) share: the kernel cache, the choice
//! of tiles, and the problem's sizes as the kernel descriptions read them.

use crate::backend::{BackwardTensors, KeyLayout};
use crate::capture;
use crate::error::{BackendError, Error, Result};
use crate::problem::Problem;
use crate::variant::Variant;
use kernels_spec::emit::interface::{NO_WORD, Scalar, Sizes};
use kernels_spec::emit::{Target, Tiling, TilingError, choose_tiles};
use kernels_spec::params::{
    Arena, GRAD_FLAG_WORD, GRAD_MAX_CONTRIBUTION, GRAD_NON_FINITE, GRAD_RANGE, SummaryJob,
    grad_value,
};
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::tensor::Tensor;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock};

/// Built kernels (compiled modules, pipelines), shared by every thread.
///
/// Each key has one slot, built by the first caller and waited for by
/// concurrent ones; the map's lock is held only to find the slot, so
/// different keys build in parallel. A failed build is kept as its error,
/// and every later caller gets that error without building again. A build
/// that panics leaves its slot empty, and the next caller builds again.
#[derive(Debug)]
pub(crate) struct KernelCache<K, V> {
    slots: Mutex<HashMap<K, Slot<V>>>,
}

type Slot<V> = Arc<OnceLock<std::result::Result<Arc<V>, BackendError>>>;

impl<K, V> Default for KernelCache<K, V> {
    fn default() -> Self {
        KernelCache {
            slots: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Eq + Hash, V> KernelCache<K, V> {
    /// The kernels for `key`, built with `build` on a miss.
    pub(crate) fn get_or_build(
        &self,
        key: K,
        build: impl FnOnce() -> std::result::Result<V, BackendError>,
    ) -> std::result::Result<Arc<V>, BackendError> {
        let slot = {
            // A poisoned lock only means another caller panicked while
            // holding it; the map itself is intact.
            let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            slots.entry(key).or_default().clone()
        };
        slot.get_or_init(|| build().map(Arc::new)).clone()
    }
}

/// The variant's section for `target`, or why it has none.
pub(crate) fn lowering<V: Variant>(
    target: Target,
) -> std::result::Result<&'static str, BackendError> {
    V::compiled().lowering(target)
}

/// The tiles `V`'s kernels run with on `target`: its `tile(..)` override of
/// `default` when that validates there, else `default`.
pub(crate) fn tiles<V: Variant, T: Tiling>(
    target: Target,
    default: T,
    p: &Problem,
    dtype: DType,
) -> std::result::Result<T, BackendError> {
    choose_tiles(default, V::TILE_Q, V::TILE_KV).map_err(|error| tiling(target, p, dtype, error))
}

/// [`BackendError::Tiling`] of `p`'s head dims.
pub(crate) fn tiling(
    target: Target,
    p: &Problem,
    dtype: DType,
    error: TilingError,
) -> BackendError {
    BackendError::Tiling {
        target,
        head_dim: p.head_dim,
        value_dim: p.head_dim_v,
        dtype,
        error,
    }
}

/// The capture arena of one call, planned on the host: the captured
/// tensors checked against their declarations (contiguous, on the call's
/// runtime), where each goes, the summaries the device computes from them,
/// where the key layout's `i32` tensors go after them, and whether the
/// call must read the error record back.
pub(crate) struct ArenaPlan<R: Runtime> {
    /// The captured tensors, in field order.
    pub tensors: Vec<Tensor<R>>,
    /// Where each tensor and summary lives.
    pub arena: Arena,
    /// The summary kernel's jobs, in the arena's order.
    pub jobs: Vec<SummaryJob>,
    /// Some checked read may be out of range for this call: read the
    /// record back after it ([`capture::checks_hold`]).
    pub report: bool,
    /// The key layout's lengths and page table (contiguous), each with the
    /// arena word it is copied to, after the arena's own words.
    pub cache: Vec<(Tensor<R>, usize)>,
    /// Words of the whole arena, the cache's tensors included.
    pub words: usize,
    /// Where the call's keys are, as the kernels read it.
    pub keys: KeyWords,
}

/// Where a call's keys are, as the GPU kernels take it (the scalars
/// `kv_lens`, `q_lens`, `kv_pages`, `page_size` and `max_pages`): the arena
/// words of a cache's (or padded batch's) key lengths, of a padded batch's
/// query lengths and of a page table, or [`NO_WORD`] where there is none,
/// then keys per page and page table entries per sequence (0 for keys in
/// place).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeyWords {
    pub lens: u32,
    pub q_lens: u32,
    pub pages: u32,
    pub page_size: u32,
    pub max_pages: u32,
}

impl KeyWords {
    /// Where the keys of `layout` are, its tensors at arena words `at`
    /// (key lengths, query lengths, page table).
    fn new<R: Runtime>(p: &Problem, layout: &KeyLayout<'_, R>, at: [u32; 3]) -> Result<Self> {
        let word = |name, value: usize| {
            u32::try_from(value).map_err(|_| Error::TooLarge {
                name,
                value,
                max: u32::MAX as usize,
            })
        };
        let (page_size, max_pages) = match layout.pages() {
            Some(t) => (t.page_size, p.seq_k / t.page_size.max(1)),
            None => (0, 0),
        };
        Ok(KeyWords {
            lens: at[0],
            q_lens: at[1],
            pages: at[2],
            page_size: word("the page size", page_size)?,
            max_pages: word("the pages per sequence", max_pages)?,
        })
    }
}

/// Words an arena may hold: every index into it is a `u32`, and a WGSL
/// storage binding is at most 128 MiB by default
/// (`maxStorageBufferBindingSize`).
pub(crate) const MAX_ARENA_WORDS: usize = 1 << 25;

impl<R: Runtime<DType = DType>> ArenaPlan<R> {
    /// The plan for `variant`'s captures on problem `p`, with keys laid
    /// out as `layout` says.
    pub(crate) fn new<V: Variant>(
        variant: &V,
        p: &Problem,
        layout: &KeyLayout<'_, R>,
    ) -> Result<Self> {
        // A window of a longer sequence reads tensors that span all of it.
        let captured = variant.window().captured(p);
        let tensors = variant
            .captures()
            .iter()
            .map(|c| c.on::<R>(&captured))
            .collect::<Result<Vec<_>>>()?;
        let shapes: Vec<&[usize]> = tensors.iter().map(|t| t.shape()).collect();
        let arena = Arena::new(&shapes, V::SUMMARIES, V::LEARNABLE);
        if arena.words > MAX_ARENA_WORDS {
            return Err(Error::TooLarge {
                name: "the capture arena (captured tensors and summaries, in 32-bit words)",
                value: arena.words,
                max: MAX_ARENA_WORDS,
            });
        }
        let jobs = (0..V::SUMMARIES.len())
            .map(|s| arena.job(s, &shapes, V::SUMMARIES))
            .collect();
        let report = !capture::checks_hold(V::READ_CHECKS, &captured, &shapes);
        // The key lengths, the query lengths, then the page table, after
        // the arena's words.
        let mut words = arena.words;
        let mut cache = Vec::new();
        let mut at = [NO_WORD; 3];
        let index_tensors = [
            layout.lengths().map(|l| l.tensor),
            layout.query_lengths().map(|l| l.tensor),
            layout.pages().map(|t| t.tensor),
        ];
        for (slot, t) in at.iter_mut().zip(index_tensors) {
            if let Some(t) = t {
                let t = t.contiguous()?;
                *slot = u32::try_from(words).unwrap_or(NO_WORD);
                let n = t.numel();
                cache.push((t, words));
                words += n;
            }
        }
        if words > MAX_ARENA_WORDS {
            return Err(Error::TooLarge {
                name: "the capture arena with the cache's lengths and page table (32-bit words)",
                value: words,
                max: MAX_ARENA_WORDS,
            });
        }
        let keys = KeyWords::new(p, layout, at)?;
        Ok(ArenaPlan {
            tensors,
            arena,
            jobs,
            report,
            cache,
            words,
            keys,
        })
    }

    /// The tensors copied into the arena before the kernels, each with its
    /// first word: the captured tensors, then the cache's.
    pub(crate) fn copies(&self) -> impl Iterator<Item = (&Tensor<R>, usize)> {
        let captured = self.tensors.iter().zip(self.arena.tensors.iter().copied());
        captured.chain(self.cache.iter().map(|(t, at)| (t, *at)))
    }

    /// The captured tensors' shapes.
    pub(crate) fn shapes(&self) -> Vec<&[usize]> {
        self.tensors.iter().map(|t| t.shape()).collect()
    }

    /// The error of the arena's record (its first
    /// [`ERROR_WORDS`](kernels_spec::params::ERROR_WORDS) words),
    /// if a read was out of range.
    pub(crate) fn error<V: Variant>(&self, target: Target, record: &[u32]) -> Option<Error> {
        capture::read_error(target, V::READ_CHECKS, V::TENSORS, &self.shapes(), record)
    }
}

/// Sums of a gradient accumulator at or beyond this magnitude (2³⁰, one
/// bit short of the ±2³¹ where the 64-bit fixed point wraps) are an
/// error rather than a value that may have wrapped.
const GRAD_MAX_SUM: f64 = 1_073_741_824.0;

/// The tensors every GPU backward reads, each checked and made contiguous
/// by the backend's `input` (`lse`: f32; `k` and `v` as the keys are laid
/// out, pages included). (`out` is left to the backends that read it.)
pub(crate) struct BackwardOperands<R: Runtime> {
    pub(crate) q: Tensor<R>,
    pub(crate) k: Tensor<R>,
    pub(crate) v: Tensor<R>,
    pub(crate) dout: Tensor<R>,
    pub(crate) lse: Tensor<R>,
}

impl<R: Runtime<DType = DType>> BackwardOperands<R> {
    pub(crate) fn new(
        t: &BackwardTensors<'_, R>,
        backend: &'static str,
        input: impl Fn(&'static str, &Tensor<R>) -> Result<Tensor<R>>,
    ) -> Result<Self> {
        crate::validate::check_dtype("lse", t.lse, backend, &[DType::F32], "f32")?;
        Ok(Self {
            q: input("q", t.q)?,
            k: input("k", t.keys.k)?,
            v: input("v", t.keys.v)?,
            dout: input("dout", t.dout)?,
            lse: t.lse.contiguous()?,
        })
    }
}

/// A GPU backward's gradients as the caller's keys hold them: `dq`, `dk`
/// and `dv` of each sequence's slots (as the kernels write them), those
/// of a paged call folded into its `pages` pages ([`fold_pages`]), and the
/// learnable tensors' `tensors`.
pub(crate) fn backward_grads<R: Runtime<DType = DType>>(
    p: &Problem,
    layout: &KeyLayout<'_, R>,
    [dq, dk, dv]: [Tensor<R>; 3],
    pages: usize,
    tensors: Vec<Option<Tensor<R>>>,
) -> Result<crate::backend::AttentionGrads<R>>
where
    R::Client: numr::ops::IndexingOps<R>
        + numr::ops::BinaryOps<R>
        + numr::ops::ShapeOps<R>
        + numr::ops::UtilityOps<R>,
{
    Ok(crate::backend::AttentionGrads {
        dq,
        dk: fold_pages(dk, p, layout, pages)?,
        dv: fold_pages(dv, p, layout, pages)?,
        tensors,
    })
}

/// The gradient of a paged cache's pages (`[pages, Hkv, page_size, dim]`)
/// from that of its sequences' slots (`slots`, `[B, Hkv, Sk, dim]`, as the
/// backward kernels write it): each page's row is the sum, in sequence
/// order, of the slot rows that read it (a page shared by several
/// sequences gets all of theirs), zero where no sequence's length reaches
/// it. `slots` itself for keys in place. Gathers only (numr's
/// `index_select`, one per sequence that shares a page): the same bits on
/// every run.
pub(crate) fn fold_pages<R: Runtime<DType = DType>>(
    slots: Tensor<R>,
    p: &Problem,
    layout: &KeyLayout<'_, R>,
    pages: usize,
) -> Result<Tensor<R>>
where
    R::Client: numr::ops::IndexingOps<R>
        + numr::ops::BinaryOps<R>
        + numr::ops::ShapeOps<R>
        + numr::ops::UtilityOps<R>,
{
    let (Some(lens), Some(table)) = (layout.lengths(), layout.pages()) else {
        return Ok(slots);
    };
    let dim = slots.shape()[3];
    let (h, ps, sk) = (p.heads_kv, table.page_size, p.seq_k);
    let max_pages = sk / ps.max(1);
    let slot_rows = p.batch * h * sk;
    // Each page's readers (sequence, logical page), in sequence order.
    let mut readers: Vec<Vec<(usize, usize)>> = vec![Vec::new(); pages];
    for (b, &len) in lens.host.iter().enumerate() {
        for lp in 0..len.div_ceil(ps.max(1)) {
            readers[table.host[b * max_pages + lp]].push((b, lp));
        }
    }
    let depth = readers.iter().map(Vec::len).max().unwrap_or(0);
    let device = slots.device().clone();
    // The slot rows and one zero row, which every page row without a
    // reader gathers.
    let zero = Tensor::<R>::zeros(&[1, dim], slots.dtype(), &device)?;
    let rows = Tensor::cat(&[&slots.reshape(&[slot_rows, dim])?, &zero], 0)?;
    let page_rows = pages * h * ps;
    let mut out: Option<Tensor<R>> = None;
    for r in 0..depth.max(1) {
        let mut index = vec![slot_rows as i32; page_rows];
        for (page, readers) in readers.iter().enumerate() {
            let Some(&(b, lp)) = readers.get(r) else {
                continue;
            };
            for hh in 0..h {
                for slot in 0..ps {
                    let j = lp * ps + slot;
                    if j < lens.host[b] {
                        index[(page * h + hh) * ps + slot] = ((b * h + hh) * sk + j) as i32;
                    }
                }
            }
        }
        let index = Tensor::<R>::from_slice(&index, &[page_rows], &device)?;
        let gathered = rows.index_select(0, &index)?;
        out = Some(match out {
            None => gathered,
            Some(acc) => acc.add(&gathered)?,
        });
    }
    let out = out.expect("one gather at least");
    Ok(out.reshape(&[pages, h, ps, dim])?)
}

/// Whether a backward computes the gradient of some learnable tensor.
pub(crate) fn learns<V: Variant>(wanted: &[bool]) -> bool {
    V::LEARNABLE.iter().zip(wanted).any(|(_, &w)| w)
}

impl<R: Runtime<DType = DType>> ArenaPlan<R> {
    /// The gradients of the learnable tensors asked for (`wanted`, by
    /// slot) from the arena's words after the kernels: `record`, its first
    /// [`ERROR_WORDS`](kernels_spec::params::ERROR_WORDS), and `grads`,
    /// its words from [`Arena::grad_start`] on. A NaN or infinite
    /// contribution (flagged: the accumulators hold none) makes every
    /// gradient of the call NaN; one out of the accumulators' range is an
    /// error. Each gradient is an f32 tensor of its tensor's shape on
    /// `device`.
    pub(crate) fn grads<V: Variant>(
        &self,
        backend: &'static str,
        record: &[u32],
        grads: &[u32],
        wanted: &[bool],
        device: &R::Device,
    ) -> Result<Vec<Option<Tensor<R>>>> {
        let flags = record.get(GRAD_FLAG_WORD).copied().unwrap_or(0);
        let field = |slot: usize| V::TENSORS.get(V::LEARNABLE[slot]).map_or("?", |d| d.name);
        let first_wanted = wanted.iter().position(|&w| w).unwrap_or(0);
        if flags & GRAD_RANGE != 0 {
            return Err(Error::TensorGradRange {
                backend,
                field: field(first_wanted),
                rule: "every contribution dz · ∂score/∂read is below 2^24 in magnitude",
                value: f64::from(GRAD_MAX_CONTRIBUTION),
            });
        }
        let mut out = Vec::with_capacity(V::LEARNABLE.len());
        for (slot, &t) in V::LEARNABLE.iter().enumerate() {
            if !wanted.get(slot).copied().unwrap_or(false) {
                out.push(None);
                continue;
            }
            let numel = self.tensors[t].numel();
            let first = self.arena.grads[slot] - self.arena.grad_start;
            let words = &grads[first..first + 2 * numel];
            let mut values = Vec::with_capacity(numel);
            for pair in words.chunks_exact(2) {
                let v = grad_value(pair[0], pair[1]);
                if v.abs() >= GRAD_MAX_SUM {
                    return Err(Error::TensorGradRange {
                        backend,
                        field: field(slot),
                        rule: "every element's sum stays below 2^30 in magnitude",
                        value: v.abs(),
                    });
                }
                values.push(if flags & GRAD_NON_FINITE != 0 {
                    f32::NAN
                } else {
                    v as f32
                });
            }
            out.push(Some(Tensor::<R>::from_slice(
                &values,
                self.tensors[t].shape(),
                device,
            )?));
        }
        Ok(out)
    }
}

/// The word of a launch scalar that depends only on the call: the
/// problem's sizes, its scale (f32 bits), where its keys are, and its key
/// splits; `None` for the scalars of one dispatch (its tile range and
/// flags). Sizes fit in `u32`: validation bounds them by 2^30.
pub(crate) fn scalar_word(p: &Problem, s: Scalar, keys: KeyWords, splits: u32) -> Option<u32> {
    Some(match s {
        Scalar::Batch => p.batch as u32,
        Scalar::HeadsQ => p.heads_q as u32,
        Scalar::HeadsKv => p.heads_kv as u32,
        Scalar::SeqQ => p.seq_q as u32,
        Scalar::SeqK => p.seq_k as u32,
        Scalar::Scale => p.scale.to_bits(),
        Scalar::KvLens => keys.lens,
        Scalar::QLens => keys.q_lens,
        Scalar::KvPages => keys.pages,
        Scalar::PageSize => keys.page_size,
        Scalar::MaxPages => keys.max_pages,
        Scalar::Splits => splits,
        Scalar::TileBegin | Scalar::TileEnd | Scalar::Flags => return None,
    })
}

/// The head dims `(D, Dv)` as the tile configurations take them (a head
/// dim past `u32::MAX` becomes `u32::MAX`, which no configuration
/// validates).
pub(crate) fn head_dims(p: &Problem) -> (u32, u32) {
    let dim = |d: usize| u32::try_from(d).unwrap_or(u32::MAX);
    (dim(p.head_dim), dim(p.head_dim_v))
}

/// The problem's sizes, as launch geometry reads them.
pub(crate) fn sizes(p: &Problem) -> Sizes {
    split_sizes(p, 1)
}

/// The parameter block of a call: the variant's fields; for a variant
/// with `dropout`, the call's draw in the fields' last words
/// ([`kernels_spec::dropout::Word`]); and where the call sits in the
/// variant's sequence ([`kernels_spec::params::WindowWord`]).
pub(crate) fn param_words<V: crate::Variant>(
    variant: &V,
    p: &Problem,
) -> kernels_spec::params::ParamWords {
    let window = variant.window();
    let mut words = variant
        .param_words()
        .with_window(window.q_shift, window.kv_shift, window.sink);
    if <V::Host as crate::HostVariant>::WEIGHTS.dropout {
        let at = kernels_spec::dropout::Word::Threshold.index();
        words.0[at..at + kernels_spec::dropout::DROPOUT_WORDS].copy_from_slice(&p.dropout.words());
    }
    words
}

/// The sizes of a forward in `splits` key splits.
pub(crate) fn split_sizes(p: &Problem, splits: u32) -> Sizes {
    Sizes {
        batch: p.batch as u64,
        heads_q: p.heads_q as u64,
        heads_kv: p.heads_kv as u64,
        seq_q: p.seq_q as u64,
        seq_k: p.seq_k as u64,
        splits: splits.max(1).into(),
    }
}

/// Keys a split of a split-KV forward covers at least: below that the
/// merge and the splits' fixed costs outweigh the parallelism gained.
pub(crate) const MIN_SPLIT_KEYS: u64 = 256;

/// Key splits for a forward whose grid has `blocks` blocks (query row
/// blocks × kv heads × batch) over `seq_k` keys in tiles of `block_kv`:
/// 1 where the grid alone has the `target` blocks that fill the device,
/// else enough splits for `target` blocks, each at least
/// [`MIN_SPLIT_KEYS`] keys (and one tile), at most `max`. A function of
/// the shape and the device only, so the chunking, and with it the
/// result, is the same on every call.
pub(crate) fn split_count(blocks: u64, seq_k: u64, block_kv: u64, target: u64, max: u64) -> u32 {
    if blocks >= target {
        return 1;
    }
    let wanted = target.div_ceil(blocks.max(1));
    let most = seq_k / MIN_SPLIT_KEYS.max(block_kv).max(1);
    u32::try_from(wanted.min(most).min(max).max(1)).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention;
    use kernels_spec::emit::TilingError;
    use kernels_spec::emit::cuda::{CudaDType, CudaTiles};
    use kernels_spec::emit::wgsl::WgslTiles;
    use std::sync::Barrier;

    #[attention(mask = |_b, _h, q, kv| kv <= q, tile(q = 16, kv = 24))]
    #[derive(Clone, Debug)]
    struct Tiled;

    fn problem(head_dim: usize) -> Problem {
        Problem::new(1, (1, 1), (1, 1), head_dim)
    }

    #[test]
    fn a_tile_override_applies_where_it_validates() {
        // WGSL stages any number of rows that fits.
        let wgsl = tiles::<Tiled, _>(
            Target::Wgsl,
            WgslTiles::for_head_dim(64),
            &problem(64),
            DType::F32,
        );
        let wgsl = wgsl.expect("tiles");
        assert_eq!((wgsl.block_q, wgsl.block_kv), (16, 24));
        // On tensor cores 24 keys are no multiple of 16: the defaults stay.
        let default = CudaTiles::for_problem(64, 64, CudaDType::F16);
        let cuda =
            tiles::<Tiled, _>(Target::Cuda, default, &problem(64), DType::F16).expect("tiles");
        assert_eq!(cuda, default);
        // On CUDA cores they are a multiple of 8, and apply.
        let default = CudaTiles::for_problem(64, 64, CudaDType::F32);
        let cuda =
            tiles::<Tiled, _>(Target::Cuda, default, &problem(64), DType::F32).expect("tiles");
        assert_eq!((cuda.block_q, cuda.block_kv), (16, 24));
    }

    #[test]
    fn a_head_dim_without_tiling_is_a_typed_error() {
        let default = CudaTiles::for_problem(36, 36, CudaDType::F32);
        let err = tiles::<Tiled, _>(Target::Cuda, default, &problem(36), DType::F32).unwrap_err();
        assert!(
            matches!(
                &err,
                BackendError::Tiling {
                    target: Target::Cuda,
                    head_dim: 36,
                    error: TilingError::HeadDim { head_dim: 36, .. },
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("multiple of 8"), "{err}");
        let huge = Problem::new(1, (1, 1), (1, 1), 1 << 40);
        let default = WgslTiles::for_head_dim(head_dims(&huge).0);
        let err = tiles::<Tiled, _>(Target::Wgsl, default, &huge, DType::F32);
        assert!(
            matches!(
                err,
                Err(BackendError::Tiling {
                    error: TilingError::Memory { .. },
                    ..
                })
            ),
            "{err:?}"
        );
    }
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn concurrent_first_use_builds_once() {
        let cache = KernelCache::<u32, usize>::default();
        let builds = AtomicUsize::new(0);
        let threads = 8;
        let barrier = Barrier::new(threads);
        let results: Vec<Arc<usize>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        cache
                            .get_or_build(7, || {
                                builds.fetch_add(1, Ordering::SeqCst);
                                // Long enough that the others arrive while
                                // the build runs.
                                std::thread::sleep(std::time::Duration::from_millis(50));
                                Ok(42)
                            })
                            .expect("the build succeeds")
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(builds.load(Ordering::SeqCst), 1);
        assert!(
            results
                .iter()
                .all(|r| **r == 42 && Arc::ptr_eq(r, &results[0]))
        );
    }

    #[test]
    fn a_failed_build_is_kept_and_other_keys_still_build() {
        let cache = KernelCache::<&str, u8>::default();
        let error = BackendError::Compile {
            target: Target::Wgsl,
            source_name: "broken".into(),
            log: "syntax error".into(),
        };
        let first = cache.get_or_build("a", || Err(error.clone()));
        assert_eq!(first.unwrap_err(), error);
        let again = cache.get_or_build("a", || panic!("a kept failure is not rebuilt"));
        assert_eq!(again.unwrap_err(), error);
        assert_eq!(*cache.get_or_build("b", || Ok(3)).unwrap(), 3);
    }

    #[test]
    fn a_panicking_build_leaves_the_slot_empty() {
        let cache = KernelCache::<u8, u8>::default();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = cache.get_or_build(1, || panic!("build panics"));
        }));
        assert!(panicked.is_err());
        assert_eq!(*cache.get_or_build(1, || Ok(5)).unwrap(), 5);
    }
}
