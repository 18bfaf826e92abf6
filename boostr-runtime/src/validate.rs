//! Up-front validation of attention inputs: every rule is checked before any
//! kernel runs, and a broken rule is an [`Error`] naming it and the values.

use crate::error::{Error, Result};
use crate::options::AttentionOptions;
use crate::problem::{Dropout, Problem};
use crate::variant::{HostVariant, Variant};
use numr::dtype::DType;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// Positions, batch and head indices are `i32` in every kernel (CUDA and WGSL
/// index with 32 bits), and the tile classifiers rely on them staying below
/// 2^30 in magnitude so that sums and differences of two never overflow.
pub(crate) const MAX_INDEX: usize = (1 << 30) - 1;

fn dims4<R: Runtime<DType = DType>>(name: &'static str, t: &Tensor<R>) -> Result<[usize; 4]> {
    let shape = t.shape();
    let dims: [usize; 4] = shape.try_into().map_err(|_| Error::Rank {
        name,
        rank: 4,
        layout: "[batch, heads, seq, head_dim]",
        shape: shape.to_vec(),
    })?;
    if dims.contains(&0) {
        return Err(Error::ZeroSize {
            name,
            shape: shape.to_vec(),
        });
    }
    in_storage(name, t)?;
    Ok(dims)
}

/// Every element of the (non-empty) view `t` lies inside its storage.
fn in_storage<R: Runtime<DType = DType>>(name: &'static str, t: &Tensor<R>) -> Result<()> {
    let offset = t.offset() as i64;
    let (mut lo, mut hi) = (offset, offset);
    for (&extent, &stride) in t.shape().iter().zip(t.strides()) {
        let reach = (extent as i64 - 1) * stride as i64;
        if reach < 0 {
            lo += reach;
        } else {
            hi += reach;
        }
    }
    let storage = t.storage().len();
    if lo >= 0 && hi < storage as i64 {
        return Ok(());
    }
    Err(Error::ViewPastStorage {
        name,
        shape: t.shape().to_vec(),
        strides: t.strides().to_vec(),
        offset: t.offset(),
        reach: if lo < 0 { -1 } else { hi },
        storage,
    })
}

/// Check a tensor's dtype against what the backend supports.
pub(crate) fn check_dtype<R: Runtime<DType = DType>>(
    name: &'static str,
    t: &Tensor<R>,
    backend: &'static str,
    supported: &[DType],
    supported_text: &'static str,
) -> Result<()> {
    if supported.contains(&t.dtype()) {
        Ok(())
    } else {
        Err(Error::DType {
            name,
            dtype: t.dtype(),
            backend,
            supported: supported_text,
        })
    }
}

/// The problem of a paged KV cache: `q [B, Hq, Sq, D]`, `k_pages [pages,
/// Hkv, page_size, D]`, `v_pages [pages, Hkv, page_size, Dv]`, `page_table
/// [B, max_pages]` (`i32`), with `Sk = max_pages · page_size`; and the page
/// size.
pub fn paged_problem<R: Runtime<DType = DType>>(
    q: &Tensor<R>,
    k_pages: &Tensor<R>,
    v_pages: &Tensor<R>,
    page_table: &Tensor<R>,
    scale: Option<f32>,
) -> Result<(Problem, usize)> {
    let [b, _, _, _] = dims4("q", q)?;
    let [_, _, page_size, _] = dims4("k", k_pages)?;
    let [_, _, _, dv] = dims4("v", v_pages)?;
    if k_pages.shape()[..3] != v_pages.shape()[..3] {
        return Err(Error::Shapes {
            rule: "k and v pages must agree in every dim but the last (pages, heads, page size)",
            q: q.shape().to_vec(),
            k: k_pages.shape().to_vec(),
            v: v_pages.shape().to_vec(),
        });
    }
    if page_table.dtype() != DType::I32 {
        return Err(Error::CacheIndexDType {
            name: "page_table",
            got: page_table.dtype(),
        });
    }
    let &[tb, max_pages] = page_table.shape() else {
        return Err(Error::ShapeOf {
            name: "page_table",
            expected: vec![b, 0],
            got: page_table.shape().to_vec(),
        });
    };
    if tb != b || max_pages == 0 {
        return Err(Error::ShapeOf {
            name: "page_table",
            expected: vec![b, max_pages.max(1)],
            got: page_table.shape().to_vec(),
        });
    }
    let mut p = check_pages(q, k_pages, scale)?.with_head_dim_v(dv);
    let capacity = max_pages
        .checked_mul(page_size)
        .filter(|&c| c <= MAX_INDEX)
        .ok_or(Error::TooLarge {
            name: "max_pages · page_size",
            value: max_pages.saturating_mul(page_size),
            max: MAX_INDEX,
        })?;
    p.seq_k = capacity;
    Ok((p, page_size))
}

