#![cfg_attr(docsrs, feature(doc_cfg))]
//! Exactly-once execution per key for async functions.
//!
//! Annotate an `async fn` that returns `Result<T, E>` with [`#[idempotent]`](macro@idempotent) and
//! it runs at most once per key; every repeat with that key gets the recorded result back:
//!
//! ```
//! use idempotent_runtime::{idempotent, Error, MemoryStore};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
//! struct Receipt { user: String, amount: i64 }
//!
//! struct Payments { store: MemoryStore }
//!
//! impl Payments {
//!     #[idempotent(key = request_id, store = self.store, fingerprint = (user, amount))]
//!     async fn deduct_balance(&self, request_id: &str, user: &str, amount: i64) -> Result<Receipt, Error> {
//!         // ... the non-idempotent work: UPDATE users SET balance = balance - amount ...
//!         Ok(Receipt { user: user.to_owned(), amount })
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let payments = Payments { store: MemoryStore::new() };
//! let first = payments.deduct_balance("req-1", "alice", 100).await.unwrap();
//! let retry = payments.deduct_balance("req-1", "alice", 100).await.unwrap(); // replayed
//! assert_eq!(first, retry);
//! # }
//! ```
//!
//! # The protocol
//!
//! Each call goes **check → claim → execute → record**:
//!
//! 1. The key (with its scope) is looked up and, if free, claimed for this call in one atomic store
//!    operation, with a *lease*: of any number of concurrent callers, exactly one wins.
//! 2. A completed record is replayed (decoded from JSON) without running the body; a live claim held
//!    by another caller gives [`Error::InProgress`], or with `wait` is waited for.
//! 3. The winner runs the body, then records `Ok` (and, if asked, `Err`) for `retention`, fenced by
//!    its owner [`Token`]: a caller whose lease ran out and was taken over gets [`Error::LeaseLost`]
//!    and overwrites nothing.
//!    While the body runs, its lease is renewed every third of its length (the heartbeat), so a
//!    live body is never run twice however long it takes; while its result is recorded, the
//!    renewals go on for up to one more lease, so a slow completion keeps the key too.
//! 4. An unrecorded `Err` or a panic releases the claim so a retry can run; a crashed process's
//!    claim frees itself one lease after its last renewal. A cancelled call (its future dropped
//!    while the body runs) keeps the claim until the lease ends, like a crash, unless
//!    [`OnCancel::Release`] is chosen; a call dropped while recording is recorded in the
//!    background (see [`Call::run_with`]).
//!
//! # A chain of services
//!
//! A body that calls another service can run more than once for its key (its `Err` released the
//! key; its process died and a retry took the claim over). Two things make those re-runs safe:
//!
//! - **Derived keys**: inside the body, [`client::IdempotentRetry`] gives each request without an
//!   `Idempotency-Key` a key derived from the call's scope and key and the request's method, path
//!   and position among the run's requests with that method and path ([`derived_key`]), so every run sends the same keys and the other service
//!   replays. Opt out with `IdempotentRetry::derive_keys(false)` or [`without_derived_keys`].
//! - **Recovery points**: [`step`] records a named piece of the body's result under the call,
//!   fenced by the call's claim, and replays it on every later run instead of running it again.
//!
//! Both find things by position, so the body must be **deterministic** in what it asks: the same
//! derived-key requests (method, path), in the same order for each method and path, and the same
//! steps (names) in the same order, on every run for a key. Requests to different routes may
//! leave in any order (concurrently, in a `join!`). Build them from the call's inputs and from step results, not from the clock or
//! random numbers. Requests inside a step count within the step, so a replayed step does not move
//! the requests after it. Code in a task the body spawns is outside the call.
//!
//! # Features
//!
//! | feature | what it adds |
//! |---|---|
//! | (none) | [`#[idempotent]`](macro@idempotent), [`Call`], [`MemoryStore`], [`AnyStore`] |
//! | `redis`, `redis-cluster` | `stores::redis`: `RedisStore`, `RedisClusterStore` |
//! | `postgres`, `mysql`, `sqlite` | `stores::sql`: the pooled and transactional SQL stores |
//! | `cache` | `stores::cache::CachedStore`, a local replay cache in front of any store |
//! | `axum` | `http`: the `Idempotency-Key` layer and extractor |
//! | `tonic` | `grpc`: the gRPC layer for tonic servers and the key interceptor for tonic clients |
//! | `reqwest` | `client`: retries that keep their key |
//! | `amqp`, `jetstream` | `consume`: broker consumers that settle by the record |
//! | `metrics` | counters and histograms on the `metrics` facade (see [`observe`]) |
//!
//! # Record format
//!
//! Outcomes are stored as JSON: `{"Ok": <value>}`, `{"Err": <error>}` (only with `record_err`) or
//! `{"Unrecordable": "<reason>"}` when the result was too large or failed to serialise (the call
//! ran; replays get [`Error::Unrecordable`] and it does not run again). Fingerprints are the
//! SHA-256 of the fingerprinted value's JSON, in hex.
//!
//! Note JSON's limits: `Some(())` and `None` both encode as `null`, and so do `Some(None)` and
//! `None`; a `HashMap` with non-string keys does not serialise. Give such results a struct.

