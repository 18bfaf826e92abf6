//! Generation from the trained model: the prompt prefilled and each new
//! token decoded through boostr's paged KV cache (`PagedKvCache`, written by
//! its `reshape_and_cache`), which the compiled variant reads in place
//! through `Keys::paged`; tokens sampled with boostr's `sample_token`.

use crate::net::{Model, Weights, with_attention};
use boostr::inference::kv_cache::PagedKvCache;
use boostr::ops::SamplingOps;
use boostr_runtime::Keys;
use numr::autograd::Var;
use numr::dtype::DType;
use numr::runtime::cpu::{CpuClient, CpuDevice, CpuRuntime};
use numr::tensor::Tensor;
use std::time::{Duration, Instant};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Positions per page.
const PAGE: usize = 16;

/// One sequence's paged cache: a `PagedKvCache` per layer and the pages it
/// owns, in the order of its positions.
struct Cache {
    layers: Vec<PagedKvCache<CpuRuntime>>,
    /// `[1, pages]` (i32): the sequence's pages, deliberately not in
    /// storage order, so that the table is what finds them.
    table: Tensor<CpuRuntime>,
    pages: Vec<usize>,
    len: usize,
}

impl Cache {
    fn new(model: &Model, capacity: usize, device: &CpuDevice) -> Result<Self> {
        let c = &model.config;
        let n = capacity.div_ceil(PAGE);
        let layers = (0..c.layers)
            .map(|_| PagedKvCache::new(n, PAGE, c.kv_heads, c.head_dim(), DType::F32, device))
            .collect::<std::result::Result<_, _>>()?;
        let pages: Vec<usize> = (0..n).rev().collect();
        let table: Vec<i32> = pages.iter().map(|&p| p as i32).collect();
        Ok(Self {
            layers,
            table: Tensor::from_slice(&table, &[1, n], device)?,
            pages,
            len: 0,
        })
    }

    /// The slots of positions `start..start + n` (boostr's slot mapping:
    /// page · PAGE + offset), i32: boostr 0.10's CPU `reshape_and_cache`
    /// reads them as i32 (its documentation says i64, which panics).
    fn slots(&self, start: usize, n: usize, device: &CpuDevice) -> Result<Tensor<CpuRuntime>> {
        let slots: Vec<i32> = (start..start + n)
            .map(|p| (self.pages[p / PAGE] * PAGE + p % PAGE) as i32)
            .collect();
        Ok(Tensor::from_slice(&slots, &[n], device)?)
    }
}

/// What a generation measured.
pub struct Report {
    /// The largest |decode logit − full-sequence logit| over every
    /// generated position, and the largest |logit|.
    pub logit_error: f64,
    pub logit_scale: f64,
    pub prefill: Duration,
    pub decode: Duration,
    pub decoded: usize,
}

/// `n` tokens after `prompt` (token ids), sampled at `temperature` with
/// nucleus `top_p`.
pub fn generate(
    model: &Model,
    w: &Weights,
    client: &CpuClient,
    device: &CpuDevice,
    prompt: &[i64],
    n: usize,
    (temperature, top_p): (f32, f32),
) -> Result<(Vec<i64>, Report)> {
    let c = model.config;
    if prompt.is_empty() || prompt.len() + n > c.max_seq {
        return Err(format!(
            "a prompt of {} tokens and {n} new ones must fit in 1..={} positions",
            prompt.len(),
            c.max_seq
        )
        .into());
    }
    let mut cache = Cache::new(model, prompt.len() + n, device)?;
    let mut tokens = prompt.to_vec();
    let mut logits_seen: Vec<Vec<f32>> = Vec::new();
    let (mut prefill, mut decode) = (Duration::ZERO, Duration::ZERO);
    for step in 0..=n {
        let started = Instant::now();
        // The new tokens: the whole prompt first, then one at a time.
        let new = if step == 0 {
            &tokens[..]
        } else {
            &tokens[tokens.len() - 1..]
        };
        let (start, count) = (cache.len, new.len());
        let ids = Tensor::from_slice(new, &[1, count], device)?;
        let mut x = model.embed(client, w, &ids, false)?;
        let slots = cache.slots(start, count, device)?;
        let lengths = Tensor::from_slice(&[(start + count) as i32], &[1], device)?;
        for l in 0..c.layers {
            let (q, k, v) = model.qkv(client, w, l, &x, false)?;
            let (q, k, v) = with_attention!(model, w, l, false, |a| a.heads(
                &q,
                &k,
                &v,
                Some(&model.rope),
                start
            )?);
            // boostr's cache takes tokens as [n, Hkv, D] and stores pages
            // as [pages, PAGE, Hkv, D]; the kernels read them in place as
            // [pages, Hkv, PAGE, D] views.
            let tokens_major = |t: &Tensor<CpuRuntime>| -> Result<Tensor<CpuRuntime>> {
                Ok(t.permute(&[0, 2, 1, 3])?.contiguous()?.reshape(&[
                    count,
                    c.kv_heads,
                    c.head_dim(),
                ])?)
            };
            let layer = &cache.layers[l];
            layer.update(&tokens_major(&k)?, &tokens_major(&v)?, &slots, client)?;
            let k_pages = layer.k_cache().permute(&[0, 2, 1, 3])?;
            let v_pages = layer.v_cache().permute(&[0, 2, 1, 3])?;
            let keys = Keys::paged(&k_pages, &v_pages, &cache.table, &lengths);
            let a = with_attention!(model, w, l, false, |a| a.decode(&q, keys)?);
            x = model.block_out(client, w, l, &x, &Var::new(a, false), false)?;
        }
        cache.len += count;
        let logits = model.head(client, w, &x, false)?;
        let last = logits.tensor().narrow(1, count - 1, 1)?.contiguous()?;
        let last = last.reshape(&[c.vocab])?;
        logits_seen.push(last.to_vec::<f32>());
        if step < n {
            let next = client.sample_token(&last, temperature, 0, top_p, 0.0)?;
            tokens.push(i64::from(next));
        }
        if step == 0 {
            prefill += started.elapsed();
        } else {
            decode += started.elapsed();
        }
    }
    // The same tokens through the training forward, all at once: its logits
    // at each generated position must be the decode's.
    let all = Tensor::from_slice(&tokens, &[1, tokens.len()], device)?;
    let full = model
        .logits(client, w, &all, false)?
        .tensor()
        .contiguous()?
        .to_vec::<f32>();
    let (mut logit_error, mut logit_scale) = (0.0f64, 0.0f64);
    for (i, seen) in logits_seen.iter().enumerate() {
        let row = prompt.len() - 1 + i;
        for (a, b) in seen.iter().zip(&full[row * c.vocab..][..c.vocab]) {
            logit_error = logit_error.max(f64::from((a - b).abs()));
            logit_scale = logit_scale.max(f64::from(b.abs()));
        }
    }
    Ok((
        tokens,
        Report {
            logit_error,
            logit_scale,
            prefill,
            decode,
            decoded: n,
        },
    ))
}
