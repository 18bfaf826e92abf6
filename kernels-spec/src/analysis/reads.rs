//! Which index bounds of every tensor read hold for every problem.
//!
//! Each index of each read gets a bound `lo ..= hi` as an affine form over
//! the problem's sizes (`B, Hq, Hkv, Sq, Sk`, each at least 1), from the
//! argument ranges `b ∈ [0, B)`, `h ∈ [0, Hq)`, `q ∈ [Sk − Sq, Sk)`,
//! `kv ∈ [0, Sk)` and constants, through `+ − ·const /const %const`,
//! `min max clamp abs`, `let` and `if`. A bound is proved when it holds for
//! every size: `index ≥ 0` when `lo` is non-negative for all sizes (or the
//! index is a `u32`), `index < dim` when `dim − 1 − hi` is, against a
//! declared dimension that is a size or a number (an `_` dimension is never
//! proved). Every bound not proved is checked by the kernels at run time.
//!
//! Soundness: a form is used only where its value cannot wrap, i.e. it stays
//! in `i32` for all sizes below [`INDEX_BOUND`]; parameters, tensor values
//! and anything else give no bound.
//!
//! Note `q`'s lower bound `Sk − Sq`: with `Sq > Sk` the first rows sit at
//! negative positions, so a read indexed by `q` keeps its `>= 0` check.

use super::build;
use super::tiles::INDEX_BOUND;
use crate::ir::{
    Arg, BinOp, Builtin, Const, DimDecl, Expr, ExprKind, Function, IndexCheck, Local, Read, Size,
    TensorDecl, Ty, UnOp,
};
use std::collections::HashMap;

pub use crate::ir::{Holds, SiteCondition, SizeForm};

/// `c + Σ k_s · s` over the problem's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Affine {
    c: i64,
    k: [i64; 5],
}

impl Affine {
    const fn constant(c: i64) -> Affine {
        Affine { c, k: [0; 5] }
    }

    fn form(self) -> SizeForm {
        SizeForm {
            constant: self.c,
            per_size: self.k,
        }
    }

    fn size(s: Size, plus: i64) -> Affine {
        let mut k = [0; 5];
        k[s as usize] = 1;
        Affine { c: plus, k }
    }

    fn add(self, o: Affine) -> Affine {
        let mut k = self.k;
        k.iter_mut().zip(o.k).for_each(|(a, b)| *a += b);
        Affine { c: self.c + o.c, k }
    }

    fn scale(self, f: i64) -> Affine {
        Affine {
            c: self.c * f,
            k: self.k.map(|x| x * f),
        }
    }

    fn is_constant(self) -> Option<i64> {
        (self.k == [0; 5]).then_some(self.c)
    }

    /// The least and greatest value for sizes in `1 ..= INDEX_BOUND`.
    fn range(self) -> (i64, i64) {
        self.k.iter().fold((self.c, self.c), |(lo, hi), &k| {
            let (a, b) = (k, k * INDEX_BOUND);
            (lo + a.min(b), hi + a.max(b))
        })
    }

    /// Non-negative for every problem.
    fn nonneg(self) -> bool {
        self.range().0 >= 0
    }

    /// Whether every value it takes is an `i32` (so it never wrapped).
    fn fits(self) -> bool {
        let (lo, hi) = self.range();
        lo >= i32::MIN as i64 && hi <= i32::MAX as i64
    }
}

/// Bounds of an integer value; `None` is unbounded on that side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Bounds {
    lo: Option<Affine>,
    hi: Option<Affine>,
}

const UNBOUNDED: Bounds = Bounds { lo: None, hi: None };

fn exact(a: Affine) -> Bounds {
    Bounds {
        lo: Some(a),
        hi: Some(a),
    }
}

fn checked(a: Option<Affine>) -> Option<Affine> {
    a.filter(|a| a.fits())
}

