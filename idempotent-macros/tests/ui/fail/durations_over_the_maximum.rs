use idempotent_runtime::{Error, MemoryStore, idempotent};

#[idempotent(key = key, store = store, lease = "25h", retention = "3651d", wait = "2d")]
async fn pay(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
