//! What the Redis store costs per key beside a raw write, with a fixed number of calls in flight
//! on one connection.
//!
//! Each mode keeps `--in-flight` keys in flight (default 16, the consumers' default concurrency,
//! and 64) on one multiplexed connection, with fresh keys, for `--seconds` per mode; within each
//! run, `raw` goes first, then `store`:
//!
//! - `raw`: `SET key value NX PX`, one command per key (the reference of the `load` program);
//! - `store`: an `#[idempotent]` fn on the `RedisStore`, one task per key in flight (a claim and a
//!   record per call).
//!
//! Until `3cd4809` it also had `pairs` and `window` (the store's two commands sent by hand, one
//! key at a time and as one pipeline per window), and later `batched`, on the store sending its
//! steps in pipelines, an option since removed; BENCHMARKS.md has their figures.
//!
//! ```text
//! cargo run --release -p idempotent-examples --bin redis_window -- --runs 5 --seconds 2
//! ```
//!
//! Redis from `REDIS_URL` (default `redis://127.0.0.1:6379/15`). **It empties that database
//! (`FLUSHDB`) before every mode**, so point it at a database nothing else uses: keys left by one
//! mode would otherwise expire while a later one runs, and Redis's expiry work would be counted
//! against that mode (a version without it measured differences between modes that changed with
//! their order). Keys are under `redis-window:` and expire after 10 s. Beside each
//! rate it prints the CPU time per key of this process (from `/proc/self/stat`) and of Redis (its
//! own count, `used_cpu_user + used_cpu_sys` of `INFO cpu`): CPU per key tells the work a mode
//! costs apart from waiting, and moves far less than the rates when the machine is noisy.

#![allow(clippy::cast_precision_loss, reason = "key counts far below 2^52")]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idempotent_examples::measure::{info_cpu_usec, process_ticks};
use idempotent_runtime::stores::redis::redis::{self, aio::ConnectionManager};
use idempotent_runtime::{Error, RedisStore, idempotent};

const USAGE: &str = "usage: redis_window [--runs 3] [--seconds 2] [--in-flight 16,64]";

const PREFIX: &str = "redis-window:";
const MODES: [&str; 2] = ["raw", "store"];

#[idempotent(key = id, store = store, scope = "redis-window", lease = "10s", retention = "10s")]
async fn op(store: &RedisStore, id: &str) -> Result<usize, Error> {
    Ok(id.len())
}

/// This process's CPU ticks so far, and Redis's CPU µs by its own count.
async fn cpu_now(connection: &ConnectionManager) -> (f64, f64) {
    let ticks = process_ticks("/proc/self/stat").map_or(f64::NAN, |(_, ticks)| ticks);
    let info: String = redis::cmd("INFO").arg("cpu").query_async(&mut connection.clone()).await.unwrap_or_default();
    (ticks, info_cpu_usec(&info))
}

/// What one mode measured: keys per second, and the CPU µs per key of this process and of Redis.
#[derive(Clone, Copy)]
struct Measured {
    rate: f64,
    client: f64,
    server: f64,
}

/// Runs `mode` with `in_flight` keys in flight for `seconds`.
async fn rate(
    mode: &'static str,
    in_flight: usize,
    seconds: f64,
    connection: &ConnectionManager,
    store: &RedisStore,
    tag: &str,
) -> Measured {
    let done = Arc::new(AtomicU64::new(0));
    let (ticks, server) = cpu_now(connection).await;
    let stop = Instant::now() + Duration::from_secs_f64(seconds);
    let mut handles = Vec::new();
    for task in 0..in_flight {
        let store = store.clone();
        let (mut connection, done) = (connection.clone(), Arc::clone(&done));
        let tag = format!("{PREFIX}{tag}:{mode}:{task}");
        handles.push(tokio::spawn(async move {
            let mut round = 0u64;
            while Instant::now() < stop {
                round += 1;
                let key = format!("{tag}:{round}");
                if mode == "raw" {
                    let mut cmd = redis::cmd("SET");
                    cmd.arg(&key).arg("1").arg("NX").arg("PX").arg(10_000);
                    let _: redis::Value = cmd.query_async(&mut connection).await.expect("SET");
                } else {
                    op(&store, &key).await.expect("a call on the Redis store");
                }
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for handle in handles {
        handle.await.expect("a load task");
    }
    let keys = done.load(Ordering::Relaxed) as f64;
    let (ticks_after, server_after) = cpu_now(connection).await;
    Measured {
        rate: keys / seconds,
        client: (ticks_after - ticks) * 10_000.0 / keys,
        server: (server_after - server) / keys,
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut runs, mut seconds, mut in_flights) = (3usize, 2.0f64, vec![16usize, 64]);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(USAGE)?;
        match flag.as_str() {
            "--runs" => runs = value.parse()?,
            "--seconds" => seconds = value.parse()?,
            "--in-flight" => in_flights = value.split(',').map(str::parse).collect::<Result<_, _>>()?,
            _ => return Err(USAGE.into()),
        }
    }
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/15".into());
    let connection = ConnectionManager::new(redis::Client::open(url.as_str())?).await?;
    let store = RedisStore::new(connection.clone()).with_prefix(PREFIX)?;
    println!("load average at start: {}", std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim());
    let mut ratios: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); MODES.len()]; in_flights.len()];
    let (mut rates, mut client, mut server) = (ratios.clone(), ratios.clone(), ratios.clone());
    for run in 1..=runs {
        for (f, &in_flight) in in_flights.iter().enumerate() {
            let mut row = Vec::with_capacity(MODES.len());
            for mode in MODES {
                // Every mode starts on an empty database: no keys of an earlier mode expire (and
                // cost Redis CPU) while it runs.
                let () = redis::cmd("FLUSHDB").arg("SYNC").query_async(&mut connection.clone()).await?;
                let tag = format!("{run}:{in_flight}");
                row.push(rate(mode, in_flight, seconds, &connection, &store, &tag).await);
            }
            let raw = row[0].rate;
            let line: Vec<String> = MODES
                .iter()
                .zip(&row)
                .map(|(m, x)| {
                    format!("{m} {:.0}/s ({:.2}; {:.1} + {:.1} µs)", x.rate, x.rate / raw, x.client, x.server)
                })
                .collect();
            println!("run {run}, {in_flight} in flight: {}", line.join(", "));
            for (m, x) in row.iter().enumerate() {
                rates[f][m].push(x.rate);
                ratios[f][m].push(x.rate / raw);
                client[f][m].push(x.client);
                server[f][m].push(x.server);
            }
        }
    }
    println!("load average at end: {}", std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim());
    println!(
        "\nkeys/s, median of {runs} runs of {seconds} s (÷ raw: within each run, then the median; \
         CPU µs per key of this process + of Redis)\n"
    );
    println!("| in flight | {} |", MODES.join(" | "));
    println!("|---:|{}", "---:|".repeat(MODES.len()));
    for (f, in_flight) in in_flights.iter().enumerate() {
        let cells: Vec<String> = (0..MODES.len())
            .map(|m| {
                let (rate, ratio) = (median(rates[f][m].clone()), median(ratios[f][m].clone()));
                let (ours, redis) = (median(client[f][m].clone()), median(server[f][m].clone()));
                format!("{rate:.0} ({ratio:.2}; {ours:.1} + {redis:.1} µs)")
            })
            .collect();
        println!("| {in_flight} | {} |", cells.join(" | "));
    }
    Ok(())
}
