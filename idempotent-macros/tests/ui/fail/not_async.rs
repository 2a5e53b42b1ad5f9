use idempotent_runtime::{Error, MemoryStore, idempotent};

#[idempotent(key = key, store = store)]
fn pay(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
