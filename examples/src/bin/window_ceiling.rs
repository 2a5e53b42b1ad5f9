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
//! RabbitMQ only. For each run and mode a fresh queue is filled with `--messages` messages with
//! unique ids (not timed), then drained; the time until the last acknowledgement is taken:
//!
//! - `lib-plain`, `lib-redis`, `lib-postgres`: the library's `amqp::Consumer` with
//!   `--window` deliveries in flight, the handler a counter, run through `#[idempotent]` on the
//!   Redis store or the PostgreSQL store (pool `test_before_acquire(false)`) for the last two:
//!   what `consume_load` measures;
//! - `window-plain`: a loop over the raw `lapin` consumer (prefetch twice the window) that takes
//!   the deliveries at hand, up to `--window`, runs the counter on each and acknowledges the window
//!   with one `basic.ack` (`multiple`);
//! - `window-redis`: the same loop, with the window's keys claimed by one Lua script (`SET NX PX GET`
//!   per key) and recorded by another (a fenced `SET PX` per key), on the same Redis server;
//! - `window-postgres`: the same loop, with one `INSERT .. SELECT unnest(..) .. ON CONFLICT DO
//!   NOTHING RETURNING` for the window's claims and one `UPDATE .. FROM unnest(..)` fenced by the
//!   window's token for its records, each its own transaction (two commits per window).
//!
//! The modes alternate within each run; each ratio is taken within its run against the plain
//! mode of the same family (`lib-*` against `lib-plain`, `window-*` against `window-plain`).
//!
//! ```text
//! cargo run --release -p idempotent-examples --bin window_ceiling -- --runs 5 --messages 20000 --window 16
//! ```

#![allow(clippy::cast_precision_loss, reason = "message counts far below 2^52")]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::{FutureExt as _, StreamExt as _};
use idempotent_examples::measure::{median, process_ticks, ticks_of_processes_named};
use idempotent_runtime::consume::amqp::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use idempotent_runtime::consume::amqp::lapin::types::FieldTable;
use idempotent_runtime::consume::amqp::lapin::{self, BasicProperties};
use idempotent_runtime::consume::{Disposition, amqp};
use idempotent_runtime::stores::redis::redis;
use idempotent_runtime::stores::sql::{PostgresStore, sqlx};
use idempotent_runtime::{Error, RedisStore, Store, idempotent};

const USAGE: &str = "usage: window_ceiling [--runs 5] [--messages 20000] [--window 16]";

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

#[idempotent(key = id, store = store, scope = "window-ceiling", retention = "10m")]
async fn handle<S: Store>(store: &S, id: &str, handled: &AtomicUsize) -> Result<usize, Error> {
    Ok(handled.fetch_add(1, Ordering::Relaxed))
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

/// The processes whose CPU time is counted: this program, RabbitMQ, Redis, PostgreSQL.
const PROCESSES: [&str; 4] = ["this program", "beam.smp", "redis-server", "postgres"];

struct Setup {
    amqp: String,
    redis_store: RedisStore,
    redis: redis::aio::MultiplexedConnection,
    postgres_store: PostgresStore,
    pool: sqlx::PgPool,
    messages: usize,
    window: usize,
}

fn env(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut runs, mut messages, mut window) = (5usize, 20_000usize, 16usize);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(USAGE)?.parse::<usize>().map_err(|_| USAGE)?;
        match flag.as_str() {
            "--runs" => runs = value,
            "--messages" => messages = value,
            "--window" => window = value.clamp(1, 1000),
            _ => return Err(USAGE.into()),
        }
    }
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
        redis_store,
        redis,
        postgres_store,
        pool,
        messages,
        window,
    };

    let mut rates: BTreeMap<Mode, Vec<f64>> = BTreeMap::new();
    let mut ratios: BTreeMap<Mode, Vec<f64>> = BTreeMap::new();
    let mut cpu: BTreeMap<(Mode, usize), Vec<f64>> = BTreeMap::new();
    for run in 1..=runs {
        setup.reset_tables().await?;
        let mut plain = [f64::NAN; 2];
        for mode in MODES {
            let (rate, used) = setup.measure(mode, run).await?;
            eprintln!("run {run}: {mode:?}: {rate:.0} messages/s, CPU µs per message {used:.1?}");
            let family = usize::from(mode >= Mode::WindowPlain);
            if matches!(mode, Mode::LibPlain | Mode::WindowPlain) {
                plain[family] = rate;
            }
            ratios.entry(mode).or_default().push(rate / plain[family]);
            rates.entry(mode).or_default().push(rate);
            for (i, used) in used.iter().enumerate() {
                cpu.entry((mode, i)).or_default().push(*used);
            }
        }
    }
    sqlx::query("DROP TABLE IF EXISTS idempotent_window_ceiling").execute(&setup.pool).await?;
    sqlx::query("DROP TABLE IF EXISTS idempotent_window_ceiling_store").execute(&setup.pool).await?;

    println!("\nRabbitMQ, {messages} messages per measurement, window {window}, medians of {runs} runs\n");
    println!(
        "| mode | messages/s | × its plain (per run) | CPU µs per message: this program, RabbitMQ, Redis, PostgreSQL; all |"
    );
    println!("|---|---:|---|---|");
    for (mode, values) in &rates {
        let per_run: Vec<String> = ratios[mode].iter().map(|r| format!("{r:.2}")).collect();
        let used: Vec<f64> = (0..PROCESSES.len()).map(|i| median(cpu[&(*mode, i)].clone())).collect();
        println!(
            "| {mode:?} | {:.0} | **{:.2}** ({}) | {:.1}, {:.1}, {:.1}, {:.1}; {:.1} |",
            median(values.clone()),
            median(ratios[mode].clone()),
            per_run.join(", "),
            used[0],
            used[1],
            used[2],
            used[3],
            used.iter().sum::<f64>()
        );
    }
    println!("\nload average at end: {}", loadavg());
    Ok(())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(|e| format!("unknown ({e})"), |l| l.trim().to_owned())
}

