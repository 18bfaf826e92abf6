//! Continuous batching over pages: a stream of requests of different
//! prompt lengths, most of them opening with one shared system prompt,
//! served by a decoder with one attention layer (random weights: the
//! tokens are noise, the work is a server's). Each step packs every
//! running request's rows (a decode's one token, a prefill's chunk) into
//! one batch: their keys and values are written into the pages through a
//! slot mapping (`append_kv`), then one call (`Keys::paged_packed`) attends
//! all of them. Requests join when pages are free, leave when done, and
//! their pages go back to the pool; the system prompt's pages are written
//! once and read by every request that shares it. Prints a progress line
//! and the tokens per second; at the end, checks one request's last step
//! against plain attention over its keys gathered from the pages.
//!
//! ```text
//! cargo run --release -p boostr-runtime --example serve [-- <requests> <seed>]
//! ```

use boostr_runtime::stock::Causal;
use boostr_runtime::testing::Rng;
use boostr_runtime::{AttentionOptions, CacheSlots, Keys, append_kv, attention};
use numr::ops::{IndexingOps as _, MatmulOps as _};
use numr::runtime::Runtime as _;
use numr::runtime::cpu::{CpuDevice, CpuRuntime};
use numr::tensor::Tensor;
use std::collections::VecDeque;
use std::io::Write as _;
use std::time::Instant;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;
type T = Tensor<CpuRuntime>;

/// Query heads, KV heads, head dim, embedding width, vocabulary.
const HQ: usize = 16;
const HKV: usize = 4;
const D: usize = 64;
const EMBED: usize = 256;
const VOCAB: usize = 512;
/// Keys per page, pages in the pool, pages per request at most.
const PAGE: usize = 16;
const POOL: usize = 640;
const MAX_PAGES: usize = 64;
/// The shared system prompt's tokens (whole pages).
const SYSTEM: usize = 256;
/// Running requests at most, and prompt tokens a step prefills at most.
const RUNNING: usize = 8;
const CHUNK: usize = 256;

/// The decoder's weights: embeddings and the projections to q, k, v and
/// back to the vocabulary.
struct Model {
    embed: T,
    wq: T,
    wk: T,
    wv: T,
    wo: T,
}

impl Model {
    fn new(rng: &mut Rng, device: &CpuDevice) -> Result<Self> {
        let mut w = |rows: usize, cols: usize, std: f32| -> Result<T> {
            Ok(T::from_slice(
                &rng.normal_f32(rows * cols, std),
                &[rows, cols],
                device,
            )?)
        };
        let s = 1.0 / (EMBED as f32).sqrt();
        Ok(Model {
            embed: w(VOCAB, EMBED, 1.0)?,
            wq: w(EMBED, HQ * D, s)?,
            wk: w(EMBED, HKV * D, s)?,
            wv: w(EMBED, HKV * D, s)?,
            wo: w(HQ * D, VOCAB, 1.0 / ((HQ * D) as f32).sqrt())?,
        })
    }

    /// `q [T, Hq, D]`, `k, v [T, Hkv, D]` of `tokens`.
    fn qkv(&self, tokens: &[i32], device: &CpuDevice) -> Result<(T, T, T)> {
        let c = CpuRuntime::default_client(device);
        let ids = T::from_slice(tokens, &[tokens.len()], device)?;
        let x = c.index_select(&self.embed, 0, &ids)?;
        let n = tokens.len();
        Ok((
            c.matmul(&x, &self.wq)?.reshape(&[n, HQ, D])?,
            c.matmul(&x, &self.wk)?.reshape(&[n, HKV, D])?,
            c.matmul(&x, &self.wv)?.reshape(&[n, HKV, D])?,
        ))
    }

    /// The greedy next token of each of `rows` of `out [T, Hq, D]`.
    fn next(&self, out: &T, rows: &[i32], device: &CpuDevice) -> Result<Vec<i32>> {
        let c = CpuRuntime::default_client(device);
        let picked = c.index_select(out, 0, &T::from_slice(rows, &[rows.len()], device)?)?;
        let logits = c.matmul(&picked.reshape(&[rows.len(), HQ * D])?, &self.wo)?;
        let best = c.argmax(&logits, 1, false)?;
        Ok(best.to_vec::<i64>().iter().map(|&t| t as i32).collect())
    }
}

/// One request: its tokens (prompt, then generated), how many are in the
/// cache, its pages, and how many tokens it still generates.
struct Request {
    tokens: Vec<i32>,
    prompt: usize,
    cached: usize,
    pages: Vec<usize>,
    /// Leading pages that are the system prompt's (not its own).
    shared: usize,
    to_generate: usize,
}

mod common;

const USAGE: &str = "usage: serve [<requests> <seed>] (defaults 32 5)";

