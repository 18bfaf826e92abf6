//! The analyses against brute force: the tile classifier against the mask it
//! was derived from, the symbolic derivative against finite differences.

use kernels_spec::eval::{Value, call};
use kernels_spec::ir::{ExprKind, Program, TileClass};
use kernels_spec::{compile_str, print};

fn program(source: &str) -> Program {
    match compile_str(source) {
        Ok(c) => c.program,
        Err(d) => panic!("{source} failed to compile: {:?}", d.messages()),
    }
}

/// The class of a tile by evaluating the mask on every pair.
fn brute_class(
    p: &Program,
    params: &[Value],
    b: i32,
    h: i32,
    q: (i32, i32),
    kv: (i32, i32),
) -> i32 {
    let (mut any, mut all) = (false, true);
    for qi in q.0..=q.1 {
        for ki in kv.0..=kv.1 {
            let args = [Value::I32(b), Value::I32(h), Value::I32(qi), Value::I32(ki)];
            let visible = call(&p.mask, &args, params).bool();
            any |= visible;
            all &= visible;
        }
    }
    match (any, all) {
        (false, _) => TileClass::Empty.code(),
        (true, true) => TileClass::Full.code(),
        _ => TileClass::Partial.code(),
    }
}

fn classify(p: &Program, params: &[Value], b: i32, h: i32, q: (i32, i32), kv: (i32, i32)) -> i32 {
    let args = [b, h, q.0, q.1, kv.0, kv.1].map(Value::I32);
    call(&p.classify, &args, params).i32()
}

/// Every tile of a grid with tile sizes `tq × tk`, query positions offset by
/// `q_offset` (bottom-right alignment with Sq != Sk).
fn tiles(tq: i32, tk: i32, q_offset: i32) -> Vec<((i32, i32), (i32, i32))> {
    let mut out = Vec::new();
    for qt in 0..8 {
        for kt in 0..8 {
            let q0 = qt * tq + q_offset;
            let k0 = kt * tk;
            out.push(((q0, q0 + tq - 1), (k0, k0 + tk - 1)));
        }
    }
    out
}

/// The classifier never lies; with `exact`, it also never says `PARTIAL`
/// for a tile that is empty or full.
fn check_classifier(source: &str, params: &[Value], exact: bool) -> usize {
    let p = program(source);
    let mut partial = 0;
    for (tq, tk) in [(1, 1), (4, 4), (8, 16), (16, 8), (5, 7)] {
        for q_offset in [0, 13, -9] {
            for (q, kv) in tiles(tq, tk, q_offset) {
                for (b, h) in [(0, 0), (1, 3)] {
                    let want = brute_class(&p, params, b, h, q, kv);
                    let got = classify(&p, params, b, h, q, kv);
                    let sound = got == want || got == TileClass::Partial.code();
                    assert!(
                        sound,
                        "{source} {params:?}: tile q {q:?} kv {kv:?} is {want}, classifier says {got}\n{}",
                        print::function(&p, &p.classify)
                    );
                    if exact {
                        assert_eq!(
                            got,
                            want,
                            "{source} {params:?}: tile q {q:?} kv {kv:?} not exact\n{}",
                            print::function(&p, &p.classify)
                        );
                    }
                    partial += usize::from(want == TileClass::Partial.code());
                }
            }
        }
    }
    partial
}

/// An exact classifier on a mask whose boundary the grid crosses.
fn check_exact(source: &str, params: &[Value]) {
    let partial = check_classifier(source, params, true);
    assert!(
        partial > 0,
        "{source} {params:?}: the grid never crosses the mask's boundary"
    );
}

#[test]
fn causal_is_exact() {
    check_exact("#[attention(mask = |b, h, q, kv| kv <= q)] struct C;", &[]);
}

#[test]
fn sliding_windows_are_exact() {
    for w in [1, 3, 8, 100] {
        check_exact(
            "#[attention(mask = |b, h, q, kv| kv <= q && q - kv < self.w)] struct W { w: i32 }",
            &[Value::I32(w)],
        );
        check_exact(
            "#[attention(mask = |b, h, q, kv| q - kv < self.w && kv - q < self.w)] struct W { w: i32 }",
            &[Value::I32(w)],
        );
    }
}

