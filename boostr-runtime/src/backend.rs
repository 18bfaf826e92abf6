//! The numr runtimes that attention runs on. Each backend owns its launch:
//! there is no dispatch table over targets in shared code.

use crate::cpu::aligned::Aligned;
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::validate;
use crate::variant::Variant;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::runtime::cpu::CpuRuntime;
use numr::tensor::Tensor;
use rayon::prelude::*;

/// A numr runtime with fused attention kernels. (`Debug`, as numr's
/// runtimes are: a variant generic over its runtime derives `Debug`, which
/// then holds for every `R: AttentionRuntime`.)
pub trait AttentionRuntime: Runtime<DType = DType> + std::fmt::Debug {
    /// Run the forward kernel on validated inputs; returns `(out, lse)`.
    fn attention_forward<V: Variant>(
        variant: &V,
        problem: &Problem,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)>;

    /// Run the forward over a KV cache on validated inputs: `k, v` hold
    /// `Sk` (the capacity) slots per sequence, of which sequence `b` uses
    /// `lengths.host[b]` (see [`crate::KvCache`]); returns `(out, lse)`.
    /// Backends without such a kernel return
    /// [`Error::LayoutUnsupported`].
    fn attention_forward_cache<V: Variant>(
        variant: &V,
        problem: &Problem,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        lengths: CacheLengths<'_, Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        let _ = (variant, problem, q, k, v, lengths);
        Err(crate::Error::LayoutUnsupported {
            backend: Self::name(),
            layout: "a KV cache with per-sequence lengths",
        })
    }

    /// Run the forward over a paged KV cache on validated inputs (see
    /// [`crate::PagedKvCache`]): `problem.seq_k` is `max_pages ·
    /// page_size`; returns `(out, lse)`. Backends without such a kernel
    /// return [`Error::LayoutUnsupported`].
    fn attention_forward_paged<V: Variant>(
        variant: &V,
        problem: &Problem,
        q: &Tensor<Self>,
        pages: Pages<'_, Self>,
        lengths: CacheLengths<'_, Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        let _ = (variant, problem, q, pages, lengths);
        Err(crate::Error::LayoutUnsupported {
            backend: Self::name(),
            layout: "a paged KV cache",
        })
    }

    /// Run the backward kernels on validated inputs; returns `dq, dk, dv`
    /// and the gradient of each learnable tensor that
    /// [`BackwardTensors::tensor_grads`] asks for.
    fn attention_backward<V: Variant>(
        variant: &V,
        problem: &Problem,
        tensors: BackwardTensors<'_, Self>,
    ) -> Result<AttentionGrads<Self>>;
}

/// The validated per-sequence key lengths of a KV cache: the `[B]` `i32`
/// tensor on the call's device, and its values on the host (each in
/// `0 ..= capacity`).
#[derive(Debug)]
pub struct CacheLengths<'a, R: Runtime> {
    /// The lengths as given.
    pub tensor: &'a Tensor<R>,
    /// Their values.
    pub host: &'a [usize],
}

/// The validated pages of a paged KV cache.
#[derive(Debug)]
pub struct Pages<'a, R: Runtime> {
    /// `k [pages, Hkv, page_size, D]`.
    pub k: &'a Tensor<R>,
    /// `v [pages, Hkv, page_size, D]`.
    pub v: &'a Tensor<R>,
    /// Keys per page.
    pub page_size: usize,
    /// The `[B, max_pages]` `i32` page table as given.
    pub table: &'a Tensor<R>,
    /// Its values, every entry a length reaches a valid page (the others
    /// 0, never read).
    pub host: &'a [usize],
}

/// What the backward returns: the gradients of the loss with respect to
/// `q, k, v`, and to the variant's learnable tensors.
#[derive(Debug)]
pub struct AttentionGrads<R: Runtime> {
    /// `d loss / d q [B, Hq, Sq, D]`.
    pub dq: Tensor<R>,
    /// `d loss / d k [B, Hkv, Sk, D]`.
    pub dk: Tensor<R>,
    /// `d loss / d v [B, Hkv, Sk, D]`.
    pub dv: Tensor<R>,
    /// Per learnable tensor, in slot order ([`Variant::LEARNABLE`]): its
    /// gradient (f32, its shape), or `None` where it was not asked for.
    pub tensors: Vec<Option<Tensor<R>>>,
}

