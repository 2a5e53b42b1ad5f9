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
//! Executed or replayed → `basic.ack`; retry → `basic.nack` with `requeue` after the retry delay,
//! or, after a failure of the handler, a copy with its attempt count (below); dead-letter →
//! `basic.reject` without `requeue`, which RabbitMQ routes to the queue's dead-letter exchange
//! (declare one, for example with [`declare_with_dead_letter`]; without it RabbitMQ drops the
//! message, and only the log keeps the reason).
//!
//! # Counting attempts
//!
//! RabbitMQ counts deliveries only on quorum queues (`x-delivery-count`), and what it counts has
//! changed between versions (3.x counted every requeue, 4.3 counts `basic.reject` but not
//! `basic.nack`); a classic queue counts nothing. So the consumer carries the count itself, in
//! the header [`ATTEMPT`] (`Idempotent-Attempt`, absent on the first attempt): when the handler
//! failed (its own error that the policy retries, or a panic), the consumer waits the retry
//! delay, publishes a copy of the message (body and properties, the header incremented, the
//! original routing key in [`ROUTING_KEY`]) straight to the queue through the default exchange,
//! waits for RabbitMQ's publisher confirm (the consumer puts its channel in confirm mode), and
//! only then acks the delivery. On the attempt [`max_attempts`](super::Consumer::max_attempts) a
//! failure dead-letters the message instead. Other retries (the key claimed elsewhere, the store
//! down) return a copy the same way with the count left alone: a plain requeue would count
//! towards a quorum queue's `x-delivery-limit` (RabbitMQ 3.x counts every requeue), and an outage
//! longer than that many retry delays dead-lettered messages whose work had never run
//! (`amqp_a_store_outage_on_a_quorum_queue_with_a_delivery_limit_does_not_dead_letter`, found in
//! review). Should the copy not be confirmed, the delivery is requeued as before.
//!
//! What this means: the copy goes to the back of the queue; a crash between the copy's confirm and
//! the ack leaves both, which the idempotency key makes harmless (one runs, the other replays or
//! waits); a worker killed *inside* the handler does not count an attempt (use a quorum queue's
//! `x-delivery-limit` to bound that loop). A dead-lettered message keeps its header, so a tool
//! that moves dead letters back to the queue should remove [`ATTEMPT`] to give them their
//! attempts again.
//!
//! # Why the retry waits before the requeue
//!
//! A requeued message goes back to the head of its queue and is delivered again at once: a plain
//! `nack` of a message whose id is still claimed elsewhere would spin between the consumers at
//! network speed until the claim ends. So the delivery is held, unacknowledged, for the retry
//! delay, and only then returned (as a copy, above). The alternative, a delay queue (publish a
//! copy with a TTL to a queue that dead-letters back into this one, then ack the original), needs
//! a second queue; holding it needs nothing but a concurrency slot (a crash during the wait
//! redelivers it at once, as for any unacked message), and its cost is bounded: a waiting
//! delivery occupies one of the consumer's [`concurrency`](Consumer::concurrency) slots, the
//! others keep working.

pub use lapin;

use std::future::Future;
use std::sync::Mutex;

use bytes::Bytes;
use futures_util::StreamExt as _;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    BasicRejectOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel};

use super::broker::{Broker, Consume, Handle};
use super::{Disposition, HandlerError, NO_ID, Settled, Verdict};

/// The header in which the consumer counts a message's attempts (absent: the first).
pub const ATTEMPT: &str = "Idempotent-Attempt";

/// The header in which a copy returned for a retry keeps the routing key of the original (the
/// copy is routed to the queue by its name).
pub const ROUTING_KEY: &str = "Idempotent-Routing-Key";

/// A RabbitMQ consumer: the one [`Consumer`](super::Consumer) type, with its AMQP half.
pub type Consumer<E> = super::Consumer<Amqp, E>;

/// The AMQP half of a [`Consumer`]: the channel, the queue and how a message's id is read.
pub struct Amqp {
    channel: Channel,
    queue: String,
    id_of: IdOf,
}

impl std::fmt::Debug for Amqp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Amqp").field("queue", &self.queue).finish_non_exhaustive()
    }
}

