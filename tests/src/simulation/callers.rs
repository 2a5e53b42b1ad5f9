//! The callers: what each one of a history does, drawn from the seed, and the task that does it
//! through the real `Call` protocol.
//!
//! A caller makes up to a few calls with one key. Each call's body makes its side effect (logged as
//! `BodyStart`), works for a while, then returns `Ok`, returns `Err` or panics; the call may be
//! dropped by a deadline at whatever await point it has reached, under either `OnCancel` policy,
//! and may wait for a running duplicate. After anything but `Ok` the caller retries.

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use idempotent_runtime::{Call, Error, OnCancel, Store};

use super::history::{BodyEnd, CallEnd, Event, History};
use super::rng::SplitMix64;

tokio::task_local! {
    /// The caller and attempt whose task is running, for the store wrapper's log.
    pub static CALLER: (usize, u32);
}

/// The message of the bodies' planted panics; any other panic is the library's.
pub const BODY_PANIC: &str = "sim: the body panics (planted)";

/// What a body does after its side effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// Returns `Ok`.
    Ok,
    /// Returns `Err`.
    Err,
    /// Panics.
    Panic,
}

/// One call of a caller.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// What the body does.
    pub body: BodyKind,
    /// How long the body works before it ends.
    pub work: Duration,
    /// A deadline that drops the call, from the call's start.
    pub cancel_after: Option<Duration>,
    /// What a cancellation does to the claim.
    pub on_cancel: OnCancel,
    /// How long a duplicate waits for a running call.
    pub wait: Option<Duration>,
    /// The pause before the next attempt.
    pub pause: Duration,
}

/// One caller of a history.
#[derive(Debug, Clone)]
pub struct Caller {
    /// Its number.
    pub id: usize,
    /// The key's number.
    pub key: usize,
    /// When it starts.
    pub start: Duration,
    /// Its calls (it stops after the first `Ok`).
    pub attempts: Vec<Attempt>,
}

impl Caller {
    /// Draws caller `id` on one of `keys` keys, with durations scaled to `lease`.
    pub fn draw(id: usize, keys: usize, lease: Duration, rng: &mut SplitMix64) -> Self {
        let frac = |rng: &mut SplitMix64, max_percent: u64| {
            lease * u32::try_from(rng.below(max_percent + 1)).unwrap_or(0) / 100
        };
        let key = usize::try_from(rng.below(keys as u64)).unwrap_or(0);
        let start = frac(rng, 200);
        let count = 1 + rng.below(3);
        let attempts = (0..count)
            .map(|_| {
                let body = match rng.below(10) {
                    0..=5 => BodyKind::Ok,
                    6..=8 => BodyKind::Err,
                    _ => BodyKind::Panic,
                };
                // Mostly short bodies; some outlive several renewals.
                let work = if rng.chance(25) { frac(rng, 250) } else { frac(rng, 30) };
                let cancel_after = rng.chance(25).then(|| frac(rng, 150));
                let on_cancel = if rng.chance(50) { OnCancel::Keep } else { OnCancel::Release };
                let wait = rng.chance(30).then(|| frac(rng, 200));
                let pause = frac(rng, 60);
                Attempt { body, work, cancel_after, on_cancel, wait, pause }
            })
            .collect();
        Caller { id, key, start, attempts }
    }
}

/// A body's error, or the library's.
#[derive(Debug)]
pub enum SimError {
    /// The library's typed error.
    Lib(Error),
    /// The body's own.
    Body,
}

impl From<Error> for SimError {
    fn from(error: Error) -> Self {
        SimError::Lib(error)
    }
}

/// The value a body returns: unique to its caller and attempt.
#[must_use]
pub fn body_value(caller: usize, attempt: u32) -> String {
    format!("c{caller}.{attempt}")
}

/// Logs `Dropped` if the body is dropped before it ends.
struct BodyGuard {
    history: History,
    caller: usize,
    attempt: u32,
    ended: bool,
}

impl Drop for BodyGuard {
    fn drop(&mut self) {
        if !self.ended {
            self.history.log(Event::BodyEnd { caller: self.caller, attempt: self.attempt, how: BodyEnd::Dropped });
        }
    }
}

/// Polls a future, catching a panic that unwinds out of it (as `futures::FutureExt::catch_unwind`).
pub(super) struct CatchUnwind<F>(pub(super) Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, String>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.0.as_mut();
        match catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(payload) => {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Poll::Ready(Err(message))
            }
        }
    }
}

fn error_name(error: &Error) -> &'static str {
    match error {
        Error::InProgress { .. } => "InProgress",
        Error::LeaseLost { .. } => "LeaseLost",
        Error::Store { .. } => "Store",
        Error::Decode { .. } => "Decode",
        Error::Unrecordable { .. } => "Unrecordable",
        Error::FingerprintMismatch { .. } => "FingerprintMismatch",
        _ => "Other",
    }
}

