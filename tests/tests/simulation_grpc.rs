//! Histories at the gRPC edge (`tests/src/simulation/grpc/`): tonic clients that retry with one
//! key as a `retryPolicy` with a deadline would (by a loop of their own or through
//! `GrpcRetryLayer`), a network that loses responses, refuses, stalls
//! and kills connections, and handlers behind `GrpcIdempotencyLayer` that pay, fail after paying,
//! decline, say they did nothing, or panic. Each test runs 32 histories at once, each with a
//! server, a proxy and keys of its own, over one store. `IDEMPOTENT_SIM_FROM=<seed>` sets the
//! first seed, to explore past the default ones, and `IDEMPOTENT_SIM_HISTORIES=<n>` the number of
//! histories per test; `IDEMPOTENT_SIM_DUMP=1` prints every history, passing or not.
//!
//! A test binary of its own: the only panics in it are the handlers' planted ones, so a panic of
//! the library's is counted and fails the test.
#![cfg(feature = "grpc")]

use std::sync::Arc;
use std::sync::atomic::Ordering;

use idempotent_runtime::Store;
use idempotent_tests::simulation::bugs::Planted;
use idempotent_tests::simulation::{self, Bug, callers, grpc};

/// Histories per test, all at once.
const HISTORIES: u64 = 32;

/// Runs the histories of the default seeds (or from `IDEMPOTENT_SIM_FROM`) on `store`, all at
/// once, with `bug` planted in each layer.
async fn run_all<S: Store + Clone + 'static>(
    store: S,
    bug: Option<grpc::ConfigBug>,
    store_faults: bool,
) -> Vec<grpc::Verdict> {
    let prefix = idempotent_tests::fresh::suffix();
    let from = simulation::env_from().unwrap_or(simulation::DEFAULT_SEED);
    let histories: Vec<_> = (0..simulation::env_histories().unwrap_or(HISTORIES))
        .map(|i| {
            let (store, prefix) = (store.clone(), format!("{prefix}s{i}"));
            tokio::spawn(async move { grpc::run_history(from + i, store, &prefix, bug, store_faults).await })
        })
        .collect();
    let mut verdicts = Vec::new();
    for history in histories {
        verdicts.push(history.await.expect("a history task"));
    }
    verdicts
}

