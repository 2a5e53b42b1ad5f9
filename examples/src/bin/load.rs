//! A load program: what `#[idempotent]` costs on each store, next to the store's own cheapest write.
//!
//! For each store and concurrency it runs, several times, three timed phases of `--seconds` each,
//! after an untimed warm-up (with `--slices N`, each phase runs as N slices, alternating raw, first
//! and replay, so that load from other processes falls on the three alike):
//!
//! - `raw`: the store's minimal write with a fresh key, straight through the client crate
//!   (Redis: `SET key value NX PX`; SQL: `INSERT ... ON CONFLICT DO NOTHING`; memory: one insert
//!   into a locked `HashMap` shard). One round trip.
//! - `first`: an `#[idempotent]` fn called with fresh keys: a claim and a record, two round trips.
//! - `replay`: the same fn called again with the keys `first` completed: one claim that finds the
//!   record, one round trip.
//!
//! So the ideal is `first/s = 0.5 × raw/s` and `replay/s = 1.0 × raw/s`. The store `redis-cached`
//! is the Redis store behind a `CachedStore` (a local replay cache): its replays are answered from
//! this process's memory, with no round trip, so they can beat the raw write. The store
//! `redis-peer` runs the same function through the crates.io `idempotent` 0.3.0 crate's Redis
//! store (the best other Rust crate; a dependency of this program only), so its ratios to the same
//! raw write can be set beside ours. The store `redis-script` is ours with
//! `with_native_completion(false)`: on a server with `SET ... IFEQ` (Valkey 8.1), it completes by
//! the script as on an older server, to set the two beside each other. It prints one CSV row per
//! phase (to `--csv`) and a Markdown table of medians over the runs, with the ratios measured side
//! by side in each run. `--rss-keys N` instead measures the memory store's resident memory with `N`
//! completed keys, and after they expire and are purged.
//!
//! ```text
//! cargo run --release -p idempotent-examples --bin load -- --store redis --concurrency 64 --seconds 10
//! cargo run --release -p idempotent-examples --bin load -- --store all --runs 5 --csv target/load.csv
//! cargo run --release -p idempotent-examples --bin load -- --rss-keys 1000000
//! ```
//!
//! Servers come from `REDIS_URL`, `POSTGRES_URL` and `MYSQL_URL` (the test suite's defaults);
//! SQLite uses a file under the system temporary directory. The benchmark tables are
//! `idempotent_bench` and `idempotent_bench_raw`; they are dropped and created before each run.

#![allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "statistics over counts far below 2^52, and percentile ranks within a vector's bounds"
)]

use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::BuildHasher;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_examples::measure::{info_cpu_usec, median, process_ticks, ticks_of_processes_named};
use idempotent_runtime::stores::cache::CachedStore;
use idempotent_runtime::stores::memory::MemoryLimits;
use idempotent_runtime::stores::redis::RedisClusterStore;
use idempotent_runtime::stores::redis::redis::{self, aio::ConnectionManager};
use idempotent_runtime::stores::sql::{MySqlStore, PostgresStore, SqliteStore, sqlx};
use idempotent_runtime::{Call, Error, MemoryStore, RedisStore, Store, idempotent};

const USAGE: &str = "\
usage: load [--store memory|redis|redis-script|redis-peer|redis-cached|redis-cluster|redis-cluster-wait|postgres|mysql|sqlite|all]
            [--concurrency 1,16,64]
            [--seconds 3] [--slices 1] [--runs 3] [--warmup-ms 300] [--csv PATH]
       load --rss-keys 1000000";

/// The process names of a Redis server, for its CPU time: Redis's own or Valkey's.
const REDIS_SERVERS: &str = "redis-server|valkey-server";

/// The function under test: trivial, so what is measured is the idempotency layer.
#[idempotent(key = id, store = store, scope = "load", retention = "10m")]
async fn op<S: Store>(store: &S, id: &str) -> Result<u64, Error> {
    Ok(id.len() as u64)
}

/// [`op`] through one of our stores.
async fn ours<S: Store>(store: &S, key: &str) -> Result<(), String> {
    op(store, key).await.map(drop).map_err(|e| e.to_string())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Raw,
    First,
    Replay,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Raw => "raw",
            Phase::First => "first",
            Phase::Replay => "replay",
        }
    }
}

/// A store under test, with its raw baseline operation.
trait Target: Send + Sync + 'static {
    /// The name (`comm`) of the server processes whose CPU time is counted, if any.
    const SERVER: Option<&'static str>;

    /// The function under test through the idempotency layer under `key`: a first execution
    /// when the key is fresh, a replay when an earlier phase completed it.
    fn call(&self, key: &str) -> impl Future<Output = Result<(), String>> + Send;

    /// The store's own minimal write of a fresh `key`: one round trip.
    fn raw(&self, key: &str) -> impl Future<Output = Result<(), String>> + Send;

    /// CPU microseconds the server used so far, by its own count (Redis: `used_cpu_user` +
    /// `used_cpu_sys` of `INFO cpu`, summed over every node), if it keeps one. Unlike the `/proc`
    /// column this counts only the server under test, at microsecond resolution.
    fn server_usec(&self) -> impl Future<Output = Option<f64>> + Send {
        std::future::ready(None)
    }
}

