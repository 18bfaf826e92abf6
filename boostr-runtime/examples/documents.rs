//! Packed documents: several sequences concatenated into one row, each
//! attending only to itself, causally, with the document ids in a tensor.
//! The variant reads the ids in its mask; the compiler proves the reads in
//! range, and classifies tiles from per-call summaries of the ids, so tiles
//! between documents are skipped and tiles inside one run unmasked, with no
//! block mask built. The key rows past the last document (a padded tail)
//! hold NaN, and reach no result.
//!
//! ```text
//! cargo run --release -p boostr-runtime --example documents
//! ```
//!
//! Runs forward and backward through numr autograd, checks both against
//! the f64 reference, and compares the time with the causal mask over the
//! whole row. Exits with status 1 if a result is off.

use boostr_runtime::stock::Causal;
use boostr_runtime::testing::{Rng, reference_backward, reference_forward};
use boostr_runtime::{AttentionOptions, Keys, Problem, Variant, attention, var_attention};
use numr::autograd::{Var, backward, var_mul, var_sum};
use numr::prelude::{CpuDevice, CpuRuntime, Runtime, Tensor};
use std::process::ExitCode;
use std::time::Instant;

/// Causal attention within documents: key `kv` is visible to query `q` when
/// both positions carry the same document id and `kv <= q`. Positions with
/// id -1 are padding and see nothing (no document has id -1 at a query's
/// position and a key's, except padding itself, which `>= 0` excludes).
#[attention(
    mask = |b, _h, q, kv| kv <= q && self.doc[b][kv] >= 0 && self.doc[b][q] == self.doc[b][kv],
)]
#[derive(Clone, Debug)]
struct Packed<R: Runtime> {
    /// The document id of every position, `[B, S]` (`-1`: padding).
    #[tensor(i32, [B, Sk])]
    doc: Tensor<R>,
}

const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 64;
/// Two rows of packed documents, lengths per row; the rest is padding.
const ROWS: [&[usize]; 2] = [&[700, 13, 1, 310], &[1, 1, 512, 400]];
const S: usize = 1040;

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("FAILED: results differ from the f64 reference beyond tolerance");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<bool, Box<dyn std::error::Error>> {
    let device = CpuDevice::new();
    let b = ROWS.len();
    let mut ids = vec![-1i32; b * S];
    for (row, lens) in ROWS.iter().enumerate() {
        let mut at = row * S;
        for (doc, &len) in lens.iter().enumerate() {
            ids[at..at + len].fill(doc as i32);
            at += len;
        }
    }
    let variant = Packed {
        doc: Tensor::<CpuRuntime>::from_slice(&ids, &[b, S], &device)?,
    };
    println!(
        "{}",
        Packed::<CpuRuntime>::compiled()
            .text
            .lines()
            .take(14)
            .collect::<Vec<_>>()
            .join("\n")
    );

    let mut rng = Rng::new(7, 0);
    let (qn, kn) = (b * HQ * S * D, b * HKV * S * D);
    let q = rng.normal_f32(qn, 1.0);
    let mut k = rng.normal_f32(kn, 1.0);
    let mut v = rng.normal_f32(kn, 1.0);
    // Padding keys hold garbage: NaN in K and V.
    for (i, x) in k.iter_mut().chain(v.iter_mut()).enumerate() {
        let pos = (i % kn) / D % S;
        let row = (i % kn) / (HKV * S * D);
        if ids[row * S + pos] < 0 {
            *x = f32::NAN;
        }
    }
    let dout = rng.normal_f32(qn, 1.0);
    let t = |data: &[f32], h: usize| Tensor::<CpuRuntime>::from_slice(data, &[b, h, S, D], &device);
    let (qt, kt, vt, dt) = (t(&q, HQ)?, t(&k, HKV)?, t(&v, HKV)?, t(&dout, HQ)?);

    // Forward and backward through autograd.
    let client = CpuRuntime::default_client(&device);
    let (qv, kv, vv) = (
        Var::new(qt.clone(), true),
        Var::new(kt.clone(), true),
        Var::new(vt.clone(), true),
    );
    let opts = AttentionOptions::default();
    let out = var_attention(&variant, &qv, Keys::dense(&kv, &vv), &opts)?.out;
    let loss = var_sum(
        &var_mul(&out, &Var::new(dt, false), &client)?,
        &[0, 1, 2, 3],
        false,
        &client,
    )?;
    let grads = backward(&loss, &client)?;

    // Against the f64 reference (which skips hidden pairs, NaN and all).
    let p = Problem::new(b, (HQ, HKV), (S, S), D);
    let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
    let host = variant.host(&p)?;
    let want = reference_forward::<f64, _>(&host, &p, &wide(&q), &wide(&k), &wide(&v));
    let want_g =
        reference_backward::<f64, _>(&host, &p, &wide(&q), &wide(&k), &wide(&v), &wide(&dout));
    let mut ok = true;
    for (name, got, want) in [
        ("out", out.tensor().to_vec::<f32>(), &want.out),
        (
            "dq",
            grads.get(qv.id()).ok_or("no dq")?.to_vec::<f32>(),
            &want_g.dq,
        ),
        (
            "dk",
            grads.get(kv.id()).ok_or("no dk")?.to_vec::<f32>(),
            &want_g.dk,
        ),
        (
            "dv",
            grads.get(vv.id()).ok_or("no dv")?.to_vec::<f32>(),
            &want_g.dv,
        ),
    ] {
        let scale = want.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
        let err = got
            .iter()
            .zip(want.iter())
            .map(|(&g, &w)| {
                if g.is_finite() {
                    (f64::from(g) - w).abs()
                } else {
                    f64::INFINITY
                }
            })
            .fold(0.0, f64::max)
            / scale;
        let pass = err < 1e-4;
        ok &= pass;
        println!(
            "{name}: max error {err:.1e} of max |ref| {scale:.2} {}",
            if pass { "ok" } else { "FAILED" }
        );
    }

    // Time the forward against causal attention over the whole row (on
    // finite inputs: the causal mask sees the padding).
    let kc = t(&rng.normal_f32(kn, 1.0), HKV)?;
    let time =
        |f: &dyn Fn() -> Result<(), boostr_runtime::Error>| -> Result<f64, boostr_runtime::Error> {
            f()?;
            let start = Instant::now();
            for _ in 0..5 {
                f()?;
            }
            Ok(start.elapsed().as_secs_f64() / 5.0)
        };
    let docs = time(&|| attention(&variant, &qt, Keys::dense(&kc, &kc), &opts).map(drop))?;
    let causal = time(&|| attention(&Causal, &qt, Keys::dense(&kc, &kc), &opts).map(drop))?;
    let pairs: usize = ROWS
        .iter()
        .flat_map(|l| l.iter())
        .map(|&l| l * (l + 1) / 2)
        .sum();
    println!(
        "forward: documents {:.2} ms, causal over the whole rows {:.2} ms \
         ({pairs} attended pairs of {} per head)",
        docs * 1e3,
        causal * 1e3,
        b * S * (S + 1) / 2
    );
    Ok(ok)
}
