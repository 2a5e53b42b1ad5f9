//! Histories at the HTTP edge: the promise as an API's clients see it, with every part real.
//!
//! A history has its own server: a route behind [`IdempotencyLayer`] (keys bound to the caller's
//! user; per history, a lease of 1 s, 2 s or 60 s, `json_fingerprint` or not, `wait` or not) over
//! the store under test. Between the server and its clients sits a [`FaultProxy`] that loses
//! responses, refuses connections, stalls traffic and kills connections at drawn moments. The
//! clients are duplicates of one request: two to five callers, of one or two users, with one or
//! two keys, each with [`IdempotentRetry`] (up to six attempts, some with a per-attempt timeout)
//! or sending once. Some send the body re-formatted, some a different body under the same key.
//!
//! The handler works for up to 3 s (longer than a 1 s or 2 s lease: the claim must be renewed), then
//! charges and answers `201`, charges and fails with `500`, declines with `402` without
//! charging, answers `503` marked [`NotProcessed`], or panics. What it does is drawn per run of a
//! key, so a key released by a panic runs again with another ending.
//!
//! The judgement, per user and key, from the handler's ledger, every response the server sent
//! (logged outside the layer) and what each caller got in the end:
//! - the handler's runs never overlap, at most one of them ends in a recorded response (`201`,
//!   `500` after charging, `402`), and none follows it: the card is charged at most once;
//! - every response carrying a run's body is that run's response, byte for byte: the first one,
//!   to the caller who ran it, then replays marked `Idempotent-Replayed: true`, and only to
//!   callers of the same user whose body has the run's fingerprint; a `422` only when the key
//!   was used with another body; a `2xx` only with a run's body; the key echoed back as sent;
//! - once every run has ended, a probe replays the recorded response, or runs the handler once
//!   if nothing was recorded, so each key ends charged exactly once. A `409` for longer than
//!   the lease after the last run ended is a blocked key.
//!
//! The plans are drawn from a seed; the histories run in real time, so interleavings are not
//! replayed exactly. The judgement does not depend on them.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use idempotent_runtime::client::{IdempotentRetry, OutboundError, RetryPolicy};
use idempotent_runtime::http::{
    HttpError, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyKeyHeader, IdempotencyLayer, JsonResponse,
    NotProcessed, RunToCompletionLayer,
};
use idempotent_runtime::stores::AnyStore;
use idempotent_runtime::{Store, idempotent};
use tokio::time::Instant;

use super::bugs::Planted;
use super::callers::BODY_PANIC;
use super::faults::{FaultRates, FaultStore};
use super::history::{Event, Fault, History};
use super::rng::SplitMix64;
use crate::proxy::{FaultProxy, Mode};

/// The scope of these histories' keys.
pub const SCOPE: &str = "simhttp";

/// How a run of the handler ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// Charges, answers `201`.
    Created,
    /// Charges, then fails: `500`.
    ChargedThenFailed,
    /// Declines without charging: `402`, a final answer.
    Declined,
    /// Does nothing and says so: `503` with [`NotProcessed`].
    NotProcessed,
    /// Panics before charging.
    Panic,
}

impl Ending {
    /// Whether the layer records the answer.
    fn recorded(self) -> bool {
        matches!(self, Ending::Created | Ending::ChargedThenFailed | Ending::Declined)
    }

    fn charges(self) -> bool {
        matches!(self, Ending::Created | Ending::ChargedThenFailed)
    }
}

/// One run of the handler, as planned.
#[derive(Debug, Clone, Copy)]
struct Behaviour {
    work: Duration,
    ending: Ending,
}

/// How a caller writes the request's body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyForm {
    /// The key's body.
    Canonical,
    /// The same JSON, keys reordered and spaced: the same request under `json_fingerprint`.
    Reformatted,
    /// Another amount: another request.
    Other,
}

/// One caller: a client process sending the request.
#[derive(Debug, Clone)]
struct CallerPlan {
    user: usize,
    key: usize,
    body: BodyForm,
    delay: Duration,
    /// Attempts and jitter seed of its `IdempotentRetry`; `None`: it sends once.
    retry: Option<(u32, u64)>,
    /// Each attempt's timeout.
    timeout: Option<Duration>,
}

/// A fault of the network, at a moment of the history.
#[derive(Debug, Clone, Copy)]
enum NetFault {
    LoseOneResponse,
    Refuse(Duration),
    Stall(Duration),
    Kill,
}

