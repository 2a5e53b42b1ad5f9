//! What claiming and recording a consumer's prefetch window in one pipeline would gain on Redis,
//! measured before building it.
//!
//! Each mode keeps `--in-flight` keys in flight (default 16, the consumers' default concurrency,
//! and 64) on one multiplexed connection, with fresh keys, for `--seconds` per mode; the modes
//! alternate within each run:
//!
//! - `raw`: `SET key value NX PX`, one command per key (the reference of the `load` program);
//! - `store`: an `#[idempotent]` fn on the `RedisStore`, one task per key in flight (what a
//!   consumer's handlers do today: a claim and a record per message);
//! - `batched`: the same calls on the store `with_batching` (its steps go in pipelines: while one
//!   is in flight, the steps that arrive wait and go together in the next);
//! - `pairs`: the store's two commands per key sent by hand (the claiming `SET ... NX PX ... GET`
//!   and an `EVALSHA` of a completion script of the store's shape), without the protocol around them;
//! - `window`: the same two commands, but the keys in flight go as one pipeline of claims and then
//!   one pipeline of completions (what batching a prefetch window would send).
//!
//! ```text
//! cargo run --release -p idempotent-examples --bin redis_window -- --runs 5 --seconds 2
//! ```
//!
//! Redis from `REDIS_URL` (default `redis://127.0.0.1:6379`); keys under `redis-window:`, which
//! expire 10 s after they are written (so the server's key count stays bounded). Beside each
//! rate it prints the CPU time per key of this process (from `/proc/self/stat`) and of Redis (its
//! own count, `used_cpu_user + used_cpu_sys` of `INFO cpu`): CPU per key tells the work a mode
//! costs apart from waiting, and moves far less than the rates when the machine is noisy.

#![allow(clippy::cast_precision_loss, reason = "key counts far below 2^52")]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idempotent_runtime::stores::redis::redis::{self, aio::ConnectionManager};
use idempotent_runtime::{Error, RedisStore, idempotent};

const USAGE: &str = "usage: redis_window [--runs 3] [--seconds 2] [--in-flight 16,64]";

/// The store's completion script, copied from `COMPLETE_LUA` in
/// `idempotent-runtime/src/stores/redis/mod.rs` (private there) so that `pairs` and `window` send
/// the very command the store sends: read the value, compare its start with the running header of
/// this token, write the record with its retention. Change both together.
const COMPLETE: &str = r"
local v = redis.pcall('GET', KEYS[1])
if v == false then
  redis.call('SET', KEYS[1], ARGV[5] .. ARGV[3], 'PX', ARGV[4])
  return 1
end
if type(v) ~= 'string' then return -1 end
local n = #ARGV[1]
if string.sub(v, 1, n) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2] .. string.sub(v, n + 1) .. ARGV[3], 'PX', ARGV[4])
  return 1
end
if string.sub(v, 1, #ARGV[2]) == ARGV[2] then return 1 end
return 0
";
const TOKEN: &str = "0123456789abcdef0123456789abcdef";
const PREFIX: &str = "redis-window:";
const MODES: [&str; 5] = ["raw", "store", "batched", "pairs", "window"];

#[idempotent(key = id, store = store, scope = "redis-window", lease = "10s", retention = "10s")]
async fn op(store: &RedisStore, id: &str) -> Result<usize, Error> {
    Ok(id.len())
}

fn claim(key: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("SET");
    cmd.arg(key).arg(format!("idempotent/1 running {TOKEN} -\n")).arg("NX").arg("PX").arg(10_000).arg("GET");
    cmd
}

fn complete(sha: &str, key: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha).arg(1).arg(key);
    cmd.arg(format!("idempotent/1 running {TOKEN} ")).arg(format!("idempotent/1 done {TOKEN} "));
    cmd.arg("{\"Ok\":12}").arg(10_000).arg(format!("idempotent/1 done {TOKEN} -\n"));
    cmd
}

/// This process's CPU time so far (user and system), from `/proc/self/stat`, in clock ticks
/// (100 per second on Linux).
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name, which is in parentheses: utime and stime are 14 and 15.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    after.split_whitespace().skip(11).take(2).filter_map(|field| field.parse::<u64>().ok()).sum()
}

