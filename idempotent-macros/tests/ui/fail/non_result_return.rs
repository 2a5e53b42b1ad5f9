use idempotent_runtime::{MemoryStore, idempotent};

#[idempotent(key = key, store = store)]
async fn pay(store: &MemoryStore, key: &str) -> Option<u32> {
    Some(1)
}

fn main() {}
