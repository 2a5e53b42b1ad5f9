//! Next to `#[tracing::instrument]`, in either order, with docs and lint attributes around.
#![deny(warnings)]

use idempotent_runtime::{Error, MemoryStore, idempotent};

/// Instrumented outside.
#[tracing::instrument(skip(store))]
#[idempotent(key = key, store = store)]
#[allow(clippy::unused_async)]
async fn outer(store: &MemoryStore, key: &str) -> Result<u8, Error> {
    Ok(1)
}

#[allow(unused_mut)]
#[idempotent(key = key, store = store)]
/// Instrumented inside.
#[tracing::instrument(skip(store), err)]
async fn inner(store: &MemoryStore, key: &str) -> Result<u8, Error> {
    let mut two = 2;
    Ok(two)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = MemoryStore::new();
    assert_eq!(outer(&store, "a").await.unwrap(), 1);
    assert_eq!(inner(&store, "b").await.unwrap(), 2);
}
