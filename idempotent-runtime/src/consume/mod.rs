//! Idempotent consumers: a broker that delivers *at least once*, and a handler that still runs once
//! per message id.
//!
//! A consumer that crashes after its work but before its acknowledgement gets the same message
//! again; so does one whose ack was lost. The helpers here take each message's id (the AMQP
//! `message_id` property, the JetStream `Nats-Msg-Id` header, or a key you derive from the
//! payload), hand the message to your handler, which runs it through [`Call`](crate::Call) or
//! `#[idempotent]` with that id as the key, and settle the delivery by the outcome:
//!
//! | outcome of the handler | settlement |
//! |---|---|
//! | `Ok` (executed, or replayed from the record) | ack, only after the call returned: the record is written |
//! | [`Error::InProgress`], [`Error::Store`] | a confirmed copy of the message returned to the queue (AMQP) or `nak` (JetStream) after [`retry_delay`](Consumer::retry_delay) |
//! | your own error (the claim was released) | your [`on_failure`](Consumer::on_failure) policy: retry after the delay (default), ack, or dead-letter |
//! | a panic (the claim was released) | retry after the delay |
//! | your own error or a panic, on the [`max_attempts`](Consumer::max_attempts)-th attempt (default [`DEFAULT_MAX_ATTEMPTS`]) | dead-letter, with the reason logged |
//! | [`Error::FingerprintMismatch`], no id or an invalid one, [`Error::Decode`], [`Error::Fingerprint`] | dead-letter, with the reason logged |
//! | [`Error::Unrecordable`], [`Error::LeaseLost`] | ack: the body ran, running it again is what must not happen |
//! | [`Error::InvalidOption`], [`Error::ScopeCollision`], [`Error::StepOutsideCall`] (a configuration mistake) | retry after the delay: the message waits for the fix |
//!
//! # Panics and poison messages
//!
//! A handler that panics (in its future, or in the call that returns it: a closure that decodes
//! the message before it calls an `async fn`) does not take the consumer down: the panic is
//! caught, logged (level `ERROR`, target `idempotent::consume`) and treated as a failure of that
//! attempt; the other deliveries in hand go on. A `#[idempotent]` body that panics releases its key, like an
//! unrecorded error, so the retry runs the body again: what the body shares with other tasks (a
//! `Mutex` it held, for example) is as the panic left it. The same holds for your other callbacks:
//! an [`on_failure`](Consumer::on_failure) policy that panics counts as a failed attempt (retried,
//! then dead-lettered), and an [`on_settled`](Consumer::on_settled) observer that panics is logged
//! (its delivery is settled already); the id reader's panic is in its builder's docs.
//!
//! A message whose handler fails every time (a *poison* message) would otherwise be retried
//! forever and take a concurrency slot on every attempt. The consumer counts attempts and
//! dead-letters a message whose handler failed (its own error with the policy's
//! [`Disposition::Retry`], or a panic) on its [`max_attempts`](Consumer::max_attempts)-th attempt.
//! Retries that are not the message's fault ([`Error::InProgress`], [`Error::Store`], a
//! configuration mistake) are never dead-lettered for their number: a store outage makes
//! messages wait, not fill the dead-letter path. Where the count comes from differs: JetStream
//! counts deliveries itself (module `jetstream`); RabbitMQ has no count on classic queues, so the
//! AMQP consumer carries its own in a header (module `amqp`).
//!
//! # Throughput
//!
//! Each delivery's call claims and records its key on its own: two statements per message on
//! the PostgreSQL store. Put the store behind a
//! [`BatchingStore`](crate::stores::batching::BatchingStore) and the claims and records of the
//! deliveries in flight reach it together, one statement for many; the more deliveries in flight
//! ([`concurrency`](Consumer::concurrency)), the larger the batches. Nothing else changes: each
//! delivery is still settled by its own call's outcome. BENCHMARKS.md has what it measured.
//!
//! Brokers: `amqp` (RabbitMQ through `lapin`, feature `amqp`) and `jetstream` (NATS JetStream
//! through `async-nats`, feature `jetstream`). Both build the one [`Consumer`] type, whose
//! settings are shared; the broker's own half (connection, queue, id reader) is its first type
//! parameter.
//!
//! Your handler's error type tells the consumer where the idempotency error is by implementing
//! [`HandlerError`] (implemented for [`Error`] itself).

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "jetstream")]
pub mod jetstream;

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt as _;

