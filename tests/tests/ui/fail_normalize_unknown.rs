use boostr_runtime::attention;

#[attention(normalize = relu)]
#[derive(Clone, Debug)]
struct Relu;

fn main() {}
