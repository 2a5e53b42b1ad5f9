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
//! its headers and the header `Idempotent-Dead-Letter-Reason`, to the
//! [`dead_letter`](Consumer::dead_letter) subject (and its id in `Idempotent-Message-Id`) (JetStream has no dead-letter queue of its own),
//! and then terminated with `+TERM` so it is never delivered again. The copy carries
//! `Nats-Msg-Id: <stream>.<sequence>` of the original, so a crash between the copy and the
//! `+TERM` (the message comes back and is copied again) leaves one copy within the stream's
//! duplicate window. Without a dead-letter subject, the message is only terminated, and only the
//! log keeps it.
//!
//! JetStream redelivers a message whose ack does not arrive within the consumer's `ack_wait`, also
//! while the first delivery is still being handled: make `ack_wait` longer than a handler takes
//! (the duplicate would get [`Error::InProgress`](crate::Error::InProgress) and be retried).

pub use async_nats;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull::MessagesErrorKind;
use async_nats::jetstream::{AckKind, Context};
use async_nats::{HeaderMap, Subject};
use bytes::Bytes;
use futures_util::StreamExt as _;

use super::{
    DEFAULT_CONCURRENCY, DEFAULT_RETRY_DELAY, Disposition, FailurePolicy, HandlerError, NO_ID, Observer, Settled,
    disposition, log,
};

/// The header a dead-lettered copy carries its reason in.
pub const DEAD_LETTER_REASON: &str = "Idempotent-Dead-Letter-Reason";

/// The header a dead-lettered copy carries the original message id in (its `Nats-Msg-Id` is the
/// original's `<stream>.<sequence>`).
pub const DEAD_LETTER_MESSAGE_ID: &str = "Idempotent-Message-Id";

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

    /// How many times JetStream has delivered it, this time included.
    #[must_use]
    pub fn delivered(&self) -> i64 {
        self.delivered
    }
}

type IdOf = Box<dyn Fn(&async_nats::Message) -> Option<String> + Send + Sync>;

/// Consumes from a pull consumer, running each message's handler once per message id and
/// settling the delivery by its outcome (see [the module docs](super)).
#[must_use = "a Consumer does nothing until `run`"]
pub struct Consumer<E> {
    context: Context,
    pull: PullConsumer,
    dead_letter: Option<Subject>,
    concurrency: usize,
    retry_delay: Duration,
    id_of: IdOf,
    on_failure: FailurePolicy<E>,
    observer: Option<Observer>,
}

impl<E> std::fmt::Debug for Consumer<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("dead_letter", &self.dead_letter)
            .field("concurrency", &self.concurrency)
            .field("retry_delay", &self.retry_delay)
            .finish_non_exhaustive()
    }
}

impl<E: HandlerError> Consumer<E> {
    /// Consumes from `consumer` (with an explicit ack policy, the default), taking each message's
    /// id from its `Nats-Msg-Id` header. `context` publishes dead-lettered copies.
    pub fn new(context: Context, consumer: PullConsumer) -> Self {
        Consumer {
            context,
            pull: consumer,
            dead_letter: None,
            concurrency: DEFAULT_CONCURRENCY,
            retry_delay: DEFAULT_RETRY_DELAY,
            id_of: Box::new(|message| {
                let headers = message.headers.as_ref()?;
                Some(headers.get(async_nats::header::NATS_MESSAGE_ID)?.as_str().to_owned())
            }),
            on_failure: Box::new(|_| Disposition::Retry),
            observer: None,
        }
    }

    /// Publishes dead-lettered messages to `subject` (which a stream must capture) before
    /// terminating them. Without it they are terminated and logged only.
    pub fn dead_letter(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter = Some(Subject::from(subject.into()));
        self
    }

    /// Takes each message's id from `id_of` (another header, a field of the payload) instead of
    /// `Nats-Msg-Id`. `None` (or an empty id) sends the message to the dead-letter path.
    pub fn id_from(mut self, id_of: impl Fn(&async_nats::Message) -> Option<String> + Send + Sync + 'static) -> Self {
        self.id_of = Box::new(id_of);
        self
    }

    /// How many messages are handled at once; also the pull batch (default
    /// [`DEFAULT_CONCURRENCY`], at least 1).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    /// The delay of the `-NAK` for a retry (default [`DEFAULT_RETRY_DELAY`]).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// What to do when the handler fails with its own error (the claim was released, so a retry
    /// runs the body again): [`Disposition::Retry`] (the default), [`Disposition::Ack`] (the error
    /// is final, for example recorded with `record_err`) or [`Disposition::DeadLetter`].
    pub fn on_failure(mut self, policy: impl Fn(&E) -> Disposition + Send + Sync + 'static) -> Self {
        self.on_failure = Box::new(policy);
        self
    }