use crate::Error;

/// How long a delivery waits before it is requeued (AMQP) or `nak`ed (JetStream) for a retry: 1 s.
pub const DEFAULT_RETRY_DELAY: Duration = Duration::from_secs(1);

/// How many deliveries a consumer handles at once (and its prefetch): 16.
pub const DEFAULT_CONCURRENCY: usize = 16;

/// On which attempt a message whose handler keeps failing is dead-lettered: the 5th.
///
/// A poison message runs 5 times, four retry delays apart ([`DEFAULT_RETRY_DELAY`] each by
/// default), and then goes to the dead-letter path. A failure that heals by itself within seconds (a
/// downstream restart) still gets its retries; one that lasts longer belongs in the dead-letter
/// path, from where it can be replayed once it is fixed. Raise it with
/// [`max_attempts`](Consumer::max_attempts), or lengthen the delay.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;

/// A consumer of one broker: the settings every broker shares, and `B`, the broker's own half
/// (`amqp::Amqp`, `jetstream::JetStream`).
///
/// Build one with `amqp::Consumer::new(channel, queue)` or `jetstream::Consumer::new(context,
/// pull_consumer)` (`amqp::Consumer<E>` and `jetstream::Consumer<E>` name this type for each
/// broker), set what differs from the defaults, and `run` it. `E` is the handler's error type.
#[must_use = "a Consumer does nothing until `run`"]
pub struct Consumer<B, E> {
    broker: B,
    settings: Settings,
    on_failure: FailurePolicy<E>,
    observer: Option<Observer>,
}

/// The numbers every consumer is configured with, whatever its broker (the callbacks are beside
/// them in [`Consumer`]).
#[derive(Debug, Clone, Copy)]
struct Settings {
    concurrency: usize,
    retry_delay: Duration,
    max_attempts: u32,
}

impl<B: std::fmt::Debug, E> std::fmt::Debug for Consumer<B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("broker", &self.broker)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<B, E> Consumer<B, E> {
    /// A consumer of `broker` with the default settings.
    pub(crate) fn with_broker(broker: B) -> Self {
        Consumer {
            broker,
            settings: Settings {
                concurrency: DEFAULT_CONCURRENCY,
                retry_delay: DEFAULT_RETRY_DELAY,
                max_attempts: DEFAULT_MAX_ATTEMPTS,
            },
            on_failure: Box::new(|_| Disposition::Retry),
            observer: None,
        }
    }

    /// How many deliveries are handled at once; also the AMQP channel's prefetch, or the JetStream
    /// pull batch (default [`DEFAULT_CONCURRENCY`], between 1 and 65,535).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.settings.concurrency = concurrency.clamp(1, usize::from(u16::MAX));
        self
    }

    /// How long a delivery to be retried waits: AMQP holds it for the delay before it returns
    /// it to the queue, JetStream delays the redelivery by it (`-NAK` with a delay). Default
    /// [`DEFAULT_RETRY_DELAY`].
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.settings.retry_delay = delay;
        self
    }

    /// On which attempt a message whose handler failed (its own error that
    /// [`on_failure`](Self::on_failure) retries, or a panic) is dead-lettered instead of retried
    /// (default [`DEFAULT_MAX_ATTEMPTS`], at least 1: 1 dead-letters at the first failure). See
    /// [the module docs](self#panics-and-poison-messages) for what counts as an attempt.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.settings.max_attempts = attempts.max(1);
        self
    }

    /// What to do when the handler fails with its own error (the claim was released, so a retry
    /// runs the body again): [`Disposition::Retry`] (the default; dead-lettered once the attempts
    /// run out), [`Disposition::Ack`] (the error is final, for example recorded with
    /// `record_err`) or [`Disposition::DeadLetter`].
    pub fn on_failure(mut self, policy: impl Fn(&E) -> Disposition + Send + Sync + 'static) -> Self {
        self.on_failure = Box::new(policy);
        self
    }

    /// Calls `observer` after each delivery is settled (for metrics, or a test's ledger).
    ///
    /// Deliveries are settled concurrently, and each call comes when its settlement returns, so
    /// the calls' order need not be the broker's. On RabbitMQ, a retried message's redelivery can
    /// be acknowledged, and reported, before the retry's own requeue has returned and been
    /// reported. Count a message's settlements rather than relying on their order.
    pub fn on_settled(mut self, observer: impl Fn(&Settled) + Send + Sync + 'static) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }
}

