//! How fast could a consumer go that claims and records a whole window of deliveries at once?
//! An upper bound for a design not yet in the library, measured beside the library's consumer.
//!
//! The library's consumer runs each delivery through its own call: a claim and a record per
//! message, two round trips to the store. Issue 23 asks whether claiming the deliveries of one
//! window together (one command or statement for the window's claims, one for its records, one
//! acknowledgement) is where the consumers' gain is. This program measures that shape without the
//! rest of the design: it is a ceiling, not an implementation. A window's loop here does no lease
//! renewal, no fingerprint, no release after a failure, no retry or dead-letter path; its handler
//! (a counter) never fails; every message id is new, so every claim succeeds.
//!
//! For each run, broker (RabbitMQ, NATS JetStream) and mode a fresh queue (stream) is filled with
//! `--messages` messages with unique ids (not timed), then drained; the time until the last
//! acknowledgement is taken:
//!
//! - `lib-plain`, `lib-redis`, `lib-postgres`: the library's consumer (`amqp::Consumer`,
//!   `jetstream::Consumer`) with `--window` deliveries in flight, the handler a counter, run
//!   through `#[idempotent]` on the Redis store or the PostgreSQL store (pool
//!   `test_before_acquire(false)`) for the last two: what `consume_load` measures, except that the
//!   handler's future is not boxed here (one `async fn` serves the three modes, as a user's
//!   closure returns its future): it is as large as the largest mode's, the PostgreSQL store's
//!   call (38 KB);
//! - `window-plain`: a loop over the broker's own consumer (RabbitMQ: `lapin`, prefetch twice the
//!   window; JetStream: a pull consumer with `AckPolicy::All`, batches of twice the window) that
//!   takes the deliveries at hand, up to `--window`, runs the counter on each and acknowledges the
//!   window with one ack (`basic.ack` with `multiple`; JetStream's `+ACK` of the last, which
//!   `AckPolicy::All` extends to those before it);
//! - `window-redis`: the same loop, with the window's keys claimed by one Lua script (`SET NX PX GET`
//!   per key) and recorded by another (a fenced `SET PX` per key), on the same Redis server;
//! - `window-postgres`: the same loop, with one `INSERT .. SELECT unnest(..) .. ON CONFLICT DO
//!   NOTHING RETURNING` for the window's claims and one `UPDATE .. FROM unnest(..)` fenced by the
//!   window's token for its records, each its own transaction (two commits per window).
//!
//! The modes alternate within each run; each ratio is taken within its run against the plain
//! mode of the same broker and family (`lib-*` against `lib-plain`, `window-*` against
//! `window-plain`).
//!
//! ```text
//! cargo run --release -p idempotent-examples --bin window_ceiling -- --runs 5 --messages 20000 --window 16
//! cargo run --release -p idempotent-examples --bin window_ceiling -- --brokers jetstream --window 64
//! cargo run --release -p idempotent-examples --bin window_ceiling -- --modes lib-plain,lib-postgres --runs 1
//! ```

#![allow(clippy::cast_precision_loss, reason = "message counts far below 2^52")]

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::{FutureExt as _, StreamExt as _};
use idempotent_examples::measure::{CONSUMER_PROCESSES, consumer_processes_ticks, median};
use idempotent_examples::{count_once, fill};
use idempotent_runtime::consume::amqp::lapin;
use idempotent_runtime::consume::amqp::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeleteOptions,
};
use idempotent_runtime::consume::amqp::lapin::types::FieldTable;
use idempotent_runtime::consume::jetstream::async_nats::{self, jetstream};
use idempotent_runtime::consume::{Disposition, Settled, amqp, jetstream as js_consume};
use idempotent_runtime::stores::redis::redis;
use idempotent_runtime::stores::sql::{PostgresStore, sqlx};
use idempotent_runtime::{Error, RedisStore};

const USAGE: &str = "usage: window_ceiling [--runs 5] [--messages 20000] [--window 16] [--brokers amqp,jetstream]
                      [--modes lib-plain,lib-redis,lib-postgres,window-plain,window-redis,window-postgres]";

/// Claims each key of the window unless it exists: `false` for a key claimed now, else its value.
const CLAIM: &str = r"
local found = {}
for i, key in ipairs(KEYS) do
  found[i] = redis.call('SET', key, ARGV[1], 'NX', 'PX', ARGV[2], 'GET') or false
