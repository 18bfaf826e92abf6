use boostr_runtime::attention;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

#[attention(mask = |b, _h, q, _kv| self.doc[b][q] > 0)]
#[derive(Clone, Debug)]
struct MissingAttr<R: Runtime> {
    doc: Tensor<R>,
}

fn main() {}
