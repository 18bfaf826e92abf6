//! IR → [`ast`](super::ast): the one walk over the variant functions that
//! every C-like GPU dialect shares.
//!
//! - Every closed sub-expression (no argument, parameter, tensor read, or
//!   local bound to a runtime value) is folded here with [`crate::eval`],
//!   with the IR's semantics, so what remains depends on a runtime value.
//!   (WGSL needs it: a constant expression that overflows or is non-finite
//!   is a shader-creation error; CUDA gets the same text for free.)
//! - `let` has no expression form in C-like languages: bindings become
//!   immutable locals before the `return`, and an `if`/`else` may evaluate
//!   both arms. Both are sound because every IR expression is pure and
//!   total, but for one effect: a checked tensor read reports an index out
//!   of range. So each checked read carries the path condition under which
//!   the IR evaluates it (`report`): the conditions of the `if` arms and the
//!   left operands of `&&`/`||` around it.
//! - A tensor read is a word of the capture arena (see [`crate::params`]):
//!   the tensor's offset plus its row-major linear index, from the
//!   dimensions in the parameter block. A read proved in range loads it; a
//!   checked read loads it only when its checked bounds hold.
//! - A classifier's range read takes the least or greatest of the summary
//!   entries of the blocks its range covers, or the unbounded value when the
//!   range is empty, outside the tensor or wider than
//!   [`SUMMARY_MAX_BLOCKS`] blocks.
//! - `clamp(x, lo, hi)` becomes `min(max(x, lo), hi)` (never panics, even if
//!   `lo > hi`), `abs` of a `u32` the value itself, a `bool` parameter
//!   `word != 0`.
//! - Arguments (the parameter block and the arena included) that a function
//!   does not read are still taken, so every variant function of a kind has
//!   the same signature; they are listed as [`Stmt::Unused`].

use super::ast::{BinaryOp, Expr, Func, Function, Literal, Member, Name, ParamsStruct, Stmt, Type};
use crate::analysis::build;
use crate::eval::{self, Value};
use crate::ir::{self, Builtin, Const, ExprKind, Local, Program, Ty, UnOp};
use crate::params::{ParamLayout, SUMMARY_BLOCK, SUMMARY_MAX_BLOCKS, WindowWord};

/// The name of a variant function in every target (`score` →
/// `variant_score`).
pub fn function_name(f: &ir::Function) -> String {
    format!("variant_{}", f.name)
}

/// The parameter block struct of a layout.
pub fn params_struct(layout: &ParamLayout) -> ParamsStruct {
    ParamsStruct {
        members: layout
            .slots()
            .iter()
            .flat_map(|s| s.members())
            .map(|m| Member {
                name: m.name,
                ty: m.ty.into(),
            })
            .collect(),
        padding_words: layout.padding_words(),
        trailing: {
            let dropout = crate::dropout::Word::ALL
                .iter()
                .filter(|_| layout.dropout())
                .map(|w| Member {
                    name: w.member().to_string(),
                    ty: Type::U32,
                });
            let window = WindowWord::ALL.iter().map(|w| Member {
                name: w.member().to_string(),
                ty: w.ty().into(),
            });
            dropout.chain(window).collect()
        },
    }
}

/// The window's shift of a position argument (`q`, `kv` and the tile's
/// bounds), as the member of the parameter block that holds it; `None`
/// for the others.
fn window_shift(a: ir::Arg) -> Option<WindowWord> {
    match a {
        ir::Arg::Q | ir::Arg::QLo | ir::Arg::QHi => Some(WindowWord::Q),
        ir::Arg::Kv | ir::Arg::KvLo | ir::Arg::KvHi => Some(WindowWord::Kv),
        ir::Arg::S | ir::Arg::B | ir::Arg::H => None,
    }
}

/// A window word of the parameter block.
fn window_word(w: WindowWord) -> Expr {
    Expr::Param {
        member: w.member().to_string(),
        ty: w.ty().into(),
    }
}

