use boostr_runtime::attention;

#[attention(dropout = |_b, _h, _q, _kv| 0.1)]
#[derive(Clone, Debug)]
struct DropoutPerPair;

fn main() {}
