//! The server the HTTP benchmark (`scripts/http-bench`) loads with `wrk`: one JSON `POST` handler
//! that echoes a small body, mounted plain and behind `IdempotencyLayer` on each store, so that
//! every path is measured against the same handler in the same process.
//!
//! - `POST /plain`: the handler alone.
//! - `POST /memory`: behind the layer on a `MemoryStore`.
//! - `POST /redis`: behind the layer on the Redis store at `REDIS_URL` (if it answers).
//! - `POST /redis-script`: the same store with `with_native_completion(false)`: on a server with
//!   `SET ... IFEQ` (Valkey 8.1), completions by the script, as on an older server.
//! - `POST /redis-cached`: the same Redis store behind a `CachedStore` (local replay cache).
//!
//! ```text
//! cargo run --release -p idempotent-examples --bin http_bench    # 127.0.0.1:3100 (or $ADDR)
//! ```

use std::time::Duration;

use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::stores::cache::CachedStore;
use idempotent_runtime::stores::memory::MemoryLimits;
use idempotent_runtime::{MemoryStore, RedisStore};
use serde_json::Value;

/// Records are kept 10 minutes, so a run leaves no keys behind for long (a 5-run benchmark
/// writes about a million).
const RETENTION: Duration = Duration::from_secs(600);

/// The handler under test: echoes the JSON body it was sent.
async fn echo(Json(body): Json<Value>) -> Json<Value> {
    Json(body)
}

#[tokio::main]
async fn main() {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3100".into());
    // Room for every key of a long run (the default bound, 64 MiB charged, fills in seconds).
    let memory = MemoryStore::with_limits(MemoryLimits::default().max_entries(50_000_000).max_bytes(16 << 30));
    let mut app = Router::new().route("/plain", post(echo)).route(
        "/memory",
        post(echo).layer(IdempotencyLayer::new(memory).keys_shared_by_all_callers().retention(RETENTION)),
    );
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    match RedisStore::connect(&redis_url).await {
        Ok(store) => {
            let store = store.with_prefix("idempotent-http-bench:").expect("a valid prefix");
            let cached = CachedStore::new(store.clone()).with_max_entries(4_000_000).with_max_bytes(1 << 30);
            let script = store.clone().with_native_completion(false);
            app = app
                .route(
                    "/redis",
                    post(echo).layer(IdempotencyLayer::new(store).keys_shared_by_all_callers().retention(RETENTION)),
                )
                .route(
                    "/redis-script",
                    post(echo).layer(IdempotencyLayer::new(script).keys_shared_by_all_callers().retention(RETENTION)),
                )
                .route(
                    "/redis-cached",
                    post(echo).layer(IdempotencyLayer::new(cached).keys_shared_by_all_callers().retention(RETENTION)),
                );
        }
        Err(e) => eprintln!("http_bench: no Redis at {redis_url} ({e}); /redis and /redis-cached are not mounted"),
    }
    let listener = tokio::net::TcpListener::bind(&addr).await.unwrap_or_else(|e| panic!("cannot bind {addr}: {e}"));
    eprintln!("http_bench: listening on {addr}");
    axum::serve(listener, app).await.expect("the server runs");
}
