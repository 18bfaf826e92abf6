use boostr_runtime::attention;

#[attention(mask = |_b, _h, _q, _kv| {})]
#[derive(Clone, Debug)]
struct EmptyBlock;

fn main() {}
