//! An idempotent consumer for NATS JetStream (a pull consumer, through [`async_nats`]). Feature
//! `jetstream`.
//!
//! ```no_run
//! use idempotent_runtime::consume::jetstream::{Consumer, async_nats};
//! use async_nats::jetstream::{self, consumer::pull};
//! use idempotent_runtime::{idempotent, Error, MemoryStore};
//!
//! #[idempotent(key = id, store = store, fingerprint = body)]
//! async fn handle(store: &MemoryStore, id: &str, body: &[u8]) -> Result<(), Error> {
//!     Ok(()) // the side effect: runs once per Nats-Msg-Id
//! }
//!
//! # async fn demo() -> Result<(), async_nats::Error> {
//! let store = MemoryStore::new();
//! let js = jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
//! let stream = js.get_stream("PAYMENTS").await?;
//! let consumer = stream
//!     .get_or_create_consumer("workers", pull::Config { durable_name: Some("workers".into()), ..Default::default() })
//!     .await?;
//! Consumer::new(js, consumer)
//!     .dead_letter("payments.dead-letter") // a subject that a stream of yours keeps
//!     .run(|message| {
//!         let store = &store;
//!         async move { handle(store, message.id(), message.payload()).await }
//!     })
//!     .await
//! # }
//! ```
//!
//! # Settlement
//!
//! Executed or replayed → `+ACK`; retry → `-NAK` with the retry delay (JetStream redelivers it
//! after the delay, to any consumer; no hot loop); dead-letter → the message is published, with
//! its headers, its reason in [`DEAD_LETTER_REASON`] and its id in [`DEAD_LETTER_MESSAGE_ID`], to
//! the [`dead_letter`](super::Consumer::dead_letter) subject (JetStream has no dead-letter queue of
//! its own), and then terminated with `+TERM` so it is never delivered again. Without a
//! dead-letter subject, the message is only terminated, and only the log keeps it. A message read
//! from the dead-letter subject itself (a consumer that takes in its own dead letters) is only
//! terminated too: it is stored there already, and a new copy would be read and copied again.
//!
//! # The dead-letter copy's id
//!
//! The default id reader takes [`DEAD_LETTER_MESSAGE_ID`] when a message has it, and
//! `Nats-Msg-Id` otherwise; a dead-letter copy of a message that had no id (it carries
//! [`DEAD_LETTER_REASON`] but no [`DEAD_LETTER_MESSAGE_ID`]) has no id. So a consumer of the
//! dead-letter subject, or a tool that publishes the copies back to the work subject with their
//! headers, runs each message under its original key, with the default settings. The copy's own
//! `Nats-Msg-Id` is `<stream>.<consumer>.<sequence>` of the original: never the original id,
//! which the duplicate window of a stream that keeps both subjects would drop as a duplicate, and
//! the same for every copy of one delivery, so a crash between the copy and the `+TERM` (the
//! message comes back and is copied again) leaves one copy within the dead-letter stream's
//! duplicate window.
//!
//! # Attempts, and handlers longer than `ack_wait`
//!
//! JetStream counts the deliveries of each message (`num_delivered`): a failure of the handler (its
//! own error that the policy retries, or a panic) on the delivery
//! [`max_attempts`](super::Consumer::max_attempts) is dead-lettered. Every delivery counts, also one
//! that followed a crash or a `-NAK` for a key claimed elsewhere; only a failure of the handler
//! ends in the dead-letter path. When the consumer's own `max_deliver` is lower, it is the cap:
//! after it JetStream would not deliver the message again. So on the delivery `max_deliver` every
//! retry is dead-lettered, also one that is not the message's fault (the key claimed elsewhere,
//! the store down): a `-NAK` there would drop the message silently, its work never done. For the
//! same reason, a dead-letter copy that cannot be published on that delivery (no stream takes the
//! subject, JetStream cannot store) is not `-NAK`ed: the message is kept in progress and the copy
//! is tried again every [`retry_delay`](super::Consumer::retry_delay) (at least 100 ms) until it
//! is stored. Only a consumer that stops first gives it up, with an `ERROR` naming its stream
//! sequence; JetStream keeps it in the stream, but will not deliver it to this consumer again.
//!
//! JetStream redelivers a message whose ack does not arrive within the consumer's `ack_wait`. While
//! the handler runs, the consumer tells JetStream that the work goes on (`+WPI`, "in progress"),
//! every third of `ack_wait` (read from the consumer's info), so a handler may take longer than
//! `ack_wait` without being delivered again meanwhile. The idempotency key's lease is renewed in
//! the same way by its heartbeat, so both the broker and the store hold the message for as long
//! as the handler runs; a consumer that dies stops both, and the message is redelivered after
//! `ack_wait`.
pub use async_nats;

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::MessagesErrorKind;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::message::Acker;
use async_nats::jetstream::{AckKind, Context};
use async_nats::{HeaderMap, Subject};
use bytes::Bytes;
use futures_util::{FutureExt as _, StreamExt as _};

