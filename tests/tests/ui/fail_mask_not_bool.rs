use boostr_runtime::attention;

#[attention(mask = |_b, _h, q, kv| q - kv)]
#[derive(Clone, Debug)]
struct MaskNotBool;

fn main() {}
