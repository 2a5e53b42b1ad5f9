//! Calling another service: outbound requests that are safe to retry (feature `reqwest`).
//!
//! A request that times out may have run on the server; sending it again runs it again, unless
//! it carries the same `Idempotency-Key` as the first attempt and the server honours it (as
//! [`IdempotencyLayer`](crate::http::IdempotencyLayer) does). A fresh key per attempt makes every
//! retry a new request. [`IdempotentRetry`] is `reqwest-middleware` middleware that gives each
//! `POST` and `PATCH` one key and retries it, with that key: no response, `408`, `409`, `429` or a
//! `5xx` that is not a replay. That is safe against a server that honours the key (see
//! [what it retries, and why that is safe](IdempotentRetry#what-it-retries-and-why-that-is-safe)):
//! the server runs the request once and answers every later attempt with its record.
//!
//! ```no_run
//! use idempotent_runtime::client::{IdempotentRetry, OutboundError, RetryPolicy};
//! use reqwest_middleware::ClientBuilder;
//!
//! # async fn demo() -> Result<(), reqwest_middleware::Error> {
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotentRetry::new(RetryPolicy::default()))
//!     .build();
//! match client.post("http://127.0.0.1:3000/orders").body(r#"{"item":"book"}"#).send().await {
//!     Ok(response) => println!("{} (replayed: {:?})", response.status(), response.headers().get("idempotent-replayed")),
//!     Err(error) => match OutboundError::find(&error) {
//!         Some(e) => eprintln!("{e}; the key was {}", e.key()),
//!         None => eprintln!("{error}"),
//!     },
//! }
//! # Ok(()) }
//! ```
//!
//! The `reqwest` this feature depends on has no TLS backend of its own: enable one (`rustls`) on
//! your own `reqwest` dependency.

mod error;
mod middleware;
mod policy;

pub use crate::headers::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
pub use crate::retry::{
    Attempts, DEFAULT_INITIAL_BACKOFF, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_BACKOFF, DEFAULT_MAX_ELAPSED, RetryPolicy,
    Stopped,
};
pub use error::OutboundError;
pub use middleware::IdempotentRetry;
pub use policy::{is_retryable_status, retry_after};
