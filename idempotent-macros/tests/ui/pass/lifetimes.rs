//! Results that borrow (named and elided lifetimes) and `impl` blocks with bounded generics, each
//! also with `record_err = <predicate>` (whose argument type is inferred from the return type).
#![deny(warnings)]

use std::borrow::Cow;
use std::marker::PhantomData;
use std::sync::LazyLock;

use idempotent_runtime::{Error, MemoryStore, Store, idempotent};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

static STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);

#[derive(Debug, Serialize, Deserialize)]
enum PayError {
    Declined,
    #[serde(skip)]
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

#[idempotent(key = key, store = STORE)]
async fn named<'a>(key: u64, name: &'a str) -> Result<Cow<'a, str>, Error> {
    Ok(Cow::Borrowed(name))
}

#[idempotent(key = key, store = STORE, record_err = is_final)]
async fn named_recorded<'a>(key: u64, name: &'a str) -> Result<Cow<'a, str>, PayError> {
    Ok(Cow::Borrowed(name))
}

#[idempotent(key = name, store = STORE)]
async fn elided(name: &str) -> Result<Cow<'_, str>, Error> {
    Ok(Cow::Borrowed(name))
}

#[idempotent(key = name, store = STORE, record_err = |e| matches!(e, PayError::Declined))]
async fn elided_recorded(name: &str) -> Result<Cow<'_, str>, PayError> {
    Ok(Cow::Borrowed(name))
}

struct Cache<'s, S, T> {
    store: &'s S,
    value: T,
}

impl<'s, S: Store, T> Cache<'s, S, T>
where
    T: Serialize + DeserializeOwned + Clone + Send + Sync,
{
    #[idempotent(key = key, store = self.store, record_err = is_final)]
    async fn get(&self, key: &str) -> Result<T, PayError> {
        Ok(self.value.clone())
    }

    #[idempotent(key = key, store = self.store, record_err)]
    async fn label(&self, key: &str) -> Result<Cow<'_, str>, PayError> {
        Ok(Cow::Owned(key.to_owned()))
    }

    #[idempotent(key = key, store = self.store, record_err = |_| true)]
    async fn phantom<U: Send>(&self, key: &str, _: PhantomData<U>) -> Result<Vec<T>, PayError> {
        Ok(vec![self.value.clone()])
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let name = String::from("ada");
    assert_eq!(named(1, &name).await.unwrap(), "ada");
    assert_eq!(named_recorded(2, &name).await.unwrap(), "ada");
    assert_eq!(elided(&name).await.unwrap(), "ada");
    assert_eq!(elided_recorded("bob").await.unwrap(), "bob");
    let store = MemoryStore::new();
    let cache = Cache { store: &store, value: 7u8 };
    assert_eq!(cache.get("g").await.unwrap(), 7);
    assert_eq!(cache.label("l").await.unwrap(), "l");
    assert_eq!(cache.phantom::<String>("p", PhantomData).await.unwrap(), vec![7]);
}
