//! New tokens' keys and values written into a KV cache or its pages, in
//! place, on every backend: after each sequence's keys
//! ([`CacheSlots::after`], FlashInfer's `append_paged_kv_cache`) or at one
//! slot per token ([`CacheSlots::mapped`], vLLM's `reshape_and_cache`),
//! quantised where the cache is fp8.
//!
//! Every index is checked on the host before anything is written: a full
//! cache, a page the table does not hold, a slot out of range or written
//! twice is an [`Error::CacheWrite`] or [`Error::PageIndex`] naming the
//! value, and the cache is left as it was. Nothing is written outside the
//! named slots, but for an fp8 page whose scale grows: its other rows are
//! requantised to the new scale (keeping their values to within its
//! rounding).

use crate::backend::{AttentionRuntime, KvWrite, WriteScales};
use crate::error::{Error, Result};
use crate::keys::{Keys, KvScales, cache_scales, index_values, is_quantised};
use numr::dtype::DType;
use numr::ops::{ScalarOps, TypeConversionOps, UnaryOps};
use numr::runtime::Runtime;
use numr::tensor::Tensor;
use std::collections::BTreeMap;
use std::collections::btree_map::Entry;

/// Where [`append_kv`] writes.
#[derive(Debug)]
#[non_exhaustive]
pub enum CacheSlots<'a, R: Runtime> {
    /// After each sequence's keys: new keys `[B, Hkv, n, D]` (values
    /// `[B, Hkv, n, Dv]`) go to positions `lengths[b] .. lengths[b] + n`
    /// of the cache or pages that [`Keys::cache`] or [`Keys::paged`]
    /// describes (with [`Keys::with_scales`] for an fp8 cache). The
    /// lengths are the ones before the write: attend with `lengths + n`
    /// after it.
    After(Keys<'a, R>),
    /// One slot per token: token `t` of new keys `[T, Hkv, D]` (values
    /// `[T, Hkv, Dv]`) goes to slot `slots[t] % page_size` of page
    /// `slots[t] / page_size` (`slots` `[T]`, `i32`); `-1` skips the token
    /// (a padded one, as vLLM's).
    #[non_exhaustive]
    Mapped {
        /// `k_pages [pages, Hkv, page_size, D]`.
        k_pages: &'a Tensor<R>,
        /// `v_pages [pages, Hkv, page_size, Dv]`.
        v_pages: &'a Tensor<R>,
        /// `slots [T]`.
        slots: &'a Tensor<R>,
        /// An fp8 cache's scales.
        scales: Option<KvScales<'a, R>>,
    },
}

impl<R: Runtime> Clone for CacheSlots<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: Runtime> Copy for CacheSlots<'_, R> {}

impl<'a, R: Runtime> CacheSlots<'a, R> {
    /// After each sequence's keys in `keys` (a [`Keys::cache`] or
    /// [`Keys::paged`]).
    pub fn after(keys: Keys<'a, R>) -> Self {
        CacheSlots::After(keys)
    }

    /// At `slots[t]` of the pages, for each token `t`.
    pub fn mapped(k_pages: &'a Tensor<R>, v_pages: &'a Tensor<R>, slots: &'a Tensor<R>) -> Self {
        CacheSlots::Mapped {
            k_pages,
            v_pages,
            slots,
            scales: None,
        }
    }

    /// An fp8 cache's scales: [`KvScales::PerHead`] are fixed and values
    /// past their range saturate (scales from calibration, or from a
    /// prompt's largest values: [`amax_scales`]); [`KvScales::PerPage`]
    /// grow to each write's largest value, in place (a fresh page's scale
    /// is 0).
    pub fn with_scales(self, scales: KvScales<'a, R>) -> Self {
        match self {
            CacheSlots::After(keys) => CacheSlots::After(keys.with_scales(scales)),
            CacheSlots::Mapped {
                k_pages,
                v_pages,
                slots,
                ..
            } => CacheSlots::Mapped {
                k_pages,
                v_pages,
                slots,
                scales: Some(scales),
            },
        }
    }
}

/// Write the new tokens' keys `k_new` and values `v_new` into the cache at
/// `slots`, in place (see [`CacheSlots`] for their shapes). The new
/// tensors are f32, f16 or bf16; the cache is of their dtype, or fp8
/// (`FP8E4M3`, `FP8E5M2`) with its scales, into which they are quantised
/// (round to nearest even, saturating). Nothing is written unless every
/// index is valid.
///
/// ```
/// use boostr_runtime::prelude::*;
/// use numr::dtype::DType;
/// use numr::runtime::cpu::{CpuDevice, CpuRuntime};
/// use numr::tensor::Tensor;
///
/// let dev = CpuDevice::new();
/// // Two sequences of a cache of capacity 8, holding 3 and 5 keys.
/// let k = Tensor::<CpuRuntime>::zeros(&[2, 1, 8, 4], DType::F32, &dev)?;
/// let v = Tensor::<CpuRuntime>::zeros(&[2, 1, 8, 4], DType::F32, &dev)?;
/// let lengths = Tensor::<CpuRuntime>::from_slice(&[3i32, 5], &[2], &dev)?;
/// let k_new = Tensor::<CpuRuntime>::ones(&[2, 1, 1, 4], DType::F32, &dev)?;
/// append_kv(CacheSlots::after(Keys::cache(&k, &v, &lengths)), &k_new, &k_new)?;
/// let k = k.to_vec::<f32>();
/// assert_eq!(k[3 * 4], 1.0); // sequence 0, slot 3
/// assert_eq!(k[(8 + 5) * 4], 1.0); // sequence 1, slot 5
/// # Ok::<(), boostr_runtime::Error>(())
/// ```
pub fn append_kv<R: AttentionRuntime>(
    slots: CacheSlots<'_, R>,
    k_new: &Tensor<R>,
    v_new: &Tensor<R>,
) -> Result<()> {
    let plan = Plan::new(slots, k_new, v_new)?;
    if plan.pairs.is_empty() {
        return Ok(());
    }
    let (k_new, v_new) = (k_new.contiguous()?, v_new.contiguous()?);
    R::write_kv(&KvWrite {
        k: plan.k,
        v: plan.v,
        k_new: &k_new,
        v_new: &v_new,
        groups: &plan.groups,
        pairs: &plan.pairs,
        page_rows: plan.page_rows,
        scales: plan.scales,
    })
}

