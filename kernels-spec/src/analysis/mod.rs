//! Stage 4, analysis: what the compiler derives from the checked IR before any
//! target sees it — the symbolic derivative of the score and the mask's tile
//! classifier — assembled into the [`Program`] every emitter reads.

pub mod build;
pub mod derivative;
pub mod reads;
pub mod tiles;

use crate::ast::TileOverride;
use crate::check::Checked;
use crate::ir::{Arg, Expr, ExprKind, Function, LearnableSite, Program, TensorDecl, Ty, Weights};

/// Run every analysis and assemble the program.
pub fn analyze(name: &str, checked: Checked, tile: Option<TileOverride>) -> Program {
    let tensors = checked.tensors;
    let mut read_conditions = Vec::new();
    let mut prove = |body: Expr| {
        let (body, conditions) = reads::prove(&build::simplify(body), &tensors);
        read_conditions.extend(conditions);
        body
    };
    let score = checked
        .score
        .map(|f| Function {
            body: prove(f.body),
            ..f
        })
        .unwrap_or_else(|| Function {
            name: "score",
            args: vec![Arg::S, Arg::B, Arg::H, Arg::Q, Arg::Kv],
            ret: Ty::F32,
            body: Expr::arg(Arg::S),
        });
    let has_mask = checked.mask.is_some();
    let mask = checked
        .mask
        .map(|f| Function {
            body: prove(f.body),
            ..f
        })
        .unwrap_or_else(|| Function {
            name: "mask",
            args: vec![Arg::B, Arg::H, Arg::Q, Arg::Kv],
            ret: Ty::Bool,
            body: Expr::bool(true),
        });
    let has_sink = checked.sink.is_some();
    let sink = checked
        .sink
        .map(|f| Function {
            body: prove(f.body),
            ..f
        })
        .unwrap_or_else(|| Function {
            name: "sink",
            args: vec![Arg::B, Arg::H, Arg::Q],
            ret: Ty::F32,
            body: Expr::float(f64::NEG_INFINITY),
        });
    let has_dropout = checked.dropout.is_some();
    let dropout = checked.dropout.unwrap_or_else(|| Function {
        name: "dropout",
        args: Vec::new(),
        ret: Ty::F32,
        body: Expr::float(0.0),
    });
    let score_grad_given = checked.score_grad.is_some();
    let score_grad = match checked.score_grad {
        Some(f) => Function {
            body: prove(f.body),
            ..f
        },
        None => derivative::score_grad(&score),
    };
    let (classify, summaries) = tiles::classifier(has_mask.then_some(&mask), &checked.params);
    let tile = tile.unwrap_or_default();
    let learnable: Vec<usize> = (0..tensors.len())
        .filter(|&t| tensors[t].learnable)
        .collect();
    let learnable_sites = learnable_sites(&score, &sink, &tensors, &learnable);
    Program {
        name: name.to_string(),
        score_is_identity: score.body.kind == ExprKind::Arg(Arg::S),
        score_grad_is_one: score_grad.body.is_float(1.0),
        score_grad_given,
        has_mask,
        weights: Weights {
            normalize: checked.normalize,
            sink: has_sink,
            dropout: has_dropout,
        },
        dropout,
        params: checked.params,
        tensors,
        layout: checked.layout,
        summaries,
        read_conditions,
        score,
        score_grad,
        mask,
        sink,
        classify,
        tile: (tile.q, tile.kv),
        learnable,
        learnable_sites,
    }
}

/// Every read of a learnable tensor in `score` and `sink`, with its
/// derivative and where it lands.
fn learnable_sites(
    score: &Function,
    sink: &Function,
    tensors: &[TensorDecl],
    learnable: &[usize],
) -> Vec<LearnableSite> {
    let mut out = Vec::new();
    for (f, in_sink) in [(score, false), (sink, true)] {
        let mut reads = Vec::new();
        f.body.walk(&mut |e| {
            if let ExprKind::Read(r) = &e.kind
                && tensors[r.tensor].learnable
            {
                reads.push((r.site, r.tensor));
            }
        });
        reads.sort_unstable();
        reads.dedup();
        for (site, tensor) in reads {
            let Some(index) = reads::read_index(f, site) else {
                continue;
            };
            out.push(LearnableSite {
                site,
                tensor,
                slot: learnable
                    .iter()
                    .position(|&t| t == tensor)
                    .expect("learnable"),
                in_sink,
                grad: derivative::read_grad(f, site),
                index: Function {
                    body: build::simplify(index.body),
                    ..index
                },
            });
        }
    }
    out
}