/// Which way into the HTTP support a history's route takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// [`IdempotencyLayer`] over the route.
    Layer,
    /// `#[idempotent]` on the handler, with [`IdempotencyKeyHeader`] and [`RunToCompletionLayer`].
    Attribute,
}

/// A history's plan.
#[derive(Debug, Clone)]
struct Plan {
    route: Route,
    lease: Duration,
    json_fingerprint: bool,
    wait: Option<Duration>,
    /// The runs of each (user, key), in order; runs past the list create.
    behaviours: BTreeMap<(usize, usize), Vec<Behaviour>>,
    callers: Vec<CallerPlan>,
    faults: Vec<(Duration, NetFault)>,
}

fn ms(rng: &mut SplitMix64, max: u64) -> Duration {
    Duration::from_millis(rng.below(max + 1))
}

fn draw(seed: u64) -> Plan {
    let mut rng = SplitMix64::new(seed);
    let lease = Duration::from_secs(rng.pick(&[1, 2, 60]));
    let json_fingerprint = rng.chance(50);
    let wait = rng.chance(30).then(|| ms(&mut rng, 1500));
    let (users, keys) = (1 + rng.below(2), 1 + rng.below(2));
    let mut behaviours = BTreeMap::new();
    for user in 0..users {
        for key in 0..keys {
            let runs = (0..=rng.below(3))
                .map(|_| Behaviour {
                    work: if rng.chance(20) { ms(&mut rng, 3000) } else { ms(&mut rng, 200) },
                    ending: match rng.below(100) {
                        0..45 => Ending::Created,
                        45..60 => Ending::ChargedThenFailed,
                        60..70 => Ending::Declined,
                        70..85 => Ending::NotProcessed,
                        _ => Ending::Panic,
                    },
                })
                .collect();
            behaviours.insert((usize::try_from(user).unwrap_or(0), usize::try_from(key).unwrap_or(0)), runs);
        }
    }
    let callers = (0..2 + rng.below(4))
        .map(|_| CallerPlan {
            user: usize::try_from(rng.below(users)).unwrap_or(0),
            key: usize::try_from(rng.below(keys)).unwrap_or(0),
            body: match rng.below(100) {
                0..80 => BodyForm::Canonical,
                80..90 => BodyForm::Reformatted,
                _ => BodyForm::Other,
            },
            delay: ms(&mut rng, 300),
            retry: rng.chance(85).then(|| (1 + u32::try_from(rng.below(6)).unwrap_or(0), rng.next_u64())),
            timeout: rng.chance(35).then(|| Duration::from_millis(50) + ms(&mut rng, 700)),
        })
        .collect();
    let faults = (0..rng.below(4))
        .map(|_| {
            let at = ms(&mut rng, 2000);
            let fault = match rng.below(4) {
                0 => NetFault::LoseOneResponse,
                1 => NetFault::Refuse(ms(&mut rng, 500)),
                2 => NetFault::Stall(ms(&mut rng, 800)),
                _ => NetFault::Kill,
            };
            (at, fault)
        })
        .collect();
    let route = if rng.chance(50) { Route::Layer } else { Route::Attribute };
    Plan { route, lease, json_fingerprint, wait, behaviours, callers, faults }
}