/// Lower one IR function of `program`.
pub fn function(program: &Program, f: &ir::Function) -> Function {
    let mut cx = Lowering {
        program,
        stmts: Vec::new(),
        closed_locals: Vec::new(),
        next_local: build::next_local(&f.body),
        names: Vec::new(),
        bound: std::collections::HashSet::new(),
        placed: Vec::new(),
    };
    // Every position is shifted by the call's window, a word of the block.
    let (mut reads_params, mut reads_tensors) = (false, false);
    f.body.walk(&mut |e| match e.kind {
        ExprKind::Param(_) => reads_params = true,
        ExprKind::Arg(a) if window_shift(a).is_some() => reads_params = true,
        ExprKind::Read(_) | ExprKind::ReadRange(_) | ExprKind::Dim(..) => {
            reads_params = true;
            reads_tensors |= !matches!(e.kind, ExprKind::Dim(..));
        }
        _ => {}
    });
    if !reads_params {
        cx.stmts.push(Stmt::Unused(Name::Params));
    }
    if !reads_tensors {
        cx.stmts.push(Stmt::Unused(Name::Captures));
    }
    for a in &f.args {
        if !f.body.uses_arg(*a) {
            cx.stmts.push(Stmt::Unused(Name::Arg(*a)));
        }
    }
    // `score` and `score_grad` are evaluated at every pair of a tile, and
    // their results discarded where the pair is hidden: a checked read
    // there reports only for a visible pair, as the reference evaluates
    // them only there.
    let seen = takes_seen(f);
    let mut checked = false;
    f.body.walk(&mut |e| {
        checked |= matches!(&e.kind, ExprKind::Read(r) if r.checks.iter().any(|c| c.any()))
    });
    let guard = if seen && checked {
        Expr::Name(Name::Seen)
    } else {
        if seen {
            cx.stmts.push(Stmt::Unused(Name::Seen));
        }
        Expr::Lit(Literal::Bool(true))
    };
    // Each position the body reads, once, where the window places it.
    for &a in &f.args {
        if let Some(w) = window_shift(a).filter(|_| f.body.uses_arg(a)) {
            let l = Local(cx.next_local);
            cx.next_local += 1;
            let placed = Expr::Binary(
                BinaryOp::Add,
                Type::I32,
                Box::new(Expr::Name(Name::Arg(a))),
                Box::new(window_word(w)),
            );
            cx.stmts.push(Stmt::Let(l, Type::I32, placed));
            cx.placed.push((a, l));
        }
    }
    let mut value = cx.expr(&f.body, &guard);
    if f.name == "sink" && program.weights.sink {
        // A call whose rows do not carry the sink (all but one of a ring's
        // calls per row) has none.
        let no_sink = Expr::Binary(
            BinaryOp::Ne,
            Type::U32,
            Box::new(window_word(WindowWord::NoSink)),
            Box::new(Expr::Lit(Literal::U32(0))),
        );
        let none = Expr::Lit(Literal::F32(f32::NEG_INFINITY));
        value = Expr::Select(Box::new(no_sink), Box::new(none), Box::new(value));
    }
    cx.stmts.push(Stmt::Return(value));
    Function {
        name: function_name(f),
        args: f
            .args
            .iter()
            .map(|a| (Name::Arg(*a), a.ty().into()))
            .collect(),
        block: true,
        seen,
        ret: f.ret.into(),
        body: cx.stmts,
    }
}

