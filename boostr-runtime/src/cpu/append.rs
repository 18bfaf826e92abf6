//! The CPU's cache writer: new rows copied into a cache's rows in place,
//! or quantised into an fp8 cache with the CUDA writer's steps in its
//! order (`emit/cuda/append.cu`), so that both write the same bytes; or
//! into an int8 cache (the CPU's only).

use super::elem::{e4m3_to_f32, e5m2_to_f32, f32_to_e4m3, f32_to_e5m2};
use crate::backend::KvWrite;
use crate::error::{Error, Result};
use numr::dtype::DType;
use numr::runtime::cpu::CpuRuntime;
use numr::tensor::Tensor;

type Cpu = Tensor<CpuRuntime>;

/// Run `w` on the host.
pub(crate) fn write_kv(w: &KvWrite<'_, CpuRuntime>) -> Result<()> {
    let scales = w.scales.map(|s| (s.k, s.v, s.grow));
    write_rows(w, w.k, w.k_new, scales.map(|(k, _, grow)| (k, grow)))?;
    write_rows(w, w.v, w.v_new, scales.map(|(_, v, grow)| (v, grow)))
}

/// int8: round to nearest even, saturating at ±127 (−128 is never
/// written, so the range is symmetric); NaN writes 0.
fn f32_to_i8(x: f32) -> u8 {
    x.round_ties_even().clamp(-127.0, 127.0) as i8 as u8
}

/// A quantised format's bits both ways (fp8, int8), and its largest value.
struct Quantised {
    encode: fn(f32) -> u8,
    decode: fn(u8) -> f32,
    most: f32,
}

fn quantised(dtype: DType) -> Option<Quantised> {
    match dtype {
        DType::FP8E4M3 => Some(Quantised {
            encode: f32_to_e4m3,
            decode: e4m3_to_f32,
            most: 448.0,
        }),
        DType::FP8E5M2 => Some(Quantised {
            encode: f32_to_e5m2,
            decode: e5m2_to_f32,
            most: 57344.0,
        }),
        DType::I8 => Some(Quantised {
            encode: f32_to_i8,
            decode: |b| f32::from(b as i8),
            most: 127.0,
        }),
        _ => None,
    }
}

/// The new rows' values, widened to f32.
fn widened(src: &Cpu) -> Result<Vec<f32>> {
    Ok(match src.dtype() {
        DType::F32 => src.to_vec::<f32>(),
        DType::F16 => src
            .to_vec::<half::f16>()
            .iter()
            .map(|x| x.to_f32())
            .collect(),
        DType::BF16 => src
            .to_vec::<half::bf16>()
            .iter()
            .map(|x| x.to_f32())
            .collect(),
        dtype => {
            return Err(Error::CacheWrite {
                rule: "new keys and values are f32, f16 or bf16",
                got: format!("{dtype:?}"),
            });
        }
    })
}

fn write_rows(
    w: &KvWrite<'_, CpuRuntime>,
    dst: &Cpu,
    src: &Cpu,
    scales: Option<(&Cpu, bool)>,
) -> Result<()> {
    let dim = *dst.shape().last().expect("a rank-4 cache");
    let elem = dst.dtype().size_in_bytes();
    // SAFETY: the cache is contiguous (checked by the plan) with its offset
    // folded into `ptr()`, `numel()` elements of `elem` bytes on the host.
    // The caller's tensors share the storage, which this write changes in
    // place, as a cache write must; no kernel reads it meanwhile (calls on
    // one runtime are ordered).
    let out = unsafe { std::slice::from_raw_parts_mut(dst.ptr() as *mut u8, dst.numel() * elem) };
    let Some(format) = quantised(dst.dtype()) else {
        // The new rows' own dtype: their bytes.
        let row = dim * elem;
        let src = src.contiguous()?;
        // SAFETY: contiguous, offset in `ptr()`, `numel()` elements.
        let bytes =
            unsafe { std::slice::from_raw_parts(src.ptr() as *const u8, src.numel() * elem) };
        for &[s, d] in w.pairs {
            let (s, d) = (s as usize * row, d as usize * row);
            out[d..d + row].copy_from_slice(&bytes[s..s + row]);
        }
        return Ok(());
    };
    let (scales, grow) = scales.expect("an fp8 cache has its scales (checked by the plan)");
    // SAFETY: f32, contiguous (a read of the scales checks both), its
    // offset in `ptr()`; written in place as the cache is.
    let scales =
        unsafe { std::slice::from_raw_parts_mut(scales.ptr() as *mut f32, scales.numel()) };
    let x = widened(src)?;
    for &[first, end, at, page_row] in w.groups {
        let pairs = &w.pairs[first as usize..end as usize];
        let at = at as usize;
        let mut s = scales[at];
        if grow {
            let amax = pairs
                .iter()
                .flat_map(|&[src, _]| &x[src as usize * dim..][..dim])
                .fold(0.0f32, |a, v| a.max(v.abs()));
            let old = s;
            s = old.max(amax / format.most);
            if page_row >= 0 && old > 0.0 && s > old {
                let rows = &mut out[page_row as usize * dim..][..w.page_rows * dim];
                for b in rows {
                    *b = (format.encode)((format.decode)(*b) * old / s);
                }
            }
            scales[at] = s;
        }
        for &[src, dst] in pairs {
            let row = &x[src as usize * dim..][..dim];
            let to = &mut out[dst as usize * dim..][..dim];
            for (b, &v) in to.iter_mut().zip(row) {
                *b = (format.encode)(if s > 0.0 { v / s } else { 0.0 });
            }
        }
    }
    Ok(())
}
