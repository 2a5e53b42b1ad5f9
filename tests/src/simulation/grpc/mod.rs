//! Histories at the gRPC edge: the promise as a tonic service's clients see it, with every part
//! real.
//!
//! A history has its own tonic server over the store under test (`server.rs`): the test service's
//! `payments.Payments/Pay` behind [`GrpcIdempotencyLayer`](idempotent_runtime::grpc::GrpcIdempotencyLayer),
//! keys bound to the caller's user (`x-user` metadata); per history, a lease of 2 s, 3 s or 60 s,
//! `wait` or not, and the key in the `idempotency-key` metadata or, in about a third of the
//! histories, in the request message's `request_id` field (AIP-155, `method_keyed_by`)
//! (`plan.rs`). Between the server and its clients sits a fault proxy that loses responses,
//! refuses connections, stalls traffic and kills connections at drawn moments in the first 600 ms
//! ([`edge`](super::edge), shared with the HTTP simulation). The clients are duplicates of one call
//! (`clients.rs`): two to five callers, of one or two users, with one or two keys, each a tonic
//! client on a channel of its own that resends the same call with the same key (one to six
//! attempts, some with a per-attempt deadline) on `UNAVAILABLE`, `ABORTED`, a passed deadline or
//! a transport error, waits a positive `grpc-retry-pushback-ms` and stops at a negative one, as
//! grpcio's `retryPolicy` with a deadline does: about half by a retry loop of its own, the others
//! through the library's `GrpcRetryLayer` on their channel, configured alike (which also stops at
//! a replayed answer). Some send a different message under the same key.
//!
//! The handler works for up to 3 s (past a third of a short lease: the claim must be renewed),
//! then pays and answers `OK` with a receipt, pays and fails with `UNAVAILABLE` or `INTERNAL`
//! (recorded: it must never run again), declines with `FAILED_PRECONDITION` without paying
//! (recorded), answers `not_processed(UNAVAILABLE)` without paying (released), or panics before
//! paying. What it does is drawn per run of a key, so a key released runs again with another
//! ending. With `store_faults`, histories with a short lease also have the simulation's fault
//! injector between the layer and the store.
//!
//! The judgement (`judge.rs`), per user and key, from the handler's ledger, every answer the
//! server sent (logged by a tower layer outside the idempotency layer) and what each caller got
//! in the end:
//! - the handler's runs never overlap, at most one of them ends in a recorded answer (`OK`, a
//!   failure after paying, a decline), and none follows it: the card is paid at most once (where
//!   store faults struck, runs after a recorded answer are README's limits: counted, not judged);
//! - every answer carrying a run's outcome (each names its run) is that run's answer: code,
//!   message and receipt. The first, once, to the caller who ran it, after the run ended; then
//!   replays marked `idempotent-replayed: true`, all of one key the same, only of a recorded
//!   answer, only to callers of the same user who sent the run's message; a replayed error
//!   carries a negative `grpc-retry-pushback-ms`, a first answer none;
//! - of the layer's own answers: `OK` only with a run's receipt; `ABORTED` with a positive
//!   pushback; `FAILED_PRECONDITION` only when the key was sent with another message; no replay
//!   but of a run's answer (without store faults);
//! - of each caller's attempts, as its side saw them and as they reached the server (`x-caller`,
//!   `x-attempt`): each carried the caller's key (or, keyed by message, one key for all), each
//!   answer it got is one the server sent it, none followed a final answer, none came sooner
//!   than the pushback or back-off asked, a caller stopped early only at its budget, and a
//!   layered caller got its last attempt's answer;
//! - once the server is quiet, a probe on a second server over the store itself (no proxy, no
//!   store faults) replays the recorded answer, or runs the handler once if nothing was recorded,
//!   so each key ends paid exactly once, or not at all if declined (without store faults).
//!   `ABORTED` for longer than the lease after the last run ended is a blocked key.
//!
//! The plans are drawn from a seed; the histories run in real time, so interleavings are not
//! replayed exactly. The judgement does not depend on them, but it assumes, as the HTTP
//! simulation does, that the process renews a short lease in time: so the shortest lease is 2 s.

mod clients;
mod judge;
mod plan;
mod server;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
use server::{Server, serve};

/// The scope of these histories' keys.
pub const SCOPE: &str = "simgrpc";

