use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| s)]
#[derive(Clone, Debug)]
struct TupleStruct(f32);

fn main() {}
