//! A small decoder-only transformer built from boostr's modules: token
//! embeddings, pre-norm blocks (RMSNorm, GQA attention with RoPE, SwiGLU),
//! a final norm and an untied head. Its attention is either a compiled
//! variant (`boostr_runtime::model::Attention`) or boostr's own
//! (`attention_core_masked`), on the same weights.

use crate::corpus::Stream;
use boostr::model::attention_core::{AttentionCoreSpec, AttentionKernel, attention_core_masked};
use boostr::nn::{Embedding, Linear, RmsNorm, RoPE, cross_entropy_loss};
use numr::autograd::{GradStore, Var, var_add, var_reshape, var_silu_mul, var_sum};
use numr::runtime::Runtime;
use numr::runtime::cpu::{CpuClient, CpuDevice, CpuRuntime};
use numr::tensor::{Tensor, TensorId};
use std::collections::HashMap;
use std::time::{Duration, Instant};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The architecture.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub vocab: usize,
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub hidden: usize,
    pub max_seq: usize,
}

impl Config {
    pub fn head_dim(&self) -> usize {
        self.dim / self.heads
    }
}

/// The attention of every block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Choice {
    /// Causal (Llama).
    Causal,
    /// Causal with its logits soft-capped at `cap` (Gemma 2).
    Softcap(f32),
    /// A causal sliding window of `window` keys (Mistral).
    Window(i32),
    /// A causal sliding window with a learned sink logit per head and layer
    /// (gpt-oss): the sinks are parameters like the weights.
    WindowSinks(i32),
}

impl Choice {
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "causal" => Choice::Causal,
            "softcap" => Choice::Softcap(30.0),
            "window" => Choice::Window(24),
            "window-sinks" => Choice::WindowSinks(24),
            _ => {
                return Err(format!(
                    "unknown variant {name:?}: causal, softcap, window or window-sinks"
                )
                .into());
            }
        })
    }

    pub fn name(&self) -> String {
        match self {
            Choice::Causal => "Causal".into(),
            Choice::Softcap(cap) => format!("CausalSoftcap {{ cap: {cap} }}"),
            Choice::Window(w) => format!("CausalSlidingWindow {{ window: {w} }}"),
            Choice::WindowSinks(w) => format!("CausalSlidingWindowSinks {{ window: {w}, .. }}"),
        }
    }

    /// boostr's `softcap` and `sliding_window` for the same attention.
    pub fn boostr(&self) -> Result<(Option<f32>, usize)> {
        match *self {
            Choice::Causal => Ok((None, 0)),
            Choice::Softcap(cap) => Ok((Some(cap), 0)),
            Choice::Window(w) => Ok((None, w as usize)),
            Choice::WindowSinks(_) => Err("boostr 0.10's attention has no sinks".into()),
        }
    }
}

/// Whose attention the blocks run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kernel {
    /// The compiled variant's fused kernels (`model::Attention`).
    Ours,
    /// boostr's attention (`attention_core_masked`: repeated KV heads, a
    /// materialised mask, softmax) with the same softcap and window.
    Boostr,
}

/// `$body` with `$a` bound to layer `$l`'s `model::Attention` of the
/// model's choice, its learnable tensors (the sinks) taken from `$w`.
macro_rules! with_attention {
    ($model:expr, $w:expr, $l:expr, $grad:expr, |$a:ident| $body:expr) => {{
        use boostr_runtime::model::Attention;
        use boostr_runtime::stock::{
            Causal, CausalSlidingWindow, CausalSlidingWindowSinks, CausalSoftcap,
        };
        let c = &$model.config;
        let (heads, kv_heads, head_dim) = (c.heads, c.kv_heads, c.head_dim());
        match $model.choice {
            $crate::net::Choice::Causal => {
                let $a = Attention::new(Causal, heads, kv_heads, head_dim)?;
                $body
            }
            $crate::net::Choice::Softcap(cap) => {
                let $a = Attention::new(CausalSoftcap { cap }, heads, kv_heads, head_dim)?;
                $body
            }
            $crate::net::Choice::Window(window) => {
                let variant = CausalSlidingWindow { window };
                let $a = Attention::new(variant, heads, kv_heads, head_dim)?;
                $body
            }
            $crate::net::Choice::WindowSinks(window) => {
                let sinks = $w.var(&format!("{}.sinks", $l), $grad);
                let variant = CausalSlidingWindowSinks { window, sinks };
                let $a = Attention::new(variant, heads, kv_heads, head_dim)?;
                $body
            }
        }
    }};
}
pub(crate) use with_attention;

