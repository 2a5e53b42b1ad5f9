//! `#[async_trait]` impls and trait default methods: every receiver, `?Send`, options that name
//! `self`, and `#[tracing::instrument]` on either side; called through `dyn` trait objects.
#![deny(warnings)]

use std::sync::Arc;

use async_trait::async_trait;
use idempotent_runtime::{Error, MemoryStore, idempotent};

#[async_trait]
trait Payments: Send + Sync {
    fn store(&self) -> &MemoryStore;

    /// A default method: `self` in the options is the implementor.
    #[idempotent(key = key, store = self.store(), fingerprint = amount)]
    async fn pay(&self, key: &str, amount: i64) -> Result<i64, Error> {
        Ok(amount)
    }

    async fn refund(&self, key: &str) -> Result<u32, Error>;
    async fn by_mut(&mut self, key: &str) -> Result<u32, Error>;
    async fn by_arc(self: Arc<Self>, key: String) -> Result<u32, Error>;
    async fn traced_outside(&self, key: &str) -> Result<u8, Error>;
    async fn traced_inside(&self, key: &str) -> Result<u8, Error>;
}

struct Provider {
    store: MemoryStore,
    calls: u32,
}

#[async_trait]
impl Payments for Provider {
    fn store(&self) -> &MemoryStore {
        &self.store
    }

    #[idempotent(key = key, store = self.store, record_err = false, lease = "10s", wait = "1s")]
    async fn refund(&self, key: &str) -> Result<u32, Error> {
        Ok(self.calls)
    }

    #[idempotent(key = key, store = self.store)]
    async fn by_mut(&mut self, key: &str) -> Result<u32, Error> {
        self.calls += 1;
        Ok(self.calls)
    }

    /// The store is borrowed from the `Arc` the body owns.
    #[idempotent(key = key, store = self.store, fingerprint = self.calls)]
    async fn by_arc(self: Arc<Self>, key: String) -> Result<u32, Error> {
        Ok(self.calls)
    }

    #[tracing::instrument(skip(self))]
    #[idempotent(key = key, store = self.store)]
    async fn traced_outside(&self, key: &str) -> Result<u8, Error> {
        Ok(1)
    }

    #[idempotent(key = key, store = self.store)]
    #[tracing::instrument(skip(self), err)]
    async fn traced_inside(&self, key: &str) -> Result<u8, Error> {
        Ok(2)
    }
}

#[async_trait(?Send)]
trait Local {
    async fn run(&self, key: u64) -> Result<String, Error>;
}

#[async_trait(?Send)]
impl Local for std::rc::Rc<MemoryStore> {
    #[idempotent(key = key, store = **self)]
    async fn run(&self, key: u64) -> Result<String, Error> {
        Ok(key.to_string())
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut provider = Provider { store: MemoryStore::new(), calls: 0 };
    assert_eq!(provider.by_mut("m").await.unwrap(), 1);
    assert_eq!(provider.by_mut("m").await.unwrap(), 1, "replayed, so not incremented");
    let shared: Arc<dyn Payments> = Arc::new(provider);
    assert_eq!(shared.pay("p", 5).await.unwrap(), 5);
    assert!(matches!(shared.pay("p", 6).await, Err(Error::FingerprintMismatch { .. })));
    assert_eq!(shared.refund("r").await.unwrap(), 1);
    assert_eq!(shared.traced_outside("o").await.unwrap(), 1);
    assert_eq!(shared.traced_inside("i").await.unwrap(), 2);
    assert_eq!(shared.clone().by_arc("a".to_owned()).await.unwrap(), 1);
    let local: Box<dyn Local> = Box::new(std::rc::Rc::new(MemoryStore::new()));
    assert_eq!(local.run(7).await.unwrap(), "7");
}
