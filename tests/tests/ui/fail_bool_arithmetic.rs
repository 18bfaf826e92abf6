use boostr_runtime::attention;

#[attention(mask = |_b, _h, q, kv| self.causal * (kv <= q))]
#[derive(Clone, Debug)]
struct BoolArithmetic {
    causal: bool,
}

fn main() {}
