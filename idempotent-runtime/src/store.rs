//! The store trait: the three atomic steps every backend implements.

use std::future::Future;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use crate::{Fingerprint, Key, StoreError};

/// The largest encoded result a store records by default (1 MiB).
pub const DEFAULT_MAX_RECORD_BYTES: usize = 1024 * 1024;

/// Where idempotency records live.
///
/// A store implements three steps, **each one atomic on the backend** (one Lua script, one SQL
/// statement, one locked map operation), so no interleaving of concurrent callers can make two of
/// them own a key at once:
///
/// 1. [`claim`](Store::claim): take the key for this caller's [`Token`] with a lease, unless a live
///    record exists, in which case return it (completed: for replay; in progress: to wait or fail).
///    An expired lease or an expired completed record counts as absent.
/// 2. [`complete`](Store::complete): if the key is still claimed by this token, store the encoded
///    outcome and make the record live for `retention`. Otherwise fail with [`StoreError::NotOwner`].
/// 3. [`release`](Store::release): if the key is still claimed by this token, delete it, so a retry
///    may run. Otherwise fail with [`StoreError::NotOwner`].
///
/// Implementations for `&S`, `Box<S>`, `Arc<S>` and `LazyLock<S>` forward to `S`, so the attribute's
/// `store = ...` accepts a store, a reference to one, an `Arc`, or a `static` `LazyLock`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotency store",
    label = "`store = ...` must name a store",
    note = "use `MemoryStore`, a Redis or SQL store of `idempotent_runtime::stores`, or implement `Store`"
)]
pub trait Store: Send + Sync {
    /// Claims `request.key` for `request.token`, or returns the live record that prevents it.
    fn claim(&self, request: &ClaimRequest<'_>) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Records `outcome` for a key this token claimed, live for `retention`.
    fn complete(
        &self,
        key: &Key,
        token: &Token,
        outcome: &[u8],
        retention: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deletes the claim this token holds, so that a retry may run the body.
    fn release(&self, key: &Key, token: &Token) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Releases a claim from a destructor, when the body panicked or its future was dropped.
    ///
    /// It cannot wait: in-memory stores release at once, remote stores spawn the release on the
    /// current Tokio runtime. The default does nothing and the lease runs out instead.
    fn release_detached(&self, key: &Key, token: &Token) {
        let _ = (key, token);
    }

    /// Deletes expired claims and records now and returns how many it deleted.
    ///
    /// Stores whose backend expires entries by itself (Redis) keep the default, which deletes
    /// nothing and returns 0.
    fn purge_expired(&self) -> impl Future<Output = Result<u64, StoreError>> + Send {
        std::future::ready(Ok(0))
    }

    /// The largest encoded outcome this store records; larger results are not recorded and their
    /// replays get [`Error::Unrecordable`](crate::Error::Unrecordable).
    fn max_record_bytes(&self) -> usize {
        DEFAULT_MAX_RECORD_BYTES
    }
}

/// The arguments of [`Store::claim`].
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// The key to claim.
    pub key: &'a Key,
    /// This caller's owner token.
    pub token: &'a Token,
    /// The request's fingerprint, stored with the claim.
    pub fingerprint: Option<&'a Fingerprint>,
    /// How long the claim lasts if the caller neither completes nor releases it.
    pub lease: Duration,
}

/// What [`Store::claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key is now this caller's: run the body.
    Claimed,
    /// A call with this key has finished: replay its outcome.
    Completed(Record),
    /// Another caller holds a live claim.
    InProgress {
        /// The fingerprint the running call was claimed with.
        fingerprint: Option<Fingerprint>,
        /// How long its lease still lasts, if the store knows.
        lease_remaining: Option<Duration>,
    },
}

/// A completed call, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The fingerprint of the request that produced it.
    pub fingerprint: Option<Fingerprint>,
    /// The encoded outcome (JSON: see the crate docs for its shape).
    pub outcome: Vec<u8>,
}

/// The owner token of one claim: random, unique per call; completion and release are fenced by it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Token(String);

impl Token {
    /// A fresh random token (a v4 UUID, as 32 hex digits).
    #[must_use]
    pub fn new() -> Self {
        Token(uuid::Uuid::new_v4().simple().to_string())
    }

    /// Takes a token read back from a store.
    #[must_use]
    pub fn from_stored(text: impl Into<String>) -> Self {
        Token(text.into())
    }

    /// The text stores keep.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for Token {
    fn default() -> Self {
        Self::new()
    }
}

/// Forwards every method of `Store` through a pointer type.
macro_rules! forward_store {
    ($([$($generics:tt)*] $pointer:ty;)*) => {$(
        impl<$($generics)*> Store for $pointer {
            fn claim(&self, request: &ClaimRequest<'_>) -> impl Future<Output = Result<Claim, StoreError>> + Send {
                (**self).claim(request)
            }

            fn complete(
                &self,
                key: &Key,
                token: &Token,
                outcome: &[u8],
                retention: Duration,
            ) -> impl Future<Output = Result<(), StoreError>> + Send {
                (**self).complete(key, token, outcome, retention)
            }

            fn release(&self, key: &Key, token: &Token) -> impl Future<Output = Result<(), StoreError>> + Send {
                (**self).release(key, token)
            }

            fn release_detached(&self, key: &Key, token: &Token) {
                (**self).release_detached(key, token);
            }

            fn purge_expired(&self) -> impl Future<Output = Result<u64, StoreError>> + Send {
                (**self).purge_expired()
            }

            fn max_record_bytes(&self) -> usize {
                (**self).max_record_bytes()
            }
        }
    )*};
}

forward_store! {
    [S: Store + ?Sized] &S;
    [S: Store + ?Sized] Box<S>;
    [S: Store + ?Sized] Arc<S>;
    // A `static STORE: LazyLock<MemoryStore>` works as `store = STORE`.
    [S: Store, F: FnOnce() -> S + Send] LazyLock<S, F>;
}
