//! Diagnostics of `#[attention]`: every `tests/ui/fail_*.rs` must fail to
//! compile with exactly the errors in its `.stderr`. (Declarations that
//! compile are exercised by the other test targets, so trybuild only
//! type-checks here and never builds the dependencies' code.)

#[test]
fn diagnostics() {
    trybuild::TestCases::new().compile_fail("tests/ui/fail_*.rs");
}
