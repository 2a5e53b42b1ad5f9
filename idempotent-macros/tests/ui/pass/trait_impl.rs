//! A trait implemented with native `async fn`; the returned future is `Send`.
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

fn assert_send<F: Future + Send>(future: F) -> F {
    future
}

#[tokio::main]
async fn main() {
    let provider = Provider { store: MemoryStore::new() };
    let paid = tokio::spawn(async move { assert_send(provider.pay("k", 3)).await.unwrap() });
    assert_eq!(paid.await.unwrap(), 3);
}
