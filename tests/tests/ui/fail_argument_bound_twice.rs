use boostr_runtime::attention;

#[attention(mask = |_b, _h, q, q| q > 0)]
#[derive(Clone, Debug)]
struct BoundTwice;

fn main() {}
