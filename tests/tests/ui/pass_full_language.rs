//! Every construct of the variant language at once (the declaration the
//! other tests share): `let` blocks (typed and untyped), `if`/`else`, `as`
//! casts, every function, and f32, i32, u32 and bool parameters.

use boostr_runtime::{HostVariant, Variant, attention};

include!("../fixtures/everything.rs");

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
