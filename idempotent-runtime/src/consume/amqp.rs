//! An idempotent consumer for RabbitMQ (AMQP 0-9-1, through [`lapin`]). Feature `amqp`.
//!
//! ```no_run
//! use idempotent_runtime::consume::amqp::{self, Consumer, lapin};
//! use idempotent_runtime::{idempotent, Error, MemoryStore};
//!
//! #[idempotent(key = id, store = store, fingerprint = body)]
//! async fn handle(store: &MemoryStore, id: &str, body: &[u8]) -> Result<(), Error> {
//!     // the side effect: runs once per message id, however often the message is delivered
//!     Ok(())
//! }
//!
//! # async fn demo() -> Result<(), lapin::Error> {
//! let store = MemoryStore::new();
//! let connection = lapin::Connection::connect("amqp://127.0.0.1:5672", Default::default()).await?;
//! let channel = connection.create_channel().await?;
//! amqp::declare_with_dead_letter(&channel, "payments").await?;
//! Consumer::new(channel, "payments")
//!     .run(|message| {
//!         let store = &store;
//!         async move { handle(store, message.id(), message.data()).await }
//!     })
//!     .await
//! # }
//! ```
//!
//! # Settlement
//!
//! Executed or replayed → `basic.ack`; retry → `basic.nack` with `requeue` after the retry delay;
//! dead-letter → `basic.reject` without `requeue`, which RabbitMQ routes to the queue's
//! dead-letter exchange (declare one, for example with [`declare_with_dead_letter`]; without it
//! RabbitMQ drops the message, and only the log keeps the reason).
//!
//! # Why the retry waits before the requeue
//!
//! A requeued message goes back to the head of its queue and is delivered again at once: a plain
//! `nack` of a message whose id is still claimed elsewhere would spin between the consumers at
//! network speed until the claim ends. So the delivery is held, unacknowledged, for the retry
//! delay, and only then requeued. The alternative, a delay queue (publish a copy with a TTL to a
//! queue that dead-letters back into this one, then ack the original), needs a second queue and
//! publisher confirms, and copies the message; holding it needs nothing but a concurrency slot,
//! keeps the message itself (a crash during the wait redelivers it at once, as for any unacked
//! message), and its cost is bounded: a waiting delivery occupies one of the consumer's
//! [`concurrency`](Consumer::concurrency) slots, the others keep working.

pub use lapin;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt as _;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};

use super::{
    DEFAULT_CONCURRENCY, DEFAULT_RETRY_DELAY, Disposition, FailurePolicy, HandlerError, NO_ID, Observer, Settled,
    disposition, log,
};

/// A message handed to the handler: its id, body and properties.
#[derive(Debug)]
pub struct Message {
    id: String,
    data: Vec<u8>,
    properties: BasicProperties,
    redelivered: bool,
    routing_key: String,
}

impl Message {
    /// The message id: the idempotency key to run the handler under.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The body.
    #[must_use]
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The body, taken out.
    #[must_use]
    pub fn into_data(self) -> Vec<u8> {
        self.data
    }

    /// The AMQP properties (headers, content type, ...).
    #[must_use]
    pub fn properties(&self) -> &BasicProperties {
        &self.properties
    }

    /// Whether the broker delivered this message before (to this or another consumer).
    #[must_use]
    pub fn redelivered(&self) -> bool {
        self.redelivered
    }

    /// The routing key it was published with.
    #[must_use]
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }
}

type IdOf = Box<dyn Fn(&Delivery) -> Option<String> + Send + Sync>;

/// Consumes one queue, running each message's handler once per message id and settling the
/// delivery by its outcome (see [the module docs](super)).
#[must_use = "a Consumer does nothing until `run`"]
pub struct Consumer<E> {
    channel: Channel,
    queue: String,
    concurrency: usize,
    retry_delay: Duration,
    id_of: IdOf,
    on_failure: FailurePolicy<E>,
    observer: Option<Observer>,
}

impl<E> std::fmt::Debug for Consumer<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("queue", &self.queue)
            .field("concurrency", &self.concurrency)
            .field("retry_delay", &self.retry_delay)
            .finish_non_exhaustive()
    }
}

impl<E: HandlerError> Consumer<E> {
    /// A consumer of `queue` on `channel`, taking each message's id from its `message_id` property.
    pub fn new(channel: Channel, queue: impl Into<String>) -> Self {
        Consumer {
            channel,
            queue: queue.into(),
            concurrency: DEFAULT_CONCURRENCY,
            retry_delay: DEFAULT_RETRY_DELAY,
            id_of: Box::new(|delivery| delivery.properties.message_id().as_ref().map(|id| id.as_str().to_owned())),
            on_failure: Box::new(|_| Disposition::Retry),
            observer: None,
        }
    }