/// The body of `key`'s request, as `form` writes it.
fn request_body(key: usize, form: BodyForm) -> Bytes {
    let amount = 100 + key;
    match form {
        BodyForm::Canonical => format!(r#"{{"amount":{amount},"currency":"eur"}}"#).into(),
        BodyForm::Reformatted => format!(r#"{{ "currency": "eur",  "amount": {amount} }}"#).into(),
        BodyForm::Other => format!(r#"{{"amount":{},"currency":"eur"}}"#, amount + 900).into(),
    }
}

/// Whether the layer takes `a` and `b` for the same request.
fn same_request(plan: &Plan, a: &[u8], b: &[u8]) -> bool {
    if plan.json_fingerprint {
        serde_json::from_slice::<serde_json::Value>(a).ok() == serde_json::from_slice::<serde_json::Value>(b).ok()
    } else {
        a == b
    }
}

/// One run of the handler, as it happened.
#[derive(Debug, Clone)]
struct Run {
    slot: (usize, usize),
    n: usize,
    caller: usize,
    body: Bytes,
    ending: Ending,
    started: Instant,
    ended: Option<Instant>,
    charged: bool,
    /// Status and body of its answer (none after a panic).
    answer: Option<(u16, Bytes)>,
}

/// A response the server sent (seen outside the layer), or a caller's last outcome.
#[derive(Debug, Clone)]
struct Seen {
    caller: usize,
    status: u16,
    replayed: bool,
    key_echo: Option<String>,
    body: Bytes,
}

/// The server's side of a history.
#[derive(Debug)]
struct Server {
    plan: Plan,
    runs: Mutex<Vec<Run>>,
    sent: Mutex<Vec<Seen>>,
    /// Requests that reached the server and have not been answered, nor given up by their client.
    in_flight: AtomicUsize,
}

impl Server {
    fn runs(&self) -> std::sync::MutexGuard<'_, Vec<Run>> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn running(&self) -> usize {
        self.runs().iter().filter(|r| r.ended.is_none()).count()
    }

    fn sent(&self) -> std::sync::MutexGuard<'_, Vec<Seen>> {
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

/// Waits until the server is quiet: no handler running, no request in flight, and nothing new
/// for 300 ms. What the network held is delivered when it heals, maybe after its client left, so
/// a request can reach the server after every caller has finished. `false` at `deadline`.
async fn settle(server: &Server, deadline: Instant) -> bool {
    let (mut seen, mut quiet_since) = (None, Instant::now());
    while Instant::now() < deadline {
        let busy = server.running() > 0 || server.in_flight.load(Ordering::Relaxed) > 0;
        let now = Some((server.runs().len(), server.sent().len()));
        if busy || now != seen {
            (seen, quiet_since) = (if busy { None } else { now }, Instant::now());
        } else if quiet_since.elapsed() >= Duration::from_millis(300) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

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
        });
        (runs.len() - 1, n, behaviour)
    };
    let ends = Ends(Arc::clone(server), index);
    tokio::time::sleep(behaviour.work).await;
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

fn seen(caller: usize, status: StatusCode, headers: &HeaderMap, body: &Bytes) -> Seen {
    Seen {
        caller,
        status: status.as_u16(),
        replayed: headers.get(&IDEMPOTENT_REPLAYED).is_some_and(|v| v == "true"),
        key_echo: headers.get(&IDEMPOTENCY_KEY).and_then(|v| v.to_str().ok()).map(str::to_owned),
        body: body.clone(),
    }
}

/// How often each store step fails, loses its reply or is delayed past the lease, in histories
/// with store faults.
const STORE_FAULTS: FaultRates = FaultRates { fail: 6, lose_reply: 6, delay: 3, extend_fail: 6 };

/// Serves `app` on a loopback port of its own.
async fn serve(app: Router) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a history's server");
    let addr = listener.local_addr().expect("the server's address");
    (addr, tokio::spawn(async move { axum::serve(listener, app).await.expect("a history's server") }))
}

/// A history's verdict.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Store steps that failed, lost their reply or were delayed (histories with store faults).
    pub store_faults: u64,
    /// Runs after a recorded answer, or overlapping another, in histories where store faults
    /// struck: re-runs by the limits README names.
    pub reruns_under_store_faults: u64,
    /// Requests the callers made (not counting retries).
    pub calls: u64,
    /// Handler runs.
    pub runs: u64,
    /// Responses the server sent.
    pub responses: u64,
    /// Of them, replays.
    pub replays: u64,
    /// Responses lost by the network (the proxy's count).
    pub lost_responses: u64,
    /// Callers whose last outcome was an error, not a response.
    pub gave_up: u64,
    /// What broke the promise.
    pub violations: Vec<String>,
    /// The history, for a failure's report.
    pub log: String,
}

/// A rule of the layer's configuration broken on purpose, to show the judgement catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerBug {
    /// `record_status` releases the key after a `5xx`: the retry of a request whose handler
    /// charged and then failed charges again.
    ReleaseServerErrors,
    /// Keys shared by all callers, while two users send the same keys: one user gets the
    /// other's answers.
    KeysSharedByAllCallers,
}

impl LayerBug {
    /// Every planted layer bug.
    pub const ALL: [LayerBug; 2] = [LayerBug::ReleaseServerErrors, LayerBug::KeysSharedByAllCallers];
}

/// How long a history may take: far more than its plan (about 6 s at most).
const HISTORY_LIMIT: Duration = Duration::from_secs(60);