/// What one phase measured.
struct Sample {
    ops: u64,
    errors: u64,
    elapsed: Duration,
    /// Per-operation latencies in nanoseconds, sorted.
    latencies: Vec<u32>,
    /// Per task, how many keys it used (for `first`, so `replay` can reuse them).
    completed: Vec<u64>,
    /// CPU seconds this process and the store's server processes used during the phase.
    cpu: Cpu,
    /// CPU microseconds the server under test used during the phase, by its own count.
    server_usec: f64,
}

impl Sample {
    fn empty() -> Self {
        Sample {
            ops: 0,
            errors: 0,
            elapsed: Duration::ZERO,
            latencies: Vec::new(),
            completed: Vec::new(),
            cpu: Cpu::default(),
            server_usec: 0.0,
        }
    }

    /// Adds another slice of the same phase.
    fn absorb(&mut self, other: Sample) {
        self.ops += other.ops;
        self.errors += other.errors;
        self.elapsed += other.elapsed;
        self.latencies.extend(other.latencies);
        self.cpu = Cpu { client: self.cpu.client + other.cpu.client, server: self.cpu.server + other.cpu.server };
        self.server_usec += other.server_usec;
    }

    fn rate(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }

    fn percentile_us(&self, p: f64) -> f64 {
        if self.latencies.is_empty() {
            return f64::NAN;
        }
        let rank = ((self.latencies.len() - 1) as f64 * p).round() as usize;
        f64::from(self.latencies[rank]) / 1000.0
    }
}

/// Runs `phase` on `concurrency` tasks for `duration`.
///
/// Fresh keys are `{tag}-{task}-{i}`; replays cycle through the keys `first` completed.
async fn drive<T: Target>(
    target: &Arc<T>,
    phase: Phase,
    concurrency: usize,
    duration: Duration,
    tag: &str,
    completed: &[u64],
) -> Sample {
    let stop = Arc::new(AtomicBool::new(false));
    let usec_before = target.server_usec().await;
    let cpu_before = Cpu::now(T::SERVER);
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|task| {
            let (target, stop, tag) = (Arc::clone(target), Arc::clone(&stop), tag.to_owned());
            // A replaying task reuses the keys of one first-phase task, all of them in turn.
            let (owner, available) = match completed.len() {
                0 => (task, 0),
                n => (task % n, completed[task % n]),
            };
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(1 << 16);
                let (mut next, mut ok, mut errors, mut key) = (0u64, 0u64, 0u64, String::with_capacity(64));
                while !stop.load(Ordering::Relaxed) {
                    let (owner, i) = match phase {
                        Phase::Replay if available == 0 => break,
                        Phase::Replay => (owner, next % available),
                        Phase::Raw | Phase::First => (task, next),
                    };
                    next += 1;
                    key.clear();
                    let _ = write!(key, "{tag}-{owner}-{i}");
                    let began = Instant::now();
                    let result = match phase {
                        Phase::Raw => target.raw(&key).await,
                        Phase::First | Phase::Replay => target.call(&key).await,
                    };
                    latencies.push(u32::try_from(began.elapsed().as_nanos()).unwrap_or(u32::MAX));
                    // The memory store never suspends: yield now and then so that the other
                    // tasks on this worker, and the timer that ends the phase, get to run.
                    if next % 16 == 0 {
                        tokio::task::yield_now().await;
                    }
                    match result {
                        Ok(()) => ok += 1,
                        Err(e) => {
                            if errors == 0 {
                                eprintln!("{}: {e}", phase.name());
                            }
                            errors += 1;
                        }
                    }
                }
                (ok, errors, next, latencies)
            })
        })
        .collect();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut sample = Sample {
        ops: 0,
        errors: 0,
        elapsed: Duration::ZERO,
        latencies: Vec::new(),
        completed: Vec::new(),
        cpu: Cpu::default(),
        server_usec: f64::NAN,
    };
    for task in tasks {
        let (ok, errors, keys, latencies) = task.await.expect("a load task panicked");
        sample.ops += ok;
        sample.errors += errors;
        sample.completed.push(keys);
        sample.latencies.extend(latencies);
    }
    sample.elapsed = start.elapsed();
    sample.cpu = Cpu::now(T::SERVER).since(cpu_before);
    if let (Some(before), Some(after)) = (usec_before, target.server_usec().await) {
        sample.server_usec = after - before;
    }
    sample.latencies.sort_unstable();
    sample
}

/// One row of the CSV and of the summary.
struct Row {
    store: &'static str,
    concurrency: usize,
    run: usize,
    phase: Phase,
    ops: u64,
    errors: u64,
    seconds: f64,
    rate: f64,
    p50_us: f64,
    p99_us: f64,
    /// CPU time per successful operation of this process, and of the store's server, in µs.
    client_cpu_us: f64,
    server_cpu_us: f64,
    /// Server CPU per successful operation by the server's own count (Redis `INFO cpu`), µs.
    server_cmd_us: f64,
}

const CSV_HEADER: &str = "store,concurrency,run,phase,ops,errors,seconds,ops_per_s,p50_us,p99_us,client_cpu_us_per_op,server_cpu_us_per_op,server_info_cpu_us_per_op";

impl Row {
    fn csv(&self) -> String {
        format!(
            "{},{},{},{},{},{},{:.3},{:.1},{:.2},{:.2},{:.2},{:.2},{:.2}",
            self.store,
            self.concurrency,
            self.run,
            self.phase.name(),
            self.ops,
            self.errors,
            self.seconds,
            self.rate,
            self.p50_us,
            self.p99_us,
            self.client_cpu_us,
            self.server_cpu_us,
            self.server_cmd_us
        )
    }
}

