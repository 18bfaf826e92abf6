use boostr_runtime::attention;

#[attention(score = move |s, _b, _h, _q, _kv| s)]
#[derive(Clone, Debug)]
struct MoveClosure;

fn main() {}
