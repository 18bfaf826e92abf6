use boostr_runtime::attention;

#[attention(mask = |_b, _h, q, kv| (kv - q) as bool)]
#[derive(Clone, Debug)]
struct UnsupportedCast;

fn main() {}
