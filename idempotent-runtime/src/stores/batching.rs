//! [`BatchingStore`]: the claims and completions that callers send a store at the same time, sent
//! to it as batches.
//!
//! A consumer with sixteen deliveries in hand, or a server with many requests in flight, makes
//! one claim and one completion per call, each its own command or statement. The PostgreSQL and
//! Redis stores can answer many keys in one statement or one pipeline
//! ([`Store::claim_many`], [`Store::complete_many`]), which costs their server and the client far
//! less per key. `BatchingStore` wraps a store and does that for calls that know nothing of
//! each other:
//!
//! ```
//! use idempotent_runtime::stores::batching::BatchingStore;
//! use idempotent_runtime::{idempotent, Error, MemoryStore, Store};
//!
//! #[idempotent(key = id, store = store)]
//! async fn handle<S: Store + 'static>(store: &BatchingStore<S>, id: &str) -> Result<(), Error> {
//!     Ok(())
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Error> {
//! // In production the PostgreSQL or the Redis store, which answer a batch at once.
//! let store = BatchingStore::new(MemoryStore::new());
//! handle(&store, "message-1").await?;
//! # Ok(())
//! # }
//! ```
//!
//! # How steps are grouped
//!
//! Claims and completions each have their own queue. A step that finds no batch of its kind on
//! the way to the store starts a task that sends it, with the steps that came while the task was
//! starting: nothing waits for company, so a lone call costs what it did plus the hand-over to
//! that task. Steps that come while a batch is on its way wait for it to return, and then go
//! together as the next batch (at most [`max_batch`](BatchingStore::max_batch) of them, in the
//! order they came). So the batches grow with the load, and one batch of each kind is in flight
//! at a time (more with [`in_flight`](BatchingStore::in_flight)). Renewals and releases, rare
//! next to claims and completions, go to the store one by one, as do the batches callers send
//! themselves.
//!
//! Each step is answered as the store's single step would answer it (that is what
//! `claim_many` and `complete_many` promise; the conformance suite checks it on every store),
//! so a call through a `BatchingStore` keeps every guarantee it has on the store. A batch is
//! sent by a task of its own: a caller dropped while its step waits or is on its way does not
//! take the other callers' steps with it. Its own step is still sent; a call dropped while
//! claiming releases its claim as it does on the store, the release made once the claim is
//! there (a caller of [`Store::claim`] that asks for no release keeps the claim until its lease
//! ends, as after a claim whose answer was lost). A batch that fails as a whole
//! (its connection, its statement, the store's code panicking) fails each of its steps with that
//! error; the next batch is sent as usual.
//!
//! # When it pays
//!
//! On the PostgreSQL and Redis (one server) stores, under concurrency: see BENCHMARKS.md for
//! what it measured. On a store without batched steps (the memory store, MariaDB, SQLite, Redis
//! Cluster) a batch is its single steps, and the queue only adds its hand-over.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::FutureExt as _;
use tokio::sync::oneshot;

use crate::store::forward_store;
use crate::{Claim, ClaimRequest, Completion, Detached, Fingerprint, Key, Store, StoreError, Token};

/// How many steps of one kind a batch holds at most by default: 64.
pub const DEFAULT_MAX_BATCH: usize = 64;

/// A store whose concurrent claims and completions are sent to `S` in batches (see [the module
/// docs](self)). Cloning it shares its queues and its store.
pub struct BatchingStore<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for BatchingStore<S> {
    fn clone(&self) -> Self {
        BatchingStore { shared: Arc::clone(&self.shared) }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for BatchingStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchingStore")
            .field("store", &self.shared.store)
            .field("max_batch", &self.shared.claims.max_batch)
            .field("in_flight", &self.shared.claims.in_flight)
            .finish_non_exhaustive()
    }
}

/// What the store's handles and the tasks that send its batches share.
struct Shared<S> {
    store: S,
    claims: Queue<Claimed>,
    completions: Queue<Completed>,
    /// The claims whose callers were dropped before their answer came, each with whether a
    /// release of it was asked for meanwhile (see [`BatchingStore::detach`]).
    abandoned: Mutex<HashMap<(Key, Token), bool>>,
}

impl<S: Store + 'static> BatchingStore<S> {
    /// Batches the claims and completions sent to `store`, up to [`DEFAULT_MAX_BATCH`] at a time,
    /// one batch of each kind in flight.
    ///
    /// Steps are sent by tasks spawned on the Tokio runtime of the caller.
    pub fn new(store: S) -> Self {
        let shared = Shared { store, claims: Queue::new(), completions: Queue::new(), abandoned: Mutex::default() };
        BatchingStore { shared: Arc::new(shared) }
    }

    /// At most `steps` claims (and as many completions) in one batch (at least 1).
    ///
    /// # Panics
    ///
    /// If this store has been cloned: set it before sharing the store.
    #[must_use]
    pub fn max_batch(self, steps: usize) -> Self {
        self.configured(|shared| {
            shared.claims.max_batch = steps.max(1);
            shared.completions.max_batch = steps.max(1);
        })
    }

    /// At most `batches` batches of claims (and as many of completions) on their way to the store at
    /// once (default 1, at least 1). More lets a store with several connections (a PostgreSQL pool)
    /// answer batches side by side; each batch is then smaller.
    ///
    /// # Panics
    ///
    /// If this store has been cloned: set it before sharing the store.
    #[must_use]
    pub fn in_flight(self, batches: usize) -> Self {
        self.configured(|shared| {
            shared.claims.in_flight = batches.max(1);
            shared.completions.in_flight = batches.max(1);
        })
    }

    /// The Tokio runtime to start a batch's task on: without one, the step fails before it is
    /// queued (queued, it would wait for a task that never starts, and so would every step after
    /// it).
    fn runtime(&self) -> Result<tokio::runtime::Handle, StoreError> {
        tokio::runtime::Handle::try_current().map_err(|_| {
            StoreError::backend(
                self.name(),
                "BatchingStore sends its batches from Tokio tasks: call it within a Tokio runtime",
            )
        })
    }

    fn configured(mut self, set: impl FnOnce(&mut Shared<S>)) -> Self {
        let shared = Arc::get_mut(&mut self.shared).expect("configure a BatchingStore before cloning it");
        set(shared);
        self
    }
}

