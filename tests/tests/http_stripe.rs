//! The HTTP layer against a client nobody in this project wrote: Stripe's own Python SDK
//! (`stripe` 16.1.0 from `PyPI`, `tests/stripe/charge.py`), pointed at a server that answers like
//! Stripe's charges API. The SDK makes the `Idempotency-Key` of every `POST` itself and retries
//! with it, on a lost connection, `409` and `5xx`, so these tests are the layer's defaults
//! composed with a real client's defaults, as a Stripe user's code would compose them. Every test
//! counts the handler's runs in the bank's own ledger, never in the store.

#![cfg(feature = "http")]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idempotent_runtime::MemoryStore;
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_tests::proxy::{FaultProxy, Mode};
use serde_json::{Value, json};
use tokio::sync::watch;

fn python() -> Option<PathBuf> {
    idempotent_tests::python::venv("stripe", "stripe==16.1.0", "import stripe; assert stripe.VERSION == '16.1.0'")
}

/// What the handler does after it has charged.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Then {
    Answer,
    /// Answers `500`, as a charge whose receipt service then timed out would.
    Fail,
}

/// The bank behind the charges route: its own count of charges, and every response the server
/// sent (key, status, replayed), seen outside the layer.
#[derive(Clone)]
struct Bank {
    charges: Arc<AtomicUsize>,
    responses: Arc<Mutex<Vec<(String, u16, bool)>>>,
    then: Then,
    /// The handler waits, after charging, until this is `true`.
    open: watch::Receiver<bool>,
}

async fn create_charge(State(bank): State<Bank>, form: String) -> Response {
    let amount: u64 = form
        .split('&')
        .find_map(|pair| pair.strip_prefix("amount="))
        .and_then(|amount| amount.parse().ok())
        .unwrap_or_default();
    let charge = bank.charges.fetch_add(1, Ordering::SeqCst) + 1;
    let mut open = bank.open.clone();
    let _ = open.wait_for(|open| *open).await;
    match bank.then {
        Then::Answer => {
            axum::Json(json!({ "id": format!("ch_{charge}"), "object": "charge", "amount": amount })).into_response()
        }
        Then::Fail => {
            let error =
                json!({ "error": { "type": "api_error", "message": "charged, then the receipt service timed out" } });
            (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(error)).into_response()
        }
    }
}

async fn note_response(State(bank): State<Bank>, request: Request, next: Next) -> Response {
    let key = request.headers().get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let response = next.run(request).await;
    let replayed = response.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    bank.responses.lock().unwrap().push((key, response.status().as_u16(), replayed));
    response
}

