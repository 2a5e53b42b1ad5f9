//! Methods with every receiver: `&self`, `&mut self`, `self`, `self: Arc<Self>`.
#![deny(warnings)]

use std::sync::Arc;

use idempotent_runtime::{Error, MemoryStore, idempotent};

struct Service {
    store: MemoryStore,
    shared: Arc<MemoryStore>,
    calls: u32,
}

impl Service {
    #[idempotent(key = key, store = self.store)]
    async fn by_ref(&self, key: &str) -> Result<u32, Error> {
        Ok(self.calls)
    }

    #[idempotent(key = key, store = self.shared)]
    async fn by_mut(&mut self, key: &str) -> Result<u32, Error> {
        self.calls += 1;
        Ok(self.calls)
    }

    #[idempotent(key = key, store = self.store)]
    async fn by_value(self, key: &str) -> Result<u32, Error> {
        Ok(self.calls)
    }

    #[idempotent(key = key, store = self.shared)]
    async fn by_arc(self: Arc<Self>, key: &str) -> Result<u32, Error> {
        Ok(self.calls)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut service = Service { store: MemoryStore::new(), shared: Arc::new(MemoryStore::new()), calls: 0 };
    assert_eq!(service.by_ref("a").await.unwrap(), 0);
    assert_eq!(service.by_mut("b").await.unwrap(), 1);
    assert_eq!(service.by_mut("b").await.unwrap(), 1, "replayed, so not incremented");
    let shared = Arc::new(Service { store: MemoryStore::new(), shared: Arc::new(MemoryStore::new()), calls: 5 });
    assert_eq!(shared.by_arc("c").await.unwrap(), 5);
    assert_eq!(service.by_value("d").await.unwrap(), 1);
}
