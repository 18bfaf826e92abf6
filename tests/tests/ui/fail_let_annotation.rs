use boostr_runtime::attention;

#[attention(score = |s, _b, _h, q, kv| { let d: f32 = q - kv; s - d })]
#[derive(Clone, Debug)]
struct LetAnnotation;

fn main() {}