end
return found";

/// Records each key of the window whose value is still this window's claim; returns how many.
const RECORD: &str = r"
local recorded = 0
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('SET', key, ARGV[i + 2], 'PX', ARGV[2])
    recorded = recorded + 1
  end
end
return recorded";

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Broker {
    Amqp,
    JetStream,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Mode {
    LibPlain,
    LibRedis,
    LibPostgres,
    WindowPlain,
    WindowRedis,
    WindowPostgres,
}

const MODES: [Mode; 6] =
    [Mode::LibPlain, Mode::LibRedis, Mode::LibPostgres, Mode::WindowPlain, Mode::WindowRedis, Mode::WindowPostgres];

impl Mode {
    /// The mode `--modes` names `name`.
    fn named(name: &str) -> Option<Mode> {
        let names = ["lib-plain", "lib-redis", "lib-postgres", "window-plain", "window-redis", "window-postgres"];
        names.iter().position(|n| *n == name).map(|i| MODES[i])
    }
}

struct Setup {
    amqp: String,
    nats: String,
    redis_store: RedisStore,
    redis: redis::aio::MultiplexedConnection,
    /// The window's claim and record scripts ([`CLAIM`], [`RECORD`]), hashed once.
    claim: redis::Script,
    record: redis::Script,
    postgres_store: PostgresStore,
    pool: sqlx::PgPool,
    messages: usize,
    window: usize,
}

fn env(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Failed> {
    let (mut runs, mut messages, mut window) = (5usize, 20_000usize, 16usize);
    let mut brokers = vec![Broker::Amqp, Broker::JetStream];
    let mut modes = MODES.to_vec();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(USAGE)?;
        let number = || value.parse::<usize>().map_err(|_| USAGE);
        match flag.as_str() {
            "--runs" => runs = number()?,
            "--messages" => messages = number()?,
            "--window" => window = number()?.clamp(1, 1000),
            "--brokers" => {
                let named = |name: &str| match name {
                    "amqp" => Some(Broker::Amqp),
                    "jetstream" => Some(Broker::JetStream),
                    _ => None,
                };
                brokers = value.split(',').map(named).collect::<Option<_>>().ok_or(USAGE)?;
            }
            "--modes" => modes = value.split(',').map(Mode::named).collect::<Option<_>>().ok_or(USAGE)?,
            _ => return Err(USAGE.into()),
        }
    }
    // A ratio is taken against its family's plain mode of the same run: it runs first if chosen.
    modes.sort();
    println!("load average at start: {}", loadavg());
    let redis_url = env("REDIS_URL", "redis://127.0.0.1:6379");
    let prefix = format!("idempotent-window-ceiling:{}:", std::process::id());
    let redis_store = RedisStore::connect(&redis_url).await?.with_prefix(prefix)?;
    let redis = redis::Client::open(redis_url)?.get_multiplexed_async_connection().await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(window).unwrap_or(16))
        .test_before_acquire(false)
        .connect(&env("POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test"))
        .await?;
    let postgres_store = PostgresStore::with_table(pool.clone(), "idempotent_window_ceiling_store")?;
    let setup = Setup {
        amqp: env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
        nats: env("NATS_URL", "nats://127.0.0.1:4222"),
        redis_store,
        redis,
        claim: redis::Script::new(CLAIM),
        record: redis::Script::new(RECORD),
        postgres_store,
        pool,
        messages,
        window,
    };

    let mut rates: BTreeMap<(Broker, Mode), Vec<f64>> = BTreeMap::new();
    let mut ratios: BTreeMap<(Broker, Mode), Vec<f64>> = BTreeMap::new();
    let mut cpu: BTreeMap<(Broker, Mode, usize), Vec<f64>> = BTreeMap::new();
    for run in 1..=runs {
        setup.reset_tables().await?;
        for &broker in &brokers {
            let mut plain = [f64::NAN; 2];
            for &mode in &modes {
                let (rate, used) = setup.measure(broker, mode, run).await?;
                eprintln!("run {run}: {broker:?} {mode:?}: {rate:.0} messages/s, CPU µs per message {used:.1?}");
                let family = usize::from(mode >= Mode::WindowPlain);
                if matches!(mode, Mode::LibPlain | Mode::WindowPlain) {
                    plain[family] = rate;
                }
                ratios.entry((broker, mode)).or_default().push(rate / plain[family]);
                rates.entry((broker, mode)).or_default().push(rate);
                for (i, used) in used.iter().enumerate() {
                    cpu.entry((broker, mode, i)).or_default().push(*used);
                }
            }
        }
    }
    sqlx::query("DROP TABLE IF EXISTS idempotent_window_ceiling").execute(&setup.pool).await?;
    sqlx::query("DROP TABLE IF EXISTS idempotent_window_ceiling_store").execute(&setup.pool).await?;

    println!("\n{messages} messages per measurement, window {window}, medians of {runs} runs\n");
    println!(
        "| broker | mode | messages/s | × its plain (per run) | CPU µs per message: this program, the broker, Redis, PostgreSQL; all four |"
    );
    println!("|---|---|---:|---|---|");
    for ((broker, mode), values) in &rates {
        let key = (*broker, *mode);
        let per_run: Vec<String> = ratios[&key].iter().map(|r| format!("{r:.2}")).collect();
        let used = |i: usize| median(cpu[&(*broker, *mode, i)].clone());
        let own = if *broker == Broker::Amqp { used(1) } else { used(2) };
        let all = used(0) + own + used(3) + used(4);
        println!(
            "| {broker:?} | {mode:?} | {:.0} | **{:.2}** ({}) | {:.1}, {own:.1}, {:.1}, {:.1}; {all:.1} |",
            median(values.clone()),
            median(ratios[&key].clone()),
            per_run.join(", "),
            used(0),
            used(3),
            used(4),
        );
    }
    println!("\nload average at end: {}", loadavg());
    Ok(())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(|e| format!("unknown ({e})"), |l| l.trim().to_owned())
}