struct Options {
    stores: Vec<String>,
    concurrency: Vec<usize>,
    seconds: f64,
    runs: usize,
    warmup: Duration,
    slices: usize,
    csv: Option<String>,
    rss_keys: Option<u64>,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        stores: vec!["all".into()],
        concurrency: vec![1, 16, 64],
        seconds: 3.0,
        runs: 3,
        warmup: Duration::from_millis(300),
        slices: 1,
        csv: None,
        rss_keys: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            return Err(String::new());
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--store" => options.stores = value.split(',').map(str::to_owned).collect(),
            "--concurrency" => {
                options.concurrency =
                    value.split(',').map(str::parse).collect::<Result<_, _>>().map_err(|e| bad(&e))?;
            }
            "--seconds" => options.seconds = value.parse().map_err(|e| bad(&e))?,
            "--runs" => options.runs = value.parse().map_err(|e| bad(&e))?,
            "--slices" => options.slices = value.parse().map_err(|e| bad(&e))?,
            "--warmup-ms" => options.warmup = Duration::from_millis(value.parse().map_err(|e| bad(&e))?),
            "--csv" => options.csv = Some(value),
            "--rss-keys" => options.rss_keys = Some(value.parse().map_err(|e| bad(&e))?),
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    if options.stores.iter().any(|s| s == "all") {
        options.stores = ["memory", "redis", "redis-cached", "postgres", "mysql", "sqlite"].map(str::to_owned).to_vec();
    }
    if options.concurrency.contains(&0) || options.runs == 0 || options.slices == 0 || options.seconds <= 0.0 {
        return Err("concurrency, runs, slices and seconds must be positive".into());
    }
    Ok(options)
}

fn main() {
    let options = match parse_options() {
        Ok(options) => options,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("load: {message}");
            }
            eprintln!("{USAGE}");
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a Tokio runtime");
    if let Some(keys) = options.rss_keys {
        runtime.block_on(memory_rss(keys));
        return;
    }
    let mut csv = options.csv.as_ref().map(|path| {
        let mut file = std::fs::File::create(path).unwrap_or_else(|e| panic!("cannot create {path}: {e}"));
        writeln!(file, "{CSV_HEADER}").expect("write the CSV");
        file
    });
    let mut rows = Vec::new();
    // Run by run, every store in turn: the stores' run `n`s are measured seconds apart, so that
    // a comparison between two stores (ours and the peer's) is one of measurements taken side by
    // side, not of one store's five runs against another's five taken minutes later.
    let mut skipped: Vec<&str> = Vec::new();
    for &concurrency in &options.concurrency {
        for run in 1..=options.runs {
            for store in &options.stores {
                if skipped.contains(&store.as_str()) {
                    continue;
                }
                match runtime.block_on(measure(store, concurrency, run, &options)) {
                    Ok(measured) => {
                        for row in measured {
                            if let Some(file) = csv.as_mut() {
                                writeln!(file, "{}", row.csv()).expect("write the CSV");
                            }
                            rows.push(row);
                        }
                    }
                    Err(e) => {
                        eprintln!("load: {store} skipped: {e}");
                        skipped.push(store);
                    }
                }
            }
        }
    }
    print!("{}", summary(&rows));
    print!("{}", beside_the_peer(&rows));
}

/// One run of the three phases on a freshly opened `store`.
async fn measure(store: &str, concurrency: usize, run: usize, options: &Options) -> Result<Vec<Row>, String> {
    match store {
        "memory" => phases(Arc::new(MemoryTarget::new()), "memory", concurrency, run, options).await,
        "redis" => phases(Arc::new(RedisTarget::open(true).await?), "redis", concurrency, run, options).await,
        "redis-script" => {
            phases(Arc::new(RedisTarget::open(false).await?), "redis-script", concurrency, run, options).await
        }
        "redis-peer" => phases(Arc::new(PeerRedisTarget::open().await?), "redis-peer", concurrency, run, options).await,
        "redis-cached" => {
            phases(Arc::new(CachedRedisTarget::open().await?), "redis-cached", concurrency, run, options).await
        }
        "redis-cluster" => {
            phases(Arc::new(RedisClusterTarget::open(0).await?), "redis-cluster", concurrency, run, options).await
        }
        "redis-cluster-wait" => {
            let target = RedisClusterTarget::open(1).await?;
            phases(Arc::new(target), "redis-cluster-wait", concurrency, run, options).await
        }
        "postgres" => {
            phases(Arc::new(PostgresTarget::open(concurrency).await?), "postgres", concurrency, run, options).await
        }
        "mysql" => phases(Arc::new(MySqlTarget::open(concurrency).await?), "mysql", concurrency, run, options).await,
        "sqlite" => phases(Arc::new(SqliteTarget::open().await?), "sqlite", concurrency, run, options).await,
        other => Err(format!(
            "unknown store {other:?} (expected memory, redis, redis-script, redis-peer, redis-cached, redis-cluster, redis-cluster-wait, \
             postgres, mysql or sqlite)"
        )),
    }
}