/// The two functions of a read of a learnable tensor (see
/// [`ir::LearnableSite`]): `variant_site<N>_at`, with the read's function's
/// signature, the arena word of the low half of the element's gradient
/// accumulator (`u32::MAX` where the read is outside the tensor), and
/// `variant_site<N>_grad`, the derivative of that function with respect to
/// the value read.
pub fn site_functions(program: &Program, site: &ir::LearnableSite) -> [Function; 2] {
    let mut at = function(program, &site.index);
    at.name = format!("variant_site{}_at", site.site);
    // The block is read now: the grad offset.
    at.body.retain(|s| *s != Stmt::Unused(Name::Params));
    let Some(Stmt::Return(index)) = at.body.pop() else {
        unreachable!("a lowered body ends with its return")
    };
    let free = at
        .body
        .iter()
        .filter_map(|s| match s {
            Stmt::Let(l, ..) => Some(l.0 + 1),
            _ => None,
        })
        .max()
        .unwrap_or(0)
        .max(build::next_local(&site.index.body));
    let l = Local(free);
    at.body.push(Stmt::Let(l, Type::I32, index));
    let index = Expr::Name(Name::Local(l));
    let word = binary(
        BinaryOp::Add,
        Type::U32,
        Expr::Param {
            member: program.layout.tensor(site.tensor).grad_member(),
            ty: Type::U32,
        },
        binary(
            BinaryOp::Mul,
            Type::U32,
            u32_lit(2),
            as_u32(index.clone(), Ty::I32),
        ),
    );
    at.body.push(Stmt::Return(Expr::Select(
        Box::new(binary(
            BinaryOp::Lt,
            Type::I32,
            index,
            Expr::Lit(Literal::I32(0)),
        )),
        Box::new(u32_lit(u32::MAX)),
        Box::new(word),
    )));
    at.ret = Type::U32;
    let mut grad = function(program, &site.grad);
    grad.name = format!("variant_site{}_grad", site.site);
    [at, grad]
}

/// Whether `f` takes the `seen` argument: `score` and `score_grad` do (the
/// pair is visible), and `sink` (the query row exists).
pub fn takes_seen(f: &ir::Function) -> bool {
    f.args.first() == Some(&ir::Arg::S) || f.name == "sink"
}

struct Lowering<'a> {
    program: &'a Program,
    stmts: Vec<Stmt>,
    /// Locals bound to closed values, in binding order, for folding.
    closed_locals: Vec<(Local, ir::Expr)>,
    /// The next local free for conditions the lowering binds itself.
    next_local: u32,
    /// The names of the IR's locals in scope, innermost last: a `let`
    /// that the IR holds twice (a subexpression a derivative rule copies)
    /// is bound again under a fresh name, since a kernel body is one scope.
    names: Vec<(Local, Local)>,
    /// The names bound so far.
    bound: std::collections::HashSet<Local>,
    /// Each position argument the body reads, and the local holding it
    /// shifted by the call's window.
    placed: Vec<(ir::Arg, Local)>,
}

fn literal(v: Value) -> Expr {
    Expr::Lit(match v {
        Value::F32(x) => Literal::F32(x),
        Value::I32(x) => Literal::I32(x),
        Value::U32(x) => Literal::U32(x),
        Value::Bool(x) => Literal::Bool(x),
    })
}

fn call(f: Func, ty: Type, args: Vec<Expr>) -> Expr {
    Expr::Call(f, ty, args)
}

fn u32_lit(v: u32) -> Expr {
    Expr::Lit(Literal::U32(v))
}

fn binary(op: BinaryOp, ty: Type, a: Expr, b: Expr) -> Expr {
    Expr::Binary(op, ty, Box::new(a), Box::new(b))
}

fn and(a: Expr, b: Expr) -> Expr {
    match (&a, &b) {
        (Expr::Lit(Literal::Bool(true)), _) => b,
        (_, Expr::Lit(Literal::Bool(true))) => a,
        _ => binary(BinaryOp::And, Type::Bool, a, b),
    }
}

fn not(a: Expr) -> Expr {
    Expr::Unary(super::ast::UnaryOp::Not, Type::Bool, Box::new(a))
}

/// The bits of an index as a `u32` (an `i32` index reinterpreted).
fn as_u32(index: Expr, ty: Ty) -> Expr {
    match ty {
        Ty::U32 => index,
        _ => Expr::Cast {
            to: Type::U32,
            from: Type::I32,
            value: Box::new(index),
        },
    }
}