/// A lower bound of `min(x, y)` (or of either arm of an `if`).
fn lower_of_both(a: Option<Affine>, b: Option<Affine>) -> Option<Affine> {
    let (a, b) = (a?, b?);
    match (a.is_constant(), b.is_constant()) {
        (Some(x), Some(y)) => Some(Affine::constant(x.min(y))),
        _ if a == b => Some(a),
        _ if a.nonneg() && b.nonneg() => Some(Affine::constant(0)),
        _ => None,
    }
}

/// An upper bound of `max(x, y)` (or of either arm of an `if`).
fn upper_of_both(a: Option<Affine>, b: Option<Affine>) -> Option<Affine> {
    let (a, b) = (a?, b?);
    match (a.is_constant(), b.is_constant()) {
        (Some(x), Some(y)) => Some(Affine::constant(x.max(y))),
        _ if a == b => Some(a),
        _ => None,
    }
}

/// A bound of either `a` or `b`, preferring a constant.
fn either(a: Option<Affine>, b: Option<Affine>) -> Option<Affine> {
    match (a, b) {
        (Some(x), _) if x.is_constant().is_some() => Some(x),
        (_, Some(y)) if y.is_constant().is_some() => Some(y),
        (x, y) => x.or(y),
    }
}

struct Prover<'a> {
    tensors: &'a [TensorDecl],
    locals: HashMap<Local, Bounds>,
    /// What makes each checked read's checks hold for one call, by site.
    conditions: Vec<SiteCondition>,
}

