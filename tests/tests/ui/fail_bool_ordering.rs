use boostr_runtime::attention;

#[attention(mask = |_b, _h, q, kv| (kv <= q) < self.causal)]
#[derive(Clone, Debug)]
struct BoolOrdering {
    causal: bool,
}

fn main() {}