impl Setup {
    async fn reset_tables(&self) -> Result<(), Failed> {
        sqlx::query("DROP TABLE IF EXISTS idempotent_window_ceiling").execute(&self.pool).await?;
        sqlx::query(
            "CREATE TABLE idempotent_window_ceiling (key TEXT PRIMARY KEY, token TEXT NOT NULL, \
             outcome TEXT, expires_at TIMESTAMPTZ NOT NULL)",
        )
        .execute(&self.pool)
        .await?;
        sqlx::query("DROP TABLE IF EXISTS idempotent_window_ceiling_store").execute(&self.pool).await?;
        self.postgres_store.create_table().await?;
        Ok(())
    }

    /// Fills a fresh queue (stream) of `broker` and drains it in `mode`: messages per second, and
    /// CPU µs per message of each of [`CONSUMER_PROCESSES`].
    async fn measure(&self, broker: Broker, mode: Mode, run: usize) -> Result<Measured, Failed> {
        let name = format!("idempotent-window-ceiling-{}-{run}-{mode:?}", std::process::id());
        match broker {
            Broker::Amqp => self.amqp(&name, mode).await,
            Broker::JetStream => self.jetstream(&name.replace('-', "_"), mode).await,
        }
    }

    /// Times `drain` (which must handle every message once): messages per second, CPU per message.
    async fn timed(
        &self,
        handled: &AtomicUsize,
        drain: impl Future<Output = Result<(), Failed>>,
    ) -> Result<Measured, Failed> {
        let (started, before) = (Instant::now(), consumer_processes_ticks());
        tokio::time::timeout(Duration::from_secs(300), drain).await??;
        let elapsed = started.elapsed();
        let after = consumer_processes_ticks();
        assert_eq!(handled.load(Ordering::SeqCst), self.messages, "every message handled once");
        let per_message = |i: usize| (after[i] - before[i]) * 10_000.0 / self.messages as f64;
        Ok((self.messages as f64 / elapsed.as_secs_f64(), std::array::from_fn(per_message)))
    }

