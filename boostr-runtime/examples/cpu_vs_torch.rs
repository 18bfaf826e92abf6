//! The Rust half of `bench/cpu_vs_torch.py`: a timing server for boostr's CPU
//! kernels, so that the Python driver can interleave single runs of boostr
//! and PyTorch on the same inputs' shapes and let drift hit both alike.
//!
//! It reads one command per line on stdin and answers one line on stdout:
//!
//! ```text
//! attn <variant> <fwd|fwdbwd> <hq> <hkv> <seq> <dims> [f32|bf16] [bhsd|bshd] -> ok <seconds>
//! gemm <n> <f32>                                                   -> ok <seconds>
//! tile <m> <n> <k> <n|t> <iters>                  -> ok <tile kernel seconds|none> <gemm crate seconds>
//! peak <iters> [all]                                               -> ok <seconds|none>
//! amxpeak <iters>                                                  -> ok <seconds|none>
//! dotpeak <iters>  (vdpbf16ps, every thread at once)               -> ok <seconds|none>
//! mem <variant> <hq> <hkv> <seq> <dim>                             -> ok <json>
//! docs <len,len,...>                                               -> ok <documents>
//! host <hq> <hkv> <seq> <dim>                                      -> ok <seconds>
//! decode <b> <sk> [f32|bf16|f16|fp8]                               -> ok <seconds>
//! repeat <n> <attn, gemm, host or decode command>                  -> ok <seconds> × n
//! quit
//! ```
//!
//! With `--pin`, the rayon workers are bound one per CPU
//! (`cpu::pin_threads`) before the first command.
//!
//! `<dims>` is the head dim `D`, or `D/Dv` for values of their own head dim
//! (MLA: `192/128`). The layout is `bhsd` (contiguous `[B, H, S, D]`, the
//! default) or `bshd`: each input (dout too) made as a contiguous `[B, S,
//! H, D]` tensor and passed permuted to `[B, H, S, D]`, as model code holds
//! its projections.
//!
//! Variants: `full`, `causal`, `alibi` (causal), `softcap` (causal, cap 30),
//! `window` (causal sliding window of 256), `prefix` (prefix-LM, prefix S/4),
//! `docs` (causal packed documents, ids from a tensor: the lengths of the
//! last `docs` command, which must sum to the sequence), `docs_closed` (the
//! closed form `q / L == kv / L && kv <= q` of the last `docs` command's
//! length, which must give equal lengths). `host` times what the `docs`
//! variant does before its kernels: checking the ids and computing their
//! per-block summaries (`Variant::host`). `decode` times one causal decode
//! step as `examples/decode.rs` runs it (`Sq = 1`, `Hq = 32`, `Hkv = 8`,
//! `D = 128`): f32 keys dense, the others a full KV cache (fp8 E4M3 with a
//! scale per kv head and bf16 queries).
//! `attn` times one run (B = 1) on inputs made when the shape last changed;
//! `fwdbwd` is `attention` followed by `attention_backward`. `gemm` times one
//! `n × n × n` f32 product through the `gemm` crate on every rayon thread
//! (boostr's tile products use it on CPUs without AVX-512). `tile` times
//! `iters` single-threaded tile products `C += A·B` (`t`: `A` stored
//! transposed) through boostr's AVX-512 tile kernel and through the `gemm`
//! crate. `peak` times `iters` rounds of 24 AVX-512 FMAs on registers only,
//! on one thread: the core's FMA peak (`iters · 768` flops); with `all`, on
//! every rayon thread at once, timed until the last one finishes
//! (`threads · iters · 768` flops: the ceiling of a multi-threaded run).
//! `mem` runs forward+backward once and reports the peak resident set
//! (`VmHWM`) against the size of q, k, v, out and their gradients; run it in
//! a fresh process. `repeat` runs an `attn`, `gemm` or `host` command `n`
//! times back to back and answers each run's seconds.
//! Errors answer `err <message>`.
//!
//! ```text
//! cargo run --release -p boostr-runtime --example cpu_vs_torch
//! ```

use boostr_runtime::stock::{
    Alibi, Causal, CausalDocuments, CausalSlidingWindow, CausalSoftcap, Full, PrefixLm,
};
use boostr_runtime::testing::Rng;
use boostr_runtime::{
    AttentionOptions, Backward, Keys, KvScales, Problem, Variant, attention, attention_backward,
};
use numr::dtype::DType;
use numr::prelude::{CpuDevice, CpuRuntime, Tensor};
use std::error::Error;
use std::io::{BufRead, Write};
use std::time::Instant;

