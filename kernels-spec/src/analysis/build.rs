//! Smart constructors over the IR: each builds one node and folds what it can
//! (constants, identities, dead branches), so the derivative and the tile
//! classifier come out in their simplest form without a separate rewrite
//! system. Float constants fold in f64; each target rounds once at emission.

use crate::ir::{Arg, BinOp, Builtin, Const, Expr, ExprKind, Local, Read, ReadRange, Ty, UnOp};

fn node(kind: ExprKind, ty: Ty) -> Expr {
    Expr { kind, ty }
}

/// An `i32`/`u32` constant of type `ty`.
pub fn int(v: i64, ty: Ty) -> Expr {
    node(ExprKind::Const(Const::Int(v)), ty)
}

fn int_value(e: &Expr) -> Option<i64> {
    match e.kind {
        ExprKind::Const(Const::Int(v)) => Some(v),
        _ => None,
    }
}

fn float_value(e: &Expr) -> Option<f64> {
    match e.kind {
        ExprKind::Const(Const::Float(v)) => Some(v),
        _ => None,
    }
}

fn bool_value(e: &Expr) -> Option<bool> {
    match e.kind {
        ExprKind::Const(Const::Bool(v)) => Some(v),
        _ => None,
    }
}

/// Wrap an integer result to its type, as every target does.
fn wrap(v: i128, ty: Ty) -> i64 {
    match ty {
        Ty::U32 => (v as u32).into(),
        _ => (v as i32).into(),
    }
}

/// Fold an integer operation with the IR's semantics (wrapping; x/0 = x%0 = 0).
fn fold_int(op: BinOp, a: i64, b: i64, ty: Ty) -> Option<Expr> {
    let (a, b) = (a as i128, b as i128);
    let v = match op {
        BinOp::Add => wrap(a + b, ty),
        BinOp::Sub => wrap(a - b, ty),
        BinOp::Mul => wrap(a * b, ty),
        BinOp::Div if b == 0 => 0,
        BinOp::Rem if b == 0 => 0,
        BinOp::Div => wrap(a / b, ty),
        BinOp::Rem => wrap(a % b, ty),
        BinOp::Eq => return Some(Expr::bool(a == b)),
        BinOp::Ne => return Some(Expr::bool(a != b)),
        BinOp::Lt => return Some(Expr::bool(a < b)),
        BinOp::Le => return Some(Expr::bool(a <= b)),
        BinOp::Gt => return Some(Expr::bool(a > b)),
        BinOp::Ge => return Some(Expr::bool(a >= b)),
        BinOp::And | BinOp::Or => return None,
    };
    Some(int(v, ty))
}

fn fold_float(op: BinOp, a: f64, b: f64) -> Option<Expr> {
    Some(match op {
        BinOp::Add => Expr::float(a + b),
        BinOp::Sub => Expr::float(a - b),
        BinOp::Mul => Expr::float(a * b),
        BinOp::Div => Expr::float(a / b),
        BinOp::Rem => Expr::float(a % b),
        BinOp::Eq => Expr::bool(a == b),
        BinOp::Ne => Expr::bool(a != b),
        BinOp::Lt => Expr::bool(a < b),
        BinOp::Le => Expr::bool(a <= b),
        BinOp::Gt => Expr::bool(a > b),
        BinOp::Ge => Expr::bool(a >= b),
        BinOp::And | BinOp::Or => return None,
    })
}

/// Whether `e` is the zero of its numeric type.
fn is_zero(e: &Expr) -> bool {
    e.is_float(0.0) || int_value(e) == Some(0)
}

fn is_one(e: &Expr) -> bool {
    e.is_float(1.0) || int_value(e) == Some(1)
}

fn zero(ty: Ty) -> Expr {
    if ty == Ty::F32 {
        Expr::float(0.0)
    } else {
        int(0, ty)
    }
}

