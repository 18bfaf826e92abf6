use boostr_runtime::attention;

#[attention(
    mask = |_b, _h, q, kv| kv <= q,
    mask = |_b, _h, q, kv| kv >= q,
)]
#[derive(Clone, Debug)]
struct DuplicateKey;

fn main() {}
