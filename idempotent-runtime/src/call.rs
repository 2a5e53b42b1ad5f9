//! The protocol: check → claim → execute → record, shared by the attribute, the HTTP layer and
//! hand-written calls.

use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::context::{self, CallContext};
use crate::observe::{CallObserver, Outcome, Replied, StoreStep, timed, timed_since};
use crate::outcome::{self, ErrorPolicy, ReleaseErrors, Replayed};
use crate::scope::Site;
use crate::setters::setters;
use crate::step::{self, Steps};
use crate::{
    Claim, ClaimRequest, Completion, Detached, Error, Fingerprint, IdempotencyKey, Key, KeyError, Scope, Store,
    StoreError, Token,
};

/// How long a claim lasts when its caller neither completes nor releases it (60 s).
pub const DEFAULT_LEASE: Duration = Duration::from_mins(1);
/// How long a completed result is replayed (24 h).
pub const DEFAULT_RETENTION: Duration = Duration::from_hours(24);

const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_millis(100);
const MAX_COMPLETE_BACKOFF: Duration = Duration::from_secs(1);
/// The shortest lease accepted: shorter ones would let a duplicate in before the body started.
pub const MIN_LEASE: Duration = Duration::from_millis(1);
/// The longest lease accepted (one day). A lease is not a guess at the body's duration (the
/// heartbeat renews it while the body runs) but how long a crashed caller blocks its key.
pub const MAX_LEASE: Duration = Duration::from_hours(24);
/// The longest retention accepted (3,650 days, about ten years).
pub const MAX_RETENTION: Duration = Duration::from_hours(3650 * 24);
/// The longest `wait` accepted (one day, like the lease).
pub const MAX_WAIT: Duration = MAX_LEASE;
/// How many claims answered after their lease a call sends before it gives up (without running).
const MAX_LATE_CLAIM_REPLIES: u32 = 3;
/// The lease is renewed every third of its length while the body runs (and while its result is
/// recorded, for up to one more lease).
const HEARTBEATS_PER_LEASE: u32 = 3;

/// What happens to the claim when the call's future is dropped while its body runs.
///
/// A cancelled body may have made some of its side effects, and those may still be landing (a
/// request sent, a write in flight), so by default a cancellation is treated like a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnCancel {
    /// Keep the claim until its lease ends (the heartbeat stops with the future), so no retry
    /// starts while the cancelled body's effects may still land. Retries get
    /// [`Error::InProgress`] until then.
    #[default]
    Keep,
    /// Release the claim at once, so a retry runs the body again. For bodies that are safe to run
    /// again after being cut off anywhere (for example, a body whose only effect is one
    /// transaction that a cancellation rolls back).
    Release,
}

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
    on_cancel: OnCancel,
    site: Option<(&'static Site, Option<&'static str>)>,
    trace_key: bool,
}

impl Call {
    /// A call with `key` inside `scope` (a stable name for the operation, such as `"payments"`).
    pub fn new(scope: &str, key: &(impl IdempotencyKey + ?Sized)) -> Self {
        Self::prepared(Key::new(scope, key))
    }

    /// Like [`new`](Call::new), in a [`Scope`] checked before (`Scope::from_static("payments")`
    /// in a `const`, or one `Scope::new` for many calls).
    pub fn in_scope(scope: Scope<'_>, key: &(impl IdempotencyKey + ?Sized)) -> Self {
        Self::prepared(Key::in_scope(scope, key))
    }

    /// A call to a function that the attribute expanded without `scope`: in the `site`'s default
    /// scope, checked once per site, and with the site kept for the scope check.
    #[doc(hidden)]
    pub fn at_site(site: &'static Site, key: &(impl IdempotencyKey + ?Sized)) -> Self {
        let mut call = Self::prepared(site.checked_scope().and_then(|scope| Key::in_scope(scope, key)));
        call.site = Some((site, None));
        call
    }