/// `a op b`, folded.
pub fn binary(op: BinOp, a: Expr, b: Expr) -> Expr {
    debug_assert_eq!(a.ty, b.ty, "operands of {op:?} must share a type");
    if op.is_logical() {
        return logical(op, a, b);
    }
    if let (Some(x), Some(y)) = (int_value(&a), int_value(&b))
        && let Some(e) = fold_int(op, x, y, a.ty)
    {
        return e;
    }
    if let (Some(x), Some(y)) = (float_value(&a), float_value(&b))
        && let Some(e) = fold_float(op, x, y)
    {
        return e;
    }
    if let (Some(x), Some(y)) = (bool_value(&a), bool_value(&b)) {
        match op {
            BinOp::Eq => return Expr::bool(x == y),
            BinOp::Ne => return Expr::bool(x != y),
            _ => {}
        }
    }
    let ty = if op.is_comparison() { Ty::Bool } else { a.ty };
    match op {
        BinOp::Add if is_zero(&a) => return b,
        BinOp::Add | BinOp::Sub if is_zero(&b) => return a,
        BinOp::Sub if is_zero(&a) => return neg(b),
        BinOp::Mul if is_zero(&a) || is_zero(&b) => return zero(a.ty),
        // Symbolic zero: d/ds of a constant numerator (x / 0 is not folded).
        BinOp::Div if is_zero(&a) && a.ty == Ty::F32 => return zero(a.ty),
        BinOp::Mul if is_one(&a) => return b,
        BinOp::Mul | BinOp::Div if is_one(&b) => return a,
        BinOp::Sub if a == b && a.ty.is_int() => return zero(a.ty),
        BinOp::Le | BinOp::Ge | BinOp::Eq if a == b && a.ty.is_int() => return Expr::bool(true),
        BinOp::Lt | BinOp::Gt | BinOp::Ne if a == b && a.ty.is_int() => {
            return Expr::bool(false);
        }
        _ => {}
    }
    node(ExprKind::Binary(op, Box::new(a), Box::new(b)), ty)
}

fn logical(op: BinOp, a: Expr, b: Expr) -> Expr {
    let (absorbing, identity) = match op {
        BinOp::And => (false, true),
        _ => (true, false),
    };
    match (bool_value(&a), bool_value(&b)) {
        (Some(x), _) if x == absorbing => return Expr::bool(absorbing),
        (_, Some(y)) if y == absorbing => return Expr::bool(absorbing),
        (Some(x), _) if x == identity => return b,
        (_, Some(y)) if y == identity => return a,
        _ => {}
    }
    if a == b {
        return a;
    }
    node(ExprKind::Binary(op, Box::new(a), Box::new(b)), Ty::Bool)
}

/// `a + b`
pub fn add(a: Expr, b: Expr) -> Expr {
    binary(BinOp::Add, a, b)
}
/// `a - b`
pub fn sub(a: Expr, b: Expr) -> Expr {
    binary(BinOp::Sub, a, b)
}
/// `a * b`
pub fn mul(a: Expr, b: Expr) -> Expr {
    binary(BinOp::Mul, a, b)
}
/// `a / b`
pub fn div(a: Expr, b: Expr) -> Expr {
    binary(BinOp::Div, a, b)
}
/// `a && b`
pub fn and(a: Expr, b: Expr) -> Expr {
    binary(BinOp::And, a, b)
}
/// `a || b`
pub fn or(a: Expr, b: Expr) -> Expr {
    binary(BinOp::Or, a, b)
}
/// `a < b`
pub fn lt(a: Expr, b: Expr) -> Expr {
    binary(BinOp::Lt, a, b)
}
/// `a <= b`
pub fn le(a: Expr, b: Expr) -> Expr {
    binary(BinOp::Le, a, b)
}
/// `a == b`
pub fn eq(a: Expr, b: Expr) -> Expr {
    binary(BinOp::Eq, a, b)
}
/// `a != b`
pub fn ne(a: Expr, b: Expr) -> Expr {
    binary(BinOp::Ne, a, b)
}

