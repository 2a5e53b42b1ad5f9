//! A consumer process for the broker tests (`tests/tests/amqp.rs`, `tests/tests/jetstream.rs`):
//! it consumes one queue (or JetStream consumer) with the idempotent consumer helper, one message
//! at a time, and each message's side effect is one row in a PostgreSQL ledger table. It SIGKILLs
//! itself at the scheduled points: after the side effect of a scheduled message id ran and its
//! record was written, before the ack. The handler of a scheduled panic id panics inside the body,
//! before the side effect, the first time any worker runs it (the table `<ledger>_panics` notes
//! it); the handler of a poison message (a body starting with `poison`) fails every time.
//!
//! ```text
//! consumer_worker amqp <amqp-url> <queue> <store> <ledger> <kill-ids> <panic-ids>
//! consumer_worker jetstream <nats-url> <stream>|<consumer>|<dead-letter-subject> <store> <ledger> <kill-ids> <panic-ids>
//!   <store>:     [batching-]postgres:<url>|<table> | [batching-]redis:<url>|<prefix>
//!   <ledger>:    <postgres-url>|<table>  (columns msg_id text, pid int; and <table>_panics (msg_id))
//!   <kill-ids>:  comma-separated message ids, or `none`
//!   <panic-ids>: comma-separated message ids, or `none`
//! ```
//!
//! It prints `SETTLED <ack|retry|dead> <id or -> <redelivered 0|1> <panic|failed|->` after each
//! settlement (the last word: the handler panicked, failed with its own error, or neither),
//! `KILLING <id>` before it kills itself, and `FINISHED` when its standard input closes (the
//! signal to stop) and the messages in hand are settled.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotent_runtime::consume::{Disposition, HandlerError, Settled};
use idempotent_runtime::stores::sql::sqlx::{self, PgPool};
use idempotent_runtime::{Error, Store, idempotent};

fn usage() -> ! {
    eprintln!(
        "usage: consumer_worker <amqp|jetstream> <broker-url> <source> <store> <ledger> <kill-ids|none> <panic-ids|none>"
    );
    std::process::exit(2);
}

/// The worker's error: the idempotency error, the ledger write failing, or a poison message.
#[derive(Debug)]
enum WorkerError {
    Idempotency(Error),
    Ledger(String),
    Poison,
}

impl From<Error> for WorkerError {
    fn from(e: Error) -> Self {
        WorkerError::Idempotency(e)
    }
}

impl std::fmt::Display for WorkerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerError::Idempotency(e) => e.fmt(f),
            WorkerError::Ledger(e) => write!(f, "ledger write failed: {e}"),
            WorkerError::Poison => f.write_str("a poison message: this handler fails on it every time"),
        }
    }
}

impl HandlerError for WorkerError {
    fn idempotency_error(&self) -> Option<&Error> {
        match self {
            WorkerError::Idempotency(e) => Some(e),
            WorkerError::Ledger(_) | WorkerError::Poison => None,
        }
    }
}

struct Ledger {
    pool: PgPool,
    insert: String,
    /// Notes a panic id; affects one row the first time only.
    note_panic: String,
    panic_ids: HashSet<String>,
}

impl Ledger {
    /// Whether this run of `id` is the first of a scheduled panic id (over the whole fleet).
    async fn first_panic(&self, id: &str) -> Result<bool, WorkerError> {
        if !self.panic_ids.contains(id) {
            return Ok(false);
        }
        let noted = sqlx::query(sqlx::AssertSqlSafe(self.note_panic.clone()))
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(|e| WorkerError::Ledger(e.to_string()))?;
        Ok(noted.rows_affected() == 1)
    }
}

/// The handler: the side effect (a ledger row) runs once per message id.
#[idempotent(key = id, store = store, scope = "consumer-test", fingerprint = payload, lease = "5s")]
async fn apply<S: Store>(
    store: &S,
    ledger: &Ledger,
    id: &str,
    payload: &[u8],
    ran: &AtomicBool,
) -> Result<String, WorkerError> {
    if payload.starts_with(b"poison") {
        return Err(WorkerError::Poison);
    }
    let scheduled_panic = ledger.first_panic(id).await?;
    assert!(!scheduled_panic, "a scheduled panic in the handler of {id}, before its side effect");
    ran.store(true, Ordering::SeqCst);
    sqlx::query(sqlx::AssertSqlSafe(ledger.insert.clone()))
        .bind(id)
        .bind(i32::try_from(std::process::id()).unwrap_or(-1))
        .execute(&ledger.pool)
        .await
        .map_err(|e| WorkerError::Ledger(e.to_string()))?;
    Ok(format!("applied {id}"))
}

struct Worker {
    ledger: Ledger,
    kill_ids: HashSet<String>,
}

