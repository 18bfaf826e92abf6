use boostr_runtime::attention;

#[attention(mask = |_b, _h, q, kv| kv - q < 4i64)]
#[derive(Clone, Debug)]
struct LiteralSuffix;

fn main() {}
