//! A payment consumer on RabbitMQ: each payment message is charged once per message id, however
//! often RabbitMQ delivers it, with the idempotency records in an SQLite file next to the balances.
//!
//! The program publishes a few payments to a fresh queue (one of them twice, as a producer that
//! retries after a lost confirm does; one reusing an id with another amount; one without an id),
//! consumes them with `consume::amqp::Consumer`, and prints what happened to each.
//!
//! ```text
//! cargo run -p idempotent-examples --bin payment_consumer          # RabbitMQ at AMQP_URL, default
//!                                                                  # amqp://guest:guest@127.0.0.1:5672/%2f
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idempotent_runtime::consume::amqp::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions,
};
use idempotent_runtime::consume::amqp::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idempotent_runtime::consume::amqp::{Consumer, declare_with_dead_letter};
use idempotent_runtime::consume::{Disposition, HandlerError, Settled};
use idempotent_runtime::stores::sql::SqliteStore;
use idempotent_runtime::{Error, idempotent};
use serde::{Deserialize, Serialize};

/// The message body.
#[derive(Debug, Serialize, Deserialize)]
struct Payment {
    user: String,
    amount: i64,
}

/// What a charge returns (and what a redelivered message gets back without charging again).
#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    user: String,
    amount: i64,
    balance_after: i64,
}

#[derive(Debug)]
enum PayError {
    /// The idempotency layer said no: in progress elsewhere, id reused, store down.
    Idempotency(Error),
    /// Not a payment: retrying will not help.
    BadPayload(String),
    /// The balance update failed: a retry may succeed.
    Database(String),
}

impl From<Error> for PayError {
    fn from(e: Error) -> Self {
        PayError::Idempotency(e)
    }
}

impl std::fmt::Display for PayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PayError::Idempotency(e) => e.fmt(f),
            PayError::BadPayload(e) => write!(f, "not a payment: {e}"),
            PayError::Database(e) => write!(f, "database: {e}"),
        }
    }
}

impl HandlerError for PayError {
    fn idempotency_error(&self) -> Option<&Error> {
        match self {
            PayError::Idempotency(e) => Some(e),
            _ => None,
        }
    }
}

/// Charges a payment once per message id; a reused id with another payment is refused.
#[idempotent(key = message_id, store = store, scope = "payments", fingerprint = (&payment.user, payment.amount))]
async fn charge(store: &SqliteStore, message_id: &str, payment: &Payment) -> Result<Receipt, PayError> {
    let balance_after: i64 =
        sqlx::query_scalar("UPDATE users SET balance = balance - ?1 WHERE id = ?2 RETURNING balance")
            .bind(payment.amount)
            .bind(&payment.user)
            .fetch_one(store.pool())
            .await
            .map_err(|e| PayError::Database(e.to_string()))?;
    println!("  charged {} {} for {message_id}; balance now {balance_after}", payment.user, payment.amount);
    Ok(Receipt { user: payment.user.clone(), amount: payment.amount, balance_after })
}

async fn publish(
    channel: &Channel,
    queue: &str,
    id: Option<&str>,
    body: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut properties = BasicProperties::default().with_delivery_mode(2);
    if let Some(id) = id {
        properties = properties.with_message_id(id.into());
    }
    channel
        .basic_publish("".into(), queue.into(), BasicPublishOptions::default(), body.as_bytes(), properties)
        .await?
        .await?;
    Ok(())
}

fn report(settled: &Settled) {
    let id = settled.message_id.as_deref().unwrap_or("(no id)");
    match (settled.disposition, &settled.reason) {
        (Disposition::Ack, _) => println!("  {id}: acked"),
        (disposition, reason) => println!("  {id}: {disposition:?}: {}", reason.as_deref().unwrap_or("")),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let path = std::env::temp_dir().join(format!("idempotent-payment-consumer-{}.db", std::process::id()));
    let store = SqliteStore::open(&path).await?;
    sqlx::query("CREATE TABLE users (id TEXT PRIMARY KEY, balance INTEGER NOT NULL)").execute(store.pool()).await?;
    sqlx::query("INSERT INTO users (id, balance) VALUES ('alice', 1000), ('bob', 1000)").execute(store.pool()).await?;

    let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    let queue = format!("payments-example-{}", std::process::id());
    let dead = declare_with_dead_letter(&channel, &queue).await?;

    println!("publishing to {queue}:");
    let messages: [(Option<&str>, &str); 5] = [
        (Some("pay-1"), r#"{"user":"alice","amount":100}"#),
        (Some("pay-1"), r#"{"user":"alice","amount":100}"#), // the producer retried: same id
        (Some("pay-2"), r#"{"user":"bob","amount":30}"#),
        (Some("pay-1"), r#"{"user":"alice","amount":999}"#), // the id reused for another payment
        (None, r#"{"user":"bob","amount":5}"#),              // no id: cannot be deduplicated
    ];
    for (id, body) in messages {
        println!("  {} {body}", id.unwrap_or("(no id)"));
        publish(&channel, &queue, id, body).await?;
    }

    println!("consuming:");
    let settled = Arc::new(AtomicUsize::new(0));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stop = std::sync::Mutex::new(Some(stop));
    let counter = Arc::clone(&settled);
    Consumer::new(channel.clone(), queue.clone())
        .concurrency(1)
        .on_failure(|e: &PayError| match e {
            PayError::BadPayload(_) => Disposition::DeadLetter,
            _ => Disposition::Retry,
        })
        .on_settled(move |s| {
            report(s);
            if counter.fetch_add(1, Ordering::SeqCst) + 1 == messages.len() {
                stop.lock().unwrap().take().map(|stop| stop.send(()));
            }
        })
        .run_until(
            |message| {
                let store = &store;
                async move {
                    let payment: Payment =
                        serde_json::from_slice(message.data()).map_err(|e| PayError::BadPayload(e.to_string()))?;
                    charge(store, message.id(), &payment).await
                }
            },
            async {
                let _ = stopped.await;
            },
        )
        .await?;

    let balances: Vec<(String, i64)> =
        sqlx::query_as("SELECT id, balance FROM users ORDER BY id").fetch_all(store.pool()).await?;
    println!("balances: {balances:?} (alice charged once for pay-1, bob once for pay-2)");
    assert_eq!(balances, vec![("alice".to_owned(), 900), ("bob".to_owned(), 970)]);
    let dead_count = channel.queue_delete(dead.as_str().into(), QueueDeleteOptions::default()).await?;
    println!("dead-letter queue {dead}: {dead_count} messages (the reused id and the message without one)");
    channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await?;
    let _ = connection.close(200, "done".into()).await;
    store.pool().close().await;
    let _ = std::fs::remove_file(&path);
    Ok(())
}
