//! The numr runtimes that attention runs on. Each backend owns its launch:
//! there is no dispatch table over targets in shared code.

use crate::error::Result;
use crate::problem::Problem;
use crate::validate;
use crate::variant::Variant;
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::runtime::cpu::CpuRuntime;
use numr::tensor::Tensor;

/// A numr runtime with fused attention kernels.
pub trait AttentionRuntime: Runtime<DType = DType> {
    /// Run the forward kernel on validated inputs; returns `(out, lse)`.
    fn attention_forward<V: Variant>(
        variant: &V,
        problem: &Problem,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)>;

    /// Run the backward kernels on validated inputs; returns `(dq, dk, dv)`.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward<V: Variant>(
        variant: &V,
        problem: &Problem,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        out: &Tensor<Self>,
        lse: &Tensor<Self>,
        dout: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)>;
}

const CPU: &str = "cpu";
const CPU_DTYPES: &str = "f32";

/// A contiguous f32 CPU tensor viewed as a slice.
struct HostF32(Tensor<CpuRuntime>);

impl HostF32 {
    fn new(name: &'static str, t: &Tensor<CpuRuntime>) -> Result<Self> {
        validate::check_dtype(name, t, CPU, &[DType::F32], CPU_DTYPES)?;
        Ok(Self(t.contiguous()?))
    }

    fn slice(&self) -> &[f32] {
        // SAFETY: the tensor is contiguous with its offset folded into `ptr()`,
        // holds `numel()` f32 values on the host, and `self` keeps its storage
        // alive for the borrow.
        unsafe { std::slice::from_raw_parts(self.0.ptr() as *const f32, self.0.numel()) }
    }
}

/// A freshly allocated f32 CPU tensor, written through a slice.
fn alloc(shape: &[usize], device: &<CpuRuntime as Runtime>::Device) -> Result<Tensor<CpuRuntime>> {
    Ok(Tensor::<CpuRuntime>::empty(shape, DType::F32, device)?)
}

fn slice_mut(t: &mut Tensor<CpuRuntime>) -> &mut [f32] {
    // SAFETY: `t` was just allocated by `alloc` and is not shared yet, so this
    // is the only reference to its `numel()` contiguous f32 values.
    unsafe { std::slice::from_raw_parts_mut(t.ptr() as *mut f32, t.numel()) }
}

impl AttentionRuntime for CpuRuntime {
    fn attention_forward<V: Variant>(
        variant: &V,
        p: &Problem,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>)> {
        let (q, k, v) = (
            HostF32::new("q", q)?,
            HostF32::new("k", k)?,
            HostF32::new("v", v)?,
        );
        let device = q.0.device();
        let mut out = alloc(q.0.shape(), device)?;
        let mut lse = alloc(&[p.batch, p.heads_q, p.seq_q], device)?;
        crate::cpu::forward(
            variant,
            p,
            q.slice(),
            k.slice(),
            v.slice(),
            slice_mut(&mut out),
            slice_mut(&mut lse),
        );
        Ok((out, lse))
    }

    fn attention_backward<V: Variant>(
        variant: &V,
        p: &Problem,
        q: &Tensor<Self>,
        k: &Tensor<Self>,
        v: &Tensor<Self>,
        out: &Tensor<Self>,
        lse: &Tensor<Self>,
        dout: &Tensor<Self>,
    ) -> Result<(Tensor<Self>, Tensor<Self>, Tensor<Self>)> {
        let (q, k, v) = (
            HostF32::new("q", q)?,
            HostF32::new("k", k)?,
            HostF32::new("v", v)?,
        );
        let (out, lse) = (HostF32::new("out", out)?, HostF32::new("lse", lse)?);
        let dout = HostF32::new("dout", dout)?;
        let device = q.0.device();
        let mut dq = alloc(q.0.shape(), device)?;
        let mut dk = alloc(k.0.shape(), device)?;
        let mut dv = alloc(v.0.shape(), device)?;
        crate::cpu::backward(
            variant,
            p,
            crate::cpu::BackwardInputs {
                q: q.slice(),
                k: k.slice(),
                v: v.slice(),
                out: out.slice(),
                lse: lse.slice(),
                dout: dout.slice(),
            },
            slice_mut(&mut dq),
            slice_mut(&mut dk),
            slice_mut(&mut dv),
        );
        Ok((dq, dk, dv))
    }
}
