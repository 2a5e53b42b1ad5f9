//! The one error type callers see, and the error type stores return.

use std::time::Duration;

use crate::key::KeyError;

/// Everything that can stop an idempotent call from running its body or returning a recorded result.
///
/// The function under `#[idempotent]` turns it into its own error type through `From<Error>`, so
/// callers usually match on it after downcasting their own error, for example:
///
/// ```
/// use idempotent_runtime::Error;
///
/// #[derive(Debug)]
/// enum PayError {
///     Idempotency(Error),
///     Insufficient,
/// }
///
/// impl From<Error> for PayError {
///     fn from(e: Error) -> Self {
///         PayError::Idempotency(e)
///     }
/// }
///
/// fn should_retry_later(e: &PayError) -> bool {
///     matches!(e, PayError::Idempotency(e) if e.is_retryable())
/// }
/// # assert!(!should_retry_later(&PayError::Insufficient));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key is empty, too long or holds control characters. The body did not run.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(#[from] KeyError),

    /// Another call with the same key is running now. The body did not run.
    #[error(
        "a call with idempotency key {key:?} is already in progress; retry later to receive its result{}",
        retry_hint(*retry_after)
    )]
    InProgress {
        /// The key, as `scope:key`.
        key: String,
        /// How long the running call's lease still lasts, when the store knows it.
        retry_after: Option<Duration>,
    },

    /// The key was used before with a different request. The body did not run.
    #[error(
        "idempotency key {key:?} was already used with a different request (fingerprint mismatch); \
         use a new key for a new request"
    )]
    FingerprintMismatch {
        /// The key, as `scope:key`.
        key: String,
    },

    /// This call's lease ran out while its body ran and another caller took the key over; the result
    /// was not recorded so as not to overwrite the new owner's. Make the lease longer than the body takes.
    #[error(
        "the claim on idempotency key {key:?} expired while the body ran and another caller took it over; \
         this result was not recorded. Set a `lease` longer than the body can take"
    )]
    LeaseLost {
        /// The key, as `scope:key`.
        key: String,
    },

    /// The store could not be reached or failed. Nothing ran (at `claim`), or the result was not
    /// recorded (at `complete`).
    #[error("idempotency store failed during {operation} of key {key:?}: {source}")]
    Store {
        /// The key, as `scope:key`.
        key: String,
        /// The protocol step: `claim`, `complete` or `release`.
        operation: &'static str,
        /// What the store reported.
        #[source]
        source: StoreError,
    },

    /// The first call ran, but its result could not be recorded (too large, or not serialisable), so
    /// it cannot be replayed. The body did not run again.
    #[error(
        "idempotency key {key:?} was executed, but its result could not be recorded ({reason}); \
         it will not run again under this key: use a new key to run it again"
    )]
    Unrecordable {
        /// The key, as `scope:key`.
        key: String,
        /// Why the result was not recorded.
        reason: String,
    },

    /// The recorded result cannot be decoded as this function's return type (did the type change?).
    /// The body did not run.
    #[error(
        "the recorded result of idempotency key {key:?} cannot be decoded as this function's return type \
         ({reason}); was the type changed since it was recorded? Use a new key or a new scope"
    )]
    Decode {
        /// The key, as `scope:key`.
        key: String,
        /// What the decoder said.
        reason: String,
    },

    /// The `fingerprint` value could not be serialised. The body did not run.
    #[error("the request fingerprint could not be computed: {0}; fingerprint a serialisable value")]
    Fingerprint(String),

    /// A `lease` or `retention` that cannot keep the promise (for example a zero lease, which would
    /// let duplicates run at once). The body did not run.
    #[error("invalid `{option}` for idempotency key {key:?}: {reason}")]
    InvalidOption {
        /// The key, as `scope:key`.
        key: String,
        /// The option at fault: `lease` or `retention`.
        option: &'static str,
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// Two different functions of this process arrived at the same default scope, so they would
    /// share records. The body did not run.
    #[error(
        "the functions at {first} and {second} both use the idempotency scope {scope:?}, so they would          share records; give at least one of them its own `scope = \"...\"`"
    )]
    ScopeCollision {
        /// The shared scope.
        scope: String,
        /// Where the function that used the scope first is defined (`file:line:column`).
        first: String,
        /// Where the refused function is defined.
        second: String,
    },
}

fn retry_hint(retry_after: Option<Duration>) -> String {
    match retry_after {
        Some(d) => format!(" (its lease ends in {} ms at the latest)", d.as_millis()),
        None => String::new(),
    }
}

impl Error {
    /// `true` when retrying the same call later may succeed: an in-progress duplicate or a store outage.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::InProgress { .. } | Error::Store { .. })
    }
}

/// What a [`Store`](crate::Store) reports when an operation fails.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Completion or release was refused: the caller's token no longer owns the key (its lease ran out
    /// and someone else claimed it, or the record is gone).
    #[error("the caller no longer owns the claim (lease expired and was taken over)")]
    NotOwner,

    /// The backend failed: connection refused or lost, timeout, SQL error.
    #[error("{backend} error: {source}")]
    Backend {
        /// Which store: `redis`, `postgres`, `mysql`, `sqlite`, ...
        backend: &'static str,
        /// The backend's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// A stored record does not have the documented shape (written by something else?).
    #[error("corrupt idempotency record: {0}")]
    Corrupt(String),
}

impl StoreError {
    /// Wraps a backend's error.
    pub fn backend(backend: &'static str, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError::Backend { backend, source: source.into() }
    }
}
