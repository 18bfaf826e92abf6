//! A small decoder-only language model on boostr's modules, trained on the
//! CPU with a compiled attention variant, then sampled from.
//!
//! ```text
//! cargo run --release -p boostr-runtime --features tiny-lm --example tiny_lm
//! cargo run --release -p boostr-runtime --features tiny-lm --example tiny_lm -- --check 50
//! ```
//!
//! The corpus is generated (sentences from a small grammar, 256 KB of
//! characters); the model has 2 layers, 4 query heads and 2 KV heads of 16
//! (GQA), RoPE, RMSNorm and SwiGLU, and trains with boostr's AdamW. The loss
//! curve is written to `tiny_lm_loss.png`. With `--check N`, a second copy
//! of the model on boostr's own attention trains beside it from the same
//! weights on the same batches, and the per-step losses are compared.

mod corpus;
mod export;
mod generate;
mod net;
mod plot;

use boostr::optimizer::{AdamW, AdamWConfig};
use corpus::{Stream, Tokens};
use indicatif::{ProgressBar, ProgressStyle};
use net::{Batch, Choice, Config, Kernel, Model, Weights};
use numr::autograd::backward;
use numr::runtime::Runtime;
use numr::runtime::cpu::{CpuDevice, CpuRuntime};
use std::time::{Duration, Instant};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The per-step losses of the two attentions must agree this closely (f32).
const CHECK_TOLERANCE: f64 = 1e-4;
/// Decode logits against the full-sequence forward's (f32), absolute.
const LOGIT_TOLERANCE: f64 = 1e-4;

struct Args {
    steps: usize,
    batch: usize,
    seq: usize,
    lr: f64,
    check: Option<usize>,
    plot: String,
    export: Option<String>,
    variant: Choice,
}

fn args() -> Result<Args> {
    let mut a = Args {
        steps: 600,
        batch: 16,
        seq: 64,
        lr: 3e-3,
        check: None,
        plot: "tiny_lm_loss.png".into(),
        export: None,
        variant: Choice::Causal,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--steps" => a.steps = value()?.parse()?,
            "--batch" => a.batch = value()?.parse()?,
            "--seq" => a.seq = value()?.parse()?,
            "--lr" => a.lr = value()?.parse()?,
            "--check" => a.check = Some(value()?.parse()?),
            "--plot" => a.plot = value()?,
            "--export" => a.export = Some(value()?),
            "--variant" => a.variant = Choice::parse(&value()?)?,
            _ => {
                return Err(format!(
                    "unknown argument {flag}; expected --steps N, --batch N, --seq N, --lr X, \
                     --check N, --plot FILE, --export FILE, \
                     --variant causal|softcap|window|window-sinks"
                )
                .into());
            }
        }
    }
    if a.export.is_some() && a.variant != Choice::Causal {
        return Err("--export writes for the PyTorch twin, whose attention is causal".into());
    }
    Ok(a)
}

