//! A history's server: the handler and its ledger, the two routes (the layer, the attribute), and
//! the log of every response sent.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRequestParts, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use idempotent_runtime::client::{IdempotentRetry, RetryPolicy};
use idempotent_runtime::http::{
    HttpError, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyKeyHeader, IdempotencyLayer, JsonResponse,
    NotProcessed, RunToCompletionLayer,
};
use idempotent_runtime::stores::AnyStore;
use idempotent_runtime::{Store, idempotent};
use tokio::time::Instant;

use super::plan::{Behaviour, Ending, Plan, Route};
use super::{ConfigBug, SCOPE};
use crate::simulation::callers::BODY_PANIC;

/// One run of the handler, as it happened.
#[derive(Debug, Clone)]
pub(super) struct Run {
    pub(super) slot: (usize, usize),
    pub(super) n: usize,
    pub(super) caller: usize,
    pub(super) body: Bytes,
    pub(super) ending: Ending,
    pub(super) started: Instant,
    pub(super) ended: Option<Instant>,
    pub(super) charged: bool,
    /// Status and body of its answer (none after a panic).
    pub(super) answer: Option<(u16, Bytes)>,
    /// How its call downstream went, if it made one.
    downstream: Option<String>,
}

/// A response the server sent (seen outside the layer), or a caller's last outcome.
#[derive(Debug, Clone)]
pub(super) struct Seen {
    pub(super) caller: usize,
    pub(super) status: u16,
    pub(super) replayed: bool,
    pub(super) key_echo: Option<String>,
    pub(super) body: Bytes,
}

/// The server's side of a history.
#[derive(Debug)]
pub(super) struct Server {
    pub(super) plan: Plan,
    pub(super) runs: Mutex<Vec<Run>>,
    pub(super) sent: Mutex<Vec<Seen>>,
    /// Requests that reached the server and have not been answered, nor given up by their client.
    pub(super) in_flight: AtomicUsize,
    /// The service the handler calls, if the plan says so.
    pub(super) downstream: Option<Arc<Downstream>>,
}

/// A service downstream of the handler (a bank it notifies), behind `IdempotencyLayer` on a
/// memory store of its own, reached through `IdempotentRetry`. The handler's requests carry no
/// key: inside the idempotent call the middleware derives one from the call's key, so every run
/// of one upstream key sends the same key, and the bank runs once per upstream key however often
/// the handler runs.
#[derive(Debug)]
pub(super) struct Downstream {
    url: String,
    client: reqwest_middleware::ClientWithMiddleware,
    /// Upstream (user, key) of every request the handler sent.
    called: Mutex<Vec<(usize, usize)>>,
    /// Every run of the bank's handler: the upstream (user, key) its body names, and its key.
    runs: Mutex<Vec<((usize, usize), String)>>,
}

impl Downstream {
    /// Starts the bank on a loopback port of its own; the handler's client derives its keys
    /// unless `derive_keys` is false (a planted bug).
    pub(super) async fn start(derive_keys: bool) -> (Arc<Self>, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the bank");
        let addr = listener.local_addr().expect("the bank's address");
        let policy = RetryPolicy::default()
            .max_attempts(6)
            .backoff(Duration::from_millis(20), Duration::from_millis(200))
            .max_elapsed(Duration::from_secs(8));
        let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(IdempotentRetry::new(policy).derive_keys(derive_keys))
            .build();
        let bank = Arc::new(Downstream {
            url: format!("http://{addr}/notify"),
            client,
            called: Mutex::default(),
            runs: Mutex::default(),
        });
        let layer =
            IdempotencyLayer::new(idempotent_runtime::MemoryStore::new()).scope("bank").keys_shared_by_all_callers();
        let app = Router::new().route("/notify", post(notify)).route_layer(layer).with_state(Arc::clone(&bank));
        let serving = tokio::spawn(async move { axum::serve(listener, app).await.expect("the bank") });
        (bank, serving)
    }