#[test]
fn prefix_lm_is_exact() {
    for prefix in [0, 5, 16, 40] {
        check_exact(
            "#[attention(mask = |b, h, q, kv| kv < self.p || kv <= q)] struct P { p: i32 }",
            &[Value::I32(prefix)],
        );
    }
}

#[test]
fn block_diagonal_is_exact() {
    for c in [1, 4, 6, 32] {
        check_exact(
            "#[attention(mask = |b, h, q, kv| q / self.c == kv / self.c)] struct D { c: i32 }",
            &[Value::I32(c)],
        );
    }
}

#[test]
fn flash_mask_is_exact() {
    let source = "#[attention(mask = |b, h, q, kv| (!self.causal || kv <= q) && (self.window <= 0 || q - kv < self.window))] \
                  struct F { causal: bool, window: i32 }";
    for causal in [false, true] {
        for window in [0, 1, 9] {
            // causal = false, window = 0 hides nothing: no boundary to cross.
            if causal || window > 0 {
                check_exact(source, &[Value::Bool(causal), Value::I32(window)]);
            } else {
                check_classifier(source, &[Value::Bool(causal), Value::I32(window)], true);
            }
        }
    }
}

#[test]
fn masks_the_analysis_cannot_bound_stay_sound() {
    // Float arithmetic is not tracked: every tile that is not provably empty
    // or full is partial, and nothing is ever misclassified.
    let float_mask = "#[attention(mask = |b, h, q, kv| (q as f32) * 0.5 >= kv as f32)] struct F;";
    check_classifier(float_mask, &[], false);
    let p = program(float_mask);
    // This tile is entirely visible, but the analysis cannot prove it.
    assert_eq!(
        brute_class(&p, &[], 0, 0, (100, 103), (0, 3)),
        TileClass::Full.code()
    );
    assert_eq!(
        classify(&p, &[], 0, 0, (100, 103), (0, 3)),
        TileClass::Partial.code()
    );

    // A checkerboard is partial on every tile larger than one pair.
    check_classifier(
        "#[attention(mask = |b, h, q, kv| (q + kv) % 2 == 0)] struct X;",
        &[],
        false,
    );
    // Head- and batch-dependent masks, products, min/max/abs/clamp, u32
    // parameters and `if` all stay sound.
    check_classifier(
        "#[attention(mask = |b, h, q, kv| if h % 2 == 0 { kv <= q } else { abs(q - kv) * 2 < self.w + b })] struct H { w: i32 }",
        &[Value::I32(9)],
        false,
    );
    check_classifier(
        "#[attention(mask = |b, h, q, kv| { let d = clamp(q - kv, -3, self.w); max(d, 0) * min(kv, 4) <= 12 })] struct M { w: i32 }",
        &[Value::I32(5)],
        false,
    );
    check_classifier(
        "#[attention(mask = |b, h, q, kv| (kv as u32) < self.n && (kv + 1) * self.k > q)] struct U { n: u32, k: i32 }",
        &[Value::U32(20), Value::I32(3)],
        false,
    );
}

#[test]
fn overflowing_parameters_stay_sound() {
    // q * k overflows i32 for these values: the concrete mask wraps, and the
    // classifier must not claim anything it cannot prove.
    let source =
        "#[attention(mask = |b, h, q, kv| q * self.k + kv > self.t)] struct O { k: i32, t: i32 }";
    for (k, t) in [
        (i32::MAX / 3, 0),
        (1 << 28, -5),
        (-(1 << 29), 100),
        (7, i32::MAX - 3),
    ] {
        check_classifier(source, &[Value::I32(k), Value::I32(t)], false);
    }
}

