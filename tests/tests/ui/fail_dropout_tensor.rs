use boostr_runtime::attention;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

#[attention(dropout = self.rates[0])]
#[derive(Clone, Debug)]
struct DropoutFromTensor<R: Runtime> {
    #[tensor(f32, [Hq])]
    rates: Tensor<R>,
}

fn main() {}