/// [`problem`] of `q` against the pages (heads, head dim, sizes), with
/// `q`'s batch and each page's `page_size` keys as `Sk`.
fn check_pages<R: Runtime<DType = DType>>(
    q: &Tensor<R>,
    pages: &Tensor<R>,
    scale: Option<f32>,
) -> Result<Problem> {
    let [b, hq, sq, dq] = dims4("q", q)?;
    let [_, hk, sk, dk] = dims4("k", pages)?;
    if dq != dk {
        return Err(Error::Shapes {
            rule: "q and k must have the same head dim (dim 3)",
            q: q.shape().to_vec(),
            k: pages.shape().to_vec(),
            v: pages.shape().to_vec(),
        });
    }
    problem_of([b, hq, sq, dq], (hk, sk), scale)
}

/// The problem of `q [B, Hq, Sq, D]` against keys of `Hkv` heads and `Sk`
/// slots, the shapes already agreeing: the heads group, every size fits
/// the kernels' indices, and the scale (default `1/sqrt(D)`) is finite.
fn problem_of(
    [batch, heads_q, seq_q, head_dim]: [usize; 4],
    (heads_kv, seq_k): (usize, usize),
    scale: Option<f32>,
) -> Result<Problem> {
    if heads_q % heads_kv != 0 {
        return Err(Error::Heads { heads_q, heads_kv });
    }
    let sizes = [
        ("batch", batch),
        ("Hq", heads_q),
        ("Sq", seq_q),
        ("Sk", seq_k),
    ];
    for (name, value) in sizes {
        if value > MAX_INDEX {
            return Err(Error::TooLarge {
                name,
                value,
                max: MAX_INDEX,
            });
        }
    }
    let scale = scale.unwrap_or(1.0 / (head_dim as f32).sqrt());
    if !scale.is_finite() {
        return Err(Error::Scale(scale));
    }
    Ok(Problem::new(batch, (heads_q, heads_kv), (seq_q, seq_k), head_dim).with_scale(scale))
}

/// The page table's values, each entry that sequence `b`'s length reaches
/// checked to be a page (`0 .. pages`); entries past it are not read (0).
pub fn page_table<R: Runtime<DType = DType>>(
    table: &Tensor<R>,
    lengths: &[usize],
    page_size: usize,
    pages: usize,
) -> Result<Vec<usize>> {
    let values = table.contiguous()?.to_vec::<i32>();
    let max_pages = values.len() / lengths.len().max(1);
    let mut out = vec![0usize; values.len()];
    for (batch, &len) in lengths.iter().enumerate() {
        for page in 0..len.div_ceil(page_size) {
            let index = values[batch * max_pages + page];
            out[batch * max_pages + page] = usize::try_from(index)
                .ok()
                .filter(|&i| i < pages)
                .ok_or(Error::PageIndex {
                    batch,
                    page,
                    index: i64::from(index),
                    pages,
                })?;
        }
    }
    Ok(out)
}

