//! Generic functions and impls, lifetimes, `where` clauses, and a store that is generic.
#![deny(warnings)]

use std::fmt::Debug;

use idempotent_runtime::{Error, MemoryStore, Store, idempotent};
use serde::Serialize;
use serde::de::DeserializeOwned;

#[idempotent(key = key, store = store)]
async fn echo<'k, S, T>(store: &S, key: &'k str, value: T) -> Result<T, Error>
where
    S: Store,
    T: Serialize + DeserializeOwned + Send + Debug,
{
    Ok(value)
}

struct Repo<'a, S> {
    store: &'a S,
}

impl<'a, S: Store> Repo<'a, S> {
    #[idempotent(key = key, store = self.store)]
    async fn save<K>(&self, key: K, value: &'a str) -> Result<String, Error>
    where
        K: idempotent_runtime::IdempotencyKey + Send,
    {
        Ok(value.to_owned())
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = MemoryStore::new();
    assert_eq!(echo(&store, "k", vec![1, 2]).await.unwrap(), vec![1, 2]);
    let repo = Repo { store: &store };
    assert_eq!(repo.save(5u32, "v").await.unwrap(), "v");
}
