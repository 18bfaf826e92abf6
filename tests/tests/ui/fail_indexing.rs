use boostr_runtime::attention;

#[attention(score = |s, _b, _h, q, _kv| s * self.table[q])]
#[derive(Clone, Debug)]
struct Indexing {
    table: f32,
}

fn main() {}