use super::broker::{Broker, Consume, Handle};
use super::{Disposition, HandlerError, NO_ID, Settled, Verdict};

/// The header a dead-lettered copy carries its reason in.
pub const DEAD_LETTER_REASON: &str = "Idempotent-Dead-Letter-Reason";

/// The header a dead-lettered copy carries the original message id in; the default id reader
/// takes it before `Nats-Msg-Id`.
pub const DEAD_LETTER_MESSAGE_ID: &str = "Idempotent-Message-Id";

/// JetStream's default `ack_wait`, for a consumer whose info does not say.
const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);

/// The shortest wait between two tries of a dead-letter copy on a message's last delivery.
const MIN_COPY_DELAY: Duration = Duration::from_millis(100);

/// A JetStream consumer: the one [`Consumer`](super::Consumer) type, with its JetStream half.
pub type Consumer<E> = super::Consumer<JetStream, E>;

/// The JetStream half of a [`Consumer`]: the pull consumer, the dead-letter subject and how a
/// message's id is read.
pub struct JetStream {
    context: Context,
    pull: PullConsumer,
    dead_letter: Option<Subject>,
    id_of: IdOf,
}

impl std::fmt::Debug for JetStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStream")
            .field("consumer", &self.pull.cached_info().name)
            .field("dead_letter", &self.dead_letter)
            .finish_non_exhaustive()
    }
}

/// A message handed to the handler: its id, subject, payload and headers.
#[derive(Debug)]
pub struct Message {
    id: String,
    subject: Subject,
    payload: Bytes,
    headers: Option<HeaderMap>,
    delivered: i64,
}

impl Message {
    /// The message id: the idempotency key to run the handler under.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The payload.
    #[must_use]
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The subject it was published to.
    #[must_use]
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The headers, if it has any.
    #[must_use]
    pub fn headers(&self) -> Option<&HeaderMap> {
        self.headers.as_ref()
    }

    /// How many times JetStream has delivered it, this time included (the attempt).
    #[must_use]
    pub fn delivered(&self) -> i64 {
        self.delivered
    }
}

type IdOf = Box<dyn Fn(&async_nats::Message) -> Option<String> + Send + Sync>;

/// The default id reader: [`DEAD_LETTER_MESSAGE_ID`], else (unless this is a dead-letter copy)
/// `Nats-Msg-Id`.
fn default_id(message: &async_nats::Message) -> Option<String> {
    let headers = message.headers.as_ref()?;
    if let Some(id) = headers.get(DEAD_LETTER_MESSAGE_ID) {
        return Some(id.as_str().to_owned());
    }
    if headers.get(DEAD_LETTER_REASON).is_some() {
        return None; // a copy of a message that had no id; its Nats-Msg-Id is the copy's own
    }
    Some(headers.get(async_nats::header::NATS_MESSAGE_ID)?.as_str().to_owned())
}

impl Broker for JetStream {
    type Message = Message;
    type Error = async_nats::Error;
}