async fn phases<T: Target>(
    target: Arc<T>,
    store: &'static str,
    concurrency: usize,
    run: usize,
    options: &Options,
) -> Result<Vec<Row>, String> {
    let tag = format!(
        "{:x}-{run}",
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_micros()
    );
    // Warm-up: connections opened, scripts loaded, caches filled; not timed.
    let warm = drive(&target, Phase::Raw, concurrency, options.warmup, &format!("{tag}w"), &[]).await;
    let warm_first = drive(&target, Phase::First, concurrency, options.warmup, &format!("{tag}w"), &[]).await;
    if warm.ops == 0 || warm_first.ops == 0 {
        return Err(format!(
            "no operation succeeded during the warm-up ({} + {} errors)",
            warm.errors, warm_first.errors
        ));
    }
    // Each phase runs in `--slices` slices, alternating raw, first, replay, so that a burst of
    // load from other processes falls on all three phases alike.
    let slice = Duration::from_secs_f64(options.seconds / options.slices as f64);
    let (mut raw, mut first, mut replay) = (Sample::empty(), Sample::empty(), Sample::empty());
    for i in 0..options.slices {
        let tag = format!("{tag}s{i}");
        raw.absorb(drive(&target, Phase::Raw, concurrency, slice, &tag, &[]).await);
        let fresh = drive(&target, Phase::First, concurrency, slice, &tag, &[]).await;
        let completed = fresh.completed.clone();
        first.absorb(fresh);
        replay.absorb(drive(&target, Phase::Replay, concurrency, slice, &tag, &completed).await);
    }
    for sample in [&mut raw, &mut first, &mut replay] {
        sample.latencies.sort_unstable();
    }
    let rows: Vec<Row> = [(Phase::Raw, raw), (Phase::First, first), (Phase::Replay, replay)]
        .into_iter()
        .map(|(phase, s)| Row {
            store,
            concurrency,
            run,
            phase,
            ops: s.ops,
            errors: s.errors,
            seconds: s.elapsed.as_secs_f64(),
            rate: s.rate(),
            p50_us: s.percentile_us(0.50),
            p99_us: s.percentile_us(0.99),
            client_cpu_us: s.cpu.client * 1e6 / s.ops as f64,
            server_cpu_us: s.cpu.server * 1e6 / s.ops as f64,
            server_cmd_us: s.server_usec / s.ops as f64,
        })
        .collect();
    eprintln!(
        "{store:>8} c={concurrency:<3} run {run}: raw {:>9.0}/s  first {:>9.0}/s  replay {:>9.0}/s{}",
        rows[0].rate,
        rows[1].rate,
        rows[2].rate,
        match rows.iter().map(|r| r.errors).sum::<u64>() {
            0 => String::new(),
            n => format!("  ({n} errors)"),
        }
    );
    Ok(rows)
}

/// Each store and concurrency measured, in the order of their first rows.
fn groups(rows: &[Row]) -> Vec<(&'static str, usize)> {
    let mut groups = Vec::new();
    for row in rows {
        if !groups.contains(&(row.store, row.concurrency)) {
            groups.push((row.store, row.concurrency));
        }
    }
    groups
}