/// One body: its side effect (logged), its work, its end.
struct Body {
    history: History,
    caller: usize,
    attempt: u32,
    key: usize,
    kind: BodyKind,
    work: Duration,
}

impl Body {
    async fn run(self) -> Result<String, SimError> {
        let Body { history, caller, attempt, key, kind, work } = self;
        history.log(Event::BodyStart { caller, attempt, key });
        let mut guard = BodyGuard { history, caller, attempt, ended: false };
        tokio::time::sleep(work).await;
        guard.ended = true;
        let how = match kind {
            BodyKind::Ok => BodyEnd::Ok,
            BodyKind::Err => BodyEnd::Err,
            BodyKind::Panic => BodyEnd::Panic,
        };
        guard.history.log(Event::BodyEnd { caller, attempt, how });
        match kind {
            BodyKind::Ok => Ok(body_value(caller, attempt)),
            BodyKind::Err => Err(SimError::Body),
            BodyKind::Panic => panic!("{BODY_PANIC}"),
        }
    }
}

/// The same call through the attribute (scope [`SCOPE`](super::scheduler::SCOPE), `on_cancel` keep).
#[idempotent_runtime::idempotent(key = key, store = store, scope = "sim", lease = lease)]
async fn through_attribute<S: Store + ?Sized>(
    store: &S,
    key: &str,
    lease: Duration,
    body: Body,
) -> Result<String, SimError> {
    body.run().await
}

/// Runs `caller` against `store` with `lease`, logging to `history`.
pub async fn run<S: Store + ?Sized>(
    caller: Caller,
    store: &S,
    lease: Duration,
    scope: &str,
    prefix: &str,
    history: History,
) {
    tokio::time::sleep(caller.start).await;
    let key = format!("{prefix}-{}", caller.key);
    for (attempt, plan) in (0u32..).zip(&caller.attempts) {
        let id = caller.id;
        history.log(Event::CallStart {
            caller: id,
            attempt,
            key: caller.key,
            plan: format!(
                "{:?} after {:?}, cancel {:?} ({:?}), wait {:?}{}",
                plan.body,
                plan.work,
                plan.cancel_after,
                plan.on_cancel,
                plan.wait,
                if plan.wait.is_none() && plan.on_cancel == OnCancel::Keep && id % 2 == 1 {
                    ", via #[idempotent]"
                } else {
                    ""
                }
            ),
        });
        let mut call = Call::new(scope, &key).lease(lease).on_cancel(plan.on_cancel);
        if let Some(wait) = plan.wait {
            call = call.wait(wait);
        }
        let body =
            Body { history: history.clone(), caller: id, attempt, key: caller.key, kind: plan.body, work: plan.work };
        // Odd callers' plain calls (no `wait`, `OnCancel::Keep`) go through the attribute.
        let attribute = plan.wait.is_none() && plan.on_cancel == OnCancel::Keep && id % 2 == 1;
        let running: Pin<Box<dyn Future<Output = Result<String, SimError>> + Send + '_>> = if attribute {
            Box::pin(through_attribute(store, &key, lease, body))
        } else {
            Box::pin(call.run(store, body.run()))
        };
        let guarded = async {
            match plan.cancel_after {
                Some(deadline) => tokio::time::timeout(deadline, running).await.ok(),
                None => Some(running.await),
            }
        };
        let ended = CALLER.scope((id, attempt), CatchUnwind(Box::pin(guarded))).await;
        let how = match ended {
            Ok(Some(Ok(value))) => CallEnd::Ok(value),
            Ok(Some(Err(SimError::Body))) => CallEnd::BodyErr,
            Ok(Some(Err(SimError::Lib(e)))) => CallEnd::Error(error_name(&e)),
            Ok(None) => CallEnd::Cancelled,
            Err(message) if message == BODY_PANIC => CallEnd::BodyPanic,
            Err(message) => CallEnd::EscapedPanic(message),
        };
        let done = matches!(how, CallEnd::Ok(_));
        history.log(Event::CallEnd { caller: id, attempt, how });
        if done {
            return;
        }
        tokio::time::sleep(plan.pause).await;
    }
}

/// Panics that were not planted, counted once [`quiet_planted_panics`] has run: a test whose
/// process has no other source of panics checks that its library raised none.
pub static FOREIGN_PANICS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Silences the planted panics' messages (they are expected), leaving every other panic's, and
/// counts those in [`FOREIGN_PANICS`].
pub fn quiet_planted_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let planted = info.payload().downcast_ref::<String>().is_some_and(|s| s == BODY_PANIC)
                || info.payload().downcast_ref::<&str>().is_some_and(|s| *s == BODY_PANIC);
            // A failing assertion of a test file is the test's, not the library's.
            let test_file = info.location().is_some_and(|l| l.file().starts_with("tests/tests/"));
            if !planted {
                if !test_file {
                    FOREIGN_PANICS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                default(info);
            }
        }));
    });
}
