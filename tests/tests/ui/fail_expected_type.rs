use boostr_runtime::attention;

#[attention(score = |_s, _b, _h, q, kv| q - kv)]
#[derive(Clone, Debug)]
struct ExpectedType;

fn main() {}