/// How a parameter starts.
#[derive(Clone, Copy)]
enum Init {
    /// Normal with this std.
    Normal(f32),
    /// Every element this value.
    Const(f32),
}

/// The parameters by name, each with the id the optimiser keys it by.
pub struct Weights {
    pub names: Vec<String>,
    pub ids: HashMap<String, TensorId>,
    pub tensors: HashMap<TensorId, Tensor<CpuRuntime>>,
}

impl Weights {
    /// Random initial weights: normal with std `1/√fan_in` (the head and
    /// the output projections scaled down by `√(2·layers)`), norms at 1.
    /// (The sinks of `WindowSinks` start at 0: a sink as likely as a key
    /// whose score is 0.)
    pub fn init(c: &Config, choice: Choice, seed: u64, device: &CpuDevice) -> Result<Self> {
        let mut rng = Stream::new(seed);
        let mut w = Weights {
            names: Vec::new(),
            ids: HashMap::new(),
            tensors: HashMap::new(),
        };
        let mut add = |name: String, shape: &[usize], init: Init| -> Result<()> {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = match init {
                Init::Normal(std) => (0..n).map(|_| rng.normal() * std).collect(),
                Init::Const(value) => vec![value; n],
            };
            let id = TensorId::new();
            w.ids.insert(name.clone(), id);
            w.tensors
                .insert(id, Tensor::from_slice(&data, shape, device)?);
            w.names.push(name);
            Ok(())
        };
        let (d, hd) = (c.dim, c.head_dim());
        let residual = 1.0 / ((2 * c.layers) as f32).sqrt();
        add("embed".into(), &[c.vocab, d], Init::Normal(1.0))?;
        for l in 0..c.layers {
            let s = 1.0 / (d as f32).sqrt();
            add(format!("{l}.attn_norm"), &[d], Init::Const(1.0))?;
            if let Choice::WindowSinks(_) = choice {
                add(format!("{l}.sinks"), &[c.heads], Init::Const(0.0))?;
            }
            add(format!("{l}.q"), &[c.heads * hd, d], Init::Normal(s))?;
            add(format!("{l}.k"), &[c.kv_heads * hd, d], Init::Normal(s))?;
            add(format!("{l}.v"), &[c.kv_heads * hd, d], Init::Normal(s))?;
            add(
                format!("{l}.o"),
                &[d, c.heads * hd],
                Init::Normal(s * residual),
            )?;
            add(format!("{l}.mlp_norm"), &[d], Init::Const(1.0))?;
            add(format!("{l}.gate"), &[c.hidden, d], Init::Normal(s))?;
            add(format!("{l}.up"), &[c.hidden, d], Init::Normal(s))?;
            let s_h = 1.0 / (c.hidden as f32).sqrt();
            add(
                format!("{l}.down"),
                &[d, c.hidden],
                Init::Normal(s_h * residual),
            )?;
        }
        add("norm".into(), &[d], Init::Const(1.0))?;
        add(
            "head".into(),
            &[c.vocab, d],
            Init::Normal(1.0 / (d as f32).sqrt()),
        )?;
        Ok(w)
    }

    /// A copy with fresh ids (a second model on the same weights).
    pub fn copy(&self) -> Self {
        let mut w = Weights {
            names: self.names.clone(),
            ids: HashMap::new(),
            tensors: HashMap::new(),
        };
        for name in &self.names {
            let id = TensorId::new();
            w.ids.insert(name.clone(), id);
            w.tensors.insert(id, self.get(name).clone());
        }
        w
    }

    pub fn get(&self, name: &str) -> &Tensor<CpuRuntime> {
        &self.tensors[&self.ids[name]]
    }

    /// The parameters' gradients out of a backward's store, contiguous:
    /// boostr's AdamW reads them as flat slices (and panics on a strided
    /// view, such as the transposed gradient `Linear`'s weight gets).
    pub fn grads(&self, all: &GradStore<CpuRuntime>) -> Result<GradStore<CpuRuntime>> {
        let mut grads = GradStore::new();
        for &id in self.ids.values() {
            if let Some(g) = all.get(id) {
                grads.insert(id, g.contiguous()?);
            }
        }
        Ok(grads)
    }

