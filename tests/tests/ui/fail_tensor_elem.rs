use boostr_runtime::attention;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

#[attention(mask = |b, _h, _q, kv| self.len[b] > kv)]
#[derive(Clone, Debug)]
struct Elem<R: Runtime> {
    #[tensor(f64, [B])]
    len: Tensor<R>,
}

fn main() {}