impl Prover<'_> {
    fn bounds(&mut self, e: &Expr) -> Bounds {
        if e.ty != Ty::I32 {
            return match (&e.kind, e.ty) {
                // A bool is 0 or 1 once cast; a u32 is never negative (its
                // upper bound is not tracked).
                (_, Ty::U32) => Bounds {
                    lo: Some(Affine::constant(0)),
                    hi: None,
                },
                _ => UNBOUNDED,
            };
        }
        match &e.kind {
            ExprKind::Const(Const::Int(v)) => exact(Affine::constant(*v)),
            ExprKind::Arg(Arg::B) => Bounds {
                lo: Some(Affine::constant(0)),
                hi: Some(Affine::size(Size::B, -1)),
            },
            ExprKind::Arg(Arg::H) => Bounds {
                lo: Some(Affine::constant(0)),
                hi: Some(Affine::size(Size::Hq, -1)),
            },
            ExprKind::Arg(Arg::Q) => Bounds {
                lo: Some(Affine::size(Size::Sk, 0).add(Affine::size(Size::Sq, 0).scale(-1))),
                hi: Some(Affine::size(Size::Sk, -1)),
            },
            ExprKind::Arg(Arg::Kv) => Bounds {
                lo: Some(Affine::constant(0)),
                hi: Some(Affine::size(Size::Sk, -1)),
            },
            ExprKind::Local(l) => self.locals.get(l).copied().unwrap_or(UNBOUNDED),
            ExprKind::Let(l, v, body) => {
                let b = self.bounds(v);
                self.locals.insert(*l, b);
                self.bounds(body)
            }
            ExprKind::Unary(UnOp::Neg, a) => {
                let b = self.bounds(a);
                Bounds {
                    lo: checked(b.hi.map(|h| h.scale(-1))),
                    hi: checked(b.lo.map(|l| l.scale(-1))),
                }
            }
            ExprKind::Binary(op, a, b) => {
                let (x, y) = (self.bounds(a), self.bounds(b));
                let konst = |e: &Expr| match e.kind {
                    ExprKind::Const(Const::Int(v)) => Some(v),
                    _ => None,
                };
                match op {
                    BinOp::Add => Bounds {
                        lo: checked(x.lo.zip(y.lo).map(|(p, q)| p.add(q))),
                        hi: checked(x.hi.zip(y.hi).map(|(p, q)| p.add(q))),
                    },
                    BinOp::Sub => Bounds {
                        lo: checked(x.lo.zip(y.hi).map(|(p, q)| p.add(q.scale(-1)))),
                        hi: checked(x.hi.zip(y.lo).map(|(p, q)| p.add(q.scale(-1)))),
                    },
                    BinOp::Mul => match (konst(a), konst(b)) {
                        (_, Some(c)) | (Some(c), _) => {
                            let other = if konst(b).is_some() { x } else { y };
                            let (lo, hi) = if c >= 0 {
                                (other.lo, other.hi)
                            } else {
                                (other.hi, other.lo)
                            };
                            Bounds {
                                lo: checked(lo.map(|l| l.scale(c))),
                                hi: checked(hi.map(|h| h.scale(c))),
                            }
                        }
                        _ => UNBOUNDED,
                    },
                    // 0 <= x / c <= x and 0 <= x % c < c for x >= 0, c >= 1.
                    BinOp::Div if konst(b).is_some_and(|c| c >= 1) => {
                        if x.lo.is_some_and(|l| l.nonneg()) {
                            Bounds {
                                lo: Some(Affine::constant(0)),
                                hi: x.hi,
                            }
                        } else {
                            UNBOUNDED
                        }
                    }
                    BinOp::Rem if konst(b).is_some_and(|c| c >= 1) => {
                        let c = konst(b).expect("checked");
                        let lo = if x.lo.is_some_and(|l| l.nonneg()) {
                            0
                        } else {
                            1 - c
                        };
                        Bounds {
                            lo: Some(Affine::constant(lo)),
                            hi: Some(Affine::constant(c - 1)),
                        }
                    }
                    _ => UNBOUNDED,
                }
            }
            ExprKind::Call(f, args) => {
                let b: Vec<Bounds> = args.iter().map(|a| self.bounds(a)).collect();
                match f {
                    Builtin::Min => Bounds {
                        lo: lower_of_both(b[0].lo, b[1].lo),
                        hi: either(b[0].hi, b[1].hi),
                    },
                    Builtin::Max => Bounds {
                        lo: either(b[0].lo, b[1].lo),
                        hi: upper_of_both(b[0].hi, b[1].hi),
                    },
                    // min(max(x, lo), hi)
                    Builtin::Clamp => Bounds {
                        lo: either(b[0].lo, b[1].lo),
                        hi: b[2].hi,
                    },
                    Builtin::Abs => Bounds {
                        lo: Some(Affine::constant(0)),
                        hi: None,
                    },
                    _ => UNBOUNDED,
                }
            }
            ExprKind::Cast(a) if a.ty == Ty::Bool => Bounds {
                lo: Some(Affine::constant(0)),
                hi: Some(Affine::constant(1)),
            },
            ExprKind::Select(_, t, f) => {
                let (x, y) = (self.bounds(t), self.bounds(f));
                Bounds {
                    lo: lower_of_both(x.lo, y.lo),
                    hi: upper_of_both(x.hi, y.hi),
                }
            }
            _ => UNBOUNDED,
        }
    }

    /// The checks `read` needs, and what makes them hold for one call.
    fn checks(&mut self, read: &Read) -> Vec<IndexCheck> {
        let decl = &self.tensors[read.tensor];
        let mut holds = Vec::new();
        let checks = read
            .indices
            .iter()
            .zip(&decl.dims)
            .enumerate()
            .map(|(axis, (index, dim))| {
                let b = self.bounds(index);
                let lower = !b.lo.is_some_and(|l| l.nonneg());
                let dim = match dim {
                    DimDecl::Size(s) => Some(Affine::size(*s, 0)),
                    DimDecl::Fixed(n) => Some(Affine::constant(i64::from(*n))),
                    DimDecl::Any => None,
                };
                let room = dim
                    .zip(b.hi)
                    .map(|(d, h)| d.add(h.scale(-1)).add(Affine::constant(-1)));
                let upper = !room.is_some_and(|r| r.nonneg());
                if lower {
                    holds.push(b.lo.map_or(Holds::Never, |l| Holds::NonNegative(l.form())));
                }
                if upper {
                    holds.push(match (room, b.hi) {
                        (Some(r), _) => Holds::NonNegative(r.form()),
                        (None, Some(h)) if dim.is_none() => Holds::BelowDim(h.form(), axis),
                        _ => Holds::Never,
                    });
                }
                IndexCheck { lower, upper }
            })
            .collect::<Vec<_>>();
        if checks.iter().any(|c| c.any()) && !self.conditions.iter().any(|c| c.site == read.site) {
            self.conditions.push(SiteCondition {
                site: read.site,
                tensor: read.tensor,
                holds,
            });
        }
        checks
    }

    /// `e` with every read's checks set.
    fn mark(&mut self, e: &Expr) -> Expr {
        let kind = match &e.kind {
            ExprKind::Read(r) => {
                let indices: Vec<Expr> = r.indices.iter().map(|i| self.mark(i)).collect();
                let checks = self.checks(r);
                ExprKind::Read(Read {
                    indices,
                    checks,
                    ..r.clone()
                })
            }
            ExprKind::Let(l, v, body) => {
                let v = self.mark(v);
                let b = self.bounds(&v);
                self.locals.insert(*l, b);
                ExprKind::Let(*l, Box::new(v), Box::new(self.mark(body)))
            }
            ExprKind::Unary(op, a) => ExprKind::Unary(*op, Box::new(self.mark(a))),
            ExprKind::Binary(op, a, b) => {
                ExprKind::Binary(*op, Box::new(self.mark(a)), Box::new(self.mark(b)))
            }
            ExprKind::Call(f, args) => {
                ExprKind::Call(*f, args.iter().map(|a| self.mark(a)).collect())
            }
            ExprKind::Cast(a) => ExprKind::Cast(Box::new(self.mark(a))),
            ExprKind::Select(c, t, f) => ExprKind::Select(
                Box::new(self.mark(c)),
                Box::new(self.mark(t)),
                Box::new(self.mark(f)),
            ),
            other => other.clone(),
        };
        Expr { kind, ty: e.ty }
    }
}

