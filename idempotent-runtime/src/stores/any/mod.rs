//! A store chosen at run time: [`AnyStore`], the one type-erased [`Store`].
//!
//! `Store`'s methods return `impl Future`, so `dyn Store` does not exist. `AnyStore` holds any
//! store behind a private object-safe shim whose methods return boxed futures: the cost is one
//! allocation and one indirect call per step (measured in `benches/any_store.rs`). There is no
//! other erased form to choose between, and wrapping an `AnyStore` in another `AnyStore` (which
//! would box every step twice) hands back the same store.
//!
//! [`AnyStore::from_url`] opens the store a configuration names:
//!
//! | URL | store | feature |
//! |---|---|---|
//! | `memory://` | [`MemoryStore`](crate::MemoryStore) | always |
//! | `sqlite://PATH` (`sqlite:///abs/path.db`, `sqlite://data/idem.db`) | [`SqliteStore::open`](crate::stores::sql::SqliteStore) | `sqlite` |
//! | `redis://HOST[:PORT][/DB]`, `rediss://...` | [`RedisStore::connect`](crate::stores::redis::RedisStore) | `redis` |
//! | `redis+cluster://HOST:PORT[,HOST:PORT...]` | `RedisClusterStore::connect_cluster` (feature `redis-cluster`) | `redis-cluster` |
//! | `postgres://USER[:PASSWORD]@HOST[:PORT]/DB` (or `postgresql://`) | `PostgresStore`, table created if missing | `postgres` |
//! | `mysql://USER[:PASSWORD]@HOST[:PORT]/DB` (or `mariadb://`) | `MySqlStore`, table created if missing | `mysql` |
//!
//! Each store gets its defaults (table `idempotency_records`, Redis key prefix, record limit); for
//! other settings build the store yourself and wrap it with [`AnyStore::new`].

mod admin;
mod url;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::store::forward_store;
use crate::{Claim, ClaimRequest, Completion, Detached, Key, Store, StoreError, Token};

pub use url::StoreUrlError;

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The answer of a batched step: one result per request, or the batch's failure.
type Many<T> = crate::BatchAnswers<T>;

/// [`Store`] in object-safe form, implemented for every `Store`; private to [`AnyStore`].
trait Erased: Send + Sync {
    fn claim<'a>(&'a self, request: &'a ClaimRequest<'_>) -> BoxFuture<'a, Result<Claim, StoreError>>;
    fn complete<'a>(&'a self, completion: &'a Completion<'_>) -> BoxFuture<'a, Result<(), StoreError>>;
    fn claim_many<'a>(&'a self, requests: &'a [ClaimRequest<'_>]) -> BoxFuture<'a, Many<Claim>>;
    fn complete_many<'a>(&'a self, completions: &'a [Completion<'_>]) -> BoxFuture<'a, Many<()>>;
    fn claim_and_complete_many<'a>(
        &'a self,
        requests: &'a [ClaimRequest<'_>],
        completions: &'a [Completion<'_>],
    ) -> BoxFuture<'a, (Many<Claim>, Many<()>)>;
    fn release<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<(), StoreError>>;
    fn extend<'a>(&'a self, key: &'a Key, token: &'a Token, lease: Duration) -> BoxFuture<'a, Result<(), StoreError>>;
    fn detach(&self, step: Detached);
    fn purge_expired(&self) -> BoxFuture<'_, Result<u64, StoreError>>;
    fn max_record_bytes(&self) -> usize;
    fn name(&self) -> &'static str;
    fn process_local(&self) -> bool;
    fn type_name(&self) -> &'static str;
}

