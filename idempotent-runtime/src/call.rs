//! The protocol: check → claim → execute → record, shared by the attribute, the HTTP layer and
//! hand-written calls.

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::outcome::{self, ErrorPolicy, ReleaseErrors, Replayed};
use crate::{Claim, ClaimRequest, Error, Fingerprint, IdempotencyKey, Key, Store, StoreError, Token};

/// How long a claim lasts when its caller neither completes nor releases it (60 s).
pub const DEFAULT_LEASE: Duration = Duration::from_mins(1);
/// How long a completed result is replayed (24 h).
pub const DEFAULT_RETENTION: Duration = Duration::from_hours(24);

const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_millis(100);
const MAX_COMPLETE_BACKOFF: Duration = Duration::from_secs(1);

/// One idempotent call, built by hand or by the `#[idempotent]` attribute.
///
/// Errors in the key or the fingerprint are kept until [`run`](Call::run), which returns them
/// without running the body.
///
/// ```
/// use idempotent_runtime::{Call, Error, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let store = MemoryStore::new();
/// let charge = |amount: i64| {
///     Call::new("charges", &"req-1")
///         .fingerprint(&amount)
///         .run(&store, async move { Ok::<_, Error>(format!("charged {amount}")) })
/// };
/// assert_eq!(charge(100).await.unwrap(), "charged 100");
/// // A retry replays the recorded receipt; the same key with another amount is refused.
/// assert_eq!(charge(100).await.unwrap(), "charged 100");
/// assert!(matches!(charge(5).await, Err(Error::FingerprintMismatch { .. })));
/// # }
/// ```
#[derive(Debug)]
#[must_use = "a Call does nothing until `run`"]
pub struct Call {
    prepared: Result<(Key, Option<Fingerprint>), Error>,
    lease: Duration,
    retention: Duration,
    wait: Option<Duration>,
}

impl Call {
    /// A call with `key` inside `scope` (a stable name for the operation, such as `"payments"`).
    pub fn new(scope: &str, key: &(impl IdempotencyKey + ?Sized)) -> Self {
        Call {
            prepared: Key::new(scope, key).map(|k| (k, None)).map_err(Error::from),
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            wait: None,
        }
    }

    /// Rejects a reused key whose request differs: `value` is hashed (see [`Fingerprint::of`]).
    pub fn fingerprint(self, value: &(impl Serialize + ?Sized)) -> Self {
        let fingerprint = Fingerprint::of(value).map_err(|e| Error::Fingerprint(e.to_string()));
        self.with_fingerprint(fingerprint)
    }

    /// Like [`fingerprint`](Call::fingerprint), with a fingerprint computed elsewhere.
    pub fn with_fingerprint(mut self, fingerprint: Result<Fingerprint, Error>) -> Self {
        self.prepared = match (self.prepared, fingerprint) {
            (Ok((key, _)), Ok(fp)) => Ok((key, Some(fp))),
            (Err(e), _) | (_, Err(e)) => Err(e),
        };
        self
    }

    /// How long a claim lasts if its caller dies (default [`DEFAULT_LEASE`]). Make it longer than
    /// the body can take: after it, a duplicate takes over and runs the body again.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long the completed result is replayed (default [`DEFAULT_RETENTION`]).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Makes a concurrent duplicate wait up to `wait` for the running call and replay its result,
    /// instead of failing at once with [`Error::InProgress`].
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Runs `body` at most once for this key; `Err` results release the key.
    pub async fn run<S, T, E, F>(self, store: &S, body: F) -> Result<T, E>
    where
        S: Store + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        F: Future<Output = Result<T, E>>,
    {
        self.run_with(store, ReleaseErrors, body).await
    }

    /// Runs `body` at most once for this key, recording the errors `policy` chooses.
    pub async fn run_with<S, T, E, P, F>(self, store: &S, policy: P, body: F) -> Result<T, E>
    where
        S: Store + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        P: ErrorPolicy<E>,
        F: Future<Output = Result<T, E>>,
    {
        let (key, fingerprint) = self.prepared?;
        let token = Token::new();
        let request = ClaimRequest { key: &key, token: &token, fingerprint: fingerprint.as_ref(), lease: self.lease };
        let deadline = self.wait.map(|wait| tokio::time::Instant::now() + wait);
        let mut backoff = FIRST_BACKOFF;
        // The lease is counted from before the claim request, so our estimate of its end is never late.
        let mut lease_end;
        loop {
            lease_end = tokio::time::Instant::now() + self.lease;
            let claim = store.claim(&request).await.map_err(|source| store_error(&key, "claim", source))?;
            match claim {
                Claim::Claimed => break,
                Claim::Completed(record) => {
                    check_fingerprint(&key, fingerprint.as_ref(), record.fingerprint.as_ref())?;
                    return replay(&key, &record.outcome, &policy);
                }
                Claim::InProgress { fingerprint: running, lease_remaining } => {
                    check_fingerprint(&key, fingerprint.as_ref(), running.as_ref())?;
                    let now = tokio::time::Instant::now();
                    match deadline {
                        Some(deadline) if now < deadline => {
                            tokio::time::sleep(backoff.min(deadline - now)).await;
                            backoff = (backoff * 2).min(MAX_BACKOFF);
                        }
                        _ => {
                            tracing::debug!(target: "idempotent", key = %key, "in progress");
                            return Err(Error::InProgress { key: key.to_string(), retry_after: lease_remaining }.into());
                        }
                    }
                }
            }
        }

        let guard = ReleaseOnDrop { store, key: &key, token: &token };
        let result = body.await;
        std::mem::forget(guard);
        record(store, &key, &token, self.retention, lease_end, &policy, result).await
    }
}

