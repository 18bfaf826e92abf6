use boostr_runtime::attention;

#[attention(mask = |_b, _h, q, kv| match q { 0 => true, _ => kv <= q })]
#[derive(Clone, Debug)]
struct Match;

fn main() {}