impl<B: Broker, E: HandlerError> Consumer<B, E>
where
    Self: Consume<B, E>,
{
    /// Consumes until the broker ends the consumption: [`run_until`](Self::run_until) with a
    /// `stop` that never completes.
    ///
    /// # Errors
    ///
    /// As [`run_until`](Self::run_until).
    pub async fn run<F, Fut, T>(self, handler: F) -> Result<(), B::Error>
    where
        F: Fn(B::Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_until(handler, std::future::pending()).await
    }

    /// Consumes until `stop` completes, then finishes the deliveries in hand; or until the broker
    /// ends the consumption: the AMQP channel closes or RabbitMQ cancels the consumer, the
    /// JetStream consumer fails (deleted, for example).
    ///
    /// Deliveries taken but not started stay unacknowledged, and the broker delivers them again:
    /// AMQP when the channel closes (the consumer is cancelled once `stop` completed), JetStream
    /// after the consumer's `ack_wait`. The AMQP channel is put in publisher-confirm mode (the
    /// copies returned after a failure are confirmed before the original is acked).
    ///
    /// # Errors
    ///
    /// The broker's error (`lapin::Error`, `async_nats::Error`): when the AMQP consumer cannot be
    /// started or its channel fails; when a JetStream pull fails for another reason than a missed
    /// heartbeat (which is logged); at once, when the JetStream consumer's ack policy is not
    /// `Explicit`.
    pub async fn run_until<F, Fut, T>(self, handler: F, stop: impl Future<Output = ()>) -> Result<(), B::Error>
    where
        F: Fn(B::Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.consume(handler, stop).await
    }
}

/// The traits through which each broker's module plugs its consuming into [`Consumer::run`] and
/// [`Consumer::run_until`], which are written once here. Public (in a private module) only so that
/// those signatures can name them: outside the crate they cannot be named or implemented.
pub(crate) mod broker {
    use std::future::Future;

    /// The broker's half of a [`Consumer`](super::Consumer) (`amqp::Amqp`, `jetstream::JetStream`):
    /// what its handler is given and how its consuming fails.
    pub trait Broker {
        /// What the handler is given (`amqp::Message`, `jetstream::Message`).
        type Message;
        /// How consuming fails (`lapin::Error`, `async_nats::Error`).
        type Error;
    }

    /// The consuming of a consumer of broker `B`: the body of `run_until`.
    pub trait Consume<B: Broker, E> {
        /// Hands each delivery to `handler` and settles it, until `stop` completes or the broker
        /// ends the consumption.
        fn consume(
            self,
            handler: impl Handle<B, E>,
            stop: impl Future<Output = ()>,
        ) -> impl Future<Output = Result<(), B::Error>>;
    }

    /// A consumer's handler, `Fn(B::Message) -> impl Future<Output = Result<T, E>>`, named once for
    /// the brokers' code.
    pub trait Handle<B: Broker, E> {
        /// What the handler returns on success.
        type Ok;
        /// The handler's future.
        type Future: Future<Output = Result<Self::Ok, E>>;

        /// Runs the handler on `message`.
        fn handle(&self, message: B::Message) -> Self::Future;
    }

    impl<B: Broker, E, T, F, Fut> Handle<B, E> for F
    where
        F: Fn(B::Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        type Ok = T;
        type Future = Fut;

        fn handle(&self, message: B::Message) -> Fut {
            self(message)
        }
    }
}

use broker::{Broker, Consume, Handle};

