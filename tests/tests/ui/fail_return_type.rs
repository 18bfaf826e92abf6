use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| -> f32 { s })]
#[derive(Clone, Debug)]
struct ReturnType;

fn main() {}
