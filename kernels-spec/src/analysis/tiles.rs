//! Tile classification by interval arithmetic.
//!
//! Lowers the mask `mask(b, h, q, kv) -> bool` to a classifier
//! `classify(b, h, q_lo, q_hi, kv_lo, kv_hi) -> i32` that runs once per
//! (query tile, key tile) with the variant's parameter values, on every
//! target, and answers [`Empty`](TileClass::Empty) (no pair visible),
//! [`Full`](TileClass::Full) (every pair visible) or
//! [`Partial`](TileClass::Partial). The classifier is ordinary IR, so every
//! emitter emits it like any other function.
//!
//! Abstract values: an `i32` value is an interval `[lo, hi]` of IR
//! expressions; a bool is the pair (can be true, can be false); `f32` and
//! `u32` values are not tracked (unknown). Soundness: every concrete value
//! (with the IR's wrapping semantics) lies in its interval, so `Empty` and
//! `Full` are proofs. Overflow: each interval also carries a static range,
//! derived from the kernels' bounds on positions (|q|, kv, b, h < 2^30) and
//! full `i32` for parameters; where the static range proves an operation
//! cannot overflow it is emitted as plain arithmetic, otherwise the bounds
//! are computed with saturating arithmetic and widened to all of `i32` when
//! a bound saturates.
//!
//! Exactness: a comparison of two intervals is exact when the operands vary
//! independently, which makes causal (`kv <= q`), sliding window
//! (`q - kv < w`), their conjunction, prefix-LM (`kv < p || kv <= q`) and
//! block-diagonal (`q / c == kv / c`) masks exact at tile granularity: a tile
//! is `PARTIAL` only if it really holds both visible and hidden pairs.

use super::build::{self, and, call, eq, le, let_, lt, not, or, select, sub};
use crate::ir::{
    Arg, BinOp, Builtin, Const, Expr, ExprKind, Function, Local, ParamDecl, Read, ReadRange,
    TileClass, Ty, UnOp,
};
use std::collections::HashMap;

/// Positions, batch and head indices are below this bound in magnitude
/// (enforced by the runtime's validation).
pub const INDEX_BOUND: i64 = (1 << 30) - 1;

const I32_MIN: i64 = i32::MIN as i64;
const I32_MAX: i64 = i32::MAX as i64;

/// The tile classifier of a mask, and the `(tensor, axis)` summaries it
/// reads. Without a mask every tile is full.
///
/// Tensor reads: a read whose indices are fixed over the tile (they depend
/// on `b`, `h` and parameters only) is its element; a read with one index
/// that runs over the tile (an interval of `q` or `kv`) and the others fixed
/// is bounded by the least and greatest element over that index range,
/// from the per-call summaries ([`ExprKind::ReadRange`]); any other read is
/// unbounded. And a tile where a checked read of the mask may index outside
/// its tensor is `Partial`, so that the kernels evaluate, and report, that
/// read wherever the reference would.
pub fn classifier(
    mask: Option<&Function>,
    params: &[ParamDecl],
) -> (Function, Vec<(usize, usize)>) {
    let args = vec![Arg::B, Arg::H, Arg::QLo, Arg::QHi, Arg::KvLo, Arg::KvHi];
    let mut summaries = Vec::new();
    let body = match mask {
        None => Expr::i32(TileClass::Full.code()),
        Some(mask) => {
            let mut cx = Interval {
                params,
                locals: HashMap::new(),
                bindings: Vec::new(),
                next: build::next_local(&mask.body),
                summaries: Vec::new(),
                in_range: Expr::bool(true),
            };
            let v = cx.eval(&mask.body);
            let (t, f) = match v {
                Abs::Bool { t, f } => (t, f),
                _ => unreachable!("a checked mask is bool"),
            };
            let class = select(
                not(t),
                Expr::i32(TileClass::Empty.code()),
                select(
                    not(f),
                    Expr::i32(TileClass::Full.code()),
                    Expr::i32(TileClass::Partial.code()),
                ),
            );
            let class = select(
                cx.in_range.clone(),
                class,
                Expr::i32(TileClass::Partial.code()),
            );
            summaries = cx.summaries;
            cx.bindings
                .into_iter()
                .rev()
                .fold(class, |body, (l, value)| let_(l, value, body))
        }
    };
    let f = Function {
        name: "classify",
        args,
        ret: Ty::I32,
        body: build::simplify(body),
    };
    // Only the summaries the simplified classifier still reads.
    summaries.retain(|&(t, a)| {
        let mut used = false;
        f.body.walk(&mut |e| {
            used |= matches!(&e.kind, ExprKind::ReadRange(r) if r.tensor == t && r.axis == Some(a))
        });
        used
    });
    (f, summaries)
}

