//! Inside `#[async_trait]`, the diagnostics are the same, at the same tokens, once each.
use async_trait::async_trait;
use idempotent_runtime::{Error, MemoryStore, idempotent};

struct Receipt;

#[async_trait]
trait Payments {
    async fn pay(&self, key: &str) -> Result<Receipt, Error>;
    async fn read(&self, key: &str) -> std::io::Result<u32>;
    async fn scan(&self, key: &str) -> Result<u32, Error>;
}

struct Provider {
    store: MemoryStore,
}

#[async_trait]
impl Payments for Provider {
    #[idempotent(key = key, store = self.store)]
    async fn pay(&self, key: &str) -> Result<Receipt, Error> {
        Ok(Receipt)
    }

    #[idempotent(key = key, store = self.store)]
    async fn read(&self, key: &str) -> std::io::Result<u32> {
        Ok(1)
    }

    #[idempotent(key = key, store = self.store, colour = "red")]
    async fn scan(&self, key: &str) -> Result<u32, Error> {
        Ok(1)
    }
}

fn main() {}