#[test]
fn no_mask_means_every_tile_is_full() {
    let p = program("#[attention(score = |s, b, h, q, kv| s * 2.0)] struct S;");
    assert!(!p.has_mask);
    assert_eq!(
        p.classify.body.as_const(),
        Some(kernels_spec::ir::Const::Int(TileClass::Full.code().into()))
    );
}

/// d score / d s by central differences in f32 against the symbolic derivative.
fn check_derivative(source: &str, params: &[Value]) {
    let p = program(source);
    for (i, s) in [-7.5f32, -2.3, -0.3, 0.1, 0.7, 1.9, 4.2, 11.0]
        .into_iter()
        .enumerate()
    {
        let (b, h, q, kv) = (1, i as i32 % 3, 9 + i as i32, 4);
        let at = |s: f32| {
            let args = [
                Value::F32(s),
                Value::I32(b),
                Value::I32(h),
                Value::I32(q),
                Value::I32(kv),
            ];
            call(&p.score, &args, params).f32() as f64
        };
        let eps = 1e-2f32;
        let fd = (at(s + eps) - at(s - eps)) / (2.0 * eps as f64);
        let args = [
            Value::F32(s),
            Value::I32(b),
            Value::I32(h),
            Value::I32(q),
            Value::I32(kv),
        ];
        let got = call(&p.score_grad, &args, params).f32() as f64;
        let tol = 2e-3 * (1.0 + fd.abs());
        assert!(
            (got - fd).abs() <= tol,
            "{source}: at s = {s}, d/ds = {got}, finite differences {fd}\n{}",
            print::function(&p, &p.score_grad)
        );
    }
}

#[test]
fn derivatives_match_finite_differences() {
    let cases: &[(&str, &[Value])] = &[
        (
            "#[attention(score = |s, b, h, q, kv| self.cap * tanh(s / self.cap))] struct A { cap: f32 }",
            &[Value::F32(3.0)],
        ),
        (
            "#[attention(score = |s, b, h, q, kv| s * s * 0.5 - exp(s * 0.25))] struct A;",
            &[],
        ),
        (
            "#[attention(score = |s, b, h, q, kv| log(1.0 + s * s) + sqrt(s * s + 1.0))] struct A;",
            &[],
        ),
        (
            "#[attention(score = |s, b, h, q, kv| sigmoid(s) * exp2(s / 4.0) + log2(2.0 + abs(s)))] struct A;",
            &[],
        ),
        (
            "#[attention(score = |s, b, h, q, kv| { let t = s * 0.5 + (h as f32); let u = t * t; u / (1.0 + u) })] struct A;",
            &[],
        ),
        (
            "#[attention(score = |s, b, h, q, kv| if s > 1.0 { s * 3.0 } else { -s })] struct A;",
            &[],
        ),
        (
            "#[attention(score = |s, b, h, q, kv| min(s, 2.5) + max(s * 0.5, -1.0) + clamp(s, -1.0, self.hi))] struct A { hi: f32 }",
            &[Value::F32(3.0)],
        ),
        (
            "#[attention(score = |s, b, h, q, kv| s / (1.0 + floor(s * 0.1) * 0.0) + ceil(0.5) - (q - kv) as f32)] struct A;",
            &[],
        ),
        (
            "#[attention(score = |s, b, h, q, kv| (s * s) % 5.0)] struct A;",
            &[],
        ),
        (
            "#[attention(score = |s, b, h, q, kv| 2.0 / (1.0 + exp(-s)))] struct A;",
            &[],
        ),
    ];
    for (source, params) in cases {
        check_derivative(source, params);
    }
}