/// Our Redis store beside the peer's (`redis` and `redis-peer`), run by run: each run's rates
/// and ratios to its own raw write, and ours over the peer's. Empty unless both were measured.
fn beside_the_peer(rows: &[Row]) -> String {
    let mut out = String::new();
    let of = |store: &str, concurrency: usize, run: usize, phase: Phase| {
        rows.iter().find(|r| r.store == store && r.concurrency == concurrency && r.run == run && r.phase == phase)
    };
    let concurrencies: Vec<usize> = groups(rows).into_iter().filter(|g| g.0 == "redis-peer").map(|g| g.1).collect();
    for concurrency in concurrencies {
        let _ = writeln!(
            out,
            "\nBeside the peer, c={concurrency}, run by run (each run of ours and of the peer's measured one after \
             the other)\n\n| run | first/s ours | first/s peer | ours ÷ peer | first÷raw ours | first÷raw peer \
             | replay/s ours | replay/s peer | ours ÷ peer | replay÷raw ours | replay÷raw peer |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        let (mut runs, mut ahead_first, mut ahead_replay) = (0, 0, 0);
        for run in rows.iter().map(|r| r.run).collect::<std::collections::BTreeSet<_>>() {
            let phases = |store| [Phase::Raw, Phase::First, Phase::Replay].map(|p| of(store, concurrency, run, p));
            let ([Some(raw), Some(first), Some(replay)], [Some(peer_raw), Some(peer_first), Some(peer_replay)]) =
                (phases("redis"), phases("redis-peer"))
            else {
                continue;
            };
            runs += 1;
            ahead_first += usize::from(first.rate > peer_first.rate);
            ahead_replay += usize::from(replay.rate > peer_replay.rate);
            let _ = writeln!(
                out,
                "| {run} | {:.0} | {:.0} | {:.2} | {:.3} | {:.3} | {:.0} | {:.0} | {:.2} | {:.3} | {:.3} |",
                first.rate,
                peer_first.rate,
                first.rate / peer_first.rate,
                first.rate / raw.rate,
                peer_first.rate / peer_raw.rate,
                replay.rate,
                peer_replay.rate,
                replay.rate / peer_replay.rate,
                replay.rate / raw.rate,
                peer_replay.rate / peer_raw.rate,
            );
        }
        let _ = writeln!(
            out,
            "\nOurs ahead of the peer: first executions in {ahead_first} of {runs} runs, replays in {ahead_replay} of {runs}."
        );
    }
    out
}

/// The Markdown summary: medians over runs; ratios are computed within each run, then the median.
fn summary(rows: &[Row]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n| store | conc. | runs | raw/s | first/s | replay/s | first÷raw (ideal 0.50) | replay÷raw (ideal 1.00) \
         | raw p50/p99 µs | first p50/p99 µs | replay p50/p99 µs | first p50 ÷ 2·raw p50 | replay p50 ÷ raw p50 |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (store, concurrency) in groups(rows) {
        let of = |phase: Phase| -> HashMap<usize, &Row> {
            rows.iter()
                .filter(|r| r.store == store && r.concurrency == concurrency && r.phase == phase)
                .map(|r| (r.run, r))
                .collect()
        };
        let (raw, first, replay) = (of(Phase::Raw), of(Phase::First), of(Phase::Replay));
        let runs: Vec<usize> = raw.keys().copied().collect();
        let med = |set: &HashMap<usize, &Row>, f: &dyn Fn(&Row) -> f64| median(set.values().map(|r| f(r)).collect());
        let ratio = |f: &dyn Fn(usize) -> f64| median(runs.iter().map(|&run| f(run)).collect());
        let _ = writeln!(
            out,
            "| {store} | {concurrency} | {} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {:.2} | {:.2} |",
            runs.len(),
            med(&raw, &|r| r.rate),
            med(&first, &|r| r.rate),
            med(&replay, &|r| r.rate),
            ratio(&|run| first[&run].rate / raw[&run].rate),
            ratio(&|run| replay[&run].rate / raw[&run].rate),
            med(&raw, &|r| r.p50_us),
            med(&raw, &|r| r.p99_us),
            med(&first, &|r| r.p50_us),
            med(&first, &|r| r.p99_us),
            med(&replay, &|r| r.p50_us),
            med(&replay, &|r| r.p99_us),
            ratio(&|run| first[&run].p50_us / (2.0 * raw[&run].p50_us)),
            ratio(&|run| replay[&run].p50_us / raw[&run].p50_us),
        );
    }
    let _ = writeln!(
        out,
        "\nCPU time per operation, µs (median over runs; server: every process of the store's server)\n\n\
         and server CPU by the server's own count (info: Redis `INFO cpu`, only the server under test)\n\n\
         | store | conc. | raw client | raw server | raw info | first client | first server | first info | replay client | replay server | replay info |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (store, concurrency) in groups(rows) {
        let cpu = |phase: Phase, f: fn(&Row) -> f64| {
            median(
                rows.iter()
                    .filter(|r| r.store == store && r.concurrency == concurrency && r.phase == phase)
                    .map(f)
                    .collect(),
            )
        };
        let _ = write!(out, "| {store} | {concurrency} |");
        for phase in [Phase::Raw, Phase::First, Phase::Replay] {
            let _ = write!(
                out,
                " {:.1} | {:.1} | {:.2} |",
                cpu(phase, |r| r.client_cpu_us),
                cpu(phase, |r| r.server_cpu_us),
                cpu(phase, |r| r.server_cmd_us)
            );
        }
        let _ = writeln!(out);
    }
    out
}

// ---- Memory ----

/// The memory store; its raw operation is one insert into a locked shard of a `HashMap`.
struct MemoryTarget {
    store: MemoryStore,
    raw: Vec<Mutex<HashMap<Box<str>, u64>>>,
    hasher: std::hash::RandomState,
}

impl MemoryTarget {
    fn new() -> Self {
        MemoryTarget {
            store: MemoryStore::new(),
            raw: (0..64).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: std::hash::RandomState::new(),
        }
    }
}

impl Target for MemoryTarget {
    const SERVER: Option<&'static str> = None;

    fn call(&self, key: &str) -> impl Future<Output = Result<(), String>> + Send {
        ours(&self.store, key)
    }

    async fn raw(&self, key: &str) -> Result<(), String> {
        let shard = usize::try_from(self.hasher.hash_one(key) % 64).unwrap_or(0);
        let mut map = self.raw[shard].lock().map_err(|e| e.to_string())?;
        map.entry(key.into()).or_insert(0);
        Ok(())
    }
}

// ---- Redis ----

/// The Redis store; its raw operation is `SET key 1 NX PX 600000` on the same connection.
struct RedisTarget {
    store: RedisStore,
    connection: ConnectionManager,
}

impl RedisTarget {
    /// Our store; with `native` false, its completions are the script even where the server has
    /// `SET ... IFEQ` (the store `redis-script`).
    async fn open(native: bool) -> Result<Self, String> {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let store = RedisStore::connect(&url).await.map_err(|e| format!("{url}: {e}"))?.with_native_completion(native);
        let store = store.with_prefix("idempotent-bench:").map_err(|e| e.to_string())?;
        let connection = store.connection();
        Ok(RedisTarget { store, connection })
    }
}

impl Target for RedisTarget {
    const SERVER: Option<&'static str> = Some(REDIS_SERVERS);

    fn call(&self, key: &str) -> impl Future<Output = Result<(), String>> + Send {
        ours(&self.store, key)
    }

    async fn raw(&self, key: &str) -> Result<(), String> {
        redis_raw(&mut self.connection.clone(), key).await
    }

    async fn server_usec(&self) -> Option<f64> {
        let info: String = redis::cmd("INFO").arg("cpu").query_async(&mut self.connection.clone()).await.ok()?;
        Some(info_cpu_usec(&info))
    }
}

/// The same function through the crates.io `idempotent` 0.3.0 crate's Redis store, as its README
/// uses it: claim (`try_insert`, one Lua script), run, record (`complete`, a second script); a
/// replay is one `try_insert` that finds the completed entry. The raw operation is ours, on a
/// connection of its own to the same server.
struct PeerRedisTarget {
    store: peer::store::valkey::ValkeyStore,
    connection: ConnectionManager,
}

impl PeerRedisTarget {
    async fn open() -> Result<Self, String> {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let client = redis::Client::open(url.as_str()).map_err(|e| format!("{url}: {e}"))?;
        let store = peer::store::valkey::ValkeyStore::with_prefix(client, Some("idempotent-bench-peer"))
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let ours = redis::Client::open(url.as_str()).map_err(|e| format!("{url}: {e}"))?;
        let connection = ours.get_connection_manager().await.map_err(|e| format!("{url}: {e}"))?;
        Ok(PeerRedisTarget { store, connection })
    }
}

impl Target for PeerRedisTarget {
    const SERVER: Option<&'static str> = Some(REDIS_SERVERS);

    async fn call(&self, key: &str) -> Result<(), String> {
        use peer::entry::ExistingEntry;
        use peer::fingerprint::{DefaultFingerprintStrategy, FingerprintStrategy as _};
        use peer::store::{IdempotencyStore as _, InsertResult};
        use peer::{CachedResponse, IdempotencyEntry, Metadata};
        let id = peer::IdempotencyKey::new(key).map_err(|e| e.to_string())?;
        // The same request identity our `op` fingerprints: the function and its argument.
        let fingerprint = DefaultFingerprintStrategy.compute("load", key.as_bytes());
        let entry = IdempotencyEntry::new(fingerprint, Duration::from_mins(10));
        match self.store.try_insert(&id, entry.clone()).await.map_err(|e| e.to_string())? {
            InsertResult::Claimed { fencing_token } => {
                let value = key.len() as u64;
                let body = serde_json::to_vec(&value).map_err(|e| e.to_string())?;
                let response = CachedResponse { status_code: 200, metadata: Metadata::default(), body: body.into() };
                self.store.complete(&id, entry.complete(response), fencing_token).await.map_err(|e| e.to_string())
            }
            InsertResult::Exists(ExistingEntry::Completed(done)) => {
                let value: u64 = serde_json::from_slice(&done.response().body).map_err(|e| e.to_string())?;
                if value == key.len() as u64 { Ok(()) } else { Err(format!("replayed {value} for {key}")) }
            }
            InsertResult::Exists(ExistingEntry::Processing(_)) => Err(format!("{key} is still processing")),
        }
    }

    async fn raw(&self, key: &str) -> Result<(), String> {
        redis_raw(&mut self.connection.clone(), key).await
    }

    async fn server_usec(&self) -> Option<f64> {
        let info: String = redis::cmd("INFO").arg("cpu").query_async(&mut self.connection.clone()).await.ok()?;
        Some(info_cpu_usec(&info))
    }
}

/// `SET idempotent-bench-raw:<key> 1 NX PX 600000`, which must succeed (the key is fresh).
async fn redis_raw(connection: &mut impl redis::aio::ConnectionLike, key: &str) -> Result<(), String> {
    let set: redis::Value = redis::cmd("SET")
        .arg(format!("idempotent-bench-raw:{key}"))
        .arg(1)
        .arg("NX")
        .arg("PX")
        .arg(600_000)
        .query_async(connection)
        .await
        .map_err(|e| e.to_string())?;
    match set {
        redis::Value::Okay => Ok(()),
        other => Err(format!("SET NX PX of a fresh key returned {other:?}")),
    }
}

/// Redis Cluster, from `REDIS_CLUSTER_URLS` (comma-separated node URLs); raw `SET NX PX` through
/// the same cluster connection. With `replicas > 0` (`redis-cluster-wait`) each completion waits
/// for that many replicas (`WAIT`). The `/proc` server column counts every `redis-server` process
/// of the machine; the `INFO cpu` column every node of the cluster.
struct RedisClusterTarget {
    store: RedisClusterStore,
    connection: redis::cluster_async::ClusterConnection,
    nodes: Vec<String>,
}

impl RedisClusterTarget {
    async fn open(replicas: u32) -> Result<Self, String> {
        let nodes: Vec<String> = std::env::var("REDIS_CLUSTER_URLS")
            .map_err(|_| "set REDIS_CLUSTER_URLS to the cluster's node URLs, comma-separated".to_owned())?
            .split(',')
            .map(str::to_owned)
            .collect();
        let store = RedisClusterStore::connect_cluster(&nodes).await.map_err(|e| format!("{nodes:?}: {e}"))?;
        let store = store
            .with_prefix("idempotent-bench:")
            .map_err(|e| e.to_string())?
            .with_replica_acks(replicas, Duration::from_secs(1));
        let connection = store.connection();
        Ok(RedisClusterTarget { store, connection, nodes })
    }
}

impl Target for RedisClusterTarget {
    const SERVER: Option<&'static str> = Some(REDIS_SERVERS);

    fn call(&self, key: &str) -> impl Future<Output = Result<(), String>> + Send {
        ours(&self.store, key)
    }

    async fn raw(&self, key: &str) -> Result<(), String> {
        redis_raw(&mut self.connection.clone(), key).await
    }

    async fn server_usec(&self) -> Option<f64> {
        let mut total = 0.0;
        for node in &self.nodes {
            let mut connection =
                redis::Client::open(node.as_str()).ok()?.get_multiplexed_async_connection().await.ok()?;
            let info: String = redis::cmd("INFO").arg("cpu").query_async(&mut connection).await.ok()?;
            total += info_cpu_usec(&info);
        }
        Some(total)
    }
}

/// The Redis store behind a local replay cache large enough for every key of a run; the raw
/// operation is the Redis target's.
struct CachedRedisTarget {
    redis: RedisTarget,
    store: CachedStore<RedisStore>,
}

impl CachedRedisTarget {
    async fn open() -> Result<Self, String> {
        let redis = RedisTarget::open(true).await?;
        let store = CachedStore::new(redis.store.clone()).with_max_entries(8_000_000).with_max_bytes(2 << 30);
        Ok(CachedRedisTarget { redis, store })
    }
}

impl Target for CachedRedisTarget {
    const SERVER: Option<&'static str> = Some(REDIS_SERVERS);

    fn call(&self, key: &str) -> impl Future<Output = Result<(), String>> + Send {
        ours(&self.store, key)
    }

    fn raw(&self, key: &str) -> impl Future<Output = Result<(), String>> + Send {
        self.redis.raw(key)
    }
}

// ---- SQL ----

/// The SQL stores' table; the raw baseline's is `idempotent_bench_raw`.
const TABLE: &str = "idempotent_bench";

/// The connection pool size for `concurrency` tasks (PostgreSQL and MariaDB).
fn pool_size(concurrency: usize) -> u32 {
    u32::try_from(concurrency.min(32)).unwrap_or(32)
}

/// Runs `statements` one after the other on `pool`.
async fn setup<DB: sqlx::Database>(pool: &sqlx::Pool<DB>, statements: &[&str]) -> Result<(), String>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let mut connection = pool.acquire().await.map_err(|e| e.to_string())?;
    for statement in statements {
        sqlx::raw_sql(sqlx::AssertSqlSafe(*statement))
            .execute(&mut *connection)
            .await
            .map_err(|e| format!("{statement}: {e}"))?;
    }
    Ok(())
}

