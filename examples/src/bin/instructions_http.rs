//! A fixed workload per case, for counting instructions with callgrind (`scripts/instructions`):
//! requests through an axum router in-process (`tower::ServiceExt::oneshot`, no sockets), plain
//! and behind `IdempotencyLayer` on the memory store.
//!
//! `instructions_http <case> <requests>` with the cases `http_plain` (the handler alone),
//! `http_first` (every request a new key), `http_replay` (2,000 recorded keys, in turn) and
//! `http_cached_replay` (the same replays through a `CachedStore` in front of the memory store:
//! every one a cache hit, the path a replay takes in front of Redis, except that a call on a
//! shared store also draws its owner token from the operating system, a system call valgrind
//! counts as a few instructions).

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

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(case), Some(requests)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: instructions_http <http_plain|http_first|http_replay|http_cached_replay> <requests>");
        return;
    };
    let requests: u64 = requests.parse().expect("a number of requests");
    let handler = post(|body: String| async move { (StatusCode::CREATED, body) });
    let plain = Router::new().route("/orders", handler.clone());
    let layered = Router::new()
        .route("/orders", handler.clone())
        .layer(IdempotencyLayer::new(MemoryStore::new()).keys_shared_by_all_callers());
    let cached = Router::new()
        .route("/orders", handler)
        .layer(IdempotencyLayer::new(CachedStore::new(MemoryStore::new())).keys_shared_by_all_callers());
    for key in 0..KEYS {
        layered.clone().oneshot(request(key)).await.expect("infallible");
        cached.clone().oneshot(request(key)).await.expect("infallible");
        plain.clone().oneshot(request(key)).await.expect("infallible");
    }
    for i in 0..requests {
        let (app, key) = match case.as_str() {
            "http_plain" => (&plain, i),
            "http_first" => (&layered, KEYS + i),
            "http_replay" => (&layered, i % KEYS),
            "http_cached_replay" => (&cached, i % KEYS),
            other => panic!("unknown case {other}"),
        };
        let status = app.clone().oneshot(request(key)).await.expect("infallible").status();
        assert_eq!(status, StatusCode::CREATED);
    }
}