/// Redis's CPU time so far by its own count (`used_cpu_user + used_cpu_sys` of `INFO cpu`), in µs.
async fn redis_cpu(connection: &ConnectionManager) -> f64 {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(&mut connection.clone()).await.unwrap_or_default();
    let seconds: f64 = info
        .lines()
        .filter_map(|line| line.strip_prefix("used_cpu_user:").or_else(|| line.strip_prefix("used_cpu_sys:")))
        .filter_map(|value| value.trim().parse::<f64>().ok())
        .sum();
    seconds * 1e6
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
    stores: &[RedisStore; 2],
    sha: &Arc<str>,
    tag: &str,
) -> Measured {
    let done = Arc::new(AtomicU64::new(0));
    let (ticks, server) = (cpu_ticks(), redis_cpu(connection).await);
    let stop = Instant::now() + Duration::from_secs_f64(seconds);
    // `window` sends all keys in flight from one task; the other modes run one task per key.
    let (tasks, batch) = if mode == "window" { (1, in_flight) } else { (in_flight, 1) };
    let mut handles = Vec::new();
    for task in 0..tasks {
        let store = stores[usize::from(mode == "batched")].clone();
        let (mut connection, sha, done) = (connection.clone(), Arc::clone(sha), Arc::clone(&done));
        let tag = format!("{PREFIX}{tag}:{mode}:{task}");
        handles.push(tokio::spawn(async move {
            let mut round = 0u64;
            while Instant::now() < stop {
                round += 1;
                let keys: Vec<String> = (0..batch).map(|i| format!("{tag}:{round}:{i}")).collect();
                match mode {
                    "raw" => {
                        let mut cmd = redis::cmd("SET");
                        cmd.arg(&keys[0]).arg("1").arg("NX").arg("PX").arg(10_000);
                        let _: redis::Value = cmd.query_async(&mut connection).await.expect("SET");
                    }
                    "store" | "batched" => {
                        op(&store, &keys[0]).await.expect("a call on the Redis store");
                    }
                    "pairs" => {
                        let _: redis::Value = claim(&keys[0]).query_async(&mut connection).await.expect("claim");
                        let _: redis::Value =
                            complete(&sha, &keys[0]).query_async(&mut connection).await.expect("complete");
                    }
                    _ => {
                        let mut claims = redis::pipe();
                        for key in &keys {
                            claims.add_command(claim(key));
                        }
                        let _: Vec<redis::Value> = claims.query_async(&mut connection).await.expect("claims");
                        let mut completions = redis::pipe();
                        for key in &keys {
                            completions.add_command(complete(&sha, key));
                        }
                        let _: Vec<redis::Value> = completions.query_async(&mut connection).await.expect("completions");
                    }
                }
                done.fetch_add(batch as u64, Ordering::Relaxed);
            }
        }));
    }
    for handle in handles {
        handle.await.expect("a load task");
    }
    let keys = done.load(Ordering::Relaxed) as f64;
    let client = (cpu_ticks() - ticks) as f64 * 10_000.0 / keys;
    Measured { rate: keys / seconds, client, server: (redis_cpu(connection).await - server) / keys }
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
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let connection = ConnectionManager::new(redis::Client::open(url.as_str())?).await?;
    let store = RedisStore::new(connection.clone()).with_prefix(PREFIX)?;
    let stores = [store.clone(), store.with_batching()];
    let sha: Arc<str> = redis::Script::new(COMPLETE).get_hash().into();
    let _: String = redis::cmd("SCRIPT").arg("LOAD").arg(COMPLETE).query_async(&mut connection.clone()).await?;
    println!("load average at start: {}", std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim());
    let mut ratios: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); MODES.len()]; in_flights.len()];
    let (mut rates, mut client, mut server) = (ratios.clone(), ratios.clone(), ratios.clone());
    for run in 1..=runs {
        for (f, &in_flight) in in_flights.iter().enumerate() {
            let mut row = Vec::new();
            for mode in MODES {
                row.push(
                    rate(mode, in_flight, seconds, &connection, &stores, &sha, &format!("{run}:{in_flight}")).await,
                );
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