pub mod admin;
mod call;
#[cfg(feature = "reqwest")]
pub mod client;
#[cfg(any(feature = "amqp", feature = "jetstream"))]
pub mod consume;
mod context;
mod detached;
#[cfg(feature = "axum")]
mod edge;
mod error;
mod expansion;
mod fingerprint;
#[cfg(feature = "tonic")]
pub mod grpc;
#[cfg(any(feature = "axum", feature = "reqwest"))]
mod headers;
mod hex;
#[cfg(feature = "axum")]
pub mod http;
mod key;
pub mod observe;
mod outcome;
mod random;
mod replayable;
#[cfg(any(feature = "reqwest", feature = "tonic"))]
mod retry;
mod scope;
mod setters;
mod step;
mod store;
pub mod stores;

pub use call::{Call, DEFAULT_LEASE, DEFAULT_RETENTION, MAX_LEASE, MAX_RETENTION, MAX_WAIT, MIN_LEASE, OnCancel};
pub use context::{derived_key, without_derived_keys};
pub use detached::Detached;
pub use error::{Error, StoreError};
pub use fingerprint::Fingerprint;
pub use key::{IdempotencyKey, Key, KeyError, MAX_KEY_BYTES, Scope};
pub use outcome::{ErrorPolicy, RecordErrors, RecordErrorsIf, ReleaseErrors};
pub use replayable::Replayable;
pub use step::step;
pub use store::{
    BatchAnswers, Claim, ClaimRequest, Claimant, Completion, DEFAULT_MAX_RECORD_BYTES, Record, Store, Token,
};
pub use stores::AnyStore;
pub use stores::memory::MemoryStore;
#[cfg(feature = "redis-cluster")]
pub use stores::redis::RedisClusterStore;
#[cfg(feature = "redis")]
pub use stores::redis::RedisStore;
#[cfg(feature = "mysql")]
pub use stores::sql::{MySqlStore, MySqlTxStore};
#[cfg(feature = "postgres")]
pub use stores::sql::{PostgresStore, PostgresTxStore};
#[cfg(feature = "sqlite")]
pub use stores::sql::{SqliteStore, SqliteTxStore};

#[doc(inline)]
pub use idempotent_macros::idempotent;

/// What the attribute's expansion refers to. Not a public API: it may change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::expansion::{AsStore, CarriesErrors, Output, RecordsErrors, ResultType, check_result};
    pub use crate::scope::Site;
    pub use crate::{Call, OnCancel, RecordErrors, RecordErrorsIf, ReleaseErrors, Scope};
    pub use core::time::Duration;
}