/// Per-head scales (`[Hkv]`, `f32`) that hold every value of `x` (`[..,
/// Hkv, rows, dim]`, as a prompt's keys or values) in `dtype`
/// (`FP8E4M3` or `FP8E5M2`): its largest magnitude per head over the
/// format's largest value (vLLM's computed KV scales).
pub fn amax_scales<R: AttentionRuntime>(x: &Tensor<R>, dtype: DType) -> Result<Tensor<R>>
where
    R::Client: UnaryOps<R> + ScalarOps<R> + TypeConversionOps<R>,
{
    use numr::ops::ReduceOps as _;
    let most = match dtype {
        DType::FP8E4M3 => 448.0,
        DType::FP8E5M2 => 57344.0,
        _ => {
            return Err(Error::CacheWrite {
                rule: "amax scales are for an fp8 format (FP8E4M3, FP8E5M2)",
                got: format!("{dtype:?}"),
            });
        }
    };
    let rank = x.ndim();
    if rank < 3 {
        return Err(Error::Rank {
            name: "x",
            rank: 4,
            layout: "[.., Hkv, rows, dim]",
            shape: x.shape().to_vec(),
        });
    }
    let client = R::default_client(x.device());
    let x = client.cast(x, DType::F32)?;
    let a = client.abs(&x)?;
    let a = client.max(&a, &[rank - 1, rank - 2], false)?;
    let dims: Vec<usize> = (0..rank - 3).collect();
    let a = if dims.is_empty() {
        a
    } else {
        client.max(&a, &dims, false)?
    };
    Ok(client.div_scalar(&a, most)?)
}

/// A validated write: the cache tensors, and the row pairs in groups.
struct Plan<'a, R: Runtime> {
    k: &'a Tensor<R>,
    v: &'a Tensor<R>,
    groups: Vec<[i32; 4]>,
    pairs: Vec<[i32; 2]>,
    page_rows: usize,
    scales: Option<WriteScales<'a, R>>,
}

/// An error of the write's rules.
fn broken<T>(rule: &'static str, got: String) -> Result<T> {
    Err(Error::CacheWrite { rule, got })
}

/// The pairs of one write, grouped by (page or sequence, kv head).
#[derive(Default)]
struct Pairs {
    groups: BTreeMap<(usize, usize), Vec<[i32; 2]>>,
}

impl Pairs {
    fn push(&mut self, group: (usize, usize), src: usize, dst: usize) {
        // Row counts are checked to fit i32 before any pair is made.
        self.groups
            .entry(group)
            .or_default()
            .push([src as i32, dst as i32]);
    }
}

