#![cfg(feature = "http")]
//! A chain of services, in one process: an idempotent body (the "shop") that calls a "bank" over
//! HTTP through `IdempotentRetry`, and is run again for the same key. The bank is a real axum
//! server under `IdempotencyLayer` on 127.0.0.1 whose own ledger counts transfers and notes every
//! key it got.
//!
//! - Derived keys: every re-run of the body (after a released `Err`, after a lost claim) sends
//!   the same downstream keys in the same order, so the bank transfers once; an explicit key
//!   wins; the opt-outs get fresh keys.
//! - Steps: a step finished by an earlier run is replayed, not run again, on the memory store, an
//!   SQLite file, PostgreSQL and inside an SQLite transaction; its record obeys the fingerprint;
//!   outside a body it is a typed error; a step's claim left by a run that died inside the step
//!   is waited out, and the next run does the step.
//!
//! The process-level proof (SIGKILL at chosen points) is `tests/tests/chain_sigkill.rs`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idempotent_runtime::client::{IdempotentRetry, RetryPolicy};
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::{Call, Error, MemoryStore, Store, derived_key, step, without_derived_keys};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use serde_json::{Value, json};

/// The bank's own books: transfers made (handler runs) and the key of every request it got.
#[derive(Clone, Default)]
struct Ledger {
    transfers: Arc<AtomicUsize>,
    keys: Arc<Mutex<Vec<String>>>,
}

impl Ledger {
    fn transfers(&self) -> usize {
        self.transfers.load(Ordering::SeqCst)
    }

    fn keys(&self) -> Vec<String> {
        self.keys.lock().unwrap().clone()
    }
}

async fn note_key(State(ledger): State<Ledger>, request: Request, next: Next) -> Response {
    let key = request.headers().get("idempotency-key").map(|v| v.to_str().unwrap().to_owned());
    ledger.keys.lock().unwrap().push(key.unwrap_or_default());
    next.run(request).await
}

async fn transfer(State(ledger): State<Ledger>) -> Response {
    let n = ledger.transfers.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, axum::Json(json!({ "transfer": n }))).into_response()
}

/// The bank on a free port: `POST /transfers` and `POST /notices`, each under the idempotency layer.
async fn bank(ledger: &Ledger) -> SocketAddr {
    let app = Router::new()
        .route("/transfers", post(transfer))
        .route("/notices", post(transfer))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).keys_shared_by_all_callers().scope("bank"))
        .layer(axum::middleware::from_fn_with_state(ledger.clone(), note_key))
        .with_state(ledger.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free port");
    let addr = listener.local_addr().expect("the bound address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("the bank runs") });
    addr
}

fn client() -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new()).with(IdempotentRetry::new(RetryPolicy::default().jitter_seed(1))).build()
}

async fn send_to(client: &ClientWithMiddleware, url: String) -> Result<Value, Error> {
    let response = client.post(url).body("{}").send().await.expect("the bank answers");
    assert!(response.status().is_success(), "{}", response.status());
    Ok(serde_json::from_slice(&response.bytes().await.expect("the body arrives")).expect("JSON"))
}

fn is_uuid(text: &str) -> bool {
    uuid::Uuid::parse_str(text).is_ok()
}

#[tokio::test]
async fn chain_http_client_rerun_after_a_released_err_sends_the_same_downstream_keys() {
    let ledger = Ledger::default();
    let addr = bank(&ledger).await;
    let client = client();
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    let order = || {
        Call::new("chain-shop", "order-1").run(&store, async {
            let transfer = send_to(&client, format!("http://{addr}/transfers")).await?;
            let notice = send_to(&client, format!("http://{addr}/notices")).await?;
            if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(Error::InvalidKey(idempotent_runtime::KeyError::Empty)); // released
            }
            Ok(json!({ "transfer": transfer, "notice": notice }))
        })
    };
    assert!(order().await.is_err(), "the first run fails after both calls, and releases the key");
    let answer = order().await.expect("the second run succeeds");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the body ran twice");
    let keys = ledger.keys();
    assert_eq!(keys.len(), 4, "{keys:?}");
    assert_eq!(keys[0], keys[2], "the re-run's first request has the first run's key");
    assert_eq!(keys[1], keys[3], "and its second request too");
    assert_ne!(keys[0], keys[1], "two requests of one run have two keys");
    assert!(keys.iter().all(|k| k.len() == 64 && !is_uuid(k)), "derived, not random: {keys:?}");
    assert_eq!(ledger.transfers(), 2, "the bank acted once per request, not once per run");
    assert_eq!(answer, json!({ "transfer": { "transfer": 1 }, "notice": { "transfer": 2 } }));
}