type BoxResult<T> = Result<T, Box<dyn Error>>;

/// Inputs of the current attention shape.
struct Inputs {
    key: (usize, usize, usize, (usize, usize), DType, bool),
    q: Tensor<CpuRuntime>,
    k: Tensor<CpuRuntime>,
    v: Tensor<CpuRuntime>,
    dout: Tensor<CpuRuntime>,
}

/// Documents of `len` positions each, in closed form.
#[attention(mask = |_b, _h, q, kv| q / self.len == kv / self.len && kv <= q)]
#[derive(Clone, Debug)]
struct EqualDocuments {
    len: i32,
}

struct Server {
    device: CpuDevice,
    rng: Rng,
    inputs: Option<Inputs>,
    gemm: Option<(usize, [Vec<f32>; 3])>,
    /// The document lengths of the last `docs` command.
    docs: Vec<usize>,
    /// Inputs of the current decode shape.
    decode: Option<Decode>,
}

/// A decode step's inputs: `(B, Sk, dtype)`, `q`, the cache, its
/// lengths and (fp8) scales.
struct Decode {
    key: (usize, usize, DType),
    q: Tensor<CpuRuntime>,
    k: Tensor<CpuRuntime>,
    v: Tensor<CpuRuntime>,
    lengths: Tensor<CpuRuntime>,
    scales: Tensor<CpuRuntime>,
}

impl Decode {
    const HQ: usize = 32;
    const HKV: usize = 8;
    const D: usize = 128;

    fn new(
        rng: &mut Rng,
        (b, sk, dtype): (usize, usize, DType),
        device: &CpuDevice,
    ) -> BoxResult<Self> {
        let mut tensor = |shape: &[usize], dtype: DType| -> BoxResult<Tensor<CpuRuntime>> {
            let x = rng.normal_f32(shape.iter().product(), 1.0);
            let bytes: Vec<u8> = match dtype {
                DType::BF16 => x
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                    .collect(),
                DType::F16 => x
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
                    .collect(),
                // Against a scale of 1/16.
                DType::FP8E4M3 => x
                    .iter()
                    .map(|&v| numr::dtype::FP8E4M3::from_f32(16.0 * v).0)
                    .collect(),
                _ => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            };
            Ok(Tensor::<CpuRuntime>::from_bytes(
                &bytes, shape, dtype, device,
            )?)
        };
        let q_dtype = if dtype == DType::FP8E4M3 {
            DType::BF16
        } else {
            dtype
        };
        let (hq, hkv, d) = (Self::HQ, Self::HKV, Self::D);
        Ok(Decode {
            key: (b, sk, dtype),
            q: tensor(&[b, hq, 1, d], q_dtype)?,
            k: tensor(&[b, hkv, sk, d], dtype)?,
            v: tensor(&[b, hkv, sk, d], dtype)?,
            lengths: Tensor::<CpuRuntime>::from_slice(&vec![sk as i32; b], &[b], device)?,
            scales: Tensor::<CpuRuntime>::from_slice(&[1.0f32 / 16.0; Self::HKV], &[hkv], device)?,
        })
    }

    /// One decode step's seconds.
    fn time(&self) -> BoxResult<f64> {
        let keys = match self.key.2 {
            DType::F32 => Keys::dense(&self.k, &self.v),
            DType::FP8E4M3 => {
                Keys::cache(&self.k, &self.v, &self.lengths).with_scales(KvScales::PerHead {
                    k: &self.scales,
                    v: &self.scales,
                })
            }
            _ => Keys::cache(&self.k, &self.v, &self.lengths),
        };
        let opts = AttentionOptions::default();
        let start = Instant::now();
        std::hint::black_box(attention(&Causal, &self.q, keys, &opts)?);
        Ok(start.elapsed().as_secs_f64())
    }
}

