use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| foo(s))]
#[derive(Clone, Debug)]
struct UnknownFunction;

fn main() {}
