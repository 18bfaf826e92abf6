use boostr_runtime::attention;

// `crate` takes the runtime crate's path as a string, as serde's does.
#[attention(mask = |_b, _h, q, kv| kv <= q, crate = boostr_runtime)]
#[derive(Clone, Debug)]
struct NotAString;

fn main() {}