/// Runs `handler` on `message` with the handler's future on the heap.
///
/// A delivery in hand is a future that the consumer creates and moves as it starts (into its
/// task, into `decide`'s panic guard), and a handler's future can be tens of kilobytes (38 KB
/// for an `#[idempotent]` handler on the PostgreSQL store): held inline, a delivery's future
/// kept two to four copies of it (by the layout the compiler gave the brokers' code), and each
/// move copied them. Boxed, it costs one allocation per delivery. The handler is called when
/// this future is first polled, inside `decide`: a handler that panics before it returns its
/// future is caught like its future's panics.
pub(crate) async fn run_boxed<B: Broker, E, H: Handle<B, E>>(handler: &H, message: B::Message) -> Result<H::Ok, E> {
    Box::pin(handler.handle(message)).await
}

/// What the consumer decided for one delivery, from the handler's run.
pub(crate) struct Verdict {
    pub(crate) disposition: Disposition,
    pub(crate) reason: Option<String>,
    /// The handler itself failed (its own error, retried by the policy, or a panic): a retry
    /// spends one of the message's attempts.
    pub(crate) failed: bool,
}

impl Verdict {
    /// Dead-letter, for `reason`, without running the handler.
    pub(crate) fn dead_letter(reason: &str) -> Verdict {
        Verdict { disposition: Disposition::DeadLetter, reason: Some(reason.to_owned()), failed: false }
    }
}

impl<B, E: HandlerError> Consumer<B, E> {
    /// Runs the handler's future for message `id` (catching a panic) on its `attempt`-th attempt,
    /// and decides the settlement; a failure on attempt `cap` (or later) is dead-lettered.
    pub(crate) async fn decide<T>(
        &self,
        id: &str,
        attempt: u32,
        cap: u32,
        run: impl Future<Output = Result<T, E>>,
    ) -> Verdict {
        let mut verdict = match AssertUnwindSafe(run).catch_unwind().await {
            Ok(result) => {
                let own_error = matches!(&result, Err(e) if e.idempotency_error().is_none());
                // The policy is the user's code: a panic in it is a failed attempt, not the end
                // of the consumer.
                let decided = std::panic::catch_unwind(AssertUnwindSafe(|| disposition(&result, &*self.on_failure)));
                let (disposition, reason) = decided.unwrap_or_else(|panic| {
                    let panic = panic_message(&*panic);
                    tracing::error!(
                        target: "idempotent::consume", message_id = id, attempt, panic,
                        "the on_failure policy panicked; the attempt counts as failed"
                    );
                    (Disposition::Retry, Some(format!("the on_failure policy panicked: {panic}")))
                });
                Verdict { disposition, reason, failed: own_error && disposition == Disposition::Retry }
            }
            Err(panic) => {
                let panic = panic_message(&*panic);
                tracing::error!(
                    target: "idempotent::consume", message_id = id, attempt, panic,
                    "the handler panicked; the attempt counts as failed"
                );
                Verdict {
                    disposition: Disposition::Retry,
                    reason: Some(format!("the handler panicked: {panic}")),
                    failed: true,
                }
            }
        };
        if verdict.failed && attempt >= cap {
            verdict.disposition = Disposition::DeadLetter;
            let reason = verdict.reason.take().unwrap_or_default();
            verdict.reason = Some(format!("{reason} (attempt {attempt} of {cap}: no attempt left)"));
        }
        verdict
    }

    /// Logs a settlement and tells the observer.
    pub(crate) fn settled(&self, settled: &Settled) {
        log(settled);
        if let Some(observer) = &self.observer {
            // The delivery is settled already; a panicking observer must not end the consumer.
            if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| observer(settled))) {
                let panic = panic_message(&*panic);
                tracing::error!(target: "idempotent::consume", panic, "the on_settled observer panicked");
            }
        }
    }
}

/// A message's id by the consumer's id reader: `None` for no id, an empty one, or a reader that
/// panicked (logged: the message goes to the dead-letter path, the consumer keeps running).
pub(crate) fn read_id<M: ?Sized>(id_of: &(dyn Fn(&M) -> Option<String> + Send + Sync), message: &M) -> Option<String> {
    match std::panic::catch_unwind(AssertUnwindSafe(|| id_of(message))) {
        Ok(id) => id.filter(|id| !id.is_empty()),
        Err(panic) => {
            let panic = panic_message(&*panic);
            tracing::error!(
                target: "idempotent::consume", panic,
                "the id reader panicked; the message is taken as having no id"
            );
            None
        }
    }
}

