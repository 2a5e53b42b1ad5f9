//! [`BatchingStore`]: the claims and completions that callers send a store at the same time, sent
//! to it as batches.
//!
//! A consumer with sixteen deliveries in hand, or a server with many requests in flight, makes
//! one claim and one completion per call, each its own command or statement. The PostgreSQL and
//! Redis stores can answer many keys in one statement or one pipeline
//! ([`Store::claim_and_complete_many`]), which costs their server and the client far less per
//! key. `BatchingStore` wraps a store and does that for calls that know nothing of
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
//! Claims and completions share one queue. A step that finds no batch on the way to the store
//! starts a task that sends it, with the steps that came while the task was starting: nothing
//! waits for company, so a lone call costs what it did plus the hand-over to that task. Steps
//! that come while a batch is on its way wait for it to return, and then go together as the next
//! batch (at most [`max_batch`](BatchingStore::max_batch) of them, in the order they came), its
//! claims and completions sent as one [`Store::claim_and_complete_many`]: on PostgreSQL one
//! statement and one commit. So the batches grow with the load, and one batch is in flight at a
//! time (more with [`in_flight`](BatchingStore::in_flight)). Renewals and releases, rare next to
//! claims and completions, go to the store one by one, as do the batches callers send
//! themselves.
//!
//! Each step is answered as the store's single step would answer it (that is what
//! `claim_and_complete_many` promises; the conformance suite checks it on every store),
//! so a call through a `BatchingStore` keeps every guarantee it has on the store. A batch is
//! sent by a task of its own: a caller dropped while its step waits or is on its way does not
//! take the other callers' steps with it. Its own step is still sent; a call dropped while
//! claiming releases its claim as it does on the store, the release made once the claim is
//! there (a caller of [`Store::claim`] that asks for no release keeps the claim until its lease
//! ends, as after a claim whose answer was lost). A batch, or a half of it (its claims, its
//! completions), that fails as a whole (its connection, its statement, the store's code
//! panicking) fails each of its steps with that error; the next batch is sent as usual.
//!
//! # When it pays
//!
//! On the PostgreSQL and Redis (one server) stores, under concurrency: see BENCHMARKS.md for
//! what it measured. On a store without batched steps (the memory store, MariaDB, SQLite, Redis
//! Cluster) a batch is its single steps, and the queue only adds its hand-over.
//!
//! With the feature `metrics`, every batch sent is a sample of the histogram
//! `idempotent_batch_steps` (label `store`, the store behind it): how many claims and
//! completions it held: near one, the calls seldom overlap and the queue only adds its
//! hand-over; always [`max_batch`](BatchingStore::max_batch), steps wait for room in a batch.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::FutureExt as _;
use tokio::sync::oneshot;

use crate::error::BatchFailure;
use crate::store::forward_store;
use crate::{BatchAnswers, Claim, ClaimRequest, Completion, Detached, Fingerprint, Key, Store, StoreError, Token};

/// How many steps (claims and completions together) a batch holds at most by default: 64.
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
            .field("max_batch", &self.shared.steps.max_batch)
            .field("in_flight", &self.shared.steps.in_flight)
            .finish_non_exhaustive()
    }
}

/// What the store's handles and the tasks that send its batches share.
struct Shared<S> {
    store: S,
    steps: Queue<Step>,
    /// The claims whose callers were dropped before their answer came, each with whether a
    /// release of it was asked for meanwhile (see [`BatchingStore::detach`]).
    abandoned: Mutex<HashMap<(Key, Token), bool>>,
}