async fn explore<S: Store + Clone + 'static>(name: &str, store: S, store_faults: bool) {
    callers::quiet_planted_panics();
    let foreign_before = callers::FOREIGN_PANICS.load(Ordering::Relaxed);
    let started = std::time::Instant::now();
    let verdicts = run_all(store, None, store_faults).await;
    let sum = |count: fn(&grpc::Verdict) -> u64| verdicts.iter().map(count).sum::<u64>();
    let failing: Vec<_> = verdicts.iter().filter(|v| !v.violations.is_empty()).collect();
    println!(
        "simulation_{name}: histories {}, calls {} ({} through GrpcRetryLayer, in {} histories, with {} attempts, {} stopped \
         at a replay or a negative pushback), handler runs {}, answers {} ({} replays), responses lost {}, callers left without an answer {}, store \
         faults {}, re-runs under them {}, violations {} ({:.1?})",
        verdicts.len(),
        sum(|v| v.calls),
        sum(|v| v.layered_calls),
        verdicts.iter().filter(|v| v.layered_calls > 0).count(),
        sum(|v| v.layered_attempts),
        sum(|v| v.layered_stopped_at_final),
        sum(|v| v.runs),
        sum(|v| v.answers),
        sum(|v| v.replays),
        sum(|v| v.lost_responses),
        sum(|v| v.gave_up),
        sum(|v| v.store_faults),
        sum(|v| v.reruns_under_store_faults),
        failing.iter().map(|v| v.violations.len()).sum::<usize>(),
        started.elapsed()
    );
    if std::env::var_os("IDEMPOTENT_SIM_DUMP").is_some() {
        for verdict in &verdicts {
            println!("{}", verdict.log);
        }
    }
    for verdict in &failing {
        println!("{}VIOLATIONS: {:#?}", verdict.log, verdict.violations);
    }
    assert!(sum(|v| v.runs) > 0 && sum(|v| v.replays) > 0, "simulation_{name}: handlers ran and answers were replayed");
    assert!(
        sum(|v| v.layered_attempts) > sum(|v| v.layered_calls) && sum(|v| v.layered_calls) < sum(|v| v.calls),
        "simulation_{name}: calls went through GrpcRetryLayer, some of them retried, and others through the hand loop"
    );
    assert!(failing.is_empty(), "simulation_{name}: {} histories break the promise (printed above)", failing.len());
    let foreign = callers::FOREIGN_PANICS.load(Ordering::Relaxed) - foreign_before;
    assert_eq!(foreign, 0, "simulation_{name}: {foreign} panics that no handler planted (printed above)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_grpc_memory() {
    explore("grpc_memory", idempotent_runtime::MemoryStore::new(), false).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_grpc_redis() {
    let Some((store, cleanup)) = idempotent_tests::fresh::redis("simulation_grpc_redis").await else { return };
    explore("grpc_redis", store, false).await;
    cleanup.run().await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_grpc_postgres() {
    let Some((store, cleanup)) = idempotent_tests::fresh::postgres("simulation_grpc_postgres").await else {
        return;
    };
    explore("grpc_postgres", store, false).await;
    cleanup.run().await;
}

/// The same histories with faults in the store too (in those with a lease of 2 s or 3 s): steps
/// that fail, lose their reply, or are delayed past the lease. A run may then follow a recorded
/// answer, as README's limits say; what is still judged is that no caller is told anything but
/// the truth: every replay of a key is one answer, every answer a run's, never another user's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_grpc_memory_store_faults() {
    explore("grpc_memory_store_faults", idempotent_runtime::MemoryStore::new(), true).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_grpc_redis_store_faults() {
    let Some((store, cleanup)) = idempotent_tests::fresh::redis("simulation_grpc_redis_store_faults").await else {
        return;
    };
    explore("grpc_redis_store_faults", store, true).await;
    cleanup.run().await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_grpc_postgres_store_faults() {
    let Some((store, cleanup)) = idempotent_tests::fresh::postgres("simulation_grpc_postgres_store_faults").await
    else {
        return;
    };
    explore("grpc_postgres_store_faults", store, true).await;
    cleanup.run().await;
}

/// The judgement catches each planted bug within the default histories: five of the layer's
/// configuration (two of them in what it sends, one in the clients' `GrpcRetryLayer`), two of the
/// store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_grpc_memory_planted_bugs() {
    callers::quiet_planted_panics();
    let report = |what: String, verdicts: &[grpc::Verdict]| {
        let found = verdicts.iter().filter(|v| !v.violations.is_empty()).count();
        let judged = verdicts.iter().filter(|v| v.violations.len() > v.probe_violations).count();
        let first = verdicts.iter().find_map(|v| v.violations.get(v.probe_violations));
        println!(
            "simulation_grpc_memory_planted_bugs: {what}: {found} of {} histories caught it ({judged} by the ledger \
             and the answers, besides the probe's findings); first of those: {first:?}",
            verdicts.len()
        );
        assert!(found > 0, "the planted bug {what} went unnoticed in {} histories", verdicts.len());
    };
    for bug in grpc::ConfigBug::ALL {
        report(format!("{bug:?}"), &run_all(idempotent_runtime::MemoryStore::new(), Some(bug), false).await);
    }
    for bug in [Bug::ClaimLetsSecondIn, Bug::RecordDropped] {
        let store = Arc::new(Planted::new(idempotent_runtime::MemoryStore::new(), Some(bug)));
        report(format!("{bug:?}"), &run_all(store, None, false).await);
    }
}
