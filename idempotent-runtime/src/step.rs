//! Recovery points: a named piece of an idempotent body whose result is recorded under the call,
//! fenced by the call's claim, and replayed on every later run of the body.
//!
//! [`step`] runs inside the body's task but the store belongs to [`Call::run`](crate::Call::run),
//! whose store type the body cannot name. So a step sends its lookup and its record as a [`Job`]
//! over a channel, and the call's own future, which polls the body, serves the jobs with its store
//! ([`serve`]).

use std::collections::VecDeque;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::call::{Completed, check_fingerprint, complete_within_lease};
use crate::context;
use crate::observe::{CallObserver, StoreStep, timed, timed_since};
use crate::outcome::{self, ReleaseErrors, Replayed};
use crate::{Claim, ClaimRequest, Completion, Error, Fingerprint, Key, Store, StoreError, Token};

/// The body's step jobs, waiting for the call to serve them. Allocates nothing until a job
/// arrives, so a body without steps pays nothing for it.
#[derive(Default)]
pub(crate) struct JobQueue {
    jobs: Mutex<VecDeque<Job>>,
    /// The call's task, to wake when a job arrives.
    waker: Mutex<Option<Waker>>,
}

impl JobQueue {
    fn push(&self, job: Job) {
        self.jobs.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push_back(job);
        if let Some(waker) = self.waker.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
            waker.wake();
        }
    }

    fn pop(&self) -> Option<Job> {
        self.jobs.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop_front()
    }

    /// Takes out the releases of steps that ended without a record (a failed or dropped step's),
    /// for a call that will not serve them because it is being dropped, and hands each key to
    /// `release`. Other jobs are dropped: their steps are gone too.
    pub(crate) fn take_releases(&self, mut release: impl FnMut(Key)) {
        while let Some(job) = self.pop() {
            if let Job::Release { key } = job {
                release(key);
            }
        }
    }

    /// Makes the queue as new, if it holds no job (through `&mut`: no locking); `false` if it
    /// holds one.
    pub(crate) fn reset(&mut self) -> bool {
        let jobs = self.jobs.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !jobs.is_empty() {
            return false;
        }
        *self.waker.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        true
    }
}

/// What a step asks of the call's store.
pub(crate) enum Job {
    /// The step's earlier record, if any (`None`: run it; the step key is now claimed by this run).
    Lookup { key: Key, reply: oneshot::Sender<Result<Option<Bytes>, Error>> },
    /// The step failed or was dropped before its record: free its key for a later run.
    Release { key: Key },
    /// Record the step's outcome, if the call still holds its claim.
    Record { key: Key, outcome: Vec<u8>, reply: oneshot::Sender<Result<(), Error>> },
}

