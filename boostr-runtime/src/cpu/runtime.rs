//! [`AttentionRuntime`] for numr's [`CpuRuntime`]: the tensors of a call
//! as host slices, in the element types the kernels read, and the kernel
//! each key layout and dtype runs.

use super::aligned::Aligned;
use super::elem::Stored;
use super::keys::KeyRows;
use super::operand::Operand;
use super::{BackwardInputs, Bf16BackwardInputs, CacheLayout, ForwardInputs, Seqs};
use crate::backend::{AttentionGrads, AttentionRuntime, BackwardTensors, CallKeys};
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

const CPU: &str = "cpu";
const CPU_DTYPES: &str = "f32, f16 and bf16 (f16/bf16 computed in f32)";

/// Elements per parallel task of the dtype conversions (memory-bound).
const CONVERT_BLOCK: usize = 1 << 16;

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

/// `f` on each pair of [`CONVERT_BLOCK`]-element blocks of `dst` and
/// `src`, in parallel.
fn in_blocks<A: Send, B: Sync>(dst: &mut [A], src: &[B], f: impl Fn(&mut [A], &[B]) + Sync) {
    dst.par_chunks_mut(CONVERT_BLOCK)
        .zip(src.par_chunks(CONVERT_BLOCK))
        .for_each(|(dst, src)| f(dst, src));
}

/// An input of the f32 kernels: contiguous f32 on the host. An f32 tensor
/// is used in place; f16 and bf16 are widened into a copy (exactly: every
/// f16 and bf16 value is an f32).
enum HostF32 {
    Tensor(Tensor<CpuRuntime>),
    Widened(Aligned<f32>),
}

