//! A user crate as strict as they come, using `#[idempotent]` in every supported shape. `.ci/run`
//! runs `cargo clippy -p idempotent-lint-fixture -- -D warnings` on it: a lint that fires on
//! generated code fails CI. Nothing here runs; `ui/pass` and the tests check behaviour.
#![deny(clippy::pedantic, clippy::nursery, missing_docs, unused_qualifications)]
#![deny(warnings, rust_2018_idioms, unreachable_pub, unused_results)]

use core::marker::PhantomData;
use core::time::Duration;
use std::borrow::Cow;
use std::sync::{Arc, LazyLock};

use async_trait::async_trait;
// Names the expansion also uses, imported so that `unused_qualifications` would notice a
// generated path that could be shorter.
use idempotent_runtime::{Call, Error, MemoryStore, RecordErrors, ReleaseErrors, Store, idempotent};
use serde::{Deserialize, Serialize};

static STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);
const LEASE: Duration = Duration::from_secs(30);

/// A receipt.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Receipt {
    /// How much.
    pub amount: i64,
}

/// This crate's error.
#[derive(Debug, Serialize, Deserialize)]
pub enum PayError {
    /// Final: recorded.
    Declined,
    /// From the library: never recorded.
    #[serde(skip)]
    Idempotency(Error),
}

impl From<Error> for PayError {
    fn from(e: Error) -> Self {
        Self::Idempotency(e)
    }
}

const fn is_final(e: &PayError) -> bool {
    matches!(e, PayError::Declined)
}

/// A free function with every option.
#[idempotent(key = key, store = STORE, scope = "pay.v1", fingerprint = (user, amount), lease = "30s",
             retention = "1d", wait = "1s", record_err = is_final)]
pub async fn pay(key: &str, user: &str, amount: i64) -> Result<Receipt, PayError> {
    if amount < 0 {
        return Err(PayError::Declined);
    }
    let _ = user;
    Ok(Receipt { amount })
}

/// Durations as expressions, errors always recorded, a closure predicate elsewhere.
#[idempotent(key = key, store = &*STORE, lease = LEASE, retention = LEASE * 2, wait = Duration::from_millis(5),
             record_err)]
pub async fn refund(key: u64) -> Result<(), PayError> {
    Ok(())
}

/// A borrowed result, elided lifetime, closure predicate.
#[idempotent(key = name, store = STORE, record_err = |e| matches!(e, PayError::Declined))]
pub async fn greet(name: &str) -> Result<Cow<'_, str>, PayError> {
    Ok(Cow::Borrowed(name))
}

/// Instrumented, in either order.
#[tracing::instrument(skip(store))]
#[idempotent(key = key, store = store)]
pub async fn traced(store: &MemoryStore, key: &str) -> Result<u8, Error> {
    Ok(1)
}

/// Instrumented inside.
#[idempotent(key = key, store = store)]
#[tracing::instrument(skip(store), err)]
pub async fn traced_inside(store: &MemoryStore, key: &str) -> Result<u8, Error> {
    Ok(2)
}

/// A service with every receiver.
#[derive(Debug)]
pub struct Service<S> {
    store: S,
    calls: u32,
}

impl<S: Store> Service<S> {
    /// `&self`.
    #[idempotent(key = key, store = self.store)]
    pub async fn by_ref(&self, key: &str) -> Result<u32, Error> {
        Ok(self.calls)
    }

    /// `&mut self`.
    #[idempotent(key = key, store = self.store)]
    pub async fn by_mut(&mut self, key: &str) -> Result<u32, Error> {
        self.calls += 1;
        Ok(self.calls)
    }

    /// `self`.
    #[idempotent(key = key, store = self.store)]
    pub async fn by_value(self, key: String) -> Result<u32, Error> {
        Ok(self.calls)
    }

    /// `self: Arc<Self>`, generic, with a `where` clause.
    #[idempotent(key = key, store = self.store, fingerprint = value)]
    pub async fn by_arc<T>(self: Arc<Self>, key: &str, value: T) -> Result<T, Error>
    where
        T: Serialize + for<'de> Deserialize<'de> + Send,
    {
        Ok(value)
    }

    /// A type parameter only in a `PhantomData`.
    #[idempotent(key = key, store = self.store)]
    pub async fn phantom<U: Send>(&self, key: &str, _marker: PhantomData<U>) -> Result<u32, Error> {
        Ok(0)
    }
}

/// A service behind `Arc<dyn Payments>`.
#[async_trait]
pub trait Payments: Send + Sync {
    /// Where records go.
    fn store(&self) -> &MemoryStore;

    /// A default method.
    #[idempotent(key = key, store = self.store(), fingerprint = amount)]
    async fn charge(&self, key: &str, amount: i64) -> Result<i64, Error> {
        Ok(amount)
    }

    /// Implemented below.
    async fn cancel(&mut self, key: &str) -> Result<u32, PayError>;
}

#[async_trait]
impl<S: Store> Payments for Service<S>
where
    Self: Send + Sync,
{
    fn store(&self) -> &MemoryStore {
        &STORE
    }

    #[idempotent(key = key, store = self.store, record_err = is_final)]
    async fn cancel(&mut self, key: &str) -> Result<u32, PayError> {
        self.calls += 1;
        Ok(self.calls)
    }
}

/// A native `async fn` trait with a default method.
#[allow(async_fn_in_trait)] // the user's own choice, about their declaration, not the expansion
pub trait Ledger {
    /// Where records go.
    fn store(&self) -> &MemoryStore;

    /// A default method.
    #[idempotent(key = key, store = self.store(), on_cancel = "release")]
    async fn post(&self, key: u64) -> Result<u64, Error> {
        Ok(key)
    }
}

/// The same protocol by hand, next to the attribute (these imports stay used).
///
/// # Errors
///
/// The idempotency errors.
pub async fn by_hand(key: &str) -> Result<u8, Error> {
    let released = Call::new("by-hand", key).run_with(&*STORE, ReleaseErrors, async { Ok::<_, Error>(1) }).await?;
    let recorded: Result<u8, PayError> =
        Call::new("by-hand-2", key).run_with(&*STORE, RecordErrors, async { Ok(2) }).await;
    Ok(released + recorded.unwrap_or(0))
}