impl<S> BatchingStore<S> {
    /// The store the batches go to.
    #[must_use]
    pub fn inner(&self) -> &S {
        &self.shared.store
    }
}

impl<S: Store + 'static> Store for BatchingStore<S> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let (reply, answer) = oneshot::channel();
        // When the caller read its clock is not when the store claims: the step may wait in the
        // queue, so the store counts the lease from its own step (see `ClaimRequest::sent_at`).
        let step = Claimed {
            key: request.key.clone(),
            token: request.token.clone(),
            fingerprint: request.fingerprint.cloned(),
            lease: request.lease,
            reply,
        };
        let runtime = self.runtime()?;
        if self.shared.claims.push(step) {
            runtime.spawn(Arc::clone(&self.shared).send_claims());
        }
        let mut waiting = Unanswered { answer, shared: &self.shared, claimant: Some((request.key, request.token)) };
        let answer = (&mut waiting.answer).await;
        waiting.claimant = None;
        answer.unwrap_or_else(|_| Err(dropped(self.name())))
    }

    async fn complete(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
        let (reply, answer) = oneshot::channel();
        let step = Completed {
            key: completion.key.clone(),
            token: completion.token.clone(),
            fingerprint: completion.fingerprint.cloned(),
            outcome: completion.outcome.to_vec(),
            retention: completion.retention,
            reply,
        };
        let runtime = self.runtime()?;
        if self.shared.completions.push(step) {
            runtime.spawn(Arc::clone(&self.shared).send_completions());
        }
        answer.await.unwrap_or_else(|_| Err(dropped(self.name())))
    }

    /// Forwards the step to the store, except the release of a claim still on its way: a call
    /// dropped while its claim waited here asks for the release before the store has the claim,
    /// so it is made once the claim's answer came (the store would find nothing to release, and
    /// the key would stay claimed until the lease ends).
    fn detach(&self, step: Detached) {
        if let Detached::Release { key, token } = &step {
            let mut abandoned = self.shared.abandoned.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(release) = abandoned.get_mut(&(key.clone(), token.clone())) {
                *release = true;
                return;
            }
        }
        self.inner().detach(step);
    }

    forward_store!(direct BatchingStore::inner;
        claim_many complete_many release extend purge_expired max_record_bytes name process_local);
}

