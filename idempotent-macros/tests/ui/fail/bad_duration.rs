use idempotent_runtime::{Error, MemoryStore, idempotent};

#[idempotent(key = key, store = store, lease = "1.5 hours", retention = "0s", wait = 30)]
async fn pay(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
