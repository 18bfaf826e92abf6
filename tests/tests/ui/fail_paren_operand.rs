use boostr_runtime::attention;

#[attention(score = |s, _b, _h, q, kv| s * (q - kv))]
#[derive(Clone, Debug)]
struct ParenOperand;

fn main() {}
