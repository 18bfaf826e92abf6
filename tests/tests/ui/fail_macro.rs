use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| dbg!(s))]
#[derive(Clone, Debug)]
struct MacroCall;

fn main() {}
