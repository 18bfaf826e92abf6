use boostr_runtime::attention;
use numr::autograd::Var;
use numr::runtime::Runtime;

#[attention(score = |s, _b, h, _q, _kv| s + self.bias[h] as f32)]
#[derive(Clone, Debug)]
struct Bias<R: Runtime> {
    #[tensor(i64, [Hq])]
    bias: Var<R>,
}

fn main() {}
