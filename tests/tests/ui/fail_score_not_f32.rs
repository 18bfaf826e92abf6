use boostr_runtime::attention;

#[attention(score = |_s, _b, _h, q, kv| kv < q)]
#[derive(Clone, Debug)]
struct ScoreNotF32;

fn main() {}