impl Server {
    fn inputs(
        &mut self,
        hq: usize,
        hkv: usize,
        seq: usize,
        (dim, dim_v): (usize, usize),
        dtype: DType,
        bshd: bool,
    ) -> BoxResult<&Inputs> {
        let key = (hq, hkv, seq, (dim, dim_v), dtype, bshd);
        if self.inputs.as_ref().is_none_or(|i| i.key != key) {
            self.inputs = None; // free the old shape first
            let p = Problem::new(1, (hq, hkv), (seq, seq), dim).with_head_dim_v(dim_v);
            let (qs, ks, vs, os) = (p.q_shape(), p.k_shape(), p.v_shape(), p.out_shape());
            let mut make = |&[b, h, s, d]: &[usize; 4]| -> BoxResult<Tensor<CpuRuntime>> {
                let shape = if bshd { [b, s, h, d] } else { [b, h, s, d] };
                let data = self.rng.normal_f32(shape.iter().product(), 1.0);
                let t = match dtype {
                    DType::BF16 => {
                        let bytes: Vec<u8> = data
                            .iter()
                            .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
                            .collect();
                        Tensor::<CpuRuntime>::from_bytes(&bytes, &shape, dtype, &self.device)?
                    }
                    _ => Tensor::<CpuRuntime>::from_slice(&data, &shape, &self.device)?,
                };
                Ok(if bshd { t.permute(&[0, 2, 1, 3])? } else { t })
            };
            self.inputs = Some(Inputs {
                key,
                q: make(&qs)?,
                k: make(&ks)?,
                v: make(&vs)?,
                dout: make(&os)?,
            });
        }
        Ok(self.inputs.as_ref().expect("just made"))
    }

