//! Human-readable printing of the IR, for `explain` output and snapshots.

use crate::ir::{
    Const, DimDecl, Expr, ExprKind, Function, Holds, Program, Size, SizeForm, Ty, UnOp,
};
use std::fmt::{self, Write};

/// Print a function as `name(args) -> ty = body` with one `let` per line.
pub fn function(program: &Program, f: &Function) -> String {
    let args: Vec<String> = f
        .args
        .iter()
        .map(|a| format!("{}: {}", a.name(), a.ty()))
        .collect();
    let mut out = format!("fn {}({}) -> {} {{\n", f.name, args.join(", "), f.ret);
    let mut p = Printer {
        program,
        out: &mut out,
    };
    p.block(&f.body, 1).expect("writing to a String");
    out.push_str("}\n");
    out
}

/// The program's declaration on one line: `variant Name { fields }`, each
/// parameter with its type and each captured tensor with its element type
/// and shape.
pub fn declaration(program: &Program) -> String {
    let params: Vec<String> = program
        .params
        .iter()
        .map(|p| format!("{}: {}", p.name, p.ty))
        .chain(program.tensors.iter().map(|t| {
            let dims: Vec<String> = t.dims.iter().map(|d| d.to_string()).collect();
            let learnable = if t.learnable { " (learnable)" } else { "" };
            format!(
                "{}: tensor {} [{}]{learnable}",
                t.name,
                t.elem,
                dims.join(", ")
            )
        }))
        .collect();
    format!("variant {} {{ {} }}", program.name, params.join(", "))
}

/// Print every function of a program.
pub fn program(program: &Program) -> String {
    let mut out = format!(
        "{}\n  score is identity: {}\n  has mask: {}\n  weights: {:?}\n  tile: q = {}, kv = {}\n\n",
        declaration(program),
        program.score_is_identity,
        program.has_mask,
        program.weights,
        program
            .tile
            .0
            .map_or("default".to_string(), |v| v.to_string()),
        program
            .tile
            .1
            .map_or("default".to_string(), |v| v.to_string()),
    );
    out.push_str(&reads(program));
    for f in program.functions() {
        out.push_str(&function(program, f));
        out.push('\n');
    }
    out.push_str(&learnable(program));
    out
}

/// Every read of a learnable tensor: where it lands and its derivative,
/// which the backward multiplies by `d loss / d score` (or `/ d sink`).
pub fn learnable(program: &Program) -> String {
    if program.learnable_sites.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "learnable reads (in score, by kv - q alone: {}):\n",
        program.score_grads_by_difference()
    );
    for site in &program.learnable_sites {
        let name = &program.tensors[site.tensor].name;
        let place = if site.in_sink { "sink" } else { "score" };
        out.push_str(&format!("// read #{} of {name} in {place}\n", site.site));
        out.push_str(&function(program, &site.index));
        out.push_str(&function(program, &site.grad));
        out.push('\n');
    }
    out
}

/// Every tensor read, which bounds of its indices were proved from the
/// declared shape, which are checked at run time, and the summaries the
/// classifier reads.
pub fn reads(program: &Program) -> String {
    let mut sites = Vec::new();
    for f in program.reading_functions() {
        crate::analysis::reads::read_sites(&f.body, &mut sites);
    }
    if sites.is_empty() {
        return String::new();
    }
    let mut out = String::from("  reads:\n");
    for s in &sites {
        let t = &program.tensors[s.tensor];
        let bounds: Vec<String> = s
            .checks
            .iter()
            .zip(&t.dims)
            .enumerate()
            .map(|(i, (c, d))| {
                let what = match (c.lower, c.upper) {
                    (false, false) => "proved",
                    (true, false) => "checked >= 0",
                    (false, true) => "checked < dim",
                    (true, true) => "checked",
                };
                format!("index {i} (of {d}) {what}")
            })
            .collect();
        out.push_str(&format!(
            "    #{} {}: {}\n",
            s.site,
            t.name,
            bounds.join(", ")
        ));
        if let Some(c) = program.read_conditions.iter().find(|c| c.site == s.site) {
            out.push_str(&format!("       {}\n", holds_text(&c.holds, &t.dims)));
        }
    }
    for &(t, axis) in &program.summaries {
        out.push_str(&format!(
            "  classifier reads the summary of {} along index {axis}\n",
            program.tensors[t].name
        ));
    }
    out.push('\n');
    out
}

/// `form` over the sizes, as people write it (`Sk - Sq`): positive terms
/// first.
fn form_text(form: &SizeForm) -> String {
    let terms: Vec<(i64, &str)> = form
        .per_size
        .iter()
        .zip(Size::ALL)
        .filter(|(k, _)| **k != 0)
        .map(|(k, s)| (*k, s.name()))
        .collect();
    let mut text = String::new();
    for (k, name) in terms
        .iter()
        .filter(|t| t.0 > 0)
        .chain(terms.iter().filter(|t| t.0 < 0))
    {
        let sign = match (text.is_empty(), *k < 0) {
            (true, false) => "",
            (true, true) => "-",
            (false, false) => " + ",
            (false, true) => " - ",
        };
        let coefficient = if k.abs() == 1 {
            String::new()
        } else {
            format!("{}·", k.abs())
        };
        text.push_str(&format!("{sign}{coefficient}{name}"));
    }
    match (text.is_empty(), form.constant) {
        (true, c) => c.to_string(),
        (false, 0) => text,
        (false, c) if c < 0 => format!("{text} - {}", -c),
        (false, c) => format!("{text} + {c}"),
    }
}

