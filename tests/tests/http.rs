#![cfg(feature = "http")]
//! HTTP `Idempotency-Key` support, over real sockets: an axum server on 127.0.0.1 (random port)
//! and a hyper client. Both ways in are tested: `IdempotencyLayer` on routes, and `#[idempotent]`
//! on a handler with the `IdempotencyKeyHeader` extractor. The store is the memory store (the
//! layer only talks to the `Store` trait), and Redis for the client-disconnect scenario.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Json, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotent_runtime::http::{
    HttpError, IdempotencyKeyHeader, IdempotencyLayer, JsonResponse, NotProcessed, RunToCompletionLayer,
};
use idempotent_runtime::{
    Claim, ClaimRequest, Completion, Fingerprint, Key, MAX_KEY_BYTES, MemoryStore, RedisStore, Store, Token, idempotent,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

const MAX_REQUEST: usize = 1024;
const MAX_RESPONSE: usize = 2048;

// ---------------------------------------------------------------- the client

/// A response, read whole.
#[derive(Debug)]
struct Reply {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().expect("a visible ASCII header"))
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// Marked as a replay. A replayed `409` or `5xx` also tells Stripe's SDK, which retries those
    /// statuses, not to retry it (it would come back the same); no other response says so.
    fn replayed(&self) -> bool {
        let replayed = self.header("idempotent-replayed") == Some("true");
        let retried_by_stripe = self.status == 409 || self.status >= 500;
        let no_retry = (replayed && retried_by_stripe).then_some("false");
        assert_eq!(self.header("stripe-should-retry"), no_retry, "{self:?}");
        replayed
    }

    /// Asserts a problem response with this status and type.
    fn assert_problem(&self, status: u16, kind: &str) -> Value {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.header("content-type"), Some("application/problem+json"), "{self:?}");
        let problem = self.json();
        assert_eq!(problem["type"], kind, "{problem}");
        assert_eq!(problem["status"], status, "{problem}");
        assert!(problem["title"].as_str().is_some_and(|t| !t.is_empty()), "{problem}");
        assert!(problem["detail"].as_str().is_some_and(|t| t.len() > 20), "{problem}");
        problem
    }
}

#[derive(Clone)]
struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    addr: SocketAddr,
}

impl Http {
    fn new(addr: SocketAddr) -> Self {
        Http { client: Client::builder(TokioExecutor::new()).build_http(), base: format!("http://{addr}"), addr }
    }

    /// Sends a `POST` over a raw connection and closes it after `after`, before the response.
    async fn post_and_disconnect(&self, path: &str, headers: &[(&str, &str)], body: &str, after: Duration) {
        use std::fmt::Write as _;
        use tokio::io::AsyncWriteExt as _;
        let mut stream = tokio::net::TcpStream::connect(self.addr).await.expect("connect to the server");
        let mut request = format!("POST {path} HTTP/1.1\r\nhost: {}\r\ncontent-length: {}\r\n", self.addr, body.len());
        for (name, value) in headers {
            let _ = write!(request, "{name}: {value}\r\n");
        }
        request.push_str("\r\n");
        request.push_str(body);
        stream.write_all(request.as_bytes()).await.expect("send the request");
        tokio::time::sleep(after).await;
        drop(stream);
    }

    async fn post(&self, path: &str, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Reply {
        self.send("POST", path, headers, body.into()).await
    }

    async fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Bytes) -> Reply {
        let mut request = http::Request::builder().method(method).uri(format!("{}{path}", self.base));
        for (name, value) in headers {
            request = request.header(*name, HeaderValue::from_bytes(value.as_bytes()).expect("a valid header value"));
        }
        let request = request.body(Full::new(body)).expect("a valid request");
        let response = self.client.request(request).await.expect("the server answers");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("the body arrives").to_bytes();
        Reply { status: parts.status.as_u16(), headers: parts.headers, body }
    }
}

async fn serve(app: Router) -> Http {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free port on 127.0.0.1");
    let addr = listener.local_addr().expect("the bound address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("the server runs") });
    Http::new(addr)
}

fn key() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A layer whose keys are shared by all callers: these tests have one caller each.
fn shared<St: Store + 'static>(store: St) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store).keys_shared_by_all_callers()
}

// ---------------------------------------------------------------- the layer's routes

#[derive(Clone, Default)]
struct Counters {
    charges: Arc<AtomicUsize>,
    flaky: Arc<AtomicUsize>,
    large: Arc<AtomicUsize>,
}

