//! `crate = "..."` lets a crate that re-exports the runtime under another path use the attribute.
#![deny(warnings)]

mod reexport {
    pub use idempotent_runtime as idem;
}

use idempotent_runtime::{Error, MemoryStore, idempotent};

#[idempotent(key = key, store = store, crate = "crate::reexport::idem")]
async fn run(store: &MemoryStore, key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(run(&MemoryStore::new(), "k").await.unwrap(), 1);
}
