use boostr_runtime::attention;

#[attention(mask = |_b, _h, q, kv| kv - q < 3000000000)]
#[derive(Clone, Debug)]
struct LiteralOverflow;

fn main() {}
