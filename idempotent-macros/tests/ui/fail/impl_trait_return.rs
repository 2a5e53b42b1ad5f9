use idempotent_runtime::{MemoryStore, idempotent};

#[idempotent(key = key, store = store)]
async fn pay(store: &MemoryStore, key: &str) -> impl std::fmt::Debug {
    1
}

fn main() {}