impl<E: HandlerError> Consumer<E> {
    /// Consumes from `consumer`, taking each message's id from its `Nats-Msg-Id` header (or, on a
    /// dead-letter copy, [`DEAD_LETTER_MESSAGE_ID`]). `context` publishes dead-lettered copies.
    /// `consumer` must have the explicit ack policy (the default): `run` fails at once on another.
    pub fn new(context: Context, consumer: PullConsumer) -> Self {
        super::Consumer::with_broker(JetStream {
            context,
            pull: consumer,
            dead_letter: None,
            id_of: Box::new(default_id),
        })
    }

    /// Publishes dead-lettered messages to `subject` (which a stream must capture) before
    /// terminating them. Without it they are terminated and logged only.
    pub fn dead_letter(mut self, subject: impl Into<String>) -> Self {
        self.broker.dead_letter = Some(Subject::from(subject.into()));
        self
    }

    /// Takes each message's id from `id_of` (another header, a field of the payload) instead of
    /// the default reader. `None` (or an empty id, or a panic of `id_of`, logged) sends the
    /// message to the dead-letter path.
    pub fn id_from(mut self, id_of: impl Fn(&async_nats::Message) -> Option<String> + Send + Sync + 'static) -> Self {
        self.broker.id_of = Box::new(id_of);
        self
    }
}

