use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| { let mut t = s; t })]
#[derive(Clone, Debug)]
struct LetMut;

fn main() {}
