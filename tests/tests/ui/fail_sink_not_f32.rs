use boostr_runtime::attention;

#[attention(sink = |_b, h, _q| h > 0)]
#[derive(Clone, Debug)]
struct SinkNotF32;

fn main() {}
