//! The ring's sums and merges on the CPU, in place and in one pass each.
//!
//! On other runtimes the ring composes numr's elementwise ops (a cast, a
//! maximum, exponentials, products: each a pass over its tensors, each
//! allocating its result). On the CPU those passes cost about 3 ns an
//! element, which at S = 8192 was a tenth of a bf16 ring's time; the
//! loops here read each element once and write the accumulator in place.
//! Each returns `None` where it does not apply (another runtime, a layout
//! it does not read), and the caller falls back to numr's ops.

use crate::cpu::weights::RowWeights as _;
use crate::variant::Weights;
use half::{bf16, f16};
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::runtime::cpu::CpuRuntime;
use numr::tensor::Tensor;
use rayon::prelude::*;
use std::any::Any;

type Cpu = Tensor<CpuRuntime>;

/// `t` as a CPU tensor, if `R` is the CPU.
fn as_cpu<R: Runtime>(t: &Tensor<R>) -> Option<&Cpu> {
    (t as &dyn Any).downcast_ref::<Cpu>()
}

/// A CPU tensor as the caller's `Tensor<R>` (`R` is the CPU).
fn from_cpu<R: Runtime>(t: Cpu) -> Option<Tensor<R>> {
    let boxed: Box<dyn Any> = Box::new(t);
    boxed.downcast::<Tensor<R>>().ok().map(|b| *b)
}

/// The elements of a contiguous f32, bf16 or f16 CPU tensor, widened.
enum Elems<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl Elems<'_> {
    fn of(t: &Cpu) -> Option<Elems<'_>> {
        if !t.is_contiguous() {
            return None;
        }
        let (ptr, n) = (t.ptr(), t.numel());
        // SAFETY: a contiguous CPU tensor of `n` elements of its dtype
        // starts at `ptr`, and `t` keeps its storage alive while borrowed.
        unsafe {
            Some(match t.dtype() {
                DType::F32 => Elems::F32(std::slice::from_raw_parts(ptr as *const f32, n)),
                DType::BF16 => Elems::Bf16(std::slice::from_raw_parts(ptr as *const bf16, n)),
                DType::F16 => Elems::F16(std::slice::from_raw_parts(ptr as *const f16, n)),
                _ => return None,
            })
        }
    }

    /// Apply `f(dst[i], src[i] as f32)` over `dst`, in parallel blocks.
    fn zip_into(&self, dst: &mut [f32], f: impl Fn(&mut f32, f32) + Sync) {
        const BLOCK: usize = 1 << 14;
        macro_rules! run {
            ($src:expr, $wide:expr) => {
                dst.par_chunks_mut(BLOCK)
                    .zip($src.par_chunks(BLOCK))
                    .for_each(|(d, s)| {
                        for (d, &s) in d.iter_mut().zip(s) {
                            f(d, $wide(s));
                        }
                    })
            };
        }
        match self {
            Elems::F32(s) => run!(s, |x: f32| x),
            Elems::Bf16(s) => run!(s, bf16::to_f32),
            Elems::F16(s) => run!(s, f16::to_f32),
        }
    }
}

/// The f32 values of `t`, to write, if `t` is a contiguous f32 CPU tensor
/// whose storage nothing else holds.
fn unique_f32(t: &mut Cpu) -> Option<&mut [f32]> {
    if t.dtype() != DType::F32 || !t.is_contiguous() || !t.storage().is_unique() {
        return None;
    }
    // SAFETY: the storage is this tensor's alone (checked above) and holds
    // its `numel` contiguous f32 from `ptr`; `&mut t` keeps it borrowed.
    Some(unsafe { std::slice::from_raw_parts_mut(t.ptr() as *mut f32, t.numel()) })
}

/// `t` as a CPU tensor, by value, or `t` back.
fn into_cpu<R: Runtime>(t: Tensor<R>) -> Result<Cpu, Tensor<R>> {
    let boxed: Box<dyn Any> = Box::new(t);
    match boxed.downcast::<Cpu>() {
        Ok(cpu) => Ok(*cpu),
        Err(boxed) => Err(*boxed
            .downcast::<Tensor<R>>()
            .expect("the box holds the tensor it was given")),
    }
}

