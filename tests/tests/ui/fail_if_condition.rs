use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| if self.capped { tanh(s) } else { s })]
#[derive(Clone, Debug)]
struct IfCondition {
    capped: u32,
}

fn main() {}