/// When the checks of one read may fail for a call, as people write it
/// (a GPU call reads its error record back only then).
fn holds_text(holds: &[Holds], dims: &[DimDecl]) -> String {
    if holds.contains(&Holds::Never) {
        return "may fail on any call (an index depends on a parameter or a tensor value): \
                GPU calls read the error record back"
            .into();
    }
    let each: Vec<String> = holds
        .iter()
        .map(|h| match h {
            Holds::Never => unreachable!("handled above"),
            Holds::NonNegative(f) => format!("{} < 0", form_text(f)),
            Holds::BelowDim(f, axis) => format!(
                "{} >= dim {axis}{}",
                form_text(f),
                dims.get(*axis).map_or(String::new(), |d| format!(" ({d})"))
            ),
        })
        .collect();
    format!(
        "may fail only when {} (GPU calls read the error record back only then)",
        each.join(" or ")
    )
}

struct Printer<'a> {
    program: &'a Program,
    out: &'a mut String,
}

impl Printer<'_> {
    fn block(&mut self, e: &Expr, depth: usize) -> fmt::Result {
        let pad = "    ".repeat(depth);
        let mut e = e;
        while let ExprKind::Let(l, v, body) = &e.kind {
            write!(self.out, "{pad}let %{}: {} = ", l.0, v.ty)?;
            self.expr(v)?;
            self.out.push_str(";\n");
            e = body;
        }
        self.out.push_str(&pad);
        self.expr(e)?;
        self.out.push('\n');
        Ok(())
    }

    fn expr(&mut self, e: &Expr) -> fmt::Result {
        match &e.kind {
            ExprKind::Const(Const::Float(v)) => write!(self.out, "{v:?}"),
            ExprKind::Const(Const::Int(v)) if e.ty == Ty::U32 => write!(self.out, "{v}u32"),
            ExprKind::Const(Const::Int(v)) => write!(self.out, "{v}"),
            ExprKind::Const(Const::Bool(b)) => write!(self.out, "{b}"),
            ExprKind::Arg(a) => write!(self.out, "{}", a.name()),
            ExprKind::Param(i) => write!(self.out, "self.{}", self.program.params[*i].name),
            ExprKind::Local(l) => write!(self.out, "%{}", l.0),
            ExprKind::Unary(op, a) => {
                self.out.push_str(if *op == UnOp::Neg { "-" } else { "!" });
                self.atom(a)
            }
            ExprKind::Binary(op, a, b) => {
                self.atom(a)?;
                write!(self.out, " {} ", op.symbol())?;
                self.atom(b)
            }
            ExprKind::Call(f, args) => {
                write!(self.out, "{}(", f.name())?;
                for (i, a) in args.iter().enumerate() {
                    if i > 0 {
                        self.out.push_str(", ");
                    }
                    self.expr(a)?;
                }
                self.out.push(')');
                Ok(())
            }
            ExprKind::Cast(a) => {
                self.atom(a)?;
                write!(self.out, " as {}", e.ty)
            }
            ExprKind::Select(c, t, f) => {
                self.out.push_str("if ");
                self.expr(c)?;
                self.out.push_str(" { ");
                self.expr(t)?;
                self.out.push_str(" } else { ");
                self.expr(f)?;
                self.out.push_str(" }");
                Ok(())
            }
            ExprKind::Let(l, v, body) => {
                write!(self.out, "{{ let %{} = ", l.0)?;
                self.expr(v)?;
                self.out.push_str("; ");
                self.expr(body)?;
                self.out.push_str(" }");
                Ok(())
            }
            ExprKind::Read(r) => {
                write!(self.out, "self.{}", self.program.tensors[r.tensor].name)?;
                for i in &r.indices {
                    self.out.push('[');
                    self.expr(i)?;
                    self.out.push(']');
                }
                write!(self.out, "#{}", r.site)
            }
            ExprKind::ReadRange(r) => {
                let name = &self.program.tensors[r.tensor].name;
                let bound = if r.max { "max" } else { "min" };
                write!(self.out, "{bound}(self.{name}")?;
                for (axis, i) in r.indices.iter().enumerate() {
                    self.out.push('[');
                    self.expr(i)?;
                    if r.axis == Some(axis) {
                        self.out.push_str(" ..= ");
                        self.expr(&r.hi)?;
                    }
                    self.out.push(']');
                }
                self.out.push(')');
                Ok(())
            }
            ExprKind::Dim(t, axis) => {
                write!(
                    self.out,
                    "dim(self.{}, {axis})",
                    self.program.tensors[*t].name
                )
            }
        }
    }

    fn atom(&mut self, e: &Expr) -> fmt::Result {
        let simple = matches!(
            e.kind,
            ExprKind::Const(_)
                | ExprKind::Arg(_)
                | ExprKind::Param(_)
                | ExprKind::Local(_)
                | ExprKind::Call(..)
                | ExprKind::Read(_)
                | ExprKind::ReadRange(_)
                | ExprKind::Dim(..)
        );
        if simple {
            self.expr(e)
        } else {
            self.out.push('(');
            self.expr(e)?;
            self.out.push(')');
            Ok(())
        }
    }
}
