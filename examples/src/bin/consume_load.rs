//! What the idempotency step costs a message consumer: messages per second through the same
//! consumer helper with and without it, side by side in each run.
//!
//! For each run, broker (RabbitMQ, NATS JetStream) and mode, a fresh queue (stream) is filled with
//! `--messages` messages with unique ids (not timed), then one consumer with `--concurrency`
//! deliveries in flight drains it, and the time until the last message is acknowledged is taken:
//!
//! - `plain`: the consumer helper with a handler that does not touch a store (a counter);
//! - `redis`, `postgres`: the same handler run through `#[idempotent]` keyed by the message id, on
//!   the Redis store and on the PostgreSQL store (a claim and a record per message: two round trips);
//! - `postgres untested`: the PostgreSQL store on a pool built with `test_before_acquire(false)`,
//!   which does not ping a connection before handing it out (a round trip less per step; the
//!   `postgres` mode's pool keeps sqlx's default);
//! - `postgres tx`: each message in a transaction of its own on that pool (`PostgresStore::begin`,
//!   the handler on the `PostgresTxStore`, then `commit`), as a consumer whose effect is a write
//!   to the same database records it: the claim and the record commit with the transaction, one
//!   commit (one WAL flush) per message instead of two. The handler writes nothing else, so the
//!   whole transaction, `BEGIN` and `COMMIT` included, is charged to the idempotency step;
//! - `redis batching`, `postgres batching`: the `redis` and `postgres untested` modes with the
//!   store behind a `BatchingStore`, which sends the claims (and the completions) of the
//!   deliveries in flight to the store together: one pipeline, one statement.
//!
//! The `BatchingStore` modes also give the mean size of the batches they sent (claims and
//! completions per batch, from the runtime's `idempotent_batch_steps` histogram): the program
//! installs a `metrics` recorder that keeps that histogram and hands every other metric a no-op
//! handle, as the default recorder does.
//!
//! The modes alternate within each run, so the ratios compare measurements taken a few seconds
//! apart. It prints a Markdown table of medians over the runs, with the CPU time per message that
//! each process spent while the consumer drained the queue (from `/proc/PID/stat`): this consumer,
//! the broker (RabbitMQ's `beam.smp`, `nats-server`), `redis-server` and PostgreSQL, and all five
//! together (the other broker's idle share included). On a machine whose cores are busy, that
//! total, not the round trips, is what bounds the rate.
//!
//! ```text
//! cargo run --release -p idempotent-examples --bin consume_load -- --runs 5 --messages 20000 --concurrency 16
//! cargo run --release -p idempotent-examples --bin consume_load -- --brokers amqp --modes plain,redis
//! ```
//!
//! `--batches` sets how many batches each `BatchingStore` has on their way at once (its
//! `in_flight`, 1 by default). `--brokers` and `--modes` run a part of the table (for a profile of one mode, say); a mode's
//! ratio needs `plain` in the same run.
//!
//! Servers come from `AMQP_URL`, `NATS_URL`, `REDIS_URL` and `POSTGRES_URL` (the test suite's
//! defaults). The PostgreSQL table is `idempotent_bench_consume`, dropped and created per run.

#![allow(clippy::cast_precision_loss, reason = "message counts far below 2^52")]

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_examples::measure::{CONSUMER_PROCESSES, consumer_processes_ticks, median};
use idempotent_examples::{count_once, fill};
use idempotent_runtime::consume::amqp::lapin;
use idempotent_runtime::consume::amqp::lapin::options::QueueDeleteOptions;
use idempotent_runtime::consume::jetstream::async_nats::{self, jetstream};
use idempotent_runtime::consume::{Disposition, amqp, jetstream as js_consume};
use idempotent_runtime::stores::batching::BatchingStore;
use idempotent_runtime::stores::sql::{PostgresStore, sqlx};
use idempotent_runtime::{Error, RedisStore, StoreError};

