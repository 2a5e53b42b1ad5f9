//! A trait implemented with native `async fn` (the returned future is `Send`), and a native
//! trait's default method.
#![deny(warnings)]

use std::future::Future;

use idempotent_runtime::{Error, MemoryStore, idempotent};

trait Payments {
    fn pay(&self, key: &str, amount: i64) -> impl Future<Output = Result<i64, Error>> + Send;
}

struct Provider {
    store: MemoryStore,
}

impl Payments for Provider {
    #[idempotent(key = key, store = self.store, fingerprint = amount)]
    async fn pay(&self, key: &str, amount: i64) -> Result<i64, Error> {
        Ok(amount)
    }
}

trait Refunds {
    fn store(&self) -> &MemoryStore;

    /// A default method: the default scope comes from the implementing type.
    #[idempotent(key = key, store = self.store())]
    async fn refund(&self, key: &str) -> Result<i64, Error> {
        Ok(1)
    }
}

impl Refunds for Provider {
    fn store(&self) -> &MemoryStore {
        &self.store
    }
}

fn assert_send<F: Future + Send>(future: F) -> F {
    future
}

#[tokio::main]
async fn main() {
    let provider = Provider { store: MemoryStore::new() };
    let paid = tokio::spawn(async move { assert_send(provider.pay("k", 3)).await.unwrap() });
    assert_eq!(paid.await.unwrap(), 3);
    let provider = Provider { store: MemoryStore::new() };
    assert_eq!(provider.refund("k").await.unwrap(), 1);
}
