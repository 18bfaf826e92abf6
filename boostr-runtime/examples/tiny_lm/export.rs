//! The run as a safetensors file for the PyTorch twin
//! (`bench/tiny_lm_torch.py`): the initial weights under their names, every
//! step's batch, our per-step losses, and the architecture and optimiser
//! settings as metadata.

use crate::net::{Config, Weights};
use boostr::format::safetensors::save_safetensors;
use boostr::optimizer::AdamWConfig;
use numr::runtime::cpu::CpuRuntime;
use numr::tensor::Tensor;
use std::collections::HashMap;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;
type T = Tensor<CpuRuntime>;

pub fn write(
    path: &str,
    c: &Config,
    opt: &AdamWConfig,
    initial: &Weights,
    batches: &[(T, T)],
    losses: &[f64],
) -> Result<()> {
    let mut tensors: HashMap<String, T> = initial
        .names
        .iter()
        .map(|n| (format!("weights.{n}"), initial.get(n).clone()))
        .collect();
    let device = initial.get("embed").device().clone();
    let stack = |pick: fn(&(T, T)) -> &T| -> Result<T> {
        let parts: Vec<T> = batches
            .iter()
            .map(|b| pick(b).unsqueeze(0))
            .collect::<std::result::Result<_, _>>()?;
        let refs: Vec<&T> = parts.iter().collect();
        Ok(Tensor::cat(&refs, 0)?)
    };
    tensors.insert("batches.inputs".into(), stack(|b| &b.0)?);
    tensors.insert("batches.targets".into(), stack(|b| &b.1)?);
    let losses: Vec<f32> = losses.iter().map(|&l| l as f32).collect();
    tensors.insert(
        "losses".into(),
        Tensor::from_slice(&losses, &[losses.len()], &device)?,
    );
    let meta: HashMap<String, String> = [
        ("vocab", c.vocab.to_string()),
        ("dim", c.dim.to_string()),
        ("layers", c.layers.to_string()),
        ("heads", c.heads.to_string()),
        ("kv_heads", c.kv_heads.to_string()),
        ("hidden", c.hidden.to_string()),
        ("max_seq", c.max_seq.to_string()),
        ("rope_base", "10000".into()),
        ("norm_eps", "1e-5".into()),
        ("lr", opt.lr.to_string()),
        ("weight_decay", opt.weight_decay.to_string()),
        ("beta1", opt.beta1.to_string()),
        ("beta2", opt.beta2.to_string()),
        ("eps", opt.eps.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    save_safetensors(path, &tensors, Some(&meta))?;
    Ok(())
}
