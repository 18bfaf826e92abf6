//! Stage 4, analysis: what the compiler derives from the checked IR before any
//! target sees it — the symbolic derivative of the score and the mask's tile
//! classifier — assembled into the [`Program`] every emitter reads.

pub mod build;
pub mod derivative;
pub mod reads;
pub mod tiles;

use crate::ast::TileOverride;
use crate::check::Checked;
use crate::ir::{Arg, Expr, ExprKind, Function, Program, Ty};

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
    let score_grad = derivative::score_grad(&score);
    let (classify, summaries) = tiles::classifier(has_mask.then_some(&mask), &checked.params);
    let tile = tile.unwrap_or_default();
    Program {
        name: name.to_string(),
        score_is_identity: score.body.kind == ExprKind::Arg(Arg::S),
        has_mask,
        has_sink,
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
    }
}
