//! Compile-time behaviour of `#[idempotent]`: every supported shape compiles (`ui/pass`), every
//! misuse gives the diagnostic pinned in its `.stderr` file (`ui/fail`).
//!
//! Regenerate the snapshots after an intended change with `TRYBUILD=overwrite cargo test -p
//! idempotent-macros --test ui`, and review the diff.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/pass/*.rs");
    cases.compile_fail("tests/ui/fail/*.rs");
}
