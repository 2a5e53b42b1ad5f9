//! Planted bugs: a store wrapper that breaks one rule of the `Store` contract on purpose, so the
//! tests can show the oracle catches each of them.
//!
//! With no bug switched on it forwards every step unchanged. It remembers which token last claimed
//! each key (the "holder"), which is what a bug that ignores tokens acts on.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use idempotent_runtime::{Claim, ClaimRequest, Completion, Detached, Key, Store, StoreError, Token};
use tokio::time::Instant;

/// One planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bug {
    /// A claim that finds another token's live claim takes the key anyway.
    ClaimLetsSecondIn,
    /// A refused completion overwrites the key's holder (no token fence).
    CompleteUnfenced,
    /// A refused completion is reported as recorded.
    CompleteFailureAsSuccess,
    /// A completion after this token's lease ended is refused although nobody took the key over.
    CompleteRefusedAfterLease,
    /// The recorded bytes differ from the outcome (one trailing space), and it is acknowledged.
    RecordCorrupted,
    /// The completion is acknowledged but nothing is recorded (the claim is deleted instead).
    RecordDropped,
    /// A release deletes whoever holds the key, not only this token's claim.
    ReleaseIgnoresToken,
    /// A release is acknowledged but does nothing.
    ReleaseDropped,
    /// Renewals after a token's first one are acknowledged but do nothing.
    HeartbeatStopsAfterFirst,
    /// A refused renewal is acknowledged (and renews the holder's claim instead).
    ExtendForeignToken,
}

impl Bug {
    /// Every planted bug.
    pub const ALL: [Bug; 10] = [
        Bug::ClaimLetsSecondIn,
        Bug::CompleteUnfenced,
        Bug::CompleteFailureAsSuccess,
        Bug::CompleteRefusedAfterLease,
        Bug::RecordCorrupted,
        Bug::RecordDropped,
        Bug::ReleaseIgnoresToken,
        Bug::ReleaseDropped,
        Bug::HeartbeatStopsAfterFirst,
        Bug::ExtendForeignToken,
    ];
}

/// A store that forwards to `inner`, except where its planted bug says otherwise.
#[derive(Debug)]
pub struct Planted<S> {
    inner: S,
    bug: Option<Bug>,
    state: Mutex<Seen>,
}

#[derive(Debug, Default)]
struct Seen {
    /// Key → the token that last claimed it, and when its lease ends by our count.
    holders: HashMap<String, (Token, Instant)>,
    /// Token → how many renewals it was granted.
    renewals: HashMap<Token, u32>,
}

impl<S: Store> Planted<S> {
    /// `inner` with `bug` planted (or none).
    pub fn new(inner: S, bug: Option<Bug>) -> Self {
        Planted { inner, bug, state: Mutex::new(Seen::default()) }
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The token that last claimed `key`, if it is not `ours`.
    fn other_holder(&self, key: &Key, ours: &Token) -> Option<Token> {
        self.seen().holders.get(key.as_str()).map(|(t, _)| t.clone()).filter(|t| t != ours)
    }

    fn note_lease(&self, key: &Key, token: &Token, lease: Duration) {
        self.seen().holders.insert(key.as_str().to_owned(), (token.clone(), Instant::now() + lease));
    }
}

impl<S: Store> Store for Planted<S> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let mut claim = self.inner.claim(request).await;
        if self.bug == Some(Bug::ClaimLetsSecondIn)
            && matches!(claim, Ok(Claim::InProgress { .. }))
            && let Some(holder) = self.other_holder(request.key, request.token)
        {
            let _ = self.inner.release(request.key, &holder).await;
            claim = self.inner.claim(request).await;
        }
        if matches!(claim, Ok(Claim::Claimed)) {
            self.note_lease(request.key, request.token, request.lease);
        }
        claim
    }

    async fn complete(&self, c: &Completion<'_>) -> Result<(), StoreError> {
        match self.bug {
            Some(Bug::RecordCorrupted) => {
                let mut corrupted = c.outcome.to_vec();
                corrupted.push(b' ');
                let changed = Completion::new(c.key, c.token, c.fingerprint, &corrupted, c.retention);
                return self.inner.complete(&changed).await;
            }
            Some(Bug::RecordDropped) => {
                let _ = self.inner.release(c.key, c.token).await;
                return Ok(());
            }
            Some(Bug::CompleteRefusedAfterLease) => {
                let ended = self
                    .seen()
                    .holders
                    .get(c.key.as_str())
                    .is_some_and(|(t, end)| t == c.token && *end <= Instant::now());
                if ended {
                    return Err(StoreError::NotOwner);
                }
            }
            _ => {}
        }
        let result = self.inner.complete(c).await;
        match (self.bug, &result) {
            (Some(Bug::CompleteUnfenced), Err(StoreError::NotOwner)) => match self.other_holder(c.key, c.token) {
                Some(holder) => {
                    let overwrite = Completion::new(c.key, &holder, c.fingerprint, c.outcome, c.retention);
                    self.inner.complete(&overwrite).await
                }
                None => result,
            },
            (Some(Bug::CompleteFailureAsSuccess), Err(StoreError::NotOwner)) => Ok(()),
            _ => result,
        }
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        match self.bug {
            Some(Bug::ReleaseDropped) => Ok(()),
            Some(Bug::ReleaseIgnoresToken) => {
                let holder = self.other_holder(key, token).unwrap_or_else(|| token.clone());
                self.inner.release(key, &holder).await
            }
            _ => self.inner.release(key, token).await,
        }
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        if self.bug == Some(Bug::HeartbeatStopsAfterFirst) && self.seen().renewals.get(token).is_some_and(|n| *n >= 1) {
            return Ok(());
        }
        let result = self.inner.extend(key, token, lease).await;
        match (&result, self.bug) {
            (Ok(()), _) => {
                *self.seen().renewals.entry(token.clone()).or_default() += 1;
                self.note_lease(key, token, lease);
                result
            }
            (Err(StoreError::NotOwner), Some(Bug::ExtendForeignToken)) => {
                if let Some(holder) = self.other_holder(key, token) {
                    let _ = self.inner.extend(key, &holder, lease).await;
                }
                Ok(())
            }
            _ => result,
        }
    }

    fn detach(&self, step: Detached) {
        self.inner.detach(step);
    }

    fn max_record_bytes(&self) -> usize {
        self.inner.max_record_bytes()
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn process_local(&self) -> bool {
        self.inner.process_local()
    }
}
