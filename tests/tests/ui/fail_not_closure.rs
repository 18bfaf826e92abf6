use boostr_runtime::attention;

#[attention(score = tanh)]
#[derive(Clone, Debug)]
struct NotClosure;

fn main() {}
