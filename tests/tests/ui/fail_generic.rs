use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| s * self.scale)]
#[derive(Clone, Debug)]
struct Generic<const N: usize> {
    scale: f32,
}

fn main() {}
