use boostr_runtime::attention;

#[attention(sink = |_b, _h, _q, _kv| 0.5)]
#[derive(Clone, Debug)]
struct SinkArity;

fn main() {}
