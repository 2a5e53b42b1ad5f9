//! The stores: one file each, and [`AnyStore`], any of them chosen at run time.

pub mod any;
pub mod batching;
#[cfg(feature = "cache")]
pub mod cache;
pub mod memory;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod sql;

pub use crate::detached::spawn_detached;
pub use any::{AnyStore, StoreUrlError};

/// A store step that did not finish within the store's timeout (`with_timeout` on the SQL and
/// Redis stores); the source of the [`StoreError::Backend`](crate::StoreError::Backend) it fails
/// with. A step that waited on a dead connection or a stuck server fails with it instead of
/// waiting for ever.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{backend} did not answer the {operation} within {after:?} ({causes}); raise the limit with `with_timeout` \
     if the server is merely slow",
    causes = likely_causes(.backend)
)]
pub struct TimedOut {
    /// Which store: `postgres`, `mysql`, `sqlite`, `redis`, `redis-cluster`.
    pub backend: &'static str,
    /// The step: `claim`, `complete`, `release`, `extend` or `purge`, or an operator's method of
    /// [`Admin`](crate::admin::Admin): `inspect`, `list`, `release` or `stats`.
    pub operation: &'static str,
    /// The limit it exceeded.
    pub after: std::time::Duration,
}

/// What usually keeps `backend` from answering in time, for [`TimedOut`]'s message. On the SQL
/// stores a step waits for a lock that an open transaction holds, a `SqlTxStore`'s included (its
/// claim is an uncommitted row): the server is not slow, and a longer limit does not help.
fn likely_causes(backend: &str) -> &'static str {
    match backend {
        "postgres" | "mysql" => {
            "a row held by an open transaction (a call in a `SqlTxStore` holds its key's row until the transaction \
             ends), a stalled network or a stuck server?"
        }
        "sqlite" => "the database's write lock held by an open transaction (a `SqlTxStore` holds it until it ends)?",
        _ => "network stalled, server stuck, or a failover under way?",
    }
}