    fn prepared(key: Result<Key, KeyError>) -> Self {
        Call {
            prepared: key.map(|k| (k, None)).map_err(Error::from),
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            wait: None,
            on_cancel: OnCancel::Keep,
            site: None,
            trace_key: false,
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

    setters! {
        /// How long a claim lasts if its caller dies (default [`DEFAULT_LEASE`], from
        /// [`MIN_LEASE`] to [`MAX_LEASE`]). While the body runs, the lease is renewed every third
        /// of its length, so a live body keeps its claim however long it takes; while its result
        /// is recorded, the renewals go on for up to one more lease. A crashed caller's claim ends
        /// one lease after its last renewal.
        pub fn lease(lease: Duration);
        /// How long the completed result is replayed (default [`DEFAULT_RETENTION`]; not shorter
        /// than the lease, at most [`MAX_RETENTION`]).
        pub fn retention(retention: Duration);
        /// What a cancellation does to the claim while the body runs (default [`OnCancel::Keep`]).
        pub fn on_cancel(on_cancel: OnCancel);
        /// Records the raw key in the call's `tracing` span (field `key`). Off by default: keys
        /// can be secrets, so the span and the library's events carry only the scope (see
        /// [`crate::observe`]).
        pub fn trace_key(trace_key: bool);
    }

    /// Makes a concurrent duplicate wait up to `wait` for the running call and replay its result,
    /// instead of failing at once with [`Error::InProgress`] (at most [`MAX_WAIT`]).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// The calling method's `Self` type, for the scope check of a call made [`at_site`](Call::at_site).
    #[doc(hidden)]
    pub fn self_type<T: ?Sized>(mut self) -> Self {
        if let Some((_, self_type)) = &mut self.site {
            *self_type = Some(std::any::type_name::<T>());
        }
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
    ///
    /// # Cancellation and panics
    ///
    /// The future may be dropped at any point; what happens to the key depends on where:
    ///
    /// | dropped while | the key |
    /// |---|---|
    /// | the claim request is in flight | released in the background (the body never started) |
    /// | the body runs | kept until its lease ends ([`OnCancel::Keep`], the default), or released ([`OnCancel::Release`]) |
    /// | the result is being recorded | recorded in the background, retried while the lease lasts |
    ///
    /// A claim dropped in flight may still be applied after the background release has found
    /// nothing to release: on a SQL store the claim's statement runs on after its client stops
    /// waiting, and the release goes out on another connection. The key then stays claimed, by
    /// nobody, until its lease ends, and retries get [`Error::InProgress`] meanwhile; the body
    /// does not run.
    ///
    /// A body that panics releases the key, like an unrecorded `Err`. Background steps go through
    /// [`Store::detach`].
    ///
    /// The call runs in its own `tracing` span and is counted in the metrics (see
    /// [`crate::observe`]).
    pub async fn run_with<S, T, E, P, F>(self, store: &S, policy: P, body: F) -> Result<T, E>
    where
        S: Store + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        P: ErrorPolicy<E>,
        F: Future<Output = Result<T, E>>,
    {
        let Call { prepared, lease, retention, wait, on_cancel, site, trace_key } = self;
        let observer = CallObserver::start(prepared.as_ref().ok().map(|(key, _)| key), trace_key);
        let (key, fingerprint) = match prepared {
            Ok(prepared) => prepared,
            Err(e) => return Err(observer.error(e).into()),
        };
        // Borrowed by the protocol's future (not moved into it, beside the rest of the call).
        let (key, fingerprint) = (&key, fingerprint.as_ref());
        let observer = &observer;
        // The protocol is pinned where it is and polled inside the call's span (what
        // `Instrument` does, without moving the whole protocol's future into a wrapper and the
        // wrapper into this one: it is about 2 KB).
        let protocol = pin!(async move {
            if let Some((site, self_type)) = site {
                site.check(key, self_type).map_err(|e| observer.error(e))?;
            }
            check_durations(key, lease, retention, wait).map_err(|e| observer.error(e))?;
            // Unique among every caller of the store: drawn from the operating system for a
            // shared store (copies of this process must not repeat it), counted for ours. The
            // draw, a system call, waits until a store reads the token: a replay from a local
            // cache never does.
            let token = if store.process_local() { Token::counted() } else { Token::deferred() };
            let request = ClaimRequest::new(key, &token, fingerprint, lease);
            let mut guard = Guard {
                store,
                key,
                token: &token,
                fingerprint,
                lease,
                on_cancel,
                phase: Phase::Idle,
                body_polling: false,
                span: observer.span(),
                context: None,
            };
            let deadline = wait.map(|wait| Instant::now() + wait);
            // `replied`: when the last claim's reply came (read for its latency metric, or when asked).
            let (mut backoff, mut late_replies, mut replied) = (FIRST_BACKOFF, 0, Replied::default());
            let lease_end = loop {
                // The lease is counted from before the request, so our estimate of its end is never late.
                let sent = Instant::now();
                guard.phase = Phase::Claiming;
                let claim =
                    timed_since(store, StoreStep::Claim, sent, Some(&mut replied), store.claim(&request.sent_at(sent)))
                        .await
                        .map_err(|source| observer.error(store_error(key, "claim", source)))?;
                guard.phase = Phase::Idle;
                match claim {
                    // A reply that took longer than the lease (or a claim after such a reply): the
                    // store started that lease when the request arrived, which may have been long
                    // before the reply, so it may have ended, or be about to, and another caller may
                    // run the body. Renewed, it runs from the renewal; lapsed, the key is claimed
                    // again and the store says who holds it now.
                    Claim::Claimed if late_replies > 0 || replied.at() >= sent + lease => {
                        match renew_found_claim(&mut guard.phase, store, key, &token, lease, observer).await? {
                            Some(lease_end) => break lease_end,
                            None => late_reply(store, key, &mut late_replies, observer)?,
                        }
                    }
                    Claim::Claimed => break sent + lease,
                    Claim::Completed(record) => {
                        check_fingerprint(key, fingerprint, record.fingerprint.as_ref())
                            .map_err(|e| observer.error(e))?;
                        return replay(key, &record.outcome, &policy, observer);
                    }
                    Claim::InProgress { fingerprint: running, lease_remaining } => {
                        check_fingerprint(key, fingerprint, running.as_ref()).map_err(|e| observer.error(e))?;
                        let now = Instant::now();
                        match deadline {
                            Some(deadline) if now < deadline => {
                                tokio::time::sleep(backoff.min(deadline - now)).await;
                                backoff = (backoff * 2).min(MAX_BACKOFF);
                            }
                            _ => {
                                tracing::debug!(target: "idempotent", "in progress");
                                let error = Error::InProgress { key: key.to_string(), retry_after: lease_remaining };
                                return Err(observer.error(error).into());
                            }
                        }
                    }
                }
            };

            guard.phase = Phase::Running;
            let lease_end = Mutex::new(lease_end);
            // The body runs with its call's identity (derived outbound keys, steps); its steps are
            // served here, with the store.
            // Kept by the guard, which frees what steps the body left unrecorded if the call is dropped.
            let context = &*guard.context.insert(CallContext::root(key));
            let body = context::scoped(Arc::clone(context), body);
            let steps = Steps {
                store,
                call: key,
                token: &token,
                fingerprint,
                lease,
                retention,
                lease_end: &lease_end,
                observer,
            };
            let (result, held) = {
                // Pinned here once (`with_heartbeat` polls them where they are), and dropped when
                // the body has ended.
                let body = pin!(body);
                let beat = pin!(heartbeat(store, key, &token, lease, &lease_end, Renew::WhileHeld));
                let serve = pin!(step::serve(&steps, context.queue()));
                with_heartbeat(&mut guard.body_polling, body, beat, serve).await
            };
            // What the body's steps left (the release of a step that failed just before it ended) is
            // served by `record`, once the outcome is in the guard: a call dropped meanwhile has its
            // result recorded in the background, as when dropped while recording.
            let left = context.had_steps().then_some(&steps);
            let result = record(&mut guard, retention, &lease_end, held, &policy, result, left, observer).await;
            CallContext::recycle(guard.context.take());
            result
        });
        in_span(observer.span(), protocol).await
    }
}

/// Renews a claim answered after its lease, before the body counts on it: the store started
/// that lease when the request arrived, not when it was sent, and a claim sent again that finds
/// the key held by its own token does not renew it either. Returns the lease's end, counted from
/// the renewal, or `None` if the claim lapsed first or the renewal too was answered after a
/// lease. `phase` says `Claiming` while the renewal is in flight, and stays so if it fails (the
/// call's guard then releases the key).
async fn renew_found_claim<S: Store + ?Sized>(
    phase: &mut Phase,
    store: &S,
    key: &Key,
    token: &Token,
    lease: Duration,
    observer: &CallObserver,
) -> Result<Option<Instant>, Error> {
    *phase = Phase::Claiming;
    let renewing = Instant::now();
    let renewed = match timed_since(store, StoreStep::Extend, renewing, None, store.extend(key, token, lease)).await {
        Ok(()) if Instant::now() < renewing + lease => Some(renewing + lease),
        Ok(()) | Err(StoreError::NotOwner) => None,
        Err(source) => return Err(observer.error(store_error(key, "extend", source))),
    };
    *phase = Phase::Idle;
    Ok(renewed)
}

/// Counts in `late` a claim whose renewal after a late reply failed: claim again, or, at the
/// third in a row, give up without running the body.
fn late_reply<S: Store + ?Sized>(store: &S, key: &Key, late: &mut u32, observer: &CallObserver) -> Result<(), Error> {
    *late += 1;
    if *late == MAX_LATE_CLAIM_REPLIES {
        let source = StoreError::backend(
            store.name(),
            "every claim was answered after its lease had ended; the body was not started",
        );
        return Err(observer.error(store_error(key, "claim", source)));
    }
    tracing::warn!(target: "idempotent", "a claim was answered after its lease ended; claiming again");
    Ok(())
}

/// Polls `future` to its end, inside `span` on every poll.
async fn in_span<F: Future>(span: &tracing::Span, mut future: Pin<&mut F>) -> F::Output {
    poll_fn(|cx| {
        let _entered = span.enter();
        future.as_mut().poll(cx)
    })
    .await
}

fn store_error(key: &Key, operation: &'static str, source: StoreError) -> Error {
    Error::Store { key: key.to_string(), operation, source }
}

fn check_durations(key: &Key, lease: Duration, retention: Duration, wait: Option<Duration>) -> Result<(), Error> {
    // The defaults are valid.
    if lease == DEFAULT_LEASE && retention == DEFAULT_RETENTION && wait.is_none() {
        return Ok(());
    }
    let invalid = |option, reason| Err(Error::InvalidOption { key: key.to_string(), option, reason });
    if lease < MIN_LEASE {
        return invalid(
            "lease",
            format!(
                "{lease:?} is shorter than the minimum of 1 ms: a claim that short lets duplicates run the body \
                 at once; use a lease of seconds (it is renewed while the body runs)"
            ),
        );
    }
    if lease > MAX_LEASE {
        return invalid(
            "lease",
            format!(
                "{lease:?} is longer than the maximum of 24 h: the lease is how long a crashed caller blocks its \
                 key, not how long the body may run (it is renewed while the body runs); use seconds or minutes"
            ),
        );
    }
    if retention < lease {
        return invalid(
            "retention",
            format!(
                "{retention:?} is shorter than the lease ({lease:?}): a result could be forgotten while a \
                 duplicate still waits for it; make the retention at least as long as the lease"
            ),
        );
    }
    if retention > MAX_RETENTION {
        return invalid(
            "retention",
            format!("{retention:?} is longer than the maximum of 3650 days; keep records for days or weeks"),
        );
    }
    if let Some(wait) = wait.filter(|wait| *wait > MAX_WAIT) {
        return invalid(
            "wait",
            format!("{wait:?} is longer than the maximum of 24 h; a duplicate should wait seconds for the first call"),
        );
    }
    Ok(())
}

pub(crate) fn check_fingerprint(
    key: &Key,
    ours: Option<&Fingerprint>,
    theirs: Option<&Fingerprint>,
) -> Result<(), Error> {
    match (ours, theirs) {
        (Some(ours), Some(theirs)) if ours != theirs => {
            tracing::warn!(target: "idempotent", "fingerprint mismatch: key reused with a different request");
            Err(Error::FingerprintMismatch { key: key.to_string() })
        }
        _ => Ok(()),
    }
}

fn replay<T: DeserializeOwned, E: From<Error>>(
    key: &Key,
    outcome: &[u8],
    policy: &impl ErrorPolicy<E>,
    observer: &CallObserver,
) -> Result<T, E> {
    match outcome::decode(outcome, policy) {
        Ok(Replayed::Value(result)) => {
            tracing::debug!(target: "idempotent", ok = result.is_ok(), "replayed");
            observer.outcome(Outcome::Replayed);
            result
        }
        Ok(Replayed::Unrecordable(reason)) => {
            Err(observer.error(Error::Unrecordable { key: key.to_string(), reason }).into())
        }
        Err(reason) => Err(observer.error(Error::Decode { key: key.to_string(), reason }).into()),
    }
}

/// Polls `body` to its end while `beat` renews the lease and `serve` serves the body's steps;
/// `polling` is `true` only while the body is being polled, so a panic that unwinds out of it
/// leaves it set. The futures are borrowed, not moved in: they stay where the caller pinned them.
/// Returns the body's output and whether the claim is still held (the heartbeat did not find
/// it lapsed).
async fn with_heartbeat<F: Future>(
    polling: &mut bool,
    mut body: Pin<&mut F>,
    mut beat: Pin<&mut impl Future<Output = ()>>,
    mut serve: Pin<&mut impl Future<Output = ()>>,
) -> (F::Output, bool) {
    let mut held = true;
    let output = poll_fn(|cx| {
        *polling = true;
        let output = body.as_mut().poll(cx);
        *polling = false;
        if output.is_pending() {
            // `Renew::WhileHeld`: the heartbeat ends only when the claim has lapsed.
            if held && beat.as_mut().poll(cx).is_ready() {
                held = false;
            }
            // It never ends: it waits for the body's next step job.
            let _ = serve.as_mut().poll(cx);
        }
        output
    })
    .await;
    (output, held)
}

/// Polls `main` to its end, and `side` beside it until `side` ends.
async fn alongside<F: Future>(mut main: Pin<&mut F>, mut side: Pin<&mut impl Future>) -> F::Output {
    let mut side_ended = false;
    poll_fn(|cx| {
        let output = main.as_mut().poll(cx);
        if output.is_pending() && !side_ended {
            side_ended = side.as_mut().poll(cx).is_ready();
        }
        output
    })
    .await
}

/// How long a heartbeat goes on.
#[derive(Clone, Copy)]
enum Renew {
    /// Until the claim is lost or the caller stops polling: while the body runs.
    WhileHeld,
    /// Also no renewal due, or sent, at or after the end of the lease that the claim holds when the
    /// heartbeat starts: while the result is recorded. The claim then outlasts the body by two
    /// leases at most.
    WithinThisLease,
}

/// Renews the lease every third of its length, as long as `renew` says. A body that ends before
/// the first renewal costs no extra round trip.
async fn heartbeat<S: Store + ?Sized>(
    store: &S,
    key: &Key,
    token: &Token,
    lease: Duration,
    lease_end: &Mutex<Instant>,
    renew: Renew,
) {
    let period = lease / HEARTBEATS_PER_LEASE;
    let ends = *lease_end.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let until = matches!(renew, Renew::WithinThisLease).then_some(ends);
    let mut next = ends - lease + period;
    loop {
        if until.is_some_and(|until| next >= until) {
            return;
        }
        tokio::time::sleep_until(next).await;
        let sent = Instant::now();
        // Due before the cap but sent at or after it (a heartbeat started after its first renewal
        // was due, as a detached completion's is, or a late wake-up): not sent, or the claim would
        // outlast the body by more than two leases.
        if until.is_some_and(|until| sent >= until) {
            return;
        }
        match timed_since(store, StoreStep::Extend, sent, None, store.extend(key, token, lease)).await {
            Ok(()) => {
                *lease_end.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = sent + lease;
                next = sent + period;
            }
            Err(StoreError::NotOwner) => {
                tracing::error!(
                    target: "idempotent",
                    "the claim lapsed (its lease ended without a renewal); another caller may now take the key \
                     over and run the body too. The result is still recorded unless one does"
                );
                return;
            }
            Err(e) => {
                // Try again soon: two more periods remain before the lease ends.
                tracing::warn!(target: "idempotent", error = %e, "renewing the lease failed; retrying");
                next = Instant::now() + (period / 4).max(MIN_LEASE);
            }
        }
    }
}

/// Records the body's result (or releases the key) and hands the result back to the caller.
/// While the result is being recorded, a claim still `held` is renewed until the lease it holds
/// now would have ended: a completion slower than the lease (a slow store, a pool's queue) keeps
/// duplicates out, and a store that keeps failing completions blocks the key for two leases at
/// most. The step jobs the body `left` are served first, with the outcome already in the guard
/// (before the key is released, so a retry does not find a failed step's key still claimed).
#[allow(clippy::too_many_arguments)]
async fn record<S, T, E>(
    guard: &mut Guard<'_, S>,
    retention: Duration,
    lease_end: &Mutex<Instant>,
    held: bool,
    policy: &impl ErrorPolicy<E>,
    result: Result<T, E>,
    left: Option<&Steps<'_, S>>,
    observer: &CallObserver,
) -> Result<T, E>
where
    S: Store + ?Sized,
    T: Serialize,
    E: From<Error>,
{
    let (store, key, token, fingerprint) = (guard.store, guard.key, guard.token, guard.fingerprint);
    let encoded = match &result {
        Ok(value) => Some(outcome::encode_ok_reusing(value)),
        Err(error) => policy.encode(error),
    };
    let outcome = match encoded {
        None => {
            observer.outcome(Outcome::Released);
            guard.phase = Phase::Releasing;
            if let (Some(steps), Some(context)) = (left, &guard.context) {
                step::drain(steps, context.queue()).await;
            }
            match timed(store, StoreStep::Release, store.release(key, token)).await {
                Ok(()) => tracing::debug!(target: "idempotent", "released after an error"),
                Err(e) => tracing::warn!(
                    target: "idempotent", error = %e,
                    "could not release the claim after an error; it frees itself when its lease ends"
                ),
            }
            guard.phase = Phase::Done;
            return result;
        }
        Some(Ok(bytes)) if bytes.len() <= store.max_record_bytes() => bytes,
        Some(Ok(bytes)) => unrecordable(
            observer,
            &format!("its encoding is {} bytes, over the store's limit of {}", bytes.len(), store.max_record_bytes()),
        ),
        Some(Err(e)) => unrecordable(observer, &format!("it failed to serialise: {e}")),
    };
    let lease = guard.lease;
    // A completion detached from here (its caller dropped) is renewed up to the end of the lease as
    // it stands now, as this one is.
    let ends = *lease_end.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    guard.phase = Phase::Recording { outcome, retention, lease_end: ends, held };
    if let (Some(steps), Some(context)) = (left, &guard.context) {
        step::drain(steps, context.queue()).await;
    }
    let Phase::Recording { outcome, .. } = &guard.phase else { unreachable!("set above") };
    let completion = Completion::new(key, token, fingerprint, outcome, retention);
    // What `complete_renewed` does for a detached completion, written out: one more future around
    // it cost the memory store's first execution about 80 instructions (2 %) by callgrind. Here
    // the retries follow the renewals' `lease_end`; a detached completion, which cannot see the
    // renewals its call made before it was dropped, retries until the latest end they allow.
    let completed = {
        let completing = pin!(complete_within_lease(store, &completion, lease_end));
        if held {
            let renewals = pin!(heartbeat(store, key, token, lease, lease_end, Renew::WithinThisLease));
            alongside(completing, renewals).await
        } else {
            completing.await
        }
    };
    if let Phase::Recording { outcome, .. } = std::mem::replace(&mut guard.phase, Phase::Done) {
        outcome::recycle(outcome);
    }
    match completed {
        Completed::Recorded { attempts } => {
            observer.outcome(Outcome::Executed);
            tracing::debug!(target: "idempotent", ok = result.is_ok(), attempts, "executed and recorded");
            result
        }
        Completed::LeaseLost => {
            tracing::error!(target: "idempotent", "executed, but another caller took the key over before the result was recorded");
            Err(observer.error(Error::LeaseLost { key: key.to_string() }).into())
        }
        Completed::Failed(e @ StoreError::Aborted { .. }) => {
            // Recording is committing here: the body's writes will not persist, so the caller
            // must not see its `Ok`.
            tracing::error!(target: "idempotent", error = %e, "the result could not be recorded in the transaction");
            Err(observer.error(store_error(key, "complete", e)).into())
        }
        Completed::Failed(e) => {
            observer.outcome(Outcome::StoreError);
            tracing::error!(
                target: "idempotent", error = %e,
                "the body ran but its result could not be recorded; duplicates after the lease will run again"
            );
            result
        }
    }
}

/// How a completion ended.
pub(crate) enum Completed {
    /// Recorded (by this attempt or, its reply lost, by an earlier one of the same token).
    Recorded { attempts: u32 },
    /// Another token took the key over after this claim's lease ended: it holds the key now, or
    /// it already recorded its own result there (a late owner's record is never overwritten).
    LeaseLost,
    /// The store failed for good (a refusal), or kept failing until the lease ended.
    Failed(StoreError),
}

/// Completes as [`complete_within_lease`] does while, given `renew_by`, a heartbeat renews the
/// claim by that lease until `lease_end`, the end of the lease it held when recording began: a
/// detached completion (`record` does the same in place). Renewed up to then, the claim may be
/// live until a lease after it, so the completion is retried until then; one that lands after
/// the claim lapsed is fenced like any other.
pub(crate) async fn complete_renewed<S: Store + ?Sized>(
    store: &S,
    completion: &Completion<'_>,
    renew_by: Option<Duration>,
    lease_end: Instant,
) -> Completed {
    let Some(lease) = renew_by else {
        return complete_within_lease(store, completion, &Mutex::new(lease_end)).await;
    };
    let (key, token) = (completion.key, completion.token);
    let (renewed_until, retried_until) = (Mutex::new(lease_end), Mutex::new(lease_end + lease));
    let completing = pin!(complete_within_lease(store, completion, &retried_until));
    let renewals = pin!(heartbeat(store, key, token, lease, &renewed_until, Renew::WithinThisLease));
    alongside(completing, renewals).await
}

/// Completes, retrying transient failures with back-off while the lease lasts (`lease_end`, which
/// a heartbeat may be pushing on meanwhile). The claim keeps
/// duplicates out meanwhile, completion is refused only when another token holds the key (a
/// retry never overwrites another owner's record), and repeated completions by one token succeed
/// (a lost reply is not a lost lease). Failures that cannot succeed (a refused value, an aborted
/// transaction, a corrupt record) are not retried.
pub(crate) async fn complete_within_lease<S: Store + ?Sized>(
    store: &S,
    completion: &Completion<'_>,
    lease_end: &Mutex<Instant>,
) -> Completed {
    let mut backoff = FIRST_BACKOFF;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        match timed(store, StoreStep::Complete, store.complete(completion)).await {
            Ok(()) => return Completed::Recorded { attempts },
            Err(StoreError::NotOwner) => return Completed::LeaseLost,
            Err(e)
                if e.is_transient()
                    && Instant::now() + backoff
                        < *lease_end.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =>
            {
                tracing::warn!(target: "idempotent", error = %e, attempts, "recording the result failed; retrying within the lease");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_COMPLETE_BACKOFF);
            }
            Err(e) => return Completed::Failed(e),
        }
    }
}

fn unrecordable(observer: &CallObserver, reason: &str) -> Vec<u8> {
    observer.outcome(Outcome::Unrecordable);
    tracing::error!(target: "idempotent", reason, "result not recorded; replays will get Error::Unrecordable");
    outcome::encode_unrecordable(reason)
}

/// Where a call is, for what its destructor must do if the call's future is dropped there.
enum Phase {
    /// Nothing of ours is in the store (before claiming, or after losing the claim race).
    Idle,
    /// A claim request is in flight: it may have claimed the key.
    Claiming,
    /// The body runs.
    Running,
    /// An unrecorded error's release is in flight.
    Releasing,
    /// The outcome is being recorded; `held` if the claim is renewed meanwhile.
    Recording { outcome: Vec<u8>, retention: Duration, lease_end: Instant, held: bool },
    /// The call has finished with the store.
    Done,
}

/// Finishes, through [`Store::detach`], what a dropped or panicking call left undone.
struct Guard<'a, S: Store + ?Sized> {
    store: &'a S,
    key: &'a Key,
    token: &'a Token,
    fingerprint: Option<&'a Fingerprint>,
    lease: Duration,
    on_cancel: OnCancel,
    phase: Phase,
    /// Set while the body is polled: still set in the destructor means the body panicked.
    body_polling: bool,
    /// The call's span, entered while the destructor reports and detaches (the protocol's
    /// future is dropped outside it: see `in_span`).
    span: &'a tracing::Span,
    /// The body's context while it runs: its queue holds the releases of steps that ended
    /// without a record, which the call serves, or this destructor detaches.
    context: Option<Arc<CallContext>>,
}