/// The answer a claim waits for; dropped before it came, it leaves its claimant in
/// [`Shared::abandoned`], so that a release asked for after the drop follows the claim.
struct Unanswered<'a, S> {
    answer: oneshot::Receiver<Result<Claim, StoreError>>,
    shared: &'a Shared<S>,
    /// `None` once answered.
    claimant: Option<(&'a Key, &'a Token)>,
}

impl<S> Drop for Unanswered<'_, S> {
    fn drop(&mut self) {
        let Some((key, token)) = self.claimant else { return };
        let entry = (key.clone(), token.clone());
        let mut abandoned = self.shared.abandoned.lock().unwrap_or_else(PoisonError::into_inner);
        abandoned.insert(entry.clone(), false);
        drop(abandoned);
        // Closed, no answer can come any more: one that came before is the store's, and a release
        // sent now finds the claim; one that did not is left to the sender, which finds the entry.
        self.answer.close();
        if self.answer.try_recv().is_ok() {
            self.shared.abandoned.lock().unwrap_or_else(PoisonError::into_inner).remove(&entry);
        }
    }
}

impl<S: Store + 'static> Shared<S> {
    /// Sends the claims waiting, a batch at a time, until none waits.
    async fn send_claims(self: Arc<Self>) {
        while let Some(batch) = self.claims.next() {
            let requests: Vec<ClaimRequest<'_>> = batch
                .iter()
                .map(|step| ClaimRequest::new(&step.key, &step.token, step.fingerprint.as_ref(), step.lease))
                .collect();
            let answers = self.answered("claim_many", self.store.claim_many(&requests)).await;
            drop(requests);
            let unheard = reply_each(batch, answers, self.store.name(), |step| (step.reply, (step.key, step.token)));
            for (claimant, answer) in unheard {
                self.abandoned_answer(claimant, &answer);
            }
        }
    }

    /// A claim's answer whose caller was dropped: the release asked for meanwhile is made now
    /// that the store holds the claim.
    fn abandoned_answer(&self, claimant: (Key, Token), answer: &Result<Claim, StoreError>) {
        let mut abandoned = self.abandoned.lock().unwrap_or_else(PoisonError::into_inner);
        let release = abandoned.remove(&claimant).unwrap_or(false);
        drop(abandoned);
        if release && matches!(answer, Ok(Claim::Claimed)) {
            let (key, token) = claimant;
            self.store.detach(Detached::Release { key, token });
        }
    }

    /// Sends the completions waiting, a batch at a time, until none waits.
    async fn send_completions(self: Arc<Self>) {
        while let Some(batch) = self.completions.next() {
            let completions: Vec<Completion<'_>> = batch
                .iter()
                .map(|step| {
                    Completion::new(&step.key, &step.token, step.fingerprint.as_ref(), &step.outcome, step.retention)
                })
                .collect();
            let answers = self.answered("complete_many", self.store.complete_many(&completions)).await;
            drop(completions);
            reply_each(batch, answers, self.store.name(), |step| (step.reply, ()));
        }
    }

    /// The answers of a batch step, a panic of the store's code taken as the batch's failure: the
    /// queue must go on (its next batch is sent by the task that sent this one).
    async fn answered<T>(
        &self,
        step: &str,
        batch: impl Future<Output = Result<Vec<Result<T, StoreError>>, StoreError>>,
    ) -> Result<Vec<Result<T, StoreError>>, StoreError> {
        let Ok(answers) = AssertUnwindSafe(batch).catch_unwind().await else {
            tracing::error!(target: "idempotent", store = self.store.name(), step, "the store panicked in a batch");
            return Err(StoreError::backend(self.store.name(), format!("the store's {step} panicked")));
        };
        answers
    }
}

/// A claim on its way to the store, with where its answer goes.
struct Claimed {
    key: Key,
    token: Token,
    fingerprint: Option<Fingerprint>,
    lease: Duration,
    reply: oneshot::Sender<Result<Claim, StoreError>>,
}

/// A completion on its way to the store, with where its answer goes.
struct Completed {
    key: Key,
    token: Token,
    fingerprint: Option<Fingerprint>,
    outcome: Vec<u8>,
    retention: Duration,
    reply: oneshot::Sender<Result<(), StoreError>>,
}

