//! Captured tensors: the fields a variant declares `#[tensor(elem, [dims])]`
//! and reads by indexing in `score` and `mask`.
//!
//! - [`TensorDecl`]: what the compiler knows of a captured tensor (its
//!   element type and declared shape), as the macro writes it for the
//!   runtimes.
//! - [`check`]: a tensor given at call time against its declaration: its
//!   dtype, its rank and every declared dimension; an `Err` that names the
//!   field, what was expected and what was given.
//! - [`Learnable`]: a learnable tensor (a `Var<R>` field), type-erased for
//!   the autograd op, which records it as an input of its backward.
//! - [`HostTensor`]: a checked tensor on the host, as the CPU kernels and
//!   the reference read it, with the per-call summaries the tile classifier
//!   reads (`kernels_spec::params` describes their layout, the same on every
//!   target).

use crate::error::{Error, Result};
use crate::problem::Problem;
use kernels_spec::params::{Arena, ParamWords, SUMMARY_BLOCK, SUMMARY_MAX_BLOCKS, summary_blocks};
use numr::autograd::Var;
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::runtime::cpu::CpuRuntime;
use numr::tensor::Tensor;
use std::any::Any;
use std::fmt;
use std::sync::Mutex;

pub use kernels_spec::ir::{DimDecl, Given, Holds, Size, SizeForm, Ty};

/// A captured tensor as the compiler declared it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorDecl {
    /// The field's name.
    pub name: &'static str,
    /// The element type the kernels hold (`i32`, `u32` or `f32`).
    pub elem: Ty,
    /// What the caller passes, where it differs (`bool`, `i64`).
    pub given: Given,
    /// Its declared shape, outermost first (none: one value).
    pub dims: &'static [DimDecl],
}

impl TensorDecl {
    /// The numr dtype the caller passes.
    pub fn dtype(&self) -> DType {
        match (self.given, self.elem) {
            (Given::Bool, _) => DType::Bool,
            (Given::I64, _) => DType::I64,
            (Given::Elem, Ty::I32) => DType::I32,
            (Given::Elem, Ty::U32) => DType::U32,
            (Given::Elem, _) => DType::F32,
        }
    }

    /// The declared shape with the problem's sizes filled in (`None` for an
    /// `_` dimension).
    pub fn expected(&self, p: &Problem) -> Vec<Option<usize>> {
        self.dims
            .iter()
            .map(|d| match d {
                DimDecl::Size(s) => Some(size(p, *s)),
                DimDecl::Fixed(n) => Some(*n as usize),
                DimDecl::Any => None,
            })
            .collect()
    }

    /// `[B = 2, Sk = 100]`, for messages.
    pub fn describe(&self, p: &Problem) -> String {
        let dims: Vec<String> = self
            .dims
            .iter()
            .map(|d| match d {
                DimDecl::Size(s) => format!("{} = {}", s.name(), size(p, *s)),
                other => other.to_string(),
            })
            .collect();
        format!("[{}]", dims.join(", "))
    }
}

/// A tensor read whose indices are checked at run time, as the compiler
/// declared it for the runtimes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadCheck {
    /// The read's site (its number in the variant, as the kernels report it).
    pub site: u32,
    /// The tensor it reads.
    pub tensor: usize,
    /// Whether each index is an `i32` (else a `u32`), to decode the
    /// kernels' record of an index.
    pub signed: &'static [bool],
    /// What makes each checked bound hold for one call.
    pub holds: &'static [Holds],
}

/// Whether every checked read of `checks` is in range for every call of
/// problem `p` with captured tensors of `shapes`: then no call can report a
/// read out of range, and a GPU backend need not read its record back.
pub fn checks_hold(checks: &[ReadCheck], p: &Problem, shapes: &[&[usize]]) -> bool {
    let sizes = [p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k].map(|s| s as i64);
    checks.iter().all(|c| {
        c.holds.iter().all(|h| match h {
            Holds::Never => false,
            Holds::NonNegative(f) => f.eval(sizes) >= 0,
            Holds::BelowDim(f, axis) => shapes
                .get(c.tensor)
                .and_then(|s| s.get(*axis))
                .is_some_and(|&d| f.eval(sizes) < d as i64),
        })
    })
}