/// `x` widened into a new f32 tensor, which the caller holds alone.
fn widened(x: &Cpu, xs: &Elems<'_>) -> Option<Cpu> {
    let mut wide = Cpu::zeros(x.shape(), DType::F32, x.device()).ok()?;
    xs.zip_into(unique_f32(&mut wide)?, |d, s| *d = s);
    Some(wide)
}

/// `*acc += x` in f32 on the CPU, in place (`acc` becomes `x` in f32 when
/// `None`). `false`, with `acc` as it was, where this does not apply: `acc`
/// is then summed with numr's ops.
pub(super) fn add_into<R: Runtime>(acc: &mut Option<Tensor<R>>, x: &Tensor<R>) -> bool {
    let Some(x) = as_cpu(x) else { return false };
    let Some(xs) = Elems::of(x) else { return false };
    match acc.take() {
        None => match widened(x, &xs).and_then(from_cpu) {
            Some(wide) => {
                *acc = Some(wide);
                true
            }
            None => false,
        },
        Some(t) => match into_cpu(t) {
            Ok(mut sum) => {
                let added = sum.shape() == x.shape()
                    && unique_f32(&mut sum).is_some_and(|dst| {
                        xs.zip_into(dst, |d, s| *d += s);
                        true
                    });
                *acc = from_cpu(sum);
                added
            }
            Err(t) => {
                *acc = Some(t);
                false
            }
        },
    }
}

/// Merge the partial `(out, lse)` of more keys into `(acc_out, acc_lse)`
/// (`[rows, Dv]` and `[rows]`) on the CPU, in one pass, as `weights`
/// merges partial rows (the softmax over both key sets; sigmoid weights'
/// sum), in f32, as new tensors. `None` where this does not apply.
pub(super) fn merge<R: Runtime>(
    weights: Weights,
    (acc_out, acc_lse): (&Tensor<R>, &Tensor<R>),
    out: &Tensor<R>,
    lse: &Tensor<R>,
) -> Option<(Tensor<R>, Tensor<R>)> {
    {
        let (out, lse) = (as_cpu(out)?, as_cpu(lse)?);
        let (outs, lses) = (Elems::of(out)?, Elems::of(lse)?);
        let Elems::F32(l2) = lses else { return None };
        let (acc_out, acc_lse) = (as_cpu(acc_out)?, as_cpu(acc_lse)?);
        if acc_out.shape() != out.shape() || acc_lse.shape() != lse.shape() {
            return None;
        }
        // Fresh f32 accumulators when ours are not (the first partial, in
        // its dtype, or held elsewhere).
        let mut o1 = widened(acc_out, &Elems::of(acc_out)?)?;
        let mut l1 = widened(acc_lse, &Elems::of(acc_lse)?)?;
        let dv = *out.shape().last()?;
        {
            let (o1s, l1s) = (unique_f32(&mut o1)?, unique_f32(&mut l1)?);
            let rows = o1s
                .par_chunks_mut(dv)
                .zip(l1s.par_iter_mut())
                .zip(l2.par_iter())
                .enumerate();
            macro_rules! run {
                ($o2:expr, $wide:expr) => {
                    rows.for_each(|(r, ((o1, l1), &l2))| {
                        let m = l1.max(l2);
                        let (w1, w2) = (weights.merge(*l1, m), weights.merge(l2, m));
                        let sum = w1 + w2;
                        let scale = weights.scale(sum);
                        let (a1, a2) = (w1 * scale, w2 * scale);
                        for (o1, &o2) in o1.iter_mut().zip(&$o2[r * dv..(r + 1) * dv]) {
                            *o1 = a1 * *o1 + a2 * $wide(o2);
                        }
                        *l1 = weights.lse(m, sum);
                    })
                };
            }
            match outs {
                Elems::F32(o2) => run!(o2, |x: f32| x),
                Elems::Bf16(o2) => run!(o2, bf16::to_f32),
                Elems::F16(o2) => run!(o2, f16::to_f32),
            }
        }
        Some((from_cpu(o1)?, from_cpu(l1)?))
    }
}
