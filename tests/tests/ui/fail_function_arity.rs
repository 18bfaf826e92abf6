use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| min(s))]
#[derive(Clone, Debug)]
struct FunctionArity;

fn main() {}
