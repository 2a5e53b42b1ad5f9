#![cfg(feature = "http")]
//! The outbound side: `IdempotentRetry` (reqwest-middleware) against real axum servers on
//! 127.0.0.1, some behind the fault proxy.
//!
//! - End to end: our `IdempotencyLayer` server, reached through a proxy that loses the response
//!   after the server ran the request, then refuses connections (in two tests, while the server
//!   restarts on a persistent store it opens from a URL with `AnyStore`: an SQLite file, and
//!   PostgreSQL). The client retries with the same key, the handler runs once (counted by a
//!   ledger outside the store), and the client gets the recorded response, marked replayed.
//! - The policy, one rule per test, against a scripted server that answers a given sequence of
//!   statuses and notes the key of every request it gets.
//!
//! Ordering comes from what the proxy or the server saw, never from racing sleeps; the jitter is
//! seeded.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use bytes::Bytes;
use idempotent_runtime::client::{Attempts, IdempotentRetry, OutboundError, RetryPolicy, Stopped};
use idempotent_runtime::http::{HttpError, IdempotencyKeyHeader, IdempotencyLayer, JsonResponse, RunToCompletionLayer};
use idempotent_runtime::stores::AnyStore;
use idempotent_runtime::{MemoryStore, Store, idempotent};
use idempotent_tests::proxy::{FaultProxy, Mode};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use serde_json::{Value, json};
use tokio::sync::oneshot;

/// Serves `app` on a loopback port of its own, in the background; its address.
async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free port");
    let addr = listener.local_addr().expect("the bound address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("the server runs") });
    addr
}

const JSON: &str = "application/json";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Many quick attempts: the faults last as long as the test says, not as long as the policy allows.
fn patient() -> RetryPolicy {
    RetryPolicy::default()
        .max_attempts(200)
        .backoff(ms(10), ms(100))
        .max_elapsed(Duration::from_secs(30))
        .jitter_seed(1)
}

fn client(policy: RetryPolicy) -> ClientWithMiddleware {
    client_with(reqwest::Client::new(), policy)
}

fn client_with(inner: reqwest::Client, policy: RetryPolicy) -> ClientWithMiddleware {
    ClientBuilder::new(inner).with(IdempotentRetry::new(policy)).build()
}

fn attempts(response: &reqwest::Response) -> Attempts {
    response.extensions().get::<Attempts>().cloned().expect("the middleware notes its attempts")
}

fn is_uuid_v4(text: &str) -> bool {
    uuid::Uuid::parse_str(text).is_ok_and(|u| u.get_version_num() == 4)
}

// ---------------------------------------------------------------- the API with IdempotencyLayer

/// Counts what happened on the server side, outside the idempotency store.
#[derive(Clone, Default)]
struct Ledger {
    /// Handler runs begun.
    started: Arc<AtomicUsize>,
    /// Handler runs finished.
    runs: Arc<AtomicUsize>,
    /// The `Idempotency-Key` of every request that reached the server, replays included.
    keys: Arc<Mutex<Vec<String>>>,
}

impl Ledger {
    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn keys(&self) -> Vec<String> {
        self.keys.lock().unwrap().clone()
    }
}

/// Notes the key of every request, before the idempotency layer.
async fn note_key(State(ledger): State<Ledger>, request: Request, next: Next) -> Response {
    let key = request.headers().get("idempotency-key").map(|v| v.to_str().unwrap().to_owned());
    ledger.keys.lock().unwrap().push(key.unwrap_or_default());
    next.run(request).await
}

/// `POST /charges`: counts its run in the ledger, sleeps `x-delay-ms` if asked, answers 201.
async fn charge(State(ledger): State<Ledger>, headers: HeaderMap, body: Bytes) -> Response {
    ledger.started.fetch_add(1, Ordering::SeqCst);
    if let Some(delay) = headers.get("x-delay-ms").and_then(|v| v.to_str().ok()?.parse().ok()) {
        tokio::time::sleep(ms(delay)).await;
    }
    let run = ledger.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let receipt = json!({ "charge": run, "request": String::from_utf8_lossy(&body) });
    (StatusCode::CREATED, [("location", format!("/charges/{run}"))], axum::Json(receipt)).into_response()
}

/// A running API server; `stop` shuts it down and drops its store.
struct Api {
    addr: SocketAddr,
    shutdown: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Api {
    async fn start<S: Store + 'static>(store: S, ledger: &Ledger) -> Api {
        let app = Router::new()
            .route("/charges", post(charge))
            // A short lease: a 409's Retry-After may be the claim's remaining lease.
            .route_layer(
                IdempotencyLayer::new(store)
                    .keys_shared_by_all_callers()
                    .scope("charges")
                    .lease(Duration::from_secs(3)),
            )
            .layer(axum::middleware::from_fn_with_state(ledger.clone(), note_key))
            .with_state(ledger.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free port");
        let addr = listener.local_addr().expect("the bound address");
        let (shutdown, stop) = oneshot::channel();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stop.await;
                })
                .await
                .expect("the server runs");
        });
        Api { addr, shutdown, task }
    }

    /// Stops accepting, waits for open connections to end (kill them first), drops the store.
    async fn stop(self) {
        let _ = self.shutdown.send(());
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("the server stops once its connections are gone")
            .expect("the server task ends cleanly");
    }
}

/// The response's notes, headers and JSON body.
async fn read(response: reqwest::Response) -> (Attempts, HeaderMap, Value) {
    let attempts = attempts(&response);
    let headers = response.headers().clone();
    let body = response.bytes().await.expect("the body arrives");
    (attempts, headers, serde_json::from_slice(&body).expect("a JSON body"))
}