/// PostgreSQL; the raw operation is one `INSERT ... ON CONFLICT DO NOTHING` on the same pool.
struct PostgresTarget {
    store: PostgresStore,
    pool: sqlx::PgPool,
}

impl PostgresTarget {
    async fn open(concurrency: usize) -> Result<Self, String> {
        let url = std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(pool_size(concurrency))
            .connect(&url)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        // Dropped and created anew, so that the table always has the store's current schema.
        setup(&pool, &["DROP TABLE IF EXISTS idempotent_bench, idempotent_bench_raw"]).await?;
        let store = PostgresStore::with_table(pool.clone(), TABLE).map_err(|e| e.to_string())?;
        store.create_table().await.map_err(|e| e.to_string())?;
        setup(&pool, &["CREATE TABLE idempotent_bench_raw (idempotency_key TEXT PRIMARY KEY, value TEXT NOT NULL)"])
            .await?;
        Ok(PostgresTarget { store, pool })
    }
}

impl Target for PostgresTarget {
    const SERVER: Option<&'static str> = Some("postgres");

    fn call(&self, key: &str) -> impl Future<Output = Result<(), String>> + Send {
        ours(&self.store, key)
    }

    async fn raw(&self, key: &str) -> Result<(), String> {
        let insert = sqlx::query(
            "INSERT INTO idempotent_bench_raw (idempotency_key, value) VALUES ($1, $2) \
             ON CONFLICT (idempotency_key) DO NOTHING",
        );
        let done = insert.bind(key).bind("1").execute(&self.pool).await.map_err(|e| e.to_string())?;
        expect_one_row(done.rows_affected())
    }
}

