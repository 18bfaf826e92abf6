//! Every construct of the variant language at once: `let` blocks (typed and
//! untyped), `if`/`else`, `as` casts, every function, and f32, i32, u32 and
//! bool parameters.

use boostr_runtime::{Variant, attention};

#[attention(
    score = |s, b, h, q, kv| {
        let cap: f32 = self.cap;
        let t = cap * tanh(s / cap);
        let dist = abs(q - kv) as f32;
        let bias = if self.alibi { -self.slope * (h + 1) as f32 * dist } else { 0.0 };
        let smooth = log(1.0 + exp(t)) - log2(1.0 + exp2(-abs(t)));
        let gate = sigmoid(sqrt(1.0 + t * t)) * floor(s) - ceil(s) * 0.0;
        let lo = min(b, 0) as f32;
        max(clamp(t + bias + 0.5 * smooth + gate * 0.0, -cap, cap), lo - cap)
    },
    mask = |_b, _h, q, kv| {
        let window = self.window as i32;
        let causal = if self.causal { kv <= q } else { true };
        causal && (q - kv < window || self.window == 0u32) && !(kv < 0)
    },
    tile(q = 32, kv = 64),
)]
#[derive(Clone, Debug)]
struct Everything {
    cap: f32,
    slope: f32,
    window: u32,
    causal: bool,
    alibi: bool,
}

fn main() {
    let v = Everything {
        cap: 30.0,
        slope: 0.25,
        window: 4,
        causal: true,
        alibi: true,
    };
    assert!(v.mask(0, 0, 5, 5));
    assert!(v.mask(0, 0, 5, 2));
    assert!(!v.mask(0, 0, 5, 1));
    assert!(!v.mask(0, 0, 5, 6));
    let s = v.score(1.5, 0, 1, 3, 1);
    assert!(s.is_finite() && s.abs() <= 30.0, "{s}");
    assert!(Everything::compiled().text.contains("score"));
}
