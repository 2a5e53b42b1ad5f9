use idempotent_runtime::{Error, MemoryStore, idempotent};

#[idempotent(key = key, store = store, key = other)]
async fn pay(store: &MemoryStore, key: &str, other: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