    /// Upstream (user, key) of every request the handler sent, so far.
    pub(super) fn called(&self) -> Vec<(usize, usize)> {
        self.called.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Every run of the bank's handler so far: the upstream (user, key) its body names, and its key.
    pub(super) fn runs(&self) -> Vec<((usize, usize), String)> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The handler's request to the bank, for upstream `(user, key)`.
    /// Returns how it went, for the history's log: how long it took, and the status (or error).
    async fn call(&self, user: usize, key: usize) -> String {
        self.called.lock().unwrap_or_else(PoisonError::into_inner).push((user, key));
        let started = Instant::now();
        let sent = self
            .client
            .post(&self.url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(format!(r#"{{"user":{user},"key":{key}}}"#))
            .send()
            .await;
        let attempts =
            sent.as_ref().ok().and_then(|r| r.extensions().get::<idempotent_runtime::client::Attempts>().cloned());
        format!("{:?}: {:?} {attempts:?}", started.elapsed(), sent.map(|r| r.status()))
    }
}

/// The bank's handler: notes the run and the key it came with.
async fn notify(State(bank): State<Arc<Downstream>>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let key = headers.get(&IDEMPOTENCY_KEY).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let slot = serde_json::from_slice::<serde_json::Value>(&body).ok().map_or((usize::MAX, usize::MAX), |v| {
        let number = |field: &str| v[field].as_u64().and_then(|n| usize::try_from(n).ok()).unwrap_or(usize::MAX);
        (number("user"), number("key"))
    });
    bank.runs.lock().unwrap_or_else(PoisonError::into_inner).push((slot, key));
    StatusCode::CREATED
}

impl Server {
    pub(super) fn runs(&self) -> std::sync::MutexGuard<'_, Vec<Run>> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn running(&self) -> usize {
        self.runs().iter().filter(|r| r.ended.is_none()).count()
    }

    pub(super) fn sent(&self) -> std::sync::MutexGuard<'_, Vec<Seen>> {
        self.sent.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Counts a request in flight until its answer is logged or its client leaves.
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The number in header `name` (the test's own `x-user`, `x-key`, `x-caller`), or `usize::MAX`.
fn number(headers: &HeaderMap, name: &str) -> usize {
    headers.get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(usize::MAX)
}

/// Marks its run ended when dropped, a panic's unwinding included.
struct Ends(Arc<Server>, usize);

impl Drop for Ends {
    fn drop(&mut self) {
        let mut runs = self.0.runs();
        runs[self.1].ended.get_or_insert_with(Instant::now);
    }
}

/// One run of the handler, as the plan says: registers the run, works, then charges or not and
/// answers (or panics). Returns the ending, the status and the JSON body of the answer.
async fn perform(server: &Arc<Server>, headers: &HeaderMap, body: Bytes) -> (Ending, StatusCode, serde_json::Value) {
    let (user, key, caller) = (number(headers, "x-user"), number(headers, "x-key"), number(headers, "x-caller"));
    let probe = headers.contains_key("x-probe");
    let (index, n, behaviour) = {
        let mut runs = server.runs();
        let n = runs.iter().filter(|r| r.slot == (user, key)).count();
        let planned = server.plan.behaviours.get(&(user, key)).and_then(|b| b.get(n)).copied();
        let behaviour = match planned {
            Some(planned) if !probe => planned,
            _ => Behaviour { work: Duration::ZERO, ending: Ending::Created },
        };
        runs.push(Run {
            slot: (user, key),
            n,
            caller,
            body,
            ending: behaviour.ending,
            started: Instant::now(),
            ended: None,
            charged: false,
            answer: None,
            downstream: None,
        });
        (runs.len() - 1, n, behaviour)
    };
    let ends = Ends(Arc::clone(server), index);
    tokio::time::sleep(behaviour.work).await;
    if let Some(downstream) = &server.downstream {
        let how = downstream.call(user, key).await;
        server.runs()[index].downstream = Some(how);
    }
    let value = serde_json::json!({ "user": user, "key": key, "run": n, "ending": format!("{:?}", behaviour.ending) });
    let status = match behaviour.ending {
        Ending::Created => StatusCode::CREATED,
        Ending::ChargedThenFailed => StatusCode::INTERNAL_SERVER_ERROR,
        Ending::Declined => StatusCode::PAYMENT_REQUIRED,
        Ending::NotProcessed => StatusCode::SERVICE_UNAVAILABLE,
        Ending::Panic => panic!("{BODY_PANIC}"),
    };
    {
        let mut runs = server.runs();
        let run = &mut runs[index];
        run.charged = behaviour.ending.charges();
        run.answer = Some((status.as_u16(), json_bytes(&value)));
        run.ended = Some(Instant::now());
    }
    drop(ends);
    (behaviour.ending, status, value)
}

/// A JSON body as `JsonResponse` writes it.
fn json_bytes(value: &serde_json::Value) -> Bytes {
    serde_json::to_vec(value).expect("a JSON value serialises").into()
}

/// The handler behind [`IdempotencyLayer`].
async fn charge(State(server): State<Arc<Server>>, headers: HeaderMap, body: Bytes) -> Response {
    let (ending, status, value) = perform(&server, &headers, body).await;
    if ending == Ending::NotProcessed {
        return (status, NotProcessed, json_bytes(&value)).into_response();
    }
    (status, json_bytes(&value)).into_response()
}

/// The state of the `#[idempotent]` route.
#[derive(Clone)]
struct AttributeState {
    server: Arc<Server>,
    store: AnyStore,
}

/// The caller's user, from `x-user`, for `key.for_caller`.
struct User(String);

impl<S: Send + Sync> FromRequestParts<S> for User {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut http::request::Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(User(parts.headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned()))
    }
}

/// What the `#[idempotent]` route fingerprints: the body's JSON content under
/// `json_fingerprint`, its bytes otherwise, as the layer does.
#[derive(serde::Serialize)]
enum RequestPrint {
    Json(Option<serde_json::Value>),
    Bytes(Vec<u8>),
}

fn request_print(plan: &Plan, body: &[u8]) -> RequestPrint {
    if plan.json_fingerprint {
        RequestPrint::Json(serde_json::from_slice(body).ok())
    } else {
        RequestPrint::Bytes(body.to_vec())
    }
}

/// The `#[idempotent]` handler's errors: the library's, or "nothing was done" (`503`), which
/// releases the key as every `Err` does.
enum Refusal {
    Idempotency(idempotent_runtime::Error),
    NotProcessed(serde_json::Value),
}

impl From<idempotent_runtime::Error> for Refusal {
    fn from(error: idempotent_runtime::Error) -> Self {
        Refusal::Idempotency(error)
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::Idempotency(error) => HttpError(error).into_response(),
            Refusal::NotProcessed(value) => (StatusCode::SERVICE_UNAVAILABLE, json_bytes(&value)).into_response(),
        }
    }
}

/// The same handler under `#[idempotent]`: an answer after acting is an `Ok` (recorded, whatever
/// its status), "nothing was done" an `Err`.
#[idempotent(
    key = key.for_caller(&user.0),
    store = state.store,
    scope = "simhttp",
    fingerprint = request_print(&state.server.plan, &body),
    lease = state.server.plan.lease,
    wait = state.server.plan.wait.unwrap_or(Duration::ZERO)
)]
async fn charge_attribute(
    State(state): State<AttributeState>,
    key: IdempotencyKeyHeader,
    user: User,
    headers: HeaderMap,
    body: Bytes,
) -> Result<JsonResponse<serde_json::Value>, Refusal> {
    let (ending, status, value) = perform(&state.server, &headers, body).await;
    if ending == Ending::NotProcessed {
        return Err(Refusal::NotProcessed(value));
    }
    Ok(JsonResponse::with_status(status, value))
}

/// Outside the layer: logs every response the server sends.
async fn log_sent(State(server): State<Arc<Server>>, request: Request, next: Next) -> Response {
    let caller = number(request.headers(), "x-caller");
    server.in_flight.fetch_add(1, Ordering::Relaxed);
    let in_flight = InFlight(&server.in_flight);
    let response = next.run(request).await;
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
    server.sent().push(seen(caller, parts.status, &parts.headers, &body));
    drop(in_flight);
    Response::from_parts(parts, Body::from(body))
}

pub(super) fn seen(caller: usize, status: StatusCode, headers: &HeaderMap, body: &Bytes) -> Seen {
    Seen {
        caller,
        status: status.as_u16(),
        replayed: headers.get(&IDEMPOTENT_REPLAYED).is_some_and(|v| v == "true"),
        key_echo: headers.get(&IDEMPOTENCY_KEY).and_then(|v| v.to_str().ok()).map(str::to_owned),
        body: body.clone(),
    }
}

/// The history's server: its route, the way in its plan says (the layer when a bug is planted
/// in the layer), and the log of what it sends outside.
pub(super) fn router<S: Store + Clone + 'static>(server: &Arc<Server>, store: S, bug: Option<ConfigBug>) -> Router {
    let plan = &server.plan;
    let route = if plan.route == Route::Attribute && !bug.is_some_and(ConfigBug::in_layer) {
        let state = AttributeState { server: Arc::clone(server), store: AnyStore::new(store) };
        Router::new().route("/charge", post(charge_attribute)).route_layer(RunToCompletionLayer).with_state(state)
    } else {
        let mut layer = IdempotencyLayer::new(store)
            .scope(SCOPE)
            .caller(|parts| parts.headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned())
            .lease(plan.lease);
        if plan.json_fingerprint {
            layer = layer.json_fingerprint();
        }
        if let Some(wait) = plan.wait {
            layer = layer.wait(wait);
        }
        match bug {
            Some(ConfigBug::ReleaseServerErrors) => layer = layer.record_status(|status| !status.is_server_error()),
            Some(ConfigBug::KeysSharedByAllCallers) => layer = layer.keys_shared_by_all_callers(),
            Some(ConfigBug::FreshDownstreamKeys) | None => {}
        }
        Router::new().route("/charge", post(charge)).route_layer(layer).with_state(Arc::clone(server))
    };
    route.layer(axum::middleware::from_fn_with_state(Arc::clone(server), log_sent))
}