#[test]
fn derivatives_simplify() {
    let identity = program("#[attention(mask = |b, h, q, kv| kv <= q)] struct A;");
    assert!(identity.score_is_identity);
    assert!(identity.score_grad.body.is_float(1.0));

    let written_identity = program("#[attention(score = |s, b, h, q, kv| s)] struct A;");
    assert!(written_identity.score_is_identity);

    // Constants fold: d(2s + bias)/ds = 2.
    let linear =
        program("#[attention(score = |s, b, h, q, kv| s * 2.0 + (kv - q) as f32 * 0.5)] struct A;");
    assert!(!linear.score_is_identity);
    assert!(
        linear.score_grad.body.is_float(2.0),
        "{:?}",
        linear.score_grad.body
    );

    // ALiBi: a bias that does not depend on s has derivative 1.
    let alibi = program(
        "#[attention(score = |s, b, h, q, kv| s - exp2(-8.0 * ((h + 1) as f32) / (self.n as f32)) * ((q - kv) as f32))] struct A { n: i32 }",
    );
    assert!(alibi.score_grad.body.is_float(1.0));

    // Softcap: tanh is computed once and reused.
    let softcap = program(
        "#[attention(score = |s, b, h, q, kv| self.cap * tanh(s / self.cap))] struct A { cap: f32 }",
    );
    let mut tanh_calls = 0;
    softcap.score_grad.body.walk(&mut |e| {
        tanh_calls += usize::from(matches!(
            e.kind,
            ExprKind::Call(kernels_spec::ir::Builtin::Tanh, _)
        ))
    });
    assert_eq!(
        tanh_calls,
        1,
        "{}",
        print::function(&softcap, &softcap.score_grad)
    );
}

// ---- masks over captured tensors ----

/// A small deterministic generator (SplitMix64) for the data tests.
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> i32 {
        (self.next() % n) as i32
    }
}

use kernels_spec::eval::{TensorValue, call_with};

/// `[batch, len]` document ids: sorted runs of random lengths, or shuffled.
fn documents(draw: &mut Draw, batch: usize, len: usize, sorted: bool) -> TensorValue {
    let mut data = Vec::with_capacity(batch * len);
    for _ in 0..batch {
        let mut row = Vec::with_capacity(len);
        let mut doc = 0;
        while row.len() < len {
            let run = 1 + draw.below(12) as usize;
            row.extend(std::iter::repeat_n(doc, run.min(len - row.len())));
            doc += 1;
        }
        if !sorted {
            for i in (1..len).rev() {
                row.swap(i, draw.below(i as u64 + 1) as usize);
            }
        }
        data.extend(row.into_iter().map(Value::I32));
    }
    TensorValue {
        dims: vec![batch, len],
        data,
    }
}

/// The classifier against brute force on every tile of several grids,
/// batches 0 and 1; returns how many tiles were partial by brute force.
fn check_data_classifier(p: &Program, tensors: &[TensorValue], sk: i32, exact: bool) -> usize {
    let mut partial = 0;
    for (tq, tk) in [(1, 1), (4, 4), (8, 16), (16, 8), (5, 7)] {
        for (q, kv) in tiles(tq, tk, 0) {
            if q.1 >= sk || kv.1 >= sk {
                continue;
            }
            for b in [0, 1] {
                let (mut any, mut all) = (false, true);
                for qi in q.0..=q.1 {
                    for ki in kv.0..=kv.1 {
                        let args = [b, 0, qi, ki].map(Value::I32);
                        let (visible, oob) = call_with(&p.mask, &args, &[], tensors);
                        assert_eq!(oob, None, "brute force read out of range at q {qi} kv {ki}");
                        any |= visible.bool();
                        all &= visible.bool();
                    }
                }
                let want = match (any, all) {
                    (false, _) => TileClass::Empty.code(),
                    (true, true) => TileClass::Full.code(),
                    _ => TileClass::Partial.code(),
                };
                let args = [b, 0, q.0, q.1, kv.0, kv.1].map(Value::I32);
                let got = call_with(&p.classify, &args, &[], tensors).0.i32();
                assert!(
                    got == want || got == TileClass::Partial.code(),
                    "tile q {q:?} kv {kv:?} b {b} is {want}, classifier says {got}\n{}",
                    print::function(p, &p.classify)
                );
                if exact {
                    assert_eq!(got, want, "tile q {q:?} kv {kv:?} b {b} not exact");
                }
                partial += usize::from(want == TileClass::Partial.code());
            }
        }
    }
    partial
}

