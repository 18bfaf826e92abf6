use boostr_runtime::attention;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

#[attention(mask = |b, _h, q, kv| self.doc[b][q][kv] == 0)]
#[derive(Clone, Debug)]
struct TooMany<R: Runtime> {
    #[tensor(i32, [B, Sk])]
    doc: Tensor<R>,
}

fn main() {}
