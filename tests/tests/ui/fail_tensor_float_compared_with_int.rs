use boostr_runtime::attention;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

#[attention(mask = |_b, h, _q, kv| self.slopes[h] < kv)]
#[derive(Clone, Debug)]
struct Compare<R: Runtime> {
    #[tensor(f32, [Hq])]
    slopes: Tensor<R>,
}

fn main() {}