/// Whether `e` holds a checked read, which needs its path condition.
fn has_checked_read(e: &ir::Expr) -> bool {
    let mut found = false;
    e.walk(&mut |x| {
        found |= matches!(&x.kind, ExprKind::Read(r) if r.checks.iter().any(|c| c.any()))
    });
    found
}

impl Lowering<'_> {
    /// Whether `e` reads no argument, parameter, tensor, or local bound to a
    /// runtime value.
    fn is_closed(&self, e: &ir::Expr) -> bool {
        let mut bound: Vec<Local> = Vec::new();
        e.walk(&mut |x| {
            if let ExprKind::Let(l, _, _) = x.kind {
                bound.push(l);
            }
        });
        let mut closed = true;
        e.walk(&mut |x| match x.kind {
            ExprKind::Arg(_)
            | ExprKind::Param(_)
            | ExprKind::Read(_)
            | ExprKind::ReadRange(_)
            | ExprKind::Dim(..) => closed = false,
            ExprKind::Local(l) => {
                closed &= bound.contains(&l) || self.closed_locals.iter().any(|(c, _)| *c == l)
            }
            _ => {}
        });
        closed
    }

    /// The value of a closed expression, with the IR's semantics.
    fn fold(&self, e: &ir::Expr) -> Value {
        let mut body = e.clone();
        for (l, v) in self.closed_locals.iter().rev() {
            body = ir::Expr {
                ty: body.ty,
                kind: ExprKind::Let(*l, Box::new(v.clone()), Box::new(body)),
            };
        }
        let f = ir::Function {
            name: "const",
            args: Vec::new(),
            ret: e.ty,
            body,
        };
        eval::call(&f, &[], &[])
    }

    /// `value` bound to a fresh local (a name, so a condition can appear in
    /// a path condition and in its own place without being computed twice).
    fn bind(&mut self, value: Expr) -> Expr {
        if matches!(value, Expr::Lit(_) | Expr::Name(_)) {
            return value;
        }
        let l = Local(self.next_local);
        self.next_local += 1;
        self.stmts.push(Stmt::Let(l, Type::Bool, value));
        Expr::Name(Name::Local(l))
    }

    /// A member of the parameter block, as a `u32`.
    fn word(&self, member: String) -> Expr {
        Expr::Param {
            member,
            ty: Type::U32,
        }
    }

    /// Dimension `axis` of tensor `t` (a `u32` member of the block).
    fn dim(&self, t: usize, axis: usize) -> Expr {
        self.word(self.program.layout.tensor(t).dim_member(axis))
    }

    /// The row-major linear index of `indices` (as `u32`s) in tensor `t`,
    /// with dimension `replaced` (if any) taken as `with`.
    fn linear(&self, t: usize, indices: &[Expr], replaced: Option<(usize, Expr)>) -> Expr {
        let mut lin: Option<Expr> = None;
        for (axis, i) in indices.iter().enumerate() {
            let dim = match &replaced {
                Some((a, with)) if *a == axis => with.clone(),
                _ => self.dim(t, axis),
            };
            lin = Some(match lin {
                None => i.clone(),
                Some(l) => binary(
                    BinaryOp::Add,
                    Type::U32,
                    binary(BinaryOp::Mul, Type::U32, l, dim),
                    i.clone(),
                ),
            });
        }
        // A tensor of no dimensions holds one element.
        lin.unwrap_or(Expr::Lit(Literal::U32(0)))
    }

    fn expr(&mut self, e: &ir::Expr, guard: &Expr) -> Expr {
        let ty = Type::from(e.ty);
        match &e.kind {
            ExprKind::Const(c) => Expr::Lit(match (*c, e.ty) {
                (Const::Float(v), _) => Literal::F32(v as f32),
                (Const::Int(v), Ty::U32) => Literal::U32(v as u32),
                (Const::Int(v), _) => Literal::I32(v as i32),
                (Const::Bool(b), _) => Literal::Bool(b),
            }),
            ExprKind::Arg(a) => match self.placed.iter().find(|(p, _)| p == a) {
                Some(&(_, l)) => Expr::Name(Name::Local(l)),
                None => Expr::Name(Name::Arg(*a)),
            },
            ExprKind::Param(i) => {
                let slot = self.program.layout.scalar(*i);
                let p = &self.program.params[*i];
                let word = Expr::Param {
                    member: slot.member(),
                    ty: if p.ty == Ty::Bool {
                        Type::U32
                    } else {
                        p.ty.into()
                    },
                };
                if p.ty == Ty::Bool {
                    binary(BinaryOp::Ne, Type::U32, word, u32_lit(0))
                } else {
                    word
                }
            }
            ExprKind::Local(l) => {
                let name = self.names.iter().rev().find(|(from, _)| from == l);
                Expr::Name(Name::Local(name.map_or(*l, |(_, to)| *to)))
            }
            _ if self.is_closed(e) => literal(self.fold(e)),
            ExprKind::Unary(op, a) => {
                let op = match op {
                    UnOp::Neg => super::ast::UnaryOp::Neg,
                    UnOp::Not => super::ast::UnaryOp::Not,
                };
                Expr::Unary(op, ty, Box::new(self.expr(a, guard)))
            }
            ExprKind::Binary(op @ (ir::BinOp::And | ir::BinOp::Or), a, b)
                if has_checked_read(b) =>
            {
                // The right operand is evaluated when the left does not
                // decide the value.
                let x = self.expr(a, guard);
                let x = self.bind(x);
                let when = if *op == ir::BinOp::And {
                    x.clone()
                } else {
                    not(x.clone())
                };
                let y = self.expr(b, &and(guard.clone(), when));
                binary(*op, Type::Bool, x, y)
            }
            ExprKind::Binary(op, a, b) => {
                let operands = a.ty.into();
                let (x, y) = (self.expr(a, guard), self.expr(b, guard));
                Expr::Binary(*op, operands, Box::new(x), Box::new(y))
            }
            ExprKind::Call(f, args) => {
                let arg_ty = args[0].ty;
                let mut a: Vec<Expr> = args.iter().map(|x| self.expr(x, guard)).collect();
                let t = Type::from(arg_ty);
                let f = match f {
                    Builtin::Exp => Func::Exp,
                    Builtin::Exp2 => Func::Exp2,
                    Builtin::Log => Func::Log,
                    Builtin::Log2 => Func::Log2,
                    Builtin::Sqrt => Func::Sqrt,
                    Builtin::Floor => Func::Floor,
                    Builtin::Ceil => Func::Ceil,
                    Builtin::Tanh => Func::Tanh,
                    Builtin::Sigmoid => Func::Sigmoid,
                    Builtin::Sin => Func::Sin,
                    Builtin::Cos => Func::Cos,
                    Builtin::Tan => Func::Tan,
                    Builtin::Abs if arg_ty == Ty::U32 => return a.remove(0),
                    Builtin::Abs => Func::Abs,
                    Builtin::Min => Func::Min,
                    Builtin::Max => Func::Max,
                    Builtin::Clamp => {
                        let hi = a.pop().expect("clamp takes three arguments");
                        return call(Func::Min, t, vec![call(Func::Max, t, a), hi]);
                    }
                    Builtin::SatAdd => Func::SatAdd,
                    Builtin::SatSub => Func::SatSub,
                    Builtin::SatMul => Func::SatMul,
                };
                call(f, t, a)
            }
            ExprKind::Cast(a) => {
                let value = self.expr(a, guard);
                if a.ty == e.ty {
                    return value;
                }
                Expr::Cast {
                    to: ty,
                    from: a.ty.into(),
                    value: Box::new(value),
                }
            }
            ExprKind::Select(c, t, f) if has_checked_read(t) || has_checked_read(f) => {
                let c = self.expr(c, guard);
                let c = self.bind(c);
                let t = self.expr(t, &and(guard.clone(), c.clone()));
                let f = self.expr(f, &and(guard.clone(), not(c.clone())));
                Expr::Select(Box::new(c), Box::new(t), Box::new(f))
            }
            ExprKind::Select(c, t, f) => {
                let (c, t, f) = (
                    self.expr(c, guard),
                    self.expr(t, guard),
                    self.expr(f, guard),
                );
                Expr::Select(Box::new(c), Box::new(t), Box::new(f))
            }
            ExprKind::Let(l, v, body) => {
                let value = self.expr(v, guard);
                let name = if self.bound.contains(l) {
                    self.next_local += 1;
                    Local(self.next_local - 1)
                } else {
                    *l
                };
                self.bound.insert(name);
                self.stmts.push(Stmt::Let(name, v.ty.into(), value));
                if self.is_closed(v) {
                    self.closed_locals.push((*l, (**v).clone()));
                }
                self.names.push((*l, name));
                let body = self.expr(body, guard);
                self.names.pop();
                body
            }
            ExprKind::Read(r) => self.read(r, e.ty, guard),
            ExprKind::ReadRange(r) => self.read_range(r, guard),
            ExprKind::Dim(t, axis) => Expr::Cast {
                to: Type::I32,
                from: Type::U32,
                value: Box::new(self.dim(*t, *axis)),
            },
        }
    }

    /// The bits of an arena word as an element of type `ty`.
    fn element(word: Expr, ty: Ty) -> Expr {
        match ty {
            Ty::U32 => word,
            other => Expr::Bits(other.into(), Box::new(word)),
        }
    }

    fn read(&mut self, r: &ir::Read, ty: Ty, guard: &Expr) -> Expr {
        let slot = self.program.layout.tensor(r.tensor);
        let indices: Vec<(Expr, Ty)> = r
            .indices
            .iter()
            .map(|i| (self.expr(i, guard), i.ty))
            .collect();
        let bits: Vec<Expr> = indices.iter().map(|(i, t)| as_u32(i.clone(), *t)).collect();
        // Every checked bound: an `i32` below 0 is a huge `u32`, so one
        // unsigned comparison checks both sides.
        let mut ok = Expr::Lit(Literal::Bool(true));
        for (axis, check) in r.checks.iter().enumerate() {
            let (index, index_ty) = &indices[axis];
            let cond = match (check.lower, check.upper) {
                (false, false) => continue,
                (true, false) if *index_ty == Ty::I32 => binary(
                    BinaryOp::Ge,
                    Type::I32,
                    index.clone(),
                    Expr::Lit(Literal::I32(0)),
                ),
                (true, false) => continue,
                _ => binary(
                    BinaryOp::Lt,
                    Type::U32,
                    bits[axis].clone(),
                    self.dim(r.tensor, axis),
                ),
            };
            ok = and(ok, cond);
        }
        let word = binary(
            BinaryOp::Add,
            Type::U32,
            self.word(slot.offset_member()),
            self.linear(r.tensor, &bits, None),
        );
        if matches!(ok, Expr::Lit(Literal::Bool(true))) {
            return Self::element(Expr::Capture(Box::new(word)), ty);
        }
        Self::element(
            Expr::CheckedCapture {
                word: Box::new(word),
                ok: Box::new(ok),
                report: Box::new(guard.clone()),
                site: r.site,
                indices: bits,
            },
            ty,
        )
    }

    fn read_range(&mut self, r: &ir::ReadRange, guard: &Expr) -> Expr {
        let slot = self.program.layout.tensor(r.tensor);
        let unbounded = Expr::Lit(Literal::I32(if r.max { i32::MAX } else { i32::MIN }));
        let idx: Vec<Expr> = r.indices.iter().map(|i| self.expr(i, guard)).collect();
        let bits: Vec<Expr> = idx
            .iter()
            .zip(&r.indices)
            .map(|(i, e)| as_u32(i.clone(), e.ty))
            .collect();
        let inside = |lowering: &Self, axis: usize| {
            binary(
                BinaryOp::Lt,
                Type::U32,
                bits[axis].clone(),
                lowering.dim(r.tensor, axis),
            )
        };
        let mut ok = Expr::Lit(Literal::Bool(true));
        for axis in (0..idx.len()).filter(|&a| Some(a) != r.axis) {
            ok = and(ok, inside(self, axis));
        }
        let Some(axis) = r.axis else {
            let word = binary(
                BinaryOp::Add,
                Type::U32,
                self.word(slot.offset_member()),
                self.linear(r.tensor, &bits, None),
            );
            let ok = self.bind(ok);
            let value = Self::element(
                Expr::CheckedCapture {
                    word: Box::new(word),
                    ok: Box::new(ok.clone()),
                    report: Box::new(Expr::Lit(Literal::Bool(false))),
                    site: 0,
                    indices: bits,
                },
                Ty::I32,
            );
            return Expr::Select(Box::new(ok), Box::new(value), Box::new(unbounded));
        };
        let lo = idx[axis].clone();
        let hi = self.expr(&r.hi, guard);
        let hi_bits = as_u32(hi.clone(), r.hi.ty);
        let g = u32_lit(SUMMARY_BLOCK as u32);
        let block = |x: Expr| binary(BinaryOp::Div, Type::U32, x, g.clone());
        let (first_block, last_block) = (block(bits[axis].clone()), block(hi_bits.clone()));
        let count = binary(
            BinaryOp::Add,
            Type::U32,
            binary(
                BinaryOp::Sub,
                Type::U32,
                last_block.clone(),
                first_block.clone(),
            ),
            u32_lit(1),
        );
        ok = and(
            ok,
            binary(
                BinaryOp::Ge,
                Type::I32,
                lo.clone(),
                Expr::Lit(Literal::I32(0)),
            ),
        );
        ok = and(ok, binary(BinaryOp::Le, Type::I32, lo, hi));
        ok = and(
            ok,
            binary(BinaryOp::Lt, Type::U32, hi_bits, self.dim(r.tensor, axis)),
        );
        let ok = self.bind(ok);
        let ok = self.bind(and(
            ok,
            binary(
                BinaryOp::Le,
                Type::U32,
                count.clone(),
                u32_lit(SUMMARY_MAX_BLOCKS as u32),
            ),
        ));
        // The summary is laid out as the tensor with dimension `axis`
        // replaced by its number of blocks: the least entries, then the
        // greatest.
        let blocks = block(binary(
            BinaryOp::Add,
            Type::U32,
            self.dim(r.tensor, axis),
            u32_lit(SUMMARY_BLOCK as u32 - 1),
        ));
        let mut at = bits.clone();
        at[axis] = first_block;
        let mut first = binary(
            BinaryOp::Add,
            Type::U32,
            self.word(slot.summary_member(axis)),
            self.linear(r.tensor, &at, Some((axis, blocks.clone()))),
        );
        if r.max {
            let mut whole = blocks;
            for a in (0..idx.len()).filter(|&a| a != axis) {
                whole = binary(BinaryOp::Mul, Type::U32, whole, self.dim(r.tensor, a));
            }
            first = binary(BinaryOp::Add, Type::U32, first, whole);
        }
        let mut stride = u32_lit(1);
        for a in axis + 1..idx.len() {
            stride = binary(BinaryOp::Mul, Type::U32, stride, self.dim(r.tensor, a));
        }
        Expr::Summary {
            first: Box::new(first),
            stride: Box::new(stride),
            // Nothing is read where the range is not in the tensor.
            count: Box::new(Expr::Select(
                Box::new(ok),
                Box::new(count),
                Box::new(u32_lit(0)),
            )),
            max: r.max,
        }
    }
}
