//! Integration tests for boostr; the tests live in `tests/`.

// Every Rust block of the README and the docs compiles and runs as a
// doctest, so that what a reader copies works.

/// The README's examples.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct Readme;

/// `docs/variants.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/variants.md")]
pub struct Variants;

/// `docs/api.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/api.md")]
pub struct Api;

/// `docs/porting.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/porting.md")]
pub struct Porting;

/// `docs/ring.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/ring.md")]
pub struct Ring;

/// `docs/backends.md`, `docs/testing.md` and `docs/performance.md` hold no
/// Rust; their commands are the project's own (`bench/`, `cargo`).
#[cfg(doctest)]
#[doc = include_str!("../../docs/backends.md")]
#[doc = include_str!("../../docs/testing.md")]
#[doc = include_str!("../../docs/performance.md")]
pub struct Reference;
