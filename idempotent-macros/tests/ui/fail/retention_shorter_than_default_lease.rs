use idempotent_runtime::{Error, MemoryStore, idempotent};

// No `lease`: the default of 60 s applies, and a 30 s retention would refuse every call.
#[idempotent(key = key, store = store, retention = "30s")]
async fn pay(store: &MemoryStore, key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