const USAGE: &str = "usage: consume_load [--runs 5] [--messages 20000] [--concurrency 16] [--batches 1]
                    [--brokers amqp,jetstream] [--modes plain,redis,postgres,postgres-untested,postgres-tx,
                     redis-batching,postgres-batching]";

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Broker {
    Amqp,
    JetStream,
}

impl Broker {
    /// The broker `--brokers` names `name`.
    fn named(name: &str) -> Option<Broker> {
        match name {
            "amqp" => Some(Broker::Amqp),
            "jetstream" => Some(Broker::JetStream),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Mode {
    Plain,
    Redis,
    Postgres,
    PostgresUntested,
    PostgresTx,
    RedisBatching,
    PostgresBatching,
}

impl Mode {
    /// The mode `--modes` names `name`.
    fn named(name: &str) -> Option<Mode> {
        Some(match name {
            "plain" => Mode::Plain,
            "redis" => Mode::Redis,
            "postgres" => Mode::Postgres,
            "postgres-untested" => Mode::PostgresUntested,
            "postgres-tx" => Mode::PostgresTx,
            "redis-batching" => Mode::RedisBatching,
            "postgres-batching" => Mode::PostgresBatching,
            _ => return None,
        })
    }
}

/// A mode's handler, as the consumers take it.
type Handler<M> = Box<dyn Fn(M) -> Pin<Box<dyn Future<Output = Result<usize, Error>> + Send>> + Send + Sync>;

/// The settlement observer.
type Observer = Box<dyn Fn(&idempotent_runtime::consume::Settled) + Send + Sync>;

struct Setup {
    amqp: String,
    nats: String,
    /// The Redis store.
    redis: RedisStore,
    /// The PostgreSQL store on a pool that pings each connection before handing it out (sqlx's
    /// default), and on one that does not (`test_before_acquire(false)`).
    postgres: Arc<[PostgresStore; 2]>,
    /// The Redis store, and the PostgreSQL store on the pool without pings, each behind a
    /// `BatchingStore`.
    redis_batching: BatchingStore<RedisStore>,
    postgres_batching: BatchingStore<PostgresStore>,
    messages: usize,
    concurrency: usize,
    /// The batch sizes the `BatchingStore`s report, through the process's recorder.
    batch_sizes: Arc<BatchSizes>,
}

fn env(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut runs, mut messages, mut concurrency, mut batches) = (5usize, 20_000usize, 16usize, 1usize);
    let mut brokers = vec![Broker::Amqp, Broker::JetStream];
    let mut modes = vec![
        Mode::Plain,
        Mode::Redis,
        Mode::Postgres,
        Mode::PostgresUntested,
        Mode::PostgresTx,
        Mode::RedisBatching,
        Mode::PostgresBatching,
    ];
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(USAGE)?;
        let number = || value.parse::<usize>().map_err(|_| USAGE);
        match flag.as_str() {
            "--runs" => runs = number()?,
            "--messages" => messages = number()?,
            "--concurrency" => concurrency = number()?,
            "--batches" => batches = number()?,
            "--brokers" => brokers = value.split(',').map(Broker::named).collect::<Option<_>>().ok_or(USAGE)?,
            "--modes" => modes = value.split(',').map(Mode::named).collect::<Option<_>>().ok_or(USAGE)?,
            _ => return Err(USAGE.into()),
        }
    }
    // A ratio is taken against `plain` of the same run: it runs first whenever it is chosen.
    modes.sort();
    println!("uptime at start: {}", uptime());
    let batch_sizes = Arc::new(BatchSizes::default());
    metrics::set_global_recorder(BatchRecorder(Arc::clone(&batch_sizes))).map_err(|e| e.to_string())?;
    let redis = RedisStore::connect(&env("REDIS_URL", "redis://127.0.0.1:6379"))
        .await?
        .with_prefix(format!("idempotent-consume-load:{}:", std::process::id()))?;
    let (options, postgres_url) = (
        sqlx::postgres::PgPoolOptions::new().max_connections(u32::try_from(concurrency).unwrap_or(16)),
        env("POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test"),
    );
    let pool = options.clone().connect(&postgres_url).await?;
    let untested = options.test_before_acquire(false).connect(&postgres_url).await?;
    let postgres = [
        PostgresStore::with_table(pool.clone(), "idempotent_bench_consume")?,
        PostgresStore::with_table(untested, "idempotent_bench_consume")?,
    ];
    let setup = Setup {
        amqp: env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
        nats: env("NATS_URL", "nats://127.0.0.1:4222"),
        redis_batching: BatchingStore::new(redis.clone()).in_flight(batches),
        postgres_batching: BatchingStore::new(postgres[1].clone()).in_flight(batches),
        redis,
        postgres: Arc::new(postgres),
        messages,
        concurrency,
        batch_sizes,
    };

    let mut rates: BTreeMap<(Broker, Mode), Vec<f64>> = BTreeMap::new();
    let mut ratios: BTreeMap<(Broker, Mode), Vec<f64>> = BTreeMap::new();
    let mut cpu: BTreeMap<(Broker, Mode, usize), Vec<f64>> = BTreeMap::new();
    let mut batch: BTreeMap<(Broker, Mode), Vec<f64>> = BTreeMap::new();
    for run in 1..=runs {
        sqlx::query("DROP TABLE IF EXISTS idempotent_bench_consume").execute(&pool).await?;
        setup.postgres[0].create_table().await?;
        for &broker in &brokers {
            let mut plain = f64::NAN;
            for &mode in &modes {
                let Measured { rate, cpu: used, batch: steps } = setup.measure(broker, mode, run).await?;
                eprintln!(
                    "run {run}: {broker:?} {mode:?}: {rate:.0} messages/s, CPU µs per message {used:.1?}, steps per \
                     batch {steps:.1?}"
                );
                if let Some(steps) = steps {
                    batch.entry((broker, mode)).or_default().push(steps);
                }
                for (i, used) in used.iter().enumerate() {
                    cpu.entry((broker, mode, i)).or_default().push(*used);
                }
                if mode == Mode::Plain {
                    plain = rate;
                } else {
                    ratios.entry((broker, mode)).or_default().push(rate / plain);
                }
                rates.entry((broker, mode)).or_default().push(rate);
            }
        }
    }
    sqlx::query("DROP TABLE IF EXISTS idempotent_bench_consume").execute(&pool).await?;

    println!(
        "\n{messages} messages per measurement, {concurrency} in flight, {batches} batch(es) on their way per \
         `BatchingStore`, median of {runs} runs (ratio: measured against `plain` within each run, then the median)\n"
    );
    println!(
        "| broker | consumer | messages/s | vs plain | CPU µs per message: consumer | broker | Redis | PostgreSQL | all five \
         | steps per batch (mean) |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for ((broker, mode), values) in &rates {
        let ratio = ratios.get(&(*broker, *mode)).map_or("1".to_owned(), |r| format!("{:.2}", median(r.clone())));
        let used = |i: usize| median(cpu.get(&(*broker, *mode, i)).cloned().unwrap_or_default());
        let steps = batch.get(&(*broker, *mode)).map_or("—".to_owned(), |b| format!("{:.1}", median(b.clone())));
        let own_broker = if *broker == Broker::Amqp { used(1) } else { used(2) };
        let all: f64 = (0..CONSUMER_PROCESSES.len()).map(used).sum();
        let cpu = format!("{:.1} | {own_broker:.1} | {:.1} | {:.1} | {all:.1}", used(0), used(3), used(4));
        let broker = match broker {
            Broker::Amqp => "RabbitMQ",
            Broker::JetStream => "JetStream",
        };
        let mode = match mode {
            Mode::Plain => "plain (no idempotency step)",
            Mode::Redis => "idempotent, Redis store",
            Mode::Postgres => "idempotent, PostgreSQL store",
            Mode::PostgresUntested => "idempotent, PostgreSQL store, pool `test_before_acquire(false)`",
            Mode::PostgresTx => "idempotent, PostgreSQL, one transaction per message (that pool)",
            Mode::RedisBatching => "idempotent, Redis store behind `BatchingStore`",
            Mode::PostgresBatching => "idempotent, PostgreSQL store (that pool) behind `BatchingStore`",
        };
        println!("| {broker} | {mode} | {:.0} | {ratio} | {cpu} | {steps} |", median(values.clone()));
    }
    println!("\nuptime at end: {}", uptime());
    Ok(())
}

/// What `uptime` prints (the load average: the machine's other work during the measurement).
fn uptime() -> String {
    match std::process::Command::new("uptime").output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        _ => std::fs::read_to_string("/proc/loadavg")
            .map_or_else(|e| format!("unknown ({e})"), |l| format!("load average {}", l.trim())),
    }
}

