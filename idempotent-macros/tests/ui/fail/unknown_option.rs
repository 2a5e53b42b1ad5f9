use idempotent_runtime::{Error, MemoryStore, idempotent};

#[idempotent(key = key, store = store, ttl = "1h")]
async fn pay(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