/// The text of a panic's payload (`panic!` gives a `&str` or a `String`).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(text), _) => (*text).to_owned(),
        (None, Some(text)) => text.clone(),
        (None, None) => "a panic without a message".to_owned(),
    }
}

/// What becomes of a delivery once its handler returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Acknowledge: the message is done and leaves the queue.
    Ack,
    /// Return it to the queue after the consumer's retry delay, for another attempt.
    Retry,
    /// Reject it to the dead-letter path (with the reason logged): it must not be retried.
    DeadLetter,
}

/// The error type of a consumer's handler: where the idempotency [`Error`] is, if this is one.
///
/// ```
/// use idempotent_runtime::{Error, consume::HandlerError};
///
/// #[derive(Debug)]
/// enum PayError {
///     Idempotency(Error),
///     Declined,
/// }
///
/// impl std::fmt::Display for PayError {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         match self {
///             PayError::Idempotency(e) => e.fmt(f),
///             PayError::Declined => f.write_str("the card was declined"),
///         }
///     }
/// }
///
/// impl HandlerError for PayError {
///     fn idempotency_error(&self) -> Option<&Error> {
///         match self {
///             PayError::Idempotency(e) => Some(e),
///             PayError::Declined => None,
///         }
///     }
/// }
/// # assert!(PayError::Declined.idempotency_error().is_none());
/// ```
pub trait HandlerError: std::fmt::Display {
    /// The idempotency error this error carries, or `None` for the handler's own failures.
    fn idempotency_error(&self) -> Option<&Error>;
}

impl HandlerError for Error {
    fn idempotency_error(&self) -> Option<&Error> {
        Some(self)
    }
}

/// One settled delivery, as reported to an [`on_settled`](Consumer::on_settled) observer.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settled {
    /// The message id, when the message had a valid one.
    pub message_id: Option<String>,
    /// What was done with the delivery (after the broker accepted the ack, requeue or reject).
    pub disposition: Disposition,
    /// Whether the broker said it had delivered this message before.
    pub redelivered: bool,
    /// Which attempt this was (1 for the first): JetStream's delivery count, or the count the AMQP
    /// consumer carries in the `Idempotent-Attempt` header.
    pub attempt: u32,
    /// Why the message was retried or dead-lettered; `None` when acknowledged after success.
    pub reason: Option<String>,
}

/// The observer type of `on_settled`.
type Observer = Arc<dyn Fn(&Settled) + Send + Sync>;

/// The failure policy type of `on_failure`.
type FailurePolicy<E> = Box<dyn Fn(&E) -> Disposition + Send + Sync>;

/// The settlement that the handler's result asks for, with the reason to log.
fn disposition<T, E: HandlerError>(
    result: &Result<T, E>,
    on_failure: &(dyn Fn(&E) -> Disposition + Send + Sync),
) -> (Disposition, Option<String>) {
    let Err(error) = result else { return (Disposition::Ack, None) };
    let Some(idempotency) = error.idempotency_error() else {
        return (on_failure(error), Some(format!("the handler failed: {error}")));
    };
    let disposition = match idempotency {
        // Claimed elsewhere or the store is down: later may succeed. A mistake in the program's
        // configuration (a bad lease, a scope collision): the message waits in the queue for the
        // fix instead of filling the dead-letter path.
        Error::InProgress { .. }
        | Error::Store { .. }
        | Error::InvalidOption { .. }
        | Error::ScopeCollision { .. }
        | Error::StepOutsideCall { .. } => Disposition::Retry,
        // The body ran (and will not run again under this key): acknowledging is what keeps it once.
        Error::Unrecordable { .. } | Error::LeaseLost { .. } => Disposition::Ack,
        // A reused id with another request, a bad id, a record of another type: retrying cannot help.
        Error::FingerprintMismatch { .. } | Error::InvalidKey(_) | Error::Decode { .. } | Error::Fingerprint(_) => {
            Disposition::DeadLetter
        }
    };
    (disposition, Some(idempotency.to_string()))
}