/// The history's server: its route, the way in its plan says (the layer when a bug is planted
/// in it), and the log of what it sends outside.
fn router<S: Store + Clone + 'static>(server: &Arc<Server>, store: S, bug: Option<LayerBug>) -> Router {
    let plan = &server.plan;
    let route = if plan.route == Route::Attribute && bug.is_none() {
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
            Some(LayerBug::ReleaseServerErrors) => layer = layer.record_status(|status| !status.is_server_error()),
            Some(LayerBug::KeysSharedByAllCallers) => layer = layer.keys_shared_by_all_callers(),
            None => {}
        }
        Router::new().route("/charge", post(charge)).route_layer(layer).with_state(Arc::clone(server))
    };
    route.layer(axum::middleware::from_fn_with_state(Arc::clone(server), log_sent))
}

/// Runs the history of `seed` against a server of its own over `store`, its keys under `prefix`,
/// with `bug` planted in the layer's configuration (or none).
pub async fn run_history<S: Store + Clone + 'static>(
    seed: u64,
    store: S,
    prefix: &str,
    bug: Option<LayerBug>,
    store_faults: bool,
) -> Verdict {
    let plan = draw(seed);
    let server = Arc::new(Server {
        plan: plan.clone(),
        runs: Mutex::default(),
        sent: Mutex::default(),
        in_flight: AtomicUsize::new(0),
    });
    // Store faults only under a short lease: a delayed step outlasts the lease, up to 1.5 times.
    let store_steps = (store_faults && plan.lease <= Duration::from_secs(2)).then(History::new);
    let (addr, serving) = match &store_steps {
        Some(history) => {
            let rng = SplitMix64::new(seed ^ 0x5707_E000_FA17);
            let planted = Planted::new(store.clone(), None);
            serve(router(&server, FaultStore::new(planted, history.clone(), STORE_FAULTS, rng, plan.lease), bug)).await
        }
        None => serve(router(&server, store.clone(), bug)).await,
    };
    // The probe's server: the same route over the store itself.
    let (probe_addr, probe_serving) = serve(router(&server, store, bug)).await;
    let proxy = Arc::new(FaultProxy::start(&addr.to_string()).await.expect("start the history's proxy"));

    let key_of = |k: usize| format!("{prefix}k{k}");
    let network = {
        let (proxy, faults) = (Arc::clone(&proxy), plan.faults.clone());
        tokio::spawn(async move { break_the_network(&proxy, faults).await })
    };
    let callers: Vec<_> = plan
        .callers
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let (c, url, key) = (c.clone(), format!("http://{}/charge", proxy.addr()), key_of(c.key));
            tokio::spawn(async move { call(i, &c, &url, &key).await })
        })
        .collect();
    let mut verdict = Verdict::default();
    let mut finals = Vec::new();
    let deadline = Instant::now() + HISTORY_LIMIT;
    for caller in callers {
        let Ok(done) = tokio::time::timeout_at(deadline, caller).await else {
            verdict.violations.push(format!("the callers did not finish within {HISTORY_LIMIT:?}"));
            break;
        };
        finals.push(done.expect("a caller task"));
    }
    let _ = network.await;
    proxy.set_mode(Mode::Pass);
    proxy.kill_connections();
    if verdict.violations.is_empty() && !settle(&server, deadline).await {
        verdict.violations.push(format!(
            "the server was not quiet within {HISTORY_LIMIT:?}: {} handler runs, {} requests in flight",
            server.running(),
            server.in_flight.load(Ordering::Relaxed)
        ));
    }
    let steps = store_steps.map(|history| history.entries()).unwrap_or_default();
    let injected = steps.iter().filter(|e| matches!(&e.event, Event::Step(step) if step.fault != Fault::None)).count();
    verdict.store_faults = injected as u64;
    if verdict.violations.is_empty() {
        probe(&server, &plan, probe_addr, &key_of, injected > 0, &mut verdict).await;
        judge(&server, &plan, &finals, &key_of, injected > 0, &mut verdict);
    }
    verdict.calls = plan.callers.len() as u64;
    verdict.runs = server.runs().len() as u64;
    let sent = server.sent().clone();
    verdict.responses = sent.len() as u64;
    verdict.replays = sent.iter().filter(|s| s.replayed).count() as u64;
    verdict.lost_responses = proxy.stats().lost_responses.load(Ordering::Relaxed);
    verdict.gave_up = finals.iter().filter(|f| f.is_err()).count() as u64;
    serving.abort();
    probe_serving.abort();
    let _ = writeln!(verdict.log, "history of seed {seed} (HTTP): {plan:?}");
    for run in server.runs().iter() {
        let _ = writeln!(verdict.log, "  run {run:?}");
    }
    for s in &sent {
        let _ = writeln!(verdict.log, "  sent {s:?}");
    }
    for f in &finals {
        let _ = writeln!(verdict.log, "  got {f:?}");
    }
    for step in &steps {
        let _ = writeln!(verdict.log, "  store {step}");
    }
    verdict
}