/// What the backward reads: the forward's inputs and results, and the
/// gradient of the loss with respect to `out`. Shapes as in [`Problem`].
#[derive(Debug)]
pub struct BackwardTensors<'a, R: Runtime> {
    /// `q [B, Hq, Sq, D]`.
    pub q: &'a Tensor<R>,
    /// `k [B, Hkv, Sk, D]`.
    pub k: &'a Tensor<R>,
    /// `v [B, Hkv, Sk, D]`.
    pub v: &'a Tensor<R>,
    /// The forward's `out [B, Hq, Sq, D]`.
    pub out: &'a Tensor<R>,
    /// The forward's `lse [B, Hq, Sq]` (f32).
    pub lse: &'a Tensor<R>,
    /// `d loss / d out [B, Hq, Sq, D]`.
    pub dout: &'a Tensor<R>,
    /// Which learnable tensors' gradients to compute, by slot
    /// ([`Variant::LEARNABLE`]); missing slots are not computed (`&[]`: no
    /// tensor gradient, no extra work).
    pub tensor_grads: &'a [bool],
    /// Over a KV cache: `k, v` (and `dk, dv`) hold `Sk` slots per
    /// sequence, of which sequence `b` has `lengths.host[b]` (see
    /// [`crate::KvCache`]); spare slots get zero gradients. Backends
    /// without a cache backward return [`Error::LayoutUnsupported`].
    pub lengths: Option<CacheLengths<'a, R>>,
}

impl<R: Runtime> Clone for BackwardTensors<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: Runtime> Copy for BackwardTensors<'_, R> {}

impl<R: Runtime> Clone for CacheLengths<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: Runtime> Copy for CacheLengths<'_, R> {}

impl<R: Runtime> Clone for Pages<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: Runtime> Copy for Pages<'_, R> {}

const CPU: &str = "cpu";
const CPU_DTYPES: &str = "f32, f16 and bf16 (f16/bf16 computed in f32)";

/// Elements per parallel task of the dtype conversions (memory-bound).
const CONVERT_BLOCK: usize = 1 << 16;

/// An input of the CPU kernels: contiguous f32 on the host. An f32 tensor is
/// used in place; f16 and bf16 are widened into a copy (exactly: every f16
/// and bf16 value is an f32), because the kernels compute in f32 — see
/// [`crate::cpu`] for why that is also the fastest choice for bf16 on CPUs
/// without AMX.
/// An input of a CPU call: f32, f16 or bf16, and `dtype` (all tensors of
/// one call share q's dtype).
fn check_input(name: &'static str, t: &Tensor<CpuRuntime>, dtype: DType) -> Result<()> {
    validate::check_dtype(
        name,
        t,
        CPU,
        &[DType::F32, DType::F16, DType::BF16],
        CPU_DTYPES,
    )?;
    if t.dtype() != dtype {
        return Err(Error::DType {
            name,
            dtype: t.dtype(),
            backend: CPU,
            supported: "the dtype of q (q, k, v, out and dout share one dtype)",
        });
    }
    Ok(())
}

enum HostF32 {
    Tensor(Tensor<CpuRuntime>),
    Widened(Aligned<f32>),
}

impl HostF32 {
    /// `t` as f32; its dtype must be f32, f16 or bf16 and equal `dtype`
    /// (all tensors of one call share q's dtype).
    fn new(name: &'static str, t: &Tensor<CpuRuntime>, dtype: DType) -> Result<Self> {
        check_input(name, t, dtype)?;
        let t = t.contiguous()?;
        if dtype == DType::F32 {
            return Ok(Self::Tensor(t));
        }
        let mut wide = Aligned::<f32>::scratch(t.numel());
        // SAFETY: `t` is contiguous with its offset folded into `ptr()` and
        // holds `numel()` 2-byte values (f16 or bf16 bits, checked above);
        // `t` outlives the borrow.
        let bits = unsafe { std::slice::from_raw_parts(t.ptr() as *const u16, t.numel()) };
        wide.par_chunks_mut(CONVERT_BLOCK)
            .zip(bits.par_chunks(CONVERT_BLOCK))
            .for_each(|(dst, src)| match dtype {
                DType::F16 => src
                    .reinterpret_cast::<half::f16>()
                    .convert_to_f32_slice(dst),
                _ => src
                    .reinterpret_cast::<half::bf16>()
                    .convert_to_f32_slice(dst),
            });
        Ok(Self::Widened(wide))
    }

