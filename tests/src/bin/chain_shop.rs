//! The shop of the chain test (`tests/tests/chain_sigkill.rs`): `POST /orders` under
//! `IdempotencyLayer` on a persistent store; the handler pays the order at the bank in a
//! [`step`] (through `IdempotentRetry`, so with a key derived from the order's key) and answers
//! with the bank's answer.
//!
//! ```text
//! chain_shop <store> <bank-port> <lease-ms>
//!   <store>: sqlite:<path> | postgres:<url>|<table>
//! ```
//!
//! It prints `LISTENING <port>`. A request's `x-stop-at` header makes it print `AT <point>` and
//! stop there, waiting to be killed:
//!
//! | point | where |
//! |---|---|
//! | `bank` | inside the step, after the bank answered, before the step is recorded |
//! | `step` | after the step was recorded, before the handler returns |
//! | `final` | in the store's `complete` of the order (the final record), before it is sent |

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::client::{IdempotentRetry, RetryPolicy};
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::{Claim, ClaimRequest, Completion, Detached, Error, Key, Store, StoreError, Token, step};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use serde_json::{Value, json};

fn usage() -> ! {
    eprintln!("usage: chain_shop <sqlite:<path>|postgres:<url>|<table>> <bank-port> <lease-ms>");
    std::process::exit(2);
}

/// Set by a request that asked to stop at `final`; read by the store's `complete`.
static STOP_AT_FINAL: AtomicBool = AtomicBool::new(false);

/// Stops here for good, after saying where.
async fn stop(point: &str) -> ! {
    println!("AT {point}");
    std::future::pending::<()>().await;
    unreachable!("pending never ends")
}

/// The real store, with a stop before the order's final record (steps' keys start with `step-`).
struct Stopping<S>(S);

impl<S: Store> Store for Stopping<S> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.0.claim(request).await
    }

    async fn complete(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
        if !completion.key.key().starts_with("step-") && STOP_AT_FINAL.load(Ordering::SeqCst) {
            stop("final").await;
        }
        self.0.complete(completion).await
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        self.0.release(key, token).await
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        self.0.extend(key, token, lease).await
    }

    fn detach(&self, step: Detached) {
        self.0.detach(step);
    }

    fn name(&self) -> &'static str {
        self.0.name()
    }
}

struct Shop {
    bank: String,
    client: ClientWithMiddleware,
}

async fn order(State(shop): State<Arc<Shop>>, headers: HeaderMap, Json(order): Json<Value>) -> Json<Value> {
    let stop_at = headers.get("x-stop-at").and_then(|v| v.to_str().ok()).unwrap_or("none").to_owned();
    STOP_AT_FINAL.store(stop_at == "final", Ordering::SeqCst);
    let paid: Result<Value, Error> = step("pay", async {
        let response = shop
            .client
            .post(format!("{}/transfers", shop.bank))
            .header("content-type", "application/json")
            .body(json!({ "order": order["order"] }).to_string())
            .send()
            .await
            .expect("the bank answers");
        let answer: Value = serde_json::from_slice(&response.bytes().await.expect("the bank's body")).expect("JSON");
        if stop_at == "bank" {
            stop("bank").await;
        }
        Ok(answer)
    })
    .await;
    let paid = paid.expect("the step is recorded");
    if stop_at == "step" {
        stop("step").await;
    }
    Json(json!({ "order": order["order"], "paid": paid }))
}

async fn serve<S: Store + 'static>(store: S, bank_port: &str, lease: Duration) {
    let policy = RetryPolicy::default().max_elapsed(Duration::from_secs(30)).jitter_seed(7);
    let client = ClientBuilder::new(reqwest::Client::new()).with(IdempotentRetry::new(policy)).build();
    let shop = Arc::new(Shop { bank: format!("http://127.0.0.1:{bank_port}"), client });
    let app = Router::new()
        .route("/orders", post(order))
        .route_layer(IdempotencyLayer::new(Stopping(store)).keys_shared_by_all_callers().scope("shop").lease(lease))
        .with_state(shop);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free port");
    println!("LISTENING {}", listener.local_addr().expect("the bound address").port());
    axum::serve(listener, app).await.expect("the shop runs");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [store, bank_port, lease] = args.as_slice() else { usage() };
    let lease = Duration::from_millis(lease.parse().unwrap_or_else(|_| usage()));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a Tokio runtime");
    runtime.block_on(async {
        let (kind, rest) = store.split_once(':').unwrap_or_else(|| usage());
        match kind {
            "sqlite" => {
                let store = idempotent_runtime::stores::sql::SqliteStore::open(rest).await.expect("open SQLite");
                serve(store, bank_port, lease).await;
            }
            "postgres" => {
                let (url, table) = rest.rsplit_once('|').unwrap_or_else(|| usage());
                let pool = idempotent_runtime::stores::sql::sqlx::PgPool::connect(url).await.expect("connect");
                let store = idempotent_runtime::stores::sql::PostgresStore::with_table(pool, table).expect("table");
                serve(store, bank_port, lease).await;
            }
            _ => usage(),
        }
    });
}
