use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| s.exp())]
#[derive(Clone, Debug)]
struct MethodCall;

fn main() {}