impl<E: HandlerError> Consume<JetStream, E> for Consumer<E> {
    async fn consume(
        self,
        handler: impl Handle<JetStream, E>,
        stop: impl Future<Output = ()>,
    ) -> Result<(), async_nats::Error> {
        let config = &self.broker.pull.cached_info().config;
        if config.ack_policy != AckPolicy::Explicit {
            // `All` acks every earlier message with each ack, also one whose handler still runs and
            // then fails; `None` acks each on delivery. Either loses a message whose handler failed.
            return Err(format!(
                "the idempotent consumer needs a JetStream consumer with AckPolicy::Explicit, not {:?}: it \
                 settles each message by its own outcome",
                config.ack_policy
            )
            .into());
        }
        let ack_wait = if config.ack_wait.is_zero() { DEFAULT_ACK_WAIT } else { config.ack_wait };
        let last = u32::try_from(config.max_deliver).ok().filter(|&max_deliver| max_deliver > 0);
        let cap = last.map_or(self.settings.max_attempts, |max_deliver| self.settings.max_attempts.min(max_deliver));
        let limits = Limits { progress_every: ack_wait / 3, cap, last };
        let messages = self.broker.pull.stream().max_messages_per_batch(self.settings.concurrency).messages().await?;
        let failure = Mutex::new(None);
        // Shared: a delivery that waits to be dead-lettered on its last delivery gives up when it
        // fires, even while every slot is taken and the stream is not polled.
        let stop = stop.shared();
        messages
            .take_until(stop.clone())
            .scan((), |(), item| {
                let next = match item {
                    Ok(message) => Some(Some(message)),
                    Err(e) if e.kind() == MessagesErrorKind::MissingHeartbeat => {
                        tracing::warn!(target: "idempotent::consume", error = %e, "JetStream pull: missed heartbeat");
                        Some(None)
                    }
                    Err(e) => {
                        *failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
                        None
                    }
                };
                std::future::ready(next)
            })
            .filter_map(std::future::ready)
            .for_each_concurrent(self.settings.concurrency, |message| {
                self.settle(message, &handler, limits, stop.clone())
            })
            .await;
        match failure.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

impl<E: HandlerError> Consumer<E> {
    async fn settle(
        &self,
        message: async_nats::jetstream::Message,
        handler: &impl Handle<JetStream, E>,
        limits: Limits,
        stop: impl Future<Output = ()>,
    ) {
        let id = super::read_id(&*self.broker.id_of, &message.message);
        let (delivered, source) = match message.info() {
            Ok(info) => (info.delivered, format!("{}.{}.{}", info.stream, info.consumer, info.stream_sequence)),
            Err(_) => (1, String::new()),
        };
        let attempt = u32::try_from(delivered).unwrap_or(u32::MAX).max(1);
        let redelivered = delivered > 1;
        let (message, acker) = message.split();
        let async_nats::Message { subject, payload, headers, .. } = message;
        // What a dead-lettered copy needs after the handler took the message.
        // A message read from the dead-letter subject itself (a consumer whose filter takes it in) is
        // already stored there: another copy would be read and copied again, without end.
        let keep = self
            .broker
            .dead_letter
            .as_ref()
            .filter(|dead_letter| **dead_letter != subject)
            .map(|_| (payload.clone(), headers.clone()));
        let verdict = match &id {
            None => Verdict::dead_letter(NO_ID),
            Some(id) => {
                let message = Message { id: id.clone(), subject, payload, headers, delivered };
                // Called inside the future whose panics `decide` catches (see the AMQP consumer).
                let work = super::run_boxed(handler, message);
                let run = with_progress(work, &acker, limits.progress_every);
                self.decide(id, attempt, limits.cap, run).await
            }
        };
        let Verdict { mut disposition, mut reason, .. } = verdict;
        let last_delivery = limits.last.is_some_and(|last| attempt >= last);
        if let Some(last) = limits.last.filter(|_| disposition == Disposition::Retry && last_delivery) {
            // JetStream does not deliver a message again after the consumer's `max_deliver`: a
            // `-NAK` now would drop it silently, its work never done. The dead-letter path keeps it.
            let why = reason.take().unwrap_or_default();
            reason = Some(format!(
                "{why} (delivery {attempt} of the consumer's max_deliver {last}: JetStream would not deliver it again)"
            ));
            disposition = Disposition::DeadLetter;
        }
        let settled = match disposition {
            Disposition::Ack => acker.ack().await,
            Disposition::Retry => acker.ack_with(AckKind::Nak(Some(self.settings.retry_delay))).await,
            Disposition::DeadLetter => {
                let reason = reason.as_deref().unwrap_or_default();
                let copied = match self.copy_to_dead_letter(keep.as_ref(), id.as_deref(), reason, &source).await {
                    Err(e) if last_delivery => {
                        let copying = self.copy_until_published(keep.as_ref(), id.as_deref(), reason, &source, e);
                        tokio::select! {
                            copied = with_progress(copying, &acker, limits.progress_every) => copied,
                            () = stop => Err("the consumer stopped before the copy was stored".into()),
                        }
                    }
                    copied => copied,
                };
                if let Err(e) = copied {
                    let message_id = id.as_deref().unwrap_or("<none>");
                    if last_delivery {
                        tracing::error!(
                            target: "idempotent::consume", message_id, reason, source, error = %e,
                            "could not publish to the dead-letter subject before the consumer stopped, on the last \
                             delivery the consumer's max_deliver allows: JetStream keeps the message in its stream \
                             (`source` is stream.consumer.sequence) but will not deliver it to this consumer again"
                        );
                    } else {
                        tracing::error!(
                            target: "idempotent::consume", message_id, reason, error = %e,
                            "could not publish to the dead-letter subject; the message is retried after the delay"
                        );
                    }
                    let _ = acker.ack_with(AckKind::Nak(Some(self.settings.retry_delay))).await;
                    return;
                }
                acker.ack_with(AckKind::Term).await
            }
        };
        match settled {
            Ok(()) => self.settled(&Settled { message_id: id, disposition, redelivered, reason, attempt }),
            Err(e) => tracing::warn!(
                target: "idempotent::consume", message_id = id.as_deref().unwrap_or("<none>"), ?disposition, error = %e,
                "settling the message failed; JetStream delivers it again after ack_wait"
            ),
        }
    }

    async fn copy_to_dead_letter(
        &self,
        keep: Option<&(Bytes, Option<HeaderMap>)>,
        id: Option<&str>,
        reason: &str,
        source: &str,
    ) -> Result<(), async_nats::Error> {
        let (Some(subject), Some((payload, headers))) = (&self.broker.dead_letter, keep) else { return Ok(()) };
        let mut headers = headers.clone().unwrap_or_default();
        let printable: String = reason.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
        headers.insert(DEAD_LETTER_REASON, printable);
        if let Some(id) = id {
            headers.insert(DEAD_LETTER_MESSAGE_ID, id);
        }
        if !source.is_empty() {
            headers.insert(async_nats::header::NATS_MESSAGE_ID, source);
        }
        self.broker.context.publish_with_headers(subject.clone(), headers, payload.clone()).await?.await?;
        Ok(())
    }

    /// Publishes the dead-letter copy again, every retry delay (at least 100 ms), until it is
    /// stored: on the last delivery JetStream makes, a `-NAK` would leave the message undelivered
    /// for good. `first` is the failure of the first try. Runs until the copy is stored; the
    /// caller gives up when the consumer stops.
    async fn copy_until_published(
        &self,
        keep: Option<&(Bytes, Option<HeaderMap>)>,
        id: Option<&str>,
        reason: &str,
        source: &str,
        first: async_nats::Error,
    ) -> Result<(), async_nats::Error> {
        let delay = self.settings.retry_delay.max(MIN_COPY_DELAY);
        tracing::error!(
            target: "idempotent::consume", message_id = id.unwrap_or("<none>"), reason, error = %first,
            "could not publish to the dead-letter subject on the message's last delivery; the message is kept \
             in progress and the copy is tried again every {delay:?} until it is stored"
        );
        loop {
            tokio::time::sleep(delay).await;
            match self.copy_to_dead_letter(keep, id, reason, source).await {
                Ok(()) => return Ok(()),
                Err(e) => tracing::warn!(
                    target: "idempotent::consume", message_id = id.unwrap_or("<none>"), error = %e,
                    "the dead-letter copy failed again; trying again"
                ),
            }
        }
    }
}

/// What `run_until` reads from the consumer's info once, for every message.
#[derive(Clone, Copy)]
struct Limits {
    /// How often a running handler's message is reported in progress (a third of `ack_wait`).
    progress_every: Duration,
    /// On which delivery a failure is dead-lettered.
    cap: u32,
    /// The consumer's `max_deliver`, if it has one: the last delivery JetStream makes, on which
    /// any retry is dead-lettered instead.
    last: Option<u32>,
}

/// Runs `work`, telling JetStream every `every` that the message is in progress (`+WPI`), so it
/// is not redelivered after `ack_wait` while `work` runs.
async fn with_progress<F: Future>(work: F, acker: &Acker, every: Duration) -> F::Output {
    let progress = async {
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            ticks.tick().await;
            if let Err(e) = acker.ack_with(AckKind::Progress).await {
                tracing::warn!(target: "idempotent::consume", error = %e, "could not report the message in progress");
            }
        }
    };
    tokio::select! {
        output = work => output,
        () = progress => unreachable!("the progress loop never ends"),
    }
}

#[cfg(test)]
mod tests {
    use super::super::broker::Handle;
    use super::super::sizes::{GROWTH_ALLOWED, future_size, large, small};
    use super::{Consumer, JetStream, Limits, Message};
    use crate::Error;

    /// The size of a delivery's future with `handler`.
    fn delivery_size(handler: &'static impl Handle<JetStream, Error>) -> usize {
        future_size(
            |(consumer, message, limits): (&'static Consumer<Error>, async_nats::jetstream::Message, Limits)| {
                consumer.settle(message, handler, limits, std::future::pending::<()>())
            },
        )
    }

    #[test]
    fn jetstream_a_delivery_in_hand_does_not_hold_the_handler_future_inline() {
        // As for the AMQP consumer: the handler's future is boxed, not copied with each move.
        let (small, large) = (delivery_size(&small::<Message>), delivery_size(&large::<Message>));
        assert!(
            large < small + GROWTH_ALLOWED,
            "a delivery's future is {large} bytes with a 64 KiB handler future, {small} with a small one"
        );
    }
}
