use boostr_runtime::attention;

#[attention(scor = |s, _b, _h, _q, _kv| s)]
#[derive(Clone, Debug)]
struct UnknownKey;

fn main() {}