impl<S: Store + 'static> BatchingStore<S> {
    /// Batches the claims and completions sent to `store`, up to [`DEFAULT_MAX_BATCH`] steps at a
    /// time, one batch in flight.
    ///
    /// Steps are sent by tasks spawned on the Tokio runtime of the caller.
    pub fn new(store: S) -> Self {
        let shared = Shared { store, steps: Queue::new(), abandoned: Mutex::default() };
        BatchingStore { shared: Arc::new(shared) }
    }

    /// At most `steps` steps, claims and completions together, in one batch (at least 1).
    ///
    /// # Panics
    ///
    /// If this store has been cloned: set it before sharing the store.
    #[must_use]
    pub fn max_batch(self, steps: usize) -> Self {
        self.configured(|shared| shared.steps.max_batch = steps.max(1))
    }

    /// At most `batches` batches on their way to the store at once (default 1, at least 1). More
    /// lets a store with several connections (a PostgreSQL pool) answer batches side by side; each
    /// batch is then smaller.
    ///
    /// # Panics
    ///
    /// If this store has been cloned: set it before sharing the store.
    #[must_use]
    pub fn in_flight(self, batches: usize) -> Self {
        self.configured(|shared| shared.steps.in_flight = batches.max(1))
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

    /// Queues `step`, and starts a task to send it if fewer than `in_flight` are sending.
    fn queue(&self, step: Step) -> Result<(), StoreError> {
        let runtime = self.runtime()?;
        if self.shared.steps.push(step) {
            runtime.spawn(Arc::clone(&self.shared).send());
        }
        Ok(())
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
        self.queue(Step::Claim(step))?;
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
        self.queue(Step::Complete(step))?;
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
        claim_many complete_many claim_and_complete_many release extend purge_expired max_record_bytes name
        process_local);
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
    /// Sends the steps waiting, a batch at a time, until none waits.
    async fn send(self: Arc<Self>) {
        while let Some(batch) = self.steps.next() {
            let (mut claims, mut completions) = (Vec::new(), Vec::new());
            for step in batch {
                match step {
                    Step::Claim(step) => claims.push(step),
                    Step::Complete(step) => completions.push(step),
                }
            }
            crate::observe::batch_sent(self.store.name(), claims.len() + completions.len());
            let requests: Vec<ClaimRequest<'_>> = claims
                .iter()
                .map(|step| ClaimRequest::new(&step.key, &step.token, step.fingerprint.as_ref(), step.lease))
                .collect();
            let records: Vec<Completion<'_>> = completions
                .iter()
                .map(|step| {
                    Completion::new(&step.key, &step.token, step.fingerprint.as_ref(), &step.outcome, step.retention)
                })
                .collect();
            let (claimed, recorded) = self.answered(self.store.claim_and_complete_many(&requests, &records)).await;
            drop((requests, records));
            let unheard = reply_each(claims, claimed, self.store.name(), |step| (step.reply, (step.key, step.token)));
            for (claimant, answer) in unheard {
                self.abandoned_answer(claimant, &answer);
            }
            reply_each(completions, recorded, self.store.name(), |step| (step.reply, ()));
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

    /// The answers of a batch, a panic of the store's code taken as the batch's failure: the
    /// queue must go on (its next batch is sent by the task that sent this one).
    async fn answered(
        &self,
        batch: impl Future<Output = (BatchAnswers<Claim>, BatchAnswers<()>)>,
    ) -> (BatchAnswers<Claim>, BatchAnswers<()>) {
        let Ok(answers) = AssertUnwindSafe(batch).catch_unwind().await else {
            tracing::error!(target: "idempotent", store = self.store.name(), "the store panicked in a batch");
            let panicked = || StoreError::backend(self.store.name(), "the store's claim_and_complete_many panicked");
            return (Err(panicked()), Err(panicked()));
        };
        answers
    }
}

/// A step on its way to the store.
enum Step {
    Claim(Claimed),
    Complete(Completed),
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
    answers: BatchAnswers<T>,
    store: &'static str,
    parts: impl Fn(J) -> (oneshot::Sender<Result<T, StoreError>>, K),
) -> Vec<(K, Result<T, StoreError>)> {
    let given = batch.len();
    let (mut answers, failure) = match answers {
        Ok(answers) => (answers.into_iter(), None),
        Err(error) => (Vec::new().into_iter(), Some(BatchFailure::from(error))),
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

/// The answer of a step whose batch was dropped before the store answered (its task ended with
/// the runtime).
fn dropped(store: &'static str) -> StoreError {
    StoreError::backend(store, "the batch was dropped before the store answered (is the runtime shutting down?)")
}

/// The steps waiting to be sent, and how many batches of them are on their way.
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
