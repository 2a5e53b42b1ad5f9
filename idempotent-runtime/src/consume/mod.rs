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
//! | [`Error::InProgress`], [`Error::Store`] | requeue (AMQP) or `nak` (JetStream) after [`retry_delay`](amqp::Consumer::retry_delay) |
//! | your own error (the claim was released) | your [`on_failure`](amqp::Consumer::on_failure) policy: retry after the delay (default), ack, or dead-letter |
//! | [`Error::FingerprintMismatch`], no id or an invalid one, [`Error::Decode`], [`Error::Fingerprint`] | dead-letter, with the reason logged |
//! | [`Error::Unrecordable`], [`Error::LeaseLost`] | ack: the body ran, running it again is what must not happen |
//! | [`Error::InvalidOption`], [`Error::ScopeCollision`] (a configuration mistake) | retry after the delay: the message waits for the fix |
//!
//! Brokers: [`amqp`] (RabbitMQ through `lapin`, feature `amqp`) and [`jetstream`] (NATS JetStream
//! through `async-nats`, feature `jetstream`).
//!
//! Your handler's error type tells the consumer where the idempotency error is by implementing
//! [`HandlerError`] (implemented for [`Error`] itself).

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "jetstream")]
pub mod jetstream;

use std::time::Duration;

use crate::Error;

/// How long a delivery waits before it is requeued (AMQP) or `nak`ed (JetStream) for a retry: 1 s.
pub const DEFAULT_RETRY_DELAY: Duration = Duration::from_secs(1);

/// How many deliveries a consumer handles at once (and its prefetch): 16.
pub const DEFAULT_CONCURRENCY: usize = 16;

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

/// One settled delivery, as reported to an [`on_settled`](amqp::Consumer::on_settled) observer.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settled {
    /// The message id, when the message had a valid one.
    pub message_id: Option<String>,
    /// What was done with the delivery (after the broker accepted the ack, requeue or reject).
    pub disposition: Disposition,
    /// Whether the broker said it had delivered this message before.
    pub redelivered: bool,
    /// Why the message was retried or dead-lettered; `None` when acknowledged after success.
    pub reason: Option<String>,
}

/// The observer type of `on_settled`.
pub(crate) type Observer = std::sync::Arc<dyn Fn(&Settled) + Send + Sync>;

/// The failure policy type of `on_failure`.
pub(crate) type FailurePolicy<E> = Box<dyn Fn(&E) -> Disposition + Send + Sync>;

/// The settlement that the handler's result asks for, with the reason to log.
pub(crate) fn disposition<T, E: HandlerError>(
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
        Error::InProgress { .. } | Error::Store { .. } | Error::InvalidOption { .. } | Error::ScopeCollision { .. } => {
            Disposition::Retry
        }
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
pub(crate) fn log(settled: &Settled) {
    let id = settled.message_id.as_deref().unwrap_or("<none>");
    let reason = settled.reason.as_deref().unwrap_or("");
    match settled.disposition {
        Disposition::Ack if settled.reason.is_none() => {
            tracing::debug!(target: "idempotent::consume", message_id = id, redelivered = settled.redelivered, "acked");
        }
        Disposition::Ack => {
            tracing::warn!(target: "idempotent::consume", message_id = id, reason, "acked after an error, not retried");
        }
        Disposition::Retry => {
            tracing::info!(target: "idempotent::consume", message_id = id, reason, "returned to the queue for a delayed retry");
        }
        Disposition::DeadLetter => {
            tracing::warn!(target: "idempotent::consume", message_id = id, reason, "dead-lettered");
        }
    }
}

/// The reason logged for a message without an id.
pub(crate) const NO_ID: &str = "the message has no id to deduplicate it by";

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

    #[test]
    fn consume_failures_follow_the_policy() {
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
        let (d, reason) = disposition::<(), _>(&Err(Declined), &|_| Disposition::DeadLetter);
        assert_eq!(d, Disposition::DeadLetter);
        assert_eq!(reason.as_deref(), Some("the handler failed: declined"));
    }
}
