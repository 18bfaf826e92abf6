use boostr_runtime::attention;

#[attention(mask = |_b, _h, q, kv| kv - q >= -self.window as i32)]
#[derive(Clone, Debug)]
struct NegateU32 {
    window: u32,
}

fn main() {}
