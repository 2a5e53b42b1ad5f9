use idempotent_runtime::{Error, MemoryStore, idempotent};

#[idempotent(key = key, store = store, record_err = "always")]
async fn pay(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
