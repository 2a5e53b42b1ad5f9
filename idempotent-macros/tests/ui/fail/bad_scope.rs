use idempotent_runtime::{Error, MemoryStore, idempotent};

#[idempotent(key = key, store = store, scope = "pay:v1")]
async fn pay(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

#[idempotent(key = key, store = store, scope = payments)]
async fn refund(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