impl Setup {
    /// Fills a fresh queue, drains it in the given mode, returns messages per second.
    async fn measure(&self, broker: Broker, mode: Mode, run: usize) -> Result<Measured, Box<dyn std::error::Error>> {
        let name = format!("idempotent-consume-load-{}-{run}-{mode:?}", std::process::id());
        match broker {
            Broker::Amqp => self.amqp(&name, mode).await,
            Broker::JetStream => self.jetstream(&name.replace('-', "_"), mode).await,
        }
    }

    fn ids(&self, name: &str) -> impl Iterator<Item = String> {
        (0..self.messages).map(move |i| format!("{name}-{i}"))
    }

    async fn amqp(&self, queue: &str, mode: Mode) -> Result<Measured, Box<dyn std::error::Error>> {
        let connection = lapin::Connection::connect(&self.amqp, lapin::ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        fill::amqp(&channel, queue, self.ids(queue)).await?;
        let consumer = amqp::Consumer::new(connection.create_channel().await?, queue).concurrency(self.concurrency);
        let rate =
            self.drain(mode, |handler, observer, stop| consumer.on_settled(observer).run_until(handler, stop)).await?;
        channel.queue_delete(queue.into(), QueueDeleteOptions::default()).await?;
        let _ = connection.close(200, "done".into()).await;
        Ok(rate)
    }

    async fn jetstream(&self, name: &str, mode: Mode) -> Result<Measured, Box<dyn std::error::Error>> {
        let js = jetstream::new(async_nats::connect(&self.nats).await?);
        let stream = fill::jetstream(&js, name, self.ids(name)).await.map_err(|e| e.to_string())?;
        let config = jetstream::consumer::pull::Config { durable_name: Some("bench".into()), ..Default::default() };
        let pull = stream.create_consumer(config).await?;
        let consumer = js_consume::Consumer::new(js.clone(), pull).concurrency(self.concurrency);
        let rate =
            self.drain(mode, |handler, observer, stop| consumer.on_settled(observer).run_until(handler, stop)).await?;
        js.delete_stream(name).await?;
        Ok(rate)
    }

    /// Runs `consume` (a consumer's `on_settled(..).run_until(..)`) with the mode's handler until
    /// every message is acked; returns messages per second and the CPU each process spent.
    async fn drain<M, C, Fut, E>(&self, mode: Mode, consume: C) -> Result<Measured, Box<dyn std::error::Error>>
    where
        M: IdOf,
        C: FnOnce(Handler<M>, Observer, Pin<Box<dyn Future<Output = ()> + Send>>) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: std::fmt::Display,
    {
        let handled = Arc::new(AtomicUsize::new(0));
        let acked = Arc::new(AtomicUsize::new(0));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stop = Mutex::new(Some(stop));
        let total = self.messages;
        let observer: Observer = {
            let acked = Arc::clone(&acked);
            Box::new(move |s: &idempotent_runtime::consume::Settled| {
                assert_eq!(s.disposition, Disposition::Ack, "{s:?}");
                if acked.fetch_add(1, Ordering::SeqCst) + 1 == total {
                    stop.lock().unwrap().take().map(|stop| stop.send(()));
                }
            })
        };
        let handler: Handler<M> = {
            let (handled, redis, postgres) = (Arc::clone(&handled), self.redis.clone(), Arc::clone(&self.postgres));
            let (redis_batching, postgres_batching) = (self.redis_batching.clone(), self.postgres_batching.clone());
            Box::new(move |message: M| {
                let (handled, id) = (Arc::clone(&handled), message.id_of());
                match mode {
                    Mode::Plain => Box::pin(async move { Ok(handled.fetch_add(1, Ordering::Relaxed)) }),
                    Mode::Redis => {
                        let store = redis.clone();
                        Box::pin(async move { count_once(&store, &id, &handled).await })
                    }
                    Mode::Postgres | Mode::PostgresUntested => {
                        let store = Arc::clone(&postgres);
                        let which = usize::from(mode == Mode::PostgresUntested);
                        Box::pin(async move { count_once(&store[which], &id, &handled).await })
                    }
                    Mode::RedisBatching => {
                        let store = redis_batching.clone();
                        Box::pin(async move { count_once(&store, &id, &handled).await })
                    }
                    Mode::PostgresBatching => {
                        let store = postgres_batching.clone();
                        Box::pin(async move { count_once(&store, &id, &handled).await })
                    }
                    Mode::PostgresTx => {
                        let store = Arc::clone(&postgres);
                        Box::pin(async move {
                            let failed = |operation, e: sqlx::Error| Error::Store {
                                key: id.clone(),
                                operation,
                                source: StoreError::backend("postgres", e),
                            };
                            let tx = store[1].begin().await.map_err(|e| failed("begin", e))?;
                            let handled = count_once(&tx, &id, &handled).await?;
                            tx.commit().await.map_err(|e| failed("commit", e))?;
                            Ok(handled)
                        })
                    }
                }
            })
        };
        let (started, cpu_before) = (Instant::now(), consumer_processes_ticks());
        let stopped = Box::pin(async move {
            let _ = stopped.await;
        });
        tokio::time::timeout(Duration::from_secs(300), consume(handler, observer, stopped))
            .await?
            .map_err(|e| e.to_string())?;
        let elapsed = started.elapsed();
        let cpu_after = consumer_processes_ticks();
        assert_eq!(handled.load(Ordering::SeqCst), total, "every message handled once");
        let per_message = |i: usize| (cpu_after[i] - cpu_before[i]) * 10_000.0 / total as f64;
        let batch = self.batch_sizes.take();
        Ok(Measured { rate: total as f64 / elapsed.as_secs_f64(), cpu: std::array::from_fn(per_message), batch })
    }
}

/// What one drain measured: messages per second, and the CPU µs per message of each process of
/// [`CONSUMER_PROCESSES`].
struct Measured {
    rate: f64,
    cpu: [f64; CONSUMER_PROCESSES.len()],
    /// The mean number of steps per batch a `BatchingStore` sent, in its modes.
    batch: Option<f64>,
}

/// The samples of `idempotent_batch_steps` recorded since the last [`BatchSizes::take`].
#[derive(Default)]
struct BatchSizes(Mutex<Vec<f64>>);

impl BatchSizes {
    /// The mean of the samples since the last call, if any, and forgets them.
    fn take(&self) -> Option<f64> {
        let samples = std::mem::take(&mut *self.0.lock().unwrap());
        (!samples.is_empty()).then(|| samples.iter().sum::<f64>() / samples.len() as f64)
    }
}

impl metrics::HistogramFn for BatchSizes {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().push(value);
    }
}

/// A recorder that keeps `idempotent_batch_steps` in a [`BatchSizes`] and gives every other
/// metric a no-op handle.
struct BatchRecorder(Arc<BatchSizes>);

impl metrics::Recorder for BatchRecorder {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}

    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }

    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }

    fn register_histogram(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        if key.name() == "idempotent_batch_steps" {
            metrics::Histogram::from_arc(Arc::clone(&self.0))
        } else {
            metrics::Histogram::noop()
        }
    }
}

/// The id of a consumer's message type.
trait IdOf {
    fn id_of(&self) -> String;
}

impl IdOf for amqp::Message {
    fn id_of(&self) -> String {
        self.id().to_owned()
    }
}

impl IdOf for js_consume::Message {
    fn id_of(&self) -> String {
        self.id().to_owned()
    }
}