/// An abstract value.
#[derive(Clone, Debug)]
enum Abs {
    /// An `i32` in `[lo, hi]`; `range` is a static bound on both.
    Int {
        lo: Expr,
        hi: Expr,
        range: (i64, i64),
    },
    /// A bool: `t` = it can be true, `f` = it can be false.
    Bool { t: Expr, f: Expr },
    /// An untracked value (f32, u32).
    Unknown,
}

fn exact_int(e: Expr, range: (i64, i64)) -> Abs {
    Abs::Int {
        lo: e.clone(),
        hi: e,
        range,
    }
}

fn full_int() -> Abs {
    Abs::Int {
        lo: Expr::i32(i32::MIN),
        hi: Expr::i32(i32::MAX),
        range: (I32_MIN, I32_MAX),
    }
}

fn unknown_bool() -> Abs {
    Abs::Bool {
        t: Expr::bool(true),
        f: Expr::bool(true),
    }
}

fn fits(range: (i64, i64)) -> bool {
    range.0 >= I32_MIN && range.1 <= I32_MAX
}

fn min(a: Expr, b: Expr) -> Expr {
    call(Builtin::Min, vec![a, b])
}

fn max(a: Expr, b: Expr) -> Expr {
    call(Builtin::Max, vec![a, b])
}

struct Interval<'a> {
    params: &'a [ParamDecl],
    locals: HashMap<Local, Abs>,
    bindings: Vec<(Local, Expr)>,
    next: u32,
    /// The summaries read so far.
    summaries: Vec<(usize, usize)>,
    /// The tile's checked reads index inside their tensors.
    in_range: Expr,
}

