use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| s * x)]
#[derive(Clone, Debug)]
struct UnknownName;

fn main() {}