/// Counts its runs; sleeps `x-delay-ms`; answers 201 with a JSON receipt echoing the body, a
/// `Location`, a recorded `x-receipt` and an unrecorded `x-trace`.
async fn charge(State(counters): State<Counters>, headers: HeaderMap, body: Bytes) -> Response {
    let run = counters.charges.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(delay) = headers.get("x-delay-ms").and_then(|v| v.to_str().ok()?.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let receipt = json!({ "run": run, "request": String::from_utf8_lossy(&body) });
    (
        StatusCode::CREATED,
        [
            ("location", format!("/charges/{run}")),
            ("x-receipt", format!("r-{run}")),
            ("x-trace", uuid::Uuid::new_v4().to_string()),
        ],
        axum::Json(receipt),
    )
        .into_response()
}

/// Answers 503 marked `NotProcessed` on its first run (it checked before doing anything), then 201.
async fn unavailable_once(State(counters): State<Counters>) -> Response {
    match counters.flaky.fetch_add(1, Ordering::SeqCst) {
        0 => (StatusCode::SERVICE_UNAVAILABLE, NotProcessed, "ledger down, nothing charged").into_response(),
        n => (StatusCode::CREATED, format!("charged after {n} refusal(s)")).into_response(),
    }
}

/// Fails with 503 on its first run, then succeeds.
async fn flaky(State(counters): State<Counters>) -> Response {
    match counters.flaky.fetch_add(1, Ordering::SeqCst) {
        0 => (StatusCode::SERVICE_UNAVAILABLE, "database down").into_response(),
        n => (StatusCode::OK, format!("ok after {n} failure(s)")).into_response(),
    }
}

/// Answers 404 (a final client error: recorded).
async fn missing() -> Response {
    (StatusCode::NOT_FOUND, "no such account").into_response()
}

/// Answers a body one byte over the response limit.
async fn large(State(counters): State<Counters>) -> Vec<u8> {
    counters.large.fetch_add(1, Ordering::SeqCst);
    vec![b'x'; MAX_RESPONSE + 1]
}

async fn layer_app() -> (Http, Counters) {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .scope("test-http")
        .caller(|parts| parts.headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("anonymous").to_owned())
        .record_header(HeaderName::from_static("x-receipt"))
        .max_request_bytes(MAX_REQUEST);
    edge_app(layer).await
}

// ---------------------------------------------------------------- the layer

#[tokio::test]
async fn http_layer_missing_key_is_400() {
    let (http, counters) = layer_app().await;
    let reply = http.post("/charges", &[], "{}").await;
    reply.assert_problem(400, "urn:idempotent:key-missing");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn http_layer_optional_key_passes_through_without_idempotency() {
    let counters = Counters::default();
    let layer = shared(MemoryStore::new()).optional();
    let app = Router::new().route("/charges", post(charge)).route_layer(layer).with_state(counters.clone());
    let http = serve(app).await;
    assert_eq!(http.post("/charges", &[], "a").await.status, 201);
    assert_eq!(http.post("/charges", &[], "a").await.status, 201);
    assert_eq!(counters.charges.load(Ordering::SeqCst), 2, "without a key, every request runs");
    let bad = http.post("/charges", &[("idempotency-key", "a b")], "a").await;
    bad.assert_problem(400, "urn:idempotent:key-malformed");
    let k = key();
    http.post("/charges", &[("idempotency-key", &k)], "a").await;
    assert!(http.post("/charges", &[("idempotency-key", &k)], "a").await.replayed());
    assert_eq!(counters.charges.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn http_layer_hands_on_requests_the_key_extractor_accepts_with_and_without_a_key() {
    // The layer runs each request to its end, so a handler behind it may extract the key; the
    // extractor refuses (500, misconfigured) a request not marked as running to its end.
    let seen = |key: Option<IdempotencyKeyHeader>| async move {
        key.map_or_else(|| "no key".to_owned(), |key| key.shared_by_all_callers().to_owned())
    };
    let app = Router::new().route("/charges", post(seen)).route_layer(shared(MemoryStore::new()).optional());
    let http = serve(app).await;
    let k = key();
    let first = http.post("/charges", &[("idempotency-key", &k)], "a").await;
    assert_eq!((first.status, &first.body[..]), (200, k.as_bytes()), "{:?}", first.body);
    let replay = http.post("/charges", &[("idempotency-key", &k)], "a").await;
    assert!(replay.replayed() && replay.body == first.body, "{:?}", replay.body);
    let keyless = http.post("/charges", &[], "a").await;
    assert_eq!((keyless.status, &keyless.body[..]), (200, &b"no key"[..]), "{:?}", keyless.body);
}

#[tokio::test]
async fn http_layer_malformed_or_too_long_key_is_400() {
    let (http, counters) = layer_app().await;
    let too_long = "k".repeat(MAX_KEY_BYTES + 1);
    for bad in ["", "\"\"", "a b", "a\tb", "a,b", "\"unterminated", "\"k\";param=1", too_long.as_str()] {
        let reply = http.post("/charges", &[("idempotency-key", bad)], "{}").await;
        let problem = reply.assert_problem(400, "urn:idempotent:key-malformed");
        if bad == too_long {
            assert!(problem["detail"].as_str().unwrap().contains("256 bytes"), "{problem}");
        }
    }
    let twice = http.post("/charges", &[("idempotency-key", "a"), ("idempotency-key", "b")], "{}").await;
    twice.assert_problem(400, "urn:idempotent:key-malformed");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 0, "no malformed key reaches the handler");

    // The longest key, a quoted sf-string and a bare UUID are all accepted.
    let longest = "k".repeat(MAX_KEY_BYTES);
    assert_eq!(http.post("/charges", &[("idempotency-key", &longest)], "{}").await.status, 201);
    assert_eq!(http.post("/charges", &[("idempotency-key", "\"quoted key\"")], "{}").await.status, 201);
    assert_eq!(http.post("/charges", &[("idempotency-key", &key())], "{}").await.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_layer_duplicate_while_running_is_409() {
    let (http, counters) = layer_app().await;
    let k = key();
    let slow = {
        let (http, k) = (http.clone(), k.clone());
        tokio::spawn(
            async move { http.post("/charges", &[("idempotency-key", &k), ("x-delay-ms", "600")], "{}").await },
        )
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let duplicate = http.post("/charges", &[("idempotency-key", &k), ("x-delay-ms", "600")], "{}").await;
    duplicate.assert_problem(409, "urn:idempotent:in-progress");
    // The running claim's remaining lease (60 s by default), capped at 5 s.
    let retry_after: u64 = duplicate.header("retry-after").unwrap().parse().unwrap();
    assert_eq!(retry_after, 5, "{duplicate:?}");
    let first = slow.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
    // Once the first has finished, the retry the 409 asked for gets its response.
    let retry = http.post("/charges", &[("idempotency-key", &k), ("x-delay-ms", "600")], "{}").await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
}

#[tokio::test]
async fn http_layer_key_reused_with_another_request_is_422() {
    let (http, counters) = layer_app().await;
    let k = key();
    assert_eq!(http.post("/charges", &[("idempotency-key", &k)], r#"{"amount":100}"#).await.status, 201);
    let other_body = http.post("/charges", &[("idempotency-key", &k)], r#"{"amount":5}"#).await;
    other_body.assert_problem(422, "urn:idempotent:key-reused");
    let other_path = http.post("/other", &[("idempotency-key", &k)], r#"{"amount":100}"#).await;
    other_path.assert_problem(422, "urn:idempotent:key-reused");
    let other_query = http.post("/charges?currency=eur", &[("idempotency-key", &k)], r#"{"amount":100}"#).await;
    other_query.assert_problem(422, "urn:idempotent:key-reused");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn http_layer_replay_is_identical_and_marked() {
    let (http, counters) = layer_app().await;
    let k = key();
    let first = http.post("/charges", &[("idempotency-key", &k)], r#"{"amount":100}"#).await;
    let replay = http.post("/charges", &[("idempotency-key", &k)], r#"{"amount":100}"#).await;
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1, "the handler ran once");

    assert_eq!(first.status, 201);
    assert!(!first.replayed(), "the first response is not marked: {first:?}");
    assert!(replay.replayed(), "the replay is marked: {replay:?}");
    assert_eq!(replay.status, first.status);
    assert_eq!(replay.body, first.body, "body bytes identical");
    assert_eq!(first.json()["request"], r#"{"amount":100}"#);
    for name in ["content-type", "location", "x-receipt", "content-length"] {
        assert!(first.header(name).is_some(), "{name} missing from {first:?}");
        assert_eq!(replay.header(name), first.header(name), "{name}");
    }
    // Headers of one exchange are not replayed; the first response keeps them.
    assert!(first.header("x-trace").is_some());
    assert_eq!(replay.header("x-trace"), None);
}

#[tokio::test]
async fn http_layer_records_4xx_responses() {
    let (http, _) = layer_app().await;
    let k = key();
    let first = http.post("/missing", &[("idempotency-key", &k)], "").await;
    let replay = http.post("/missing", &[("idempotency-key", &k)], "").await;
    assert_eq!((first.status, replay.status), (404, 404));
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_layer_64_concurrent_requests_with_one_key_run_once() {
    let (http, counters) = layer_app().await;
    let k = key();
    let requests: Vec<_> = (0..64)
        .map(|_| {
            let (http, k) = (http.clone(), k.clone());
            tokio::spawn(
                async move { http.post("/charges", &[("idempotency-key", &k), ("x-delay-ms", "300")], "{}").await },
            )
        })
        .collect();
    let mut executed = Vec::new();
    let (mut conflicts, mut replays) = (0, 0);
    for request in requests {
        let reply = request.await.unwrap();
        match reply.status {
            201 if reply.replayed() => replays += 1,
            201 => executed.push(reply),
            409 => {
                reply.assert_problem(409, "urn:idempotent:in-progress");
                conflicts += 1;
            }
            other => panic!("unexpected status {other}: {reply:?}"),
        }
    }
    println!("64 concurrent requests: 1 executed, {conflicts} got 409, {replays} got the replay");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(executed.len(), 1, "one response came from the handler");
    assert_eq!(1 + conflicts + replays, 64);
}

#[tokio::test]
async fn http_layer_keys_are_scoped_to_the_caller() {
    let (http, counters) = layer_app().await;
    let k = key();
    let alice = http.post("/charges", &[("idempotency-key", &k), ("x-user", "alice")], "alice's order").await;
    let bob = http.post("/charges", &[("idempotency-key", &k), ("x-user", "bob")], "bob's order").await;
    assert_eq!((alice.status, bob.status), (201, 201), "no 422: the keys are different records");
    assert!(!bob.replayed(), "bob never gets alice's response");
    assert_eq!(bob.json()["request"], "bob's order");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 2);
    let alice_again = http.post("/charges", &[("idempotency-key", &k), ("x-user", "alice")], "alice's order").await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
}

#[tokio::test]
async fn http_layer_not_processed_marker_releases_the_key_and_is_stripped() {
    let counters = Counters::default();
    let seen_marker = Arc::new(AtomicUsize::new(0));
    let outside = {
        let seen = Arc::clone(&seen_marker);
        axum::middleware::from_fn(move |request: axum::extract::Request, next: axum::middleware::Next| {
            let seen = Arc::clone(&seen);
            async move {
                let response = next.run(request).await;
                if NotProcessed::is_marked(&response) {
                    seen.fetch_add(1, Ordering::SeqCst);
                }
                response
            }
        })
    };
    let app = Router::new()
        .route("/unavailable-once", post(unavailable_once))
        .route_layer(shared(MemoryStore::new()))
        .layer(outside)
        .with_state(counters.clone());
    let http = serve(app).await;
    let k = key();
    let refused = http.post("/unavailable-once", &[("idempotency-key", &k)], "").await;
    assert_eq!((refused.status, &refused.body[..]), (503, &b"ledger down, nothing charged"[..]));
    let retry = http.post("/unavailable-once", &[("idempotency-key", &k)], "").await;
    assert_eq!((retry.status, retry.replayed()), (201, false), "the marked 503 released the key: {retry:?}");
    let replay = http.post("/unavailable-once", &[("idempotency-key", &k)], "").await;
    assert_eq!((replay.status, replay.replayed()), (201, true), "the success was recorded");
    assert_eq!(counters.flaky.load(Ordering::SeqCst), 2);
    assert_eq!(seen_marker.load(Ordering::SeqCst), 0, "the layer removes the marker: layers outside never see it");
}

#[tokio::test]
async fn http_layer_request_body_over_limit_is_413() {
    let (http, counters) = layer_app().await;
    let k = key();
    let reply = http.post("/charges", &[("idempotency-key", &k)], vec![b'a'; MAX_REQUEST + 1]).await;
    reply.assert_problem(413, "urn:idempotent:request-too-large");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 0);
    // The key was not used: the same key with a body at the limit runs.
    let reply = http.post("/charges", &[("idempotency-key", &k)], vec![b'a'; MAX_REQUEST]).await;
    assert_eq!(reply.status, 201);
}

// ---------------------------------------------------------------- the attribute and the extractor

#[derive(Clone)]
struct AppState<St> {
    store: St,
    runs: Arc<AtomicUsize>,
}

#[derive(Debug, Serialize, Deserialize)]
struct PayRequest {
    amount: i64,
    #[serde(default)]
    delay_ms: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    run: usize,
    user: String,
    amount: i64,
}

enum ApiError {
    Idempotency(HttpError),
    Unavailable,
}

impl From<idempotent_runtime::Error> for ApiError {
    fn from(error: idempotent_runtime::Error) -> Self {
        ApiError::Idempotency(error.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Idempotency(error) => error.into_response(),
            ApiError::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "ledger unavailable").into_response(),
        }
    }
}

fn user(headers: &HeaderMap) -> &str {
    headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("anonymous")
}

/// A negative amount fails with 503 (an `Err`: released, so a retry runs again). An amount of
/// 502 is charged, and then answered `502` (an `Ok` response: recorded, so a retry gets it back).
#[idempotent(key = key.for_caller(user(&headers)), store = state.store, fingerprint = body)]
async fn pay<St: Store>(
    State(state): State<AppState<St>>,
    key: IdempotencyKeyHeader,
    headers: HeaderMap,
    Json(body): Json<PayRequest>,
) -> Result<JsonResponse<Receipt>, ApiError> {
    let run = state.runs.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(Duration::from_millis(body.delay_ms)).await;
    if body.amount < 0 {
        return Err(ApiError::Unavailable);
    }
    let receipt = Receipt { run, user: user(&headers).to_owned(), amount: body.amount };
    if body.amount == 502 {
        return Ok(JsonResponse::with_status(StatusCode::BAD_GATEWAY, receipt));
    }
    Ok(JsonResponse::created(receipt))
}

async fn attribute_app() -> (Http, Arc<AtomicUsize>) {
    attribute_app_with(MemoryStore::new()).await
}

/// `/pay` under `#[idempotent]`, on its own task (`RunToCompletionLayer`), as the example does.
async fn attribute_app_with<St: Store + Clone + 'static>(store: St) -> (Http, Arc<AtomicUsize>) {
    let state = AppState { store, runs: Arc::default() };
    let runs = Arc::clone(&state.runs);
    let app = Router::new().route("/pay", post(pay::<St>)).route_layer(RunToCompletionLayer).with_state(state);
    (serve(app).await, runs)
}

fn pay_headers<'a>(key: &'a str, user: &'a str) -> [(&'a str, &'a str); 3] {
    [("idempotency-key", key), ("x-user", user), ("content-type", "application/json")]
}

/// A recorded `5xx` under the attribute is replayed marked as the layer's replays are:
/// `Idempotent-Replayed: true` and `Stripe-Should-Retry: false` (both checked by
/// `Reply::replayed`), so no client retries it in vain.
#[tokio::test]
async fn http_attribute_replays_a_recorded_5xx_marked() {
    let (http, runs) = attribute_app().await;
    let k = key();
    let first = http.post("/pay", &pay_headers(&k, "alice"), r#"{"amount":502}"#).await;
    let replay = http.post("/pay", &pay_headers(&k, "alice"), r#"{"amount":502}"#).await;
    assert_eq!((first.status, first.replayed()), (502, false), "{first:?}");
    assert_eq!((replay.status, replay.replayed()), (502, true), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn http_attribute_missing_or_malformed_key_is_400() {
    let (http, runs) = attribute_app().await;
    let missing = http.post("/pay", &[("content-type", "application/json")], r#"{"amount":1}"#).await;
    missing.assert_problem(400, "urn:idempotent:key-missing");
    let too_long = "k".repeat(MAX_KEY_BYTES + 1);
    for bad in ["", "a b", "\"a\\x\"", too_long.as_str()] {
        let reply = http.post("/pay", &pay_headers(bad, "alice"), r#"{"amount":1}"#).await;
        reply.assert_problem(400, "urn:idempotent:key-malformed");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn http_attribute_replays_and_refuses_a_changed_request_with_422() {
    let (http, runs) = attribute_app().await;
    let k = key();
    let first = http.post("/pay", &pay_headers(&k, "alice"), r#"{"amount":100}"#).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.header("content-type"), Some("application/json"));
    let replay = http.post("/pay", &pay_headers(&k, "alice"), r#"{"amount":100}"#).await;
    assert_eq!((replay.status, &replay.body), (201, &first.body));
    assert!(!first.replayed(), "{first:?}");
    assert!(replay.replayed(), "the attribute path marks replays like the layer: {replay:?}");
    assert_eq!(replay.json()["run"], 1);
    let changed = http.post("/pay", &pay_headers(&k, "alice"), r#"{"amount":5}"#).await;
    changed.assert_problem(422, "urn:idempotent:key-reused");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_attribute_64_concurrent_requests_run_once_others_409() {
    let (http, runs) = attribute_app().await;
    let k = key();
    let requests: Vec<_> = (0..64)
        .map(|_| {
            let (http, k) = (http.clone(), k.clone());
            tokio::spawn(
                async move { http.post("/pay", &pay_headers(&k, "alice"), r#"{"amount":7,"delay_ms":300}"#).await },
            )
        })
        .collect();
    let (mut ok, mut conflicts) = (0, 0);
    for request in requests {
        let reply = request.await.unwrap();
        match reply.status {
            201 => {
                assert_eq!(reply.json()["run"], 1);
                ok += 1;
            }
            409 => {
                reply.assert_problem(409, "urn:idempotent:in-progress");
                let retry_after: u64 = reply.header("retry-after").unwrap().parse().unwrap();
                assert_eq!(retry_after, 5, "the remaining lease of 60 s, capped: {retry_after}");
                conflicts += 1;
            }
            other => panic!("unexpected status {other}: {reply:?}"),
        }
    }
    println!("64 concurrent requests under #[idempotent]: {ok} got the receipt of run 1, {conflicts} got 409");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler body ran once");
    assert_eq!(ok + conflicts, 64);
    assert!(conflicts > 0, "with a 300 ms body, concurrent duplicates overlap it");
}

#[tokio::test]
async fn http_attribute_keys_are_scoped_to_the_caller() {
    let (http, runs) = attribute_app().await;
    let k = key();
    let alice = http.post("/pay", &pay_headers(&k, "alice"), r#"{"amount":100}"#).await;
    let bob = http.post("/pay", &pay_headers(&k, "bob"), r#"{"amount":5}"#).await;
    assert_eq!((alice.status, bob.status), (201, 201), "{bob:?}");
    assert_eq!(bob.json()["user"], "bob");
    assert_eq!(bob.json()["amount"], 5);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn http_attribute_err_is_not_processed_and_releases_the_key() {
    // Under the attribute an `Err` plays the role of `NotProcessed`: `pay` refuses a negative
    // amount before anything is charged, with a 503, and a retry may run.
    let (http, runs) = attribute_app().await;
    let k = key();
    let failed = http.post("/pay", &pay_headers(&k, "alice"), r#"{"amount":-1}"#).await;
    assert_eq!((failed.status, failed.replayed()), (503, false));
    let retry = http.post("/pay", &pay_headers(&k, "alice"), r#"{"amount":-1}"#).await;
    assert_eq!((retry.status, retry.replayed()), (503, false));
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the released key let the retry run again");
}

// ---------------------------------------------------------------- methods, paths, JSON, statuses

/// Counts its runs and answers 201 with the run number.
async fn counted(State(counters): State<Counters>) -> Response {
    let run = counters.charges.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!("run {run}")).into_response()
}

#[tokio::test]
async fn http_layer_applies_to_post_and_patch_only_by_default() {
    let counters = Counters::default();
    let app = Router::new()
        .route("/things", axum::routing::any(counted))
        .route_layer(shared(MemoryStore::new()))
        .with_state(counters.clone());
    let http = serve(app).await;
    for method in ["GET", "HEAD", "PUT", "DELETE", "OPTIONS"] {
        let k = key();
        let before = counters.charges.load(Ordering::SeqCst);
        for _ in 0..2 {
            let reply = http.send(method, "/things", &[("idempotency-key", &k)], Bytes::new()).await;
            assert_eq!(reply.status, 201, "{method}: {reply:?}");
            assert!(!reply.replayed(), "{method} passes through: {reply:?}");
        }
        assert_eq!(counters.charges.load(Ordering::SeqCst), before + 2, "{method} ran every time");
    }
    // Without a key, a GET is not refused either.
    assert_eq!(http.send("GET", "/things", &[], Bytes::new()).await.status, 201);
    for method in ["POST", "PATCH"] {
        let k = key();
        let first = http.send(method, "/things", &[("idempotency-key", &k)], Bytes::new()).await;
        let again = http.send(method, "/things", &[("idempotency-key", &k)], Bytes::new()).await;
        assert!(!first.replayed() && again.replayed(), "{method}: {again:?}");
        assert_eq!(first.body, again.body);
    }
    assert_eq!(http.send("POST", "/things", &[], Bytes::new()).await.status, 400, "POST still requires a key");
}

#[tokio::test]
async fn http_layer_methods_are_configurable() {
    let counters = Counters::default();
    let layer = shared(MemoryStore::new()).methods([http::Method::PUT]);
    let app = Router::new().route("/things", axum::routing::any(counted)).route_layer(layer).with_state(counters);
    let http = serve(app).await;
    let k = key();
    http.send("PUT", "/things", &[("idempotency-key", &k)], Bytes::new()).await;
    assert!(http.send("PUT", "/things", &[("idempotency-key", &k)], Bytes::new()).await.replayed());
    let post = http.send("POST", "/things", &[("idempotency-key", &k)], Bytes::new()).await;
    assert_eq!((post.status, post.replayed()), (201, false), "POST is no longer covered: {post:?}");
}

#[tokio::test]
async fn http_layer_fingerprint_covers_the_full_path_under_nested_routers() {
    let counters = Counters::default();
    let store = MemoryStore::new();
    let routes = || {
        Router::new()
            .route("/charges", post(charge))
            .route_layer(shared(store.clone()).scope("nested"))
            .with_state(counters.clone())
    };
    let app = Router::new().nest("/v1", routes()).nest("/v2", routes());
    let http = serve(app).await;
    let k = key();
    assert_eq!(http.post("/v1/charges", &[("idempotency-key", &k)], "same").await.status, 201);
    // The inner routers both see `/charges`; the client sent two different paths.
    let other = http.post("/v2/charges", &[("idempotency-key", &k)], "same").await;
    other.assert_problem(422, "urn:idempotent:key-reused");
    assert!(http.post("/v1/charges", &[("idempotency-key", &k)], "same").await.replayed());
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn http_layer_json_fingerprint_ignores_whitespace_and_key_order_when_asked() {
    let json = [("content-type", "application/json")];
    for aware in [false, true] {
        let counters = Counters::default();
        let mut layer = shared(MemoryStore::new());
        if aware {
            layer = layer.json_fingerprint();
        }
        let app = Router::new().route("/charges", post(charge)).route_layer(layer).with_state(counters.clone());
        let http = serve(app).await;
        let k = key();
        let with = |k: &str| [("idempotency-key", k.to_owned()), (json[0].0, json[0].1.to_owned())];
        let headers = with(&k);
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let first = http.post("/charges", &headers, r#"{"amount":100,"currency":"eur"}"#).await;
        assert_eq!(first.status, 201);
        let reordered = http.post("/charges", &headers, "{ \"currency\": \"eur\",\n  \"amount\": 100 }").await;
        if aware {
            assert!(reordered.replayed(), "same JSON, other whitespace and key order: {reordered:?}");
            assert_eq!(reordered.body, first.body);
        } else {
            reordered.assert_problem(422, "urn:idempotent:key-reused");
        }
        let changed = http.post("/charges", &headers, r#"{"currency":"eur","amount":101}"#).await;
        changed.assert_problem(422, "urn:idempotent:key-reused");
        assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
    }
}

/// Answers 401 (marked `NotProcessed`: refused before anything was done) until the request
/// carries `authorization: ok`, then 201.
async fn guarded(State(counters): State<Counters>, headers: HeaderMap) -> Response {
    let run = counters.charges.fetch_add(1, Ordering::SeqCst) + 1;
    match headers.get("authorization").and_then(|v| v.to_str().ok()) {
        Some("ok") => (StatusCode::CREATED, format!("run {run}")).into_response(),
        Some(_) => (StatusCode::FORBIDDEN, NotProcessed).into_response(),
        None => (StatusCode::UNAUTHORIZED, NotProcessed).into_response(),
    }
}

/// Refuses `/charges` without `authorization` with 401, before the layer (as an authentication
/// layer placed outside it does).
async fn authenticate(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    if request.uri().path() != "/charges" || request.headers().contains_key("authorization") {
        next.run(request).await
    } else {
        StatusCode::UNAUTHORIZED.into_response()
    }
}

#[tokio::test]
async fn http_layer_refusals_before_processing_release_the_key() {
    let counters = Counters::default();
    let app = Router::new()
        .route("/guarded", post(guarded))
        .route("/charges", post(charge))
        .route_layer(shared(MemoryStore::new()))
        .layer(axum::middleware::from_fn(authenticate))
        .with_state(counters.clone());
    let http = serve(app).await;
    let k = key();
    // The handler's own refusals, marked: not recorded.
    assert_eq!(http.post("/guarded", &[("idempotency-key", &k)], "").await.status, 401);
    let forbidden = http.post("/guarded", &[("idempotency-key", &k), ("authorization", "bad")], "").await;
    assert_eq!((forbidden.status, forbidden.replayed()), (403, false), "the 401 was not replayed");
    let fixed = http.post("/guarded", &[("idempotency-key", &k), ("authorization", "ok")], "").await;
    assert_eq!((fixed.status, fixed.replayed()), (201, false), "fixed credentials, same key: it runs");
    let replay = http.post("/guarded", &[("idempotency-key", &k), ("authorization", "ok")], "").await;
    assert!(replay.replayed());
    assert_eq!(counters.charges.load(Ordering::SeqCst), 3);

    // Authentication outside the layer: its 401 never reaches the layer, so the key is untouched.
    let k = key();
    assert_eq!(http.post("/charges", &[("idempotency-key", &k)], "").await.status, 401);
    let authenticated = http.post("/charges", &[("idempotency-key", &k), ("authorization", "ok")], "").await;
    assert_eq!((authenticated.status, authenticated.replayed()), (201, false), "{authenticated:?}");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn http_layer_retry_after_is_the_remaining_lease_rounded_up() {
    let counters = Counters::default();
    let layer = shared(MemoryStore::new()).lease(Duration::from_millis(4_500));
    let app = Router::new().route("/charges", post(charge)).route_layer(layer).with_state(counters.clone());
    let http = serve(app).await;
    let k = key();
    let slow = {
        let (http, k) = (http.clone(), k.clone());
        tokio::spawn(async move { http.post("/charges", &[("idempotency-key", &k), ("x-delay-ms", "600")], "").await })
    };
    wait_for(|| counters.charges.load(Ordering::SeqCst) == 1).await;
    let duplicate = http.post("/charges", &[("idempotency-key", &k)], "").await;
    duplicate.assert_problem(409, "urn:idempotent:in-progress");
    // 4.5 s minus the few milliseconds since the claim, rounded up: 5 (4 only if over 500 ms passed).
    let retry_after: u64 = duplicate.header("retry-after").unwrap().parse().unwrap();
    assert!((4..=5).contains(&retry_after), "{duplicate:?}");
    assert!(duplicate.json()["detail"].as_str().unwrap().contains(&format!("{retry_after} s")));
    assert_eq!(slow.await.unwrap().status, 201);
}

/// Panics on its first run, then answers 201.
async fn panics_once(State(counters): State<Counters>) -> Response {
    assert!(counters.flaky.fetch_add(1, Ordering::SeqCst) > 0, "the first run panics (this panic is expected)");
    (StatusCode::CREATED, "ok").into_response()
}

#[tokio::test]
async fn http_layer_handler_panic_is_500_and_releases_the_key() {
    let counters = Counters::default();
    let app = Router::new()
        .route("/panics", post(panics_once))
        .route_layer(shared(MemoryStore::new()))
        .with_state(counters.clone());
    let http = serve(app).await;
    let k = key();
    let failed = http.post("/panics", &[("idempotency-key", &k)], "").await;
    failed.assert_problem(500, "urn:idempotent:internal");
    let retry = http.post("/panics", &[("idempotency-key", &k)], "").await;
    assert_eq!((retry.status, retry.replayed()), (201, false), "the key was released: {retry:?}");
    assert_eq!(counters.flaky.load(Ordering::SeqCst), 2);
}

// ---------------------------------------------------------------- the client disconnects, then retries

/// Polls `done` every 10 ms for up to 10 s.
async fn wait_for(done: impl Fn() -> bool) {
    for _ in 0..1000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("waited 10 s in vain");
}

/// Retries (every 50 ms, for up to 10 s) while the answer is `409`, and returns the first other.
async fn retry_while_409(send: impl AsyncFn() -> Reply) -> Reply {
    for _ in 0..200 {
        let reply = send().await;
        if reply.status != 409 {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("still 409 after 10 s");
}

/// The scenario of issue 15: the handler charges, then awaits 1 s; the client gives up after
/// 200 ms and retries at once with the same key. The retry must get 409 (the first request runs
/// on), then the recorded response; the charge is made once.
async fn disconnect_then_retry(http: &Http, path: &str, headers: &[(&str, &str)], body: &str, charges: &AtomicUsize) {
    http.post_and_disconnect(path, headers, body, Duration::from_millis(200)).await;
    assert_eq!(charges.load(Ordering::SeqCst), 1, "the handler started and charged before the disconnect");
    let retry = http.post(path, headers, body.to_owned()).await;
    retry.assert_problem(409, "urn:idempotent:in-progress");
    let replay = retry_while_409(async || http.post(path, headers, body.to_owned()).await).await;
    assert_eq!(
        (replay.status, replay.replayed()),
        (201, true),
        "the abandoned request's response was recorded: {replay:?}"
    );
    assert_eq!(charges.load(Ordering::SeqCst), 1, "charged exactly once");
}

async fn disconnect_layer<St: Store + 'static>(store: St) {
    let counters = Counters::default();
    let app = Router::new()
        .route("/charges", post(charge))
        .route_layer(shared(store).scope("disconnect"))
        .with_state(counters.clone());
    let http = serve(app).await;
    let k = key();
    disconnect_then_retry(
        &http,
        "/charges",
        &[("idempotency-key", &k), ("x-delay-ms", "1000")],
        "{}",
        &counters.charges,
    )
    .await;
}

async fn disconnect_attribute<St: Store + Clone + 'static>(store: St) {
    let (http, runs) = attribute_app_with(store).await;
    let k = key();
    let headers = pay_headers(&k, "alice");
    disconnect_then_retry(&http, "/pay", &headers, r#"{"amount":7,"delay_ms":1000}"#, &runs).await;
}

async fn redis_store(test: &str) -> Option<RedisStore> {
    let url = idempotent_tests::services::redis_url(test)?;
    let prefix = format!("idempotent-test:{}:", uuid::Uuid::new_v4().simple());
    Some(RedisStore::connect(&url).await.expect("connect to Redis").with_prefix(prefix).expect("a valid prefix"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_layer_client_disconnect_then_retry_charges_once_memory() {
    disconnect_layer(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_layer_client_disconnect_then_retry_charges_once_redis() {
    let Some(store) = redis_store("http_layer_client_disconnect_then_retry_charges_once_redis").await else { return };
    disconnect_layer(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_attribute_client_disconnect_then_retry_charges_once_memory() {
    disconnect_attribute(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_attribute_client_disconnect_then_retry_charges_once_redis() {
    let Some(store) = redis_store("http_attribute_client_disconnect_then_retry_charges_once_redis").await else {
        return;
    };
    disconnect_attribute(store).await;
}

#[idempotent(key = key.shared_by_all_callers(), store = state.store)]
async fn pay_panics(
    State(state): State<AppState<MemoryStore>>,
    key: IdempotencyKeyHeader,
) -> Result<JsonResponse<u32>, HttpError> {
    assert!(state.runs.fetch_add(1, Ordering::SeqCst) > 0, "the first run panics (this panic is expected)");
    Ok(JsonResponse::created(1))
}

#[tokio::test]
async fn http_attribute_handler_panic_is_500_and_releases_the_key() {
    let state = AppState { store: MemoryStore::new(), runs: Arc::default() };
    let state_runs = Arc::clone(&state.runs);
    let app = Router::new().route("/pay", post(pay_panics)).route_layer(RunToCompletionLayer).with_state(state);
    let http = serve(app).await;
    let k = key();
    let failed = http.post("/pay", &[("idempotency-key", &k)], "").await;
    failed.assert_problem(500, "urn:idempotent:internal");
    let retry = http.post("/pay", &[("idempotency-key", &k)], "").await;
    assert_eq!((retry.status, retry.replayed()), (201, false), "the panic released the key: {retry:?}");
    assert_eq!(state_runs.load(Ordering::SeqCst), 2);
}

// ---------------------------------------------------------------- GET /metrics, as the example serves it

#[cfg(feature = "metrics")]
#[test]
fn http_metrics_are_served_in_the_prometheus_text_format() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    // The recorder is this thread's only: the server, the handlers and the client run on a
    // current-thread runtime here, so no other test's calls are counted.
    let body = metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let state = AppState { store: MemoryStore::new(), runs: Arc::default() };
            let app = Router::new()
                .route("/pay", post(pay::<MemoryStore>))
                .route_layer(RunToCompletionLayer)
                .with_state(state)
                .route("/metrics", axum::routing::get(move || std::future::ready(handle.render())));
            let http = serve(app).await;
            let k = key();
            for _ in 0..2 {
                assert_eq!(http.post("/pay", &pay_headers(&k, "alice"), r#"{"amount":1}"#).await.status, 201);
            }
            let scrape = http.send("GET", "/metrics", &[], Bytes::new()).await;
            assert_eq!(scrape.status, 200);
            String::from_utf8(scrape.body.to_vec()).unwrap()
        })
    });
    let line = |outcome: &str| {
        body.lines().find(|l| l.starts_with("idempotent_calls_total{") && l.contains(&format!("outcome=\"{outcome}\"")))
    };
    assert!(line("executed").is_some_and(|l| l.ends_with(" 1")), "{body}");
    assert!(line("replayed").is_some_and(|l| l.ends_with(" 1")), "{body}");
    assert!(body.contains("# TYPE idempotent_calls_total counter"), "{body}");
    assert!(body.contains("idempotent_store_step_seconds_count{store=\"memory\",step=\"claim\"} 2"), "{body}");
    assert!(body.contains("idempotent_store_step_seconds_count{store=\"memory\",step=\"complete\"} 1"), "{body}");
}

// ---------------------------------------------------------------- issue 20: never twice at the edge

/// Charges (counted), then returns a body that yields one chunk and fails: a stream cut mid-way,
/// after the handler made its effect.
async fn charge_then_broken_body(State(counters): State<Counters>) -> Response {
    counters.charges.fetch_add(1, Ordering::SeqCst);
    let chunks: Vec<Result<Bytes, std::io::Error>> =
        vec![Ok(Bytes::from_static(b"{\"charged\":")), Err(std::io::Error::other("the downstream reset"))];
    (StatusCode::CREATED, axum::body::Body::from_stream(futures_util::stream::iter(chunks))).into_response()
}

/// Charges (counted), then returns a body whose stream panics after its first chunk.
async fn charge_then_panicking_body(State(counters): State<Counters>) -> Response {
    counters.charges.fetch_add(1, Ordering::SeqCst);
    let mut sent = false;
    let stream = futures_util::stream::poll_fn(move |_| -> std::task::Poll<Option<Result<Bytes, std::io::Error>>> {
        assert!(!sent, "the body stream panics (this panic is expected)");
        sent = true;
        std::task::Poll::Ready(Some(Ok(Bytes::from_static(b"{\"charged\":"))))
    });
    (StatusCode::CREATED, axum::body::Body::from_stream(stream)).into_response()
}

/// Charges (counted), then streams `x-chunks` chunks of 64 KiB of `x`.
async fn charge_then_large_stream(State(counters): State<Counters>, headers: HeaderMap) -> Response {
    counters.large.fetch_add(1, Ordering::SeqCst);
    let chunks: usize = headers.get("x-chunks").and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(1);
    let stream =
        futures_util::stream::iter((0..chunks).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 64 * 1024]))));
    (StatusCode::OK, [("content-type", "application/octet-stream")], axum::body::Body::from_stream(stream))
        .into_response()
}

/// Every route of the layer's tests, under `layer` (with the response limit `MAX_RESPONSE`).
async fn edge_app<St: Store + 'static>(layer: IdempotencyLayer<St>) -> (Http, Counters) {
    let counters = Counters::default();
    let app = Router::new()
        .route("/broken-body", post(charge_then_broken_body))
        .route("/panicking-body", post(charge_then_panicking_body))
        .route("/large", post(large))
        .route("/large-stream", post(charge_then_large_stream))
        .route("/flaky", post(flaky))
        .route("/missing", post(missing))
        .route("/charges", post(charge))
        .route("/other", post(charge))
        .route_layer(layer.max_response_bytes(MAX_RESPONSE))
        .with_state(counters.clone());
    (serve(app).await, counters)
}

#[tokio::test]
async fn http_layer_response_stream_that_fails_or_panics_after_the_charge_is_recorded_and_never_rerun() {
    let (http, counters) = edge_app(shared(MemoryStore::new())).await;
    for (path, how) in [("/broken-body", "failing"), ("/panicking-body", "panicking")] {
        let before = counters.charges.load(Ordering::SeqCst);
        let k = key();
        let first = http.post(path, &[("idempotency-key", &k)], "").await;
        let retry = http.post(path, &[("idempotency-key", &k)], "").await;
        let runs = counters.charges.load(Ordering::SeqCst) - before;
        println!(
            "a response stream {how} after the charge: {} then {} (replayed: {}), ran {runs} time(s)",
            first.status,
            retry.status,
            retry.replayed()
        );
        assert_eq!(runs, 1, "{path}: once the handler returned a response, its key is never released");
        first.assert_problem(500, "urn:idempotent:response-failed");
        assert!(!first.replayed());
        retry.assert_problem(500, "urn:idempotent:response-failed");
        assert!(retry.replayed(), "{path}: the retry gets the recorded failure, marked: {retry:?}");
    }
}

#[tokio::test]
async fn http_layer_response_over_the_recording_limit_reaches_its_client_whole_and_replays_say_why() {
    let (http, counters) = edge_app(shared(MemoryStore::new())).await;
    // One chunk one byte over the limit, and a stream of 16 chunks of 64 KiB (1 MiB) over it.
    for (path, chunks, expected) in [("/large", "1", MAX_RESPONSE + 1), ("/large-stream", "16", 16 * 64 * 1024)] {
        let k = key();
        let headers = [("idempotency-key", k.as_str()), ("x-chunks", chunks)];
        let first = http.post(path, &headers, "").await;
        println!(
            "{path}: a {expected}-byte response over the {MAX_RESPONSE}-byte recording limit: first {} with {} bytes",
            first.status,
            first.body.len()
        );
        assert_eq!(first.status, 200, "{path}: the client that ran it gets its response: {:?}", first.headers);
        assert_eq!(first.body.len(), expected, "{path}: the whole body, not truncated");
        assert!(first.body.iter().all(|&b| b == b'x'), "{path}");
        assert!(!first.replayed());
        let retry = http.post(path, &headers, "").await;
        let problem = retry.assert_problem(500, "urn:idempotent:response-too-large");
        assert!(retry.replayed(), "{path}: {retry:?}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains("2048 bytes") && detail.contains("was processed"), "{detail}");
    }
    assert_eq!(counters.large.load(Ordering::SeqCst), 2, "each ran once");
}

#[tokio::test]
async fn http_layer_response_over_the_store_limit_reaches_its_client_and_replays_are_final() {
    // The receipt echoes the 1 KiB body: within the layer's limit (2048 bytes), its record over
    // the store's (1024 bytes).
    let (http, counters) = edge_app(shared(MemoryStore::with_max_record_bytes(1024))).await;
    let k = key();
    let first = http.post("/charges", &[("idempotency-key", &k)], vec![b'a'; MAX_REQUEST]).await;
    assert_eq!((first.status, first.replayed()), (201, false), "the request that ran gets its response");
    let retry = http.post("/charges", &[("idempotency-key", &k)], vec![b'a'; MAX_REQUEST]).await;
    retry.assert_problem(500, "urn:idempotent:internal");
    assert!(retry.replayed(), "the record is final, and says so: {retry:?}");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn http_layer_records_a_5xx_the_handler_produced() {
    let (http, counters) = edge_app(shared(MemoryStore::new())).await;
    let k = key();
    let failed = http.post("/flaky", &[("idempotency-key", &k)], "").await;
    assert_eq!((failed.status, &failed.body[..]), (503, &b"database down"[..]));
    let retry = http.post("/flaky", &[("idempotency-key", &k)], "").await;
    println!("a handler's 503: retried with the same key, got {} (replayed: {})", retry.status, retry.replayed());
    assert_eq!((retry.status, retry.replayed()), (503, true), "the handler's 503 was recorded: {retry:?}");
    assert_eq!(retry.body, failed.body);
    assert_eq!(counters.flaky.load(Ordering::SeqCst), 1, "the handler ran once");
}

#[tokio::test]
async fn http_layer_echoes_the_request_idempotency_key_on_its_responses() {
    let (http, _) = layer_app().await;
    let k = key();
    let quoted = format!("\"{k}\"");
    for sent in [k.as_str(), quoted.as_str()] {
        let first = http.post("/charges", &[("idempotency-key", sent)], "a").await;
        let replay = http.post("/charges", &[("idempotency-key", sent)], "a").await;
        let reused = http.post("/charges", &[("idempotency-key", sent)], "b").await;
        for reply in [&first, &replay, &reused] {
            assert_eq!(reply.header("idempotency-key"), Some(sent), "the key as sent, echoed: {reply:?}");
        }
        assert!(replay.replayed());
        assert_eq!(reused.status, 422);
    }
    let (http, _) = attribute_app().await;
    let k = key();
    let first = http.post("/pay", &pay_headers(&k, "alice"), r#"{"amount":1}"#).await;
    let replay = http.post("/pay", &pay_headers(&k, "alice"), r#"{"amount":1}"#).await;
    for reply in [&first, &replay] {
        assert_eq!(reply.header("idempotency-key"), Some(k.as_str()), "the attribute's routes too: {reply:?}");
    }
}

#[tokio::test]
async fn http_layer_json_fingerprint_never_merges_different_number_texts() {
    let (http, _) = edge_app(shared(MemoryStore::new()).json_fingerprint()).await;
    let pairs = [
        ("12345678901234567.89", "12345678901234567.00"),
        ("18446744073709551616", "18446744073709551617"),
        ("-18446744073709551616", "-18446744073709551617"),
        ("0.1", "0.10000000000000001"),
        ("1.0000000000000001", "1.0"),
        ("-0", "0"),
        ("-0.0", "0.0"),
        ("1e2", "100"),
        ("1E2", "1e2"),
        ("1e+2", "1e2"),
        ("1e400", "1e401"),
        ("100", "100.0"),
    ];
    let mut merged = Vec::new();
    for (first, second) in pairs {
        let k = key();
        let headers = [("idempotency-key", k.as_str()), ("content-type", "application/json")];
        let one = http.post("/charges", &headers, format!(r#"{{"amount":{first}}}"#)).await;
        assert_eq!(one.status, 201, "{first}: {one:?}");
        let two = http.post("/charges", &headers, format!(r#"{{"amount":{second}}}"#)).await;
        if two.status != 422 {
            merged.push(format!("{first} ~ {second}: {} (replayed: {})", two.status, two.replayed()));
        }
    }
    println!(
        "json_fingerprint: {} of {} pairs of different number texts merged: {merged:#?}",
        merged.len(),
        pairs.len()
    );
    assert!(merged.is_empty(), "different number texts are different requests: {merged:#?}");
    // What stays the same request: whitespace, key order and string escapes around the same texts.
    let k = key();
    let headers = [("idempotency-key", k.as_str()), ("content-type", "application/json")];
    let one = http.post("/charges", &headers, r#"{"b":1e2,"a":-0,"c":"A"}"#).await;
    let two = http.post("/charges", &headers, "{ \"c\" : \"\\u0041\", \"a\" : -0 ,\n \"b\" : 1e2 }").await;
    assert!(two.replayed() && two.body == one.body, "{two:?}");
}

#[idempotent(key = key.shared_by_all_callers(), store = state.store, lease = "1s")]
async fn pay_unguarded(
    State(state): State<AppState<MemoryStore>>,
    key: IdempotencyKeyHeader,
) -> Result<JsonResponse<usize>, HttpError> {
    let run = state.runs.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(Duration::from_secs(1)).await;
    Ok(JsonResponse::created(run))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_attribute_without_run_to_completion_fails_loudly_instead_of_running_twice() {
    let state = AppState { store: MemoryStore::new(), runs: Arc::default() };
    let runs = Arc::clone(&state.runs);
    // The mistake: an `#[idempotent]` handler served without `RunToCompletionLayer`.
    let app = Router::new().route("/pay", post(pay_unguarded)).with_state(state);
    let http = serve(app).await;
    let k = key();
    let headers = [("idempotency-key", k.as_str())];
    // The client gives up after 200 ms; hyper drops the handler (which charged at once); the
    // claim is kept for its 1 s lease; a retry after it runs the handler again.
    http.post_and_disconnect("/pay", &headers, "", Duration::from_millis(200)).await;
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let retry = retry_while_409(async || http.post("/pay", &headers, Bytes::new()).await).await;
    let ran = runs.load(Ordering::SeqCst);
    println!(
        "#[idempotent] without RunToCompletionLayer, disconnect then retry: {} and ran {ran} time(s)",
        retry.status
    );
    assert!(ran <= 1, "the handler ran {ran} times under one key");
    let problem = retry.assert_problem(500, "urn:idempotent:misconfigured");
    assert!(problem["detail"].as_str().unwrap().contains("RunToCompletionLayer"), "{problem}");
    assert_eq!(ran, 0, "a handler that could be cancelled half-way never starts");
}

#[test]
fn http_layer_without_a_caller_choice_fails_at_startup_naming_both_fixes() {
    let built = std::panic::catch_unwind(|| {
        Router::<()>::new()
            .route("/charges", post(|| async { "charged" }))
            .route_layer(IdempotencyLayer::new(MemoryStore::new()))
    });
    let Err(panic) = built else { panic!("a layer that shares keys across callers without saying so was built") };
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    println!("{message}");
    assert!(message.contains(".caller(") && message.contains(".keys_shared_by_all_callers()"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_layer_store_down_before_the_claim_is_503_and_not_recorded_redis() {
    use idempotent_tests::proxy::Mode;
    let test = "http_layer_store_down_before_the_claim_is_503_and_not_recorded_redis";
    let Some((store, cleanup, proxy)) = idempotent_tests::fresh::redis_behind_proxy(test).await else { return };
    let (http, counters) = edge_app(shared(store)).await;
    proxy.set_mode(Mode::Refuse);
    proxy.kill_connections();
    let k = key();
    let down = http.post("/charges", &[("idempotency-key", &k)], "{}").await;
    down.assert_problem(503, "urn:idempotent:store-unavailable");
    assert!(down.header("retry-after").is_some(), "{down:?}");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 0, "nothing ran");
    proxy.set_mode(Mode::Pass);
    let mut reply = http.post("/charges", &[("idempotency-key", &k)], "{}").await;
    for _ in 0..100 {
        if reply.status != 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        reply = http.post("/charges", &[("idempotency-key", &k)], "{}").await;
    }
    assert_eq!((reply.status, reply.replayed()), (201, false), "the 503 was not recorded: the retry ran: {reply:?}");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
    cleanup.run().await;
}

// ---------------------------------------------------------------- records of earlier versions

/// Writes `outcome` into `store` as the record of `key` (scope `legacy`), with `fingerprint`.
async fn write_record<St: Store>(store: &St, key: &str, fingerprint: Option<&Fingerprint>, outcome: &[u8]) {
    let key = Key::new("legacy", key).expect("a valid key");
    let token = Token::new();
    let claim = store.claim(&ClaimRequest::new(&key, &token, fingerprint, Duration::from_secs(60))).await;
    assert_eq!(claim.expect("the store answers"), Claim::Claimed);
    let completion = Completion::new(&key, &token, fingerprint, outcome, Duration::from_secs(600));
    store.complete(&completion).await.expect("the record is written");
}

/// Records the layer wrote before its compact record form (JSON objects, `{"Ok":{"Response":..}}`)
/// still replay from `store` after an upgrade: the response, `TooLarge` and `Failed` records.
async fn legacy_records_replay<St: Store + Clone + 'static>(store: St) {
    let (http, counters) = edge_app(shared(store.clone()).scope("legacy")).await;
    let body = r#"{"amount":5}"#;
    // A request run now gives the fingerprint the layer computes for this request, and its record
    // is in the compact form.
    let now = key();
    assert_eq!(http.post("/charges", &[("idempotency-key", &now)], body).await.status, 201);
    let probe = Key::new("legacy", now.as_str()).expect("a valid key");
    let token = Token::new();
    let request = ClaimRequest::new(&probe, &token, None, Duration::from_secs(60));
    let Claim::Completed(record) = store.claim(&request).await.expect("the store answers") else {
        panic!("the first request's record is not there")
    };
    assert!(record.outcome.starts_with(br#"{"Ok":"h201"#), "{:?}", record.outcome);
    let fingerprint = record.fingerprint.clone();
    assert!(fingerprint.is_some());

    let legacy = br#"{"Ok":{"Response":{"status":201,"headers":[["content-type",{"Text":"application/json"}],["location",{"Text":"/charges/legacy"}],["x-bin",{"Base64":"/3Rlc3Q="}]],"body":{"Text":"{\"legacy\":true}"}}}}"#;
    let old = key();
    write_record(&store, &old, fingerprint.as_ref(), legacy).await;
    let replay = http.post("/charges", &[("idempotency-key", &old)], body).await;
    assert_eq!(replay.status, 201, "{replay:?}");
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.header("location"), Some("/charges/legacy"));
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert_eq!(replay.headers.get("x-bin").map(HeaderValue::as_bytes), Some(&b"\xfftest"[..]));
    assert_eq!(replay.json(), json!({ "legacy": true }));
    // The old record's fingerprint still refuses another request with the key.
    http.post("/charges", &[("idempotency-key", &old)], r#"{"amount":6}"#)
        .await
        .assert_problem(422, "urn:idempotent:key-reused");

    for (outcome, kind) in [
        (&br#"{"Ok":{"TooLarge":{"limit":2048}}}"#[..], "urn:idempotent:response-too-large"),
        (&br#"{"Ok":{"Failed":{"reason":"the stream broke"}}}"#[..], "urn:idempotent:response-failed"),
    ] {
        let old = key();
        write_record(&store, &old, fingerprint.as_ref(), outcome).await;
        let replay = http.post("/charges", &[("idempotency-key", &old)], body).await;
        replay.assert_problem(500, kind);
        assert!(replay.replayed(), "{replay:?}");
    }
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1, "only the request run now charged");
}

#[tokio::test]
async fn http_layer_legacy_records_replay_memory() {
    legacy_records_replay(MemoryStore::new()).await;
}

#[tokio::test]
async fn http_layer_legacy_records_replay_redis() {
    let Some((store, cleanup)) = idempotent_tests::fresh::redis("http_layer_legacy_records_replay_redis").await else {
        return;
    };
    legacy_records_replay(store).await;
    cleanup.run().await;
}

#[tokio::test]
async fn http_layer_legacy_records_replay_postgres() {
    let Some((store, cleanup)) = idempotent_tests::fresh::postgres("http_layer_legacy_records_replay_postgres").await
    else {
        return;
    };
    legacy_records_replay(store).await;
    cleanup.run().await;
}

/// README, "A process that cannot run for a whole lease looks crashed": a handler whose thread is
/// held past its lease (so the heartbeat, polled in the same task, cannot renew the claim) loses
/// the key to a duplicate, which runs. The first request is then answered `500`, "Request outcome
/// not recorded", never its handler's `201`, and later requests replay the duplicate's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_a_handler_starved_past_its_lease_is_told_its_outcome_was_not_recorded_memory() {
    let (release, held) = std::sync::mpsc::channel::<()>();
    let held = Arc::new(std::sync::Mutex::new(held));
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (runs, held) = (Arc::clone(&runs), Arc::clone(&held));
        move || {
            let (runs, held) = (Arc::clone(&runs), Arc::clone(&held));
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                if run == 1 {
                    // Starved: this task does nothing, its heartbeat included, until released.
                    tokio::task::block_in_place(|| held.lock().unwrap().recv().expect("the test releases run 1"));
                }
                (StatusCode::CREATED, format!("run {run}"))
            }
        }
    };
    let lease = Duration::from_millis(50);
    let app = Router::new().route("/pay", post(handler)).route_layer(shared(MemoryStore::new()).lease(lease));
    let http = serve(app).await;
    let key = key();
    let first = {
        let (http, key) = (http.clone(), key.clone());
        tokio::spawn(async move { http.post("/pay", &[("idempotency-key", key.as_str())], "{}").await })
    };
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(lease * 4).await;
    let duplicate = http.post("/pay", &[("idempotency-key", key.as_str())], "{}").await;
    assert_eq!((duplicate.status, duplicate.replayed()), (201, false), "the claim lapsed; the duplicate ran");
    assert_eq!(duplicate.body, "run 2");
    release.send(()).expect("run 1 waits");
    let first = first.await.expect("the first request's task");
    let problem = first.assert_problem(500, "urn:idempotent:internal");
    assert_eq!(problem["title"], "Request outcome not recorded", "{problem}");
    assert_eq!(first.header("idempotency-key"), Some(key.as_str()));
    let later = http.post("/pay", &[("idempotency-key", key.as_str())], "{}").await;
    assert_eq!((later.status, later.replayed(), later.body), (201, true, Bytes::from("run 2")));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

// ---------------------------------------------------------------- review: `wait` with a lease shorter than the handler

/// `wait` longer than the handler, the lease shorter than it: the heartbeat keeps the first
/// request's claim, so the duplicates wait for its record and get it replayed; none of them runs
/// the handler after the first lease has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_layer_wait_with_a_lease_shorter_than_the_handler_runs_it_once() {
    let counters = Counters::default();
    let app = Router::new()
        .route("/charges", post(charge))
        .route_layer(
            shared(MemoryStore::new())
                .scope("wait-short-lease")
                .lease(Duration::from_secs(1))
                .wait(Duration::from_secs(6)),
        )
        .with_state(counters.clone());
    let http = serve(app).await;
    let k = key();
    let headers = [("idempotency-key", k.as_str()), ("x-delay-ms", "2500")];
    let mut replies = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..8u64 {
        let http = http.clone();
        let headers: Vec<(String, String)> = headers.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(i * 200)).await;
            let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
            http.post("/charges", &headers, "charge 5").await
        }));
    }
    for task in tasks {
        replies.push(task.await.unwrap());
    }
    let statuses: Vec<(u16, bool)> = replies.iter().map(|r| (r.status, r.replayed())).collect();
    println!(
        "wait 6 s, lease 1 s, handler 2.5 s: runs {}, replies {statuses:?}",
        counters.charges.load(Ordering::SeqCst)
    );
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
    assert!(replies.iter().all(|r| r.status == 201), "{statuses:?}");
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1, "{statuses:?}");
}

/// Answers `200` at once with a body streamed over `x-delay-ms` (five chunks), counting its runs.
async fn slow_body(State(counters): State<Counters>, headers: HeaderMap) -> Response {
    let run = counters.charges.fetch_add(1, Ordering::SeqCst) + 1;
    let delay: u64 = headers.get("x-delay-ms").and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(0);
    let chunks = futures_util::stream::unfold(0u64, move |i| async move {
        if i == 5 {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(delay / 5)).await;
        Some((Ok::<_, std::io::Error>(Bytes::from(format!("run {run} chunk {i};"))), i + 1))
    });
    (StatusCode::OK, axum::body::Body::from_stream(chunks)).into_response()
}

/// The handler answers at once and its body streams for longer than the lease: a duplicate sent
/// while the body still streams gets `409` (the claim is renewed while the body is read), and a
/// retry after it gets the whole body replayed; the handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_layer_response_body_streaming_past_the_lease_runs_the_handler_once() {
    let counters = Counters::default();
    let app = Router::new()
        .route("/slow-body", post(slow_body))
        .route_layer(shared(MemoryStore::new()).scope("slow-body").lease(Duration::from_secs(1)))
        .with_state(counters.clone());
    let http = serve(app).await;
    let k = key();
    let first = {
        let (http, k) = (http.clone(), k.clone());
        tokio::spawn(
            async move { http.post("/slow-body", &[("idempotency-key", &k), ("x-delay-ms", "2500")], "x").await },
        )
    };
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    let during = http.post("/slow-body", &[("idempotency-key", &k), ("x-delay-ms", "2500")], "x").await;
    let first = first.await.unwrap();
    let after = http.post("/slow-body", &[("idempotency-key", &k), ("x-delay-ms", "2500")], "x").await;
    println!(
        "body streaming 2.5 s, lease 1 s: runs {}, first {} {:?}, during {}, after {} replayed {} {:?}",
        counters.charges.load(Ordering::SeqCst),
        first.status,
        first.body,
        during.status,
        after.status,
        after.replayed(),
        after.body
    );
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
    assert_eq!(during.status, 409);
    assert!(after.replayed());
    assert_eq!(after.body, first.body);
}