#[test]
fn sorted_documents_classify_exactly() {
    let sk = 64;
    for source in [
        "#[attention(mask = |b, h, q, kv| self.doc[b][q] == self.doc[b][kv])] \
         struct D<R: Runtime> { #[tensor(i32, [B, Sk])] doc: Tensor<R> }",
        "#[attention(mask = |b, h, q, kv| self.doc[b][q] == self.doc[b][kv] && kv <= q)] \
         struct D<R: Runtime> { #[tensor(i32, [B, Sk])] doc: Tensor<R> }",
    ] {
        let p = program(source);
        let mut draw = Draw(7);
        for _ in 0..20 {
            let doc = documents(&mut draw, 2, sk as usize, true);
            let partial = check_data_classifier(&p, &[doc], sk, true);
            assert!(partial > 0, "{source}: no tile crosses a document boundary");
        }
    }
}

#[test]
fn unsorted_documents_stay_sound() {
    let p = program(
        "#[attention(mask = |b, h, q, kv| self.doc[b][q] == self.doc[b][kv] && kv <= q)] \
         struct D<R: Runtime> { #[tensor(i32, [B, Sk])] doc: Tensor<R> }",
    );
    let mut draw = Draw(11);
    for _ in 0..20 {
        let doc = documents(&mut draw, 2, 64, false);
        check_data_classifier(&p, &[doc], 64, false);
    }
}

#[test]
fn sequence_lengths_classify_exactly() {
    let p = program(
        "#[attention(mask = |b, h, q, kv| kv < self.len[b] && kv <= q)] \
         struct L<R: Runtime> { #[tensor(i32, [B])] len: Tensor<R> }",
    );
    let mut draw = Draw(3);
    let mut partial = 0;
    for _ in 0..40 {
        // Lengths of 0 and of Sk included.
        let len = TensorValue {
            dims: vec![2],
            data: vec![Value::I32(draw.below(65)), Value::I32(draw.below(65))],
        };
        partial += check_data_classifier(&p, &[len], 64, true);
    }
    assert!(partial > 0);
}

#[test]
fn reads_the_analysis_cannot_bound_stay_sound() {
    // Two running indices, and a data-dependent index: no summary applies.
    let p = program(
        "#[attention(mask = |b, h, q, kv| self.t[q][kv] > 0 || self.doc[b][self.doc[b][kv]] == 3)] \
         struct X<R: Runtime> { #[tensor(i32, [Sk, Sk])] t: Tensor<R>, #[tensor(i32, [B, Sk])] doc: Tensor<R> }",
    );
    let mut draw = Draw(5);
    let sk = 16;
    for _ in 0..10 {
        let t = TensorValue {
            dims: vec![sk, sk],
            data: (0..sk * sk)
                .map(|_| Value::I32(draw.below(3) - 1))
                .collect(),
        };
        let doc = TensorValue {
            dims: vec![2, sk],
            data: (0..2 * sk)
                .map(|_| Value::I32(draw.below(sk as u64)))
                .collect(),
        };
        check_data_classifier(&p, &[t, doc], sk as i32, false);
    }
}

