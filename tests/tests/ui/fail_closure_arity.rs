use boostr_runtime::attention;

#[attention(score = |s, q| s)]
#[derive(Clone, Debug)]
struct ClosureArity;

fn main() {}
