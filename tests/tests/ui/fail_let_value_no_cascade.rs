use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| { let t = foo(s); t * t })]
#[derive(Clone, Debug)]
struct LetValueNoCascade;

fn main() {}
