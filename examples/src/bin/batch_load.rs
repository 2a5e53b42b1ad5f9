//! What a batched step saves: a window of fresh keys claimed and recorded with
//! `Store::claim_many` and `Store::complete_many` (on PostgreSQL one statement each, on Redis one
//! pipeline each), beside the same window run as a consumer runs it today, each key its own
//! `claim` then `complete`, all of the window's keys at once.
//!
//! For each run and window size, the two modes take turns (their order swaps every run), each for
//! `--seconds`: windows of fresh keys, one after another, until the time is up. It prints the
//! keys per second, the ratio of the two modes within each run, and the CPU time per key of this
//! program and of the store's server (PostgreSQL's processes, all of them, from `/proc`; Redis's
//! own `INFO cpu`), as medians over the runs, with the load average at the start and the end.
//!
//! ```text
//! cargo run --release -p idempotent-examples --bin batch_load -- --runs 5 --seconds 5 --windows 16,64
//! cargo run --release -p idempotent-examples --bin batch_load -- --store redis
//! ```
//!
//! The servers come from `POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`) and
//! `REDIS_URL` (default `redis://127.0.0.1:6379/15`). PostgreSQL: the table
//! `idempotent_batch_load` is dropped and created before each run, and the pool holds as many
//! connections as the window has keys, built with `test_before_acquire(false)`, as the consumer
//! benchmarks build theirs. Redis: the database is emptied (`FLUSHDB`) before each run; the
//! store multiplexes every call over one connection.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use idempotent_examples::measure::{median, process_ticks, ticks_of_processes_named};
use idempotent_runtime::stores::redis::{RedisStore, redis};
use idempotent_runtime::stores::sql::{PostgresStore, sqlx};
use idempotent_runtime::{Claim, ClaimRequest, Completion, Key, Store, Token};

const TABLE: &str = "idempotent_batch_load";
const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(600);
const OUTCOME: &[u8] = br#"{"Ok":null}"#;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Mode {
    /// Each key its own claim, then its own completion; the window's keys concurrently.
    Single,
    /// `claim_many`, then `complete_many`.
    Batch,
}

/// One phase's figures: keys per second, and CPU microseconds per key of this program and of
/// the store's server.
#[derive(Debug, Clone, Copy)]
struct Phase {
    keys_per_second: f64,
    program_us: f64,
    server_us: f64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut runs = 5;
    let mut seconds = 5.0;
    let mut windows = vec![16, 64];
    let mut server = Server::Postgres;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--runs" => runs = value()?.parse()?,
            "--seconds" => seconds = value()?.parse()?,
            "--windows" => windows = value()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--store" => {
                server = match value()?.as_str() {
                    "postgres" => Server::Postgres,
                    "redis" => Server::Redis,
                    other => return Err(format!("unknown store {other}; use postgres or redis").into()),
                }
            }
            other => {
                return Err(format!(
                    "unknown argument {other}; use --runs N --seconds S --windows 16,64 --store postgres|redis"
                )
                .into());
            }
        }
    }
    println!("load average at start: {}", loadavg());

    let mut phases: BTreeMap<(usize, Mode), Vec<Phase>> = BTreeMap::new();
    let mut ratios: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for run in 0..runs {
        for &window in &windows {
            let order = if run % 2 == 0 { [Mode::Single, Mode::Batch] } else { [Mode::Batch, Mode::Single] };
            let mut rates = BTreeMap::new();
            for mode in order {
                let scope = format!("r{run}-{mode:?}");
                let phase = match server {
                    Server::Postgres => {
                        let (store, pool) = postgres(window, mode == order[0]).await?;
                        let phase = measure(&store, server, mode, window, &scope, seconds).await?;
                        pool.close().await;
                        phase
                    }
                    Server::Redis => {
                        measure(&redis(mode == order[0]).await?, server, mode, window, &scope, seconds).await?
                    }
                };
                println!(
                    "run {run} window {window:>3} {mode:?}: {:.0} keys/s, {:.1} µs this program, {:.1} µs {} per key",
                    phase.keys_per_second,
                    phase.program_us,
                    phase.server_us,
                    server.name()
                );
                rates.insert(mode, phase.keys_per_second);
                phases.entry((window, mode)).or_default().push(phase);
            }
            ratios.entry(window).or_default().push(rates[&Mode::Batch] / rates[&Mode::Single]);
        }
    }

    println!(
        "\n| window | mode | keys/s | batch ÷ single (per run) | CPU µs per key: this program, {} |",
        server.name()
    );
    println!("|---:|---|---:|---|---|");
    for ((window, mode), phases) in &phases {
        let of = |f: fn(&Phase) -> f64| median(phases.iter().map(f).collect());
        let ratio = match mode {
            Mode::Single => "1".to_owned(),
            Mode::Batch => {
                let per_run: Vec<String> = ratios[window].iter().map(|r| format!("{r:.2}")).collect();
                format!("**{:.2}** ({})", median(ratios[window].clone()), per_run.join(", "))
            }
        };
        println!(
            "| {window} | {} | {:.0} | {ratio} | {:.1}, {:.1} |",
            match mode {
                Mode::Single => "one claim and one completion per key",
                Mode::Batch => "claim_many, complete_many",
            },
            of(|p| p.keys_per_second),
            of(|p| p.program_us),
            of(|p| p.server_us)
        );
    }
    println!("\nload average at end: {}", loadavg());
    Ok(())
}

