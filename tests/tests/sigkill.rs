//! A worker process killed with SIGKILL between claim and record (`tests/src/bin/worker.rs`).
//!
//! The worker runs calls for keys `0..KEYS` on a store that outlives it, each body writing one line
//! to a ledger file, and stops inside the body of a random key, where it is killed. Then:
//!
//! 1. the keys it finished replay in this process (their records survived the kill), and their
//!    bodies do not run again;
//! 2. the key it held is `InProgress` until the lease ends (the claim survived the kill too), and
//!    nothing runs it meanwhile;
//! 3. a second worker process, started after the lease, runs the held key once and replays all
//!    others;
//! 4. the ledger holds exactly one line per key: zero double executions.

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const KEYS: u64 = 20;
const LEASE: Duration = Duration::from_millis(2000);

/// Kills the worker if the test ends early.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(store: &str, scope: &str, hold: Option<u64>, ledger: &std::path::Path) -> Worker {
    let hold = hold.map_or_else(|| "none".to_owned(), |h| h.to_string());
    let child = Command::new(env!("CARGO_BIN_EXE_worker"))
        .args([store, scope, &KEYS.to_string(), &hold, &LEASE.as_millis().to_string()])
        .arg(ledger)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the worker");
    Worker(child)
}

/// Reads the worker's lines until one starts with `until` (or it exits); returns them all.
fn read_until(worker: &mut Worker, until: &str, within: Duration) -> Vec<String> {
    let stdout = worker.0.stdout.take().expect("the worker's stdout");
    let until = until.to_owned();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let done = line.starts_with(&until);
            lines.push(line);
            if done {
                break;
            }
        }
        let _ = tx.send(lines);
    });
    rx.recv_timeout(within).expect("the worker did not report in time")
}

fn ledger_counts(ledger: &std::path::Path) -> Vec<usize> {
    let text = std::fs::read_to_string(ledger).unwrap_or_default();
    let mut counts = vec![0; usize::try_from(KEYS).unwrap()];
    for line in text.lines() {
        let key: usize = line.split(' ').next().and_then(|k| k.parse().ok()).expect("a ledger line");
        counts[key] += 1;
    }
    counts
}

/// The whole scenario on one store; `store` is the worker's store argument, `same_store` makes
/// the same store in this process.
async fn scenario<S: idempotent_runtime::Store>(name: &str, store: &str, same_store: &S) {
    let dir = idempotent_tests::fresh::temp_dir("sigkill");
    let ledger = dir.join("ledger.txt");
    let scope = format!("sigkill-{}", idempotent_tests::fresh::suffix());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let hold = u64::from(nanos) % KEYS;

    // 1. The first worker runs keys 0..hold, claims `hold` and is killed inside its body.
    let mut first = spawn(store, &scope, Some(hold), &ledger);
    let lines = read_until(&mut first, "HOLDING", Duration::from_secs(60));
    assert_eq!(lines.last().map(String::as_str), Some(format!("HOLDING {hold}").as_str()), "{lines:?}");
    first.0.kill().expect("SIGKILL the worker");
    let status = first.0.wait().expect("wait for the worker");
    let killed_at = Instant::now();
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "killed by SIGKILL: {status:?}");

    // 2. In this process: finished keys replay; the held key is in progress until its lease ends.
    let ran_here = std::sync::atomic::AtomicU32::new(0);
    for key in 0..=hold {
        let result = idempotent_runtime::Call::new(&scope, &key)
            .lease(LEASE)
            .run(same_store, async {
                ran_here.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, idempotent_runtime::Error>(String::new())
            })
            .await;
        if key < hold {
            assert!(result.as_deref().is_ok_and(|r| r.starts_with(&format!("receipt {key} by "))), "{key}: {result:?}");
        } else {
            assert!(
                matches!(result, Err(idempotent_runtime::Error::InProgress { .. })) || killed_at.elapsed() >= LEASE,
                "the killed worker's claim on {key} must hold until its lease ends: {result:?}"
            );
        }
    }
    assert_eq!(ran_here.into_inner(), 0, "no body ran in the test process");

    // 3. After the lease, a second worker runs the held key once and replays the others.
    tokio::time::sleep(LEASE.saturating_sub(killed_at.elapsed()) + Duration::from_millis(200)).await;
    let mut second = spawn(store, &scope, None, &ledger);
    let lines = read_until(&mut second, "FINISHED", Duration::from_secs(60));
    let ran: Vec<&String> = lines.iter().filter(|l| l.starts_with("RAN ")).collect();
    let replayed = lines.iter().filter(|l| l.starts_with("REPLAYED ")).count();
    let other: Vec<&String> =
        lines.iter().filter(|l| !l.starts_with("RAN ") && !l.starts_with("REPLAYED ") && *l != "FINISHED").collect();
    assert!(other.is_empty(), "the second worker saw {other:?}");
    let expected_ran: Vec<String> = (hold..KEYS).map(|k| format!("RAN {k}")).collect();
    assert_eq!(ran, expected_ran.iter().collect::<Vec<_>>(), "the held key and the keys after it run once");
    assert_eq!(replayed as u64, hold, "every key the killed worker finished is replayed");

    // 4. One side effect per key.
    let counts = ledger_counts(&ledger);
    let doubles: usize = counts.iter().map(|c| c.saturating_sub(1)).sum();
    let missing = counts.iter().filter(|c| **c == 0).count();
    println!(
        "SIGKILL {name}: {KEYS} keys, worker killed holding key {hold}; replayed after the kill {hold}, \
         held key in progress until the lease ({} ms), run once after it; double executions {doubles}, \
         lost records {}, keys never run {missing}",
        LEASE.as_millis(),
        u64::from(replayed as u64 != hold),
    );
    assert_eq!(counts, vec![1; usize::try_from(KEYS).unwrap()], "one ledger line per key");
    let _ = std::fs::remove_dir_all(dir);
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_worker_sigkilled_between_claim_and_record() {
    let dir = idempotent_tests::fresh::temp_dir("sigkill-db");
    let path = dir.join("idempotency.db");
    let store = idempotent_runtime::stores::sql::SqliteStore::open(&path).await.expect("open SQLite");
    scenario("sqlite", &format!("sqlite:{}", path.display()), &store).await;
    store.pool().close().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_worker_sigkilled_between_claim_and_record() {
    let Some(url) = idempotent_tests::services::postgres_url("postgres_worker_sigkilled_between_claim_and_record")
    else {
        return;
    };
    let (store, cleanup) = idempotent_tests::fresh::postgres_at(&url, 4).await.expect("a fresh table");
    scenario("postgres", &format!("postgres:{url}|{}", store.table()), &store).await;
    cleanup.run().await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_worker_sigkilled_between_claim_and_record() {
    let Some(url) = idempotent_tests::services::redis_url("redis_worker_sigkilled_between_claim_and_record") else {
        return;
    };
    let (store, cleanup) = idempotent_tests::fresh::redis_at(&url).await;
    scenario("redis", &format!("redis:{url}|{}", store.prefix()), &store).await;
    cleanup.run().await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_worker_sigkilled_between_claim_and_record() {
    let Some(url) = idempotent_tests::services::mysql_url("mysql_worker_sigkilled_between_claim_and_record") else {
        return;
    };
    let (store, cleanup) = idempotent_tests::fresh::mysql_at(&url, 4).await.expect("a fresh table");
    scenario("mysql", &format!("mysql:{url}|{}", store.table()), &store).await;
    cleanup.run().await;
}
