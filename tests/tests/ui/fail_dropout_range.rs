use boostr_runtime::attention;

#[attention(mask = |_b, _h, q, kv| kv <= q, dropout = 1.0)]
#[derive(Clone, Debug)]
struct DropEverything;

fn main() {}