/// The error of the kernels' record of a read out of range (words 0..5 of
/// the arena: `site + 1`, then the indices' bits), for tensors of `decls`
/// with `shapes`; `None` when nothing was recorded.
pub fn read_error(
    target: kernels_spec::emit::Target,
    checks: &[ReadCheck],
    decls: &[TensorDecl],
    shapes: &[&[usize]],
    record: &[u32],
) -> Option<Error> {
    let site = record.first()?.checked_sub(1)?;
    let Some(check) = checks.iter().find(|c| c.site == site) else {
        // A record the variant cannot have written: say so rather than
        // return a result that may be wrong.
        return Some(Error::Backend(crate::error::BackendError::Launch {
            target,
            kernel: "attention",
            reason: format!("the kernels reported an unknown read site {site}"),
        }));
    };
    let index = check
        .signed
        .iter()
        .zip(record.get(1..).unwrap_or(&[]))
        .map(|(&signed, &bits)| {
            if signed {
                i64::from(bits as i32)
            } else {
                i64::from(bits)
            }
        })
        .collect();
    Some(Error::IndexOutOfRange {
        field: decls.get(check.tensor).map_or("?", |d| d.name),
        index,
        shape: shapes.get(check.tensor).map_or(Vec::new(), |s| s.to_vec()),
    })
}

/// The value of size `s` in problem `p`.
pub fn size(p: &Problem, s: Size) -> usize {
    match s {
        Size::B => p.batch,
        Size::Hq => p.heads_q,
        Size::Hkv => p.heads_kv,
        Size::Sq => p.seq_q,
        Size::Sk => p.seq_k,
    }
}

/// A captured tensor of a variant, type-erased for the runtimes: the GPU
/// backends take it as their own `Tensor<R>` (another runtime is an error).
#[derive(Clone, Copy)]
pub struct Capture<'a> {
    /// Its declaration.
    pub decl: &'static TensorDecl,
    /// The field's `Tensor<R>`.
    pub tensor: &'a dyn Any,
    /// `R`'s type name, for messages.
    pub runtime: &'static str,
}

impl fmt::Debug for Capture<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Capture")
            .field("decl", self.decl)
            .field("runtime", &self.runtime)
            .finish()
    }
}

impl<'a> Capture<'a> {
    /// The capture of `tensor` for field `decl`.
    pub fn new<R: Runtime>(decl: &'static TensorDecl, tensor: &'a Tensor<R>) -> Capture<'a> {
        Capture {
            decl,
            tensor,
            runtime: std::any::type_name::<R>(),
        }
    }

    /// The tensor as a `Tensor<R>`, checked against its declaration for
    /// problem `p`, and contiguous.
    pub fn on<R: Runtime<DType = DType>>(&self, p: &Problem) -> Result<Tensor<R>> {
        let t = self
            .tensor
            .downcast_ref::<Tensor<R>>()
            .ok_or(Error::CaptureRuntime {
                field: self.decl.name,
                expected: std::any::type_name::<R>(),
                got: self.runtime,
            })?;
        check(self.decl, t.shape(), t.dtype(), p)?;
        held(self.decl, t.contiguous()?)
    }
}

/// A checked captured tensor in the element type the kernels hold: `bool`
/// as i32 0 or 1, `i64` as i32 (a value outside i32 is an error), each
/// converted on the host; any other as it is.
fn held<R: Runtime<DType = DType>>(decl: &TensorDecl, t: Tensor<R>) -> Result<Tensor<R>> {
    let words: Vec<i32> = match decl.given {
        Given::Elem => return Ok(t),
        Given::Bool => t
            .try_to_vec::<u8>()?
            .into_iter()
            .map(|b| i32::from(b != 0))
            .collect(),
        Given::I64 => t
            .try_to_vec::<i64>()?
            .into_iter()
            .enumerate()
            .map(|(at, value)| {
                i32::try_from(value).map_err(|_| Error::CaptureValue {
                    field: decl.name,
                    at,
                    value,
                    rule: "an i64 tensor's values must fit in i32",
                })
            })
            .collect::<Result<_>>()?,
    };
    Ok(match decl.elem {
        Ty::U32 => {
            let words: Vec<u32> = words.into_iter().map(|w| w as u32).collect();
            Tensor::<R>::from_slice(&words, t.shape(), t.device())?
        }
        _ => Tensor::<R>::from_slice(&words, t.shape(), t.device())?,
    })
}

