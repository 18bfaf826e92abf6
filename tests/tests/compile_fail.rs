//! Diagnostics of `#[attention]`: every `tests/ui/fail_*.rs` must fail to
//! compile with exactly the errors in its `.stderr`, and every
//! `tests/ui/pass_*.rs` must compile and run.

#[test]
fn diagnostics() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail_*.rs");
    t.pass("tests/ui/pass_*.rs");
}
