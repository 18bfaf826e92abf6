//! Integration tests for boostr; the tests live in `tests/`.