impl HostF32 {
    /// `t` as f32; its dtype must be f32, f16 or bf16 and equal `dtype`.
    fn new(name: &'static str, t: &Tensor<CpuRuntime>, dtype: DType) -> Result<Self> {
        check_input(name, t, dtype)?;
        let t = HostOperand::packed(t)?;
        if dtype == DType::F32 {
            return Ok(Self::Tensor(t));
        }
        let mut wide = Aligned::<f32>::scratch(t.numel());
        // SAFETY: `t` is contiguous with its offset folded into `ptr()` and
        // holds `numel()` 2-byte values (f16 or bf16 bits, checked above);
        // `t` outlives the borrow.
        let bits = unsafe { std::slice::from_raw_parts(t.ptr() as *const u16, t.numel()) };
        in_blocks(&mut wide, bits, |dst, src| match dtype {
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

/// A tensor as stored on the host, f32, f16 or bf16: the kernels that take
/// 16-bit inputs widen them a block at a time, so they are never copied
/// whole.
struct HostElems(Tensor<CpuRuntime>);

impl HostElems {
    /// `t`, of `dtype` (one of the CPU's), contiguous.
    fn new(name: &'static str, t: &Tensor<CpuRuntime>, dtype: DType) -> Result<Self> {
        check_input(name, t, dtype)?;
        Ok(Self(HostOperand::packed(t)?))
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

/// A `[.., heads, rows, dim]` input of the forward kernels as stored,
/// read in place: any strides, as long as each row's elements are
/// contiguous and no stride is negative; otherwise a contiguous copy
/// (numr's `contiguous`).
struct HostOperand(Tensor<CpuRuntime>);

impl HostOperand {
    /// `t` (rank 4, inside its storage: validated), of `dtype` (one of the
    /// CPU's).
    fn new(name: &'static str, t: &Tensor<CpuRuntime>, dtype: DType) -> Result<Self> {
        check_input(name, t, dtype)?;
        Self::view(t)
    }

    /// A cache's `k` or `v`: as [`HostOperand::new`], or fp8 (validated
    /// with its scales).
    fn kv(name: &'static str, t: &Tensor<CpuRuntime>, dtype: DType) -> Result<Self> {
        if matches!(dtype, DType::FP8E4M3 | DType::FP8E5M2 | DType::I8) {
            return Self::view(t);
        }
        Self::new(name, t, dtype)
    }

    /// `t` itself where the kernels can read it in place, else a
    /// contiguous copy.
    fn view(t: &Tensor<CpuRuntime>) -> Result<Self> {
        Ok(Self(if Self::in_place(t) {
            t.clone()
        } else {
            t.contiguous()?
        }))
    }

    /// Whether the kernels can read `t` as it is.
    fn in_place(t: &Tensor<CpuRuntime>) -> bool {
        let (shape, strides) = (t.shape(), t.strides());
        let used = |i: usize| shape[i] > 1;
        shape.len() == 4
            && (!used(3) || strides[3] == 1)
            && (0..3).all(|i| !used(i) || strides[i] >= 0)
            && (!used(2) || strides[2] >= shape[3] as isize)
    }

    /// `t` contiguous: itself, or a copy made a row at a time in parallel
    /// where its rows are readable in place (numr's `contiguous` copies a
    /// permuted tensor element by element, several times slower).
    fn packed(t: &Tensor<CpuRuntime>) -> Result<Tensor<CpuRuntime>> {
        if t.is_contiguous() || !Self::in_place(t) {
            return Ok(t.contiguous()?);
        }
        let view = Self(t.clone());
        let op = view.operand();
        let [_, _, s, d] = op.shape();
        let dst = Tensor::<CpuRuntime>::empty(t.shape(), t.dtype(), t.device())?;
        let row = d * t.dtype().size_in_bytes();
        // SAFETY: `dst` was just allocated, contiguous, and is not shared.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                dst.ptr() as *mut u8,
                t.numel() * t.dtype().size_in_bytes(),
            )
        };
        bytes
            .par_chunks_mut((row * s).max(1))
            .enumerate()
            .for_each(|(bh, head)| {
                let rows = op.head(bh);
                for (i, out) in head.chunks_exact_mut(row.max(1)).enumerate() {
                    out.copy_from_slice(rows.row(i).as_bytes());
                }
            });
        Ok(dst)
    }

    /// The operand's rows, as its dtype stores them.
    fn operand(&self) -> Operand<'_> {
        let t = &self.0;
        let shape: [usize; 4] = t.shape().try_into().expect("rank 4 (validated)");
        // Strides of dims of extent 1 are never used; the others are
        // non-negative (`new`).
        let strides = [0, 1, 2].map(|i| {
            if shape[i] > 1 {
                t.strides()[i] as usize
            } else {
                0
            }
        });
        let span = Operand::span(shape, strides);
        let at = t.ptr() as usize;
        // SAFETY (each): the view lies inside its storage (validated), so
        // the `span` elements from its first (`ptr()` includes the offset)
        // are host memory of the dtype's element, alive as long as `self`.
        let data = unsafe {
            match t.dtype() {
                DType::F32 => Stored::F32(std::slice::from_raw_parts(at as *const f32, span)),
                DType::BF16 => Stored::Bf16(std::slice::from_raw_parts(at as *const u16, span)),
                DType::F16 => Stored::F16(std::slice::from_raw_parts(at as *const u16, span)),
                DType::FP8E4M3 => Stored::E4m3(std::slice::from_raw_parts(at as *const u8, span)),
                DType::FP8E5M2 => Stored::E5m2(std::slice::from_raw_parts(at as *const u8, span)),
                DType::I8 => Stored::I8(std::slice::from_raw_parts(at as *const u8, span)),
                other => unreachable!("{other:?} is checked before"),
            }
        };
        Operand::new(data, shape, strides)
    }
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
            in_blocks(bits, wide, |dst, src| match dtype {
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
    /// The tile kernels run packed sequences as one row, through a window
    /// that moves each row and key to its sequence.
    const PACKED_IN_PLACE: bool = true;

    fn communicator_reads_tensors(_: &dyn numr::runtime::Communicator) -> bool {
        true
    }

    fn write_kv(write: &crate::backend::KvWrite<'_, Self>) -> Result<()> {
        super::append::write_kv(write)
    }

    fn attention_forward<V: Variant>(
        variant: &V,
        p: &Problem,
        q: &Tensor<Self>,
        keys: CallKeys<'_, Self>,
    ) -> Result<crate::op::Output<Self>> {
        let (dtype, device) = (q.dtype(), q.device());
        // q first: its dtype is the call's, so an unsupported one is named
        // as q's rather than as a mismatch of k.
        check_input("q", q, dtype)?;
        let mut out = Output::new(&p.out_shape(), dtype, device)?;
        let mut lse = Output::new(&p.lse_shape(), DType::F32, device)?;
        let mut max = if p.max_scores {
            Some(Output::new(&p.lse_shape(), DType::F32, device)?)
        } else {
            None
        };
        let (o, l) = (out.slice_mut(), lse.slice_mut());
        let mut m = max.as_mut().map(|m| m.slice_mut());
        // Read as stored and in place, 16-bit ones widened per block inside
        // the kernels (the decode kernel widens a call's few query rows
        // first).
        // An fp8 cache's keys are in their own dtype (checked with its
        // scales).
        let kv_dtype = |t: &Tensor<CpuRuntime>| {
            if keys.scales.is_some() {
                t.dtype()
            } else {
                dtype
            }
        };
        let (q, k, v) = (
            HostOperand::new("q", q, dtype)?,
            HostOperand::kv("k", keys.k, kv_dtype(keys.k))?,
            HostOperand::kv("v", keys.v, kv_dtype(keys.v))?,
        );
        let (mut k, mut v) = (k.operand(), v.operand());
        if let Some(scales) = keys.scales {
            k = k.with_scales(scales.k);
            v = v.with_scales(scales.v);
        }
        let x = ForwardInputs {
            q: q.operand(),
            keys: KeyRows::new(k, v, CacheLayout::of(&keys.layout), p),
            seqs: Seqs::of(&keys.layout),
        };
        // bf16 tile products where the CPU has them (AMX, `vdpbf16ps`),
        // except for decode shapes, whose kernel packs a GQA group's rows.
        let tiles = dtype == DType::BF16
            && !super::runs_decode(p, x.seqs)
            && super::forward_bf16_inputs(variant, p, x, (&mut *o, &mut *l, m.as_deref_mut()))?;
        if !tiles {
            super::forward_stored_inputs(variant, p, x, (o, l, m))?;
        }
        Ok(crate::op::Output {
            out: out.finish(),
            lse: lse.finish(),
            max_scores: max.map(Output::finish),
        })
    }

    fn attention_backward<V: Variant>(
        variant: &V,
        p: &Problem,
        t: BackwardTensors<'_, Self>,
    ) -> Result<AttentionGrads<Self>> {
        let layout = (CacheLayout::of(&t.keys.layout), Seqs::of(&t.keys.layout));
        let (dtype, device) = (t.q.dtype(), t.q.device());
        check_input("q", t.q, dtype)?;
        validate::check_dtype("lse", t.lse, CPU, &[DType::F32], "f32 for lse")?;
        let mut dq = Output::new(&p.q_shape(), dtype, device)?;
        // dK and dV as the keys are laid out: slots, or pages.
        let mut dk = Output::new(t.keys.k.shape(), dtype, device)?;
        let mut dv = Output::new(t.keys.v.shape(), dtype, device)?;
        let grads = (dq.slice_mut(), dk.slice_mut(), dv.slice_mut());
        let lse = HostF32::new("lse", t.lse, DType::F32)?;
        let dlse = t
            .dlse
            .map(|g| HostF32::new("dlse", g, DType::F32))
            .transpose()?;
        let dlse = dlse.as_ref().map(|g| g.slice());
        let wanted = t.tensor_grads;
        let mut tensors = None;
        if dtype == DType::BF16 {
            // bf16 tile products where the CPU has them (AMX, `vdpbf16ps`),
            // read as stored.
            let elems = |name, t| HostElems::new(name, t, dtype);
            let (q, k, v) = (
                elems("q", t.q)?,
                elems("k", t.keys.k)?,
                elems("v", t.keys.v)?,
            );
            let (out, dout) = (elems("out", t.out)?, elems("dout", t.dout)?);
            // SAFETY: the tensors are bf16 (checked by `HostElems::new`).
            let inputs = unsafe {
                Bf16BackwardInputs {
                    q: q.slice(),
                    k: k.slice(),
                    v: v.slice(),
                    out: out.slice(),
                    lse: lse.slice(),
                    dout: dout.slice(),
                    dlse,
                }
            };
            let g = (&mut *grads.0, &mut *grads.1, &mut *grads.2);
            tensors = super::backward_stored(variant, p, layout, inputs, g, wanted)?;
        }
        let tensors = match tensors {
            Some(tensors) => tensors,
            None => {
                let wide = |name, t| HostF32::new(name, t, dtype);
                let (q, k, v) = (wide("q", t.q)?, wide("k", t.keys.k)?, wide("v", t.keys.v)?);
                let (out, dout) = (wide("out", t.out)?, wide("dout", t.dout)?);
                let inputs = BackwardInputs {
                    q: q.slice(),
                    k: k.slice(),
                    v: v.slice(),
                    out: out.slice(),
                    lse: lse.slice(),
                    dout: dout.slice(),
                    dlse,
                };
                super::backward_stored(variant, p, layout, inputs, grads, wanted)?
                    .expect("the f32 backward runs on every CPU")
            }
        };
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
    }
}