/// A learnable tensor of a variant (a `Var<R>` field), type-erased: the
/// autograd op takes it as its own `Var<R>` (another runtime is an error).
#[derive(Clone, Copy)]
pub struct Learnable<'a> {
    /// Its declaration.
    pub decl: &'static TensorDecl,
    /// The field's `Var<R>`.
    pub var: &'a dyn Any,
    /// `R`'s type name, for messages.
    pub runtime: &'static str,
}

impl fmt::Debug for Learnable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Learnable")
            .field("decl", self.decl)
            .field("runtime", &self.runtime)
            .finish()
    }
}

impl<'a> Learnable<'a> {
    /// The learnable `var` of field `decl`.
    pub fn new<R: Runtime>(decl: &'static TensorDecl, var: &'a Var<R>) -> Learnable<'a> {
        Learnable {
            decl,
            var,
            runtime: std::any::type_name::<R>(),
        }
    }

    /// The field as a `Var<R>`, or the error of a tensor on another runtime.
    pub fn on<R: Runtime>(&self) -> Result<&'a Var<R>> {
        self.var
            .downcast_ref::<Var<R>>()
            .ok_or(Error::CaptureRuntime {
                field: self.decl.name,
                expected: std::any::type_name::<R>(),
                got: self.runtime,
            })
    }
}

/// Check a tensor's shape and dtype against its declaration for `p`.
pub fn check(decl: &TensorDecl, shape: &[usize], dtype: DType, p: &Problem) -> Result<()> {
    // A `bool` tensor may come as numr's `Bool` or as `U8` (0 false).
    let bytes = decl.given == Given::Bool && dtype == DType::U8;
    if dtype != decl.dtype() && !bytes {
        return Err(Error::CaptureDType {
            field: decl.name,
            expected: decl.dtype(),
            got: dtype,
        });
    }
    let expected = decl.expected(p);
    let fits = shape.len() == expected.len()
        && shape
            .iter()
            .zip(&expected)
            .all(|(&got, want)| want.is_none_or(|w| w == got));
    if !fits || shape.contains(&0) {
        return Err(Error::CaptureShape {
            field: decl.name,
            expected: decl.describe(p),
            got: shape.to_vec(),
        });
    }
    // Every index and every arena offset is 32-bit on the GPU targets.
    let numel: usize = shape.iter().product();
    if numel > i32::MAX as usize {
        return Err(Error::TooLarge {
            name: decl.name,
            value: numel,
            max: i32::MAX as usize,
        });
    }
    Ok(())
}

/// The element types of captured tensors.
pub trait Element: numr::dtype::Element + Default + Send + Sync + fmt::Debug + 'static {
    /// Its type in the language.
    const TY: Ty;
    /// The value as the classifiers' summaries hold it (only `i32`
    /// tensors are summarized).
    fn summary_value(self) -> i32;
}

impl Element for i32 {
    const TY: Ty = Ty::I32;
    fn summary_value(self) -> i32 {
        self
    }
}

impl Element for u32 {
    const TY: Ty = Ty::U32;
    fn summary_value(self) -> i32 {
        self as i32
    }
}

impl Element for f32 {
    const TY: Ty = Ty::F32;
    fn summary_value(self) -> i32 {
        self.to_bits() as i32
    }
}

/// The least and greatest element of every block of [`SUMMARY_BLOCK`]
/// positions along one axis, for every value of the other indices (the
/// layout of `kernels_spec::params::summary_words`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Summary {
    min: Vec<i32>,
    max: Vec<i32>,
}

/// A captured tensor on the host, checked against its declaration: what the
/// CPU kernels read.
#[derive(Debug)]
pub struct HostTensor<T: Element, const N: usize> {
    /// Keeps the storage alive; contiguous.
    _tensor: Tensor<CpuRuntime>,
    data: *const T,
    len: usize,
    dims: [usize; N],
    summaries: [Option<Summary>; N],
    /// The least (site, index) of the checked reads out of range so far.
    out_of_range: Mutex<Option<(u32, [i64; N])>>,
}

// SAFETY: `data` points into `_tensor`'s host storage, which the struct
// owns and never writes; the struct is only read through `&self`.
unsafe impl<T: Element, const N: usize> Send for HostTensor<T, N> {}
// SAFETY: as above; the only interior mutability is the `Mutex`.
unsafe impl<T: Element, const N: usize> Sync for HostTensor<T, N> {}

