use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| s * self.scale, tests = TestsNotArray { scale: 0.5 })]
#[derive(Clone, Debug)]
struct TestsNotArray {
    scale: f32,
}

fn main() {}