impl<'a, R: AttentionRuntime> Plan<'a, R> {
    fn new(slots: CacheSlots<'a, R>, k_new: &Tensor<R>, v_new: &Tensor<R>) -> Result<Self> {
        let (k, v, scales) = match slots {
            CacheSlots::After(Keys::Cache { k, v, scales, .. })
            | CacheSlots::After(Keys::Paged {
                k_pages: k,
                v_pages: v,
                scales,
                ..
            })
            | CacheSlots::Mapped {
                k_pages: k,
                v_pages: v,
                scales,
                ..
            } => (k, v, scales),
            CacheSlots::After(_) => {
                return broken(
                    "new keys are appended to a cache (Keys::cache) or pages (Keys::paged)",
                    "another key source".into(),
                );
            }
        };
        let rank = if matches!(slots, CacheSlots::Mapped { .. }) {
            3
        } else {
            4
        };
        let layout = if rank == 3 {
            "[T, Hkv, dim]"
        } else {
            "[B, Hkv, n, dim]"
        };
        for (name, t, cache) in [("k_new", k_new, k), ("v_new", v_new, v)] {
            if t.ndim() != rank {
                return Err(Error::Rank {
                    name,
                    rank,
                    layout,
                    shape: t.shape().to_vec(),
                });
            }
            if cache.ndim() != 4 {
                return Err(Error::Rank {
                    name: if name == "k_new" {
                        "the cache's k"
                    } else {
                        "the cache's v"
                    },
                    rank: 4,
                    layout: "[B or pages, Hkv, slots, dim]",
                    shape: cache.shape().to_vec(),
                });
            }
            let (s, c) = (t.shape(), cache.shape());
            if s[1] != c[1] || s[rank - 1] != c[3] {
                return broken(
                    "new rows have the cache's kv heads and head dim",
                    format!("{name} {s:?} into a cache of {c:?}"),
                );
            }
            if !cache.is_contiguous() {
                return broken(
                    "a cache written in place is contiguous",
                    format!("a cache of shape {c:?}, strides {:?}", cache.strides()),
                );
            }
            if cache.numel() / c[3].max(1) > i32::MAX as usize {
                return Err(Error::TooLarge {
                    name: "cache rows",
                    value: cache.numel() / c[3].max(1),
                    max: i32::MAX as usize,
                });
            }
        }
        let new_dtype = k_new.dtype();
        if !matches!(new_dtype, DType::F32 | DType::F16 | DType::BF16) || v_new.dtype() != new_dtype
        {
            return broken(
                "new keys and values are f32, f16 or bf16, of one dtype",
                format!("k_new {new_dtype:?}, v_new {:?}", v_new.dtype()),
            );
        }
        if k.dtype() != v.dtype() || (k.dtype() != new_dtype && !is_quantised(k.dtype())) {
            return broken(
                "the cache holds the new rows' dtype, or fp8 or int8",
                format!(
                    "k_new {new_dtype:?} into a cache of k {:?}, v {:?}",
                    k.dtype(),
                    v.dtype()
                ),
            );
        }
        let pages = matches!(
            slots,
            CacheSlots::After(Keys::Paged { .. }) | CacheSlots::Mapped { .. }
        )
        .then(|| k.shape()[0]);
        // The scales' shapes and values (what a read of the cache checks).
        cache_scales(k, v, scales, pages)?;
        let (hkv, slots_per) = (k.shape()[1], k.shape()[2]);
        let mut pairs = Pairs::default();
        match slots {
            CacheSlots::After(Keys::Cache { lengths, .. }) => {
                let [b, _, n, _] = dims4(k_new);
                if k.shape()[0] != b {
                    return broken(
                        "new rows have the cache's batch",
                        format!("k_new {:?} into a cache of {:?}", k_new.shape(), k.shape()),
                    );
                }
                let lens = lengths_of(lengths, b, slots_per, n)?;
                for (seq, &len) in lens.iter().enumerate() {
                    for h in 0..hkv {
                        for i in 0..n {
                            let src = (seq * hkv + h) * n + i;
                            let dst = (seq * hkv + h) * slots_per + len + i;
                            pairs.push((seq, h), src, dst);
                        }
                    }
                }
            }
            CacheSlots::After(Keys::Paged {
                page_table,
                lengths,
                ..
            }) => {
                let [b, _, n, _] = dims4(k_new);
                let shape = page_table.shape();
                if shape.len() != 2 || shape[0] != b {
                    return Err(Error::ShapeOf {
                        name: "page_table",
                        expected: vec![b, shape.get(1).copied().unwrap_or(1)],
                        got: shape.to_vec(),
                    });
                }
                let max_pages = shape[1];
                let table = index_values("page_table", page_table, shape)?;
                let lens = lengths_of(lengths, b, max_pages * slots_per, n)?;
                let mut owner = BTreeMap::new();
                for (seq, &len) in lens.iter().enumerate() {
                    for i in 0..n {
                        let pos = len + i;
                        let (logical, offset) = (pos / slots_per, pos % slots_per);
                        let index = table[seq * max_pages + logical];
                        let page = usize::try_from(index)
                            .ok()
                            .filter(|&p| p < k.shape()[0])
                            .ok_or(Error::PageIndex {
                                batch: seq,
                                page: logical,
                                index: i64::from(index),
                                pages: k.shape()[0],
                            })?;
                        claim(&mut owner, page * slots_per + offset, (seq, pos))?;
                        for h in 0..hkv {
                            let src = (seq * hkv + h) * n + i;
                            let dst = (page * hkv + h) * slots_per + offset;
                            pairs.push((page, h), src, dst);
                        }
                    }
                }
            }
            CacheSlots::Mapped { slots: map, .. } => {
                let t = k_new.shape()[0];
                if v_new.shape()[0] != t {
                    return broken(
                        "k_new and v_new have one row per token",
                        format!("k_new {:?}, v_new {:?}", k_new.shape(), v_new.shape()),
                    );
                }
                let values = index_values("slots", map, &[t])?;
                let total = k.shape()[0] * slots_per;
                let mut owner = BTreeMap::new();
                for (token, &slot) in values.iter().enumerate() {
                    if slot == -1 {
                        continue;
                    }
                    let Some(slot) = usize::try_from(slot).ok().filter(|&s| s < total) else {
                        return broken(
                            "each slot is -1 or in 0 .. pages · page_size",
                            format!("slots[{token}] = {slot}, with {total} slots"),
                        );
                    };
                    claim(&mut owner, slot, (token, token))?;
                    let (page, offset) = (slot / slots_per, slot % slots_per);
                    for h in 0..hkv {
                        pairs.push(
                            (page, h),
                            token * hkv + h,
                            (page * hkv + h) * slots_per + offset,
                        );
                    }
                }
            }
            CacheSlots::After(_) => unreachable!("refused above"),
        }
        if matches!(slots, CacheSlots::After(_)) {
            let (ks, vs) = (k_new.shape(), v_new.shape());
            if ks[..3] != vs[..3] {
                return broken(
                    "k_new and v_new have one row per token",
                    format!("k_new {ks:?}, v_new {vs:?}"),
                );
            }
        }
        let grow = matches!(scales, Some(KvScales::PerPage { .. }));
        let page_rows = if grow { slots_per } else { 0 };
        let mut groups = Vec::with_capacity(pairs.groups.len());
        let mut flat = Vec::new();
        for ((unit, h), rows) in pairs.groups {
            let start = flat.len() as i32;
            flat.extend(rows);
            let scale = match scales {
                None => -1,
                Some(KvScales::PerHead { .. }) => h as i32,
                Some(KvScales::PerPage { .. }) => (unit * hkv + h) as i32,
            };
            let page_row = if grow {
                ((unit * hkv + h) * slots_per) as i32
            } else {
                -1
            };
            groups.push([start, flat.len() as i32, scale, page_row]);
        }
        let scales = scales.map(|s| match s {
            KvScales::PerHead { k, v } => WriteScales { k, v, grow: false },
            KvScales::PerPage { k, v } => WriteScales { k, v, grow: true },
        });
        Ok(Plan {
            k,
            v,
            groups,
            pairs: flat,
            page_rows,
            scales,
        })
    }
}

/// A rank-4 tensor's dims.
fn dims4<R: Runtime>(t: &Tensor<R>) -> [usize; 4] {
    let s = t.shape();
    [s[0], s[1], s[2], s[3]]
}

/// A cache's `[batch]` lengths, each in `0 ..= capacity` with room for `n`
/// more.
fn lengths_of<R: Runtime<DType = DType>>(
    lengths: &Tensor<R>,
    batch: usize,
    capacity: usize,
    n: usize,
) -> Result<Vec<usize>> {
    let values = index_values("lengths", lengths, &[batch])?;
    let mut out = Vec::with_capacity(batch);
    for (seq, &len) in values.iter().enumerate() {
        let Some(len) = usize::try_from(len).ok().filter(|&l| l <= capacity) else {
            return Err(Error::Lengths {
                name: "lengths",
                rule: "each length lies in 0 ..=",
                at: seq,
                value: i64::from(len),
                bound: capacity,
            });
        };
        if len + n > capacity {
            return broken(
                "the cache has room for the new rows",
                format!("sequence {seq} holds {len} of {capacity} slots and gets {n} more"),
            );
        }
        out.push(len);
    }
    Ok(out)
}