/// A message handed to the handler: its id, body and properties.
#[derive(Debug)]
pub struct Message {
    id: String,
    data: Bytes,
    properties: BasicProperties,
    redelivered: bool,
    routing_key: String,
    attempt: u32,
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
        self.data.into()
    }

    /// The AMQP properties (headers, content type, ...).
    #[must_use]
    pub fn properties(&self) -> &BasicProperties {
        &self.properties
    }

    /// Whether the broker delivered this message before (to this or another consumer). A copy
    /// returned for a retry (after a failure, or while the key was claimed elsewhere or the store
    /// was down) is a new message to RabbitMQ: see [`attempt`](Self::attempt).
    #[must_use]
    pub fn redelivered(&self) -> bool {
        self.redelivered
    }

    /// The routing key it was published with (for a copy returned for a retry, the
    /// original's, kept in [`ROUTING_KEY`]).
    #[must_use]
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }

    /// Which attempt this is: 1, plus one for every failure of the handler on this message (the
    /// [`ATTEMPT`] header).
    #[must_use]
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

type IdOf = Box<dyn Fn(&Delivery) -> Option<String> + Send + Sync>;

impl Broker for Amqp {
    type Message = Message;
    type Error = lapin::Error;
}

impl<E: HandlerError> Consumer<E> {
    /// A consumer of `queue` on `channel`, taking each message's id from its `message_id` property.
    pub fn new(channel: Channel, queue: impl Into<String>) -> Self {
        let id_of: IdOf =
            Box::new(|delivery| delivery.properties.message_id().as_ref().map(|id| id.as_str().to_owned()));
        super::Consumer::with_broker(Amqp { channel, queue: queue.into(), id_of })
    }

    /// Takes each message's id from `id_of` (a header, a field of the payload) instead of the
    /// `message_id` property. `None` (or an empty id, or a panic of `id_of`, logged) sends the
    /// message to the dead-letter path.
    pub fn id_from(mut self, id_of: impl Fn(&Delivery) -> Option<String> + Send + Sync + 'static) -> Self {
        self.broker.id_of = Box::new(id_of);
        self
    }
}

impl<E: HandlerError> Consume<Amqp, E> for Consumer<E> {
    async fn consume(self, handler: impl Handle<Amqp, E>, stop: impl Future<Output = ()>) -> Result<(), lapin::Error> {
        let channel = &self.broker.channel;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        let prefetch = u16::try_from(self.settings.concurrency).unwrap_or(u16::MAX);
        channel.basic_qos(prefetch, BasicQosOptions::default()).await?;
        let tag = format!("idempotent-{}", uuid::Uuid::new_v4().simple());
        let queue = self.broker.queue.as_str();
        let consumer = channel
            .basic_consume(queue.into(), tag.as_str().into(), BasicConsumeOptions::default(), FieldTable::default())
            .await?;
        let failure = Mutex::new(None);
        consumer
            .take_until(stop)
            .for_each_concurrent(self.settings.concurrency, |delivery| async {
                match delivery {
                    Ok(delivery) => self.settle(delivery, &handler).await,
                    Err(e) => *failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e),
                }
            })
            .await;
        if let Some(e) = failure.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
            return Err(e);
        }
        if channel.status().connected() {
            channel.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()).await?;
        }
        Ok(())
    }
}

impl<E: HandlerError> Consumer<E> {
    async fn settle(&self, delivery: Delivery, handler: &impl Handle<Amqp, E>) {
        let id = super::read_id(&*self.broker.id_of, &delivery);
        let attempt = header_count(&delivery.properties, ATTEMPT).unwrap_or(1).max(1);
        let Delivery { acker, data, properties, redelivered, routing_key, .. } = delivery;
        let data = Bytes::from(data);
        let routing_key = header_text(&properties, ROUTING_KEY).unwrap_or_else(|| routing_key.to_string());
        // What a copy returned for a retry needs, once the handler has taken the message.
        let keep = (data.clone(), properties.clone(), routing_key.clone());
        let verdict = match &id {
            None => Verdict::dead_letter(NO_ID),
            Some(id) => {
                let message = Message { id: id.clone(), data, properties, redelivered, routing_key, attempt };
                // The handler is called inside the future that `decide` catches panics of: a closure
                // that panics before it returns its future is a failed attempt too, not a crash.
                let run = super::run_boxed(handler, message);
                self.decide(id, attempt, self.settings.max_attempts, run).await
            }
        };
        let Verdict { disposition, reason, failed } = verdict;
        let settled = match disposition {
            Disposition::Ack => acker.ack(BasicAckOptions::default()).await,
            Disposition::Retry => {
                // Held, not requeued at once: a requeued message is redelivered immediately. Then
                // a copy, counted only after a failure: a plain requeue would count towards a
                // quorum queue's `x-delivery-limit`, and a store outage or a key claimed
                // elsewhere would then dead-letter a message whose work never ran.
                tokio::time::sleep(self.settings.retry_delay).await;
                let next = if failed { attempt + 1 } else { attempt };
                if self.copy_for_retry(keep, next, id.as_deref()).await {
                    acker.ack(BasicAckOptions::default()).await
                } else {
                    acker.nack(BasicNackOptions { requeue: true, ..BasicNackOptions::default() }).await
                }
            }
            Disposition::DeadLetter => acker.reject(BasicRejectOptions { requeue: false }).await,
        };
        let id_text = id.as_deref().unwrap_or("<none>");
        match settled {
            Ok(true) => self.settled(&Settled { message_id: id, disposition, redelivered, reason, attempt }),
            Ok(false) => tracing::warn!(
                target: "idempotent::consume", message_id = id_text, ?disposition,
                "the channel closed before the delivery was settled; the broker delivers it again"
            ),
            Err(e) => tracing::warn!(
                target: "idempotent::consume", message_id = id_text, ?disposition, error = %e,
                "settling the delivery failed; the broker delivers it again"
            ),
        }
    }

