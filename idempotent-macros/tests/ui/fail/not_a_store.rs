use idempotent_runtime::{Error, idempotent};

struct Database;

#[idempotent(key = key, store = db)]
async fn pay(db: &Database, key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