/// Runs `body` as the step `name` of the current idempotent body, once per call: its `Ok` value is
/// recorded in the call's store, and every later run of the body (after a released `Err`, a crash,
/// a lost lease) gets that value back without running `body` again.
///
/// ```
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use idempotent_runtime::{Call, Error, MemoryStore, step};
///
/// #[derive(Debug)]
/// enum OrderError { Idempotency(Error), WarehouseClosed }
/// impl From<Error> for OrderError {
///     fn from(e: Error) -> Self { OrderError::Idempotency(e) }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let store = MemoryStore::new();
/// let (transfers, runs) = (AtomicU32::new(0), AtomicU32::new(0));
/// let order = || {
///     Call::new("orders", "order-7").run(&store, async {
///         let transfer: u32 = step("transfer", async {
///             Ok::<_, OrderError>(transfers.fetch_add(1, Ordering::SeqCst) + 1)
///         })
///         .await?;
///         // The first run fails after its step: the key is released, and the retry replays the step.
///         if runs.fetch_add(1, Ordering::SeqCst) == 0 {
///             return Err(OrderError::WarehouseClosed);
///         }
///         Ok(transfer)
///     })
/// };
/// assert!(matches!(order().await, Err(OrderError::WarehouseClosed)));
/// assert_eq!(order().await.unwrap(), 1);
/// assert_eq!(transfers.load(Ordering::SeqCst), 1); // the transfer ran once
/// # }
/// ```
///
/// # What is recorded, and when
///
/// A step is identified by its position among the body's steps and its `name`, so the body must
/// reach its steps in the same order on every run (see [a chain of services](crate#a-chain-of-services)). Before
/// `body` runs, the step's record is looked up: one `claim` of the step's own key, with the
/// call's token and fingerprint, which also keeps the step's key for this run (released if the
/// step fails or is dropped). After it returns `Ok`, the call's own claim is renewed
/// (`extend` with the call's token: the fence) and only if that succeeds is the value recorded
/// (`complete` of the step's key, for the call's retention). An `Err` from `body` is not recorded:
/// the body gets it, and a later run runs the step again.
///
/// The fence: a step is recorded only if the call still held its claim when the renewal reached
/// the store, and the record is refused if another run has claimed the step since. A run that lost
/// its claim gets [`Error::LeaseLost`] instead of recording. The gap between the renewal and the
/// record is one store round trip, covered by the lease the renewal just restarted: a run paused
/// for longer than a whole lease inside that gap could still record a value that a newer run
/// also computes (each run's value is its own, and the newer run's lookup or record then wins).
/// A step reached after the call's lease has ended by its own count (its renewals did not reach
/// the store), or whose lookup is answered after that, is fenced before `body` runs too: a run
/// whose claim was taken over meanwhile gets [`Error::LeaseLost`] and does not run `body`, and
/// one whose renewal is answered after the lease it started has ended gets [`Error::Store`].
///
/// # Errors
///
/// [`Error::StepOutsideCall`] outside an idempotent body (or inside a task it spawned, or inside
/// [`without_derived_keys`](crate::without_derived_keys)); [`Error::FingerprintMismatch`] when the
/// step was recorded for a different request; [`Error::LeaseLost`] when the call lost its claim;
/// [`Error::Store`] (operation `step`) when the store failed; [`Error::Decode`] when the record
/// is not a `T`. In a transactional SQL store, steps are rows of the call's transaction: they
/// commit or roll back with it (see the README).
pub async fn step<T, E, F>(name: &str, body: F) -> Result<T, E>
where
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: Future<Output = Result<T, E>>,
{
    let Some(parent) = context::current() else {
        return Err(Error::StepOutsideCall { name: name.to_owned() }.into());
    };
    let child = parent.next_step(name).map_err(Error::from)?;
    let key = child.key().clone();
    let (reply, answer) = oneshot::channel();
    parent.queue().push(Job::Lookup { key: key.clone(), reply });
    // From here the step's key may be claimed by this run: released unless the step is recorded
    // or its record was found. So whatever the lookup did, its claim is released if the step is
    // dropped before reading the answer (or while the lookup is in flight), or if the lookup
    // failed (a claim that landed, its answer lost); had it claimed nothing, the release changes
    // nothing.
    let mut pending = Pending { queue: parent.queue(), key: Some(key.clone()) };
    if let Some(recorded) = receive(answer, &key).await? {
        pending.key = None;
        return match outcome::decode::<T, Error>(&recorded, &ReleaseErrors) {
            Ok(Replayed::Value(Ok(value))) => Ok(value),
            Ok(_) => Err(Error::Decode { key: key.to_string(), reason: "not a step's value".into() }.into()),
            Err(reason) => Err(Error::Decode { key: key.to_string(), reason }.into()),
        };
    }
    let result = context::scoped(child, body).await;
    let Ok(value) = &result else { return result };
    let encoded = outcome::encode_ok(value).map_err(|e| Error::Unrecordable {
        key: key.to_string(),
        reason: format!("the step's value failed to serialise: {e}"),
    })?;
    let (reply, answer) = oneshot::channel();
    parent.queue().push(Job::Record { key: key.clone(), outcome: encoded, reply });
    receive(answer, &key).await?;
    pending.key = None;
    result
}

/// Releases a claimed step's key when the step ends without a record (its lookup or body failed,
/// it was dropped, or recording failed), or when the call's release of it is dropped before it
/// ends: by queueing a [`Job::Release`] for the call to serve.
struct Pending<'a> {
    queue: &'a JobQueue,
    key: Option<Key>,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.queue.push(Job::Release { key });
        }
    }
}