/// d score / d t[e] of every element of every tensor, by finite differences
/// of the element, against the sum over the read sites of `t` whose index
/// lands on `e` of their `read_grad`: what the backward accumulates.
#[test]
fn read_gradients_match_finite_differences() {
    use kernels_spec::analysis::{derivative::read_grad, reads::read_index};
    let p = program(
        "#[attention(score = |s, b, h, q, kv| { \
            let d = clamp(q - kv, -3, 3) + 3; \
            let w = self.w[h]; \
            s * w + tanh(self.bias[h][d]) * self.bias[h][0] - w * w * 0.5 \
         }, sink = |b, h, q| self.w[h] * 2.0 + self.bias[h][q % 7])] \
         struct V<R: Runtime> { #[tensor(f32, [Hq])] w: Tensor<R>, \
           #[tensor(f32, [Hq, 7])] bias: Tensor<R> }",
    );
    let mut draw = Draw(0x77);
    let mut tensors = vec![
        TensorValue {
            dims: vec![3],
            data: (0..3)
                .map(|_| Value::F32(draw.below(200) as f32 / 100.0 - 1.0))
                .collect(),
        },
        TensorValue {
            dims: vec![3, 7],
            data: (0..21)
                .map(|_| Value::F32(draw.below(200) as f32 / 100.0 - 1.0))
                .collect(),
        },
    ];
    let mut sites = Vec::new();
    for f in [&p.score, &p.sink] {
        kernels_spec::analysis::reads::read_sites(&f.body, &mut sites);
    }
    let mut checked = 0;
    for f in [&p.score, &p.sink] {
        let mut own = Vec::new();
        kernels_spec::analysis::reads::read_sites(&f.body, &mut own);
        for (b, h, q, kv, s) in [(0, 0, 5, 2, 0.3f32), (1, 2, 0, 6, -1.2), (0, 1, 9, 9, 2.5)] {
            let args: Vec<Value> = if f.name == "score" {
                vec![
                    Value::F32(s),
                    Value::I32(b),
                    Value::I32(h),
                    Value::I32(q),
                    Value::I32(kv),
                ]
            } else {
                vec![Value::I32(b), Value::I32(h), Value::I32(q)]
            };
            for (t, tensor_len) in [(0usize, 3usize), (1, 21)] {
                for e in 0..tensor_len {
                    let at = |tensors: &[TensorValue], x: f32| {
                        let mut ts = tensors.to_vec();
                        ts[t].data[e] = Value::F32(x);
                        call_with(f, &args, &[], &ts).0.f32() as f64
                    };
                    let x0 = tensors[t].data[e].f32();
                    let eps = 1e-2f32;
                    let fd = (at(&tensors, x0 + eps) - at(&tensors, x0 - eps)) / (2.0 * eps as f64);
                    let mut analytic = 0.0f64;
                    for site in own.iter().filter(|r| r.tensor == t) {
                        let index = read_index(f, site.site).expect("the site is in f");
                        let lands = call_with(&index, &args, &[], &tensors).0.i32();
                        if lands == e as i32 {
                            let g = read_grad(f, site.site);
                            analytic += call_with(&g, &args, &[], &tensors).0.f32() as f64;
                        }
                    }
                    assert!(
                        (analytic - fd).abs() <= 2e-3 * (1.0 + fd.abs()),
                        "{}: d/d t{t}[{e}] at {args:?}: {analytic}, finite differences {fd}",
                        f.name
                    );
                    checked += 1;
                }
            }
            tensors[0].data[0] = Value::F32(tensors[0].data[0].f32() + 0.1);
        }
    }
    assert_eq!(checked, 2 * 3 * 24);
    assert_eq!(
        sites.len(),
        5,
        "w and two bias reads in score, w and one bias read in sink"
    );
}

#[test]
fn a_read_index_is_minus_one_outside_the_tensor() {
    use kernels_spec::analysis::reads::read_index;
    let p = program(
        "#[attention(score = |s, b, h, q, kv| s + self.t[q - 2][h])] \
         struct V<R: Runtime> { #[tensor(f32, [_, 2])] t: Tensor<R> }",
    );
    let index = read_index(&p.score, 0).expect("site 0");
    let t = [TensorValue {
        dims: vec![4, 2],
        data: vec![Value::F32(0.0); 8],
    }];
    let at = |h: i32, q: i32| {
        let args = [
            Value::F32(0.0),
            Value::I32(0),
            Value::I32(h),
            Value::I32(q),
            Value::I32(0),
        ];
        call_with(&index, &args, &[], &t).0.i32()
    };
    assert_eq!(at(1, 2), 1);
    assert_eq!(at(0, 5), 6);
    assert_eq!(at(1, 5), 7);
    assert_eq!(at(0, 1), -1, "row -1");
    assert_eq!(at(0, 6), -1, "row 4 of 4");
    assert_eq!(at(2, 3), -1, "column 2 of 2");
    assert!(read_index(&p.score, 1).is_none());
}
