use boostr_runtime::attention;

// One field more than the kernels' parameter block has words.
#[attention(mask = |_b, _h, q, kv| kv <= q + self.w32)]
#[derive(Clone, Debug)]
#[rustfmt::skip]
struct TooManyParams {
    w0: i32, w1: i32, w2: i32, w3: i32, w4: i32, w5: i32, w6: i32, w7: i32,
    w8: i32, w9: i32, w10: i32, w11: i32, w12: i32, w13: i32, w14: i32, w15: i32,
    w16: i32, w17: i32, w18: i32, w19: i32, w20: i32, w21: i32, w22: i32, w23: i32,
    w24: i32, w25: i32, w26: i32, w27: i32, w28: i32, w29: i32, w30: i32, w31: f32,
    w32: i32,
    w33: bool,
}

fn main() {}
