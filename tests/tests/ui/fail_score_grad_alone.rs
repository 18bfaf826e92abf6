use boostr_runtime::attention;

#[attention(score_grad = |_s, _b, _h, _q, _kv| 1.0, mask = |_b, _h, q, kv| kv <= q)]
#[derive(Clone, Debug)]
struct Alone;

fn main() {}