#[tokio::test]
async fn chain_http_client_takeover_after_a_lost_claim_sends_the_same_downstream_keys() {
    let ledger = Ledger::default();
    let addr = bank(&ledger).await;
    let client = client();
    let store = MemoryStore::new();
    let (sent, got) = tokio::sync::oneshot::channel();
    // The first run calls the bank, then hangs; it is dropped (like a process that died): its
    // claim stays until its lease ends (OnCancel::Keep).
    let first = Call::new("chain-shop", "order-2").lease(Duration::from_millis(200)).run(&store, async {
        let transfer = send_to(&client, format!("http://{addr}/transfers")).await?;
        let _ = sent.send(transfer);
        std::future::pending::<()>().await;
        Ok::<_, Error>(Value::Null)
    });
    let mut first = Box::pin(first);
    let first_transfer = tokio::select! {
        ended = &mut first => panic!("the first run hangs after the bank call: {ended:?}"),
        transfer = got => transfer.expect("the first run reached the bank"),
    };
    drop(first);
    let early = Call::new("chain-shop", "order-2").run(&store, async { Ok::<_, Error>(Value::Null) }).await;
    assert!(matches!(early, Err(Error::InProgress { .. })), "the lost run's claim holds for its lease: {early:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = Call::new("chain-shop", "order-2")
        .run(&store, async { send_to(&client, format!("http://{addr}/transfers")).await })
        .await
        .expect("the takeover runs");
    let keys = ledger.keys();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_eq!(keys[0], keys[1], "the takeover sent the lost run's key");
    assert_eq!(ledger.transfers(), 1, "one transfer");
    assert_eq!(second, first_transfer, "and the takeover got the first transfer's answer, replayed");
}

#[tokio::test]
async fn chain_http_client_explicit_key_wins_and_the_opt_outs_get_fresh_keys() {
    let ledger = Ledger::default();
    let addr = bank(&ledger).await;
    let derived = client();
    let opted_out = ClientBuilder::new(reqwest::Client::new())
        .with(IdempotentRetry::new(RetryPolicy::default()).derive_keys(false))
        .build();
    let store = MemoryStore::new();
    for _ in 0..2 {
        // Released each time, so the body runs twice.
        let _ = Call::new("chain-shop", "order-3")
            .run(&store, async {
                let url = format!("http://{addr}/transfers");
                derived.post(&url).header("idempotency-key", "explicit-1").send().await.expect("sent");
                opted_out.post(&url).send().await.expect("sent");
                without_derived_keys(derived.post(&url).send()).await.expect("sent");
                Err::<(), _>(Error::InvalidKey(idempotent_runtime::KeyError::Empty))
            })
            .await;
    }
    let keys = ledger.keys();
    assert_eq!(keys.len(), 6, "{keys:?}");
    assert_eq!((keys[0].as_str(), keys[3].as_str()), ("explicit-1", "explicit-1"), "the explicit key wins");
    let fresh = [&keys[1], &keys[2], &keys[4], &keys[5]];
    assert!(fresh.iter().all(|k| is_uuid(k)), "opted out: random keys {keys:?}");
    assert_ne!(keys[1], keys[4]);
    assert_ne!(keys[2], keys[5]);
    assert_eq!(derived_key("POST", "/x"), None, "no derived key outside a body");
}

#[tokio::test]
async fn chain_derived_keys_depend_on_scope_key_position_method_and_path() {
    let store = MemoryStore::new();
    let keys = |scope: &'static str, key: &'static str| {
        let store = &store;
        async move {
            Call::new(scope, key)
                .run(store, async {
                    Ok::<_, Error>([
                        derived_key("POST", "/a").unwrap(),
                        derived_key("POST", "/a").unwrap(),
                        derived_key("PATCH", "/a").unwrap(),
                        derived_key("POST", "/b").unwrap(),
                    ])
                })
                .await
                .unwrap()
        }
    };
    let one = keys("chain-a", "k").await;
    let unique: std::collections::HashSet<_> = one.iter().collect();
    assert_eq!(unique.len(), 4, "position, method and path each change the key: {one:?}");
    let other_key = keys("chain-a", "k2").await;
    let other_scope = keys("chain-b", "k").await;
    assert!(one.iter().all(|k| !other_key.contains(k) && !other_scope.contains(k)));
}

// ---------------------------------------------------------------- steps

/// Counts how often a step's work really ran.
#[derive(Default)]
struct Work(AtomicUsize);

impl Work {
    fn run(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// A body with two steps that fails (released) after the first on its first run: the retry
/// replays the first step and runs the second; a third call replays the whole record.
async fn released_after_first_step<S: Store>(store: &S, key: &str) {
    let (first, second, runs) = (Work::default(), Work::default(), AtomicUsize::new(0));
    let order = || {
        Call::new("chain-steps", key).fingerprint(&"order").run(store, async {
            let a: usize = step("reserve", async { Ok::<_, Error>(first.run() * 10) }).await?;
            if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(Error::InvalidKey(idempotent_runtime::KeyError::Empty));
            }
            let b: usize = step("charge", async { Ok::<_, Error>(second.run() * 100) }).await?;
            Ok(a + b)
        })
    };
    assert!(order().await.is_err());
    assert_eq!(order().await.unwrap(), 110, "the first step's value came back from the record");
    assert_eq!(order().await.unwrap(), 110, "replayed");
    assert_eq!((first.count(), second.count()), (1, 1), "each step ran once");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the body ran twice, the steps once each");
    // The same key with another request is refused, by the record here (and by a step's record
    // when the call was released: see the next test).
    let other = Call::new("chain-steps", key).fingerprint(&"other").run(store, async { Ok::<_, Error>(0usize) });
    assert!(matches!(other.await, Err(Error::FingerprintMismatch { .. })));
}

/// A step's claim left by a run that died inside the step is waited out, then the step runs in
/// the next run: the step asks the store again once the claim's lease is over. On the memory
/// store, under Tokio's paused clock.
#[tokio::test(start_paused = true)]
async fn chain_step_claim_left_by_a_dead_run_is_waited_out_on_memory() {
    let store = MemoryStore::new();
    let (work, runs) = (Work::default(), AtomicUsize::new(0));
    let order = || {
        Call::new("chain-dead-step", "order-1").lease(Duration::from_secs(3)).wait(Duration::from_secs(30)).run(
            &store,
            async {
                if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    // The call's claim is renewed at 1 s and 2 s (every third of the lease): it
                    // ends at 5 s. The step's claim, made at 2.5 s, ends at 5.5 s.
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                }
                step("charge", async {
                    if work.run() == 1 {
                        std::future::pending::<()>().await; // the first run dies here
                    }
                    Ok::<_, Error>(7usize)
                })
                .await
            },
        )
    };
    let started = tokio::time::Instant::now();
    let first = tokio::time::timeout(Duration::from_millis(2600), order()).await;
    assert!(first.is_err(), "the first run is dropped inside its step: {first:?}");
    let second = tokio::time::timeout(Duration::from_secs(60), order()).await;
    assert_eq!(second.expect("the second run ends").unwrap(), 7);
    assert_eq!((work.count(), runs.load(Ordering::SeqCst)), (2, 2), "the step's work ran in each run");
    let waited = started.elapsed();
    assert!(
        (Duration::from_millis(5500)..Duration::from_secs(7)).contains(&waited),
        "the second run took the call over at 5 s and waited for the step's claim to end at 5.5 s: {waited:?}"
    );
}

#[tokio::test]
async fn chain_step_is_not_repeated_after_a_released_err_on_memory() {
    released_after_first_step(&MemoryStore::new(), "order-1").await;
}

#[tokio::test]
async fn chain_step_is_not_repeated_after_a_released_err_on_sqlite() {
    let (store, cleanup) = idempotent_tests::fresh::sqlite("chain-steps").await;
    released_after_first_step(&store, "order-1").await;
    cleanup.run().await;
}

#[tokio::test]
async fn chain_step_is_not_repeated_after_a_released_err_on_postgres() {
    let Some((store, cleanup)) = idempotent_tests::fresh::postgres("chain_step_on_postgres").await else { return };
    released_after_first_step(&store, "order-1").await;
    cleanup.run().await;
}

#[tokio::test]
async fn chain_step_is_not_repeated_after_a_released_err_on_redis() {
    let Some((store, cleanup)) = idempotent_tests::fresh::redis("chain_step_on_redis").await else { return };
    released_after_first_step(&store, "order-1").await;
    cleanup.run().await;
}

#[tokio::test]
async fn chain_step_is_not_repeated_after_a_released_err_on_mysql() {
    let Some((store, cleanup)) = idempotent_tests::fresh::mysql("chain_step_on_mysql").await else { return };
    released_after_first_step(&store, "order-1").await;
    cleanup.run().await;
}

#[tokio::test]
async fn chain_step_recorded_for_another_request_is_a_fingerprint_mismatch() {
    let store = MemoryStore::new();
    let work = Work::default();
    let run = |fingerprint: &'static str| {
        Call::new("chain-steps", "order-fp").fingerprint(&fingerprint).run(&store, async {
            step("reserve", async { Ok::<_, Error>(work.run()) }).await?;
            Err::<usize, _>(Error::InvalidKey(idempotent_runtime::KeyError::Empty))
        })
    };
    assert!(matches!(run("a").await, Err(Error::InvalidKey(_))));
    assert!(matches!(run("b").await, Err(Error::FingerprintMismatch { .. })), "the step's record is a's");
    assert_eq!(work.count(), 1);
}