async fn break_the_network(proxy: &FaultProxy, mut faults: Vec<(Duration, NetFault)>) {
    faults.sort_by_key(|(at, _)| *at);
    let start = Instant::now();
    for (at, fault) in faults {
        tokio::time::sleep_until(start + at).await;
        match fault {
            NetFault::LoseOneResponse => proxy.set_mode(Mode::LoseOneResponse),
            NetFault::Refuse(d) | NetFault::Stall(d) => {
                proxy.set_mode(if matches!(fault, NetFault::Refuse(_)) { Mode::Refuse } else { Mode::Stall });
                tokio::time::sleep(d).await;
                proxy.set_mode(Mode::Pass);
            }
            NetFault::Kill => proxy.kill_connections(),
        }
    }
}

/// A caller's last outcome: the response it got, or its error.
type Final = Result<Seen, String>;

/// Caller `i` sends its request (with its retries) and reads the answer.
async fn call(i: usize, plan: &CallerPlan, url: &str, key: &str) -> Final {
    tokio::time::sleep(plan.delay).await;
    let inner = reqwest::Client::builder().build().expect("a reqwest client");
    let client = match plan.retry {
        Some((attempts, jitter)) => reqwest_middleware::ClientBuilder::new(inner)
            .with(IdempotentRetry::new(
                RetryPolicy::default()
                    .max_attempts(attempts)
                    .backoff(Duration::from_millis(20), Duration::from_millis(200))
                    .max_elapsed(Duration::from_secs(4))
                    .jitter_seed(jitter),
            ))
            .build(),
        None => reqwest_middleware::ClientBuilder::new(inner).build(),
    };
    let mut request = client
        .post(url)
        .header(IDEMPOTENCY_KEY, key)
        .header("x-user", plan.user.to_string())
        .header("x-key", plan.key.to_string())
        .header("x-caller", i.to_string())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(request_body(plan.key, plan.body));
    if let Some(timeout) = plan.timeout {
        request = request.timeout(timeout);
    }
    let response = match request.send().await {
        Ok(response) => response,
        Err(e) => {
            return Err(match OutboundError::find(&e) {
                Some(outbound) => format!("{outbound}"),
                None => format!("{e}"),
            });
        }
    };
    let (status, headers) = (response.status(), response.headers().clone());
    match response.bytes().await {
        Ok(body) => Ok(seen(i, status, &headers, &body)),
        Err(e) => Err(format!("reading the body of a {status}: {e}")),
    }
}

/// What the callers saw and the ledger says, per user and key. With store faults (`faulted`), a
/// run may follow another's recorded answer, by the limits README names (a record that could not
/// be written, a claim whose lease ran out while the store was unreachable): those are counted,
/// not judged.
fn judge(
    server: &Server,
    plan: &Plan,
    finals: &[Final],
    key_of: &(dyn Fn(usize) -> String + Sync),
    faulted: bool,
    verdict: &mut Verdict,
) {
    let runs = server.runs().clone();
    let sent = server.sent().clone();
    for &slot in plan.behaviours.keys() {
        let mine: Vec<&Run> = runs.iter().filter(|r| r.slot == slot).collect();
        let overlaps = mine.windows(2).filter(|p| p[1].started < p[0].ended.unwrap_or(p[0].started)).count();
        let recorded = mine.iter().filter(|r| r.ending.recorded()).count();
        let after_recorded = mine.iter().position(|r| r.ending.recorded()).map_or(0, |i| mine.len() - i - 1);
        if faulted {
            verdict.reruns_under_store_faults += (overlaps + after_recorded) as u64;
            continue;
        }
        if overlaps > 0 {
            verdict.violations.push(format!("{slot:?}: {overlaps} runs overlap the one before"));
        }
        if recorded > 1 || after_recorded > 0 {
            verdict.violations.push(format!(
                "{slot:?}: a run followed a recorded answer (runs {:?})",
                mine.iter().map(|r| r.ending).collect::<Vec<_>>()
            ));
        }
        let charges = mine.iter().filter(|r| r.charged).count();
        if charges > 1 {
            verdict.violations.push(format!("{slot:?}: charged {charges} times"));
        }
    }
    // One record per key: every replay of a key, the probe's too, is the same answer.
    let mut replays: BTreeMap<(usize, usize), &Seen> = BTreeMap::new();
    for s in sent.iter().filter(|s| s.replayed) {
        let Some((user, key, _)) = tag_of(&s.body) else { continue };
        let first = *replays.entry((user, key)).or_insert(s);
        if (first.status, &first.body) != (s.status, &s.body) {
            verdict.violations.push(format!(
                "{:?}: two different answers replayed: {} {} and {} {}",
                (user, key),
                first.status,
                String::from_utf8_lossy(&first.body),
                s.status,
                String::from_utf8_lossy(&s.body)
            ));
        }
    }
    let responses =
        sent.iter().map(|s| ("sent", s)).chain(finals.iter().filter_map(|f| f.as_ref().ok()).map(|s| ("got", s)));
    for (how, s) in responses {
        check_response(plan, &runs, key_of, how, s, verdict);
    }
}

