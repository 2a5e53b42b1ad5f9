use idempotent_runtime::{Error, MemoryStore, idempotent};

struct Receipt;

#[idempotent(key = key, store = store)]
async fn pay(store: &MemoryStore, key: &str) -> Result<Receipt, Error> {
    Ok(Receipt)
}

fn main() {}