impl<T: Element, const N: usize> HostTensor<T, N> {
    /// `tensor` (a field of a variant on runtime `R`) on the host, checked
    /// against `decl` for `p`, with summaries along `summary_axes`. A tensor
    /// of another runtime is an error: the CPU kernels read host memory.
    pub fn capture<R: Runtime>(
        decl: &'static TensorDecl,
        tensor: &Tensor<R>,
        p: &Problem,
        summary_axes: &[usize],
    ) -> Result<Self> {
        let t: Tensor<CpuRuntime> = Capture::new(decl, tensor).on::<CpuRuntime>(p)?;
        Ok(Self::from_tensor(t, summary_axes))
    }

    /// `tensor` (a field of a variant on any runtime), checked against
    /// `decl` for `p` and copied to the host, with summaries along
    /// `summary_axes`: the reference's view of a variant on a GPU.
    pub fn copy<R: Runtime<DType = DType>>(
        decl: &'static TensorDecl,
        tensor: &Tensor<R>,
        p: &Problem,
        summary_axes: &[usize],
    ) -> Result<Self> {
        let t = Capture::new(decl, tensor).on::<R>(p)?;
        let values: Vec<T> = t.try_to_vec()?;
        let host = Tensor::<CpuRuntime>::from_slice(
            &values,
            t.shape(),
            &numr::runtime::cpu::CpuDevice::new(),
        )?;
        Ok(Self::from_tensor(host, summary_axes))
    }

    /// A checked, contiguous host tensor of this element type and rank.
    fn from_tensor(t: Tensor<CpuRuntime>, summary_axes: &[usize]) -> Self {
        debug_assert_eq!(t.dtype(), <T as numr::dtype::Element>::DTYPE);
        let dims: [usize; N] = t.shape().try_into().expect("checked rank");
        let len = t.numel();
        let data = t.ptr() as *const T;
        let mut out = HostTensor {
            _tensor: t,
            data,
            len,
            dims,
            summaries: std::array::from_fn(|_| None),
            out_of_range: Mutex::new(None),
        };
        if T::TY == Ty::I32 {
            for &axis in summary_axes {
                out.summaries[axis] = Some(out.summarize(axis));
            }
        }
        out
    }

    fn values(&self) -> &[T] {
        // SAFETY: `data` is the start of `_tensor`'s contiguous host storage
        // of `len` elements of `T` (dtype checked), alive as long as `self`.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }

    /// The linear position of `index`, if it is inside the tensor.
    fn position(&self, index: [i64; N]) -> Option<usize> {
        let mut at = 0usize;
        for (&i, &d) in index.iter().zip(&self.dims) {
            if i < 0 || i as u64 >= d as u64 {
                return None;
            }
            at = at * d + i as usize;
        }
        Some(at)
    }

    /// The element at `index`, proved in range by the compiler.
    #[inline]
    pub fn at(&self, index: [i64; N]) -> T {
        let at = self.position(index).expect("a proved read is in range");
        self.values()[at]
    }

    /// The element at `index`, or, out of range, zero (and the read is
    /// reported by [`HostTensor::error`]).
    #[inline]
    pub fn checked(&self, site: u32, index: [i64; N]) -> T {
        match self.position(index) {
            Some(at) => self.values()[at],
            None => {
                let mut first = self.out_of_range.lock().unwrap_or_else(|e| e.into_inner());
                if first.is_none_or(|f| (site, index) < f) {
                    *first = Some((site, index));
                }
                T::default()
            }
        }
    }

    /// The dimension `axis`, as the classifiers take it.
    #[inline]
    pub fn dim_i32(&self, axis: usize) -> i32 {
        self.dims[axis] as i32
    }

    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.dims
    }

    /// Its number of elements.
    pub fn numel(&self) -> usize {
        self.len
    }

    fn summarize(&self, axis: usize) -> Summary {
        let d = self.dims[axis];
        let inner: usize = self.dims[axis + 1..].iter().product();
        let outer: usize = self.dims[..axis].iter().product();
        let blocks = summary_blocks(d);
        let mut s = Summary {
            min: vec![i32::MAX; outer * blocks * inner],
            max: vec![i32::MIN; outer * blocks * inner],
        };
        let values = self.values();
        for o in 0..outer {
            for i in 0..d {
                let row = &values[(o * d + i) * inner..(o * d + i + 1) * inner];
                let at = (o * blocks + i / SUMMARY_BLOCK) * inner;
                for (j, &v) in row.iter().enumerate() {
                    s.min[at + j] = s.min[at + j].min(v.summary_value());
                    s.max[at + j] = s.max[at + j].max(v.summary_value());
                }
            }
        }
        s
    }