fn main() -> Result<()> {
    let args = common::Args::parse(USAGE, &["requests", "seed"]);
    let requests: usize = args.get(0, "requests", 32);
    let seed: u64 = args.get(1, "seed", 5);
    let device = CpuDevice::new();
    let mut rng = Rng::new(seed, 0);
    let model = Model::new(&mut rng, &device)?;
    let k_pages = T::zeros(&[POOL, HKV, PAGE, D], numr::dtype::DType::F32, &device)?;
    let v_pages = T::zeros(&[POOL, HKV, PAGE, D], numr::dtype::DType::F32, &device)?;
    let mut free: Vec<usize> = (0..POOL).rev().collect();
    let opts = AttentionOptions::default();
    let token = |rng: &mut Rng| (rng.uniform() * VOCAB as f64) as i32 % VOCAB as i32;

    // The system prompt, prefilled once into pages every sharer reads.
    let system: Vec<i32> = (0..SYSTEM).map(|_| token(&mut rng)).collect();
    let system_pages: Vec<usize> = (0..SYSTEM / PAGE)
        .map(|_| free.pop().expect("a page"))
        .collect();
    {
        let (_, k, v) = model.qkv(&system, &device)?;
        let slots: Vec<i32> = (0..SYSTEM)
            .map(|i| (system_pages[i / PAGE] * PAGE + i % PAGE) as i32)
            .collect();
        let slots = T::from_slice(&slots, &[SYSTEM], &device)?;
        append_kv(CacheSlots::mapped(&k_pages, &v_pages, &slots), &k, &v)?;
    }

    // The stream: prompts of 8 to 600 tokens after the system prompt (3
    // in 4 share it), 8 to 64 tokens each to generate.
    let mut waiting: VecDeque<Request> = (0..requests)
        .map(|_| {
            let shares = rng.uniform() < 0.75;
            let own = 8 + (rng.uniform() * 592.0) as usize;
            let mut tokens: Vec<i32> = if shares { system.clone() } else { Vec::new() };
            tokens.extend((0..own).map(|_| token(&mut rng)));
            Request {
                prompt: tokens.len(),
                tokens,
                cached: if shares { SYSTEM } else { 0 },
                pages: if shares {
                    system_pages.clone()
                } else {
                    Vec::new()
                },
                shared: if shares { system_pages.len() } else { 0 },
                to_generate: 8 + (rng.uniform() * 56.0) as usize,
            }
        })
        .collect();
    let sharing = waiting.iter().filter(|r| r.shared > 0).count();
    let mut running: Vec<Request> = Vec::new();
    let (mut done, mut steps, mut pages_reused, mut high_water) = (0, 0, 0usize, 0usize);
    let mut was_freed = vec![false; POOL];
    let (mut prefilled, mut generated) = (0usize, 0usize);
    let mut last_check = None;
    let start = Instant::now();
    while done < requests {
        // Admit while a request's pages fit (its prompt and generation).
        while running.len() < RUNNING {
            let Some(r) = waiting.front() else { break };
            let need = (r.prompt + r.to_generate).div_ceil(PAGE) - r.shared;
            if need > free.len() || r.prompt + r.to_generate > MAX_PAGES * PAGE {
                break;
            }
            running.push(waiting.pop_front().expect("a waiting request"));
        }
        // This step's rows: each request's next tokens (a decode's one,
        // a prefill's chunk within the step's budget).
        let mut budget = CHUNK;
        let mut rows = Vec::with_capacity(running.len());
        for r in &running {
            let left = r.tokens.len() - r.cached;
            let n = if r.cached >= r.prompt {
                1
            } else {
                left.min(budget.max(1))
            };
            budget = budget.saturating_sub(n);
            rows.push(n);
        }
        let (mut tokens, mut slots, mut cu, mut lengths) =
            (Vec::new(), Vec::new(), vec![0i32], Vec::new());
        for (r, &n) in running.iter_mut().zip(&rows) {
            for pos in r.cached..r.cached + n {
                if pos / PAGE == r.pages.len() {
                    let page = free.pop().ok_or("the pool ran dry")?;
                    pages_reused += usize::from(was_freed[page]);
                    r.pages.push(page);
                }
                prefilled += usize::from(pos < r.prompt);
                tokens.push(r.tokens[pos]);
                slots.push((r.pages[pos / PAGE] * PAGE + pos % PAGE) as i32);
            }
            r.cached += n;
            cu.push(cu.last().expect("0") + n as i32);
            lengths.push(r.cached as i32);
        }
        let (q, k, v) = model.qkv(&tokens, &device)?;
        let slot_t = T::from_slice(&slots, &[slots.len()], &device)?;
        append_kv(CacheSlots::mapped(&k_pages, &v_pages, &slot_t), &k, &v)?;
        let mut table = vec![0i32; running.len() * MAX_PAGES];
        for (b, r) in running.iter().enumerate() {
            for (i, &p) in r.pages.iter().enumerate() {
                table[b * MAX_PAGES + i] = p as i32;
            }
        }
        let n = running.len();
        let (table_t, len_t, cu_t) = (
            T::from_slice(&table, &[n, MAX_PAGES], &device)?,
            T::from_slice(&lengths, &[n], &device)?,
            T::from_slice(&cu, &[n + 1], &device)?,
        );
        let keys = Keys::paged_packed(&k_pages, &v_pages, &table_t, &len_t, &cu_t);
        let out = attention(&Causal, &q, keys, &opts)?.out;
        // The next token of each request whose prompt is all in: from its
        // last row.
        let finishing: Vec<usize> = (0..n)
            .filter(|&b| running[b].cached >= running[b].prompt)
            .collect();
        let last_rows: Vec<i32> = finishing.iter().map(|&b| cu[b + 1] - 1).collect();
        if !last_rows.is_empty() {
            for (&b, t) in finishing.iter().zip(model.next(&out, &last_rows, &device)?) {
                running[b].tokens.push(t);
                running[b].to_generate -= 1;
            }
        }
        generated += finishing.len();
        steps += 1;
        last_check = Some((
            out,
            cu.clone(),
            running
                .iter()
                .map(|r| (r.pages.clone(), r.cached))
                .collect::<Vec<_>>(),
            q,
        ));
        // Requests that are done leave; their own pages go back.
        let before = running.len();
        running.retain_mut(|r| {
            if r.to_generate == 0 {
                for page in r.pages.drain(r.shared..) {
                    was_freed[page] = true;
                    free.push(page);
                }
                false
            } else {
                true
            }
        });
        done += before - running.len();
        high_water = high_water.max(POOL - free.len());
        if steps % 10 != 0 && done < requests {
            continue;
        }
        let secs = start.elapsed().as_secs_f64();
        print!(
            "\rstep {steps:4} | running {:2} waiting {:3} done {done:3}/{requests} | pages {:4}/{POOL} | {:7.0} tok/s",
            running.len(),
            waiting.len(),
            POOL - free.len(),
            (prefilled + generated) as f64 / secs
        );
        std::io::stdout().flush()?;
    }
    let secs = start.elapsed().as_secs_f64();
    println!();
    println!(
        "{requests} requests ({sharing} sharing a {SYSTEM}-token system prompt, its {} pages written once) in {steps} steps, {secs:.2} s",
        system_pages.len(),
    );
    println!(
        "  {prefilled} prompt tokens and {generated} generated: {:.0} tok/s ({:.0} generated tok/s); \
         pages in use at most {high_water}/{POOL}, {pages_reused} reused after a request freed them",
        (prefilled + generated) as f64 / secs,
        generated as f64 / secs,
    );
    // The last step's first request against plain attention over its keys
    // gathered from the pages.
    let (out, cu, seqs, q) = last_check.ok_or("no step ran")?;
    let (pages, len) = &seqs[0];
    let (rows, first) = ((cu[1] - cu[0]) as usize, cu[0] as usize);
    let (kh, vh) = (k_pages.to_vec::<f32>(), v_pages.to_vec::<f32>());
    let gather = |x: &[f32]| -> Vec<f32> {
        (0..HKV)
            .flat_map(|h| {
                (0..*len).map(move |j| ((pages[j / PAGE] * HKV + h) * PAGE + j % PAGE) * D)
            })
            .flat_map(|at| x[at..at + D].to_vec())
            .collect()
    };
    let kd = T::from_slice(&gather(&kh), &[1, HKV, *len, D], &device)?;
    let vd = T::from_slice(&gather(&vh), &[1, HKV, *len, D], &device)?;
    let qd = q
        .narrow(0, first, rows)?
        .permute(&[1, 0, 2])?
        .unsqueeze(0)?
        .contiguous()?;
    let want = attention(&Causal, &qd, Keys::dense(&kd, &vd), &opts)?
        .out
        .to_vec::<f32>();
    let got = out.to_vec::<f32>();
    let mut worst = 0.0f32;
    for i in 0..rows {
        for h in 0..HQ {
            for c in 0..D {
                let g = got[((first + i) * HQ + h) * D + c];
                let w = want[(h * rows + i) * D + c];
                worst = worst.max((g - w).abs());
            }
        }
    }
    println!("the last step's first request against attention over its gathered keys: {worst:.1e}");
    if worst > 1e-4 {
        return Err(format!("the served rows differ from plain attention by {worst}").into());
    }
    Ok(())
}
