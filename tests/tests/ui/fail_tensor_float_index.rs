use boostr_runtime::attention;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

#[attention(score = |s, b, _h, _q, _kv| s + self.bias[b][s])]
#[derive(Clone, Debug)]
struct FloatIndex<R: Runtime> {
    #[tensor(f32, [B, Sk])]
    bias: Tensor<R>,
}

fn main() {}
