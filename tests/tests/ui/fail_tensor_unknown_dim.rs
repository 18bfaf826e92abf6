use boostr_runtime::attention;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

#[attention(mask = |b, _h, q, _kv| self.doc[b][q] > 0)]
#[derive(Clone, Debug)]
struct UnknownDim<R: Runtime> {
    #[tensor(i32, [B, S])]
    doc: Tensor<R>,
}

fn main() {}