    /// The error of the least read out of range, if any, as field `name`.
    pub fn error(&self, name: &'static str) -> Option<Error> {
        let first = *self.out_of_range.lock().unwrap_or_else(|e| e.into_inner());
        first.map(|(_, index)| Error::IndexOutOfRange {
            field: name,
            index: index.to_vec(),
            shape: self.dims.to_vec(),
        })
    }
}

impl<const N: usize> HostTensor<f32, N> {
    /// Add `delta` to the element at linear position `at`, in a private
    /// copy (the caller's tensor is never written), and return the change
    /// made (`fl(x + delta) − x`, exact): for finite-difference checks.
    #[doc(hidden)]
    pub fn perturb(&mut self, at: usize, delta: f32) -> f32 {
        let mut values = self.values().to_vec();
        let old = values[at];
        values[at] += delta;
        let change = values[at] - old;
        let t = Tensor::<CpuRuntime>::from_slice(
            &values,
            &self.dims,
            &numr::runtime::cpu::CpuDevice::new(),
        )
        .expect("a host tensor of a checked shape");
        self.data = t.ptr() as *const f32;
        self._tensor = t;
        change
    }
}

impl<const N: usize> HostTensor<i32, N> {
    /// The element at `index` for a classifier: `i32::MIN` (`i32::MAX` for
    /// `max`) outside the tensor.
    #[inline]
    pub fn bound_at(&self, index: [i64; N], max: bool) -> i32 {
        match self.position(index) {
            Some(at) => self.values()[at],
            None if max => i32::MAX,
            None => i32::MIN,
        }
    }

    /// A bound on the least (or, `max`, greatest) element where index `axis`
    /// runs over `index[axis] ..= hi`: from the summary's blocks covering the
    /// range, or the unbounded value where the range is empty, outside the
    /// tensor or wider than `SUMMARY_MAX_BLOCKS` blocks (the semantics of
    /// `ir::ReadRange`, the same on every target).
    #[inline]
    pub fn range_bound(&self, axis: usize, index: [i64; N], hi: i64, max: bool) -> i32 {
        let unbounded = if max { i32::MAX } else { i32::MIN };
        let lo = index[axis];
        let inside = index
            .iter()
            .zip(&self.dims)
            .enumerate()
            .all(|(a, (&i, &d))| a == axis || (i >= 0 && (i as u64) < d as u64));
        let d = self.dims[axis] as i64;
        if !inside || lo < 0 || lo > hi || hi >= d {
            return unbounded;
        }
        let (first, last) = (lo as usize / SUMMARY_BLOCK, hi as usize / SUMMARY_BLOCK);
        if last - first + 1 > SUMMARY_MAX_BLOCKS {
            return unbounded;
        }
        let Some(s) = &self.summaries[axis] else {
            return unbounded;
        };
        let blocks = summary_blocks(self.dims[axis]);
        let inner: usize = self.dims[axis + 1..].iter().product();
        let linear = |dims: &[usize], index: &[i64]| {
            dims.iter()
                .zip(index)
                .fold(0usize, |at, (&d, &i)| at * d + i as usize)
        };
        let outer_at = linear(&self.dims[..axis], &index[..axis]);
        let inner_at = linear(&self.dims[axis + 1..], &index[axis + 1..]);
        let entries = if max { &s.max } else { &s.min };
        (first..=last)
            .map(|blk| entries[(outer_at * blocks + blk) * inner + inner_at])
            .fold(if max { i32::MIN } else { i32::MAX }, |acc, v| {
                if max { acc.max(v) } else { acc.min(v) }
            })
    }
}