/// `-a`, folded.
pub fn neg(a: Expr) -> Expr {
    if let Some(x) = float_value(&a) {
        return Expr::float(-x);
    }
    if let Some(x) = int_value(&a) {
        return int(wrap(-(x as i128), a.ty), a.ty);
    }
    if let ExprKind::Unary(UnOp::Neg, inner) = a.kind {
        return *inner;
    }
    let ty = a.ty;
    node(ExprKind::Unary(UnOp::Neg, Box::new(a)), ty)
}

/// `!a`, folded; a negated comparison becomes the opposite comparison.
pub fn not(a: Expr) -> Expr {
    if let Some(x) = bool_value(&a) {
        return Expr::bool(!x);
    }
    match a.kind {
        ExprKind::Unary(UnOp::Not, inner) => *inner,
        // Integer comparisons have exact opposites (no NaN).
        ExprKind::Binary(op, l, r) if op.is_comparison() && l.ty.is_int() => {
            let flipped = match op {
                BinOp::Lt => BinOp::Ge,
                BinOp::Le => BinOp::Gt,
                BinOp::Gt => BinOp::Le,
                BinOp::Ge => BinOp::Lt,
                BinOp::Eq => BinOp::Ne,
                _ => BinOp::Eq,
            };
            binary(flipped, *l, *r)
        }
        kind => node(
            ExprKind::Unary(UnOp::Not, Box::new(Expr { kind, ty: Ty::Bool })),
            Ty::Bool,
        ),
    }
}

/// A call of `f`, folding `min`/`max` of equal or constant integer arguments.
pub fn call(f: Builtin, args: Vec<Expr>) -> Expr {
    let ty = args[0].ty;
    if matches!(f, Builtin::Min | Builtin::Max) {
        if args[0] == args[1] {
            return args.into_iter().next().expect("two arguments");
        }
        if let (Some(x), Some(y)) = (int_value(&args[0]), int_value(&args[1])) {
            let v = if f == Builtin::Min {
                x.min(y)
            } else {
                x.max(y)
            };
            return int(v, ty);
        }
    }
    if matches!(f, Builtin::SatAdd | Builtin::SatSub | Builtin::SatMul)
        && let (Some(x), Some(y)) = (int_value(&args[0]), int_value(&args[1]))
    {
        let (x, y) = (x as i32, y as i32);
        let v = match f {
            Builtin::SatAdd => x.saturating_add(y),
            Builtin::SatSub => x.saturating_sub(y),
            _ => x.saturating_mul(y),
        };
        return int(v.into(), ty);
    }
    node(ExprKind::Call(f, args), ty)
}

/// `if c { t } else { e }`, folded.
pub fn select(c: Expr, t: Expr, e: Expr) -> Expr {
    if let Some(x) = bool_value(&c) {
        return if x { t } else { e };
    }
    if t == e {
        return t;
    }
    if t.ty == Ty::Bool {
        // Boolean selects are logic: keep them small for the classifier.
        match (bool_value(&t), bool_value(&e)) {
            (Some(true), Some(false)) => return c,
            (Some(false), Some(true)) => return not(c),
            (Some(true), _) => return or(c, e),
            (Some(false), _) => return and(not(c), e),
            (_, Some(false)) => return and(c, t),
            (_, Some(true)) => return or(not(c), t),
            _ => {}
        }
    }
    let ty = t.ty;
    node(ExprKind::Select(Box::new(c), Box::new(t), Box::new(e)), ty)
}

/// A conversion of `a` to `ty` (no node when it already has that type).
pub fn cast(a: Expr, ty: Ty) -> Expr {
    if a.ty == ty {
        return a;
    }
    node(ExprKind::Cast(Box::new(a)), ty)
}

