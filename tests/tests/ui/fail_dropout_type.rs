use boostr_runtime::attention;

#[attention(dropout = self.percent)]
#[derive(Clone, Debug)]
struct DropoutInt {
    percent: i32,
}

fn main() {}
