use idempotent_runtime::{Error, MemoryStore, idempotent};

#[derive(Debug)]
enum PayError {
    Declined,
    Idempotency(Error),
}

impl From<Error> for PayError {
    fn from(e: Error) -> Self {
        PayError::Idempotency(e)
    }
}

fn is_final(e: &PayError) -> bool {
    matches!(e, PayError::Declined)
}

#[idempotent(key = key, store = store, record_err)]
async fn pay(store: &MemoryStore, key: &str) -> Result<u32, PayError> {
    Err(PayError::Declined)
}

#[idempotent(key = key, store = store, record_err = is_final)]
async fn refund(store: &MemoryStore, key: &str) -> Result<u32, PayError> {
    Ok(1)
}

fn main() {}