/// `let local = value; body`, dropped when `body` does not read `local` and
/// inlined when `value` is trivial (a constant, argument, parameter or local).
pub fn let_(local: Local, value: Expr, body: Expr) -> Expr {
    let uses = count_uses(&body, local);
    if uses == 0 {
        return body;
    }
    let trivial = matches!(
        value.kind,
        ExprKind::Const(_) | ExprKind::Arg(_) | ExprKind::Param(_) | ExprKind::Local(_)
    );
    // A value that reads a tensor stays where it is bound: moved into its one
    // use, under an `if` or `&&`, its read would happen less often, and an
    // index out of range would go unreported.
    if trivial || (uses == 1 && !value.reads_tensor()) {
        return substitute(body, local, &value);
    }
    let ty = body.ty;
    node(ExprKind::Let(local, Box::new(value), Box::new(body)), ty)
}

/// How many times `body` reads `local`.
pub fn count_uses(body: &Expr, local: Local) -> usize {
    let mut n = 0;
    body.walk(&mut |e| n += usize::from(e.kind == ExprKind::Local(local)));
    n
}

/// Replace every read of `local` in `body` by `value`, re-folding on the way up.
pub fn substitute(body: Expr, local: Local, value: &Expr) -> Expr {
    rebuild(body, &mut |e| match e.kind {
        ExprKind::Local(l) if l == local => Some(value.clone()),
        _ => None,
    })
}

/// Rebuild `e` bottom-up through the smart constructors; `leaf` may replace
/// leaves. This is also the simplifier: rebuilding folds everything foldable.
pub fn rebuild(e: Expr, leaf: &mut impl FnMut(&Expr) -> Option<Expr>) -> Expr {
    if let Some(replaced) = leaf(&e) {
        return replaced;
    }
    let ty = e.ty;
    match e.kind {
        ExprKind::Const(_)
        | ExprKind::Arg(_)
        | ExprKind::Param(_)
        | ExprKind::Local(_)
        | ExprKind::Dim(..) => e,
        ExprKind::Read(r) => node(
            ExprKind::Read(Read {
                indices: r.indices.into_iter().map(|i| rebuild(i, leaf)).collect(),
                ..r
            }),
            ty,
        ),
        ExprKind::ReadRange(r) => node(
            ExprKind::ReadRange(ReadRange {
                indices: r.indices.into_iter().map(|i| rebuild(i, leaf)).collect(),
                hi: Box::new(rebuild(*r.hi, leaf)),
                ..r
            }),
            ty,
        ),
        ExprKind::Unary(UnOp::Neg, a) => neg(rebuild(*a, leaf)),
        ExprKind::Unary(UnOp::Not, a) => not(rebuild(*a, leaf)),
        ExprKind::Binary(op, a, b) => binary(op, rebuild(*a, leaf), rebuild(*b, leaf)),
        ExprKind::Call(f, args) => call(f, args.into_iter().map(|a| rebuild(a, leaf)).collect()),
        ExprKind::Cast(a) => cast(rebuild(*a, leaf), ty),
        ExprKind::Select(c, t, f) => {
            select(rebuild(*c, leaf), rebuild(*t, leaf), rebuild(*f, leaf))
        }
        ExprKind::Let(l, v, b) => {
            let v = rebuild(*v, leaf);
            let b = rebuild(*b, leaf);
            let_(l, v, b)
        }
    }
}

/// Simplify an expression (constant folding, identities, dead lets).
pub fn simplify(e: Expr) -> Expr {
    rebuild(e, &mut |_| None)
}

/// An argument reference.
pub fn arg(a: Arg) -> Expr {
    Expr::arg(a)
}

/// The largest local number used in `e`, plus one (for fresh locals).
pub fn next_local(e: &Expr) -> u32 {
    let mut n = 0;
    e.walk(&mut |x| match x.kind {
        ExprKind::Local(Local(i)) | ExprKind::Let(Local(i), _, _) => n = n.max(i + 1),
        _ => {}
    });
    n
}
