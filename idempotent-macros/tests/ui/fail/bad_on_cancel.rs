use idempotent_runtime::{Error, MemoryStore, idempotent};

#[idempotent(key = key, store = store, on_cancel = "retry")]
async fn pay(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

#[idempotent(key = key, store = store, on_cancel = Release)]
async fn refund(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
