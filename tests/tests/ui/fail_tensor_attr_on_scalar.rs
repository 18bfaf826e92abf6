use boostr_runtime::attention;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

#[attention(mask = |b, _h, _q, kv| self.len[b] > kv)]
#[derive(Clone, Debug)]
struct AttrOnScalar<R: Runtime> {
    #[tensor(i32, [B])]
    len: i32,
    other: Tensor<R>,
}

fn main() {}
