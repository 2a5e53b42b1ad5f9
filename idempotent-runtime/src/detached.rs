//! Steps left to finish after their caller's future is gone: a release after a panic or a
//! cancellation, a completion interrupted by a drop.

use std::time::Duration;

use crate::call::{Completed, complete_renewed};
use crate::{Completion, Fingerprint, Key, Store, StoreError, Token};

/// A protocol step that must still reach the store although the call that began it was dropped.
///
/// The protocol hands it to [`Store::detach`]. A store that can work without its caller spawns
/// [`finish`](Detached::finish) on the runtime (see [`spawn_detached`]); an in-memory store does
/// the step at once.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Detached {
    /// Delete the claim `token` holds on `key`: the body panicked, failed without being recorded,
    /// or was cancelled under `on_cancel = "release"`, or the call was dropped while claiming.
    Release {
        /// The claimed key.
        key: Key,
        /// The claim's owner token.
        token: Token,
    },
    /// Record `outcome` for `key`: the body finished, but its caller was dropped before the record
    /// was written. Renewed like a foreground completion, up to `lease_end`, and retried until a
    /// lease after it, the latest the claim, renewed up to then, can be live; without `renew_by`,
    /// neither renewed nor retried past `lease_end`.
    Complete {
        /// The claimed key.
        key: Key,
        /// The claim's owner token.
        token: Token,
        /// The request's fingerprint, as claimed.
        fingerprint: Option<Fingerprint>,
        /// The encoded outcome.
        outcome: Vec<u8>,
        /// How long the record is replayed.
        retention: Duration,
        /// The end of the lease the claim held when recording began, by the caller's estimate
        /// (never later than the store's): no renewal is sent from then on.
        lease_end: tokio::time::Instant,
        /// The lease to renew the claim by while the completion is in flight; `None` if the claim
        /// was found lapsed before recording began (it is then not renewed).
        renew_by: Option<Duration>,
    },
}

impl Detached {
    /// The key the step is about.
    #[must_use]
    pub fn key(&self) -> &Key {
        match self {
            Detached::Release { key, .. } | Detached::Complete { key, .. } => key,
        }
    }

    /// The completion this step makes, if it is one.
    #[must_use]
    pub fn completion(&self) -> Option<Completion<'_>> {
        match self {
            Detached::Release { .. } => None,
            Detached::Complete { key, token, fingerprint, outcome, retention, .. } => {
                Some(Completion::new(key, token, fingerprint.as_ref(), outcome, *retention))
            }
        }
    }

    /// Does the step on `store`: one release, or a completion whose transient failures are
    /// retried with back-off, the claim renewed meanwhile (`renew_by`) until the lease it held
    /// when recording began would have ended, and the completion retried until a lease after
    /// that (the latest the claim can be live; without `renew_by`, until that end).
    pub async fn finish<S: Store + ?Sized>(self, store: &S) -> Result<(), StoreError> {
        match self {
            Detached::Release { key, token } => store.release(&key, &token).await,
            Detached::Complete { key, token, fingerprint, outcome, retention, lease_end, renew_by } => {
                let completion = Completion::new(&key, &token, fingerprint.as_ref(), &outcome, retention);
                match complete_renewed(store, &completion, renew_by, lease_end).await {
                    Completed::Recorded { .. } => Ok(()),
                    Completed::LeaseLost => Err(StoreError::NotOwner),
                    Completed::Failed(error) => Err(error),
                }
            }
        }
    }
}

/// Spawns `step.finish(&store)` on the current Tokio runtime; the default way for a remote store
/// to implement [`Store::detach`]. Outside a runtime the step is dropped and the claim ends with
/// its lease. Failures are logged under the target `idempotent`.
///
/// ```
/// use idempotent_runtime::stores::spawn_detached;
/// use idempotent_runtime::{Detached, Store};
///
/// #[derive(Clone)]
/// struct MyStore { /* a pool or a client handle */ }
/// # impl Store for MyStore {
/// #     async fn claim(&self, _: &idempotent_runtime::ClaimRequest<'_>) -> Result<idempotent_runtime::Claim, idempotent_runtime::StoreError> { unimplemented!() }
/// #     async fn complete(&self, _: &idempotent_runtime::Completion<'_>) -> Result<(), idempotent_runtime::StoreError> { unimplemented!() }
/// #     async fn release(&self, _: &idempotent_runtime::Key, _: &idempotent_runtime::Token) -> Result<(), idempotent_runtime::StoreError> { unimplemented!() }
/// #     async fn extend(&self, _: &idempotent_runtime::Key, _: &idempotent_runtime::Token, _: std::time::Duration) -> Result<(), idempotent_runtime::StoreError> { unimplemented!() }
/// fn detach(&self, step: Detached) {
///     spawn_detached(self.clone(), step);
/// }
/// # }
/// ```
pub fn spawn_detached<S: Store + 'static>(store: S, step: Detached) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::warn!(
            target: "idempotent", scope = step.key().scope(),
            "no Tokio runtime to finish a detached step on; the claim ends with its lease"
        );
        return;
    };
    // In the span of the call that left the step (keys stay out of logs: they can be secrets).
    let task = async move {
        let key = step.key().clone();
        let what = match &step {
            Detached::Release { .. } => "release",
            Detached::Complete { .. } => "completion",
        };
        match step.finish(&store).await {
            Ok(()) => tracing::debug!(target: "idempotent", scope = key.scope(), what, "detached step done"),
            Err(e) => tracing::warn!(
                target: "idempotent", scope = key.scope(), what, error = %e,
                "detached step failed; the claim ends with its lease"
            ),
        }
    };
    runtime.spawn(tracing::Instrument::in_current_span(task));
}
