//! A store chosen at run time: [`AnyStore`], the type-erased [`Store`], and [`DynStore`], the
//! object-safe form of the trait behind it.
//!
//! `Store`'s methods return `impl Future`, so `dyn Store` does not exist. [`DynStore`] has the
//! same methods returning boxed futures; every `Store` is a `DynStore`, and `dyn DynStore`,
//! `Arc<dyn DynStore>` and [`AnyStore`] are `Store`s again. The cost is one allocation and one
//! indirect call per step (measured in `benches/any_store.rs`).
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

mod url;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::Detached;
use crate::{Claim, ClaimRequest, Key, Store, StoreError, Token};

pub use url::StoreUrlError;

/// A boxed, `Send` future: what [`DynStore`]'s methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// [`Store`] in object-safe form: the same steps, returning boxed futures.
///
/// Implemented for every `Store`; use it as `Arc<dyn DynStore>` or through [`AnyStore`]. Its
/// methods carry a `dyn_` prefix so that they never shadow `Store`'s on a concrete store.
pub trait DynStore: Send + Sync {
    /// [`Store::claim`].
    fn dyn_claim<'a>(&'a self, request: &'a ClaimRequest<'_>) -> BoxFuture<'a, Result<Claim, StoreError>>;
    /// [`Store::complete`].
    fn dyn_complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        outcome: &'a [u8],
        retention: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    /// [`Store::release`].
    fn dyn_release<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<(), StoreError>>;
    /// [`Store::extend`].
    fn dyn_extend<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    /// [`Store::detach`].
    fn dyn_detach(&self, step: Detached);
    /// [`Store::purge_expired`].
    fn dyn_purge_expired(&self) -> BoxFuture<'_, Result<u64, StoreError>>;
    /// [`Store::max_record_bytes`].
    fn dyn_max_record_bytes(&self) -> usize;
    /// The concrete store's type name, for `Debug`.
    fn dyn_type_name(&self) -> &'static str;
}

impl<S: Store> DynStore for S {
    fn dyn_claim<'a>(&'a self, request: &'a ClaimRequest<'_>) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(self.claim(request))
    }

    fn dyn_complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        outcome: &'a [u8],
        retention: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.complete(key, token, outcome, retention))
    }

    fn dyn_release<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.release(key, token))
    }

    fn dyn_extend<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.extend(key, token, lease))
    }

    fn dyn_detach(&self, step: Detached) {
        self.detach(step);
    }

    fn dyn_purge_expired(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(self.purge_expired())
    }

    fn dyn_max_record_bytes(&self) -> usize {
        self.max_record_bytes()
    }

    fn dyn_type_name(&self) -> &'static str {
        std::any::type_name::<S>()
    }
}

// The futures are awaited inside `async fn`s rather than returned: a boxed future borrows
// `self` and the arguments for one lifetime, which `Store`'s signatures cannot name.
impl Store for dyn DynStore {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.dyn_claim(request).await
    }

    async fn complete(&self, key: &Key, token: &Token, outcome: &[u8], retention: Duration) -> Result<(), StoreError> {
        self.dyn_complete(key, token, outcome, retention).await
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        self.dyn_release(key, token).await
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        self.dyn_extend(key, token, lease).await
    }

    fn detach(&self, step: Detached) {
        self.dyn_detach(step);
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.dyn_purge_expired().await
    }

    fn max_record_bytes(&self) -> usize {
        self.dyn_max_record_bytes()
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
    inner: Arc<dyn DynStore>,
}

impl AnyStore {
    /// Wraps `store`.
    pub fn new(store: impl Store + 'static) -> Self {
        AnyStore { inner: Arc::new(store) }
    }

    /// Wraps a shared store.
    #[must_use]
    pub fn from_arc(store: Arc<dyn DynStore>) -> Self {
        AnyStore { inner: store }
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

    /// The store, as a trait object.
    ///
    /// (Calling through it, not through the `Arc`, matters: `Arc<dyn DynStore>` is a `Store`
    /// too, hence a `DynStore`, and its methods would box the boxed futures once more.)
    #[must_use]
    pub fn as_dyn(&self) -> &dyn DynStore {
        &*self.inner
    }

    /// The concrete store's type name (such as `idempotent_runtime::stores::memory::MemoryStore`).
    #[must_use]
    pub fn type_name(&self) -> &'static str {
        self.as_dyn().dyn_type_name()
    }
}

impl std::fmt::Debug for AnyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AnyStore").field(&self.type_name()).finish()
    }
}

impl Store for AnyStore {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.as_dyn().dyn_claim(request).await
    }

    async fn complete(&self, key: &Key, token: &Token, outcome: &[u8], retention: Duration) -> Result<(), StoreError> {
        self.as_dyn().dyn_complete(key, token, outcome, retention).await
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        self.as_dyn().dyn_release(key, token).await
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        self.as_dyn().dyn_extend(key, token, lease).await
    }

    fn detach(&self, step: Detached) {
        self.as_dyn().dyn_detach(step);
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.as_dyn().dyn_purge_expired().await
    }

    fn max_record_bytes(&self) -> usize {
        self.as_dyn().dyn_max_record_bytes()
    }
}