/// Hands each step of `batch` its answer, and returns the answers whose callers were gone, with
/// what `parts` kept of their steps. The batch's own failure is each step's; a step the store left
/// unanswered (a store whose batch answered fewer steps than it was given) fails.
fn reply_each<J, T, K>(
    batch: Vec<J>,
    answers: Result<Vec<Result<T, StoreError>>, StoreError>,
    store: &'static str,
    parts: impl Fn(J) -> (oneshot::Sender<Result<T, StoreError>>, K),
) -> Vec<(K, Result<T, StoreError>)> {
    let given = batch.len();
    let (mut answers, failure) = match answers {
        Ok(answers) => (answers.into_iter(), None),
        Err(error) => (Vec::new().into_iter(), Some(Failure::from(error))),
    };
    let answered = answers.len();
    let mut unheard = Vec::new();
    for step in batch {
        let answer = match (answers.next(), &failure) {
            (Some(answer), _) => answer,
            (None, Some(failure)) => Err(failure.error()),
            (None, None) => {
                Err(StoreError::backend(store, format!("the store answered {answered} of a batch of {given} steps")))
            }
        };
        let (reply, kept) = parts(step);
        if let Err(answer) = reply.send(answer) {
            unheard.push((kept, answer));
        }
    }
    unheard
}

/// The error of a batch that failed as a whole, to be copied into each of its steps' answers: a
/// [`StoreError`]'s source is not `Clone`, so the copies share it.
enum Failure {
    NotOwner,
    Backend(&'static str, Source),
    Rejected(&'static str, Source),
    Aborted(&'static str, Source),
    Full(String),
    Corrupt(String),
}

type Source = Arc<dyn std::error::Error + Send + Sync>;

impl From<StoreError> for Failure {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::NotOwner => Failure::NotOwner,
            StoreError::Backend { backend, source } => Failure::Backend(backend, Source::from(source)),
            StoreError::Rejected { backend, source } => Failure::Rejected(backend, Source::from(source)),
            StoreError::Aborted { backend, source } => Failure::Aborted(backend, Source::from(source)),
            StoreError::Full(text) => Failure::Full(text),
            StoreError::Corrupt(text) => Failure::Corrupt(text),
        }
    }
}

impl Failure {
    /// One copy of the error.
    fn error(&self) -> StoreError {
        let shared = |source: &Source| Box::new(Arc::clone(source));
        match self {
            Failure::NotOwner => StoreError::NotOwner,
            Failure::Backend(backend, source) => StoreError::Backend { backend, source: shared(source) },
            Failure::Rejected(backend, source) => StoreError::Rejected { backend, source: shared(source) },
            Failure::Aborted(backend, source) => StoreError::Aborted { backend, source: shared(source) },
            Failure::Full(text) => StoreError::Full(text.clone()),
            Failure::Corrupt(text) => StoreError::Corrupt(text.clone()),
        }
    }
}

/// The answer of a step whose batch was dropped before the store answered (its task ended with
/// the runtime).
fn dropped(store: &'static str) -> StoreError {
    StoreError::backend(store, "the batch was dropped before the store answered (is the runtime shutting down?)")
}

/// The steps of one kind waiting to be sent, and how many batches of them are on their way.
struct Queue<J> {
    state: Mutex<Waiting<J>>,
    max_batch: usize,
    in_flight: usize,
}

struct Waiting<J> {
    steps: Vec<J>,
    sending: usize,
}

impl<J> Queue<J> {
    fn new() -> Self {
        Queue {
            state: Mutex::new(Waiting { steps: Vec::new(), sending: 0 }),
            max_batch: DEFAULT_MAX_BATCH,
            in_flight: 1,
        }
    }

    /// Queues `step`; `true` when the caller is to start a sender (fewer than `in_flight` are
    /// sending). The sender takes its first batch when it starts, not now: the steps that come
    /// while it is being started go with this one.
    fn push(&self, step: J) -> bool {
        let mut waiting = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        waiting.steps.push(step);
        if waiting.sending >= self.in_flight {
            return false;
        }
        waiting.sending += 1;
        true
    }

    /// The next batch for a sender, or `None` (one sender fewer) when no step waits.
    fn next(&self) -> Option<Vec<J>> {
        let mut waiting = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if waiting.steps.is_empty() {
            waiting.sending -= 1;
            return None;
        }
        Some(self.take(&mut waiting))
    }

    /// The oldest steps waiting, at most `max_batch`.
    fn take(&self, waiting: &mut Waiting<J>) -> Vec<J> {
        if waiting.steps.len() <= self.max_batch {
            std::mem::take(&mut waiting.steps)
        } else {
            waiting.steps.drain(..self.max_batch).collect()
        }
    }
}
