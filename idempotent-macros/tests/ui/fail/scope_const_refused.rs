// A hand-made `Scope` in a `const` is checked at compile time, as `scope = "..."` is.
use idempotent_runtime::Scope;

const _: Scope<'static> = Scope::from_static("pay:v1");

fn main() {}