    fn slice(&self) -> &[f32] {
        match self {
            // SAFETY: the tensor is contiguous f32 with its offset folded
            // into `ptr()`, holds `numel()` values on the host, and `self`
            // keeps its storage alive for the borrow.
            Self::Tensor(t) => unsafe {
                std::slice::from_raw_parts(t.ptr() as *const f32, t.numel())
            },
            Self::Widened(v) => &v[..],
        }
    }
}

/// A KV cache's keys or values as stored on the host, f32, f16 or bf16:
/// the decode kernel widens them one key block at a time, so a 16-bit
/// cache is never copied whole.
struct HostElems(Tensor<CpuRuntime>);

impl HostElems {
    /// `t`, of `dtype` (one of the CPU's), contiguous.
    fn new(name: &'static str, t: &Tensor<CpuRuntime>, dtype: DType) -> Result<Self> {
        check_input(name, t, dtype)?;
        Ok(Self(t.contiguous()?))
    }

    /// The elements as `E`.
    ///
    /// # Safety
    /// `E` must be the tensor's element type (f32, `half::f16` or
    /// `half::bf16` for its dtype).
    unsafe fn slice<E>(&self) -> &[E] {
        // SAFETY: contiguous, offset folded into `ptr()`, `numel()` values
        // of `E` (the caller's promise), alive as long as `self`.
        unsafe { std::slice::from_raw_parts(self.0.ptr() as *const E, self.0.numel()) }
    }
}

/// Where a CPU cache forward reads its keys.
enum CacheLayout<'a> {
    Lengths,
    Pages {
        table: &'a [usize],
        page_size: usize,
    },
}

/// The CPU forward over a KV cache in the cache's own element type.
#[allow(clippy::too_many_arguments)]
fn cpu_cache_forward<V: Variant, E: crate::cpu::KvElem>(
    variant: &V,
    p: &Problem,
    lens: &[usize],
    layout: &CacheLayout<'_>,
    q: &[f32],
    k: &[E],
    v: &[E],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    match layout {
        CacheLayout::Lengths => crate::cpu::forward_cache(variant, p, lens, q, k, v, out, lse),
        CacheLayout::Pages { table, page_size } => {
            crate::cpu::forward_paged(variant, p, lens, table, *page_size, q, k, v, out, lse)
        }
    }
}

/// [`cpu_cache_forward`] for a call: `out` and `lse` in q's dtype.
fn cpu_cache_call<V: Variant>(
    variant: &V,
    p: &Problem,
    lens: &[usize],
    layout: CacheLayout<'_>,
    q: &Tensor<CpuRuntime>,
    k: &Tensor<CpuRuntime>,
    v: &Tensor<CpuRuntime>,
) -> Result<(Tensor<CpuRuntime>, Tensor<CpuRuntime>)> {
    let (dtype, device) = (q.dtype(), q.device());
    let q = HostF32::new("q", q, dtype)?;
    let (k, v) = (
        HostElems::new("k", k, dtype)?,
        HostElems::new("v", v, dtype)?,
    );
    let mut out = Output::new(&[p.batch, p.heads_q, p.seq_q, p.head_dim], dtype, device)?;
    let mut lse = Output::new(&[p.batch, p.heads_q, p.seq_q], DType::F32, device)?;
    let (qs, o, l) = (q.slice(), out.slice_mut(), lse.slice_mut());
    // SAFETY: each arm reads the elements as the type of the dtype it
    // matched (checked by `HostElems::new`).
    unsafe {
        match dtype {
            DType::F16 => cpu_cache_forward::<V, half::f16>(
                variant,
                p,
                lens,
                &layout,
                qs,
                k.slice(),
                v.slice(),
                o,
                l,
            ),
            DType::BF16 => cpu_cache_forward::<V, half::bf16>(
                variant,
                p,
                lens,
                &layout,
                qs,
                k.slice(),
                v.slice(),
                o,
                l,
            ),
            _ => cpu_cache_forward::<V, f32>(
                variant,
                p,
                lens,
                &layout,
                qs,
                k.slice(),
                v.slice(),
                o,
                l,
            ),
        }
    }?;
    Ok((out.finish(), lse.finish()))
}

/// An output of the CPU kernels: written as f32, delivered in `dtype`.
struct Output {
    tensor: Tensor<CpuRuntime>,
    /// The f32 values when `dtype` is not f32 (narrowed in [`Output::finish`]).
    wide: Option<Aligned<f32>>,
}

