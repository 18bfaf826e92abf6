use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| if s > 0.0 { s })]
#[derive(Clone, Debug)]
struct IfWithoutElse;

fn main() {}