    pub fn var(&self, name: &str, grad: bool) -> Var<CpuRuntime> {
        Var::with_id(self.get(name).clone(), self.ids[name], grad)
    }

    fn linear(&self, name: &str, grad: bool) -> Linear<CpuRuntime> {
        Linear::with_ids(self.get(name).clone(), self.ids[name], None, grad)
    }

    fn norm(&self, name: &str, grad: bool) -> RmsNorm<CpuRuntime> {
        RmsNorm::with_id(self.get(name).clone(), self.ids[name], 1e-5, grad)
    }

    pub fn count(&self) -> usize {
        self.tensors.values().map(|t| t.numel()).sum()
    }
}

/// The model: its architecture, RoPE tables and attention.
pub struct Model {
    pub config: Config,
    pub rope: RoPE<CpuRuntime>,
    pub choice: Choice,
    pub kernel: Kernel,
}

impl Model {
    pub fn new(config: Config, choice: Choice, kernel: Kernel, device: &CpuDevice) -> Result<Self> {
        let rope =
            RoPE::precompute_freqs(config.max_seq, config.head_dim(), 10_000.0, None, device)?;
        if kernel == Kernel::Boostr {
            choice.boostr()?;
        }
        Ok(Self {
            config,
            rope,
            choice,
            kernel,
        })
    }

    /// Logits `[B·S, vocab]` of `tokens [B, S]` (i64), differentiable in the
    /// weights when `grad`.
    pub fn logits(
        &self,
        client: &CpuClient,
        w: &Weights,
        tokens: &Tensor<CpuRuntime>,
        grad: bool,
    ) -> Result<Var<CpuRuntime>> {
        let c = &self.config;
        let &[b, s] = tokens.shape() else {
            return Err("tokens must be [B, S]".into());
        };
        let mut x = self.embed(client, w, tokens, grad)?;
        for l in 0..c.layers {
            let (q, k, v) = self.qkv(client, w, l, &x, grad)?;
            let a = self.attend(client, w, l, [&q, &k, &v], grad)?;
            x = self.block_out(client, w, l, &x, &a, grad)?;
        }
        let logits = self.head(client, w, &x, grad)?;
        Ok(var_reshape(&logits, &[b * s, c.vocab])?)
    }

    /// The token embeddings `[B, S, dim]`.
    pub fn embed(
        &self,
        client: &CpuClient,
        w: &Weights,
        tokens: &Tensor<CpuRuntime>,
        grad: bool,
    ) -> Result<Var<CpuRuntime>> {
        let embed = Embedding::with_id(w.get("embed").clone(), w.ids["embed"], grad);
        Ok(embed.forward(client, tokens)?)
    }

    /// Layer `l`'s query, key and value projections of the normed `x`.
    pub fn qkv(
        &self,
        client: &CpuClient,
        w: &Weights,
        l: usize,
        x: &Var<CpuRuntime>,
        grad: bool,
    ) -> Result<(Var<CpuRuntime>, Var<CpuRuntime>, Var<CpuRuntime>)> {
        let h = w.norm(&format!("{l}.attn_norm"), grad).forward(client, x)?;
        let proj = |p: &str| w.linear(&format!("{l}.{p}"), grad).forward(client, &h);
        Ok((proj("q")?, proj("k")?, proj("v")?))
    }

    /// The rest of layer `l` after attention `a [B, S, H·D]`: the output
    /// projection and its residual, then the SwiGLU MLP and its residual.
    pub fn block_out(
        &self,
        client: &CpuClient,
        w: &Weights,
        l: usize,
        x: &Var<CpuRuntime>,
        a: &Var<CpuRuntime>,
        grad: bool,
    ) -> Result<Var<CpuRuntime>> {
        let o = w.linear(&format!("{l}.o"), grad).forward(client, a)?;
        let x = var_add(x, &o, client)?;
        let h = w.norm(&format!("{l}.mlp_norm"), grad).forward(client, &x)?;
        let gate = w.linear(&format!("{l}.gate"), grad).forward(client, &h)?;
        let up = w.linear(&format!("{l}.up"), grad).forward(client, &h)?;
        let f = w
            .linear(&format!("{l}.down"), grad)
            .forward(client, &var_silu_mul(&gate, &up, client)?)?;
        Ok(var_add(&x, &f, client)?)
    }