fn main() -> Result<()> {
    let args = args()?;
    let device = CpuDevice::new();
    let client = CpuRuntime::default_client(&device);
    let text = corpus::generate(256 * 1024, 7);
    let tokens = Tokens::new(&text);
    let config = Config {
        vocab: tokens.alphabet.len(),
        dim: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        hidden: 176,
        max_seq: 256,
    };
    let entropy = tokens.unigram_entropy();
    let ours = Model::new(config, args.variant, Kernel::Ours, &device)?;
    let mut weights = Weights::init(&config, args.variant, 11, &device)?;
    println!(
        "corpus: {} characters, {} symbols, unigram entropy {entropy:.3} nats",
        tokens.ids.len(),
        config.vocab
    );
    println!(
        "model: {} parameters ({} layers, {} query heads and {} KV heads of {}, SwiGLU {}); \
         attention {}",
        weights.count(),
        config.layers,
        config.heads,
        config.kv_heads,
        config.head_dim(),
        config.hidden,
        args.variant.name()
    );
    let adamw_config = AdamWConfig {
        lr: args.lr,
        ..AdamWConfig::default()
    };
    let adamw = || AdamW::<CpuRuntime>::new(adamw_config.clone());
    let mut opt = adamw();
    // The twin on boostr's attention, from the same weights.
    let mut twin = match args.check {
        Some(_) => {
            let model = Model::new(config, args.variant, Kernel::Boostr, &device)?;
            Some((model, weights.copy(), adamw()))
        }
        None => None,
    };
    let initial = weights.copy();
    let mut batches = Vec::new();
    let mut rng = Stream::new(3);
    let bar = ProgressBar::new(args.steps as u64).with_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} steps, {msg} [{elapsed} < {eta}]",
    )?);
    let (mut losses, mut twin_losses) = (Vec::new(), Vec::new());
    // Step times: ours over every step and over the checked ones, the twin's.
    let (mut ours_time, mut ours_checked, mut twin_time) =
        (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for step in 0..args.steps {
        let batch = Batch::draw(&tokens.ids, args.batch, args.seq, &mut rng, &device)?;
        if args.export.is_some() {
            batches.push((batch.inputs.clone(), batch.targets.clone()));
        }
        let started = Instant::now();
        let loss = ours.loss(&client, &weights, &batch, true)?;
        let grads = weights.grads(&backward(&loss, &client)?)?;
        opt.step(&client, &mut weights.tensors, &grads)?;
        let took = started.elapsed();
        ours_time += took;
        losses.push(f64::from(loss.tensor().to_vec::<f32>()[0]));
        let checking = args.check.is_some_and(|n| step < n);
        if checking {
            ours_checked += took;
        }
        if let (true, Some((model, w, opt))) = (checking, twin.as_mut()) {
            let started = Instant::now();
            let loss = model.loss(&client, w, &batch, true)?;
            let grads = w.grads(&backward(&loss, &client)?)?;
            opt.step(&client, &mut w.tensors, &grads)?;
            twin_time += started.elapsed();
            twin_losses.push(f64::from(loss.tensor().to_vec::<f32>()[0]));
        }
        bar.set_message(format!("loss {:.3}", losses[step]));
        bar.inc(1);
    }
    bar.finish();
    let tail = &losses[losses.len().saturating_sub(20)..];
    let final_loss = tail.iter().sum::<f64>() / tail.len() as f64;
    println!(
        "loss: {:.3} at the start, {final_loss:.3} over the last {} steps (unigram entropy \
         {entropy:.3}); {:.1} ms per step",
        losses[0],
        tail.len(),
        ours_time.as_secs_f64() * 1e3 / args.steps as f64
    );
    plot::loss_curve(
        &args.plot,
        &args.variant.name(),
        &losses,
        &twin_losses,
        entropy,
    )?;
    println!("loss curve: {}", args.plot);
    let share = net::attention_time(&ours, &weights, (args.batch, args.seq), &device)?;
    let step = ours_time.as_secs_f64() / args.steps as f64;
    println!(
        "attention (forward and backward of every layer, timed alone on the step's shapes): \
         {:.1} ms, {:.0}% of a step",
        share.as_secs_f64() * 1e3,
        100.0 * share.as_secs_f64() / step
    );
    if let Some(path) = &args.export {
        export::write(path, &config, &adamw_config, &initial, &batches, &losses)?;
        println!("weights, batches and losses for bench/tiny_lm_torch.py: {path}");
    }
    if !twin_losses.is_empty() {
        check(&losses, &twin_losses, ours_checked, twin_time)?;
    }
    let prompt = tokens.encode("the cat ")?;
    let (out, report) =
        generate::generate(&ours, &weights, &client, &device, &prompt, 160, (0.8, 0.95))?;
    println!(
        "sampled (temperature 0.8, top-p 0.95):\n{}",
        tokens.decode(&out)
    );
    println!(
        "prefill of {} tokens {:.1} ms; {} tokens decoded through the paged cache at {:.0} \
         tokens/s; decode logits against the full forward's: max |difference| {:.2e} (logits up \
         to {:.1})",
        prompt.len(),
        report.prefill.as_secs_f64() * 1e3,
        report.decoded,
        report.decoded as f64 / report.decode.as_secs_f64(),
        report.logit_error,
        report.logit_scale
    );
    if report.logit_error > LOGIT_TOLERANCE {
        return Err(format!(
            "decode logits differ from the full forward's by {:.2e} > {LOGIT_TOLERANCE:e}",
            report.logit_error
        )
        .into());
    }
    if final_loss >= entropy {
        return Err(format!(
            "the loss {final_loss:.3} did not go below the unigram entropy {entropy:.3}"
        )
        .into());
    }
    Ok(())
}

/// The per-step losses of our attention against boostr's, from the same
/// weights on the same batches.
fn check(ours: &[f64], theirs: &[f64], ours_time: Duration, theirs_time: Duration) -> Result<()> {
    println!("step  ours        boostr      relative difference");
    let mut worst: f64 = 0.0;
    for (step, (a, b)) in ours.iter().zip(theirs).enumerate() {
        let rel = (a - b).abs() / b.abs();
        worst = worst.max(rel);
        if step < 5 || step % 10 == 9 || step + 1 == theirs.len() {
            println!("{step:4}  {a:.8}  {b:.8}  {rel:.2e}");
        }
    }
    let n = theirs.len();
    println!(
        "over {n} steps the losses differ by at most {worst:.2e} (relative); step time \
         {:.1} ms with ours, {:.1} ms with boostr's attention (forward, backward, AdamW)",
        ours_time.as_secs_f64() * 1e3 / n as f64,
        theirs_time.as_secs_f64() * 1e3 / n as f64
    );
    if worst > CHECK_TOLERANCE {
        return Err(format!(
            "the losses differ by {worst:.2e} > {CHECK_TOLERANCE:e} from boostr's attention"
        )
        .into());
    }
    Ok(())
}