/// The CPU time (clock ticks of 10 ms) so far of this program and of each of the servers.
fn cpu_by_process() -> [f64; PROCESSES.len()] {
    std::array::from_fn(|i| match i {
        0 => process_ticks("/proc/self/stat").map_or(f64::NAN, |(_, ticks)| ticks),
        _ => ticks_of_processes_named(PROCESSES[i]),
    })
}

impl Setup {
    async fn reset_tables(&self) -> Result<(), Box<dyn std::error::Error>> {
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

    /// Fills a fresh queue and drains it in `mode`: messages per second, CPU µs per message.
    async fn measure(&self, mode: Mode, run: usize) -> Result<(f64, [f64; 4]), Box<dyn std::error::Error>> {
        let queue = format!("idempotent-window-ceiling-{}-{run}-{mode:?}", std::process::id());
        let connection = lapin::Connection::connect(&self.amqp, lapin::ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        channel.queue_declare(queue.as_str().into(), QueueDeclareOptions::default(), FieldTable::default()).await?;
        let mut confirms = Vec::with_capacity(self.messages);
        for i in 0..self.messages {
            let properties = BasicProperties::default().with_message_id(format!("{queue}-{i}").into());
            let options = BasicPublishOptions::default();
            confirms.push(channel.basic_publish("".into(), queue.as_str().into(), options, b"{}", properties).await?);
        }
        for confirm in confirms {
            confirm.await?;
        }
        let handled = Arc::new(AtomicUsize::new(0));
        let consuming = connection.create_channel().await?;
        let (started, before) = (Instant::now(), cpu_by_process());
        let drained = match mode {
            Mode::LibPlain | Mode::LibRedis | Mode::LibPostgres => {
                self.library(consuming, &queue, mode, &handled).boxed().await
            }
            Mode::WindowPlain | Mode::WindowRedis | Mode::WindowPostgres => {
                self.windows(consuming, &queue, mode, &handled).boxed().await
            }
        };
        tokio::time::timeout(Duration::from_secs(300), async { drained }).await??;
        let elapsed = started.elapsed();
        let after = cpu_by_process();
        assert_eq!(handled.load(Ordering::SeqCst), self.messages, "every message handled once");
        channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await?;
        let _ = connection.close(200, "done".into()).await;
        let per_message = |i: usize| (after[i] - before[i]) * 10_000.0 / self.messages as f64;
        Ok((self.messages as f64 / elapsed.as_secs_f64(), std::array::from_fn(per_message)))
    }

    /// The library's consumer, `window` deliveries in flight, until every message is acked.
    async fn library(
        &self,
        channel: lapin::Channel,
        queue: &str,
        mode: Mode,
        handled: &AtomicUsize,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let (acked, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(tokio::sync::Notify::new()));
        let total = self.messages;
        let notify = Arc::clone(&done);
        let consumer = amqp::Consumer::new(channel, queue).concurrency(self.window).on_settled(move |settled| {
            assert_eq!(settled.disposition, Disposition::Ack, "{settled:?}");
            if acked.fetch_add(1, Ordering::SeqCst) + 1 == total {
                notify.notify_one();
            }
        });
        let handler = |message: amqp::Message| async move {
            let id = message.id().to_owned();
            match mode {
                Mode::LibRedis => handle(&self.redis_store, &id, handled).await,
                Mode::LibPostgres => handle(&self.postgres_store, &id, handled).await,
                _ => Ok(handled.fetch_add(1, Ordering::Relaxed)),
            }
        };
        consumer.run_until(handler, async move { done.notified().await }).await?;
        Ok(())
    }

    /// The window loop over the raw consumer, until every message is acked.
    async fn windows(
        &self,
        channel: lapin::Channel,
        queue: &str,
        mode: Mode,
        handled: &AtomicUsize,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let prefetch = u16::try_from(self.window * 2).unwrap_or(u16::MAX);
        channel.basic_qos(prefetch, BasicQosOptions::default()).await?;
        let options = BasicConsumeOptions::default();
        let mut consumer = channel.basic_consume(queue.into(), "window".into(), options, FieldTable::default()).await?;
        let claim = redis::Script::new(CLAIM);
        let record = redis::Script::new(RECORD);
        let mut redis = self.redis.clone();
        let (mut acked, mut windows) = (0, 0);
        let mut window = Vec::with_capacity(self.window);
        while acked < self.messages {
            window.clear();
            window.push(consumer.next().await.ok_or("the consumer ended")??);
            while window.len() < self.window {
                match consumer.next().now_or_never() {
                    Some(Some(delivery)) => window.push(delivery?),
                    _ => break,
                }
            }
            let keys: Vec<String> = window
                .iter()
                .map(|d| d.properties.message_id().as_ref().map(ToString::to_string).ok_or("a message without an id"))
                .collect::<Result<_, _>>()?;
            let token = format!("c {:032x}", rand_token());
            match mode {
                Mode::WindowRedis => {
                    let found: Vec<Option<String>> =
                        claim.key(&keys).arg(&token).arg(60_000).invoke_async(&mut redis).await?;
                    assert!(found.iter().all(Option::is_none), "every key claimed: {found:?}");
                    let outcomes: Vec<String> = keys
                        .iter()
                        .map(|_| format!("d{}\n{{\"Ok\":{}}}", &token[1..], handled.fetch_add(1, Ordering::Relaxed)))
                        .collect();
                    let recorded: usize =
                        record.key(&keys).arg(&token).arg(600_000).arg(&outcomes).invoke_async(&mut redis).await?;
                    assert_eq!(recorded, keys.len());
                }
                Mode::WindowPostgres => {
                    let claimed: Vec<String> = sqlx::query_scalar(
                        "INSERT INTO idempotent_window_ceiling (key, token, expires_at) \
                         SELECT k, $2, now() + interval '60 seconds' FROM unnest($1::text[]) AS k \
                         ON CONFLICT (key) DO NOTHING RETURNING key",
                    )
                    .bind(&keys)
                    .bind(&token)
                    .fetch_all(&self.pool)
                    .await?;
                    assert_eq!(claimed.len(), keys.len(), "every key claimed");
                    let outcomes: Vec<String> = keys
                        .iter()
                        .map(|_| format!("{{\"Ok\":{}}}", handled.fetch_add(1, Ordering::Relaxed)))
                        .collect();
                    let recorded = sqlx::query(
                        "UPDATE idempotent_window_ceiling AS t SET outcome = r.o, \
                         expires_at = now() + interval '10 minutes' \
                         FROM unnest($1::text[], $2::text[]) AS r(k, o) WHERE t.key = r.k AND t.token = $3",
                    )
                    .bind(&keys)
                    .bind(&outcomes)
                    .bind(&token)
                    .execute(&self.pool)
                    .await?;
                    assert_eq!(recorded.rows_affected(), keys.len() as u64);
                }
                _ => {
                    for _ in &keys {
                        handled.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            let last = window.last().expect("a window holds a delivery");
            last.acker.ack(BasicAckOptions { multiple: true }).await?;
            acked += window.len();
            windows += 1;
        }
        eprintln!("{mode:?}: {windows} windows, {:.1} deliveries each on average", acked as f64 / windows as f64);
        Ok(())
    }
}

/// A random token per window (uuid's per-thread generator: enough for a benchmark's one process).
fn rand_token() -> u128 {
    u128::from_ne_bytes(uuid::Uuid::new_v4().into_bytes())
}
