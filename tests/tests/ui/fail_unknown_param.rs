use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| s * self.nope)]
#[derive(Clone, Debug)]
struct UnknownParam {
    cap: f32,
}

fn main() {}
