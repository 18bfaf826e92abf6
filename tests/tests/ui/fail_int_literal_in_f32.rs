use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| s + 1)]
#[derive(Clone, Debug)]
struct IntLiteral;

fn main() {}
