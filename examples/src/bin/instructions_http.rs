//! A fixed workload per case, for counting instructions with callgrind (`scripts/instructions`):
//! requests through an axum router in-process (`tower::ServiceExt::oneshot`, no sockets), plain
//! and behind `IdempotencyLayer` on the memory store.
//!
//! `instructions_http <case> <requests>` with the cases `http_plain` (the handler alone),
//! `http_first` (every request a new key), `http_replay` (2,000 recorded keys, in turn),
//! `http_cached_replay` (the same replays through a `CachedStore` in front of the memory store:
//! every one a cache hit, the path a replay takes in front of Redis, except that a call on a
//! shared store also draws its owner token from the operating system, a system call valgrind
//! counts as a few instructions), and `http_first_caller` and `http_replay_caller` (a layer that
//! binds each key to its caller, read from an `x-user` header, with UUID keys, as most clients
//! send them).

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idempotent_runtime::MemoryStore;
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::stores::cache::CachedStore;
use tower::ServiceExt as _;

const KEYS: u64 = 2_000;

fn request(key: u64) -> Request<Body> {
    Request::post("/orders")
        .header("idempotency-key", format!("k-{key}"))
        .header("content-type", "application/json")
        .body(Body::from(r#"{"item":"book","quantity":1}"#))
        .expect("a valid request")
}

/// A request from the user `user-1` with a UUID-shaped key (36 characters) for `key`.
fn caller_request(key: u64) -> Request<Body> {
    Request::post("/orders")
        .header("idempotency-key", format!("{:08x}-0000-4000-8000-{:012x}", key >> 16, key & 0xffff))
        .header("x-user", "user-1")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"item":"book","quantity":1}"#))
        .expect("a valid request")
}

/// `router` as `axum::serve` runs it: with its state given (`into_make_service` does that), so
/// that each route's handler is made into a service, every layer applied, once. A `Router<()>`
/// called as it is does that again for every request, and would be counted here with costs
/// (three allocations per layered request) a server does not have.
fn served(router: Router) -> Router {
    router.with_state(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(case), Some(requests)) = (args.get(1), args.get(2)) else {
        eprintln!(
            "usage: instructions_http <http_plain|http_first|http_replay|http_cached_replay|http_first_caller|\
             http_replay_caller> <requests>"
        );
        return;
    };
    let requests: u64 = requests.parse().expect("a number of requests");
    let handler = post(|body: String| async move { (StatusCode::CREATED, body) });
    let plain = served(Router::new().route("/orders", handler.clone()));
    let layered = served(
        Router::new()
            .route("/orders", handler.clone())
            .layer(IdempotencyLayer::new(MemoryStore::new()).keys_shared_by_all_callers()),
    );
    let cached = served(
        Router::new()
            .route("/orders", handler.clone())
            .layer(IdempotencyLayer::new(CachedStore::new(MemoryStore::new())).keys_shared_by_all_callers()),
    );
    let user = |parts: &axum::http::request::Parts| {
        parts.headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
    };
    let by_caller =
        served(Router::new().route("/orders", handler).layer(IdempotencyLayer::new(MemoryStore::new()).caller(user)));
    for key in 0..KEYS {
        layered.clone().oneshot(request(key)).await.expect("infallible");
        cached.clone().oneshot(request(key)).await.expect("infallible");
        plain.clone().oneshot(request(key)).await.expect("infallible");
        by_caller.clone().oneshot(caller_request(key)).await.expect("infallible");
    }
    for i in 0..requests {
        let (app, request) = match case.as_str() {
            "http_plain" => (&plain, request(i)),
            "http_first" => (&layered, request(KEYS + i)),
            "http_replay" => (&layered, request(i % KEYS)),
            "http_cached_replay" => (&cached, request(i % KEYS)),
            "http_first_caller" => (&by_caller, caller_request(KEYS + i)),
            "http_replay_caller" => (&by_caller, caller_request(i % KEYS)),
            other => panic!("unknown case {other}"),
        };
        let status = app.clone().oneshot(request).await.expect("infallible").status();
        assert_eq!(status, StatusCode::CREATED);
    }
}