fn store_error(key: &Key, operation: &'static str, source: StoreError) -> Error {
    Error::Store { key: key.to_string(), operation, source }
}

fn check_fingerprint(key: &Key, ours: Option<&Fingerprint>, theirs: Option<&Fingerprint>) -> Result<(), Error> {
    match (ours, theirs) {
        (Some(ours), Some(theirs)) if ours != theirs => {
            tracing::warn!(target: "idempotent", key = %key, "fingerprint mismatch: key reused with a different request");
            Err(Error::FingerprintMismatch { key: key.to_string() })
        }
        _ => Ok(()),
    }
}

fn replay<T: DeserializeOwned, E: From<Error>>(
    key: &Key,
    outcome: &[u8],
    policy: &impl ErrorPolicy<E>,
) -> Result<T, E> {
    match outcome::decode(outcome, policy) {
        Ok(Replayed::Value(result)) => {
            tracing::debug!(target: "idempotent", key = %key, ok = result.is_ok(), "replayed");
            result
        }
        Ok(Replayed::Unrecordable(reason)) => Err(Error::Unrecordable { key: key.to_string(), reason }.into()),
        Err(reason) => Err(Error::Decode { key: key.to_string(), reason }.into()),
    }
}

/// Records the body's result (or releases the key) and hands the result back to the caller.
async fn record<S, T, E>(
    store: &S,
    key: &Key,
    token: &Token,
    retention: Duration,
    lease_end: tokio::time::Instant,
    policy: &impl ErrorPolicy<E>,
    result: Result<T, E>,
) -> Result<T, E>
where
    S: Store + ?Sized,
    T: Serialize,
    E: From<Error>,
{
    let encoded = match &result {
        Ok(value) => Some(outcome::encode_ok(value)),
        Err(error) => policy.encode(error),
    };
    let outcome = match encoded {
        None => {
            match store.release(key, token).await {
                Ok(()) => tracing::debug!(target: "idempotent", key = %key, "released after an error"),
                Err(e) => tracing::warn!(
                    target: "idempotent", key = %key, error = %e,
                    "could not release the claim after an error; it frees itself when its lease ends"
                ),
            }
            return result;
        }
        Some(Ok(bytes)) if bytes.len() <= store.max_record_bytes() => bytes,
        Some(Ok(bytes)) => unrecordable(
            key,
            &format!("its encoding is {} bytes, over the store's limit of {}", bytes.len(), store.max_record_bytes()),
        ),
        Some(Err(e)) => unrecordable(key, &format!("it failed to serialise: {e}")),
    };
    // A failed completion is retried while the claim's lease lasts: the claim keeps duplicates out
    // meanwhile, and completion is fenced by the token, so a retry can never overwrite another
    // owner's record.
    let mut backoff = FIRST_BACKOFF;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        match store.complete(key, token, &outcome, retention).await {
            Ok(()) => {
                tracing::debug!(target: "idempotent", key = %key, ok = result.is_ok(), attempts, "executed and recorded");
                return result;
            }
            // After an attempt whose reply was lost, `NotOwner` may mean that attempt recorded it.
            Err(StoreError::NotOwner) if attempts > 1 => {
                tracing::warn!(target: "idempotent", key = %key, attempts, "completion retried: an earlier attempt recorded it, or the lease was lost");
                return result;
            }
            Err(StoreError::NotOwner) => return Err(Error::LeaseLost { key: key.to_string() }.into()),
            Err(e) if tokio::time::Instant::now() + backoff < lease_end => {
                tracing::warn!(target: "idempotent", key = %key, error = %e, attempts, "recording the result failed; retrying within the lease");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_COMPLETE_BACKOFF);
            }
            Err(e) => {
                tracing::error!(
                    target: "idempotent", key = %key, error = %e, attempts,
                    "the body ran but its result could not be recorded within the lease; duplicates after the lease will run again"
                );
                return result;
            }
        }
    }
}

fn unrecordable(key: &Key, reason: &str) -> Vec<u8> {
    tracing::error!(target: "idempotent", key = %key, reason, "result not recorded; replays will get Error::Unrecordable");
    outcome::encode_unrecordable(reason)
}

/// Releases the claim if the body panics or its future is dropped before it finishes.
struct ReleaseOnDrop<'a, S: Store + ?Sized> {
    store: &'a S,
    key: &'a Key,
    token: &'a Token,
}

impl<S: Store + ?Sized> Drop for ReleaseOnDrop<'_, S> {
    fn drop(&mut self) {
        tracing::debug!(target: "idempotent", key = %self.key, "released: the body panicked or was cancelled");
        self.store.release_detached(self.key, self.token);
    }
}