impl Worker {
    /// Runs `apply` for one message, and kills the process if this id is scheduled and its body ran.
    async fn handle<S: Store>(&self, store: &S, id: &str, payload: &[u8]) -> Result<String, WorkerError> {
        let ran = AtomicBool::new(false);
        let result = apply(store, &self.ledger, id, payload, &ran).await;
        if result.is_ok() && ran.load(Ordering::SeqCst) && self.kill_ids.contains(id) {
            println!("KILLING {id}");
            let pid = std::process::id().to_string();
            let _ = std::process::Command::new("kill").args(["-KILL", &pid]).status();
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        result
    }
}

fn print_settled(settled: &Settled) {
    let disposition = match settled.disposition {
        Disposition::Ack => "ack",
        Disposition::Retry => "retry",
        Disposition::DeadLetter => "dead",
    };
    let id = settled.message_id.as_deref().unwrap_or("-");
    let reason = settled.reason.as_deref().unwrap_or_default();
    let cause = if reason.starts_with("the handler panicked") {
        "panic"
    } else if reason.starts_with("the handler failed") {
        "failed"
    } else {
        "-"
    };
    println!("SETTLED {disposition} {id} {} {cause}", u8::from(settled.redelivered));
}

/// Completes when standard input closes.
fn stdin_closed() -> impl std::future::Future<Output = ()> {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        let _ = tx.send(());
    });
    async move {
        let _ = rx.await;
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [broker, url, source, store, ledger, kill_ids, panic_ids] = args.as_slice() else { usage() };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a Tokio runtime");
    runtime.block_on(async {
        let (ledger_url, ledger_table) = ledger.rsplit_once('|').unwrap_or_else(|| usage());
        let pool = PgPool::connect(ledger_url).await.expect("connect to the ledger");
        let insert = format!("INSERT INTO {ledger_table} (msg_id, pid) VALUES ($1, $2)");
        let note_panic = format!("INSERT INTO {ledger_table}_panics (msg_id) VALUES ($1) ON CONFLICT DO NOTHING");
        let ids = |list: &str| -> HashSet<String> {
            if list == "none" { HashSet::new() } else { list.split(',').map(str::to_owned).collect() }
        };
        let ledger = Ledger { pool, insert, note_panic, panic_ids: ids(panic_ids) };
        let worker = Worker { ledger, kill_ids: ids(kill_ids) };
        let (kind, rest) = store.split_once(':').unwrap_or_else(|| usage());
        // `batching-<kind>`: the store behind a `BatchingStore`.
        let (batching, kind) = kind.strip_prefix("batching-").map_or((false, kind), |kind| (true, kind));
        match kind {
            "postgres" => {
                let (url_, table) = rest.rsplit_once('|').unwrap_or_else(|| usage());
                let pool = PgPool::connect(url_).await.expect("connect to the store");
                let store = idempotent_runtime::stores::sql::PostgresStore::with_table(pool, table).expect("table");
                worker.consume_on(broker, url, source, store, batching).await;
            }
            "redis" => {
                let (url_, prefix) = rest.rsplit_once('|').unwrap_or_else(|| usage());
                let store = idempotent_runtime::RedisStore::connect(url_).await.expect("connect").with_prefix(prefix);
                worker.consume_on(broker, url, source, store.expect("prefix"), batching).await;
            }
            _ => usage(),
        }
    });
    println!("FINISHED");
}

impl Worker {
    /// Consumes with `store`, behind a `BatchingStore` if `batching`.
    async fn consume_on<S: Store + 'static>(&self, broker: &str, url: &str, source: &str, store: S, batching: bool) {
        if batching {
            let store = idempotent_runtime::stores::batching::BatchingStore::new(store);
            self.consume(broker, url, source, &store).await;
        } else {
            self.consume(broker, url, source, &store).await;
        }
    }

    async fn consume<S: Store>(&self, broker: &str, url: &str, source: &str, store: &S) {
        match broker {
            "amqp" => self.amqp(url, source, store).await,
            "jetstream" => self.jetstream(url, source, store).await,
            _ => usage(),
        }
    }

    async fn amqp<S: Store>(&self, url: &str, queue: &str, store: &S) {
        use idempotent_runtime::consume::amqp::{Consumer, lapin};
        let connection =
            lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await.expect("connect");
        let channel = connection.create_channel().await.expect("a channel");
        Consumer::new(channel, queue)
            .concurrency(1)
            .retry_delay(Duration::from_millis(200))
            .on_settled(print_settled)
            .run_until(|message| async move { self.handle(store, message.id(), message.data()).await }, stdin_closed())
            .await
            .expect("consume");
        // Every delivery in hand is settled. (lapin closes the consumer's channel when the Consumer
        // drops it, so closing the connection may report that channel as closing already.)
        let _ = connection.close(200, "done".into()).await;
    }

    async fn jetstream<S: Store>(&self, url: &str, source: &str, store: &S) {
        use idempotent_runtime::consume::jetstream::{Consumer, async_nats};
        let mut parts = source.split('|');
        let (Some(stream), Some(consumer), Some(dead_letter)) = (parts.next(), parts.next(), parts.next()) else {
            usage()
        };
        let client = async_nats::connect(url).await.expect("connect");
        let js = async_nats::jetstream::new(client.clone());
        let stream = js.get_stream(stream).await.expect("the stream");
        let pull = stream.get_consumer(consumer).await.expect("the consumer");
        Consumer::new(js, pull)
            .dead_letter(dead_letter)
            .concurrency(1)
            .retry_delay(Duration::from_millis(200))
            .on_settled(print_settled)
            .run_until(
                |message| async move { self.handle(store, message.id(), message.payload()).await },
                stdin_closed(),
            )
            .await
            .expect("consume");
        client.flush().await.expect("flush the acks");
    }
}
