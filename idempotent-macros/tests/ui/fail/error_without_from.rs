use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug)]
struct PayError;

#[idempotent(key = key, store = store)]
async fn pay(store: &MemoryStore, key: &str) -> Result<u32, PayError> {
    Ok(1)
}

fn main() {}