#[tokio::test]
async fn chain_step_err_is_not_recorded_and_outside_a_body_is_a_typed_error() {
    let store = MemoryStore::new();
    let work = Work::default();
    let run = || {
        Call::new("chain-steps", "order-err").run(&store, async {
            step("flaky", async {
                if work.run() == 1 { Err(Error::InvalidKey(idempotent_runtime::KeyError::Empty)) } else { Ok(7u8) }
            })
            .await
        })
    };
    assert!(run().await.is_err());
    assert_eq!(run().await.unwrap(), 7, "a failed step runs again");
    assert_eq!(work.count(), 2);
    let outside = step("loose", async { Ok::<_, Error>(1) }).await;
    assert!(matches!(outside, Err(Error::StepOutsideCall { ref name }) if name == "loose"), "{outside:?}");
    let spawned = Call::new("chain-steps", "order-spawn")
        .run(&store, async {
            let task = tokio::spawn(step("in-a-task", async { Ok::<_, Error>(1) }));
            task.await.expect("the task ends")
        })
        .await;
    assert!(matches!(spawned, Err(Error::StepOutsideCall { .. })), "task-locals do not cross spawn: {spawned:?}");
}

#[tokio::test]
async fn chain_requests_inside_a_step_keep_their_keys_when_an_earlier_step_is_replayed() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    let seen = Mutex::new(Vec::new());
    let run = || {
        Call::new("chain-steps", "order-keys").run(&store, async {
            step("first", async { Ok::<_, Error>(derived_key("POST", "/one").unwrap()) }).await?;
            let after = derived_key("POST", "/two").unwrap();
            seen.lock().unwrap().push(after);
            if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(Error::InvalidKey(idempotent_runtime::KeyError::Empty));
            }
            Ok(())
        })
    };
    assert!(run().await.is_err());
    run().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0], seen[1], "a request after a replayed step keeps its position: {seen:?}");
}