impl<S: Store> Erased for S {
    fn claim<'a>(&'a self, request: &'a ClaimRequest<'_>) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(Store::claim(self, request))
    }

    fn complete<'a>(&'a self, completion: &'a Completion<'_>) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(Store::complete(self, completion))
    }

    fn claim_many<'a>(&'a self, requests: &'a [ClaimRequest<'_>]) -> BoxFuture<'a, Many<Claim>> {
        Box::pin(Store::claim_many(self, requests))
    }

    fn complete_many<'a>(&'a self, completions: &'a [Completion<'_>]) -> BoxFuture<'a, Many<()>> {
        Box::pin(Store::complete_many(self, completions))
    }

    fn claim_and_complete_many<'a>(
        &'a self,
        requests: &'a [ClaimRequest<'_>],
        completions: &'a [Completion<'_>],
    ) -> BoxFuture<'a, (Many<Claim>, Many<()>)> {
        Box::pin(Store::claim_and_complete_many(self, requests, completions))
    }

    fn release<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(Store::release(self, key, token))
    }

    fn extend<'a>(&'a self, key: &'a Key, token: &'a Token, lease: Duration) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(Store::extend(self, key, token, lease))
    }

    fn detach(&self, step: Detached) {
        Store::detach(self, step);
    }

    fn purge_expired(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(Store::purge_expired(self))
    }

    fn max_record_bytes(&self) -> usize {
        Store::max_record_bytes(self)
    }

    fn name(&self) -> &'static str {
        Store::name(self)
    }

    fn process_local(&self) -> bool {
        Store::process_local(self)
    }

    fn type_name(&self) -> &'static str {
        std::any::type_name::<S>()
    }
}

/// Any store, chosen at run time: from configuration with [`from_url`](Self::from_url), or
/// wrapping a store you built with [`new`](Self::new). Cloning shares the store.
///
/// ```
/// use idempotent_runtime::stores::AnyStore;
/// use idempotent_runtime::{idempotent, Error};
///
/// #[idempotent(key = order, store = store)]
/// async fn ship(store: &AnyStore, order: u64) -> Result<String, Error> {
///     Ok(format!("shipped {order}"))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let url = std::env::var("IDEMPOTENT_STORE").unwrap_or_else(|_| "memory://".to_owned());
/// # let url = "memory://";
/// let store = AnyStore::from_url(&url).await?;
/// assert_eq!(ship(&store, 7).await?, "shipped 7");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct AnyStore {
    inner: Arc<dyn Erased>,
    /// The same store's operator methods, when it was wrapped with them.
    admin: Option<Arc<dyn admin::ErasedAdmin>>,
}

impl AnyStore {
    /// Wraps `store` (an `AnyStore` is returned as it is, not wrapped again).
    pub fn new<S: Store + 'static>(store: S) -> Self {
        let mut slot = Some(store);
        if let Some(any) = (&mut slot as &mut dyn std::any::Any).downcast_mut::<Option<AnyStore>>() {
            return any.take().unwrap_or_else(|| unreachable!("filled above"));
        }
        AnyStore { inner: Arc::new(slot.take().unwrap_or_else(|| unreachable!("filled above"))), admin: None }
    }

    /// Wraps `store` with its operator methods too, so that this `AnyStore` implements
    /// [`Admin`](crate::admin::Admin) by forwarding to it.
    pub fn with_admin<S: Store + crate::admin::Admin + 'static>(store: S) -> Self {
        let shared = Arc::new(store);
        AnyStore { inner: Arc::clone(&shared) as Arc<dyn Erased>, admin: Some(shared) }
    }

    /// Opens the store `url` names (see the [module docs](self) for the schemes): `memory://`,
    /// `sqlite://PATH`, `redis://...`, `redis+cluster://...`, `postgres://...`, `mysql://...`.
    ///
    /// # Errors
    ///
    /// [`StoreUrlError`]: an unknown scheme, a malformed URL, a scheme whose feature this build
    /// lacks (the message names the feature to enable), or a store that could not be opened.
    pub async fn from_url(url: &str) -> Result<Self, StoreUrlError> {
        url::open(url).await
    }

    /// The concrete store's type name (such as `idempotent_runtime::stores::memory::MemoryStore`),
    /// for diagnostics; [`Store::name`] is the short name.
    #[must_use]
    pub fn type_name(&self) -> &'static str {
        self.inner.type_name()
    }
}

impl std::fmt::Debug for AnyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AnyStore").field(&self.type_name()).finish()
    }
}

impl AnyStore {
    fn erased(&self) -> &dyn Erased {
        &*self.inner
    }
}

// Awaited, not returned: a boxed future borrows `self` and the arguments for one lifetime, which
// `Store`'s signatures cannot name.
impl Store for AnyStore {
    forward_store!(awaited AnyStore::erased;
        claim complete claim_many complete_many claim_and_complete_many release extend detach purge_expired
        max_record_bytes name
        process_local);
}