impl Output {
    fn new(
        shape: &[usize],
        dtype: DType,
        device: &<CpuRuntime as Runtime>::Device,
    ) -> Result<Self> {
        let tensor = Tensor::<CpuRuntime>::empty(shape, dtype, device)?;
        let wide = (dtype != DType::F32).then(|| Aligned::scratch(tensor.numel()));
        Ok(Self { tensor, wide })
    }

    /// Where the kernel writes.
    fn slice_mut(&mut self) -> &mut [f32] {
        match &mut self.wide {
            Some(wide) => &mut wide[..],
            // SAFETY: the tensor was just allocated as f32 and is not shared
            // yet, so this is the only reference to its `numel()` contiguous
            // values.
            None => unsafe {
                std::slice::from_raw_parts_mut(self.tensor.ptr() as *mut f32, self.tensor.numel())
            },
        }
    }

    /// The tensor, rounded to its dtype (to nearest, ties to even).
    fn finish(self) -> Tensor<CpuRuntime> {
        if let Some(wide) = &self.wide {
            let n = self.tensor.numel();
            // SAFETY: the tensor was allocated with 2-byte elements (f16 or
            // bf16), is contiguous and not shared yet.
            let bits = unsafe { std::slice::from_raw_parts_mut(self.tensor.ptr() as *mut u16, n) };
            let dtype = self.tensor.dtype();
            bits.par_chunks_mut(CONVERT_BLOCK)
                .zip(wide.par_chunks(CONVERT_BLOCK))
                .for_each(|(dst, src)| match dtype {
                    DType::F16 => dst
                        .reinterpret_cast_mut::<half::f16>()
                        .convert_from_f32_slice(src),
                    _ => dst
                        .reinterpret_cast_mut::<half::bf16>()
                        .convert_from_f32_slice(src),
                });
        }
        self.tensor
    }
}

impl AttentionRuntime for CpuRuntime {
    fn attention_forward<V: Variant>(
        variant: &V,
        p: &Problem,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        let (dtype, device) = (q.dtype(), q.device());
        let mut out = Output::new(&[p.batch, p.heads_q, p.seq_q, p.head_dim], dtype, device)?;
        let mut lse = Output::new(&[p.batch, p.heads_q, p.seq_q], DType::F32, device)?;
        if dtype == DType::F32 {
            let (q, k, v) = (
                HostF32::new("q", q, dtype)?,
                HostF32::new("k", k, dtype)?,
                HostF32::new("v", v, dtype)?,
            );
            let (q, k, v) = (q.slice(), k.slice(), v.slice());
            crate::cpu::forward(variant, p, q, k, v, out.slice_mut(), lse.slice_mut())?;
            return Ok((out.finish(), lse.finish()));
        }
        // 16-bit inputs, read as stored.
        let (qe, ke, ve) = (
            HostElems::new("q", q, dtype)?,
            HostElems::new("k", k, dtype)?,
            HostElems::new("v", v, dtype)?,
        );
        let (o, l) = (out.slice_mut(), lse.slice_mut());
        // SAFETY (each arm): the tensors are of the dtype matched (checked
        // by `HostElems::new`).
        unsafe {
            if dtype == DType::F16 {
                let (q, k, v) = (qe.slice(), ke.slice(), ve.slice());
                crate::cpu::forward_stored::<V, half::f16>(variant, p, q, k, v, o, l)?;
            } else {
                let (q, k, v) = (qe.slice(), ke.slice(), ve.slice());
                // bf16 tile products where the CPU has them (AMX), except for
                // decode shapes, whose kernel packs a GQA group's rows.
                let tiles = !crate::cpu::is_decode(p)
                    && crate::cpu::forward_bf16(variant, p, q, k, v, &mut *o, &mut *l)?;
                if !tiles {
                    crate::cpu::forward_stored::<V, half::bf16>(variant, p, q, k, v, o, l)?;
                }
            }
        }
        Ok((out.finish(), lse.finish()))
    }

    fn attention_forward_cache<V: Variant>(
        variant: &V,
        p: &Problem,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        lengths: CacheLengths<'_, Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        cpu_cache_call(variant, p, lengths.host, CacheLayout::Lengths, q, k, v)
    }

