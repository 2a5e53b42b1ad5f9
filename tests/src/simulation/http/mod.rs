//! Histories at the HTTP edge: the promise as an API's clients see it, with every part real.
//!
//! A history has its own server over the store under test (`server.rs`): a route behind
//! [`IdempotencyLayer`](idempotent_runtime::http::IdempotencyLayer) (keys bound to the caller's
//! user), or an `#[idempotent]` handler with `IdempotencyKeyHeader` and `RunToCompletionLayer`;
//! per history, a lease of 2 s, 3 s or 60 s, `json_fingerprint` or not, `wait` or not
//! (`plan.rs`). Between the server and its clients sits a fault proxy that loses responses,
//! refuses connections, stalls traffic and kills connections at drawn moments. The clients are
//! duplicates of one request (`clients.rs`): two to five callers, of one or two users, with one or
//! two keys, each with `IdempotentRetry` (up to six attempts, some with a per-attempt timeout) or
//! sending once. Some send the body re-formatted, some a different body under the same key.
//!
//! The handler works for up to 3 s (past a third of a short lease: the claim must be renewed),
//! then charges and answers `201`, charges and fails with `500`, declines with `402` without
//! charging, answers `503` as not processed (`NotProcessed` under the layer, an `Err` under the
//! attribute), or panics. What it does is drawn per run of a key, so a key released by a panic
//! runs again with another ending. In half the histories each run first notifies a downstream
//! service (a bank behind a layer of its own) through `IdempotentRetry`, with no key of its own:
//! the middleware derives it from the upstream call's. With `store_faults`, histories with a
//! short lease also have the simulation's fault injector between the route and the store.
//!
//! The judgement (`judge.rs`), per user and key, from the handler's ledger, every response the
//! server sent (logged outside the route) and what each caller got in the end:
//! - the handler's runs never overlap, at most one of them ends in a recorded response (`201`,
//!   `500` after charging, `402`), and none follows it: the card is charged at most once (where
//!   store faults struck, runs after a recorded answer are README's limits: counted, not judged);
//! - every response carrying a run's body is that run's response, byte for byte: the first one,
//!   to the caller who ran it, then replays marked `Idempotent-Replayed: true`, all of one key
//!   the same, and only to callers of the same user whose body has the run's fingerprint; a
//!   `422` only when the key was sent with another body; a `2xx` only with a run's body; the key
//!   echoed back as sent;
//! - the bank runs exactly once per upstream key that notified it, under a key no other upstream
//!   key derived, however often the handler ran (store faults included);
//! - once the server is quiet, a probe replays the recorded response, or runs the handler once if
//!   nothing was recorded, so each key ends charged exactly once (without store faults). A `409`
//!   for longer than the lease after the last run ended is a blocked key.
//!
//! The plans are drawn from a seed; the histories run in real time, so interleavings are not
//! replayed exactly. The judgement does not depend on them, but it does assume that the process
//! renews a short lease in time: with leases of 1 s, nine of these tests at once on two cores
//! starved the process for over half a second, long enough for a claim to lapse and a duplicate
//! to take the key over (a limit README names; the library answered the first run's request with
//! `500`, "outcome not recorded"). So the shortest lease is 2 s.

mod clients;
mod judge;
mod plan;
mod server;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use idempotent_runtime::Store;
use tokio::time::Instant;

use super::bugs::Planted;
use super::edge::{HISTORY_LIMIT, STORE_FAULTS, break_the_network, finish, settle};
use super::faults::FaultStore;
use super::history::{Event, Fault, History};
use super::rng::SplitMix64;
use crate::proxy::{FaultProxy, Mode};
use clients::call;
use judge::{judge, probe};
use plan::draw;
use server::{Downstream, Server, router};

/// The scope of these histories' keys.
pub const SCOPE: &str = "simhttp";

/// A configuration broken on purpose, to show the judgement catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigBug {
    /// The layer's `record_status` releases the key after a `5xx`: the retry of a request whose
    /// handler charged and then failed charges again.
    ReleaseServerErrors,
    /// The layer's keys are shared by all callers, while two users send the same keys: one user
    /// gets the other's answers.
    KeysSharedByAllCallers,
    /// The handler's client sends a fresh key downstream on every run (`derive_keys(false)`), in
    /// every history: a handler that runs again notifies the bank again.
    FreshDownstreamKeys,
}

impl ConfigBug {
    /// Every planted configuration bug.
    pub const ALL: [ConfigBug; 3] =
        [ConfigBug::ReleaseServerErrors, ConfigBug::KeysSharedByAllCallers, ConfigBug::FreshDownstreamKeys];