/// Serves the charges route behind the layer, its keys bound to the caller's API key (what a
/// Stripe-like API does); returns the bank, its address, and the gate that lets handlers answer.
async fn serve(then: Then, open: bool) -> (Bank, SocketAddr, watch::Sender<bool>) {
    let (gate, opened) = watch::channel(open);
    let bank = Bank { charges: Arc::default(), responses: Arc::default(), then, open: opened };
    let layer = IdempotencyLayer::new(MemoryStore::new()).caller(|parts| {
        parts.headers.get("authorization").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
    });
    let app = Router::new()
        .route("/v1/charges", post(create_charge))
        .route_layer(layer)
        .layer(axum::middleware::from_fn_with_state(bank.clone(), note_response))
        .with_state(bank.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free port");
    let addr = listener.local_addr().expect("the bound address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("the server runs") });
    (bank, addr, gate)
}

/// Runs the SDK's client once (a new process) and returns the line it printed.
async fn stripe_charge(python: &Path, base: String, amount: u64, key: Option<&str>) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/stripe/charge.py");
    let (python, key) = (python.to_owned(), key.map(str::to_owned));
    let out = tokio::task::spawn_blocking(move || {
        let mut command = std::process::Command::new(python);
        command.arg(script).arg(base).arg(amount.to_string()).args(key);
        command.output().expect("run the Stripe client")
    })
    .await
    .expect("the client's thread");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the Stripe client failed: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn responses(bank: &Bank) -> Vec<(String, u16, bool)> {
    bank.responses.lock().unwrap().clone()
}

/// The connection is lost as the charge's answer comes back (a proxy cuts it). The SDK retries
/// with the key it made, and gets the recorded charge: one charge, the same one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_stripe_client_retrying_a_lost_answer_gets_the_one_charge() {
    let Some(python) = python() else { return };
    let (bank, addr, _gate) = serve(Then::Answer, true).await;
    let proxy = FaultProxy::start(&addr.to_string()).await.expect("start the proxy");
    proxy.set_mode(Mode::LoseOneResponse);
    let got = stripe_charge(&python, format!("http://{}", proxy.addr()), 100, None).await;
    let seen = responses(&bank);
    println!("the SDK got {got}; the server answered {seen:?}; charges {}", bank.charges.load(Ordering::SeqCst));
    assert_eq!(got, json!({ "charge": "ch_1", "amount": 100 }));
    assert_eq!(bank.charges.load(Ordering::SeqCst), 1, "charged once");
    assert_eq!(proxy.stats().lost_responses.load(Ordering::Relaxed), 1, "the first answer was lost");
    let [(first, 200, false), (second, 200, true)] = seen.as_slice() else { panic!("{seen:?}") };
    assert!(first == second && !first.is_empty(), "the SDK's retry kept its key: {seen:?}");
}

/// The handler charges, then answers `500`. The SDK retries a `5xx` (twice, its default), with
/// the same key: its retry gets the recorded `500`, replayed and marked `Stripe-Should-Retry:
/// false`, so the SDK stops there and reports the error instead of spending its second retry (and
/// its back-off) on the same replay. The card is charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_stripe_client_retrying_a_recorded_500_charges_once() {
    let Some(python) = python() else { return };
    let (bank, addr, _gate) = serve(Then::Fail, true).await;
    let got = stripe_charge(&python, format!("http://{addr}"), 250, None).await;
    let seen = responses(&bank);
    println!("the SDK got {got}; the server answered {seen:?}; charges {}", bank.charges.load(Ordering::SeqCst));
    assert_eq!(got, json!({ "error": "APIError", "status": 500 }));
    assert_eq!(bank.charges.load(Ordering::SeqCst), 1, "charged once");
    let statuses: Vec<(u16, bool)> = seen.iter().map(|(_, status, replayed)| (*status, *replayed)).collect();
    assert_eq!(statuses, [(500, false), (500, true)], "the replay stopped the SDK's retries: {seen:?}");
    assert!(seen.iter().all(|(key, ..)| *key == seen[0].0), "one key: {seen:?}");
}

/// Two processes send one charge with the key the user gave (a double-clicked button): the
/// second arrives while the first runs, gets `409`, retries after the SDK's back-off, and gets
/// the first one's charge. One charge, both callers told `ch_1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_stripe_client_concurrent_duplicate_gets_409_then_the_same_charge() {
    let Some(python) = python() else { return };
    let (bank, addr, gate) = serve(Then::Answer, false).await;
    let base = format!("http://{addr}");
    let first = tokio::spawn(stripe_charge_owned(python.clone(), base.clone()));
    wait_until("the first charge runs", || bank.charges.load(Ordering::SeqCst) == 1).await;
    let second = tokio::spawn(stripe_charge_owned(python, base));
    wait_until("the duplicate is refused with 409", || responses(&bank).iter().any(|(_, status, _)| *status == 409))
        .await;
    gate.send(true).expect("the handler waits");
    let (first, second) = (first.await.expect("the first client"), second.await.expect("the second client"));
    let seen = responses(&bank);
    println!("the SDKs got {first} and {second}; the server answered {seen:?}");
    assert_eq!(first, json!({ "charge": "ch_1", "amount": 300 }));
    assert_eq!(second, first, "the duplicate got the first one's charge");
    assert_eq!(bank.charges.load(Ordering::SeqCst), 1, "charged once");
    assert!(seen.contains(&("double-click-7".to_owned(), 200, true)), "the retry was a replay: {seen:?}");
}

async fn stripe_charge_owned(python: PathBuf, base: String) -> Value {
    stripe_charge(&python, base, 300, Some("double-click-7")).await
}

async fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