    fn command(&mut self, line: &str) -> BoxResult<Option<String>> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> BoxResult<usize> {
            let w = words.get(i).ok_or("missing argument")?;
            Ok(w.parse::<usize>()
                .map_err(|_| format!("bad number {w:?}"))?)
        };
        // `D` or `D/Dv`.
        let dims = |i: usize| -> BoxResult<(usize, usize)> {
            let w = words.get(i).ok_or("missing argument")?;
            let (d, dv) = w.split_once('/').unwrap_or((w, w));
            let n = |x: &str| {
                x.parse::<usize>()
                    .map_err(|_| format!("bad head dims {w:?}"))
            };
            Ok((n(d)?, n(dv)?))
        };
        match words.first().copied() {
            Some("attn") => {
                let (variant, pass) = (words.get(1), words.get(2));
                let (hq, hkv, seq, dim) = (num(3)?, num(4)?, num(5)?, dims(6)?);
                let dtype = match words.get(7).copied() {
                    None | Some("f32") => DType::F32,
                    Some("bf16") => DType::BF16,
                    Some(other) => return Err(format!("dtype {other:?}: f32 or bf16").into()),
                };
                let bshd = match words.get(8).copied() {
                    None | Some("bhsd") => false,
                    Some("bshd") => true,
                    Some(other) => return Err(format!("layout {other:?}: bhsd or bshd").into()),
                };
                let fwdbwd = match pass.copied() {
                    Some("fwd") => false,
                    Some("fwdbwd") => true,
                    other => return Err(format!("pass {other:?}: fwd or fwdbwd").into()),
                };
                let name = variant.copied().unwrap_or_default();
                let (docs, device) = (self.docs.clone(), self.device.clone());
                let x = self.inputs(hq, hkv, seq, dim, dtype, bshd)?;
                let secs = time_named(name, x, fwdbwd, &docs, &device)?;
                Ok(Some(format!("ok {secs:.9}")))
            }
            Some("docs") => {
                let lens = words
                    .get(1)
                    .ok_or("docs needs lengths")?
                    .split(',')
                    .map(|l| l.parse::<usize>().map_err(|_| format!("bad length {l:?}")))
                    .collect::<Result<Vec<_>, _>>()?;
                if lens.contains(&0) {
                    return Err("a document has at least one position".into());
                }
                let n = lens.len();
                self.docs = lens;
                Ok(Some(format!("ok {n}")))
            }
            Some("host") => {
                let (hq, hkv, seq, dim) = (num(1)?, num(2)?, num(3)?, num(4)?);
                let variant = documents(&self.docs, seq, &self.device)?;
                let p = Problem::new(1, (hq, hkv), (seq, seq), dim).with_scale(1.0);
                let start = Instant::now();
                let host = variant.host(&p)?;
                let secs = start.elapsed().as_secs_f64();
                drop(host);
                Ok(Some(format!("ok {secs:.9}")))
            }
            Some("decode") => {
                let (b, sk) = (num(1)?, num(2)?);
                let dtype = match words.get(3).copied() {
                    None | Some("f32") => DType::F32,
                    Some("bf16") => DType::BF16,
                    Some("f16") => DType::F16,
                    Some("fp8") => DType::FP8E4M3,
                    Some(other) => {
                        return Err(format!("dtype {other:?}: f32, bf16, f16 or fp8").into());
                    }
                };
                let key = (b, sk, dtype);
                if self.decode.as_ref().is_none_or(|x| x.key != key) {
                    self.decode = None; // free the old shape first
                    self.decode = Some(Decode::new(&mut self.rng, key, &self.device)?);
                }
                let secs = self.decode.as_ref().expect("just made").time()?;
                Ok(Some(format!("ok {secs:.9}")))
            }
            Some("tile") => {
                let (m, n, k, iters) = (num(1)?, num(2)?, num(3)?, num(5)?);
                let transposed = match words.get(4).copied() {
                    Some("t") => true,
                    Some("n") => false,
                    other => return Err(format!("A layout {other:?}: n or t").into()),
                };
                let (ours, theirs) =
                    boostr_runtime::cpu::time_tile_products(m, n, k, transposed, iters);
                let ours = ours.map_or("none".to_string(), |t| format!("{t:.9}"));
                Ok(Some(format!("ok {ours} {theirs:.9}")))
            }
            Some("peak") => {
                let iters = num(1)?;
                let t = match words.get(2).copied() {
                    None => boostr_runtime::cpu::time_fma_peak(iters),
                    Some("all") => boostr_runtime::cpu::time_fma_peak_all(iters),
                    Some(other) => return Err(format!("peak {other:?}: all or nothing").into()),
                };
                Ok(Some(
                    t.map_or("ok none".to_string(), |t| format!("ok {t:.9}")),
                ))
            }
            Some("dotpeak") => {
                let iters = num(1)?;
                let t = boostr_runtime::cpu::time_bf16_dot_peak_all(iters);
                Ok(Some(
                    t.map_or("ok none".to_string(), |t| format!("ok {t:.9}")),
                ))
            }
            Some("amxpeak") => {
                let iters = num(1)?;
                let t = boostr_runtime::cpu::time_amx_peak(iters);
                Ok(Some(
                    t.map_or("ok none".to_string(), |t| format!("ok {t:.9}")),
                ))
            }
            Some("gemm") => {
                let n = num(1)?;
                Ok(Some(format!("ok {:.9}", self.time_gemm(n))))
            }
            Some("mem") => {
                let name = words.get(1).copied().unwrap_or_default();
                let (hq, hkv, seq, dim) = (num(2)?, num(3)?, num(4)?, num(5)?);
                let before = peak_rss()?;
                let (docs, device) = (self.docs.clone(), self.device.clone());
                let x = self.inputs(hq, hkv, seq, (dim, dim), DType::F32, false)?;
                let t = time_named(name, x, true, &docs, &device)?;
                let peak = peak_rss()?;
                // q, k, v, out and their gradients (dout is out's gradient).
                let tensors = 4 * (2 * hq + 2 * hkv) * seq * dim * 2;
                Ok(Some(format!(
                    "ok {{\"peak_rss\": {peak}, \"rss_before_inputs\": {before}, \
                     \"tensors\": {tensors}, \"seconds\": {t:.3}}}"
                )))
            }
            Some("repeat") => {
                // `n` runs back to back, each timed on its own: the driver's
                // PyTorch runs are consecutive calls in one process, and so
                // must ours be (a round trip through the pipe between runs
                // lets rayon's workers fall asleep, and waking them on a
                // shared VM can cost milliseconds).
                let n = num(1)?;
                let inner = words.get(2..).unwrap_or_default().join(" ");
                if !matches!(
                    words.get(2).copied(),
                    Some("attn" | "gemm" | "host" | "decode")
                ) {
                    return Err(
                        format!("repeat runs attn, gemm, host or decode, not {inner:?}").into(),
                    );
                }
                let mut times = Vec::with_capacity(n);
                for _ in 0..n {
                    let reply = self.command(&inner)?.ok_or("no answer")?;
                    times.push(reply.trim_start_matches("ok ").to_string());
                }
                Ok(Some(format!("ok {}", times.join(" "))))
            }
            Some("quit") | None => Ok(None),
            Some(other) => Err(format!("unknown command {other:?}").into()),
        }
    }

    fn time_gemm(&mut self, n: usize) -> f64 {
        if self.gemm.as_ref().is_none_or(|g| g.0 != n) {
            let a = self.rng.normal_f32(n * n, 1.0);
            let b = self.rng.normal_f32(n * n, 1.0);
            self.gemm = Some((n, [a, b, vec![0.0; n * n]]));
        }
        let (_, [a, b, c]) = self.gemm.as_mut().expect("just made");
        let s = n as isize;
        let start = Instant::now();
        // C = A B, row-major, as its transpose Cᵀ = Bᵀ Aᵀ in column-major
        // (the layout the kernels want; `gemm::gemm` does the same).
        // SAFETY: a, b, c are n × n (strides n and 1 either way), so every
        // access is in bounds; c does not alias a or b.
        unsafe {
            gemm_f32::gemm::f32::get_gemm_fn()(
                n,
                n,
                n,
                c.as_mut_ptr(),
                s,
                1,
                false,
                b.as_ptr(),
                s,
                1,
                a.as_ptr(),
                s,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm_common::Parallelism::Rayon(rayon::current_num_threads()),
            );
        }
        start.elapsed().as_secs_f64()
    }
}