async fn receive<T>(answer: oneshot::Receiver<Result<T, Error>>, key: &Key) -> Result<T, Error> {
    answer.await.unwrap_or_else(|_| Err(gone(key)))
}

/// The call stopped serving its steps before answering (it ended while the step waited).
fn gone(key: &Key) -> Error {
    Error::Store {
        key: key.to_string(),
        operation: "step",
        source: StoreError::backend("idempotent", "the call that ran this step's body has ended"),
    }
}

/// The call's side of its steps: what the jobs need of the call.
pub(crate) struct Steps<'a, S: Store + ?Sized> {
    pub(crate) store: &'a S,
    pub(crate) call: &'a Key,
    pub(crate) token: &'a Token,
    pub(crate) fingerprint: Option<&'a Fingerprint>,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) lease_end: &'a Mutex<Instant>,
    pub(crate) observer: &'a CallObserver,
}

/// Serves the body's step jobs, one at a time, until the body ends (the caller stops polling).
/// A job in flight is boxed, so the store's futures grow only calls whose body has steps, not
/// every call's future.
pub(crate) fn serve<'a, S: Store + ?Sized>(
    steps: &'a Steps<'a, S>,
    queue: &'a JobQueue,
) -> impl Future<Output = ()> + Send + 'a {
    let mut current: Option<Pin<Box<dyn Future<Output = ()> + Send + 'a>>> = None;
    poll_fn(move |cx| {
        loop {
            if let Some(job) = current.as_mut() {
                if job.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                current = None;
            }
            // Registered before the queue is read, so a job pushed in between wakes us.
            {
                let mut waker = queue.waker.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *waker = Some(cx.waker().clone());
                }
            }
            match queue.pop() {
                Some(job) => current = Some(Box::pin(steps.serve(job, queue))),
                None => return Poll::Pending,
            }
        }
    })
}

/// Serves what the body left when it ended: the release of a step that failed just before it.
pub(crate) async fn drain<S: Store + ?Sized>(steps: &Steps<'_, S>, queue: &JobQueue) {
    while let Some(job) = queue.pop() {
        Box::pin(steps.serve(job, queue)).await;
    }
}

