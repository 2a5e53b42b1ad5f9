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

    /// The body ran, but while its claim had lapsed (its lease ended without a renewal, because the
    /// store could not be reached for a whole lease) another caller took the key over, so this
    /// result was not recorded: it would have overwritten the new owner's. The body may have run
    /// twice. A completion that nobody contested is recorded, however late; this error means a
    /// takeover really happened.
    #[error(
        "idempotency key {key:?} was taken over by another caller while this call's claim had lapsed \
         (its lease ended without a renewal: the store was unreachable for a whole lease), so this result \
         was not recorded and the body may have run twice; keep the lease well above the store's \
         outage and pool waits"
    )]
    LeaseLost {
        /// The key, as `scope:key`.
        key: String,
    },

    /// The store failed. At `claim`, the body did not run (a retry may succeed later). At
    /// `complete`, the body ran but its result could not be recorded: this is returned only by a
    /// transactional store ([`StoreError::Aborted`]), whose transaction must then be rolled back;
    /// other stores return the body's result and log the failure (see the crate docs' limits).
    #[error("idempotency store failed during {operation} of key {key:?}: {source}")]
    Store {
        /// The key, as `scope:key`.
        key: String,
        /// The protocol step: `claim` or `complete`.
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

    /// A `lease`, `retention` or `wait` that cannot keep the promise (for example a zero lease,
    /// which would let duplicates run at once, or one so long that its end cannot be computed).
    /// The body did not run.
    #[error("invalid `{option}` for idempotency key {key:?}: {reason}")]
    InvalidOption {
        /// The key, as `scope:key`.
        key: String,
        /// The option at fault: `lease`, `retention` or `wait`.
        option: &'static str,
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// Two different functions of this process (or one trait default method called for two
    /// `Self` types) arrived at the same default scope, so they would share records. The body did
    /// not run.
    #[error(
        "the functions at {first} and {second} both use the default idempotency scope {scope:?}, so they \
         would share records; give at least one of them its own `scope = \"...\"`, or put `#[idempotent]` \
         on their impl blocks to name each type in its methods' scopes"
    )]
    ScopeCollision {
        /// The shared scope.
        scope: String,
        /// Where the function that used the scope first is defined (`file:line:column`, and the
        /// `Self` type for a method).
        first: String,
        /// Where the refused function is defined.
        second: String,
    },

    /// [`step`](crate::step) was called outside the body of an idempotent call (or in a task the
    /// body spawned, or inside [`without_derived_keys`](crate::without_derived_keys)), where there
    /// is no call to record it under. The step did not run.
    #[error(
        "step {name:?} runs outside an idempotent body, so it has no call to be recorded under; call it from \
         the body itself (not from a task the body spawned)"
    )]
    StepOutsideCall {
        /// The step's name.
        name: String,
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
    /// The step was refused: another token holds the key (completion), or this token's lease has
    /// ended or its claim is gone (renewal, release).
    #[error("the caller does not own the claim (its lease ended, or another caller holds the key)")]
    NotOwner,

    /// The backend failed or could not be reached (connection refused or lost, a timeout, a
    /// server busy or restarting): the same step may succeed if tried again.
    #[error("{backend} error: {source}")]
    Backend {
        /// Which store: `redis`, `postgres`, `mysql`, `sqlite`, ...
        backend: &'static str,
        /// The backend's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The backend refused the step itself (a value it cannot store, a constraint or trigger that
    /// rejects the write, a missing table): trying the same step again cannot succeed, so the
    /// protocol does not retry it.
    #[error("{backend} refused the operation: {source}")]
    Rejected {
        /// Which store.
        backend: &'static str,
        /// The backend's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The transaction a transactional store works in cannot commit this call's work: the
    /// completion failed inside it, or it was aborted before. The caller must roll it back (its
    /// business writes did not happen as far as anyone else will see); a retry in a new
    /// transaction runs the body again.
    #[error("the {backend} transaction cannot commit this call (roll it back and retry): {source}")]
    Aborted {
        /// Which store.
        backend: &'static str,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The store is full: it refuses new claims until records expire (a bounded in-process
    /// store at its bound).
    #[error("the idempotency store is full ({0}); new keys are refused until records expire")]
    Full(String),

    /// A stored record does not have the documented shape (written by something else?).
    #[error("corrupt idempotency record: {0}")]
    Corrupt(String),
}

/// The error of a batch that failed as a whole, to be copied into each of its steps' answers: a
/// [`StoreError`]'s source is not `Clone`, so the copies share it.
pub(crate) enum BatchFailure {
    NotOwner,
    Backend(&'static str, Source),
    Rejected(&'static str, Source),
    Aborted(&'static str, Source),
    Full(String),
    Corrupt(String),
}

type Source = std::sync::Arc<dyn std::error::Error + Send + Sync>;

impl From<StoreError> for BatchFailure {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::NotOwner => BatchFailure::NotOwner,
            StoreError::Backend { backend, source } => BatchFailure::Backend(backend, Source::from(source)),
            StoreError::Rejected { backend, source } => BatchFailure::Rejected(backend, Source::from(source)),
            StoreError::Aborted { backend, source } => BatchFailure::Aborted(backend, Source::from(source)),
            StoreError::Full(text) => BatchFailure::Full(text),
            StoreError::Corrupt(text) => BatchFailure::Corrupt(text),
        }
    }
}

impl BatchFailure {
    /// One copy of the error.
    pub(crate) fn error(&self) -> StoreError {
        let shared = |source: &Source| Box::new(std::sync::Arc::clone(source));
        match self {
            BatchFailure::NotOwner => StoreError::NotOwner,
            BatchFailure::Backend(backend, source) => StoreError::Backend { backend, source: shared(source) },
            BatchFailure::Rejected(backend, source) => StoreError::Rejected { backend, source: shared(source) },
            BatchFailure::Aborted(backend, source) => StoreError::Aborted { backend, source: shared(source) },
            BatchFailure::Full(text) => StoreError::Full(text.clone()),
            BatchFailure::Corrupt(text) => StoreError::Corrupt(text.clone()),
        }
    }
}

impl StoreError {
    /// Wraps a backend's error that trying again may cure ([`StoreError::Backend`]).
    pub fn backend(backend: &'static str, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError::Backend { backend, source: source.into() }
    }

    /// Wraps a backend's refusal of the step itself ([`StoreError::Rejected`]).
    pub fn rejected(backend: &'static str, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError::Rejected { backend, source: source.into() }
    }

    /// `true` when the same step may succeed if sent again: a backend failure or a full store.
    /// The protocol retries only these while the lease lasts.
    #[must_use]
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Backend { .. } | StoreError::Full(_))
    }
}
