use boostr_runtime::attention;
use numr::autograd::Var;
use numr::runtime::Runtime;

#[attention(
    score = |s, _b, h, _q, _kv| s + self.bias[h],
    mask = |_b, h, q, kv| kv as f32 <= q as f32 + self.bias[h],
)]
#[derive(Clone, Debug)]
struct LearnableInMask<R: Runtime> {
    #[tensor(f32, [Hq])]
    bias: Var<R>,
}

fn main() {}