    /// The final norm and the head: logits `[B, S, vocab]`.
    pub fn head(
        &self,
        client: &CpuClient,
        w: &Weights,
        x: &Var<CpuRuntime>,
        grad: bool,
    ) -> Result<Var<CpuRuntime>> {
        let x = w.norm("norm", grad).forward(client, x)?;
        Ok(w.linear("head", grad).forward(client, &x)?)
    }

    /// Mean cross-entropy of predicting `tokens[:, 1:]` from `tokens[:, :-1]`
    /// (the batch is `[B, S + 1]`).
    pub fn loss(
        &self,
        client: &CpuClient,
        w: &Weights,
        batch: &Batch,
        grad: bool,
    ) -> Result<Var<CpuRuntime>> {
        let logits = self.logits(client, w, &batch.inputs, grad)?;
        Ok(cross_entropy_loss(client, &logits, &batch.targets)?)
    }

    fn attend(
        &self,
        client: &CpuClient,
        w: &Weights,
        l: usize,
        [q, k, v]: [&Var<CpuRuntime>; 3],
        grad: bool,
    ) -> Result<Var<CpuRuntime>> {
        if self.kernel == Kernel::Ours {
            return with_attention!(self, w, l, grad, |a| Ok(a.forward(
                q,
                k,
                v,
                Some(&self.rope)
            )?));
        }
        let c = &self.config;
        let (softcap, sliding_window) = self.choice.boostr()?;
        let spec = AttentionCoreSpec {
            num_heads: c.heads,
            num_kv_heads: c.kv_heads,
            head_dim: c.head_dim(),
            q_norm: None,
            k_norm: None,
            use_alibi: false,
            skip_rope: false,
            sliding_window,
            softcap,
            alibi_scale: 1.0,
            kernel: AttentionKernel::Masked,
        };
        let rope = self.rope.narrow_positions(q.shape()[1])?;
        let (cos, sin) = (Some(rope.cos_cache()), Some(rope.sin_cache()));
        Ok(attention_core_masked(client, q, k, v, cos, sin, &spec)?)
    }
}

/// One batch: `inputs [B, S]` and `targets [B·S]` (the next characters).
pub struct Batch {
    pub inputs: Tensor<CpuRuntime>,
    pub targets: Tensor<CpuRuntime>,
}

impl Batch {
    /// `b` windows of `s + 1` characters at random offsets of `ids`.
    pub fn draw(
        ids: &[i64],
        b: usize,
        s: usize,
        rng: &mut Stream,
        device: &CpuDevice,
    ) -> Result<Self> {
        let (mut inputs, mut targets) = (Vec::with_capacity(b * s), Vec::with_capacity(b * s));
        for _ in 0..b {
            let at = rng.below(ids.len() - s - 1);
            inputs.extend_from_slice(&ids[at..at + s]);
            targets.extend_from_slice(&ids[at + 1..at + s + 1]);
        }
        Ok(Self {
            inputs: Tensor::from_slice(&inputs, &[b, s], device)?,
            targets: Tensor::from_slice(&targets, &[b * s], device)?,
        })
    }
}

/// The time of the model's attention in one training step: forward and
/// backward of `Attention::forward` (heads, RoPE, the kernels) on random
/// projections of the step's shapes, once per layer; the median of 7 runs.
pub fn attention_time(
    model: &Model,
    w: &Weights,
    (batch, seq): (usize, usize),
    device: &CpuDevice,
) -> Result<Duration> {
    let c = model.config;
    let client = CpuRuntime::default_client(device);
    let mut rng = Stream::new(5);
    let mut proj = |heads: usize| -> Result<Var<CpuRuntime>> {
        let n = batch * seq * heads * c.head_dim();
        let data: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        let t = Tensor::from_slice(&data, &[batch, seq, heads * c.head_dim()], device)?;
        Ok(Var::new(t, true))
    };
    let (q, k, v) = (proj(c.heads)?, proj(c.kv_heads)?, proj(c.kv_heads)?);
    let mut times = Vec::new();
    for _ in 0..8 {
        let started = Instant::now();
        let y = with_attention!(model, w, 0, true, |a| a.forward(
            &q,
            &k,
            &v,
            Some(&model.rope)
        )?);
        let loss = var_sum(&y, &[0, 1, 2], false, &client)?;
        numr::autograd::backward(&loss, &client)?;
        times.push(started.elapsed());
    }
    // The first run compiles nothing but warms the caches: left out.
    times.remove(0);
    times.sort();
    Ok(times[times.len() / 2] * c.layers as u32)
}
