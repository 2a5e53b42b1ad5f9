use idempotent_runtime::{Error, MemoryStore, idempotent};

#[idempotent(key = key, store = store, lease = "10m", retention = "30s")]
async fn pay(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
