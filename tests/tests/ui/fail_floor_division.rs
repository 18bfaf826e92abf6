use boostr_runtime::attention;

// Python's `//` is `div_floor(a, b)`: two numbers of one type.
#[attention(mask = |_b, _h, q, kv| div_floor(q, 3.0) == kv)]
#[derive(Clone, Debug)]
struct FloorMixed;

#[attention(mask = |_b, _h, q, kv| rem_floor(q - kv) == 0)]
#[derive(Clone, Debug)]
struct FloorArity;

// The constants are `f32::INFINITY` and `f32::NEG_INFINITY`.
#[attention(score = |s, _b, _h, _q, _kv| s + f32::MAX)]
#[derive(Clone, Debug)]
struct OtherConstant;

fn main() {}
