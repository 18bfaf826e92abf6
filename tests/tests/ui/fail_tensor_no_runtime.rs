use boostr_runtime::attention;
use numr::tensor::Tensor;

#[attention(mask = |b, _h, _q, kv| self.len[b] > kv)]
#[derive(Clone, Debug)]
struct NoRuntime {
    #[tensor(i32, [B])]
    len: Tensor<numr::runtime::cpu::CpuRuntime>,
}

fn main() {}