    /// Whether the bug is in the layer (whose histories then all take the layer's route).
    fn in_layer(self) -> bool {
        matches!(self, ConfigBug::ReleaseServerErrors | ConfigBug::KeysSharedByAllCallers)
    }
}

/// A history's verdict.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Store steps that failed, lost their reply or were delayed (histories with store faults).
    pub store_faults: u64,
    /// Runs after a recorded answer, or overlapping another, in histories where store faults
    /// struck: re-runs by the limits README names.
    pub reruns_under_store_faults: u64,
    /// Requests the handler sent to the downstream service.
    pub downstream_calls: u64,
    /// Runs of the downstream service's handler.
    pub downstream_runs: u64,
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

/// The violation of callers that did not finish in time, with where their requests were then:
/// at the proxy, in the server, or neither.
fn unfinished_callers(unfinished: &[usize], server: &Server, proxy: &FaultProxy) -> String {
    let stats = proxy.stats();
    format!(
        "callers {unfinished:?} did not finish within {HISTORY_LIMIT:?}; the server then had {} requests in \
         flight and {} handler runs going; the proxy had accepted {} connections, refused {}, held {} chunks \
         and forwarded {} bytes",
        server.in_flight.load(Ordering::Relaxed),
        server.running(),
        stats.accepted.load(Ordering::Relaxed),
        stats.refused.load(Ordering::Relaxed),
        stats.held_chunks.load(Ordering::Relaxed),
        stats.bytes.load(Ordering::Relaxed),
    )
}

/// Runs the history of `seed` against a server of its own over `store`, its keys under `prefix`,
/// with `bug` planted in the layer's configuration (or none).
pub async fn run_history<S: Store + Clone + 'static>(
    seed: u64,
    store: S,
    prefix: &str,
    bug: Option<ConfigBug>,
    store_faults: bool,
) -> Verdict {
    let mut plan = draw(seed);
    plan.downstream |= bug == Some(ConfigBug::FreshDownstreamKeys);
    let (downstream, bank_serving) = if plan.downstream {
        let (bank, serving) = Downstream::start(bug != Some(ConfigBug::FreshDownstreamKeys)).await;
        (Some(bank), Some(serving))
    } else {
        (None, None)
    };
    let server = Arc::new(Server {
        plan,
        runs: Mutex::default(),
        sent: Mutex::default(),
        in_flight: AtomicUsize::new(0),
        downstream,
    });
    let plan = &server.plan;
    // Store faults only under a short lease: a delayed step outlasts the lease, up to 1.5 times.
    let store_steps = (store_faults && plan.lease <= Duration::from_secs(3)).then(History::new);
    let (addr, serving) = match &store_steps {
        Some(history) => {
            let rng = SplitMix64::new(seed ^ 0x5707_E000_FA17);
            let planted = Planted::new(store.clone(), None);
            serve(router(&server, FaultStore::new(planted, history.clone(), STORE_FAULTS, rng, plan.lease, 0), bug))
                .await
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
    let deadline = Instant::now() + HISTORY_LIMIT;
    let (finals, unfinished) = finish(callers, deadline).await;
    if !unfinished.is_empty() {
        verdict.violations.push(unfinished_callers(&unfinished, &server, &proxy));
    }
    let _ = network.await;
    proxy.set_mode(Mode::Pass);
    proxy.kill_connections();
    let busy = || server.running() > 0 || server.in_flight.load(Ordering::Relaxed) > 0;
    let progress = || (server.runs().len(), server.sent().len());
    if verdict.violations.is_empty() && !settle(busy, progress, deadline).await {
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
        probe(&server, plan, probe_addr, &key_of, injected > 0, &mut verdict).await;
        judge(&server, plan, &finals, &key_of, injected > 0, &mut verdict);
    }
    verdict.calls = plan.callers.len() as u64;
    if let Some(bank) = &server.downstream {
        verdict.downstream_calls = bank.called().len() as u64;
        verdict.downstream_runs = bank.runs().len() as u64;
    }
    verdict.runs = server.runs().len() as u64;
    let sent = server.sent().clone();
    verdict.responses = sent.len() as u64;
    verdict.replays = sent.iter().filter(|s| s.replayed).count() as u64;
    verdict.lost_responses = proxy.stats().lost_responses.load(Ordering::Relaxed);
    verdict.gave_up = finals.iter().filter(|f| f.is_err()).count() as u64;
    serving.abort();
    probe_serving.abort();
    if let Some(bank) = bank_serving {
        bank.abort();
    }
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

/// Serves `app` on a loopback port of its own.
async fn serve(app: Router) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a history's server");
    let addr = listener.local_addr().expect("the server's address");
    (addr, tokio::spawn(async move { axum::serve(listener, app).await.expect("a history's server") }))
}
