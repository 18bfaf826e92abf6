use boostr_runtime::attention;

// The generated items name the runtime crate through the path `crate`
// gives: one that resolves to nothing fails there, not at `::boostr_runtime`.
#[attention(mask = |_b, _h, q, kv| kv <= q, crate = "nowhere")]
#[derive(Clone, Debug)]
struct Nowhere;

fn main() {}
