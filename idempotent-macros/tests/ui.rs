//! Compile-time behaviour of `#[idempotent]`: every supported shape compiles (`ui/pass`), every
//! misuse gives the diagnostic pinned in its `.stderr` file (`ui/fail`).
//!
//! Regenerate the snapshots after an intended change with `TRYBUILD=overwrite cargo test -p
//! idempotent-macros --test ui`, and review the diff. `IDEMPOTENT_UI=<file stem>` runs one case.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    let Ok(only) = std::env::var("IDEMPOTENT_UI") else {
        cases.pass("tests/ui/pass/*.rs");
        cases.compile_fail("tests/ui/fail/*.rs");
        return;
    };
    for dir in ["pass", "fail"] {
        let path = format!("tests/ui/{dir}/{only}.rs");
        if std::path::Path::new(&path).exists() {
            if dir == "pass" { cases.pass(path) } else { cases.compile_fail(path) }
        }
    }
}