/// Claim a cache slot for one writer (`(token or sequence, position)`): a
/// slot written twice in one call is an error.
fn claim(
    owner: &mut BTreeMap<usize, (usize, usize)>,
    slot: usize,
    by: (usize, usize),
) -> Result<()> {
    match owner.entry(slot) {
        Entry::Vacant(e) => {
            e.insert(by);
            Ok(())
        }
        Entry::Occupied(e) => broken(
            "each slot is written once per call",
            format!(
                "slot {slot} written for (token or sequence {}, position {}) and ({}, {})",
                e.get().0,
                e.get().1,
                by.0,
                by.1
            ),
        ),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cpu::{e4m3_to_f32, e5m2_to_f32};
    use crate::testing::{Rng, SEED_ENV, choose_seed};

    /// Kv heads, head dims (values narrower), slots per page (and a
    /// cache's capacity), pages, sequences.
    const HKV: usize = 2;
    const D: usize = 12;
    const DV: usize = 8;
    const PAGE: usize = 5;
    const PAGES: usize = 9;
    const B: usize = 3;

    /// Where the new rows go.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Form {
        Cache,
        Paged,
        Mapped,
    }

    /// A cache format and how its scales behave.
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct Format {
        cache: DType,
        new: DType,
        /// fp8 scales per page (growing), else per head (fixed).
        per_page: bool,
    }

    /// The new rows' dtype written as itself.
    pub(crate) const F32: Format = Format {
        cache: DType::F32,
        new: DType::F32,
        per_page: false,
    };

    /// The formats the CPU writes: every dtype as itself, and both fp8
    /// formats with scales per head and per page, from every dtype.
    pub(crate) const CPU_FORMATS: [Format; 9] = [
        F32,
        Format {
            cache: DType::F16,
            new: DType::F16,
            per_page: false,
        },
        Format {
            cache: DType::BF16,
            new: DType::BF16,
            per_page: false,
        },
        Format {
            cache: DType::FP8E4M3,
            new: DType::F32,
            per_page: true,
        },
        Format {
            cache: DType::FP8E4M3,
            new: DType::BF16,
            per_page: false,
        },
        Format {
            cache: DType::FP8E5M2,
            new: DType::F16,
            per_page: true,
        },
        Format {
            cache: DType::FP8E5M2,
            new: DType::F32,
            per_page: false,
        },
        Format {
            cache: DType::I8,
            new: DType::F32,
            per_page: true,
        },
        Format {
            cache: DType::I8,
            new: DType::BF16,
            per_page: false,
        },
    ];

    /// `x` in `dtype`'s bytes (f32, f16, bf16).
    fn bytes_of(x: &[f32], dtype: DType) -> Vec<u8> {
        match dtype {
            DType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::F16 => x
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            _ => x
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        }
    }

    /// `x` rounded to `dtype` (f32, f16, bf16).
    fn rounded(x: f32, dtype: DType) -> f32 {
        match dtype {
            DType::F32 => x,
            DType::F16 => half::f16::from_f32(x).to_f32(),
            _ => half::bf16::from_f32(x).to_f32(),
        }
    }

    /// A quantised byte's value.
    fn decode(dtype: DType, b: u8) -> f32 {
        match dtype {
            DType::FP8E4M3 => e4m3_to_f32(b),
            DType::FP8E5M2 => e5m2_to_f32(b),
            _ => f32::from(b as i8),
        }
    }

    /// The largest value of a quantised format.
    fn most(dtype: DType) -> f32 {
        match dtype {
            DType::FP8E4M3 => 448.0,
            DType::FP8E5M2 => 57344.0,
            _ => 127.0,
        }
    }

    /// The rounding bound of `x` quantised at scale `s`: half a unit in the
    /// last place, relative for fp8's normals, absolute below them and for
    /// int8.
    fn bound(dtype: DType, x: f32, s: f32) -> f32 {
        let (rel, sub) = match dtype {
            DType::FP8E4M3 => (2f32.powi(-4), 2f32.powi(-10)),
            DType::FP8E5M2 => (2f32.powi(-3), 2f32.powi(-17)),
            _ => (0.0, 0.5),
        };
        (x.abs() * rel).max(s * sub) * 1.0001
    }

    /// One tensor of a cache (keys or values): its rows' bytes before the
    /// write, its scales before, and the new rows' values.
    struct Side {
        dim: usize,
        before: Vec<u8>,
        scales: Vec<f32>,
        new: Vec<f32>,
    }

    /// A cache of `units` (sequences or pages) of `PAGE` slots: every other
    /// row holds values, the rest poison (a NaN's bits), with scales per
    /// head or per page (every third page fresh, of scale 0).
    fn side(format: Format, units: usize, dim: usize, tokens: usize, rng: &mut Rng) -> Side {
        let fp8 = is_quantised(format.cache);
        let n_scales = if format.per_page { units * HKV } else { HKV };
        let scales: Vec<f32> = (0..n_scales)
            .map(|i| {
                if !fp8 || (format.per_page && (i / HKV).is_multiple_of(3)) {
                    0.0
                } else {
                    (0.2 + rng.uniform() as f32) / 100.0
                }
            })
            .collect();
        let mut before = Vec::new();
        for row in 0..units * HKV * PAGE {
            let x = rng.normal_f32(dim, 1.0);
            match (row % 2 == 1, fp8) {
                (true, false) if format.cache == DType::F32 => {
                    before.extend((0..dim).flat_map(|_| f32::NAN.to_le_bytes()));
                }
                (true, false) => before.extend((0..dim).flat_map(|_| [0xff, 0x7f])),
                // fp8's NaN; int8's -128, which no write makes.
                (true, true) if format.cache == DType::I8 => {
                    before.extend(std::iter::repeat_n(0x80, dim));
                }
                (true, true) => before.extend(std::iter::repeat_n(0x7f, dim)),
                (false, false) => before.extend(bytes_of(&x, format.cache)),
                (false, true) => {
                    let encode = match format.cache {
                        DType::FP8E4M3 => crate::cpu::f32_to_e4m3,
                        DType::FP8E5M2 => crate::cpu::f32_to_e5m2,
                        _ => |v: f32| (v * 0.4).round() as i8 as u8,
                    };
                    before.extend(x.iter().map(|&v| encode(v * 100.0)));
                }
            }
        }
        // Some values past a per-head scale's range (saturating).
        let new = rng
            .normal_f32(tokens * HKV * dim, 3.0)
            .into_iter()
            .map(|x| rounded(x, format.new))
            .collect();
        Side {
            dim,
            before,
            scales,
            new,
        }
    }

    /// Check one side after the write: `writes` are `(token, unit, slot)`,
    /// the new row of token `t` and head `h` being row `t · HKV + h` of
    /// `side.new` (the caller's layout mapped to tokens).
    fn check_side(
        what: &str,
        format: Format,
        side: &Side,
        after: &[u8],
        scales_after: &[f32],
        writes: &[(usize, usize, usize)],
    ) {
        let dim = side.dim;
        let elem = format.cache.size_in_bytes();
        let row_bytes = dim * elem;
        let fp8 = is_quantised(format.cache);
        let mut written = vec![None; side.before.len() / row_bytes];
        for &(token, unit, slot) in writes {
            for h in 0..HKV {
                written[(unit * HKV + h) * PAGE + slot] = Some(token * HKV + h);
            }
        }
        // The scales each (unit, head) ends with, and whether it grew.
        let mut want_scales = side.scales.clone();
        let mut grew = vec![false; written.len() / PAGE];
        if fp8 && format.per_page {
            for group in 0..written.len() / PAGE {
                let amax = (0..PAGE)
                    .filter_map(|slot| written[group * PAGE + slot])
                    .flat_map(|src| &side.new[src * dim..][..dim])
                    .fold(0.0f32, |a, x| a.max(x.abs()));
                let old = side.scales[group];
                want_scales[group] = old.max(amax / most(format.cache));
                grew[group] = old > 0.0 && want_scales[group] > old;
            }
        }
        assert_eq!(scales_after, want_scales.as_slice(), "{what}: the scales");
        for (row, src) in written.iter().enumerate() {
            let (got, was) = (
                &after[row * row_bytes..][..row_bytes],
                &side.before[row * row_bytes..][..row_bytes],
            );
            let group = row / PAGE;
            let s = if format.per_page {
                want_scales[group]
            } else {
                want_scales.get(group % HKV).copied().unwrap_or(0.0)
            };
            match src {
                Some(src) if !fp8 => {
                    let want = bytes_of(&side.new[src * dim..][..dim], format.cache);
                    assert_eq!(got, want.as_slice(), "{what}: row {row} holds its new row");
                }
                Some(src) => {
                    for (i, (&b, &x)) in got.iter().zip(&side.new[src * dim..][..dim]).enumerate() {
                        let x = x.clamp(-most(format.cache) * s, most(format.cache) * s);
                        let err = (decode(format.cache, b) * s - x).abs();
                        assert!(
                            err <= bound(format.cache, x, s),
                            "{what}: row {row} element {i} = {} for {x} (scale {s}), off by {err}",
                            decode(format.cache, b) * s
                        );
                    }
                }
                None if grew[group] => {
                    let old = side.scales[group];
                    for (i, (&b, &a)) in got.iter().zip(was).enumerate() {
                        let x = decode(format.cache, a) * old;
                        if x.is_nan() {
                            assert_eq!(b, a, "{what}: row {row} element {i}: poison stays");
                            continue;
                        }
                        let err = (decode(format.cache, b) * s - x).abs();
                        assert!(
                            err <= bound(format.cache, x, s),
                            "{what}: row {row} element {i} requantised to {} from {x}, off by {err}",
                            decode(format.cache, b) * s
                        );
                    }
                }
                None => assert_eq!(got, was, "{what}: row {row} is not written"),
            }
        }
    }

    /// Tensors of `R` from host values.
    fn on<R: AttentionRuntime>(
        device: &R::Device,
    ) -> impl Fn(&[u8], &[usize], DType) -> Tensor<R> + '_ {
        move |bytes, shape, dtype| Tensor::<R>::from_bytes(bytes, shape, dtype, device).unwrap()
    }

    /// Every form of write in every `format`, on `R`: written rows hold
    /// the new rows (to within the fp8 rounding), every other row keeps its
    /// bytes (poisoned rows included), but for an fp8 page whose scale grew,
    /// whose rows keep their values to within the new scale's rounding;
    /// scales per page grow to each write's largest value.
    pub(crate) fn writes_in_place_on<R: AttentionRuntime>(device: &R::Device, formats: &[Format]) {
        let seed = choose_seed();
        let mut rng = Rng::new(seed, 0);
        for &format in formats {
            for form in [Form::Cache, Form::Paged, Form::Mapped] {
                if form == Form::Cache && format.per_page {
                    continue;
                }
                let what =
                    format!("{form:?} {format:?}, seed {seed} (rerun with {SEED_ENV}={seed})");
                one_write::<R>(device, format, form, &mut rng, &what);
            }
        }
    }

    fn one_write<R: AttentionRuntime>(
        device: &R::Device,
        format: Format,
        form: Form,
        rng: &mut Rng,
        what: &str,
    ) {
        let t = on::<R>(device);
        let i32s = |x: &[i32]| Tensor::<R>::from_slice(x, &[x.len()], device).unwrap();
        let n = 3;
        let (units, tokens) = match form {
            Form::Cache => (B, B * n),
            Form::Paged => (PAGES, B * n),
            Form::Mapped => (PAGES, 7),
        };
        let (ks, vs) = (
            side(format, units, D, tokens, rng),
            side(format, units, DV, tokens, rng),
        );
        let cache_shape = |dim| [units, HKV, PAGE, dim];
        let (k, v) = (
            t(&ks.before, &cache_shape(D), format.cache),
            t(&vs.before, &cache_shape(DV), format.cache),
        );
        let scale_shape: &[usize] = if format.per_page {
            &[units, HKV]
        } else {
            &[HKV]
        };
        let (k_scales, v_scales) = (
            t(&bytes_of(&ks.scales, DType::F32), scale_shape, DType::F32),
            t(&bytes_of(&vs.scales, DType::F32), scale_shape, DType::F32),
        );
        let scales = is_quantised(format.cache).then_some(if format.per_page {
            KvScales::PerPage {
                k: &k_scales,
                v: &v_scales,
            }
        } else {
            KvScales::PerHead {
                k: &k_scales,
                v: &v_scales,
            }
        });
        // The new rows by token `(b, i)` or `t`, in the caller's layout.
        let by_token = |side: &Side| -> Vec<f32> {
            match form {
                // [B, Hkv, n, dim] from token-major rows.
                Form::Cache | Form::Paged => {
                    let dim = side.dim;
                    let mut x = vec![0.0; side.new.len()];
                    for b in 0..B {
                        for i in 0..n {
                            for h in 0..HKV {
                                let src = ((b * n + i) * HKV + h) * dim;
                                let dst = ((b * HKV + h) * n + i) * dim;
                                x[dst..dst + dim].copy_from_slice(&side.new[src..src + dim]);
                            }
                        }
                    }
                    x
                }
                Form::Mapped => side.new.clone(),
            }
        };
        let new_shape = |dim| match form {
            Form::Mapped => vec![tokens, HKV, dim],
            _ => vec![B, HKV, n, dim],
        };
        let (k_new, v_new) = (
            t(
                &bytes_of(&by_token(&ks), format.new),
                &new_shape(D),
                format.new,
            ),
            t(
                &bytes_of(&by_token(&vs), format.new),
                &new_shape(DV),
                format.new,
            ),
        );
        let mut writes = Vec::new();
        let (lengths, table, slots);
        let target = match form {
            Form::Cache => {
                let lens = [0, 2, 1];
                lengths = i32s(&lens);
                for (b, &len) in lens.iter().enumerate() {
                    writes.extend((0..n).map(|i| (b * n + i, b, len as usize + i)));
                }
                let keys = Keys::cache(&k, &v, &lengths);
                CacheSlots::after(match scales {
                    Some(s) => keys.with_scales(s),
                    None => keys,
                })
            }
            Form::Paged => {
                // Three pages per sequence, shuffled; writes across pages.
                let lens = [4, 0, 9];
                let pages = [7, 2, 5, 0, 8, 3, 1, 6, 4];
                table = Tensor::<R>::from_slice(&pages.map(|p| p as i32), &[B, 3], device).unwrap();
                lengths = i32s(&lens);
                for (b, &len) in lens.iter().enumerate() {
                    for i in 0..n {
                        let pos = len as usize + i;
                        writes.push((b * n + i, pages[b * 3 + pos / PAGE], pos % PAGE));
                    }
                }
                let keys = Keys::paged(&k, &v, &table, &lengths);
                CacheSlots::after(match scales {
                    Some(s) => keys.with_scales(s),
                    None => keys,
                })
            }
            Form::Mapped => {
                // Token 4 is padding; two tokens share a page.
                let map = [17, 3, 40, 18, -1, 0, 44];
                slots = i32s(&map);
                for (token, &slot) in map.iter().enumerate() {
                    if slot >= 0 {
                        writes.push((token, slot as usize / PAGE, slot as usize % PAGE));
                    }
                }
                let to = CacheSlots::mapped(&k, &v, &slots);
                match scales {
                    Some(s) => to.with_scales(s),
                    None => to,
                }
            }
        };
        append_kv(target, &k_new, &v_new).unwrap_or_else(|e| panic!("{what}: {e}"));
        let scales_after = |t: &Tensor<R>| {
            if is_quantised(format.cache) {
                t.to_vec::<f32>()
            } else {
                vec![0.0; t.numel()]
            }
        };
        check_side(
            &format!("k, {what}"),
            format,
            &ks,
            &k.to_bytes().unwrap(),
            &scales_after(&k_scales),
            &writes,
        );
        check_side(
            &format!("v, {what}"),
            format,
            &vs,
            &v.to_bytes().unwrap(),
            &scales_after(&v_scales),
            &writes,
        );
    }

    /// Every broken rule is an error naming the value, and leaves the
    /// cache as it was.
    #[test]
    fn bad_writes_are_errors_and_write_nothing() {
        use numr::runtime::cpu::{CpuDevice, CpuRuntime};
        type T = Tensor<CpuRuntime>;
        let dev = CpuDevice::new();
        let f32s = |shape: &[usize]| {
            let n = shape.iter().product();
            T::from_slice(&Rng::new(7, 0).normal_f32(n, 1.0), shape, &dev).unwrap()
        };
        let i32s = |x: &[i32], shape: &[usize]| T::from_slice(x, shape, &dev).unwrap();
        let (k, v) = (f32s(&[B, HKV, PAGE, D]), f32s(&[B, HKV, PAGE, DV]));
        let (kp, vp) = (f32s(&[PAGES, HKV, PAGE, D]), f32s(&[PAGES, HKV, PAGE, DV]));
        let (k_new, v_new) = (f32s(&[B, HKV, 3, D]), f32s(&[B, HKV, 3, DV]));
        let (k_tok, v_tok) = (f32s(&[2, HKV, D]), f32s(&[2, HKV, DV]));
        let ok_lengths = i32s(&[0, 1, 2], &[B]);
        let table = i32s(&[0, 1, 2, 3, 4, 5, 6, 7, 8], &[B, 3]);
        let full = i32s(&[0, 3, 2], &[B]);
        let past = i32s(&[0, 6, 2], &[B]);
        let paged_full = i32s(&[13, 0, 0], &[B]);
        let bad_table = i32s(&[0, 1, 2, 99, 4, 5, 6, 7, 8], &[B, 3]);
        let shared_table = i32s(&[0, 1, 2, 0, 4, 5, 6, 7, 8], &[B, 3]);
        let zeros = i32s(&[0, 0, 0], &[B]);
        let slot_past = i32s(&[3, 45], &[2]);
        let slot_neg = i32s(&[-2, 1], &[2]);
        let slot_twice = i32s(&[7, 7], &[2]);
        let slots_ok = i32s(&[7, 8], &[2]);
        let k_f16 = k_new.to_dtype(DType::F16).unwrap();
        let k_f64 = k_new.to_dtype(DType::F64).unwrap();
        let wrong_heads = f32s(&[B, 1, 3, D]);
        let wrong_dim = f32s(&[B, HKV, 3, D + 1]);
        let fp8 = T::from_bytes(
            &vec![0u8; B * HKV * PAGE * D],
            &[B, HKV, PAGE, D],
            DType::FP8E4M3,
            &dev,
        )
        .unwrap();
        let per_page = f32s(&[B, HKV]);
        let strided = f32s(&[B, HKV, D, PAGE]);
        let strided = strided.transpose(2, 3).unwrap();
        let before = |ts: &[&T]| ts.iter().map(|t| t.to_bytes().unwrap()).collect::<Vec<_>>();
        let caches = [&k, &v, &kp, &vp];
        let start = before(&caches);
        let cases: Vec<(&str, Result<()>)> = vec![
            (
                "sequence 1 holds 3 of 5 slots and gets 3 more",
                append_kv(
                    CacheSlots::after(Keys::cache(&k, &v, &full)),
                    &k_new,
                    &v_new,
                ),
            ),
            (
                "lengths[1] = 6",
                append_kv(
                    CacheSlots::after(Keys::cache(&k, &v, &past)),
                    &k_new,
                    &v_new,
                ),
            ),
            (
                "sequence 0 holds 13 of 15 slots",
                append_kv(
                    CacheSlots::after(Keys::paged(&kp, &vp, &table, &paged_full)),
                    &k_new,
                    &v_new,
                ),
            ),
            (
                "entry [1, 0] is 99",
                append_kv(
                    CacheSlots::after(Keys::paged(&kp, &vp, &bad_table, &zeros)),
                    &k_new,
                    &v_new,
                ),
            ),
            (
                "slot 0 written for",
                append_kv(
                    CacheSlots::after(Keys::paged(&kp, &vp, &shared_table, &zeros)),
                    &k_new,
                    &v_new,
                ),
            ),
            (
                "slots[1] = 45, with 45 slots",
                append_kv(CacheSlots::mapped(&kp, &vp, &slot_past), &k_tok, &v_tok),
            ),
            (
                "slots[0] = -2",
                append_kv(CacheSlots::mapped(&kp, &vp, &slot_neg), &k_tok, &v_tok),
            ),
            (
                "slot 7 written for",
                append_kv(CacheSlots::mapped(&kp, &vp, &slot_twice), &k_tok, &v_tok),
            ),
            (
                "k_new must have rank 3",
                append_kv(CacheSlots::mapped(&kp, &vp, &slots_ok), &k_new, &v_new),
            ),
            (
                "kv heads and head dim; got k_new [3, 1, 3, 12]",
                append_kv(
                    CacheSlots::after(Keys::cache(&k, &v, &ok_lengths)),
                    &wrong_heads,
                    &v_new,
                ),
            ),
            (
                "kv heads and head dim; got k_new [3, 2, 3, 13]",
                append_kv(
                    CacheSlots::after(Keys::cache(&k, &v, &ok_lengths)),
                    &wrong_dim,
                    &v_new,
                ),
            ),
            (
                "k_new F16, v_new F32",
                append_kv(
                    CacheSlots::after(Keys::cache(&k, &v, &ok_lengths)),
                    &k_f16,
                    &v_new,
                ),
            ),
            (
                "k_new F64",
                append_kv(
                    CacheSlots::after(Keys::cache(&k, &v, &ok_lengths)),
                    &k_f64,
                    &v_new,
                ),
            ),
            (
                "an fp8 or int8 cache needs its scales",
                append_kv(
                    CacheSlots::after(Keys::cache(&fp8, &fp8, &ok_lengths)),
                    &k_new,
                    &k_new,
                ),
            ),
            (
                "scales per page need pages",
                append_kv(
                    CacheSlots::after(Keys::cache(&fp8, &fp8, &ok_lengths).with_scales(
                        KvScales::PerPage {
                            k: &per_page,
                            v: &per_page,
                        },
                    )),
                    &k_new,
                    &k_new,
                ),
            ),
            (
                "appended to a cache (Keys::cache) or pages",
                append_kv(CacheSlots::after(Keys::dense(&k, &v)), &k_new, &v_new),
            ),
            (
                "a cache written in place is contiguous",
                append_kv(
                    CacheSlots::after(Keys::cache(&strided, &strided, &ok_lengths)),
                    &k_new,
                    &k_new,
                ),
            ),
        ];
        for (want, got) in cases {
            let e = got.expect_err(want).to_string();
            assert!(e.contains(want), "want an error with {want:?}, got {e:?}");
        }
        assert!(before(&caches) == start, "a refused write changed a cache");
    }

    /// An int8 cache (scales per head, and pages with scales per page),
    /// written by `append_kv`, reads as its dequantised values: attention
    /// over it equals attention over the f32 values its bytes and scales
    /// hold, through the decode kernel (1 row) and the tile kernels (40).
    /// The decode multiplies in integers where AVX-512 is present: q and
    /// the weights rounded to int16, each to half a step of 2^-15 of its
    /// row's largest, which the tolerance bounds (`cpu::gemv_i8`).
    #[test]
    fn int8_caches_read_as_their_dequantised_values() {
        use crate::stock::Causal;
        use crate::{AttentionOptions, attention};
        use numr::runtime::cpu::{CpuDevice, CpuRuntime};
        type T = Tensor<CpuRuntime>;
        let dev = CpuDevice::new();
        let mut rng = Rng::new(choose_seed(), 0);
        let (b, hq, hkv, cap, d, page) = (2, 4, 2, 96, 64, 16);
        let lens = [77i32, 96];
        let lengths = T::from_slice(&lens, &[b], &dev).unwrap();
        let zeros = |shape: &[usize]| {
            T::from_bytes(&vec![0u8; shape.iter().product()], shape, DType::I8, &dev).unwrap()
        };
        let mut new =
            |n: usize| T::from_slice(&rng.normal_f32(n, 2.0), &[b, hkv, cap, d], &dev).unwrap();
        let (k_new, v_new) = (new(b * hkv * cap * d), new(b * hkv * cap * d));
        let none = T::from_slice(&[0i32, 0], &[b], &dev).unwrap();
        // Contiguous, scales per head from the values' amax.
        let (k, v) = (zeros(&[b, hkv, cap, d]), zeros(&[b, hkv, cap, d]));
        let ks = amax_scales(&k_new, DType::FP8E4M3).unwrap().to_vec::<f32>();
        let ks: Vec<f32> = ks.iter().map(|s| s * 448.0 / 127.0).collect();
        let (k_s, v_s) = (
            T::from_slice(&ks, &[hkv], &dev).unwrap(),
            T::from_slice(&ks, &[hkv], &dev).unwrap(),
        );
        let per_head = KvScales::PerHead { k: &k_s, v: &v_s };
        append_kv(
            CacheSlots::after(Keys::cache(&k, &v, &none).with_scales(per_head)),
            &k_new,
            &v_new,
        )
        .unwrap();
        // Pages of 16 (the sequences' in order), scales per page grown by the write.
        let pages = b * cap / page;
        let (kp, vp) = (zeros(&[pages, hkv, page, d]), zeros(&[pages, hkv, page, d]));
        let (kps, vps) = (
            T::zeros(&[pages, hkv], DType::F32, &dev).unwrap(),
            T::zeros(&[pages, hkv], DType::F32, &dev).unwrap(),
        );
        let per_page = KvScales::PerPage { k: &kps, v: &vps };
        let table: Vec<i32> = (0..pages as i32).collect();
        let table = T::from_slice(&table, &[b, cap / page], &dev).unwrap();
        append_kv(
            CacheSlots::after(Keys::paged(&kp, &vp, &table, &none).with_scales(per_page)),
            &k_new,
            &v_new,
        )
        .unwrap();
        // The f32 values each holds.
        let dequantised = |t: &T, scales: &T, per: usize| -> T {
            let bytes = t.to_bytes().unwrap();
            let s = scales.to_vec::<f32>();
            let x: Vec<f32> = bytes
                .iter()
                .enumerate()
                .map(|(i, &q)| f32::from(q as i8) * s[(i / (per * d)) % s.len()])
                .collect();
            T::from_slice(&x, t.shape(), &dev).unwrap()
        };
        let opts = AttentionOptions::default();
        for sq in [1, 40] {
            let q = T::from_slice(&rng.normal_f32(b * hq * sq * d, 1.0), &[b, hq, sq, d], &dev)
                .unwrap();
            let got = attention(
                &Causal,
                &q,
                Keys::cache(&k, &v, &lengths).with_scales(per_head),
                &opts,
            )
            .unwrap()
            .out
            .to_vec::<f32>();
            let want = attention(
                &Causal,
                &q,
                Keys::cache(
                    &dequantised(&k, &k_s, cap),
                    &dequantised(&v, &v_s, cap),
                    &lengths,
                ),
                &opts,
            )
            .unwrap()
            .out
            .to_vec::<f32>();
            let paged = attention(
                &Causal,
                &q,
                Keys::paged(&kp, &vp, &table, &lengths).with_scales(per_page),
                &opts,
            )
            .unwrap()
            .out
            .to_vec::<f32>();
            let want_paged = attention(
                &Causal,
                &q,
                Keys::paged(
                    &dequantised(&kp, &kps, page),
                    &dequantised(&vp, &vps, page),
                    &table,
                    &lengths,
                ),
                &opts,
            )
            .unwrap()
            .out
            .to_vec::<f32>();
            // The integer decode's roundings: each score off by at most
            // scale · max|q| / 2^16 · Σ|k| (a key's), moving an output by
            // at most twice that times max|v|; each weight off by at most
            // 2^-16 of the largest (1), times |v|, for every key.
            let rounding = |k: &T, v: &T| -> f32 {
                if sq > 1 {
                    return 0.0;
                }
                let (k, v) = (k.to_vec::<f32>(), v.to_vec::<f32>());
                let q_max = q.to_vec::<f32>().iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let k_sum = k.chunks(d).map(|r| r.iter().map(|x| x.abs()).sum::<f32>());
                let v_max = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let score = opts.scale.unwrap_or(1.0 / (d as f32).sqrt()) * q_max / 65534.0
                    * k_sum.fold(0.0, f32::max);
                2.0 * score * v_max + cap as f32 * v_max / 65534.0
            };
            let bounds = [
                rounding(&dequantised(&k, &k_s, cap), &dequantised(&v, &v_s, cap)),
                rounding(&dequantised(&kp, &kps, page), &dequantised(&vp, &vps, page)),
            ];
            let pairs = [("cache", &got, &want), ("pages", &paged, &want_paged)];
            for ((what, got, want), bound) in pairs.into_iter().zip(bounds) {
                for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
                    assert!(
                        (g - w).abs() <= 2e-5 * (1.0 + w.abs()) + bound,
                        "{what}, {sq} rows: element {i}: {g} against {w} (rounding bound {bound})"
                    );
                }
            }
        }
    }

    #[test]
    fn writes_in_place_on_the_cpu() {
        writes_in_place_on::<numr::runtime::cpu::CpuRuntime>(
            &numr::runtime::cpu::CpuDevice::new(),
            &CPU_FORMATS,
        );
    }
}
