use boostr_runtime::attention;
use numr::runtime::Runtime;
use numr::tensor::Tensor;

#[attention(mask = |b, _h, _q, kv| self.len[b][0][0][0][0] > kv)]
#[derive(Clone, Debug)]
struct Rank<R: Runtime> {
    #[tensor(i32, [B, 1, 1, 1, 1])]
    len: Tensor<R>,
}

fn main() {}