#[tokio::test]
async fn chain_steps_in_an_sqlite_transaction_commit_and_roll_back_with_it() {
    use idempotent_runtime::stores::sql::SqliteStore;
    let dir = idempotent_tests::fresh::temp_dir("chain-tx");
    let store = SqliteStore::open(dir.join("idempotency.db")).await.expect("open SQLite");
    let work = Work::default();
    let attempt = |tx| {
        let work = &work;
        async move {
            let result = Call::new("chain-tx", "order-1")
                .run(&tx, async {
                    step("reserve", async { Ok::<_, Error>(work.run()) }).await?;
                    Err::<usize, _>(Error::InvalidKey(idempotent_runtime::KeyError::Empty))
                })
                .await;
            (tx, result)
        }
    };
    // Rolled back: the step's record goes with the transaction, so the next run runs it again.
    let (tx, result) = attempt(store.begin().await.unwrap()).await;
    assert!(result.is_err());
    tx.rollback().await.unwrap();
    // Committed (the released claim and the step's record): the next run replays the step.
    let (tx, result) = attempt(store.begin().await.unwrap()).await;
    assert!(result.is_err());
    tx.commit().await.unwrap();
    let (tx, result) = attempt(store.begin().await.unwrap()).await;
    assert!(result.is_err());
    tx.rollback().await.unwrap();
    assert_eq!(work.count(), 2, "run in the rolled-back transaction and the committed one, replayed after");
    let _ = std::fs::remove_dir_all(dir);
}

#[cfg(feature = "metrics")]
#[test]
fn chain_steps_are_counted_executed_and_replayed() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let store = MemoryStore::new();
            for round in 0..2 {
                let _ = Call::new("chain-metrics", "k")
                    .run(&store, async {
                        step("one", async { Ok::<_, Error>(1) }).await?;
                        if round == 0 {
                            return Err(Error::InvalidKey(idempotent_runtime::KeyError::Empty));
                        }
                        Ok(())
                    })
                    .await;
            }
        });
    });
    let steps: Vec<_> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == "idempotent_steps_total")
        .map(|(key, _, _, value)| (key.key().labels().map(|l| l.value().to_owned()).collect::<Vec<_>>(), value))
        .collect();
    assert!(steps.contains(&(vec!["executed".into()], DebugValue::Counter(1))), "{steps:?}");
    assert!(steps.contains(&(vec!["replayed".into()], DebugValue::Counter(1))), "{steps:?}");
}