/// Logs a settlement under the target `idempotent::consume`.
fn log(settled: &Settled) {
    let id = settled.message_id.as_deref().unwrap_or("<none>");
    let reason = settled.reason.as_deref().unwrap_or("");
    match settled.disposition {
        Disposition::Ack if settled.reason.is_none() => {
            tracing::debug!(target: "idempotent::consume", message_id = id, redelivered = settled.redelivered, attempt = settled.attempt, "acked");
        }
        Disposition::Ack => {
            tracing::warn!(target: "idempotent::consume", message_id = id, reason, "acked after an error, not retried");
        }
        Disposition::Retry => {
            tracing::info!(target: "idempotent::consume", message_id = id, reason, attempt = settled.attempt, "returned to the queue for a delayed retry");
        }
        Disposition::DeadLetter => {
            tracing::warn!(target: "idempotent::consume", message_id = id, reason, attempt = settled.attempt, "dead-lettered");
        }
    }
}

/// The reason logged for a message without an id.
pub(crate) const NO_ID: &str = "the message has no id to deduplicate it by";

/// What the brokers' tests of a delivery's future size share.
#[cfg(test)]
pub(crate) mod sizes {
    use crate::Error;

    /// The size of the futures `make` returns (it is never called).
    pub(crate) fn future_size<A, F: std::future::Future>(_make: impl Fn(A) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// A handler whose future holds 64 KiB across an await, as large as the futures of handlers
    /// on some stores (an `#[idempotent]` handler on the PostgreSQL store: 38 KB).
    #[allow(clippy::large_stack_arrays, reason = "the large future is what the tests measure; it is never polled")]
    pub(crate) async fn large<M>(_: M) -> Result<(), Error> {
        let buffer = [1u8; 65_536];
        tokio::task::yield_now().await;
        std::hint::black_box(&buffer);
        Ok(())
    }

    /// A handler whose future is small.
    pub(crate) async fn small<M>(_: M) -> Result<(), Error> {
        Ok(())
    }

    /// How much larger a delivery's future may be with [`large`] than with [`small`].
    pub(crate) const GROWTH_ALLOWED: usize = 1024;
}

#[cfg(test)]
mod tests {
    use super::{Disposition, disposition};
    use crate::{Error, KeyError, StoreError};

    fn of(error: Error) -> Disposition {
        disposition::<(), Error>(&Err(error), &|_| Disposition::Retry).0
    }

    #[test]
    fn consume_outcomes_map_to_settlements() {
        assert_eq!(disposition::<_, Error>(&Ok(()), &|_| Disposition::Retry), (Disposition::Ack, None));
        assert_eq!(of(Error::InProgress { key: "k".into(), retry_after: None }), Disposition::Retry);
        let source = StoreError::backend("redis", "down");
        assert_eq!(of(Error::Store { key: "k".into(), operation: "claim", source }), Disposition::Retry);
        assert_eq!(of(Error::FingerprintMismatch { key: "k".into() }), Disposition::DeadLetter);
        assert_eq!(of(Error::InvalidKey(KeyError::Empty)), Disposition::DeadLetter);
        assert_eq!(of(Error::Decode { key: "k".into(), reason: "r".into() }), Disposition::DeadLetter);
        assert_eq!(of(Error::Unrecordable { key: "k".into(), reason: "r".into() }), Disposition::Ack);
        assert_eq!(of(Error::LeaseLost { key: "k".into() }), Disposition::Ack);
        let collision = Error::ScopeCollision { scope: "s".into(), first: "a".into(), second: "b".into() };
        assert_eq!(of(collision), Disposition::Retry);
    }

    #[derive(Debug)]
    struct Declined;
    impl std::fmt::Display for Declined {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("declined")
        }
    }
    impl super::HandlerError for Declined {
        fn idempotency_error(&self) -> Option<&Error> {
            None
        }
    }