/// The causal document variant over documents of `lens`, which must sum to
/// `seq`.
fn documents(
    lens: &[usize],
    seq: usize,
    device: &CpuDevice,
) -> BoxResult<CausalDocuments<CpuRuntime>> {
    if lens.iter().sum::<usize>() != seq {
        return Err(format!("documents {lens:?} do not sum to {seq}").into());
    }
    let ids: Vec<i32> = lens
        .iter()
        .enumerate()
        .flat_map(|(d, &l)| std::iter::repeat_n(d as i32, l))
        .collect();
    Ok(CausalDocuments {
        doc: Tensor::<CpuRuntime>::from_slice(&ids, &[1, seq], device)?,
    })
}

/// Time one run of the variant named `name` on `x` (`docs`: the documents
/// of the `docs` variants).
fn time_named(
    name: &str,
    x: &Inputs,
    fwdbwd: bool,
    docs: &[usize],
    device: &CpuDevice,
) -> BoxResult<f64> {
    let (hq, _, seq_len, _, _, _) = x.key;
    let (heads, seq) = (i32::try_from(hq)?, i32::try_from(seq_len)?);
    match name {
        // Made per run: the ids and their summaries are the call's work.
        "docs" => time_attention(&documents(docs, seq_len, device)?, x, fwdbwd),
        "docs_closed" => match docs {
            [len, rest @ ..]
                if rest.iter().all(|l| l == len) && docs.iter().sum::<usize>() == seq_len =>
            {
                time_attention(
                    &EqualDocuments {
                        len: i32::try_from(*len)?,
                    },
                    x,
                    fwdbwd,
                )
            }
            _ => Err(
                format!("docs_closed needs equal documents summing to {seq}, not {docs:?}").into(),
            ),
        },
        "full" => time_attention(&Full, x, fwdbwd),
        "causal" => time_attention(&Causal, x, fwdbwd),
        "alibi" => time_attention(&Alibi { heads }, x, fwdbwd),
        "softcap" => time_attention(&CausalSoftcap { cap: 30.0 }, x, fwdbwd),
        "window" => time_attention(&CausalSlidingWindow { window: 256 }, x, fwdbwd),
        "prefix" => time_attention(&PrefixLm { prefix: seq / 4 }, x, fwdbwd),
        other => Err(format!("unknown variant {other:?}").into()),
    }
}

fn time_attention<V: Variant>(v: &V, x: &Inputs, fwdbwd: bool) -> BoxResult<f64> {
    let opts = AttentionOptions::default();
    let start = Instant::now();
    let keys = Keys::dense(&x.k, &x.v);
    let y = attention(v, &x.q, keys, &opts)?;
    if fwdbwd {
        let grads = attention_backward(v, &x.q, keys, Backward::new(&y, &x.dout), &opts)?;
        drop(grads);
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Peak resident set size of this process in bytes (`VmHWM`).
fn peak_rss() -> BoxResult<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .ok_or("no VmHWM in /proc/self/status")?;
    Ok(kb * 1024)
}

fn main() -> BoxResult<()> {
    // `--pin`: one worker per CPU, each bound to its own (see
    // `cpu::pin_threads`), as many as RAYON_NUM_THREADS asks.
    if std::env::args().any(|a| a == "--pin") {
        boostr_runtime::cpu::pin_threads(None)?;
    }
    let mut server = Server {
        device: CpuDevice::new(),
        rng: Rng::new(0x5eed_70c4, 0),
        inputs: None,
        gemm: None,
        docs: Vec::new(),
        decode: None,
    };
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "ready {} threads", rayon::current_num_threads())?;
    stdout.flush()?;
    for line in stdin.lock().lines() {
        let reply = match server.command(&line?) {
            Ok(Some(reply)) => reply,
            Ok(None) => break,
            Err(e) => format!("err {e}"),
        };
        writeln!(stdout, "{reply}")?;
        stdout.flush()?;
    }
    Ok(())
}