fn expect_one_row(affected: u64) -> Result<(), String> {
    if affected == 1 { Ok(()) } else { Err(format!("the insert of a fresh key affected {affected} rows")) }
}

/// MariaDB/MySQL; the raw operation is its `INSERT ... ON DUPLICATE KEY UPDATE` (MySQL has no
/// `ON CONFLICT`), on the same pool.
struct MySqlTarget {
    store: MySqlStore,
    pool: sqlx::MySqlPool,
}

impl MySqlTarget {
    async fn open(concurrency: usize) -> Result<Self, String> {
        let url = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(pool_size(concurrency))
            .connect(&url)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        // Dropped and created anew, so that the table always has the store's current schema.
        setup(&pool, &["DROP TABLE IF EXISTS idempotent_bench, idempotent_bench_raw"]).await?;
        let store = MySqlStore::with_table(pool.clone(), TABLE).map_err(|e| e.to_string())?;
        store.create_table().await.map_err(|e| e.to_string())?;
        setup(
            &pool,
            &["CREATE TABLE idempotent_bench_raw (idempotency_key VARBINARY(511) NOT NULL PRIMARY KEY, \
               value VARCHAR(16) NOT NULL) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4"],
        )
        .await?;
        Ok(MySqlTarget { store, pool })
    }
}

impl Target for MySqlTarget {
    const SERVER: Option<&'static str> = Some("mariadbd");

