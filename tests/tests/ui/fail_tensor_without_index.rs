use boostr_runtime::attention;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

#[attention(mask = |_b, _h, _q, _kv| self.len > 0)]
#[derive(Clone, Debug)]
struct NoIndex<R: Runtime> {
    #[tensor(i32, [B])]
    len: Tensor<R>,
}

fn main() {}
