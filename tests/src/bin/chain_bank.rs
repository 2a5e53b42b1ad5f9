//! The bank of the chain test (`tests/tests/chain_sigkill.rs`): `POST /transfers` under
//! `IdempotencyLayer` on its own memory store, each transfer one line of its ledger file.
//!
//! ```text
//! chain_bank <ledger-file>
//! ```
//!
//! Every request that reaches it (replays included) is also one line, its `Idempotency-Key`, of
//! `<ledger-file>.requests`.
//!
//! It prints `LISTENING <port>` once it accepts connections. A transfer's answer is
//! `{"order": <order>, "seq": <how many transfers this order has had, this one included>}`, so an
//! order transferred exactly once is always answered `seq: 1`.

use std::io::Write as _;
use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use idempotent_runtime::MemoryStore;
use idempotent_runtime::http::IdempotencyLayer;
use serde_json::{Value, json};

/// The ledger file, written under a lock so lines never interleave.
struct Ledger(Mutex<std::path::PathBuf>);

async fn transfer(State(ledger): State<Arc<Ledger>>, Json(request): Json<Value>) -> Json<Value> {
    let order = request["order"].clone();
    let line = order.to_string();
    let path = ledger.0.lock().expect("the ledger lock");
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(&*path).expect("open the ledger");
    writeln!(file, "{line}").expect("write the ledger");
    file.sync_data().expect("sync the ledger");
    let seq = std::fs::read_to_string(&*path).expect("read the ledger").lines().filter(|l| *l == line).count();
    Json(json!({ "order": order, "seq": seq }))
}

/// Notes the key of every request, before the idempotency layer.
async fn note_request(State(ledger): State<Arc<Ledger>>, request: Request, next: Next) -> Response {
    let key = request.headers().get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    {
        let path = ledger.0.lock().expect("the ledger lock").with_extension("requests");
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path).expect("open the request log");
        writeln!(file, "{key}").expect("write the request log");
    }
    next.run(request).await
}

fn main() {
    let ledger = std::env::args().nth(1).unwrap_or_else(|| {
        eprintln!("usage: chain_bank <ledger-file>");
        std::process::exit(2);
    });
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a Tokio runtime");
    let ledger = Arc::new(Ledger(Mutex::new(ledger.into())));
    runtime.block_on(async {
        let app = Router::new()
            .route("/transfers", post(transfer))
            .route_layer(IdempotencyLayer::new(MemoryStore::new()).keys_shared_by_all_callers().scope("bank"))
            .layer(axum::middleware::from_fn_with_state(Arc::clone(&ledger), note_request))
            .with_state(ledger);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free port");
        println!("LISTENING {}", listener.local_addr().expect("the bound address").port());
        axum::serve(listener, app).await.expect("the bank runs");
    });
}