/// A configuration of the layer broken on purpose, to show the judgement catches it (two break
/// what the layer sends, in the server's own tower layer outside it; the last breaks the clients'
/// `GrpcRetryLayer`, in a tower layer under it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigBug {
    /// The layer's `record_code` releases the key after `UNAVAILABLE` and `INTERNAL`: the retry
    /// of a call whose handler paid and then failed pays again.
    ReleaseServerErrors,
    /// The layer's keys are shared by all callers, while two users send the same keys: one user
    /// gets the other's answers.
    KeysSharedByAllCallers,
    /// Replays go out without `idempotent-replayed: true` (removed on their way out): a caller
    /// cannot tell a replay from a run of its own.
    ReplaysUnmarked,
    /// A replayed error's `grpc-retry-pushback-ms: -1` goes out as `0` (changed on its way out):
    /// a client's retry policy resends a call whose answer is final.
    ReplayedErrorsInviteRetries,
    /// Under each layered caller's `GrpcRetryLayer`, every attempt's `idempotency-key` is replaced
    /// by a fresh UUID: a retry is a new call to the server.
    RetryLayerFreshKeys,
}

impl ConfigBug {
    /// Every planted configuration bug.
    pub const ALL: [ConfigBug; 5] = [
        ConfigBug::ReleaseServerErrors,
        ConfigBug::KeysSharedByAllCallers,
        ConfigBug::ReplaysUnmarked,
        ConfigBug::ReplayedErrorsInviteRetries,
        ConfigBug::RetryLayerFreshKeys,
    ];
}