    fn call(&self, key: &str) -> impl Future<Output = Result<(), String>> + Send {
        ours(&self.store, key)
    }

    async fn raw(&self, key: &str) -> Result<(), String> {
        let insert = sqlx::query(
            "INSERT INTO idempotent_bench_raw (idempotency_key, value) VALUES (?, ?) \
             ON DUPLICATE KEY UPDATE idempotency_key = idempotency_key",
        );
        let done = insert.bind(key).bind("1").execute(&self.pool).await.map_err(|e| e.to_string())?;
        expect_one_row(done.rows_affected())
    }
}

/// SQLite in a fresh file, with the pool `SqliteStore::open` would build (sqlx's default size);
/// the raw operation is one `INSERT ... ON CONFLICT DO NOTHING` on the same pool.
struct SqliteTarget {
    store: SqliteStore,
    pool: sqlx::SqlitePool,
}

impl SqliteTarget {
    async fn open() -> Result<Self, String> {
        let path = std::env::temp_dir().join("idempotent-bench.db");
        for suffix in ["", "-wal", "-shm"] {
            let mut file = path.clone().into_os_string();
            file.push(suffix);
            let _ = std::fs::remove_file(file);
        }
        let pool = sqlx::SqlitePool::connect_with(SqliteStore::connect_options(&path))
            .await
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let store = SqliteStore::with_table(pool.clone(), TABLE).map_err(|e| e.to_string())?;
        store.create_table().await.map_err(|e| e.to_string())?;
        setup(
            &pool,
            &["CREATE TABLE IF NOT EXISTS idempotent_bench_raw (idempotency_key TEXT PRIMARY KEY, value TEXT NOT NULL)"],
        )
        .await?;
        Ok(SqliteTarget { store, pool })
    }
}

impl Target for SqliteTarget {
    const SERVER: Option<&'static str> = None;

    fn call(&self, key: &str) -> impl Future<Output = Result<(), String>> + Send {
        ours(&self.store, key)
    }

    async fn raw(&self, key: &str) -> Result<(), String> {
        let insert = sqlx::query(
            "INSERT INTO idempotent_bench_raw (idempotency_key, value) VALUES (?1, ?2) \
             ON CONFLICT (idempotency_key) DO NOTHING",
        );
        let done = insert.bind(key).bind("1").execute(&self.pool).await.map_err(|e| e.to_string())?;
        expect_one_row(done.rows_affected())
    }
}

/// CPU time used so far, in seconds: by this process, and by every process named `server`.
///
/// Read from `/proc/<pid>/stat` (user + system time, in clock ticks of 1/100 s). The server's
/// count includes whatever else it served meanwhile (other clients of the same server).
#[derive(Debug, Default, Clone, Copy)]
struct Cpu {
    client: f64,
    server: f64,
}

impl Cpu {
    const TICKS_PER_SECOND: f64 = 100.0;

    fn now(server: Option<&str>) -> Self {
        let client = process_ticks("/proc/self/stat").map_or(f64::NAN, |(_, ticks)| ticks);
        let server = server.map_or(f64::NAN, ticks_of_processes_named);
        Cpu { client: client / Self::TICKS_PER_SECOND, server: server / Self::TICKS_PER_SECOND }
    }

    fn since(self, before: Cpu) -> Cpu {
        Cpu { client: self.client - before.client, server: self.server - before.server }
    }
}

/// Resident memory of this process, from `/proc/self/status`: (`VmRSS`, `VmHWM`) in MiB.
fn rss_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(f64::NAN, |kib| kib / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Peak and current resident memory with `keys` completed keys in a memory store, then after
/// they expired and were purged, then with as many new keys again (is the memory reused?).
async fn memory_rss(keys: u64) {
    const RETENTION: Duration = Duration::from_secs(5);
    let report = |what: &str, store: &MemoryStore| {
        let (rss, hwm) = rss_mib();
        println!("| {what} | {} | {rss:.1} | {hwm:.1} |", store.len());
    };
    // Room for every key (the default bounds would refuse keys long before a million).
    let limits = MemoryLimits::default().max_entries(usize::MAX).max_bytes(usize::MAX);
    let store = MemoryStore::with_limits(limits);
    println!("| moment | entries | VmRSS MiB | VmHWM (peak) MiB |\n|---|---:|---:|---:|");
    report("start", &store);
    let fill = |round: u64| {
        let store = store.clone();
        async move {
            let began = Instant::now();
            for i in 0..keys {
                let key = format!("rss-{round}-{i}");
                Call::new("load", &key)
                    .lease(RETENTION)
                    .retention(RETENTION)
                    .run(&store, async { Ok::<_, Error>(i) })
                    .await
                    .expect("a memory-store call");
            }
            began.elapsed()
        }
    };
    let took = fill(1).await;
    report(&format!("{keys} keys completed (in {:.2} s)", took.as_secs_f64()), &store);
    assert!(took < RETENTION, "filling took longer than the retention; the count above is not all live keys");
    // The last key was completed just now: wait out its retention.
    tokio::time::sleep(RETENTION + Duration::from_millis(200)).await;
    let purged = store.purge_expired().await.expect("purge");
    report(&format!("expired and purged ({purged} entries)"), &store);
    let took = fill(2).await;
    report(&format!("{keys} new keys completed (in {:.2} s)", took.as_secs_f64()), &store);
}
