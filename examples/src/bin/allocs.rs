//! Heap allocations per call, counted by dhat's allocator: `#[idempotent]` on the memory store
//! (first execution and replay, beside the naive check-then-insert map), and the HTTP layer on
//! the memory store (first request and replay, beside the plain handler).
//!
//! ```text
//! cargo run --release -p idempotent-examples --bin allocs
//! ```
//!
//! Each figure is the number of allocations made by 10,000 calls, divided by 10,000, after 1,000
//! calls of warm-up (so that maps and buffers that grow once are grown).

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Mutex;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::{Error, MemoryStore, idempotent};
use tower::ServiceExt as _;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

const WARM_UP: u64 = 1_000;
const CALLS: u64 = 10_000;

#[idempotent(key = id, store = store, scope = "allocs")]
async fn wrapped(store: &MemoryStore, id: u64) -> Result<u64, Error> {
    Ok(black_box(id))
}

/// The design notes' naive approach, as in the `overhead` bench.
#[derive(Default)]
struct Naive(Mutex<HashMap<String, Vec<u8>>>);

impl Naive {
    async fn call(&self, id: u64) -> Result<u64, Error> {
        let key = format!("allocs:{id}");
        let found = self.0.lock().unwrap().get(&key).cloned();
        if let Some(bytes) = found {
            return serde_json::from_slice(&bytes).map_err(|e| Error::Fingerprint(e.to_string()));
        }
        let value = black_box(id);
        let bytes = serde_json::to_vec(&value).map_err(|e| Error::Fingerprint(e.to_string()))?;
        self.0.lock().unwrap().insert(key, bytes);
        Ok(value)
    }
}

fn blocks() -> u64 {
    dhat::HeapStats::get().total_blocks
}

/// Allocations per call of `call(i)` for `i` in `from..from + CALLS`, after a warm-up on other ids.
async fn per_call<F: AsyncFn(u64)>(from: u64, call: F) -> f64 {
    for i in 0..WARM_UP {
        call(from + 10_000_000 + i).await;
    }
    let before = blocks();
    for i in from..from + CALLS {
        call(i).await;
    }
    #[allow(clippy::cast_precision_loss)]
    let per = (blocks() - before) as f64 / CALLS as f64;
    per
}

fn request(key: u64) -> Request<Body> {
    Request::post("/orders")
        .header("idempotency-key", format!("k-{key}"))
        .header("content-type", "application/json")
        .body(Body::from(r#"{"item":"book","quantity":1}"#))
        .expect("a valid request")
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _profiler = dhat::Profiler::builder().testing().build();

    let store = MemoryStore::new();
    let naive = Naive::default();
    let first = per_call(0, async |i| {
        wrapped(&store, i).await.unwrap();
    })
    .await;
    let replay = per_call(0, async |i| {
        wrapped(&store, i).await.unwrap();
    })
    .await;
    let naive_first = per_call(0, async |i| {
        naive.call(i).await.unwrap();
    })
    .await;
    let naive_replay = per_call(0, async |i| {
        naive.call(i).await.unwrap();
    })
    .await;

    let handler = post(|body: String| async move { (StatusCode::CREATED, body) });
    // With their state given, as `axum::serve` runs a router (`into_make_service` does that): a
    // `Router<()>` called as it is makes each route's handler into a service, every layer
    // applied, again for every request, three allocations per layered request that a server
    // does not make.
    let plain: Router = Router::new().route("/orders", handler.clone()).with_state(());
    let layered: Router = Router::new()
        .route("/orders", handler)
        .layer(IdempotencyLayer::new(MemoryStore::new()).keys_shared_by_all_callers())
        .with_state(());
    let send = async |app: &Router, key: u64| {
        let status = app.clone().oneshot(request(key)).await.expect("infallible").status();
        assert_eq!(status, StatusCode::CREATED);
    };
    let plain_request = per_call(0, async |i| send(&plain, i).await).await;
    let http_first = per_call(0, async |i| send(&layered, i).await).await;
    let http_replay = per_call(0, async |i| send(&layered, i).await).await;

    println!("| call | allocations per call | baseline beside it |");
    println!("|---|---|---|");
    println!("| `#[idempotent]`, memory store, first execution | {first:.2} | naive map {naive_first:.2} |");
    println!("| `#[idempotent]`, memory store, replay | {replay:.2} | naive map {naive_replay:.2} |");
    println!("| HTTP layer, memory store, first request | {http_first:.2} | plain handler {plain_request:.2} |");
    println!("| HTTP layer, memory store, replay | {http_replay:.2} | plain handler {plain_request:.2} |");
}