/// `body` with the run-time checks of every tensor read set to the bounds
/// that are not proved.
pub fn prove_reads(body: &Expr, tensors: &[TensorDecl]) -> Expr {
    prove(body, tensors).0
}

/// [`prove_reads`], and for each read with checks, what makes them hold
/// for one call.
pub fn prove(body: &Expr, tensors: &[TensorDecl]) -> (Expr, Vec<SiteCondition>) {
    let mut p = Prover {
        tensors,
        locals: HashMap::new(),
        conditions: Vec::new(),
    };
    let body = p.mark(body);
    (body, p.conditions)
}

/// Where the read at `site` of `f` lands: a function with `f`'s signature
/// giving the element's row-major linear index into its tensor, or `-1`
/// where an index is outside the tensor. The `let`s around the read are
/// rebuilt around its indices, so they see what the read sees. `None` if
/// `f` has no such site.
pub fn read_index(f: &Function, site: u32) -> Option<Function> {
    let mut lets = Vec::new();
    let (lets, read) = find_read(&f.body, site, &mut lets)?;
    let dim = |axis: usize| Expr {
        kind: ExprKind::Dim(read.tensor, axis),
        ty: Ty::I32,
    };
    let (mut ok, mut linear) = (Expr::bool(true), Expr::i32(0));
    for (axis, index) in read.indices.iter().enumerate() {
        // A u32 index past i32::MAX becomes negative, and is outside.
        let index = build::cast(index.clone(), Ty::I32);
        ok = build::and(
            ok,
            build::and(
                build::le(Expr::i32(0), index.clone()),
                build::lt(index.clone(), dim(axis)),
            ),
        );
        linear = build::add(build::mul(linear, dim(axis)), index);
    }
    let mut body = build::select(ok, linear, Expr::i32(-1));
    for (l, value) in lets.into_iter().rev() {
        body = Expr {
            kind: ExprKind::Let(l, Box::new(value), Box::new(body)),
            ty: Ty::I32,
        };
    }
    Some(Function {
        name: "read_index",
        args: f.args.clone(),
        ret: Ty::I32,
        body,
    })
}