    /// Takes each message's id from `id_of` (a header, a field of the payload) instead of the
    /// `message_id` property. `None` (or an empty id) sends the message to the dead-letter path.
    pub fn id_from(mut self, id_of: impl Fn(&Delivery) -> Option<String> + Send + Sync + 'static) -> Self {
        self.id_of = Box::new(id_of);
        self
    }

    /// How many deliveries are handled at once; also the channel's prefetch (default
    /// [`DEFAULT_CONCURRENCY`], at least 1).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.clamp(1, usize::from(u16::MAX));
        self
    }

    /// How long a delivery to be retried is held before it is requeued (default
    /// [`DEFAULT_RETRY_DELAY`]).
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

    /// Calls `observer` after each delivery is settled (for metrics, or a test's ledger).
    pub fn on_settled(mut self, observer: impl Fn(&Settled) + Send + Sync + 'static) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }

    /// Consumes until the channel closes or the broker cancels the consumer.
    ///
    /// # Errors
    ///
    /// When the consumer cannot be started, or the channel fails.
    pub async fn run<F, Fut, T>(self, handler: F) -> Result<(), lapin::Error>
    where
        F: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_until(handler, std::future::pending()).await
    }

    /// Consumes until `stop` completes (or the channel closes), then cancels the consumer and
    /// finishes the deliveries in hand. Deliveries prefetched but not started stay unacknowledged
    /// and return to the queue when the channel closes.
    ///
    /// # Errors
    ///
    /// When the consumer cannot be started, or the channel fails.
    pub async fn run_until<F, Fut, T>(self, handler: F, stop: impl Future<Output = ()>) -> Result<(), lapin::Error>
    where
        F: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let prefetch = u16::try_from(self.concurrency).unwrap_or(u16::MAX);
        self.channel.basic_qos(prefetch, BasicQosOptions::default()).await?;
        let tag = format!("idempotent-{}", uuid::Uuid::new_v4().simple());
        let consumer = self
            .channel
            .basic_consume(
                self.queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let failure = Mutex::new(None);
        consumer
            .take_until(stop)
            .for_each_concurrent(self.concurrency, |delivery| async {
                match delivery {
                    Ok(delivery) => self.settle(delivery, &handler).await,
                    Err(e) => *failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e),
                }
            })
            .await;
        if let Some(e) = failure.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
            return Err(e);
        }
        if self.channel.status().connected() {
            self.channel.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()).await?;
        }
        Ok(())
    }

    async fn settle<F, Fut, T>(&self, delivery: Delivery, handler: &F)
    where
        F: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let id = (self.id_of)(&delivery).filter(|id| !id.is_empty());
        let Delivery { acker, data, properties, redelivered, routing_key, .. } = delivery;
        let (disposition, reason) = match &id {
            None => (Disposition::DeadLetter, Some(NO_ID.to_owned())),
            Some(id) => {
                let message =
                    Message { id: id.clone(), data, properties, redelivered, routing_key: routing_key.to_string() };
                disposition(&handler(message).await, &*self.on_failure)
            }
        };
        let settled = match disposition {
            Disposition::Ack => acker.ack(BasicAckOptions::default()).await,
            Disposition::Retry => {
                tokio::time::sleep(self.retry_delay).await;
                acker.nack(BasicNackOptions { multiple: false, requeue: true }).await
            }
            Disposition::DeadLetter => acker.reject(BasicRejectOptions { requeue: false }).await,
        };
        match settled {
            Ok(true) => {
                let settled = Settled { message_id: id, disposition, redelivered, reason };
                log(&settled);
                if let Some(observer) = &self.observer {
                    observer(&settled);
                }
            }
            Ok(false) => tracing::warn!(
                target: "idempotent::consume", message_id = id.as_deref().unwrap_or("<none>"), ?disposition,
                "the channel closed before the delivery was settled; the broker delivers it again"
            ),
            Err(e) => tracing::warn!(
                target: "idempotent::consume", message_id = id.as_deref().unwrap_or("<none>"), ?disposition, error = %e,
                "settling the delivery failed; the broker delivers it again"
            ),
        }
    }
}

/// Declares the durable queue `queue` with a dead-letter queue `<queue>.dead-letter` (through the
/// default exchange), where rejected messages go. Returns the dead-letter queue's name.
///
/// # Errors
///
/// When a declaration fails, for example because `queue` exists with other arguments.
pub async fn declare_with_dead_letter(channel: &Channel, queue: &str) -> Result<String, lapin::Error> {
    let dead = format!("{queue}.dead-letter");
    channel.queue_declare(dead.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default()).await?;
    let mut arguments = FieldTable::default();
    arguments.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("".into()));
    arguments.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(dead.as_str().into()));
    channel.queue_declare(queue.into(), QueueDeclareOptions::durable(), arguments).await?;
    Ok(dead)
}