/// The client got the first run's recorded 201, replayed.
fn assert_replayed_first_run(headers: &HeaderMap, body: &Value) {
    let replayed = headers.get("idempotent-replayed").map(|v| v.to_str().unwrap());
    assert_eq!(replayed, Some("true"), "the answer is the recorded one, replayed: {body}");
    assert_eq!(headers.get("location").unwrap(), "/charges/1");
    assert_eq!(*body, json!({ "charge": 1, "request": r#"{"amount":100}"# }));
}

/// The ledger shows one run, and every request that reached the server had the client's key.
fn assert_one_run_one_key(ledger: &Ledger, attempts: &Attempts) {
    assert_eq!(ledger.started.load(Ordering::SeqCst), 1, "the handler began exactly once");
    assert_eq!(ledger.runs(), 1, "the handler ran exactly once");
    let keys = ledger.keys();
    assert!(keys.len() >= 2, "the first attempt and the replayed one reached the server: {keys:?}");
    assert!(keys.iter().all(|k| *k == attempts.key), "every attempt carried {}: {keys:?}", attempts.key);
    assert!(is_uuid_v4(&attempts.key), "{}", attempts.key);
}

/// Two copies of one process (a `fork` child beside its parent, as a virtual machine restored
/// twice from one snapshot makes them) each send one request with no key of their own: the
/// middleware gives them different fresh keys. uuid's per-thread generator, which made them
/// before, goes on identically in both copies: the two requests carried one key, and a server
/// would have taken the second for a retry of the first.
#[cfg(all(feature = "redis", feature = "grpc"))] // the test program's other modes need them
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_client_copies_of_one_process_send_different_fresh_keys() {
    async fn note(State(keys): State<Arc<Mutex<Vec<String>>>>, headers: HeaderMap) -> StatusCode {
        let key = headers.get("idempotency-key").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        keys.lock().unwrap().push(key.unwrap_or_default());
        StatusCode::OK
    }
    let keys = Arc::new(Mutex::new(Vec::new()));
    let app = Router::new().route("/orders", post(note)).with_state(Arc::clone(&keys));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free port");
    let url = format!("http://{}/orders", listener.local_addr().expect("the bound address"));
    let server = tokio::spawn(async move { axum::serve(listener, app).await.expect("the server runs") });
    let run = move || idempotent_tests::output_lines(env!("CARGO_BIN_EXE_fork_copies"), &["outbound-key", &url]);
    let copies = tokio::task::spawn_blocking(run).await.unwrap();
    server.abort();
    assert_eq!(copies, ["sent", "sent"]);
    let keys = keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 3, "the warm-up request and one from each copy: {keys:?}");
    assert!(keys.iter().all(|key| is_uuid_v4(key)), "{keys:?}");
    assert_ne!(keys[1], keys[2], "each copy's request has a key of its own: {keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_client_lost_response_then_refused_connections_is_retried_with_the_same_key_and_replayed() {
    let ledger = Ledger::default();
    let api = Api::start(MemoryStore::new(), &ledger).await;
    let proxy = FaultProxy::start(&api.addr.to_string()).await.expect("start the proxy");
    proxy.set_mode(Mode::LoseResponses);

    let client = client(patient());
    let url = format!("http://{}/charges", proxy.addr());
    let call = tokio::spawn(client.post(url).header("content-type", JSON).body(r#"{"amount":100}"#).send());

    proxy
        .wait_until("the server's answer is lost", Duration::from_secs(10), |s| {
            s.lost_responses.load(Ordering::SeqCst) >= 1
        })
        .await;
    assert_eq!(ledger.runs(), 1, "the server ran the request before its answer was lost");
    proxy.set_mode(Mode::Refuse);
    proxy.wait_until("retries are refused", Duration::from_secs(10), |s| s.refused.load(Ordering::SeqCst) >= 3).await;
    proxy.set_mode(Mode::Pass);

    let response = call.await.expect("the call task").expect("the client gets an answer in the end");
    assert_eq!(response.status(), StatusCode::CREATED);
    let (attempts, headers, body) = read(response).await;
    assert_replayed_first_run(&headers, &body);
    assert!(attempts.count >= 5, "one lost, three refused, one answered: {attempts:?}");
    assert_eq!(attempts.stopped, None);
    assert_one_run_one_key(&ledger, &attempts);
    api.stop().await;
}

/// The answer is lost, the server goes down and comes back as a new process on the same
/// persistent store (opened from `store_url`, as a deployment would): the retry is replayed.
/// Returns the key, for cleaning up.
async fn restart_scenario(store_url: &str) -> String {
    let open = async || AnyStore::from_url(store_url).await.expect("open the store");
    let ledger = Ledger::default();
    let first = Api::start(open().await, &ledger).await;
    let proxy = FaultProxy::start(&first.addr.to_string()).await.expect("start the proxy");
    proxy.set_mode(Mode::LoseResponses);

    let client = client(patient());
    let url = format!("http://{}/charges", proxy.addr());
    let call = tokio::spawn(client.post(url).header("content-type", JSON).body(r#"{"amount":100}"#).send());

    proxy
        .wait_until("the server's answer is lost", Duration::from_secs(10), |s| {
            s.lost_responses.load(Ordering::SeqCst) >= 1
        })
        .await;
    // The server goes down: connections refused, open ones cut, the process's store closed.
    proxy.set_mode(Mode::Refuse);
    proxy.kill_connections();
    first.stop().await;
    proxy
        .wait_until("retries are refused while it is down", Duration::from_secs(10), |s| {
            s.refused.load(Ordering::SeqCst) >= 3
        })
        .await;

    // A new server process on the same store, on another port.
    let second = Api::start(open().await, &ledger).await;
    proxy.set_target(second.addr);
    proxy.set_mode(Mode::Pass);

    let response = call.await.expect("the call task").expect("the client gets an answer in the end");
    assert_eq!(response.status(), StatusCode::CREATED);
    let (attempts, headers, body) = read(response).await;
    assert_replayed_first_run(&headers, &body);
    assert!(attempts.count >= 5, "{attempts:?}");
    assert_one_run_one_key(&ledger, &attempts);
    second.stop().await;
    attempts.key
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_client_retry_across_a_server_restart_on_sqlite_replays_the_recorded_response() {
    let dir = idempotent_tests::fresh::temp_dir("http-client-restart");
    restart_scenario(&format!("sqlite://{}", dir.join("records.db").display())).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_client_retry_across_a_server_restart_on_postgres_replays_the_recorded_response() {
    use idempotent_runtime::stores::sql::sqlx;
    let test = "http_client_retry_across_a_server_restart_on_postgres_replays_the_recorded_response";
    let Some(url) = idempotent_tests::services::postgres_url(test) else { return };
    let key = restart_scenario(&url).await;
    let pool = sqlx::PgPool::connect(&url).await.expect("connect to PostgreSQL");
    let deleted = sqlx::query("DELETE FROM idempotency_records WHERE idempotency_key = $1")
        .bind(format!("charges:{key}"))
        .execute(&pool)
        .await
        .expect("delete the test's record");
    assert_eq!(deleted.rows_affected(), 1, "the record was in PostgreSQL");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_client_timeout_shorter_than_the_handler_gets_409_then_the_replay_and_runs_it_once() {
    let ledger = Ledger::default();
    let api = Api::start(MemoryStore::new(), &ledger).await;
    // The first attempt times out after 300 ms while the handler takes 1 s. The server keeps
    // running it (the client's disconnect does not cancel it), the retry finds it still running
    // (409, Retry-After: 1), waits, and gets the recorded response.
    let inner = reqwest::Client::builder().timeout(ms(300)).build().expect("a client");
    let start = Instant::now();
    let response = client_with(inner, patient())
        .post(format!("http://{}/charges", api.addr))
        .header("content-type", JSON)
        .header("x-delay-ms", "1000")
        .body(r#"{"amount":100}"#)
        .send()
        .await
        .expect("an answer in the end");
    assert_eq!(response.status(), StatusCode::CREATED);
    let (attempts, headers, body) = read(response).await;
    assert_replayed_first_run(&headers, &body);
    assert!(attempts.count >= 3, "timed out, 409, replayed: {attempts:?}");
    assert!(start.elapsed() >= Duration::from_secs(1), "Retry-After: 1 was honoured");
    assert_one_run_one_key(&ledger, &attempts);
    api.stop().await;
}

/// Defaults composed as axum's documentation composes them: a timeout in front of the
/// idempotency layer (`tower::timeout` with `HandleErrorLayer`, answering `408` after 150 ms)
/// and a handler that takes 400 ms. The layer runs the request to its end; the client, told
/// `408`, retries with the same key, gets `409` while the handler runs and then the recorded
/// response. A client that returned the `408` would report a charge that was made as failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_client_retries_a_servers_408_with_the_same_key_and_gets_the_replay() {
    let ledger = Ledger::default();
    let timeout = tower::ServiceBuilder::new()
        .layer(axum::error_handling::HandleErrorLayer::new(|_: tower::BoxError| async { StatusCode::REQUEST_TIMEOUT }))
        .layer(tower::timeout::TimeoutLayer::new(ms(150)));
    let app = Router::new()
        .route("/charges", post(charge))
        // A short lease: the 409's Retry-After is the claim's remaining lease.
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .keys_shared_by_all_callers()
                .scope("charges")
                .lease(Duration::from_secs(2)),
        )
        .layer(timeout)
        .layer(axum::middleware::from_fn_with_state(ledger.clone(), note_key))
        .with_state(ledger.clone());
    let addr = serve(app).await;
    let response = client(patient())
        .post(format!("http://{addr}/charges"))
        .header("content-type", JSON)
        .header("x-delay-ms", "400")
        .body(r#"{"amount":100}"#)
        .send()
        .await
        .expect("an answer in the end");
    assert_eq!(response.status(), StatusCode::CREATED, "the recorded response, not the server's 408");
    let (attempts, headers, body) = read(response).await;
    assert_replayed_first_run(&headers, &body);
    assert!(attempts.count >= 2, "408, then the replay (409s between): {attempts:?}");
    assert_one_run_one_key(&ledger, &attempts);
}

#[tokio::test]
async fn http_client_key_reused_with_another_body_is_a_typed_error() {
    let ledger = Ledger::default();
    let api = Api::start(MemoryStore::new(), &ledger).await;
    let client = client(patient());
    let url = format!("http://{}/charges", api.addr);
    let key = "0b6f8a52-5d0e-4f0a-9a57-3c1d2e4f5a60";
    let first = client.post(&url).header("idempotency-key", key).body(r#"{"amount":100}"#).send().await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(attempts(&first).key, key, "the caller's key is kept");

    let error = client.post(&url).header("idempotency-key", key).body(r#"{"amount":999}"#).send().await.unwrap_err();
    let Some(OutboundError::KeyReused { key: reused, url: at, detail }) = OutboundError::find(&error) else {
        panic!("expected KeyReused, got {error:?}");
    };
    assert_eq!((reused.as_str(), at.as_str()), (key, url.as_str()));
    assert!(detail.as_deref().is_some_and(|d| d.contains("different request")), "{detail:?}");
    let message = error.to_string();
    assert!(message.contains("422") && message.contains("new key"), "{message}");
    assert_eq!(ledger.runs(), 1);
    assert_eq!(ledger.keys().len(), 2, "a 422 is not retried");
    api.stop().await;
}

// ---------------------------------------------------------------- a scripted server

/// A status to answer, with the `Retry-After` to send with it.
type Answer = (u16, Option<&'static str>);
/// A request's method and `Idempotency-Key`.
type Seen = (Method, Option<String>);

/// Answers each request with the next status of its script (with `Retry-After` if given), `200`
/// once the script is used up, and notes every request's method and key.
#[derive(Clone, Default)]
struct Script {
    answers: Arc<Mutex<VecDeque<Answer>>>,
    /// How long the first request hangs before it is answered.
    first_delay: Arc<Mutex<Option<Duration>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Script {
    async fn serve(answers: &[Answer]) -> (Script, String) {
        let script = Script { answers: Arc::new(Mutex::new(answers.iter().copied().collect())), ..Script::default() };
        let app = Router::new().route("/{*path}", any(scripted)).with_state(script.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free port");
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.expect("the server runs") });
        (script, base)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// The keys of the requests seen, all of which must have one and the same.
    fn one_key(&self) -> String {
        let seen = self.seen();
        let first = seen[0].1.clone().expect("a key");
        assert!(seen.iter().all(|(_, key)| key.as_ref() == Some(&first)), "one key on every attempt: {seen:?}");
        first
    }
}

async fn scripted(State(script): State<Script>, request: Request) -> Response {
    let key = request.headers().get("idempotency-key").map(|v| v.to_str().unwrap().to_owned());
    script.seen.lock().unwrap().push((request.method().clone(), key));
    let _ = axum::body::to_bytes(request.into_body(), 1 << 20).await;
    let delay = script.first_delay.lock().unwrap().take();
    if let Some(delay) = delay {
        tokio::time::sleep(delay).await;
    }
    let (status, retry_after) = script.answers.lock().unwrap().pop_front().unwrap_or((200, None));
    let mut response = (StatusCode::from_u16(status).unwrap(), format!("answer {status}")).into_response();
    if let Some(seconds) = retry_after {
        response.headers_mut().insert("retry-after", seconds.parse().unwrap());
    }
    response
}

#[tokio::test]
async fn http_client_gives_post_and_patch_one_uuid_key_each_and_leaves_other_methods_alone() {
    let (script, base) = Script::serve(&[]).await;
    let client = client(patient());
    for method in [Method::POST, Method::PATCH, Method::GET, Method::PUT, Method::DELETE] {
        let response = client.request(method.clone(), format!("{base}/x")).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let noted = response.extensions().get::<Attempts>().cloned();
        assert_eq!(noted.is_some(), matches!(method, Method::POST | Method::PATCH), "{method}: {noted:?}");
    }
    let seen = script.seen();
    let keys: Vec<_> = seen.iter().map(|(_, key)| key.clone()).collect();
    assert!(keys[0].as_deref().is_some_and(is_uuid_v4) && keys[1].as_deref().is_some_and(is_uuid_v4), "{seen:?}");
    assert_ne!(keys[0], keys[1], "each request gets its own key");
    assert_eq!(&keys[2..], &[None, None, None], "GET, PUT, DELETE get no key");

    // Configured methods; a key the caller set makes any request retried with it.
    let (script, base) = Script::serve(&[(503, None)]).await;
    let client =
        ClientBuilder::new(reqwest::Client::new()).with(IdempotentRetry::new(patient()).methods([Method::PUT])).build();
    let put = client.put(format!("{base}/x")).send().await.unwrap();
    assert_eq!((put.status(), attempts(&put).count), (StatusCode::OK, 2), "PUT is now keyed and retried");
    let post = client.post(format!("{base}/x")).send().await.unwrap();
    assert!(post.extensions().get::<Attempts>().is_none(), "POST is no longer handled");
    let get = client.get(format!("{base}/x")).header("idempotency-key", "mine-1").send().await.unwrap();
    assert_eq!(attempts(&get).key, "mine-1");
    let seen = script.seen();
    assert_eq!(seen.len(), 4, "{seen:?}");
    assert_eq!(seen[0].1, seen[1].1, "the PUT retry carried the same key");
    assert_eq!((seen[2].1.as_deref(), seen[3].1.as_deref()), (None, Some("mine-1")));
}

#[tokio::test]
async fn http_client_retries_5xx_429_409_and_408_with_the_same_key() {
    let script = [(503, None), (500, None), (429, Some("0")), (409, Some("0")), (408, None), (502, None), (201, None)];
    let (script, base) = Script::serve(&script).await;
    let response = client(patient()).post(format!("{base}/orders")).body("order").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let attempts = attempts(&response);
    assert_eq!((attempts.count, attempts.stopped), (7, None));
    assert_eq!(script.seen().len(), 7);
    assert_eq!(script.one_key(), attempts.key);
}

#[tokio::test]
async fn http_client_retries_a_timed_out_request_with_the_same_key() {
    let (script, base) = Script::serve(&[(201, None)]).await;
    *script.first_delay.lock().unwrap() = Some(Duration::from_secs(3));
    let inner = reqwest::Client::builder().timeout(ms(300)).build().expect("a client");
    let response = client_with(inner, patient()).post(format!("{base}/orders")).body("order").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(attempts(&response).count, 2, "the first attempt timed out; the second was answered");
    assert_eq!(script.seen().len(), 2);
    assert_eq!(script.one_key(), attempts(&response).key);
}

#[tokio::test]
async fn http_client_never_retries_other_4xx() {
    for status in [400, 401, 403, 404, 405, 410, 412, 413, 415, 425] {
        let (script, base) = Script::serve(&[(status, None), (201, None)]).await;
        let response = client(patient()).post(format!("{base}/orders")).body("order").send().await.unwrap();
        assert_eq!(response.status().as_u16(), status);
        assert_eq!(attempts(&response).count, 1, "{status}");
        assert_eq!(script.seen().len(), 1, "{status} is an answer, not retried");
    }
}

#[tokio::test]
async fn http_client_stops_after_its_attempts_and_returns_the_last_response() {
    let (script, base) = Script::serve(&[(503, None); 10]).await;
    let response = client(patient().max_attempts(3)).post(format!("{base}/orders")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let attempts = attempts(&response);
    assert_eq!((attempts.count, attempts.stopped), (3, Some(Stopped::AttemptsExhausted)));
    assert_eq!(script.seen().len(), 3);
    assert_eq!(script.one_key(), attempts.key);
}

#[tokio::test]
async fn http_client_honours_retry_after_and_stops_at_its_time_budget() {
    // Retry-After: 1 is waited for (the back-off alone would be 5-10 ms).
    let (_, base) = Script::serve(&[(503, Some("1")), (201, None)]).await;
    let start = Instant::now();
    let response = client(patient()).post(format!("{base}/orders")).send().await.unwrap();
    assert_eq!((response.status(), attempts(&response).count), (StatusCode::CREATED, 2));
    assert!(start.elapsed() >= Duration::from_secs(1), "{:?}", start.elapsed());

    // Retry-After: 60 does not fit a 2 s budget: the 503 comes back at once.
    let (script, base) = Script::serve(&[(503, Some("60")), (201, None)]).await;
    let policy = patient().max_elapsed(Duration::from_secs(2));
    let response = client(policy).post(format!("{base}/orders")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let attempts = attempts(&response);
    assert_eq!((attempts.count, attempts.stopped), (1, Some(Stopped::TimeBudgetExhausted)));
    assert_eq!(script.seen().len(), 1);
}

/// A loopback port with nothing listening on it.
async fn closed_port() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap()
}

#[tokio::test]
async fn http_client_gives_up_on_refused_connections_with_a_typed_error_naming_the_key() {
    let addr = closed_port().await;
    let error = client(patient().max_attempts(3)).post(format!("http://{addr}/orders")).send().await.unwrap_err();
    let Some(gave_up @ OutboundError::GaveUp { attempts, source, .. }) = OutboundError::find(&error) else {
        panic!("expected GaveUp, got {error:?}");
    };
    assert_eq!(*attempts, 3);
    assert!(is_uuid_v4(gave_up.key()), "{gave_up}");
    assert!(source.is_connect(), "{source:?}");
    let message = error.to_string();
    assert!(message.contains(gave_up.key()) && message.contains("retry later with the same key"), "{message}");
}

fn stream_body() -> reqwest::Body {
    let chunks: Vec<Result<Bytes, std::io::Error>> =
        vec![Ok(Bytes::from_static(b"chunk 1, ")), Ok(Bytes::from_static(b"chunk 2"))];
    reqwest::Body::wrap_stream(futures_util::stream::iter(chunks))
}

#[tokio::test]
async fn http_client_sends_a_streaming_body_once_and_says_why_it_did_not_retry() {
    let (script, base) = Script::serve(&[(503, None), (201, None)]).await;
    let response = client(patient()).post(format!("{base}/upload")).body(stream_body()).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let attempts = attempts(&response);
    assert_eq!((attempts.count, attempts.stopped), (1, Some(Stopped::BodyNotReplayable)));
    assert_eq!(script.seen().len(), 1);
    assert!(is_uuid_v4(&script.one_key()), "a streamed request gets a key too");

    let addr = closed_port().await;
    let error = client(patient()).post(format!("http://{addr}/upload")).body(stream_body()).send().await.unwrap_err();
    let Some(not_replayable @ OutboundError::NotReplayable { .. }) = OutboundError::find(&error) else {
        panic!("expected NotReplayable, got {error:?}");
    };
    assert!(not_replayable.to_string().contains("body is a stream"), "{not_replayable}");
}

// ---------------------------------------------------------------- issue 20: hostile servers, the two sides' defaults together

/// `POST /charge-then-fail`: charges (the ledger), then answers 500, as a handler whose downstream
/// timed out after the charge would.
async fn charge_then_fail(State(ledger): State<Ledger>) -> Response {
    ledger.started.fetch_add(1, Ordering::SeqCst);
    let run = ledger.runs.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::INTERNAL_SERVER_ERROR, format!("charged (run {run}), then the receipt service timed out"))
        .into_response()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_client_and_server_defaults_run_a_handler_that_charged_then_failed_once() {
    let ledger = Ledger::default();
    // Both sides as they come: the layer's defaults (with the caller choice it requires), the
    // client's default policy (its jitter seeded).
    let app = Router::new()
        .route("/charge-then-fail", post(charge_then_fail))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).keys_shared_by_all_callers())
        .layer(axum::middleware::from_fn_with_state(ledger.clone(), note_key))
        .with_state(ledger.clone());
    let addr = serve(app).await;
    let client = client(RetryPolicy::default().jitter_seed(20));
    let response = client.post(format!("http://{addr}/charge-then-fail")).body("charge 100").send().await.unwrap();
    let attempts = attempts(&response);
    let status = response.status();
    let replayed = response.headers().get("idempotent-replayed").cloned();
    let body = response.text().await.unwrap();
    println!(
        "defaults together: the handler ran {} time(s) under one key in {} attempt(s); the client got {status} ({body:?}, replayed: {replayed:?})",
        ledger.runs(),
        attempts.count
    );
    assert_eq!(ledger.runs(), 1, "the handler charged {} times under one key", ledger.runs());
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(body, "charged (run 1), then the receipt service timed out", "the recorded 500");
    assert_eq!(replayed.as_ref().map(|v| v.to_str().unwrap()), Some("true"), "the client's last answer is the replay");
    assert_eq!(
        (attempts.count, attempts.stopped),
        (2, Some(Stopped::Replayed)),
        "the first 500, then its replay, which is final"
    );
    assert!(ledger.keys().iter().all(|k| *k == attempts.key));
}

#[tokio::test]
async fn http_client_survives_hostile_retry_after_headers() {
    // A slow 503 (over 1 s, so the elapsed time has whole seconds) asking for u64::MAX seconds.
    let (script, base) = Script::serve(&[(503, Some("18446744073709551615")), (201, None)]).await;
    *script.first_delay.lock().unwrap() = Some(ms(1_100));
    let start = Instant::now();
    let response = client(patient()).post(format!("{base}/orders")).send().await.unwrap();
    let noted = attempts(&response);
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!((noted.count, noted.stopped), (1, Some(Stopped::TimeBudgetExhausted)));
    assert!(start.elapsed() < Duration::from_secs(5), "returned at once, not after a wait: {:?}", start.elapsed());

    // Values past the budget stop at once; values that are not a wait are ignored (back-off).
    let hostile: [(&str, bool); 9] = [
        ("18446744073709551615", true),
        ("18446744073709551616", false),
        ("99999999999999999999999999999", false),
        ("Fri, 31 Dec 9999 23:59:59 GMT", true),
        ("-1", false),
        ("1e9", false),
        ("0x10", false),
        ("", false),
        ("3, 4", false),
    ];
    for (value, past_budget) in hostile {
        let (script, base) = Script::serve(&[(503, Some(value)), (201, None)]).await;
        let start = Instant::now();
        let response = client(patient()).post(format!("{base}/orders")).send().await.unwrap();
        let noted = attempts(&response);
        println!(
            "Retry-After: {value:?} -> {} after {} attempt(s) in {:?}",
            response.status(),
            noted.count,
            start.elapsed()
        );
        if past_budget {
            assert_eq!((noted.count, noted.stopped), (1, Some(Stopped::TimeBudgetExhausted)), "{value:?}");
        } else {
            assert_eq!((response.status(), noted.count), (StatusCode::CREATED, 2), "{value:?}: backed off");
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{value:?}: {:?}", start.elapsed());
        assert_eq!(script.seen().len(), noted.count as usize);
    }
}

#[derive(Clone)]
struct AttributeState {
    store: MemoryStore,
    ledger: Ledger,
}

/// Under `#[idempotent]`: charges (the ledger), then answers 502 as an `Ok` value, which the
/// attribute records like any other (an `Err` would mean "nothing was done" and release the key).
#[idempotent(key = key.shared_by_all_callers(), store = state.store)]
async fn charge_then_fail_attribute(
    State(state): State<AttributeState>,
    key: IdempotencyKeyHeader,
) -> Result<JsonResponse<String>, HttpError> {
    let run = state.ledger.runs.fetch_add(1, Ordering::SeqCst) + 1;
    Ok(JsonResponse::with_status(
        StatusCode::BAD_GATEWAY,
        format!("charged (run {run}), then the receipt service failed"),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_client_and_attribute_defaults_run_a_handler_that_charged_then_failed_once() {
    let ledger = Ledger::default();
    let state = AttributeState { store: MemoryStore::new(), ledger: ledger.clone() };
    let app = Router::new()
        .route("/charge-then-fail", post(charge_then_fail_attribute))
        .route_layer(RunToCompletionLayer)
        .with_state(state);
    let addr = serve(app).await;
    let response = client(RetryPolicy::default().jitter_seed(25))
        .post(format!("http://{addr}/charge-then-fail"))
        .send()
        .await
        .unwrap();
    let (attempts, headers, body) = read(response).await;
    println!("#[idempotent] and the client's defaults: ran {} time(s) in {} attempt(s)", ledger.runs(), attempts.count);
    assert_eq!(ledger.runs(), 1);
    assert_eq!(body, json!("charged (run 1), then the receipt service failed"));
    assert_eq!(headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(headers.get("idempotency-key").unwrap().to_str().unwrap(), attempts.key, "the key, echoed");
    assert_eq!((attempts.count, attempts.stopped), (2, Some(Stopped::Replayed)));
}

// ---------------------------------------------------------------- review: keyed requests on methods the layer does not cover

/// A server with the layer's defaults (and the caller choice it requires) over `PUT` and `POST`
/// `/charge-then-fail`, the layer covering `PUT` too, as README says to when clients key it.
async fn charge_then_fail_server(ledger: &Ledger) -> SocketAddr {
    let layer = IdempotencyLayer::new(MemoryStore::new()).keys_shared_by_all_callers();
    let app = Router::new()
        .route("/charge-then-fail", post(charge_then_fail).put(charge_then_fail))
        .route_layer(layer.methods([Method::POST, Method::PATCH, Method::PUT]))
        .layer(axum::middleware::from_fn_with_state(ledger.clone(), note_key))
        .with_state(ledger.clone());
    serve(app).await
}

/// The client retries a request that carries an `Idempotency-Key` whatever its method (and the
/// methods it is given), on the promise that the server runs it once per key. The layer covers
/// `POST` and `PATCH` by default and passes a keyed `PUT` through untouched: with both defaults, a
/// `PUT` whose handler charged and then answered `500` charged once per attempt (5 times, found in
/// review). README's rule, that a layer covers every method its clients send keys on, keeps it to
/// once: this server's layer covers `PUT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_client_keyed_put_runs_a_handler_that_charged_then_failed_once_where_the_layer_covers_put() {
    // The caller sets the key itself, as the client's docs invite ("a key the caller set makes any
    // request retried with it").
    let explicit = Ledger::default();
    let addr = charge_then_fail_server(&explicit).await;
    let response = client(RetryPolicy::default().jitter_seed(21))
        .put(format!("http://{addr}/charge-then-fail"))
        .header("idempotency-key", "3f0c6a9e-2b7d-4c1e-9a58-0d6e4b2f7a11")
        .body("charge 100")
        .send()
        .await
        .unwrap();
    let (status, noted) = (response.status(), attempts(&response));
    println!(
        "keyed PUT: the handler ran {} time(s) under key {} in {} attempt(s); the client got {status} ({:?})",
        explicit.runs(),
        noted.key,
        noted.count,
        noted.stopped
    );

    // The client configured for PUT (`methods`), the server left with its defaults.
    let configured = Ledger::default();
    let addr = charge_then_fail_server(&configured).await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(IdempotentRetry::new(RetryPolicy::default().jitter_seed(22)).methods([
            Method::POST,
            Method::PATCH,
            Method::PUT,
        ]))
        .build();
    let response = client.put(format!("http://{addr}/charge-then-fail")).body("charge 100").send().await.unwrap();
    let configured_attempts = attempts(&response);
    println!(
        "PUT in the client's methods: the handler ran {} time(s) under key {} in {} attempt(s)",
        configured.runs(),
        configured_attempts.key,
        configured_attempts.count
    );
    assert!(explicit.keys().iter().all(|k| *k == noted.key), "one key: {:?}", explicit.keys());
    assert_eq!(explicit.runs(), 1, "a keyed PUT charged {} times under one key", explicit.runs());
    assert_eq!(configured.runs(), 1, "a PUT keyed by the client charged {} times under one key", configured.runs());
}

/// `POST /validated`: the body must be `{"amount": <integer>}` (axum's `Json` extractor answers
/// `422` when it is not); a valid one is charged (the ledger) and answered `201`.
#[derive(serde::Deserialize)]
struct Amount {
    amount: u64,
}

async fn validated(State(ledger): State<Ledger>, axum::Json(charge): axum::Json<Amount>) -> Response {
    let run = ledger.runs.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!("charged {} (run {run})", charge.amount)).into_response()
}

/// A `422` that is the handler's own answer (here axum's `Json` rejection of a body of the wrong
/// shape, recorded by the layer like any response) is not a reused key: the key is fresh, the
/// request ran once and this is its answer. The client reports it as `OutboundError::KeyReused`,
/// with the advice to send a new key, and the response (its status and body) is lost to the caller.
#[tokio::test]
async fn http_client_handler_422_on_a_fresh_key_is_the_answer_not_key_reused() {
    let ledger = Ledger::default();
    let app = Router::new()
        .route("/validated", post(validated))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).keys_shared_by_all_callers())
        .layer(axum::middleware::from_fn_with_state(ledger.clone(), note_key))
        .with_state(ledger.clone());
    let addr = serve(app).await;
    let result = client(patient())
        .post(format!("http://{addr}/validated"))
        .header("content-type", JSON)
        .body(r#"{"amount":"ten"}"#)
        .send()
        .await;
    match &result {
        Ok(response) => println!("fresh key, invalid body: the client got {}", response.status()),
        Err(error) => println!("fresh key, invalid body: the client got an error: {error}"),
    }
    assert_eq!(ledger.keys().len(), 1, "one attempt, one fresh key: {:?}", ledger.keys());
    let response = result.expect("the server's own answer, a 422 that is not about the key");
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(response.text().await.unwrap().contains("amount"), "the handler's explanation reaches the caller");
}

// ---------------------------------------------------------------- review: derived keys across two services

/// A service under `IdempotencyLayer` with its defaults (scope `"http"`, keys bound to `x-user`)
/// whose handler pays at `bank` through `IdempotentRetry` (a derived key) and answers with the
/// bank's status and body.
async fn paying_service(bank: SocketAddr, route: &'static str) -> SocketAddr {
    async fn pay_at_bank(State(bank): State<SocketAddr>, body: Bytes) -> Response {
        let client = client(RetryPolicy::default().jitter_seed(30));
        let answer = client.post(format!("http://{bank}/transfers")).body(body).send().await.unwrap();
        let status = answer.status();
        let replayed = answer.headers().get("idempotent-replayed").is_some();
        let text = answer.text().await.unwrap();
        (status, format!("{text} (bank replayed: {replayed})")).into_response()
    }
    let app = Router::new()
        .route(route, post(pay_at_bank))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).caller(|parts| {
            parts.headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("anonymous").to_owned()
        }))
        .with_state(bank);
    serve(app).await
}

/// Two services, each with its own store and the layer's default scope, get one user's requests
/// under one `Idempotency-Key` (a client that keys a user action, sent to both services; each
/// service's own records are apart) and each pays the same amount at an internal bank whose keys
/// are shared by its callers. The derived key is made of the scope, the caller-bound key, the
/// position, the method and the path: the same for both services. The bank takes the second
/// transfer for a retry of the first and replays the first one's receipt: the second service is
/// told it paid, and nothing was paid for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_client_derived_keys_of_two_services_with_default_scopes_never_share_a_bank_record() {
    let ledger = Ledger::default();
    let bank_app = Router::new()
        .route("/transfers", post(charge))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).keys_shared_by_all_callers().scope("bank"))
        .layer(axum::middleware::from_fn_with_state(ledger.clone(), note_key))
        .with_state(ledger.clone());
    let bank = serve(bank_app).await;
    let shop = paying_service(bank, "/orders").await;
    let club = paying_service(bank, "/membership").await;

    let user_action = "7d1f0e52-1c39-4b8a-9f0e-2a6b3c4d5e6f";
    let plain = reqwest::Client::new();
    let mut answers = Vec::new();
    for url in [format!("http://{shop}/orders"), format!("http://{club}/membership")] {
        let answer = plain
            .post(url)
            .header("idempotency-key", user_action)
            .header("x-user", "kim")
            .body(r#"{"amount":10}"#)
            .send()
            .await
            .unwrap();
        answers.push((answer.status(), answer.text().await.unwrap()));
    }
    println!("bank keys {:?}, bank runs {}, answers {answers:?}", ledger.keys(), ledger.runs());
    assert!(answers.iter().all(|(status, _)| *status == StatusCode::CREATED), "{answers:?}");
    assert_eq!(ledger.runs(), 2, "two services each paid once: {answers:?}");
}

// ---------------------------------------------------------------- review: derived keys of concurrent requests

/// A body makes two requests concurrently (`join!`), each after a read whose latency varies (a
/// database, a token fetch: simulated by a sleep that differs between the two runs). The first
/// run pays both banks and then fails (its `Err` releases the key); the second run sends the
/// same two requests, but in the other order. With one position counter for the whole body each
/// got the position, and so the derived key, the other had, and both banks paid again (4
/// payments, found in review); counted per method and path, each keeps its key and both replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_client_derived_keys_of_concurrent_requests_survive_a_rerun_of_the_body() {
    let ledger = Ledger::default();
    let bank_app = Router::new()
        .route("/a", post(charge))
        .route("/b", post(charge))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).keys_shared_by_all_callers().scope("banks"))
        .layer(axum::middleware::from_fn_with_state(ledger.clone(), note_key))
        .with_state(ledger.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free port");
    let bank = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, bank_app).await.expect("the banks run") });
    let client = client(RetryPolicy::default().jitter_seed(40));
    let shop = MemoryStore::new();
    for (run, (read_a, read_b)) in [(1, (10, 80)), (2, (80, 10))] {
        let client = client.clone();
        let result = idempotent_runtime::Call::new("shop", "order-77")
            .run(&shop, async move {
                let pay = |path: &'static str, read: u64| {
                    let client = client.clone();
                    async move {
                        tokio::time::sleep(ms(read)).await; // the read before the request
                        client
                            .post(format!("http://{bank}{path}"))
                            .body(r#"{"amount":5}"#)
                            .send()
                            .await
                            .unwrap()
                            .status()
                    }
                };
                let (a, b) = tokio::join!(pay("/a", read_a), pay("/b", read_b));
                if run == 1 {
                    // Both paid; a later step fails before the order is recorded.
                    return Err(idempotent_runtime::Error::Fingerprint("the order could not be saved".into()));
                }
                Ok((a.as_u16(), b.as_u16()))
            })
            .await;
        println!("run {run}: {result:?}");
    }
    println!("bank keys {:?}, payments {}", ledger.keys(), ledger.runs());
    assert_eq!(ledger.runs(), 2, "one payment per bank for one order, over both runs of its body");
}

/// README: a handler's derived keys hash the method and path its request came on, not the body
/// or the query, so a retry after the key was released (here the handler answered `503` marked
/// `NotProcessed`) that the client re-formatted, with its query in another order, derives the same
/// keys. Another path under the same key derives others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_client_derived_keys_ignore_the_body_and_query_of_a_released_retry() {
    async fn derive(uri: axum::http::Uri) -> Response {
        let derived = idempotent_runtime::derived_key("POST", "/bank").expect("inside the call");
        if uri.path() == "/orders" {
            (StatusCode::SERVICE_UNAVAILABLE, idempotent_runtime::http::NotProcessed, derived).into_response()
        } else {
            (StatusCode::CREATED, derived).into_response()
        }
    }
    let app = Router::new()
        .route("/orders", post(derive))
        .route("/refunds", post(derive))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).keys_shared_by_all_callers());
    let addr = serve(app).await;
    let plain = reqwest::Client::new();
    let mut derived = Vec::new();
    for (target, body) in [
        ("/orders?a=1&b=2", r#"{"amount":10}"#),
        ("/orders?b=2&a=1", "{ \"amount\": 10 }"),
        ("/refunds?a=1&b=2", r#"{"amount":10}"#),
    ] {
        let answer = plain
            .post(format!("http://{addr}{target}"))
            .header("idempotency-key", "0b6f0c2e-5d1a-4c8e-9f3b-7a2d4e6c8b10")
            .body(body)
            .send()
            .await
            .unwrap();
        derived.push((answer.status(), answer.text().await.unwrap()));
    }
    println!("derived keys: {derived:?}");
    assert_eq!(derived[0].0, StatusCode::SERVICE_UNAVAILABLE, "the first run released its key");
    assert_eq!(derived[1].0, StatusCode::SERVICE_UNAVAILABLE, "the re-formatted retry ran again");
    assert_eq!(derived[0].1, derived[1].1, "one route, one derived key: {derived:?}");
    assert_eq!(derived[2].0, StatusCode::CREATED);
    assert_ne!(derived[2].1, derived[0].1, "another route, another key: {derived:?}");
}
