use boostr_runtime::attention;

#[attention(
    mask = |_b, _h, q, kv| kv <= q,
    sink = |_b, _h, _q| 0.5,
    normalize = sigmoid,
)]
#[derive(Clone, Debug)]
struct SigmoidSink;

fn main() {}
