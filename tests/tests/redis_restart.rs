#![cfg(feature = "redis")]
//! The Redis store through a real server restart, with the same store object throughout.
//!
//! This stops the shared Redis server, so it lives in its own test binary: cargo runs test
//! binaries one after another, and no other Redis test runs while the server is down.
//!
//! The test server runs without persistence, so the shutdown saves a snapshot (`SHUTDOWN SAVE`)
//! that the restarted server loads: what was recorded before the outage must still replay, and a
//! body that finished during it is recorded by its completion, retried until the server is back.
//! The snapshot file is deleted once the server is back, so later restarts start empty as before.

use std::collections::HashMap;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idempotent_runtime::stores::redis::{RedisStore, redis};
use idempotent_runtime::{Error, idempotent};
use idempotent_tests::services::{redis_answers_pong, redis_port, redis_start_args};

/// Where the test server keeps its snapshot (`--dir` below, default `dbfilename`).
const SNAPSHOT: &str = "/var/lib/redis/dump.rdb";

fn redis_answers() -> bool {
    redis_answers_pong(redis_port())
}

fn wait_until(up: bool, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if redis_answers() == up {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// Starts the server (it loads the snapshot, if any), then deletes the snapshot.
fn start_redis() -> bool {
    if !redis_answers() {
        let _ = Command::new("redis-server").args(redis_start_args()).status();
    }
    let up = wait_until(true, Duration::from_secs(15));
    let _ = std::fs::remove_file(SNAPSHOT);
    up
}

fn stop_redis_with_snapshot() {
    let out = Command::new("redis-cli").args(["-p", &redis_port().to_string(), "shutdown", "save"]).output();
    // A successful shutdown closes the connection without a reply; only check that it is down.
    drop(out);
    assert!(wait_until(false, Duration::from_secs(15)), "redis-server did not stop");
}

/// Restarts Redis when dropped, so a failing assertion cannot leave the server down for the
/// tests that run after this one.
struct RestartOnDrop;

impl Drop for RestartOnDrop {
    fn drop(&mut self) {
        if !start_redis() {
            eprintln!("*** redis_survives_server_restart could not restart Redis; start it by hand ***");
        }
    }
}

#[derive(Debug)]
enum PayError {
    Idempotency(Error),
}

impl From<Error> for PayError {
    fn from(error: Error) -> Self {
        PayError::Idempotency(error)
    }
}

#[derive(Default)]
struct Ledger(Mutex<HashMap<u32, u32>>);

impl Ledger {
    fn hit(&self, key: u32) {
        *self.0.lock().unwrap().entry(key).or_default() += 1;
    }

    fn count(&self, key: u32) -> u32 {
        self.0.lock().unwrap().get(&key).copied().unwrap_or(0)
    }
}

#[idempotent(key = order, store = store, scope = "restart", retention = "60s")]
async fn charge(store: &RedisStore, ledger: &Ledger, order: u32) -> Result<u32, PayError> {
    ledger.hit(order);
    Ok(order * 10)
}

/// Claims, says so on `started`, then waits for `gate` before finishing, so the server can die
/// while the body runs.
#[idempotent(key = order, store = store, scope = "restart", lease = "30s", retention = "60s")]
async fn charge_slowly(
    store: &RedisStore,
    ledger: &Ledger,
    order: u32,
    started: tokio::sync::oneshot::Sender<()>,
    gate: tokio::sync::oneshot::Receiver<()>,
) -> Result<u32, PayError> {
    ledger.hit(order);
    let _ = started.send(());
    let _ = gate.await;
    Ok(order * 10)
}

fn is_store_error<T: std::fmt::Debug>(result: &Result<T, PayError>) -> bool {
    matches!(result, Err(PayError::Idempotency(Error::Store { .. })))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_survives_server_restart() {
    let Some(url) = idempotent_tests::services::redis_url("redis_survives_server_restart") else { return };
    if !idempotent_tests::services::programs_installed("redis_survives_server_restart", &["redis-server"]) {
        return;
    }
    let _restart = RestartOnDrop;
    let prefix = format!("idempotent-test:{}:", uuid::Uuid::new_v4().simple());
    let store = RedisStore::connect(&url).await.unwrap().with_prefix(prefix.clone()).unwrap();
    let ledger = Ledger::default();

    assert_eq!(charge(&store, &ledger, 1).await.unwrap(), 10);

    // Order 2 claims while Redis is up; its body finishes while Redis is down.
    let (open_gate, gate) = tokio::sync::oneshot::channel();
    let (started, claimed) = tokio::sync::oneshot::channel();
    let slow = {
        let store = store.clone();
        tokio::spawn(async move {
            let ledger = Ledger::default();
            let result = charge_slowly(&store, &ledger, 2, started, gate).await;
            (result, ledger.count(2))
        })
    };
    claimed.await.expect("order 2 claims and starts its body");

    stop_redis_with_snapshot();
    let outage = Instant::now();

    // During the outage: typed store errors, and no body runs.
    for order in [1, 3, 4] {
        let before = ledger.count(order);
        let started = Instant::now();
        let result = charge(&store, &ledger, order).await;
        assert!(is_store_error(&result), "order {order} during the outage: expected Error::Store, got {result:?}");
        assert_eq!(ledger.count(order), before, "order {order}: the body must not run during the outage");
        eprintln!("order {order} failed after {:?}: {:?}", started.elapsed(), result.unwrap_err());
    }

    // The body that claimed before the outage finishes now. Its completion cannot reach Redis, so
    // it is retried (within the 30 s lease) while the server is down.
    open_gate.send(()).unwrap();

    // Outlast the manager's reconnection attempts, so that the restart finds it holding a failed
    // connection: calls after the restart must still succeed.
    tokio::time::sleep(Duration::from_secs(3)).await;
    eprintln!("outage lasted {:?} before restart", outage.elapsed());
    assert!(start_redis(), "redis-server did not come back");

    // The retried completion lands once Redis is back: the caller gets its result, recorded.
    let (result, runs) = slow.await.unwrap();
    assert_eq!(result.unwrap(), 20, "the body ran once and its caller gets its result");
    assert_eq!(runs, 1);

    // The same store works again: what was recorded before the outage replays.
    let started = Instant::now();
    assert_eq!(charge(&store, &ledger, 1).await.unwrap(), 10, "order 1 replays after the restart");
    eprintln!("first call after the restart took {:?}", started.elapsed());
    assert_eq!(ledger.count(1), 1);

    // Order 2 was recorded by the completion retried across the outage: a duplicate replays it and
    // never runs the body again.
    let mut raw = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let record: Option<Vec<u8>> =
        redis::cmd("GET").arg(format!("{prefix}restart:2")).query_async(&mut raw).await.unwrap();
    let record = String::from_utf8_lossy(record.as_deref().unwrap_or_default()).into_owned();
    assert!(
        record.starts_with("idempotent/1 done "),
        "the completion retried across the outage is recorded: {record:?}"
    );
    assert_eq!(charge(&store, &ledger, 2).await.unwrap(), 20, "order 2 replays its recorded result");
    assert_eq!(ledger.count(2), 0, "order 2's body never runs again");

    // New keys run once and replay.
    assert_eq!(charge(&store, &ledger, 3).await.unwrap(), 30);
    assert_eq!(charge(&store, &ledger, 3).await.unwrap(), 30);
    assert_eq!(ledger.count(3), 1, "order 3 runs once after the restart");

    let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{prefix}*")).query_async(&mut raw).await.unwrap();
    for key in keys {
        let _: () = redis::cmd("DEL").arg(key).query_async(&mut raw).await.unwrap();
    }
}

/// Stops the private server of `redis_paused_server_gives_a_timeout_error` when dropped.
struct ShutdownOnDrop(u16);

impl Drop for ShutdownOnDrop {
    fn drop(&mut self) {
        let _ = Command::new("redis-cli").args(["-p", &self.0.to_string(), "shutdown", "nosave"]).output();
    }
}

/// A server that stops answering mid-run (here: a private server under `CLIENT PAUSE`, so the
/// shared one is not disturbed) gives a typed timeout error after the response timeout, and the
/// same store works once it answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_server_gives_a_timeout_error() {
    use idempotent_runtime::stores::redis::DEFAULT_RESPONSE_TIMEOUT;
    use idempotent_runtime::{Claim, ClaimRequest, Key, Store, StoreError, Token};

    if !idempotent_tests::services::programs_installed("redis_paused_server_gives_a_timeout_error", &["redis-server"]) {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let port_text = port.to_string();
    let _shutdown = ShutdownOnDrop(port);
    let status = Command::new("redis-server")
        .args(["--daemonize", "yes", "--bind", "127.0.0.1", "--port", &port_text, "--save", "", "--appendonly", "no"])
        .args(["--dir", "/tmp", "--logfile", "", "--pidfile", &format!("/tmp/idempotent-test-redis-{port}.pid")])
        .status()
        .unwrap();
    assert!(status.success(), "could not start a private redis-server on port {port}");
    let url = format!("redis://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let store = loop {
        match RedisStore::connect(&url).await {
            Ok(store) => break store,
            Err(e) => assert!(Instant::now() < deadline, "private redis-server does not answer: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let claim = |name: &'static str| {
        let store = store.clone();
        async move {
            let key = Key::new("paused", &name).unwrap();
            let token = Token::new();
            store.claim(&ClaimRequest::new(&key, &token, None, Duration::from_secs(30))).await
        }
    };
    assert_eq!(claim("before").await.unwrap(), Claim::Claimed);

    let mut raw = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let pause = DEFAULT_RESPONSE_TIMEOUT + Duration::from_secs(1);
    let pause_ms = u64::try_from(pause.as_millis()).unwrap();
    let _: () = redis::cmd("CLIENT").arg("PAUSE").arg(pause_ms).arg("ALL").query_async(&mut raw).await.unwrap();
    let paused_at = Instant::now();
    let result = claim("during").await;
    let waited = paused_at.elapsed();
    eprintln!("paused server: failed after {waited:?} with {result:?}");
    assert!(matches!(result, Err(StoreError::Backend { backend: "redis", .. })), "{result:?}");
    assert!(waited + Duration::from_millis(100) >= DEFAULT_RESPONSE_TIMEOUT && waited < pause, "{waited:?}");

    tokio::time::sleep(pause.saturating_sub(paused_at.elapsed()) + Duration::from_millis(200)).await;
    assert_eq!(claim("after").await.unwrap(), Claim::Claimed, "the same store works once the server answers");
}
