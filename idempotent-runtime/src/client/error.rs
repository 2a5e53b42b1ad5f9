//! The middleware's typed errors, and what it notes on the responses it returns.

use std::time::Duration;

/// Why [`IdempotentRetry`](super::IdempotentRetry) returned an error instead of a response.
///
/// It reaches the caller as `reqwest_middleware::Error::Middleware`; [`OutboundError::find`]
/// gets it back:
///
/// ```
/// use idempotent_runtime::client::OutboundError;
///
/// fn explain(error: &reqwest_middleware::Error) -> String {
///     match OutboundError::find(error) {
///         Some(OutboundError::KeyReused { key, .. }) => format!("bug: key {key} reused for another request"),
///         Some(e @ OutboundError::GaveUp { .. }) => format!("retry later with the same key ({})", e.key()),
///         Some(other) => other.to_string(),
///         None => error.to_string(),
///     }
/// }
/// # let _ = explain;
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboundError {
    /// The server answered `422` with the problem type `urn:idempotent:key-reused`: it has seen
    /// this key with a *different* request (method, path or body). A retry never changes that; the
    /// request is not retried. Another `422` (the handler's own) is returned as a response.
    #[error(
        "the server refused Idempotency-Key {key:?} for {url} with 422: the key was already used with a \
         different request (method, path or body differ). Send a new key for a new request, and reuse a key \
         only to retry the very same request{}",
        detail.as_deref().map(|d| format!(" (server: {d})")).unwrap_or_default()
    )]
    KeyReused {
        /// The key that was sent.
        key: String,
        /// The request's URL.
        url: String,
        /// The server's explanation (the problem's `detail`, or the start of the body), if any.
        detail: Option<String>,
    },

    /// Every attempt failed without a response (connection refused or lost, timeout) until the
    /// attempts or the time budget ran out. The request may or may not have run on the server:
    /// send it again later **with the same key** to find out (the server replays it if it ran).
    #[error(
        "{url}: no response after {attempts} attempt(s) in {} ms with Idempotency-Key {key:?}; it may have run: \
         retry later with the same key (the server replays it if it ran): {source}",
        elapsed.as_millis()
    )]
    GaveUp {
        /// The key every attempt carried.
        key: String,
        /// The request's URL.
        url: String,
        /// How many attempts were made.
        attempts: u32,
        /// The time from the first attempt to the last failure.
        elapsed: Duration,
        /// The last attempt's error.
        #[source]
        source: Box<reqwest_middleware::Error>,
    },

    /// The request failed without a response and was not retried because its body is a stream,
    /// which can be sent only once.
    #[error(
        "{url}: the request failed and was not retried because its body is a stream, which cannot be sent \
         twice; send a buffered body (bytes, text, JSON) to have it retried, or send it again yourself with the \
         same Idempotency-Key {key:?}: {source}"
    )]
    NotReplayable {
        /// The key the request carried.
        key: String,
        /// The request's URL.
        url: String,
        /// The error of the one attempt.
        #[source]
        source: Box<reqwest_middleware::Error>,
    },
}

impl OutboundError {
    /// The `OutboundError` inside a `reqwest_middleware::Error`, if it holds one.
    #[must_use]
    pub fn find(error: &reqwest_middleware::Error) -> Option<&OutboundError> {
        match error {
            reqwest_middleware::Error::Middleware(inner) => inner.downcast_ref(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }

    /// The `Idempotency-Key` the request carried.
    #[must_use]
    pub fn key(&self) -> &str {
        match self {
            OutboundError::KeyReused { key, .. }
            | OutboundError::GaveUp { key, .. }
            | OutboundError::NotReplayable { key, .. } => key,
        }
    }
}