    #[test]
    fn consume_failures_follow_the_policy() {
        let (d, reason) = disposition::<(), _>(&Err(Declined), &|_| Disposition::DeadLetter);
        assert_eq!(d, Disposition::DeadLetter);
        assert_eq!(reason.as_deref(), Some("the handler failed: declined"));
    }

    /// What `decide` makes of one run on attempt `attempt` of a cap of 3.
    fn decided<E: super::HandlerError>(
        consumer: &super::Consumer<(), E>,
        attempt: u32,
        run: impl std::future::Future<Output = Result<(), E>>,
    ) -> (Disposition, Option<String>, bool) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a runtime");
        let verdict = runtime.block_on(consumer.decide("id", attempt, 3, run));
        (verdict.disposition, verdict.reason, verdict.failed)
    }

    #[test]
    fn consume_a_failure_on_the_last_attempt_is_dead_lettered_and_only_a_failure_counts() {
        let consumer = super::Consumer::<(), Declined>::with_broker(());
        let (d, reason, failed) = decided(&consumer, 2, async { Err(Declined) });
        assert_eq!((d, reason.as_deref(), failed), (Disposition::Retry, Some("the handler failed: declined"), true));
        let (d, reason, _) = decided(&consumer, 3, async { Err(Declined) });
        assert_eq!(d, Disposition::DeadLetter);
        assert_eq!(reason.as_deref(), Some("the handler failed: declined (attempt 3 of 3: no attempt left)"));
        assert_eq!(decided(&consumer, 7, async { Ok(()) }), (Disposition::Ack, None, false));
        // A panic counts like a failure; its message is the reason.
        let (d, reason, failed) = decided(&consumer, 1, async { panic!("boom {}", 42) });
        assert_eq!((d, reason.as_deref(), failed), (Disposition::Retry, Some("the handler panicked: boom 42"), true));
        let (d, _, _) = decided(&consumer, 3, async { panic!("boom") });
        assert_eq!(d, Disposition::DeadLetter);
        // The policy's own dead-letter or ack is not a counted retry.
        let acking = super::Consumer::<(), Declined>::with_broker(()).on_failure(|_| Disposition::Ack);
        assert_eq!(decided(&acking, 3, async { Err(Declined) }).0, Disposition::Ack);
        // Retries that are not the message's fault never run out.
        let waiting = super::Consumer::<(), Error>::with_broker(());
        let busy = async { Err(Error::InProgress { key: "k".into(), retry_after: None }) };
        assert_eq!(decided(&waiting, 3, busy).0, Disposition::Retry);
        let down = async {
            let source = StoreError::backend("redis", "down");
            Err(Error::Store { key: "k".into(), operation: "claim", source })
        };
        let (d, _, failed) = decided(&waiting, 9, down);
        assert_eq!((d, failed), (Disposition::Retry, false));
    }

    #[test]
    fn consume_a_failure_policy_that_panics_counts_as_a_failed_attempt() {
        // A panic in `on_failure` used to unwind through the consumer and end its `run`.
        let panicking = super::Consumer::<(), Declined>::with_broker(()).on_failure(|_| panic!("policy bug"));
        let (d, reason, failed) = decided(&panicking, 1, async { Err(Declined) });
        assert_eq!(
            (d, reason.as_deref(), failed),
            (Disposition::Retry, Some("the on_failure policy panicked: policy bug"), true)
        );
        let (d, _, _) = decided(&panicking, 3, async { Err(Declined) });
        assert_eq!(d, Disposition::DeadLetter);
        // A success never asks the policy.
        assert_eq!(decided(&panicking, 1, async { Ok(()) }).0, Disposition::Ack);
    }

    #[test]
    fn consume_an_observer_that_panics_does_not_end_the_consumer() {
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = std::sync::Arc::clone(&seen);
        let consumer = super::Consumer::<(), Declined>::with_broker(()).on_settled(move |_| {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            panic!("observer bug");
        });
        let settled = super::Settled {
            message_id: Some("id".into()),
            disposition: Disposition::Ack,
            redelivered: false,
            attempt: 1,
            reason: None,
        };
        consumer.settled(&settled);
        consumer.settled(&settled);
        assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), 2);
    }
}
