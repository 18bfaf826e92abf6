// The row normalisation as the kernels use it: the template functions
// around the `weights_*` functions that the compiler lowers from the
// variant's weights (kernels_spec::emit::gpu::weights).
//@@ forward

// The weight in P·V of a pair with score s (-inf where hidden) in a row
// whose running max is m (weights_pair), added to the row's sum l, then
// times the pair's dropout factor (0 or 1/(1 - p); 1 without dropout).
fn pair_weight(s: f32, m: f32, l: ptr<function, f32>, ib: i32, ih: i32, qp: i32, kp: i32) -> f32 {
    let p = weights_pair(s, m);
    *l += p;
    return p * variant_dropout(ib, ih, qp, kp);
}
//@@ backward

// The weight of a visible pair with score sc in a row with lse `lse`
// (weights_prob), 0 unless seen.
fn pair_prob(sc: f32, lse: f32, seen: bool) -> f32 {
    return select(0.0f, weights_prob(sc, lse), seen);
}