impl Interval<'_> {
    /// Bind a non-trivial bound to a fresh local so it is computed once.
    fn share(&mut self, e: Expr) -> Expr {
        if matches!(
            e.kind,
            ExprKind::Const(_) | ExprKind::Arg(_) | ExprKind::Param(_) | ExprKind::Local(_)
        ) {
            return e;
        }
        let l = Local(self.next);
        self.next += 1;
        let ty = e.ty;
        self.bindings.push((l, e));
        Expr::local(l, ty)
    }

    fn int(&mut self, lo: Expr, hi: Expr, range: (i64, i64)) -> Abs {
        // A point stays one expression, so that reads can tell it is one.
        if lo == hi {
            let v = self.share(lo);
            return Abs::Int {
                lo: v.clone(),
                hi: v,
                range,
            };
        }
        let (lo, hi) = (self.share(lo), self.share(hi));
        Abs::Int { lo, hi, range }
    }

    /// The bounds of a tensor read over the tile.
    fn read(&mut self, r: &Read, ty: Ty) -> Abs {
        let idx: Vec<Abs> = r.indices.iter().map(|i| self.eval(i)).collect();
        let ints: Option<Vec<(Expr, Expr)>> = idx
            .iter()
            .map(|a| match a {
                Abs::Int { lo, hi, .. } => Some((lo.clone(), hi.clone())),
                _ => None,
            })
            .collect();
        // The checked bounds, over the whole tile.
        for (axis, check) in r.checks.iter().enumerate() {
            if !check.any() {
                continue;
            }
            let ok = match &ints {
                Some(ints) => {
                    let (lo, hi) = ints[axis].clone();
                    let dim = Expr {
                        kind: ExprKind::Dim(r.tensor, axis),
                        ty: Ty::I32,
                    };
                    let lower = if check.lower {
                        le(Expr::i32(0), lo)
                    } else {
                        Expr::bool(true)
                    };
                    let upper = if check.upper {
                        lt(hi, dim)
                    } else {
                        Expr::bool(true)
                    };
                    and(lower, upper)
                }
                // A u32 index is not tracked: the tile cannot be decided.
                None => Expr::bool(false),
            };
            let ok = self.share(ok);
            self.in_range = and(self.in_range.clone(), ok);
        }
        let Some(ints) = ints.filter(|_| ty == Ty::I32) else {
            return if ty == Ty::I32 {
                full_int()
            } else {
                Abs::Unknown
            };
        };
        let varying: Vec<usize> = (0..ints.len())
            .filter(|&a| ints[a].0 != ints[a].1)
            .collect();
        // Several indices that run over the tile (a block map read at `q /
        // block` and `kv / block`): where each holds one value over this
        // tile (blocks at least a tile), the element itself; where all but
        // the last do, bounded along the last; else unbounded.
        let (axis, single) = match varying[..] {
            [] => (None, None),
            [a] => (Some(a), None),
            [.., last] => {
                let same = |a: usize| eq(ints[a].0.clone(), ints[a].1.clone());
                let others = varying[..varying.len() - 1]
                    .iter()
                    .map(|&a| same(a))
                    .reduce(and)
                    .expect("two or more");
                let (others, point) = (self.share(others), same(last));
                let point = self.share(point);
                (Some(last), Some((others, point)))
            }
        };
        if let Some(a) = axis
            && !self.summaries.contains(&(r.tensor, a))
        {
            self.summaries.push((r.tensor, a));
        }
        let los: Vec<Expr> = ints.iter().map(|(lo, _)| lo.clone()).collect();
        let hi = axis.map_or_else(|| los[0].clone(), |a| ints[a].1.clone());
        let bound = |max: bool| Expr {
            kind: ExprKind::ReadRange(ReadRange {
                tensor: r.tensor,
                axis,
                indices: los.clone(),
                hi: Box::new(hi.clone()),
                max,
            }),
            ty: Ty::I32,
        };
        let element = |max: bool| Expr {
            kind: ExprKind::ReadRange(ReadRange {
                tensor: r.tensor,
                axis: None,
                indices: los.clone(),
                hi: Box::new(los[0].clone()),
                max,
            }),
            ty: Ty::I32,
        };
        let (lo, hi) = match single {
            None => (bound(false), bound(true)),
            Some((others, point)) => {
                let at = |max: bool, unbounded: i32| {
                    let along = select(point.clone(), element(max), bound(max));
                    select(others.clone(), along, Expr::i32(unbounded))
                };
                (at(false, i32::MIN), at(true, i32::MAX))
            }
        };
        self.int(lo, hi, (I32_MIN, I32_MAX))
    }

    fn boolean(&mut self, t: Expr, f: Expr) -> Abs {
        let (t, f) = (self.share(t), self.share(f));
        Abs::Bool { t, f }
    }

    fn eval(&mut self, e: &Expr) -> Abs {
        match &e.kind {
            ExprKind::Const(Const::Int(v)) if e.ty == Ty::I32 => exact_int(e.clone(), (*v, *v)),
            ExprKind::Const(Const::Bool(v)) => Abs::Bool {
                t: Expr::bool(*v),
                f: Expr::bool(!*v),
            },
            ExprKind::Const(_) => Abs::Unknown,
            ExprKind::Arg(a) => {
                let (lo, hi) = match a {
                    Arg::Q => (Arg::QLo, Arg::QHi),
                    Arg::Kv => (Arg::KvLo, Arg::KvHi),
                    other => (*other, *other),
                };
                let range = match a {
                    Arg::B | Arg::H => (0, INDEX_BOUND),
                    _ => (-INDEX_BOUND, INDEX_BOUND),
                };
                Abs::Int {
                    lo: Expr::arg(lo),
                    hi: Expr::arg(hi),
                    range,
                }
            }
            ExprKind::Param(i) => match self.params[*i].ty {
                Ty::I32 => exact_int(e.clone(), (I32_MIN, I32_MAX)),
                Ty::Bool => Abs::Bool {
                    t: e.clone(),
                    f: not(e.clone()),
                },
                _ => Abs::Unknown,
            },
            ExprKind::Local(l) => self.locals.get(l).cloned().unwrap_or(Abs::Unknown),
            ExprKind::Let(l, value, body) => {
                let v = self.eval(value);
                self.locals.insert(*l, v);
                self.eval(body)
            }
            ExprKind::Unary(UnOp::Not, a) => match self.eval(a) {
                Abs::Bool { t, f } => Abs::Bool { t: f, f: t },
                _ => unknown_bool(),
            },
            ExprKind::Unary(UnOp::Neg, a) => match self.eval(a) {
                Abs::Int { lo, hi, range } => self.arith(
                    BinOp::Sub,
                    exact_int(Expr::i32(0), (0, 0)),
                    Abs::Int { lo, hi, range },
                ),
                _ => Abs::Unknown,
            },
            ExprKind::Binary(op, a, b) => {
                let (x, y) = (self.eval(a), self.eval(b));
                if op.is_logical() {
                    self.logic(*op, x, y)
                } else if op.is_comparison() {
                    self.compare(*op, x, y)
                } else if e.ty == Ty::I32 {
                    self.arith(*op, x, y)
                } else {
                    Abs::Unknown
                }
            }
            ExprKind::Call(f, args) if e.ty == Ty::I32 => {
                let vals: Vec<Abs> = args.iter().map(|a| self.eval(a)).collect();
                self.int_call(*f, vals)
            }
            ExprKind::Call(..) => Abs::Unknown,
            ExprKind::Cast(a) => match (self.eval(a), e.ty) {
                (Abs::Int { lo, hi, range }, Ty::I32) => Abs::Int { lo, hi, range },
                (Abs::Bool { t, f }, Ty::I32) => {
                    // false → 0, true → 1
                    let lo = select(f.clone(), Expr::i32(0), Expr::i32(1));
                    let hi = select(t, Expr::i32(1), Expr::i32(0));
                    self.int(lo, hi, (0, 1))
                }
                _ => Abs::Unknown,
            },
            ExprKind::Select(c, a, b) => {
                let c = self.eval(c);
                let (x, y) = (self.eval(a), self.eval(b));
                self.select(c, x, y)
            }
            ExprKind::Read(r) => self.read(r, e.ty),
            // Not in a mask: these come from classifiers.
            ExprKind::ReadRange(_) | ExprKind::Dim(..) => full_int(),
        }
    }

    fn select(&mut self, c: Abs, x: Abs, y: Abs) -> Abs {
        let Abs::Bool { t: ct, f: cf } = c else {
            unreachable!("a checked condition is bool")
        };
        match (x, y) {
            (Abs::Bool { t: xt, f: xf }, Abs::Bool { t: yt, f: yf }) => {
                let t = or(and(ct.clone(), xt), and(cf.clone(), yt));
                let f = or(and(ct, xf), and(cf, yf));
                self.boolean(t, f)
            }
            (
                Abs::Int {
                    lo: xl,
                    hi: xh,
                    range: xr,
                },
                Abs::Int {
                    lo: yl,
                    hi: yh,
                    range: yr,
                },
            ) => {
                // Only x possible / only y possible / both: the hull.
                let pick = |only_x: Expr, only_y: Expr, both: Expr| {
                    select(
                        not(cf.clone()),
                        only_x,
                        select(not(ct.clone()), only_y, both),
                    )
                };
                let lo = pick(xl.clone(), yl.clone(), min(xl, yl));
                let hi = pick(xh.clone(), yh.clone(), max(xh, yh));
                self.int(lo, hi, (xr.0.min(yr.0), xr.1.max(yr.1)))
            }
            (Abs::Bool { .. }, _) | (_, Abs::Bool { .. }) => unknown_bool(),
            _ => Abs::Unknown,
        }
    }

    fn logic(&mut self, op: BinOp, x: Abs, y: Abs) -> Abs {
        let (Abs::Bool { t: xt, f: xf }, Abs::Bool { t: yt, f: yf }) = (x, y) else {
            return unknown_bool();
        };
        match op {
            BinOp::And => self.boolean(and(xt, yt), or(xf, yf)),
            _ => self.boolean(or(xt, yt), and(xf, yf)),
        }
    }

    fn compare(&mut self, op: BinOp, x: Abs, y: Abs) -> Abs {
        match (x, y) {
            (Abs::Int { lo: xl, hi: xh, .. }, Abs::Int { lo: yl, hi: yh, .. }) => {
                let (t, f) = match op {
                    BinOp::Lt => (lt(xl, yh), le(yl, xh)),
                    BinOp::Le => (le(xl, yh), lt(yl, xh)),
                    BinOp::Gt => (lt(yl, xh), le(xl, yh)),
                    BinOp::Ge => (le(yl, xh), lt(xl, yh)),
                    BinOp::Eq | BinOp::Ne => {
                        let overlap = and(le(xl.clone(), yh.clone()), le(yl.clone(), xh.clone()));
                        let point = and(and(eq(xl.clone(), xh), eq(yl.clone(), yh)), eq(xl, yl));
                        let can_differ = not(point);
                        if op == BinOp::Eq {
                            (overlap, can_differ)
                        } else {
                            (can_differ, overlap)
                        }
                    }
                    _ => unreachable!("not a comparison"),
                };
                self.boolean(t, f)
            }
            (Abs::Bool { t: xt, f: xf }, Abs::Bool { t: yt, f: yf }) => {
                let can_equal = or(and(xt.clone(), yt.clone()), and(xf.clone(), yf.clone()));
                let can_differ = or(and(xt, yf), and(xf, yt));
                match op {
                    BinOp::Eq => self.boolean(can_equal, can_differ),
                    BinOp::Ne => self.boolean(can_differ, can_equal),
                    _ => unknown_bool(),
                }
            }
            _ => unknown_bool(),
        }
    }

    fn arith(&mut self, op: BinOp, x: Abs, y: Abs) -> Abs {
        let (
            Abs::Int {
                lo: xl,
                hi: xh,
                range: xr,
            },
            Abs::Int {
                lo: yl,
                hi: yh,
                range: yr,
            },
        ) = (x, y)
        else {
            return full_int();
        };
        match op {
            BinOp::Add | BinOp::Sub => {
                let (range, (lo_a, lo_b), (hi_a, hi_b)) = if op == BinOp::Add {
                    ((xr.0 + yr.0, xr.1 + yr.1), (xl, yl), (xh, yh))
                } else {
                    ((xr.0 - yr.1, xr.1 - yr.0), (xl, yh), (xh, yl))
                };
                if fits(range) {
                    let lo = build::binary(op, lo_a, lo_b);
                    let hi = build::binary(op, hi_a, hi_b);
                    self.int(lo, hi, range)
                } else {
                    let sat = if op == BinOp::Add {
                        Builtin::SatAdd
                    } else {
                        Builtin::SatSub
                    };
                    let lo = call(sat, vec![lo_a, lo_b]);
                    let hi = call(sat, vec![hi_a, hi_b]);
                    self.widen(lo, hi)
                }
            }
            BinOp::Mul => {
                let corners =
                    [(xr.0, yr.0), (xr.0, yr.1), (xr.1, yr.0), (xr.1, yr.1)].map(|(a, b)| a * b);
                let range = (
                    *corners.iter().min().expect("4"),
                    *corners.iter().max().expect("4"),
                );
                let fits = fits(range);
                let product = |a: &Expr, b: &Expr| {
                    if fits {
                        build::binary(BinOp::Mul, a.clone(), b.clone())
                    } else {
                        call(Builtin::SatMul, vec![a.clone(), b.clone()])
                    }
                };
                let p = [
                    product(&xl, &yl),
                    product(&xl, &yh),
                    product(&xh, &yl),
                    product(&xh, &yh),
                ];
                let p: Vec<Expr> = p.into_iter().map(|e| self.share(e)).collect();
                let lo = min(
                    min(p[0].clone(), p[1].clone()),
                    min(p[2].clone(), p[3].clone()),
                );
                let hi = max(
                    max(p[0].clone(), p[1].clone()),
                    max(p[2].clone(), p[3].clone()),
                );
                if fits {
                    self.int(lo, hi, range)
                } else {
                    self.widen(lo, hi)
                }
            }
            BinOp::Div => {
                // |x / y| <= |x| always (x / 0 = 0), except i32::MIN / -1.
                let m = xr.0.abs().max(xr.1.abs());
                if xr.0 <= I32_MIN {
                    return full_int();
                }
                let range = (-m, m);
                // A divisor interval holding 0 gives up; else the extremes are
                // at the corners (truncating division is monotone in each operand
                // on either side of 0).
                let zero_in = and(le(yl.clone(), Expr::i32(0)), le(Expr::i32(0), yh.clone()));
                let zero_in = self.share(zero_in);
                let q = [(&xl, &yl), (&xl, &yh), (&xh, &yl), (&xh, &yh)]
                    .map(|(a, b)| build::binary(BinOp::Div, a.clone(), b.clone()));
                let q: Vec<Expr> = q.into_iter().map(|e| self.share(e)).collect();
                let lo = min(
                    min(q[0].clone(), q[1].clone()),
                    min(q[2].clone(), q[3].clone()),
                );
                let hi = max(
                    max(q[0].clone(), q[1].clone()),
                    max(q[2].clone(), q[3].clone()),
                );
                let lo = select(zero_in.clone(), Expr::i32(-(m.min(I32_MAX)) as i32), lo);
                let hi = select(zero_in, Expr::i32(m.min(I32_MAX) as i32), hi);
                self.int(lo, hi, range)
            }
            BinOp::Rem => {
                // |x % y| <= |x| with the sign of x (x % 0 = 0); when y > 0 also
                // |x % y| < y.
                let range = (xr.0.min(0), xr.1.max(0));
                let base_lo = min(xl, Expr::i32(0));
                let base_hi = max(xh, Expr::i32(0));
                let positive = lt(Expr::i32(0), yl);
                let positive = self.share(positive);
                let bound = sub(yh, Expr::i32(1));
                let bound = self.share(bound);
                let lo = select(
                    positive.clone(),
                    max(base_lo.clone(), build::neg(bound.clone())),
                    base_lo,
                );
                let hi = select(positive, min(base_hi.clone(), bound), base_hi);
                self.int(lo, hi, range)
            }
            _ => full_int(),
        }
    }

    /// Bounds computed with saturating arithmetic: if either saturated, the
    /// wrapped concrete value can be anything.
    fn widen(&mut self, lo: Expr, hi: Expr) -> Abs {
        let lo = self.share(lo);
        let hi = self.share(hi);
        let saturated = or(
            eq(lo.clone(), Expr::i32(i32::MIN)),
            eq(hi.clone(), Expr::i32(i32::MAX)),
        );
        let saturated = self.share(saturated);
        let lo = select(saturated.clone(), Expr::i32(i32::MIN), lo);
        let hi = select(saturated, Expr::i32(i32::MAX), hi);
        self.int(lo, hi, (I32_MIN, I32_MAX))
    }

    fn int_call(&mut self, f: Builtin, vals: Vec<Abs>) -> Abs {
        let mut ints = Vec::with_capacity(vals.len());
        for v in vals {
            match v {
                Abs::Int { lo, hi, range } => ints.push((lo, hi, range)),
                _ => return full_int(),
            }
        }
        match f {
            Builtin::Min | Builtin::Max => {
                let [(al, ah, ar), (bl, bh, br)]: [_; 2] = ints.try_into().expect("arity 2");
                let pick = if f == Builtin::Min { min } else { max };
                let range = if f == Builtin::Min {
                    (ar.0.min(br.0), ar.1.min(br.1))
                } else {
                    (ar.0.max(br.0), ar.1.max(br.1))
                };
                self.int(pick(al, bl), pick(ah, bh), range)
            }
            Builtin::Clamp => {
                let [x, lo, hi]: [_; 3] = ints.try_into().expect("arity 3");
                let m = self.int_call(Builtin::Max, vec![int_abs(x), int_abs(lo)]);
                self.int_call(Builtin::Min, vec![m, int_abs(hi)])
            }
            Builtin::Abs => {
                let [(lo, hi, range)]: [_; 1] = ints.try_into().expect("arity 1");
                if range.0 <= I32_MIN {
                    return full_int();
                }
                let nonneg = le(Expr::i32(0), lo.clone());
                let nonpos = le(hi.clone(), Expr::i32(0));
                let (nonneg, nonpos) = (self.share(nonneg), self.share(nonpos));
                let new_lo = select(
                    nonneg.clone(),
                    lo.clone(),
                    select(nonpos.clone(), build::neg(hi.clone()), Expr::i32(0)),
                );
                let new_hi = select(
                    nonneg,
                    hi.clone(),
                    select(nonpos, build::neg(lo.clone()), max(build::neg(lo), hi)),
                );
                let m = range.0.abs().max(range.1.abs());
                let low = if range.0 >= 0 {
                    range.0
                } else if range.1 <= 0 {
                    -range.1
                } else {
                    0
                };
                self.int(new_lo, new_hi, (low, m))
            }
            _ => full_int(),
        }
    }
}

fn int_abs((lo, hi, range): (Expr, Expr, (i64, i64))) -> Abs {
    Abs::Int { lo, hi, range }
}