/// A history's verdict.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Store steps that failed, lost their reply or were delayed (histories with store faults).
    pub store_faults: u64,
    /// Runs after a recorded answer, or overlapping another, in histories where store faults
    /// struck: re-runs by the limits README names.
    pub reruns_under_store_faults: u64,
    /// Calls the callers made (not counting retries).
    pub calls: u64,
    /// Of them, calls made through `GrpcRetryLayer`.
    pub layered_calls: u64,
    /// The attempts of those calls (as the layer sent them).
    pub layered_attempts: u64,
    /// Of those calls, how many the layer ended at an answer with a retried code because it was
    /// a replay or carried a negative pushback.
    pub layered_stopped_at_final: u64,
    /// Handler runs.
    pub runs: u64,
    /// Answers the server sent.
    pub answers: u64,
    /// Of them, replays.
    pub replays: u64,
    /// Responses lost by the network (the proxy's count).
    pub lost_responses: u64,
    /// Callers whose last outcome was an error of the transport or a deadline, not an answer.
    pub gave_up: u64,
    /// What broke the promise.
    pub violations: Vec<String>,
    /// Of them, how many the probe found (the others the history's own judgement did).
    pub probe_violations: usize,
    /// The history, for a failure's report.
    pub log: String,
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
    let server = Arc::new(Server {
        plan: draw(seed),
        runs: Mutex::default(),
        sent: Mutex::default(),
        arrived: Mutex::default(),
        in_flight: AtomicUsize::new(0),
    });
    let plan = &server.plan;
    // Store faults only under a short lease: a delayed step outlasts the lease, up to 1.5 times.
    let store_steps = (store_faults && plan.lease <= Duration::from_secs(3)).then(History::new);
    let (addr, serving) = match &store_steps {
        Some(history) => {
            let rng = SplitMix64::new(seed ^ 0x5707_E000_FA17);
            let planted = Planted::new(store.clone(), None);
            serve(&server, FaultStore::new(planted, history.clone(), STORE_FAULTS, rng, plan.lease, 0), bug).await
        }
        None => serve(&server, store.clone(), bug).await,
    };
    // The probe's server: the same service over the store itself.
    let (probe_addr, probe_serving) = serve(&server, store, bug).await;
    let proxy = Arc::new(FaultProxy::start(&addr.to_string()).await.expect("start the history's proxy"));

    // `<prefix>-<n>`, as the store simulation's log reads a key's number.
    let key_of = |k: usize| format!("{prefix}-{k}");
    let network = {
        let (proxy, faults) = (Arc::clone(&proxy), plan.faults.clone());
        tokio::spawn(async move { break_the_network(&proxy, faults).await })
    };
    let callers: Vec<_> = (0..plan.callers.len())
        .map(|i| {
            let (server, target, key) =
                (Arc::clone(&server), format!("http://{}", proxy.addr()), key_of(plan.callers[i].key));
            tokio::spawn(async move { call(i, &server.plan, &server.plan.callers[i], &target, &key, bug).await })
        })
        .collect();
    let mut verdict = Verdict::default();
    let deadline = Instant::now() + HISTORY_LIMIT;
    let (ended, unfinished) = finish(callers, deadline).await;
    let finals: Vec<_> = ended.iter().map(|e| e.last.clone()).collect();
    if !unfinished.is_empty() {
        verdict.violations.push(format!(
            "callers {unfinished:?} did not finish within {HISTORY_LIMIT:?}; the server then had {} calls in flight \
             and {} handler runs going",
            server.in_flight.load(Ordering::Relaxed),
            server.running()
        ));
    }
    let _ = network.await;
    proxy.set_mode(Mode::Pass);
    proxy.kill_connections();
    let busy = || server.running() > 0 || server.in_flight.load(Ordering::Relaxed) > 0;
    let progress = || (server.runs().len(), server.sent().len());
    if verdict.violations.is_empty() && !settle(busy, progress, deadline).await {
        verdict.violations.push(format!(
            "the server was not quiet within {HISTORY_LIMIT:?}: {} handler runs, {} calls in flight",
            server.running(),
            server.in_flight.load(Ordering::Relaxed)
        ));
    }
    let steps = store_steps.map(|history| history.entries()).unwrap_or_default();
    let injected = steps.iter().filter(|e| matches!(&e.event, Event::Step(step) if step.fault != Fault::None)).count();
    verdict.store_faults = injected as u64;
    if verdict.violations.is_empty() {
        probe(&server, plan, probe_addr, &key_of, injected > 0, &mut verdict).await;
        verdict.probe_violations = verdict.violations.len();
        judge(&server, plan, &ended, &key_of, injected > 0, &mut verdict);
    }
    verdict.calls = plan.callers.len() as u64;
    count_layered(plan, &ended, &mut verdict);
    verdict.runs = server.runs().len() as u64;
    let sent = server.sent().clone();
    verdict.answers = sent.len() as u64;
    verdict.replays = sent.iter().filter(|s| s.replayed).count() as u64;
    verdict.lost_responses = proxy.stats().lost_responses.load(Ordering::Relaxed);
    verdict.gave_up = finals.iter().filter(|f| f.is_err()).count() as u64;
    serving.abort();
    probe_serving.abort();
    let _ = writeln!(verdict.log, "history of seed {seed} (gRPC): {plan:?}");
    for run in server.runs().iter() {
        let _ = writeln!(verdict.log, "  run {run:?}");
    }
    for s in &sent {
        let _ = writeln!(verdict.log, "  sent {s:?}");
    }
    for (i, e) in ended.iter().enumerate() {
        for (n, t) in e.tried.iter().enumerate() {
            let _ = writeln!(verdict.log, "  caller {i} attempt {} got {:?}", n + 1, t.outcome);
        }
        let _ = writeln!(verdict.log, "  caller {i} got {:?}", e.last);
    }
    for a in server.arrived().iter() {
        let _ = writeln!(verdict.log, "  arrived {a:?}");
    }
    for step in &steps {
        let _ = writeln!(verdict.log, "  store {step}");
    }
    verdict
}

/// Notes in `verdict` the calls made through `GrpcRetryLayer`, their attempts, and how many of
/// them it ended at a final answer with a retried code.
fn count_layered(plan: &plan::Plan, ended: &[clients::Ended], verdict: &mut Verdict) {
    verdict.layered_calls = plan.callers.iter().filter(|c| c.layered).count() as u64;
    verdict.layered_attempts =
        ended.iter().zip(&plan.callers).filter(|(_, c)| c.layered).map(|(e, _)| e.tried.len() as u64).sum();
    verdict.layered_stopped_at_final = ended
        .iter()
        .zip(&plan.callers)
        .filter(|(e, c)| {
            let final_answer = |s: &server::Seen| {
                s.replayed || s.pushback.as_deref().is_some_and(|p| p.parse::<i64>().is_ok_and(|ms| ms < 0))
            };
            c.layered && e.last.as_ref().is_ok_and(|s| clients::RETRIED.contains(&s.answer.code) && final_answer(s))
        })
        .count() as u64;
}