    /// Calls `observer` after each message is settled (for metrics, or a test's ledger).
    pub fn on_settled(mut self, observer: impl Fn(&Settled) + Send + Sync + 'static) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }

    /// Consumes until the consumer fails (deleted, for example).
    ///
    /// # Errors
    ///
    /// When pulling fails for another reason than a missed heartbeat (which is logged).
    pub async fn run<F, Fut, T>(self, handler: F) -> Result<(), async_nats::Error>
    where
        F: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_until(handler, std::future::pending()).await
    }

    /// Consumes until `stop` completes, then finishes the messages in hand. Messages pulled but
    /// not started are redelivered by JetStream after the consumer's `ack_wait`.
    ///
    /// # Errors
    ///
    /// When pulling fails for another reason than a missed heartbeat (which is logged).
    pub async fn run_until<F, Fut, T>(self, handler: F, stop: impl Future<Output = ()>) -> Result<(), async_nats::Error>
    where
        F: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let messages = self.pull.stream().max_messages_per_batch(self.concurrency).messages().await?;
        let failure = Mutex::new(None);
        messages
            .take_until(stop)
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
            .for_each_concurrent(self.concurrency, |message| self.settle(message, &handler))
            .await;
        match failure.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    async fn settle<F, Fut, T>(&self, message: async_nats::jetstream::Message, handler: &F)
    where
        F: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let id = (self.id_of)(&message.message).filter(|id| !id.is_empty());
        let (delivered, source) = match message.info() {
            Ok(info) => (info.delivered, format!("{}.{}", info.stream, info.stream_sequence)),
            Err(_) => (1, String::new()),
        };
        let redelivered = delivered > 1;
        let (message, acker) = message.split();
        let async_nats::Message { subject, payload, headers, .. } = message;
        // What a dead-lettered copy needs after the handler took the message.
        let keep = self.dead_letter.as_ref().map(|_| (payload.clone(), headers.clone()));
        let (disposition, reason) = match &id {
            None => (Disposition::DeadLetter, Some(NO_ID.to_owned())),
            Some(id) => {
                let message = Message { id: id.clone(), subject, payload, headers, delivered };
                disposition(&handler(message).await, &*self.on_failure)
            }
        };
        let settled = match disposition {
            Disposition::Ack => acker.ack().await,
            Disposition::Retry => acker.ack_with(AckKind::Nak(Some(self.retry_delay))).await,
            Disposition::DeadLetter => {
                let reason = reason.as_deref().unwrap_or_default();
                match self.copy_to_dead_letter(keep, id.as_deref(), reason, &source).await {
                    Ok(()) => acker.ack_with(AckKind::Term).await,
                    Err(e) => {
                        tracing::error!(
                            target: "idempotent::consume", message_id = id.as_deref().unwrap_or("<none>"), reason, error = %e,
                            "could not publish to the dead-letter subject; the message is retried after the delay"
                        );
                        let _ = acker.ack_with(AckKind::Nak(Some(self.retry_delay))).await;
                        return;
                    }
                }
            }
        };
        match settled {
            Ok(()) => {
                let settled = Settled { message_id: id, disposition, redelivered, reason };
                log(&settled);
                if let Some(observer) = &self.observer {
                    observer(&settled);
                }
            }
            Err(e) => tracing::warn!(
                target: "idempotent::consume", message_id = id.as_deref().unwrap_or("<none>"), ?disposition, error = %e,
                "settling the message failed; JetStream delivers it again after ack_wait"
            ),
        }
    }

    async fn copy_to_dead_letter(
        &self,
        keep: Option<(Bytes, Option<HeaderMap>)>,
        id: Option<&str>,
        reason: &str,
        source: &str,
    ) -> Result<(), async_nats::Error> {
        let (Some(subject), Some((payload, headers))) = (&self.dead_letter, keep) else { return Ok(()) };
        let mut headers = headers.unwrap_or_default();
        let printable: String = reason.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
        headers.insert(DEAD_LETTER_REASON, printable);
        if let Some(id) = id {
            headers.insert(DEAD_LETTER_MESSAGE_ID, id);
        }
        if !source.is_empty() {
            headers.insert(async_nats::header::NATS_MESSAGE_ID, source);
        }
        self.context.publish_with_headers(subject.clone(), headers, payload).await?.await?;
        Ok(())
    }
}