/// Write each tensor's place in the capture arena into the parameter block:
/// for tensor `t` of `shapes` (checked against its declaration), at word
/// `slots[t].0` (its slot, of declared rank `slots[t].1`), its arena offset,
/// its dimensions, and the arena offsets of its `summaries`, or of a
/// `learnable` tensor's gradient accumulators
/// (`kernels_spec::params::Arena` lays them out, the same on every target).
pub fn place_tensors(
    words: &mut ParamWords,
    slots: &[(usize, usize)],
    shapes: &[&[usize]],
    summaries: &[(usize, usize)],
    learnable: &[usize],
) {
    let arena = Arena::new(shapes, summaries, learnable);
    let mut put = |word: usize, value: usize| {
        if let Some(w) = words.0.get_mut(word) {
            *w = u32::try_from(value).unwrap_or(u32::MAX);
        }
    };
    for (t, (&(slot, rank), shape)) in slots.iter().zip(shapes).enumerate() {
        put(slot, arena.tensors[t]);
        for (axis, &d) in shape.iter().take(rank).enumerate() {
            put(slot + 1 + axis, d);
        }
    }
    for (s, &(t, axis)) in summaries.iter().enumerate() {
        let (slot, rank) = slots[t];
        if axis < rank {
            put(slot + 1 + rank + axis, arena.summaries[s]);
        }
    }
    for (&t, &at) in learnable.iter().zip(&arena.grads) {
        let (slot, rank) = slots[t];
        if rank > 0 {
            put(slot + 1 + rank, at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;
    use numr::runtime::cpu::CpuDevice;

    fn host(values: &[i32], shape: [usize; 2], axis: usize) -> HostTensor<i32, 2> {
        let t = Tensor::<CpuRuntime>::from_slice(values, &shape, &CpuDevice::new()).unwrap();
        HostTensor::from_tensor(t, &[axis])
    }

    /// Along either axis of a `[5, 77]` tensor (and `[77, 5]`), the bound of
    /// every range of up to `SUMMARY_MAX_BLOCKS` blocks is the least (or
    /// greatest) element of the blocks that cover it: never inside the
    /// range's own values, equal to them on block-aligned ranges; unbounded
    /// for empty, out-of-range and too-wide ranges.
    #[test]
    fn range_bounds_cover_the_range_from_its_blocks() {
        let mut rng = Rng::new(5, 0);
        for axis in 0..2 {
            let shape = if axis == 1 { [5, 77] } else { [77, 5] };
            let values: Vec<i32> = (0..5 * 77)
                .map(|_| (rng.uniform() * 2000.0) as i32 - 1000)
                .collect();
            let t = host(&values, shape, axis);
            let at = |o: usize, i: usize| {
                if axis == 1 {
                    values[o * 77 + i]
                } else {
                    values[i * 5 + o]
                }
            };
            let index = |o: usize, i: i64| {
                if axis == 1 {
                    [o as i64, i]
                } else {
                    [i, o as i64]
                }
            };
            for o in 0..5 {
                for lo in 0..77i64 {
                    for hi in lo..77i64 {
                        let blocks =
                            (hi as usize / SUMMARY_BLOCK) - (lo as usize / SUMMARY_BLOCK) + 1;
                        let (min, max) = (
                            t.range_bound(axis, index(o, lo), hi, false),
                            t.range_bound(axis, index(o, lo), hi, true),
                        );
                        if blocks > SUMMARY_MAX_BLOCKS {
                            assert_eq!((min, max), (i32::MIN, i32::MAX));
                            continue;
                        }
                        let first = lo as usize / SUMMARY_BLOCK * SUMMARY_BLOCK;
                        let last = ((hi as usize / SUMMARY_BLOCK + 1) * SUMMARY_BLOCK).min(77);
                        let covered: Vec<i32> = (first..last).map(|i| at(o, i)).collect();
                        assert_eq!(min, *covered.iter().min().unwrap());
                        assert_eq!(max, *covered.iter().max().unwrap());
                        let own: Vec<i32> = (lo as usize..=hi as usize).map(|i| at(o, i)).collect();
                        assert!(min <= *own.iter().min().unwrap());
                        assert!(max >= *own.iter().max().unwrap());
                    }
                }
                // Empty, and outside the tensor: unbounded.
                assert_eq!(t.range_bound(axis, index(o, 9), 8, false), i32::MIN);
                assert_eq!(t.range_bound(axis, index(o, -1), 3, true), i32::MAX);
                assert_eq!(t.range_bound(axis, index(o, 70), 77, false), i32::MIN);
            }
        }
    }

    #[test]
    fn checked_reads_report_the_least_site_and_index() {
        let t = host(&[1, 2, 3, 4, 5, 6], [2, 3], 1);
        assert_eq!(t.checked(1, [1, 2]), 6);
        assert!(t.error("t").is_none());
        assert_eq!(t.checked(3, [0, 3]), 0);
        assert_eq!(t.checked(1, [2, 0]), 0);
        assert_eq!(t.checked(1, [-1, 0]), 0);
        let e = t.error("t").expect("reads out of range");
        assert!(
            matches!(&e, Error::IndexOutOfRange { field: "t", index, shape }
                if *index == [-1, 0] && *shape == [2, 3]),
            "{e}"
        );
    }

    #[test]
    fn the_arena_record_decodes_to_the_error() {
        const DECLS: &[TensorDecl] = &[TensorDecl {
            name: "doc",
            elem: Ty::I32,
            given: Given::Elem,
            dims: &[DimDecl::Size(Size::B), DimDecl::Size(Size::Sk)],
        }];
        const CHECKS: &[ReadCheck] = &[ReadCheck {
            site: 3,
            tensor: 0,
            signed: &[true, true],
            holds: &[],
        }];
        let shapes: &[&[usize]] = &[&[2, 9]];
        let target = kernels_spec::emit::Target::Wgsl;
        assert!(read_error(target, CHECKS, DECLS, shapes, &[0; 8]).is_none());
        let record = [4, 1, (-2i32) as u32, 0, 0, 0, 0, 1];
        let e = read_error(target, CHECKS, DECLS, shapes, &record);
        assert!(
            matches!(&e, Some(Error::IndexOutOfRange { field: "doc", index, shape })
                if *index == [1, -2] && *shape == [2, 9]),
            "{e:?}"
        );
        // A site the variant does not have is an error too, never a pass.
        let e = read_error(target, CHECKS, DECLS, shapes, &[9, 0, 0, 0, 0, 0, 0, 1]);
        assert!(matches!(e, Some(Error::Backend(_))), "{e:?}");
    }

    #[test]
    fn checks_hold_from_the_sizes_alone() {
        let p = Problem::new(1, (2, 1), (5, 9), 8);
        // `Sk - Sq >= 0`: holds for Sq <= Sk.
        const HOLDS: &[Holds] = &[Holds::NonNegative(SizeForm {
            constant: 0,
            per_size: [0, 0, 0, -1, 1],
        })];
        let checks = [ReadCheck {
            site: 0,
            tensor: 0,
            signed: &[true],
            holds: HOLDS,
        }];
        assert!(checks_hold(&checks, &p, &[&[9]]));
        assert!(!checks_hold(&checks, &Problem { seq_q: 10, ..p }, &[&[9]]));
        // `Sk - 1 < dim 0`, for an `_` dimension.
        const BELOW: &[Holds] = &[Holds::BelowDim(
            SizeForm {
                constant: -1,
                per_size: [0, 0, 0, 0, 1],
            },
            0,
        )];
        let checks = [ReadCheck {
            holds: BELOW,
            ..checks[0]
        }];
        assert!(checks_hold(&checks, &p, &[&[9]]));
        assert!(!checks_hold(&checks, &p, &[&[8]]));
        let checks = [ReadCheck {
            holds: &[Holds::Never],
            ..checks[0]
        }];
        assert!(!checks_hold(&checks, &p, &[&[9]]));
    }

    #[test]
    fn the_parameter_block_places_each_tensor_and_its_summaries() {
        use crate::Variant;
        let ids: Vec<i32> = (0..80).map(|i| i / 7).collect();
        let doc = Tensor::<CpuRuntime>::from_slice(&ids, &[2, 40], &CpuDevice::new()).unwrap();
        let words = crate::stock::Documents { doc }.param_words().0;
        // `doc`: its offset after the error words, its dimensions, then the
        // arena offsets of its summaries (none along axis 0; along axis 1
        // after the 80 elements).
        let arena = Arena::new(&[&[2, 40]], &[(0, 1)], &[]);
        assert_eq!(arena.tensors, [kernels_spec::params::ERROR_WORDS]);
        assert_eq!(
            &words[..5],
            &[arena.tensors[0] as u32, 2, 40, 0, arena.summaries[0] as u32]
        );
        assert_eq!(arena.summaries[0], kernels_spec::params::ERROR_WORDS + 80);
        assert!(words[5..].iter().all(|&w| w == 0));
    }
}
