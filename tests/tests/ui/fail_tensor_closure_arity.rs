use boostr_runtime::attention;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

#[attention(
    mask = |b, _h, _q, kv| self.len[b] > kv,
    tests = [|data, more| Lengths { len: data.lengths() }],
)]
#[derive(Clone, Debug)]
struct Lengths<R: Runtime> {
    #[tensor(i32, [B])]
    len: Tensor<R>,
}

fn main() {}