/// The read at `site` in `e`, with the `let`s in scope there (outermost
/// first).
fn find_read(
    e: &Expr,
    site: u32,
    lets: &mut Vec<(Local, Expr)>,
) -> Option<(Vec<(Local, Expr)>, Read)> {
    match &e.kind {
        ExprKind::Read(r) if r.site == site => Some((lets.clone(), r.clone())),
        ExprKind::Let(l, value, body) => {
            if let Some(found) = find_read(value, site, lets) {
                return Some(found);
            }
            lets.push((*l, (**value).clone()));
            let found = find_read(body, site, lets);
            lets.pop();
            found
        }
        _ => {
            let mut found = None;
            e.for_each_child(&mut |child| {
                if found.is_none() {
                    found = find_read(child, site, lets);
                }
            });
            found
        }
    }
}

/// One tensor read, for reports.
#[derive(Clone, Debug, PartialEq)]
pub struct ReadSite {
    /// Its number in the program.
    pub site: u32,
    /// The tensor read.
    pub tensor: usize,
    /// The checks its indices need.
    pub checks: Vec<IndexCheck>,
}

/// Every read of `body`, in order of first appearance, each site once.
pub fn read_sites(body: &Expr, out: &mut Vec<ReadSite>) {
    body.walk(&mut |e| {
        if let ExprKind::Read(r) = &e.kind
            && !out.iter().any(|s| s.site == r.site)
        {
            out.push(ReadSite {
                site: r.site,
                tensor: r.tensor,
                checks: r.checks.clone(),
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use crate::compile_str;
    use crate::ir::{ExprKind, IndexCheck, Program};

    fn checks_of(source: &str) -> Vec<Vec<IndexCheck>> {
        let p: Program = compile_str(source)
            .unwrap_or_else(|d| panic!("{:?}", d.messages()))
            .program;
        let mut out = Vec::new();
        for f in [&p.score, &p.mask] {
            f.body.walk(&mut |e| {
                if let ExprKind::Read(r) = &e.kind {
                    out.push(r.checks.clone());
                }
            });
        }
        out
    }

    const NONE: IndexCheck = IndexCheck::NONE;
    const LOWER: IndexCheck = IndexCheck {
        lower: true,
        upper: false,
    };
    const UPPER: IndexCheck = IndexCheck {
        lower: false,
        upper: true,
    };

    #[test]
    fn positions_and_heads_are_proved_against_their_sizes() {
        let c = checks_of(
            "#[attention(mask = |b, h, q, kv| self.doc[b][kv] == self.doc[b][q] && self.len[h] > 0)] \
             struct V<R: Runtime> { #[tensor(i32, [B, Sk])] doc: Tensor<R>, #[tensor(i32, [Hq])] len: Tensor<R> }",
        );
        // `q` may be negative when Sq > Sk; everything else is in range.
        assert_eq!(c, [vec![NONE, NONE], vec![NONE, LOWER], vec![NONE]]);
    }

    #[test]
    fn clamped_and_offset_indices() {
        let c = checks_of(
            "#[attention(score = |s, b, h, q, kv| s + self.t[clamp(q - kv, 0, 31)] + self.t[kv % 32] \
               + self.t[kv + 1] + self.u[q - kv + self.m] + self.w[h][(kv as u32)])] \
             struct V<R: Runtime> { m: i32, #[tensor(f32, [32])] t: Tensor<R>, \
               #[tensor(f32, [_])] u: Tensor<R>, #[tensor(f32, [Hq, Sk])] w: Tensor<R> }",
        );
        assert_eq!(
            c,
            [
                vec![NONE],
                vec![NONE],
                // kv + 1 may reach 32 and beyond.
                vec![UPPER],
                // A parameter gives no bound, and `_` never proves the upper.
                vec![IndexCheck::BOTH],
                // A u32 index is never negative; its upper bound is not tracked.
                vec![NONE, UPPER],
            ]
        );
    }
}