    async fn amqp(&self, queue: &str, mode: Mode) -> Result<Measured, Failed> {
        let connection = lapin::Connection::connect(&self.amqp, lapin::ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        fill::amqp(&channel, queue, (0..self.messages).map(|i| format!("{queue}-{i}"))).await?;
        let handled = AtomicUsize::new(0);
        let consuming = connection.create_channel().await?;
        let measured = if mode < Mode::WindowPlain {
            let (observer, done) = self.until_all_acked();
            let consumer = amqp::Consumer::new(consuming, queue).concurrency(self.window).on_settled(observer);
            let handler = |message: amqp::Message| self.handle(mode, message.id().to_owned(), &handled);
            self.timed(&handled, async { consumer.run_until(handler, done).await.map_err(Failed::from) }).await?
        } else {
            self.timed(&handled, self.amqp_windows(consuming, queue, mode, &handled)).await?
        };
        channel.queue_delete(queue.into(), QueueDeleteOptions::default()).await?;
        let _ = connection.close(200, "done".into()).await;
        Ok(measured)
    }

    async fn jetstream(&self, name: &str, mode: Mode) -> Result<Measured, Failed> {
        let js = jetstream::new(async_nats::connect(&self.nats).await?);
        let stream = fill::jetstream(&js, name, (0..self.messages).map(|i| format!("{name}-{i}"))).await?;
        let handled = AtomicUsize::new(0);
        let measured = if mode < Mode::WindowPlain {
            let config = jetstream::consumer::pull::Config { durable_name: Some("lib".into()), ..Default::default() };
            let pull = stream.create_consumer(config).await?;
            let (observer, done) = self.until_all_acked();
            let consumer = js_consume::Consumer::new(js.clone(), pull).concurrency(self.window).on_settled(observer);
            let handler = |message: js_consume::Message| self.handle(mode, message.id().to_owned(), &handled);
            self.timed(&handled, async { consumer.run_until(handler, done).await }).await?
        } else {
            let config = jetstream::consumer::pull::Config {
                durable_name: Some("window".into()),
                ack_policy: jetstream::consumer::AckPolicy::All,
                ..Default::default()
            };
            let pull = stream.create_consumer(config).await?;
            self.timed(&handled, self.jetstream_windows(pull, mode, &handled)).await?
        };
        js.delete_stream(name).await?;
        Ok(measured)
    }

    /// An `on_settled` observer that checks each settlement is an ack, and a future that
    /// completes once every message is acked.
    fn until_all_acked(&self) -> (impl Fn(&Settled) + Send + Sync + 'static, impl Future<Output = ()>) {
        let (acked, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(tokio::sync::Notify::new()));
        let (total, notify) = (self.messages, Arc::clone(&done));
        let observer = move |settled: &Settled| {
            assert_eq!(settled.disposition, Disposition::Ack, "{settled:?}");
            if acked.fetch_add(1, Ordering::SeqCst) + 1 == total {
                notify.notify_one();
            }
        };
        (observer, async move { done.notified().await })
    }

    /// The library consumer's handler in `mode`.
    async fn handle(&self, mode: Mode, id: String, handled: &AtomicUsize) -> Result<usize, Error> {
        match mode {
            Mode::LibRedis => count_once(&self.redis_store, &id, handled).await,
            Mode::LibPostgres => count_once(&self.postgres_store, &id, handled).await,
            _ => Ok(handled.fetch_add(1, Ordering::Relaxed)),
        }
    }

    /// The window loop over RabbitMQ's raw consumer, until every message is acked.
    async fn amqp_windows(
        &self,
        channel: lapin::Channel,
        queue: &str,
        mode: Mode,
        handled: &AtomicUsize,
    ) -> Result<(), Failed> {
        let prefetch = u16::try_from(self.window * 2).unwrap_or(u16::MAX);
        channel.basic_qos(prefetch, BasicQosOptions::default()).await?;
        let options = BasicConsumeOptions::default();
        let mut consumer = channel.basic_consume(queue.into(), "window".into(), options, FieldTable::default()).await?;
        let (mut acked, mut windows) = (0, 0);
        let mut window = Vec::with_capacity(self.window);
        while acked < self.messages {
            next_window(&mut consumer, self.window, &mut window).await?;
            let id = |d: &lapin::message::Delivery| d.properties.message_id().as_ref().map(ToString::to_string);
            let keys: Vec<String> = window.iter().map(id).collect::<Option<_>>().ok_or("a message without an id")?;
            self.window_step(mode, &keys, handled).await?;
            let last = window.last().expect("a window holds a delivery");
            last.acker.ack(BasicAckOptions { multiple: true }).await?;
            acked += window.len();
            windows += 1;
        }
        eprintln!("Amqp {mode:?}: {windows} windows, {:.1} deliveries each on average", acked as f64 / windows as f64);
        Ok(())
    }

    /// The window loop over a JetStream pull consumer with `AckPolicy::All`, until every message
    /// is acked.
    async fn jetstream_windows(
        &self,
        pull: jetstream::consumer::PullConsumer,
        mode: Mode,
        handled: &AtomicUsize,
    ) -> Result<(), Failed> {
        let mut messages = pull.stream().max_messages_per_batch(self.window * 2).messages().await?;
        let (mut acked, mut windows) = (0, 0);
        let mut window = Vec::with_capacity(self.window);
        while acked < self.messages {
            next_window(&mut messages, self.window, &mut window).await?;
            let id = |m: &jetstream::Message| Some(m.headers.as_ref()?.get("Nats-Msg-Id")?.to_string());
            let keys: Vec<String> = window.iter().map(id).collect::<Option<_>>().ok_or("a message without an id")?;
            self.window_step(mode, &keys, handled).await?;
            window.last().expect("a window holds a message").ack().await?;
            acked += window.len();
            windows += 1;
        }
        eprintln!(
            "JetStream {mode:?}: {windows} windows, {:.1} deliveries each on average",
            acked as f64 / windows as f64
        );
        Ok(())
    }

    /// One window's claims, handling and records, as `mode` makes them.
    async fn window_step(&self, mode: Mode, keys: &[String], handled: &AtomicUsize) -> Result<(), Failed> {
        let token = format!("c {:032x}", rand_token());
        match mode {
            Mode::WindowRedis => {
                let mut redis = self.redis.clone();
                let found: Vec<Option<String>> =
                    self.claim.key(keys).arg(&token).arg(60_000).invoke_async(&mut redis).await?;
                assert!(found.iter().all(Option::is_none), "every key claimed: {found:?}");
                let outcomes: Vec<String> = keys
                    .iter()
                    .map(|_| format!("d{}\n{{\"Ok\":{}}}", &token[1..], handled.fetch_add(1, Ordering::Relaxed)))
                    .collect();
                let recorded: usize =
                    self.record.key(keys).arg(&token).arg(600_000).arg(&outcomes).invoke_async(&mut redis).await?;
                assert_eq!(recorded, keys.len());
            }
            Mode::WindowPostgres => {
                let claimed: Vec<String> = sqlx::query_scalar(
                    "INSERT INTO idempotent_window_ceiling (key, token, expires_at) \
                     SELECT k, $2, now() + interval '60 seconds' FROM unnest($1::text[]) AS k \
                     ON CONFLICT (key) DO NOTHING RETURNING key",
                )
                .bind(keys)
                .bind(&token)
                .fetch_all(&self.pool)
                .await?;
                assert_eq!(claimed.len(), keys.len(), "every key claimed");
                let outcomes: Vec<String> =
                    keys.iter().map(|_| format!("{{\"Ok\":{}}}", handled.fetch_add(1, Ordering::Relaxed))).collect();
                let recorded = sqlx::query(
                    "UPDATE idempotent_window_ceiling AS t SET outcome = r.o, \
                     expires_at = now() + interval '10 minutes' \
                     FROM unnest($1::text[], $2::text[]) AS r(k, o) WHERE t.key = r.k AND t.token = $3",
                )
                .bind(keys)
                .bind(&outcomes)
                .bind(&token)
                .execute(&self.pool)
                .await?;
                assert_eq!(recorded.rows_affected(), keys.len() as u64);
            }
            _ => {
                for _ in keys {
                    handled.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }
}

/// How the program fails (every client's error converts into it).
type Failed = Box<dyn std::error::Error + Send + Sync>;

/// Messages per second, and the CPU µs per message of each of [`CONSUMER_PROCESSES`].
type Measured = (f64, [f64; CONSUMER_PROCESSES.len()]);

/// Waits for the next delivery of `stream`, then takes those already at hand, up to `size` in
/// all, into `window` (emptied first).
async fn next_window<T, E: Into<Failed>>(
    stream: &mut (impl futures_util::Stream<Item = Result<T, E>> + Unpin),
    size: usize,
    window: &mut Vec<T>,
) -> Result<(), Failed> {
    window.clear();
    window.push(stream.next().await.ok_or("the consumer ended")?.map_err(Into::into)?);
    while window.len() < size {
        match stream.next().now_or_never() {
            Some(Some(item)) => window.push(item.map_err(Into::into)?),
            _ => break,
        }
    }
    Ok(())
}

/// A random token per window (uuid's per-thread generator: enough for a benchmark's one process).
fn rand_token() -> u128 {
    u128::from_ne_bytes(uuid::Uuid::new_v4().into_bytes())
}
