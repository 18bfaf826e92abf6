use boostr_runtime::attention;

#[attention(score = |s, _b, _h, q, _kv| s + q)]
#[derive(Clone, Debug)]
struct OperandTypes;

fn main() {}