/// One response, against the runs of its caller's user and key.
fn check_response(
    plan: &Plan,
    runs: &[Run],
    key_of: &(dyn Fn(usize) -> String + Sync),
    how: &str,
    s: &Seen,
    verdict: &mut Verdict,
) {
    let Some(caller) = plan.callers.get(s.caller) else {
        return; // the probe's
    };
    let slot = (caller.user, caller.key);
    let body = request_body(caller.key, caller.body);
    let what = format!("caller {} {how} {} {}", s.caller, s.status, String::from_utf8_lossy(&s.body));
    if s.key_echo != Some(key_of(caller.key)) {
        verdict.violations.push(format!("{what}: the key echoed back is {:?}", s.key_echo));
    }
    let Some((user, key, n)) = tag_of(&s.body) else {
        if (200..300).contains(&s.status) {
            verdict.violations.push(format!("{what}: a 2xx that no run answered"));
        }
        let others = plan.callers.iter().filter(|c| (c.user, c.key) == slot);
        if s.status == 422 && others.into_iter().all(|c| same_request(plan, &request_body(c.key, c.body), &body)) {
            verdict.violations.push(format!("{what}: 422, but every caller of the key sent this request's body"));
        }
        return;
    };
    let run = runs.iter().find(|r| r.slot == (user, key) && r.n == n);
    let Some(run) = run else {
        verdict.violations.push(format!("{what}: no such run"));
        return;
    };
    if run.slot != slot {
        verdict.violations.push(format!("{what}: the answer of another user's or key's run {:?}", run.slot));
    }
    if run.answer.as_ref() != Some(&(s.status, s.body.clone())) {
        verdict.violations.push(format!("{what}: not what run {} answered ({:?})", run.n, run.answer));
    }
    if !same_request(plan, &run.body, &body) {
        verdict.violations.push(format!("{what}: the answer of a request with another body"));
    }
    if s.replayed && !run.ending.recorded() {
        verdict.violations.push(format!("{what}: replays an answer that is not recorded ({:?})", run.ending));
    }
    if !s.replayed && run.caller != s.caller {
        verdict
            .violations
            .push(format!("{what}: run {} was caller {}'s, and this is not marked replayed", run.n, run.caller));
    }
}

/// The `x-caller` of the probe's requests.
const PROBE: usize = usize::MAX;

/// The run a response's body names: (user, key, run).
fn tag_of(body: &[u8]) -> Option<(usize, usize, usize)> {
    let value = serde_json::from_slice::<serde_json::Value>(body).ok()?;
    let number = |field: &str| value.get(field)?.as_u64().and_then(|n| usize::try_from(n).ok());
    Some((number("user")?, number("key")?, number("run")?))
}

