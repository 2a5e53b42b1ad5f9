#![cfg(all(feature = "http", feature = "sqlite", feature = "postgres"))]
//! Exactly once across a chain of three processes and a SIGKILL: this test (the caller) orders
//! through the shop (`tests/src/bin/chain_shop.rs`, `IdempotencyLayer` on SQLite or PostgreSQL),
//! which pays at the bank (`tests/src/bin/chain_bank.rs`, its own memory store and ledger file)
//! in a `step`, through `IdempotentRetry`.
//!
//! Each run kills the shop with SIGKILL at one point of one order: `bank` (the bank answered, the
//! step is not recorded), `step` (the step is recorded, the order is not), `final` (inside the
//! store's `complete` of the order, before it is sent). Then a new shop process starts on the
//! same store and the caller retries the order with the same key (through `IdempotentRetry`,
//! which waits out the dead shop's claim on `409`). Every order must have exactly one line in the
//! bank's ledger, and every answer must be the one an undisturbed order gets:
//! `{"order": n, "paid": {"order": n, "seq": 1}}`. The bank also logs every request it gets: a
//! recorded step is replayed, so it is asked again only after a `bank` kill (and then with the
//! same derived key, which it replays).
//!
//! `IDEMPOTENT_CHAIN_RUNS` (default 6) is the number of kill runs per store, spread evenly over
//! the three points.

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use idempotent_runtime::client::{IdempotentRetry, RetryPolicy};
use reqwest_middleware::ClientBuilder;
use serde_json::{Value, json};

const POINTS: [&str; 3] = ["bank", "step", "final"];
/// The shop's lease. Shorter leases make runs faster but, on a loaded machine, let a debug-built
/// shop miss its renewals: at 400 ms one PostgreSQL run in 210 lost its claim before recording a step.
const LEASE_MS: u64 = 1000;

/// A child process, killed (SIGKILL) when dropped; its stdout lines arrive on `lines`.
struct Process {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Process {
    fn start(program: &str, args: &[&str]) -> (Process, u16) {
        let mut child = Command::new(program)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the process");
        let stdout = child.stdout.take().expect("its stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut process = Process { child, lines };
        let listening = process.wait_for("LISTENING ");
        let port = listening["LISTENING ".len()..].parse().expect("a port");
        (process, port)
    }

    /// Blocks until a line starting with `prefix` (within 30 s).
    fn wait_for(&mut self, prefix: &str) -> String {
        tokio::task::block_in_place(|| {
            loop {
                let line = self.lines.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|e| {
                    panic!("no line starting with {prefix:?} from the process within 30 s: {e}");
                });
                if line.starts_with(prefix) {
                    return line;
                }
            }
        })
    }

    /// SIGKILL, and wait for the process to be gone.
    fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn runs() -> usize {
    std::env::var("IDEMPOTENT_CHAIN_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(6)
}

/// Runs `runs` kill runs against shops on `store`; returns the kills per point.
async fn chain(store: &str, tag: &str, runs: usize) -> HashMap<&'static str, usize> {
    let dir = idempotent_tests::fresh::temp_dir(tag);
    let ledger = dir.join("bank-ledger");
    let (_bank, bank_port) = Process::start(env!("CARGO_BIN_EXE_chain_bank"), &[ledger.to_str().unwrap()]);
    let (bank_port, lease) = (bank_port.to_string(), LEASE_MS.to_string());
    let shop_args = [store, bank_port.as_str(), lease.as_str()];
    let (mut shop, mut shop_port) = Process::start(env!("CARGO_BIN_EXE_chain_shop"), &shop_args);
    let plain = reqwest::Client::new();
    let policy = RetryPolicy::default()
        .max_attempts(500)
        .backoff(Duration::from_millis(10), Duration::from_millis(100))
        .jitter_seed(3);
    let retrying = ClientBuilder::new(reqwest::Client::new()).with(IdempotentRetry::new(policy)).build();
    let suffix = idempotent_tests::fresh::suffix();
    let mut kills = HashMap::new();
    for run in 0..runs {
        let point = POINTS[run % POINTS.len()];
        let key = format!("order-{suffix}-{run}");
        let body = json!({ "order": run }).to_string();
        let url = format!("http://127.0.0.1:{shop_port}/orders");
        let first = tokio::spawn(
            plain
                .post(&url)
                .header("idempotency-key", &key)
                .header("x-stop-at", point)
                .header("content-type", "application/json")
                .body(body.clone())
                .send(),
        );
        shop.wait_for(&format!("AT {point}"));
        shop.kill();
        *kills.entry(point).or_insert(0) += 1;
        let lost = first.await.expect("the first attempt's task");
        assert!(lost.is_err(), "the killed shop cannot have answered: {lost:?}");
        (shop, shop_port) = Process::start(env!("CARGO_BIN_EXE_chain_shop"), &shop_args);
        let response = retrying
            .post(format!("http://127.0.0.1:{shop_port}/orders"))
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("the retry is answered");
        assert_eq!(response.status(), 200, "run {run} ({point})");
        let answer: Value = serde_json::from_slice(&response.bytes().await.unwrap()).expect("JSON");
        assert_eq!(answer, json!({ "order": run, "paid": { "order": run, "seq": 1 } }), "run {run} ({point})");
    }
    drop(shop);
    let lines = std::fs::read_to_string(&ledger).unwrap_or_default();
    let mut transfers: HashMap<String, usize> = HashMap::new();
    for line in lines.lines() {
        *transfers.entry(line.to_owned()).or_insert(0) += 1;
    }
    for run in 0..runs {
        assert_eq!(transfers.get(&run.to_string()), Some(&1), "order {run}: the bank's ledger {transfers:?}");
    }
    assert_eq!(transfers.len(), runs, "no other transfers: {transfers:?}");
    // The bank is asked again when the step was not recorded (`bank`), and when a shop lost its
    // claim before recording the step (the fence refuses the record; the handler fails and a
    // retry runs it again, with the same derived key): a recorded step is replayed, and its
    // request is not sent again.
    let requests = std::fs::read_to_string(ledger.with_extension("requests")).unwrap_or_default();
    let requests = requests.lines().count();
    let rerun_steps = kills.get("bank").copied().unwrap_or(0);
    assert!(requests >= runs + rerun_steps, "requests at the bank: one per order, plus one per unrecorded step");
    println!("chain on {tag}: {} requests re-sent after a lapsed claim", requests - runs - rerun_steps);
    println!(
        "chain on {tag}: {runs} kill runs {kills:?}, {} transfers for {runs} orders, {requests} requests at the bank",
        lines.lines().count()
    );
    let _ = std::fs::remove_dir_all(dir);
    kills
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_sigkilled_shop_on_sqlite_transfers_once_per_order() {
    let dir = idempotent_tests::fresh::temp_dir("chain-shop-sqlite");
    let store = format!("sqlite:{}", dir.join("shop.db").display());
    let kills = chain(&store, "sqlite", runs()).await;
    assert_eq!(kills.values().sum::<usize>(), runs());
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_sigkilled_shop_on_postgres_transfers_once_per_order() {
    let Some(url) = idempotent_tests::services::postgres_url("chain_sigkilled_shop_on_postgres") else { return };
    let (_store, cleanup) = idempotent_tests::fresh::postgres_at(&url, 2).await.expect("a fresh table");
    let idempotent_tests::fresh::Cleanup::Postgres(_, table) = &cleanup else { unreachable!("a PostgreSQL table") };
    let kills = chain(&format!("postgres:{url}|{table}"), "postgres", runs()).await;
    assert_eq!(kills.values().sum::<usize>(), runs());
    cleanup.run().await;
}
