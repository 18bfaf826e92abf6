use boostr_runtime::attention;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

#[attention(mask = |b, _h, _q, _kv| self.doc[b] == 0)]
#[derive(Clone, Debug)]
struct TooFew<R: Runtime> {
    #[tensor(i32, [B, Sk])]
    doc: Tensor<R>,
}

fn main() {}