/// After the history, on a server of its own without store faults: each key replays its
/// recorded answer, or runs once now. Without store faults, each key is then charged exactly
/// once (none if its request was declined); with them, the probe replays what was replayed
/// before, if anything was.
async fn probe(
    server: &Server,
    plan: &Plan,
    addr: SocketAddr,
    key_of: &(dyn Fn(usize) -> String + Sync),
    faulted: bool,
    verdict: &mut Verdict,
) {
    let client = reqwest::Client::new();
    for &slot in plan.behaviours.keys() {
        let runs: Vec<Run> = server.runs().iter().filter(|r| r.slot == slot).cloned().collect();
        // The run whose answer was replayed, if one was.
        let replayed = server
            .sent()
            .iter()
            .filter(|s| s.replayed)
            .find_map(|s| tag_of(&s.body).filter(|t| (t.0, t.1) == slot))
            .and_then(|t| runs.iter().find(|r| r.n == t.2).cloned());
        // The bodies to try, the recorded request's first, so the probe is the same request; then
        // the other bodies the key was sent with (a claim left by a failed release or a lost reply
        // holds its request's fingerprint until its lease ends), then the canonical one.
        let mut bodies: Vec<Bytes> = Vec::new();
        let sent_with = plan.callers.iter().filter(|c| (c.user, c.key) == slot).map(|c| request_body(c.key, c.body));
        for body in replayed
            .iter()
            .chain(runs.iter().filter(|r| r.ending.recorded()))
            .map(|r| r.body.clone())
            .chain(sent_with)
            .chain([request_body(slot.1, BodyForm::Canonical)])
        {
            if !bodies.contains(&body) {
                bodies.push(body);
            }
        }
        // A completion that failed keeps its claim for its lease.
        let blocked_until = Instant::now() + plan.lease * if faulted { 3 } else { 1 } + Duration::from_secs(3);
        let mut asked = 0;
        let answer = 'probing: loop {
            let (mut last, mut busy) = (None, false);
            for body in &bodies {
                let sent = client
                    .post(format!("http://{addr}/charge"))
                    .header(IDEMPOTENCY_KEY, key_of(slot.1))
                    .header("x-user", slot.0.to_string())
                    .header("x-key", slot.1.to_string())
                    .header("x-caller", PROBE.to_string())
                    .header("x-probe", "1")
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(body.clone())
                    .send()
                    .await;
                let response = match sent {
                    Ok(response) => response,
                    Err(e) => {
                        verdict.violations.push(format!("{slot:?}: the probe failed: {e}"));
                        return;
                    }
                };
                asked += 1;
                let (status, headers) = (response.status(), response.headers().clone());
                let bytes = response.bytes().await.unwrap_or_default();
                let got = seen(PROBE, status, &headers, &bytes);
                if status != StatusCode::CONFLICT && status != StatusCode::UNPROCESSABLE_ENTITY {
                    break 'probing got;
                }
                busy |= status == StatusCode::CONFLICT;
                last = Some(got);
            }
            // Every body met a claim, or a record of another request. A claim ends with its lease;
            // without store faults, a `422` for every body the key was sent with is final.
            if Instant::now() >= blocked_until || !(busy || faulted) {
                break last.expect("at least the canonical body was tried");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let runs: Vec<Run> = server.runs().iter().filter(|r| r.slot == slot).cloned().collect();
        let probe_run = runs.iter().find(|r| r.caller == PROBE);
        let first_recorded = runs.iter().find(|r| r.ending.recorded());
        let answered = |run: &Run| run.answer == Some((answer.status, answer.body.clone()));
        let fine = match (faulted, &replayed, probe_run) {
            // Without store faults the first recorded answer is the record.
            (false, _, Some(run)) => {
                first_recorded.is_some_and(|first| first.n == run.n) && !answer.replayed && answered(run)
            }
            (false, _, None) => answer.replayed && first_recorded.is_some_and(answered),
            (true, Some(before), None) => answer.replayed && answered(before),
            (true, Some(_), Some(_)) => false,
            (true, None, Some(run)) => !answer.replayed && answered(run),
            (true, None, None) => answer.replayed && runs.iter().any(|r| r.ending.recorded() && answered(r)),
        };
        if !fine {
            verdict.violations.push(format!(
                "{slot:?}: the probe got {answer:?} after {asked} request(s); the key's runs: {:?}",
                runs.iter().map(|r| (r.caller, r.ending, r.answer.clone())).collect::<Vec<_>>()
            ));
        }
        // A declined request is final, and charges nothing.
        let declined = runs.iter().any(|r| r.ending == Ending::Declined);
        let charges = runs.iter().filter(|r| r.charged).count();
        if !faulted && charges != usize::from(!declined) {
            verdict
                .violations
                .push(format!("{slot:?}: charged {charges} times after the probe (declined: {declined})"));
        }
    }
}