impl<S: Store + ?Sized> Guard<'_, S> {
    /// Releases the keys of the steps that ended without a record and whose releases the call
    /// will not serve now: a step whose body panicked, or that was dropped with the call. Without
    /// this, the retry that the call's own release lets in would wait out each such step's claim
    /// (one lease) inside the step. Detached before the call's own release, so a retry that finds
    /// the call's key free finds the steps' free too (on a store that runs detached steps in
    /// order, as the memory store does at once).
    fn release_steps(&self) {
        if let Some(context) = &self.context {
            context.queue().take_releases(|key| {
                self.store.detach(Detached::Release { key, token: self.token.clone() });
            });
        }
    }
}

impl<S: Store + ?Sized> Drop for Guard<'_, S> {
    fn drop(&mut self) {
        // The key and token are copied only for a step that is left to do.
        let release = |guard: &Self| Detached::Release { key: guard.key.clone(), token: guard.token.clone() };
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        if matches!(phase, Phase::Idle | Phase::Done) {
            return;
        }
        let _entered = self.span.enter();
        let step = match phase {
            Phase::Idle | Phase::Done => return,
            Phase::Claiming => release(self),
            Phase::Releasing => {
                self.release_steps();
                release(self)
            }
            // Only the body's own panic (the flag is still set): a call dropped by the unwinding of
            // a panic elsewhere in its task (another branch of a `join!`) was cancelled, and its
            // body's effects may still land, so `on_cancel` decides, as for any other drop.
            Phase::Running if self.body_polling => {
                tracing::warn!(target: "idempotent", "the body panicked; releasing the key");
                self.release_steps();
                release(self)
            }
            Phase::Running => match self.on_cancel {
                OnCancel::Keep => {
                    tracing::warn!(
                        target: "idempotent",
                        "cancelled while the body ran; the key stays claimed until its lease ends (on_cancel = keep)"
                    );
                    return;
                }
                OnCancel::Release => {
                    tracing::debug!(target: "idempotent", "cancelled while the body ran; releasing (on_cancel = release)");
                    self.release_steps();
                    release(self)
                }
            },
            Phase::Recording { outcome, retention, lease_end, held } => {
                tracing::debug!(target: "idempotent", "dropped while recording; finishing the record in the background");
                Detached::Complete {
                    key: self.key.clone(),
                    token: self.token.clone(),
                    fingerprint: self.fingerprint.cloned(),
                    outcome,
                    retention,
                    lease_end,
                    renew_by: held.then_some(self.lease),
                }
            }
        };
        self.store.detach(step);
    }
}
