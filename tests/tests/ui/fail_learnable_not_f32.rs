use boostr_runtime::attention;
use numr::autograd::Var;
use numr::runtime::Runtime;

#[attention(mask = |b, _h, _q, kv| kv < self.len[b])]
#[derive(Clone, Debug)]
struct LearnableLengths<R: Runtime> {
    #[tensor(i32, [B])]
    len: Var<R>,
}

fn main() {}
