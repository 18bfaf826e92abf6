use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| { s * 2.0; s })]
#[derive(Clone, Debug)]
struct StatementBeforeTail;

fn main() {}