/// `p` with what `opts` asks of the kernels: whether to return each row's
/// largest score, and the call's dropout draw for a variant with
/// `dropout`, whose probability must lie in `[0, 1)` and whose batch and
/// query heads must fit the counter's 16 bits each
/// ([`kernels_spec::dropout`]).
pub fn call<V: Variant>(variant: &V, p: Problem, opts: &AttentionOptions) -> Result<Problem> {
    let p = p.with_max_scores(opts.max_scores);
    if !<V::Host as HostVariant>::WEIGHTS.dropout {
        return Ok(p);
    }
    let prob = variant.dropout();
    let dropout =
        Dropout::new(prob, opts.dropout_seed, opts.dropout_offset).ok_or(Error::Dropout(prob))?;
    if dropout.active() {
        for (name, value) in [("batch", p.batch), ("Hq", p.heads_q)] {
            if value > DROPOUT_MAX_INDEX {
                return Err(Error::TooLarge {
                    name,
                    value,
                    max: DROPOUT_MAX_INDEX,
                });
            }
        }
    }
    Ok(p.with_dropout(dropout))
}

/// The largest batch and query head count with dropout: each is 16 bits of
/// the generator's counter.
const DROPOUT_MAX_INDEX: usize = 1 << 16;

/// The packed rows of `q [total_q, Hq, D]` and of `k [total_k, Hkv, D]`,
/// `v [total_k, Hkv, Dv]` (FlashAttention's varlen layout): each of rank
/// 3, `k` and `v` of as many rows; the rest is checked on the kernels'
/// view of them ([`problem`]).
pub fn packed_totals<R: Runtime<DType = DType>>(
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
) -> Result<[usize; 2]> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.ndim() != 3 {
            return Err(Error::Rank {
                name,
                rank: 3,
                layout: "[total, heads, head_dim] (packed sequences)",
                shape: t.shape().to_vec(),
            });
        }
    }
    if k.shape()[0] != v.shape()[0] {
        return Err(Error::Shapes {
            rule: "packed k and v must have the same rows (dim 0)",
            q: q.shape().to_vec(),
            k: k.shape().to_vec(),
            v: v.shape().to_vec(),
        });
    }
    Ok([q.shape()[0], k.shape()[0]])
}

/// The rows of packed queries `q [total_q, Hq, D]` (over keys in pages).
pub fn packed_queries<R: Runtime<DType = DType>>(q: &Tensor<R>) -> Result<usize> {
    if q.ndim() != 3 {
        return Err(Error::Rank {
            name: "q",
            rank: 3,
            layout: "[total_q, heads, head_dim] (packed queries)",
            shape: q.shape().to_vec(),
        });
    }
    Ok(q.shape()[0])
}

/// Validate `q [B, Hq, Sq, D]`, `k [B, Hkv, Sk, D]` and `v [B, Hkv, Sk, Dv]`
/// and derive the [`Problem`].
pub fn problem<R: Runtime<DType = DType>>(
    q: &Tensor<R>,
    k: &Tensor<R>,
    v: &Tensor<R>,
    scale: Option<f32>,
) -> Result<Problem> {
    let [bq, hq, sq, dq] = dims4("q", q)?;
    let [bk, hk, sk, dk] = dims4("k", k)?;
    let [bv, hv, sv, dv] = dims4("v", v)?;
    let shapes = |rule| Error::Shapes {
        rule,
        q: q.shape().to_vec(),
        k: k.shape().to_vec(),
        v: v.shape().to_vec(),
    };
    if bq != bk || bq != bv {
        return Err(shapes(
            "q, k and v must have the same batch size (dim 0), or k and v a batch of 1 \
             (keys shared by every sequence)",
        ));
    }
    if hk != hv {
        return Err(shapes("k and v must have the same number of heads (dim 1)"));
    }
    if sk != sv {
        return Err(shapes("k and v must have the same sequence length (dim 2)"));
    }
    if dq != dk {
        return Err(shapes("q and k must have the same head dim (dim 3)"));
    }
    Ok(problem_of([bq, hq, sq, dq], (hk, sk), scale)?.with_head_dim_v(dv))
}

/// Check that `t` has exactly `expected` as its shape.
pub fn shape_of<R: Runtime<DType = DType>>(
    name: &'static str,
    t: &Tensor<R>,
    expected: &[usize],
) -> Result<()> {
    if t.shape() == expected {
        Ok(())
    } else {
        Err(Error::ShapeOf {
            name,
            expected: expected.to_vec(),
            got: t.shape().to_vec(),
        })
    }
}
