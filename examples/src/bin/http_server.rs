//! An HTTP API whose `POST`s are safe to retry with an `Idempotency-Key` header.
//!
//! - `POST /orders` is made idempotent by `IdempotencyLayer`: the whole response is recorded and
//!   replayed with `Idempotent-Replayed: true`.
//! - `POST /payments` uses `#[idempotent]` on the handler, with the key from the
//!   `IdempotencyKeyHeader` extractor and the request body as the fingerprint.
//!
//! Both take 2 s (a slow payment provider), so a duplicate sent meanwhile gets `409`, with
//! `Retry-After` from the running request's remaining lease. The caller is read from an `x-user`
//! header, a stand-in for your authentication: keys are scoped per user.
//!
//! Both run each request on its own task, so a client that disconnects mid-request does not
//! cancel it: the payment completes, its receipt is recorded, and the client's retry gets it.
//! The layer does this by itself; the `#[idempotent]` route needs `RunToCompletionLayer`, because
//! hyper drops a handler's future when its connection closes, and a handler dropped after it
//! charged but before its result was recorded leaves the retry without the receipt.
//!
//! `GET /metrics` serves the library's metrics (calls by scope and outcome, store-step latency)
//! in the Prometheus text format.
//!
//! ```text
//! cargo run -p idempotent-examples --bin http_server        # listens on 127.0.0.1:3000 (or $ADDR)
//! IDEMPOTENT_STORE=sqlite://orders.db cargo run -p idempotent-examples --bin http_server  # records survive restarts
//! curl -i -X POST localhost:3000/orders -H 'Idempotency-Key: 1f0c...' -H 'x-user: alice' \
//!      -H 'content-type: application/json' -d '{"item":"book","quantity":1}'
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{Json, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Router, serve};
use idempotent_runtime::http::{HttpError, IdempotencyKeyHeader, IdempotencyLayer, JsonResponse, RunToCompletionLayer};
use idempotent_runtime::idempotent;
use idempotent_runtime::stores::AnyStore;
use serde::{Deserialize, Serialize};

const PROVIDER_DELAY: Duration = Duration::from_secs(2);

#[derive(Clone)]
struct AppState {
    store: AnyStore,
    next_id: Arc<AtomicU64>,
}

#[derive(Debug, Serialize, Deserialize)]
struct OrderRequest {
    item: String,
    quantity: u32,
}

#[derive(Debug, Serialize)]
struct Order {
    order: u64,
    item: String,
    quantity: u32,
}

/// `POST /orders`, behind the layer: an ordinary handler, run once per key.
async fn create_order(State(state): State<AppState>, Json(order): Json<OrderRequest>) -> Response {
    tokio::time::sleep(PROVIDER_DELAY).await;
    let id = state.next_id.fetch_add(1, Ordering::SeqCst);
    let location = format!("/orders/{id}");
    let created = Order { order: id, item: order.item, quantity: order.quantity };
    (StatusCode::CREATED, [(header::LOCATION, location)], Json(created)).into_response()
}

#[derive(Debug, Serialize, Deserialize)]
struct PayRequest {
    account: String,
    amount_cents: i64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    payment: u64,
    account: String,
    amount_cents: i64,
}

/// The handler's errors: the idempotency ones become problem responses.
enum ApiError {
    Idempotency(HttpError),
    InvalidAmount,
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
            ApiError::InvalidAmount => (StatusCode::BAD_REQUEST, "amount_cents must be positive").into_response(),
        }
    }
}

/// `POST /payments`, under `#[idempotent]`: the receipt is recorded and replayed (a replay carries
/// `Idempotent-Replayed: true`, as `JsonResponse` marks what it decodes from a record); an `Err`
/// releases the key so a corrected retry can run.
#[idempotent(key = key.for_caller(user(&headers)), store = state.store, fingerprint = body)]
async fn pay(
    State(state): State<AppState>,
    key: IdempotencyKeyHeader,
    headers: HeaderMap,
    Json(body): Json<PayRequest>,
) -> Result<JsonResponse<Receipt>, ApiError> {
    if body.amount_cents <= 0 {
        return Err(ApiError::InvalidAmount);
    }
    tokio::time::sleep(PROVIDER_DELAY).await;
    let payment = state.next_id.fetch_add(1, Ordering::SeqCst);
    Ok(JsonResponse::created(Receipt { payment, account: body.account, amount_cents: body.amount_cents }))
}

fn user(headers: &HeaderMap) -> &str {
    headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("anonymous")
}

fn caller(parts: &Parts) -> String {
    user(&parts.headers).to_owned()
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| std::io::Error::other(format!("installing the metrics recorder: {e}")))?;
    // The store from IDEMPOTENT_STORE (memory://, sqlite://PATH, redis://, postgres://, mysql://).
    let url = std::env::var("IDEMPOTENT_STORE").unwrap_or_else(|_| "memory://".to_owned());
    let store = AnyStore::from_url(&url).await.map_err(std::io::Error::other)?;
    println!("idempotency store: {url}");
    let state = AppState { store, next_id: Arc::new(AtomicU64::new(1)) };
    let orders = Router::new()
        .route("/orders", post(create_order))
        .route_layer(IdempotencyLayer::new(state.store.clone()).scope("orders").caller(caller));
    let payments = Router::new().route("/payments", post(pay)).route_layer(RunToCompletionLayer);
    let app = Router::new()
        .merge(payments)
        .merge(orders)
        .with_state(state)
        .route("/metrics", get(move || std::future::ready(metrics.render())));

    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    serve(listener, app).await
}