impl<S: Store + ?Sized> Steps<'_, S> {
    async fn serve(&self, job: Job, queue: &JobQueue) {
        match job {
            // Its step was dropped before the lookup was served (the body has ended, or gave up
            // on it): nothing to look up, nothing to claim.
            Job::Lookup { reply, .. } if reply.is_closed() => {}
            // What the lookup may claim, the step releases (see `step`).
            Job::Lookup { key, reply } => {
                let _ = reply.send(self.lookup(&key).await);
            }
            Job::Record { key, outcome, reply } => {
                let _ = reply.send(self.record(&key, &outcome).await);
            }
            Job::Release { key } => {
                // Dropped before the release is answered, it goes back in the queue: `drain`, or
                // the call's guard if the call is being dropped, sends it again.
                let mut held = Pending { queue, key: Some(key) };
                if let Some(key) = &held.key {
                    self.release(key).await;
                }
                held.key = None;
            }
        }
    }

    async fn release(&self, key: &Key) {
        match timed(self.store, StoreStep::Release, self.store.release(key, self.token)).await {
            Ok(()) => {}
            // Not held by this run: a release sent again after its first attempt was dropped (that
            // one landed), or the release of a lookup that claimed nothing.
            Err(StoreError::NotOwner) => tracing::debug!(target: "idempotent", "the step's key was not held"),
            Err(error) => tracing::warn!(
                target: "idempotent", %error,
                "could not release a failed step's key; it frees itself when its lease ends"
            ),
        }
    }

    /// The step's record, or `None` once this run holds the step's key (until the step is
    /// recorded, or released by [`Job::Release`] when it fails or is dropped). A claim of the
    /// step's key left by a run that died in the step is waited out (it is not renewed, so it
    /// ends within one lease).
    async fn lookup(&self, key: &Key) -> Result<Option<Bytes>, Error> {
        // A call whose lease has ended by its own count may have been taken over (its renewals
        // did not reach the store): it is renewed, as a record is fenced, before a step may run,
        // or a body cut off from the store would run steps after another caller had taken the
        // call over and recorded it (RELIABILITY.md, row 43). Checked before the lookup is sent,
        // and again when its claim is granted: the answer may come back after the lease ended,
        // or after waiting out an earlier run's claim of the step (row 44). Within the lease,
        // nothing is sent.
        self.fence_if_lapsed(key, "a step started after the call lost its claim; not run").await?;
        let request = ClaimRequest::new(key, self.token, self.fingerprint, self.lease);
        loop {
            let claim = timed(self.store, StoreStep::Claim, self.store.claim(&request))
                .await
                .map_err(|source| step_error(key, source))?;
            match claim {
                // The step's key is released by the step if the fence fails.
                Claim::Claimed => {
                    self.fence_if_lapsed(key, "a step's lookup was answered after the call lost its claim; not run")
                        .await?;
                    return Ok(None);
                }
                Claim::Completed(record) => {
                    check_fingerprint(self.call, self.fingerprint, record.fingerprint.as_ref())?;
                    self.observer.step(true);
                    return Ok(Some(record.outcome));
                }
                Claim::InProgress { fingerprint, lease_remaining } => {
                    check_fingerprint(self.call, self.fingerprint, fingerprint.as_ref())?;
                    let wait = lease_remaining.unwrap_or(self.lease / 10).clamp(Duration::from_millis(5), self.lease);
                    tracing::debug!(target: "idempotent", wait_ms = wait.as_millis(), "an earlier run's step claim is still live; waiting it out");
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// Fences the call (see [`fence`](Self::fence)) if its lease has ended by its own count, so
    /// that a step runs only within a lease. A renewal answered after the lease it started has
    /// ended shows nothing about now (the claim may have lapsed again and been taken over): the
    /// step is not run, and gets a store error.
    async fn fence_if_lapsed(&self, key: &Key, lost: &'static str) -> Result<(), Error> {
        let lease_end = || *self.lease_end.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if Instant::now() < lease_end() {
            return Ok(());
        }
        self.fence(key, lost).await?;
        if Instant::now() >= lease_end() {
            let late = "the call's renewal was answered after its lease had ended; the step was not run";
            return Err(step_error(key, StoreError::backend(self.store.name(), late)));
        }
        Ok(())
    }

    /// Renews the call's claim (the fence): `LeaseLost` (logged as `lost`) if another caller has
    /// taken it over.
    async fn fence(&self, key: &Key, lost: &'static str) -> Result<(), Error> {
        let sent = Instant::now();
        let extend = self.store.extend(self.call, self.token, self.lease);
        match timed_since(self.store, StoreStep::Extend, sent, None, extend).await {
            Ok(()) => {
                *self.lease_end.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = sent + self.lease;
                Ok(())
            }
            Err(StoreError::NotOwner) => {
                tracing::error!(target: "idempotent", "{lost}");
                Err(Error::LeaseLost { key: self.call.to_string() })
            }
            Err(source) => Err(step_error(key, source)),
        }
    }

    /// Renews the call's claim (the fence), then records the step.
    async fn record(&self, key: &Key, outcome: &[u8]) -> Result<(), Error> {
        self.fence(key, "a step finished after the call lost its claim; not recorded").await?;
        if outcome.len() > self.store.max_record_bytes() {
            return Err(Error::Unrecordable {
                key: key.to_string(),
                reason: format!("the step's value is {} bytes, over the store's limit", outcome.len()),
            });
        }
        let completion = Completion::new(key, self.token, self.fingerprint, outcome, self.retention);
        match complete_within_lease(self.store, &completion, self.lease_end).await {
            Completed::Recorded { .. } => {
                self.observer.step(false);
                Ok(())
            }
            Completed::LeaseLost => Err(Error::LeaseLost { key: key.to_string() }),
            Completed::Failed(source) => Err(step_error(key, source)),
        }
    }
}

fn step_error(key: &Key, source: StoreError) -> Error {
    Error::Store { key: key.to_string(), operation: "step", source }
}
