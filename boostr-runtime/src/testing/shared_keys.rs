//! Keys shared by every sequence of a batch (`k, v [1, ..]` with `q [B,
//! ..]`): the same results as those keys repeated for each sequence.

use super::backends::TestBackend;
use super::cases::Case;
use super::inputs::Inputs;
use super::run_backend::out_and_lse_loss;
use crate::keys::Keys;
use crate::op::{Backward, attention, attention_backward, var_attention};
use crate::variant::Variant;
use numr::autograd::{Var, backward};
use numr::runtime::Runtime;
use numr::tensor::Tensor;

/// Stream offset of the shared keys' draw (apart from the case's own).
const STREAM: u64 = 1 << 32;

/// On a case of batch ≥ 2 (the first only, unless the backend reads a
/// zero batch stride in place), fresh inputs whose keys and values (those of
/// sequence 0) every sequence shares, given once as `k, v [1, ..]` and
/// once repeated as `[B, ..]`: `out`, `lse` and `dq` must agree, and `dk`,
/// `dv` of the shared keys (shaped `[1, ..]`) must be the sums over the
/// batch of the repeated keys' — through `attention_backward` and through
/// autograd. Returns a summary, or `None` for a case of batch 1.
pub(crate) fn check_shared_keys<R: TestBackend, V: Variant>(
    variant: &V,
    device: &<R::Runtime as Runtime>::Device,
    case: &Case,
    (seed, stream): (u64, u64),
    failures: &mut Vec<String>,
) -> Option<String> {
    let p = case.problem();
    let first = R::cases().iter().find(|c| c.batch >= 2);
    if p.batch < 2 || !(R::READS_STRIDED || first.is_some_and(|c| c.name == case.name)) {
        return None;
    }
    let run = || -> Result<Vec<String>, String> {
        let inputs = Inputs::draw(case, seed, STREAM + stream);
        let [q, k, v, dout] = inputs.slices();
        let per = |d: usize| p.heads_kv * p.seq_k * d;
        let (k1, v1) = (&k[..per(p.head_dim)], &v[..per(p.head_dim_v)]);
        let repeat = |x: &[f32]| x.repeat(p.batch);
        let upload = |data: &[f32], shape: &[usize]| {
            Tensor::<R::Runtime>::from_slice(data, shape, device).map_err(|e| e.to_string())
        };
        let one = |s: [usize; 4]| [1, s[1], s[2], s[3]];
        let (qt, dt) = (upload(q, &p.q_shape())?, upload(dout, &p.out_shape())?);
        let dlse = upload(&inputs.dlse, &p.lse_shape())?;
        let (k_all, v_all) = (
            upload(&repeat(k1), &p.k_shape())?,
            upload(&repeat(v1), &p.v_shape())?,
        );
        let (k_one, v_one) = (
            upload(k1, &one(p.k_shape()))?,
            upload(v1, &one(p.v_shape()))?,
        );
        let opts = &inputs.opts;
        let both = |k: &Tensor<R::Runtime>, v: &Tensor<R::Runtime>| {
            let keys = Keys::dense(k, v);
            let y = attention(variant, &qt, keys, opts).map_err(|e| e.to_string())?;
            let grads = Backward::new(&y, &dt).with_dlse(&dlse);
            let g =
                attention_backward(variant, &qt, keys, grads, opts).map_err(|e| e.to_string())?;
            Ok::<_, String>((y.out, y.lse, g))
        };
        let (out, lse, g) = both(&k_all, &v_all)?;
        let (out_s, lse_s, g_s) = both(&k_one, &v_one)?;
        let host = |t: &Tensor<R::Runtime>| t.to_vec::<f32>();
        let summed = |t: &Tensor<R::Runtime>| {
            let x = host(t);
            let n = x.len() / p.batch;
            (0..n)
                .map(|i| (0..p.batch).map(|b| f64::from(x[b * n + i])).sum())
                .collect::<Vec<f64>>()
        };
        let widen =
            |t: &Tensor<R::Runtime>| -> Vec<f64> { host(t).into_iter().map(f64::from).collect() };
        let mut bad = Vec::new();
        let check = |what: &str, got: &Tensor<R::Runtime>, want: Vec<f64>, shape: &[usize]| {
            if got.shape() != shape {
                return Some(format!("{what}: shape {:?}, not {shape:?}", got.shape()));
            }
            let top = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            let tol = 1e-5 * (1.0 + top);
            let worst = host(got)
                .iter()
                .zip(&want)
                .filter(|(_, w)| w.is_finite())
                .map(|(&x, w)| (f64::from(x) - w).abs())
                .fold(
                    0.0f64,
                    |m, e| if e.is_nan() { f64::INFINITY } else { m.max(e) },
                );
            (worst > tol).then(|| format!("{what}: max |diff| {worst:.3e} > {tol:.3e}"))
        };
        bad.extend(check(
            "shared keys: out",
            &out_s,
            widen(&out),
            &p.out_shape(),
        ));
        bad.extend(check(
            "shared keys: lse",
            &lse_s,
            widen(&lse),
            &p.lse_shape(),
        ));
        bad.extend(check(
            "shared keys: dq",
            &g_s.dq,
            widen(&g.dq),
            &p.q_shape(),
        ));
        bad.extend(check(
            "shared keys: dk",
            &g_s.dk,
            summed(&g.dk),
            &one(p.k_shape()),
        ));
        bad.extend(check(
            "shared keys: dv",
            &g_s.dv,
            summed(&g.dv),
            &one(p.v_shape()),
        ));
        // Autograd, the same loss: the gradient of the `[1, ..]` keys.
        let client = <R::Runtime as Runtime>::default_client(device);
        let (qv, kv, vv) = (
            Var::new(qt.clone(), false),
            Var::new(k_one.clone(), true),
            Var::new(v_one.clone(), true),
        );
        let y =
            var_attention(variant, &qv, Keys::dense(&kv, &vv), opts).map_err(|e| e.to_string())?;
        let loss =
            out_and_lse_loss(&client, (&y.out, &y.lse), (&dt, &dlse)).map_err(|e| e.to_string())?;
        let grads = backward(&loss, &client).map_err(|e| e.to_string())?;
        for (what, var, want) in [("dk", &kv, &g_s.dk), ("dv", &vv, &g_s.dv)] {
            match grads.get(var.id()) {
                Some(t) => bad.extend(check(
                    &format!("shared keys: autograd {what}"),
                    t,
                    widen(want),
                    want.shape(),
                )),
                None => bad.push(format!("shared keys: autograd gave no {what}")),
            }
        }
        Ok(bad)
    };
    match run() {
        Ok(bad) => failures.extend(bad),
        Err(e) => failures.push(format!("shared keys: {e}")),
    }
    Some("shared k, v [1, ..] checked".to_string())
}
