use idempotent_runtime::{Error, idempotent};

#[idempotent(scope = "payments")]
async fn pay(key: &str) -> Result<u32, Error> {
    Ok(1)
}

fn main() {}
