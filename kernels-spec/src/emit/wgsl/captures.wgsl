// ---- the capture arena (see kernels_spec::params) ----
fn bx_capture(word: u32) -> u32 {
    return atomicLoad(&captures[word]);
}
// The word when ok, else 0 without reading it; the first read out of range
// of a dispatch that reports records its site and indices in words 0..4
// (word 7 elects it).
fn bx_capture_checked(word: u32, ok: bool, report: bool, site: u32, i0: u32, i1: u32, i2: u32, i3: u32) -> u32 {
    if ok { return atomicLoad(&captures[word]); }
    if report && atomicMax(&captures[7], 1u) == 0u {
        atomicStore(&captures[1], i0);
        atomicStore(&captures[2], i1);
        atomicStore(&captures[3], i2);
        atomicStore(&captures[4], i3);
        atomicStore(&captures[0], site + 1u);
    }
    return 0u;
}
// The least (or greatest) of `count` summary entries `stride` words apart
// (count <= 8, kernels_spec::params::SUMMARY_MAX_BLOCKS). A constant trip
// count, so the loop unrolls rather than counting against a software
// adapter's loop limit.
fn bx_summary(first: u32, stride: u32, count: u32, greatest: bool) -> i32 {
    if count == 0u { return select(-2147483647i - 1i, 2147483647i, greatest); }
    var best = bitcast<i32>(atomicLoad(&captures[first]));
    for (var i = 1u; i < 8u; i++) {
        if i < count {
            let v = bitcast<i32>(atomicLoad(&captures[first + i * stride]));
            best = select(min(best, v), max(best, v), greatest);
        }
    }
    return best;
}
// Adds x to the 64-bit fixed-point gradient accumulator at words `word`
// (low), `word + 1` (high); u32 max: the read was outside its tensor.
// x·2^32 is rounded to nearest and added with integer atomics, the carry
// out of the low word taken from its old value, so the sum is the same bits
// in any order. A non-finite x, or one of 2^24 or more, is dropped and
// flagged in word 5.
fn bx_grad_add(word: u32, x: f32) {
    if word == 0xffffffffu || x == 0.0f { return; }
    let a = abs(x);
    if (bitcast<u32>(x) & 0x7f800000u) == 0x7f800000u {
        atomicOr(&captures[5], 1u);
        return;
    }
    if a >= 16777216.0f {
        atomicOr(&captures[5], 2u);
        return;
    }
    // |x| = whole + frac exactly; frac·2^32 < 2^32 for every f32 frac < 1.
    let whole = floor(a);
    var hi = u32(whole);
    var lo = u32(round((a - whole) * 4294967296.0f));
    if x < 0.0f {
        lo = ~lo + 1u;
        hi = ~hi + select(0u, 1u, lo == 0u);
    }
    let old = atomicAdd(&captures[word], lo);
    atomicAdd(&captures[word + 1u], hi + select(0u, 1u, old + lo < old));
}
