use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| cap * tanh(s / self.cap))]
#[derive(Clone, Debug)]
struct FieldWithoutSelf {
    cap: f32,
}

fn main() {}