/// The store under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    Postgres,
    Redis,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Server::Postgres => "PostgreSQL",
            Server::Redis => "Redis",
        }
    }

    /// The command name of the server's processes in `/proc`.
    fn process(self) -> &'static str {
        match self {
            Server::Postgres => "postgres",
            Server::Redis => "redis-server",
        }
    }
}

/// A PostgreSQL store on a pool of `window` connections, on the table made afresh when `fresh`.
async fn postgres(window: usize, fresh: bool) -> Result<(PostgresStore, sqlx::PgPool), Box<dyn std::error::Error>> {
    let url = std::env::var("POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(window)?)
        .test_before_acquire(false)
        .connect(&url)
        .await?;
    if fresh {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {TABLE}"))).execute(&pool).await?;
    }
    let store = PostgresStore::with_table(pool.clone(), TABLE)?;
    store.create_table().await?;
    Ok((store, pool))
}

/// A Redis store, on its database emptied when `fresh`.
async fn redis(fresh: bool) -> Result<RedisStore, Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/15".to_owned());
    let store = RedisStore::connect(&url).await?;
    if fresh {
        let () = redis::cmd("FLUSHDB").query_async(&mut store.connection()).await?;
    }
    Ok(store)
}

/// Runs windows of `window` fresh keys in `mode` for `seconds` (after one untimed window).
async fn measure(
    store: &impl Store,
    server: Server,
    mode: Mode,
    window: usize,
    scope: &str,
    seconds: f64,
) -> Result<Phase, Box<dyn std::error::Error>> {
    let mut next = 0;
    let mut keys = move || {
        let keys: Result<Vec<Key>, _> = (next..next + window).map(|i| Key::new(scope, &i)).collect();
        next += window;
        keys
    };
    run_window(store, mode, &keys()?).await?;
    let (program, serving) = ticks(server);
    let started = Instant::now();
    let mut done = 0;
    while started.elapsed().as_secs_f64() < seconds {
        run_window(store, mode, &keys()?).await?;
        done += window;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let (program_after, serving_after) = ticks(server);
    // Ticks are 1/100 s: microseconds per key.
    let per_key = |ticks: f64| ticks * 10_000.0 / done as f64;
    Ok(Phase {
        keys_per_second: done as f64 / elapsed,
        program_us: per_key(program_after - program),
        server_us: per_key(serving_after - serving),
    })
}

/// Claims and records `keys`, each once, with fresh tokens.
async fn run_window(store: &impl Store, mode: Mode, keys: &[Key]) -> Result<(), Box<dyn std::error::Error>> {
    let tokens: Vec<Token> = keys.iter().map(|_| Token::new()).collect();
    let requests: Vec<ClaimRequest<'_>> =
        keys.iter().zip(&tokens).map(|(key, token)| ClaimRequest::new(key, token, None, LEASE)).collect();
    let completions: Vec<Completion<'_>> =
        keys.iter().zip(&tokens).map(|(key, token)| Completion::new(key, token, None, OUTCOME, RETENTION)).collect();
    match mode {
        Mode::Single => {
            let each = requests.iter().zip(&completions).map(|(request, completion)| async move {
                match store.claim(request).await? {
                    Claim::Claimed => store.complete(completion).await,
                    other => Err(idempotent_runtime::StoreError::Corrupt(format!("a fresh key answered {other:?}"))),
                }
            });
            join_all(each).await.into_iter().collect::<Result<Vec<()>, _>>()?;
        }
        Mode::Batch => {
            for claim in store.claim_many(&requests).await? {
                if claim? != Claim::Claimed {
                    return Err("a fresh key was not claimed".into());
                }
            }
            store.complete_many(&completions).await?.into_iter().collect::<Result<Vec<()>, _>>()?;
        }
    }
    Ok(())
}

/// CPU ticks so far of this program and of every process of the server.
fn ticks(server: Server) -> (f64, f64) {
    let program = process_ticks("/proc/self/stat").map_or(f64::NAN, |(_, ticks)| ticks);
    (program, ticks_of_processes_named(server.process()))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(|e| format!("unknown ({e})"), |l| l.trim().to_owned())
}