    fn attention_forward_paged<V: Variant>(
        variant: &V,
        p: &Problem,
        q: &Tensor<Self>,
        pages: Pages<'_, Self>,
        lengths: CacheLengths<'_, Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        let layout = CacheLayout::Pages {
            table: pages.host,
            page_size: pages.page_size,
        };
        cpu_cache_call(variant, p, lengths.host, layout, q, pages.k, pages.v)
    }

    fn attention_backward<V: Variant>(
        variant: &V,
        p: &Problem,
        t: BackwardTensors<'_, Self>,
    ) -> Result<AttentionGrads<Self>> {
        let BackwardTensors {
            q,
            k,
            v,
            out,
            lse,
            dout,
            tensor_grads,
            lengths,
        } = t;
        let dtype = q.dtype();
        let device = q.device();
        validate::check_dtype("lse", lse, CPU, &[DType::F32], "f32 for lse")?;
        let q_shape = [p.batch, p.heads_q, p.seq_q, p.head_dim];
        let kv_shape = [p.batch, p.heads_kv, p.seq_k, p.head_dim];
        let mut dq = Output::new(&q_shape, dtype, device)?;
        let mut dk = Output::new(&kv_shape, dtype, device)?;
        let mut dv = Output::new(&kv_shape, dtype, device)?;
        let finish = |dq: Output, dk: Output, dv: Output, tensors: Vec<Option<Vec<f32>>>| {
            let learnables = variant.learnables();
            let tensors = tensors
                .into_iter()
                .zip(&learnables)
                .map(|(g, l)| {
                    let Some(g) = g else { return Ok(None) };
                    let shape = l.on::<CpuRuntime>()?.shape();
                    Ok(Some(Tensor::<CpuRuntime>::from_slice(&g, shape, device)?))
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(AttentionGrads {
                dq: dq.finish(),
                dk: dk.finish(),
                dv: dv.finish(),
                tensors,
            })
        };
        if dtype == DType::BF16 {
            // bf16 tile products where the CPU has them (AMX), read as stored.
            let elems = |name, t| HostElems::new(name, t, dtype);
            let (qe, ke, ve) = (elems("q", q)?, elems("k", k)?, elems("v", v)?);
            let (oe, de) = (elems("out", out)?, elems("dout", dout)?);
            let lse = HostF32::new("lse", lse, DType::F32)?;
            // SAFETY: the tensors are bf16 (checked by `HostElems::new`).
            let inputs = unsafe {
                crate::cpu::Bf16BackwardInputs {
                    q: qe.slice(),
                    k: ke.slice(),
                    v: ve.slice(),
                    out: oe.slice(),
                    lse: lse.slice(),
                    dout: de.slice(),
                }
            };
            let (dq_s, dk_s, dv_s) = (dq.slice_mut(), dk.slice_mut(), dv.slice_mut());
            let ran = match lengths {
                Some(l) => crate::cpu::backward_bf16_cache(
                    variant,
                    p,
                    l.host,
                    inputs,
                    dq_s,
                    dk_s,
                    dv_s,
                    tensor_grads,
                )?,
                None => {
                    crate::cpu::backward_bf16(variant, p, inputs, dq_s, dk_s, dv_s, tensor_grads)?
                }
            };
            if let Some(tensors) = ran {
                return finish(dq, dk, dv, tensors);
            }
        }
        let (q, k, v) = (
            HostF32::new("q", q, dtype)?,
            HostF32::new("k", k, dtype)?,
            HostF32::new("v", v, dtype)?,
        );
        let (out, lse) = (
            HostF32::new("out", out, dtype)?,
            HostF32::new("lse", lse, DType::F32)?,
        );
        let dout = HostF32::new("dout", dout, dtype)?;
        let inputs = crate::cpu::BackwardInputs {
            q: q.slice(),
            k: k.slice(),
            v: v.slice(),
            out: out.slice(),
            lse: lse.slice(),
            dout: dout.slice(),
        };
        let (dq_s, dk_s, dv_s) = (dq.slice_mut(), dk.slice_mut(), dv.slice_mut());
        let tensors = match lengths {
            Some(l) => crate::cpu::backward_cache(
                variant,
                p,
                l.host,
                inputs,
                dq_s,
                dk_s,
                dv_s,
                tensor_grads,
            )?,
            None => crate::cpu::backward(variant, p, inputs, dq_s, dk_s, dv_s, tensor_grads)?,
        };
        finish(dq, dk, dv, tensors)
    }
}
