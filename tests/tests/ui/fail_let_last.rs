use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| { let t = s * 2.0; })]
#[derive(Clone, Debug)]
struct LetLast;

fn main() {}
