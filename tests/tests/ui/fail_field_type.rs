use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| s)]
#[derive(Clone, Debug)]
struct FieldType {
    cap: f32,
    v: Vec<f32>,
}

fn main() {}