    /// Publishes the copy of a message to retry for its attempt `next`, straight to the queue, and
    /// waits for the broker's confirm. `false` (logged): the copy is not known to be stored, and
    /// the original is requeued instead (without the count).
    async fn copy_for_retry(
        &self,
        (data, properties, routing_key): (Bytes, BasicProperties, String),
        next: u32,
        id: Option<&str>,
    ) -> bool {
        let mut headers = properties.headers().clone().unwrap_or_default();
        headers.insert(ATTEMPT.into(), AMQPValue::LongLongInt(i64::from(next)));
        headers.insert(ROUTING_KEY.into(), AMQPValue::LongString(routing_key.as_str().into()));
        let properties = properties.with_headers(headers);
        let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
        let queue = ShortString::from(self.broker.queue.as_str());
        let published =
            async { self.broker.channel.basic_publish("".into(), queue, options, &data, properties).await?.await };
        let problem = match published.await {
            Ok(lapin::Confirmation::Ack(None)) => return true,
            Ok(lapin::Confirmation::Ack(Some(_))) => "the queue did not take it".to_owned(),
            Ok(other) => format!("the broker did not confirm it ({other:?})"),
            Err(e) => e.to_string(),
        };
        tracing::warn!(
            target: "idempotent::consume", message_id = id.unwrap_or("<none>"), problem,
            "could not return a copy with the attempt count; the message is requeued without it"
        );
        false
    }
}

/// A header's value as a count (any integer type; RabbitMQ and clients differ in which they use).
fn header_count(properties: &BasicProperties, name: &str) -> Option<u32> {
    let value = properties.headers().as_ref()?.inner().get(name)?;
    let count = match value {
        AMQPValue::ShortShortInt(n) => i64::from(*n),
        AMQPValue::ShortShortUInt(n) => i64::from(*n),
        AMQPValue::ShortInt(n) => i64::from(*n),
        AMQPValue::ShortUInt(n) => i64::from(*n),
        AMQPValue::LongInt(n) => i64::from(*n),
        AMQPValue::LongUInt(n) => i64::from(*n),
        AMQPValue::LongLongInt(n) => *n,
        _ => return None,
    };
    u32::try_from(count).ok()
}

/// A header's value as text.
fn header_text(properties: &BasicProperties, name: &str) -> Option<String> {
    match properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(text) => Some(text.to_string()),
        AMQPValue::ShortString(text) => Some(text.as_str().to_owned()),
        _ => None,
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

#[cfg(test)]
mod tests {
    use super::super::broker::Handle;
    use super::super::sizes::{GROWTH_ALLOWED, future_size, large, small};
    use super::{Amqp, Consumer, Delivery, Message};
    use crate::Error;

    /// The size of a delivery's future with `handler`.
    fn delivery_size(handler: &'static impl Handle<Amqp, Error>) -> usize {
        future_size(|(consumer, delivery): (&'static Consumer<Error>, Delivery)| consumer.settle(delivery, handler))
    }

    #[test]
    fn amqp_a_delivery_in_hand_does_not_hold_the_handler_future_inline() {
        // Held inline, a handler's future was copied with the delivery's future each time that
        // moved (into its task, into the panic guard): 38 KB at a time on the PostgreSQL store.
        let (small, large) = (delivery_size(&small::<Message>), delivery_size(&large::<Message>));
        assert!(
            large < small + GROWTH_ALLOWED,
            "a delivery's future is {large} bytes with a 64 KiB handler future, {small} with a small one"
        );
    }
}
