use idempotent_runtime::{Error, MemoryStore, idempotent};

struct Request {
    amount: f64,
}

#[idempotent(key = request.amount, store = store)]
async fn pay(store: &MemoryStore, request: Request) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
