//! A worker process for the SIGKILL test (`tests/tests/sigkill.rs`): it runs idempotent calls for
//! keys `0..keys` on a store that outlives it, writing each body's side effect as a line in a
//! ledger file, and stops inside the body of key `hold` (after the claim, before the record) to be
//! killed there.
//!
//! ```text
//! worker <store> <scope> <keys> <hold> <lease-ms> <ledger-file>
//!   <store>: sqlite:<path> | postgres:<url>|<table> | mysql:<url>|<table> | redis:<url>|<prefix>
//!   <hold>:  the key to stop in, or `none`
//! ```
//!
//! It prints one line per key: `RAN k`, `REPLAYED k`, `BUSY k <ms>` (in progress elsewhere, lease
//! left), `FAILED k <error>`, or `HOLDING k` before it waits to be killed; then `FINISHED`.

use std::io::Write as _;
use std::time::Duration;

use idempotent_runtime::{Call, Error, Store};

fn usage() -> ! {
    eprintln!("usage: worker <store> <scope> <keys> <hold|none> <lease-ms> <ledger-file>");
    std::process::exit(2);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [store, scope, keys, hold, lease, ledger] = args.as_slice() else { usage() };
    let keys: u64 = keys.parse().unwrap_or_else(|_| usage());
    let hold: Option<u64> = if hold == "none" { None } else { Some(hold.parse().unwrap_or_else(|_| usage())) };
    let lease = Duration::from_millis(lease.parse().unwrap_or_else(|_| usage()));
    let job = Job { scope: scope.clone(), keys, hold, lease, ledger: ledger.into() };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a Tokio runtime");
    runtime.block_on(job.on(store));
    println!("FINISHED");
}

struct Job {
    scope: String,
    keys: u64,
    hold: Option<u64>,
    lease: Duration,
    ledger: std::path::PathBuf,
}

impl Job {
    async fn on(&self, spec: &str) {
        let (kind, rest) = spec.split_once(':').unwrap_or_else(|| usage());
        match kind {
            #[cfg(feature = "sqlite")]
            "sqlite" => {
                let store = idempotent_runtime::stores::sql::SqliteStore::open(rest).await.expect("open SQLite");
                self.run(&store).await;
            }
            #[cfg(feature = "postgres")]
            "postgres" => {
                let (url, table) = rest.rsplit_once('|').unwrap_or_else(|| usage());
                let pool = idempotent_runtime::stores::sql::sqlx::PgPool::connect(url).await.expect("connect");
                let store = idempotent_runtime::stores::sql::PostgresStore::with_table(pool, table).expect("table");
                self.run(&store).await;
            }
            #[cfg(feature = "mysql")]
            "mysql" => {
                let (url, table) = rest.rsplit_once('|').unwrap_or_else(|| usage());
                let pool = idempotent_runtime::stores::sql::sqlx::MySqlPool::connect(url).await.expect("connect");
                let store = idempotent_runtime::stores::sql::MySqlStore::with_table(pool, table).expect("table");
                self.run(&store).await;
            }
            #[cfg(feature = "redis")]
            "redis" => {
                let (url, prefix) = rest.rsplit_once('|').unwrap_or_else(|| usage());
                let store = idempotent_runtime::RedisStore::connect(url).await.expect("connect").with_prefix(prefix);
                self.run(&store.expect("prefix")).await;
            }
            other => {
                eprintln!("worker: store kind {other:?} is not built into this binary");
                std::process::exit(2);
            }
        }
    }

    async fn run<S: Store>(&self, store: &S) {
        for key in 0..self.keys {
            let ran = std::cell::Cell::new(false);
            let result = Call::new(&self.scope, &key)
                .lease(self.lease)
                .run(store, async {
                    ran.set(true);
                    if self.hold == Some(key) {
                        println!("HOLDING {key}");
                        std::future::pending::<()>().await;
                    }
                    self.side_effect(key);
                    Ok::<_, Error>(format!("receipt {key} by {}", std::process::id()))
                })
                .await;
            match result {
                Ok(_) if ran.get() => println!("RAN {key}"),
                Ok(_) => println!("REPLAYED {key}"),
                Err(Error::InProgress { retry_after, .. }) => {
                    println!("BUSY {key} {}", retry_after.unwrap_or_default().as_millis());
                }
                Err(e) => println!("FAILED {key} {e}"),
            }
        }
    }

    /// The body's effect: one line in the ledger, on disk before the body returns.
    fn side_effect(&self, key: u64) {
        let mut file =
            std::fs::OpenOptions::new().create(true).append(true).open(&self.ledger).expect("open the ledger");
        writeln!(file, "{key} {}", std::process::id()).expect("write the ledger");
        file.sync_data().expect("sync the ledger");
    }
}
