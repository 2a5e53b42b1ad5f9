//! Histories at the HTTP edge (`tests/src/simulation/http/`): clients that retry with one key, a
//! network that loses responses, refuses, stalls and kills connections, and handlers behind
//! `IdempotencyLayer` or `#[idempotent]` that notify a downstream bank, then charge, fail after
//! charging, decline, say they did nothing, or panic. Each test runs 32 histories at once, each
//! with a server, a proxy and keys of its own, over one store. `IDEMPOTENT_SIM_FROM=<seed>` sets
//! the first seed, to explore past the default ones, and `IDEMPOTENT_SIM_HISTORIES=<n>` the number
//! of histories per test; `IDEMPOTENT_SIM_DUMP=1` prints every history, passing or not, and
//! `IDEMPOTENT_SIM_LOG=1` the library's warnings and errors.
//!
//! A test binary of its own: the only panics in it are the handlers' planted ones, so a panic of
//! the library's is counted and fails the test.
#![cfg(feature = "http")]

use std::sync::Arc;
use std::sync::atomic::Ordering;

use idempotent_runtime::Store;
use idempotent_tests::simulation::bugs::Planted;
use idempotent_tests::simulation::{self, Bug, callers, http};

/// Histories per test, all at once.
const HISTORIES: u64 = 32;

/// Runs the histories of the default seeds (or from `IDEMPOTENT_SIM_FROM`) on `store`, all at
/// once, with `bug` planted in each layer.
async fn run_all<S: Store + Clone + 'static>(
    store: S,
    bug: Option<http::ConfigBug>,
    store_faults: bool,
) -> Vec<http::Verdict> {
    let prefix = idempotent_tests::fresh::suffix();
    let from = simulation::env_from().unwrap_or(simulation::DEFAULT_SEED);
    let histories: Vec<_> = (0..simulation::env_histories().unwrap_or(HISTORIES))
        .map(|i| {
            let (store, prefix) = (store.clone(), format!("{prefix}s{i}"));
            tokio::spawn(async move { http::run_history(from + i, store, &prefix, bug, store_faults).await })
        })
        .collect();
    let mut verdicts = Vec::new();
    for history in histories {
        verdicts.push(history.await.expect("a history task"));
    }
    verdicts
}

/// With `IDEMPOTENT_SIM_LOG=1`, prints the library's warnings and errors (with the time), to
/// read beside a failing history.
fn log_library_events() {
    struct Print;
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Print {
        fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            if *event.metadata().level() <= tracing::Level::WARN {
                println!("LOG {:?} {}", std::time::SystemTime::now(), idempotent_tests::event_text(event));
            }
        }
    }
    use tracing_subscriber::layer::SubscriberExt as _;
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    if std::env::var_os("IDEMPOTENT_SIM_LOG").is_some() {
        INSTALLED.call_once(|| {
            let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Print));
        });
    }
}

async fn explore<S: Store + Clone + 'static>(name: &str, store: S, store_faults: bool) {
    log_library_events();
    callers::quiet_planted_panics();
    let foreign_before = callers::FOREIGN_PANICS.load(Ordering::Relaxed);
    let started = std::time::Instant::now();
    let verdicts = run_all(store, None, store_faults).await;
    let sum = |count: fn(&http::Verdict) -> u64| verdicts.iter().map(count).sum::<u64>();
    let failing: Vec<_> = verdicts.iter().filter(|v| !v.violations.is_empty()).collect();
    println!(
        "simulation_{name}: histories {}, requests {}, handler runs {}, responses {} ({} replays), \
         responses lost {}, callers left without a response {}, store faults {}, re-runs under them {}, \
         downstream calls {} and runs {}, violations {} ({:.1?})",
        verdicts.len(),
        sum(|v| v.calls),
        sum(|v| v.runs),
        sum(|v| v.responses),
        sum(|v| v.replays),
        sum(|v| v.lost_responses),
        sum(|v| v.gave_up),
        sum(|v| v.store_faults),
        sum(|v| v.reruns_under_store_faults),
        sum(|v| v.downstream_calls),
        sum(|v| v.downstream_runs),
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
    assert!(failing.is_empty(), "simulation_{name}: {} histories break the promise (printed above)", failing.len());
    let foreign = callers::FOREIGN_PANICS.load(Ordering::Relaxed) - foreign_before;
    assert_eq!(foreign, 0, "simulation_{name}: {foreign} panics that no handler planted (printed above)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_http_memory() {
    explore("http_memory", idempotent_runtime::MemoryStore::new(), false).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_http_redis() {
    let Some((store, cleanup)) = idempotent_tests::fresh::redis("simulation_http_redis").await else { return };
    explore("http_redis", store, false).await;
    cleanup.run().await;
}

/// `CachedStore` in front of Redis, as the HTTP benchmarks use it: completed records replayed from
/// this process's memory, claims always sent to Redis.
#[cfg(all(feature = "redis", feature = "cache"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_http_redis_cached() {
    let Some((store, cleanup)) = idempotent_tests::fresh::redis("simulation_http_redis_cached").await else { return };
    explore("http_redis_cached", idempotent_runtime::stores::cache::CachedStore::new(store), false).await;
    cleanup.run().await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_http_postgres() {
    let Some((store, cleanup)) = idempotent_tests::fresh::postgres("simulation_http_postgres").await else {
        return;
    };
    explore("http_postgres", store, false).await;
    cleanup.run().await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_http_mysql() {
    let Some((store, cleanup)) = idempotent_tests::fresh::mysql("simulation_http_mysql").await else { return };
    explore("http_mysql", store, false).await;
    cleanup.run().await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_http_sqlite() {
    let (store, cleanup) = idempotent_tests::fresh::sqlite("simulation_http").await;
    explore("http_sqlite", store, false).await;
    cleanup.run().await;
}

/// The same histories with faults in the store too (in those with a lease of 2 s or 3 s): steps
/// that fail, lose their reply, or are delayed past the lease. A run may then follow a recorded
/// answer, as README's limits say; what is still judged is that no caller is told anything but
/// the truth: every replay of a key is one answer, every answer a run's, never another user's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_http_memory_store_faults() {
    explore("http_memory_store_faults", idempotent_runtime::MemoryStore::new(), true).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_http_redis_store_faults() {
    let Some((store, cleanup)) = idempotent_tests::fresh::redis("simulation_http_redis_store_faults").await else {
        return;
    };
    explore("http_redis_store_faults", store, true).await;
    cleanup.run().await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_http_postgres_store_faults() {
    let Some((store, cleanup)) = idempotent_tests::fresh::postgres("simulation_http_postgres_store_faults").await
    else {
        return;
    };
    explore("http_postgres_store_faults", store, true).await;
    cleanup.run().await;
}

/// The judgement catches each planted bug within the default histories: three of the
/// configuration (two of the layer's, one of the handler's client), two of the store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulation_http_memory_planted_bugs() {
    callers::quiet_planted_panics();
    let report = |what: String, verdicts: &[http::Verdict]| {
        let found = verdicts.iter().filter(|v| !v.violations.is_empty()).count();
        let first = verdicts.iter().find_map(|v| v.violations.first());
        println!(
            "simulation_http_memory_planted_bugs: {what}: {found} of {} histories caught it; first: {first:?}",
            verdicts.len()
        );
        assert!(found > 0, "the planted bug {what} went unnoticed in {} histories", verdicts.len());
    };
    for bug in http::ConfigBug::ALL {
        report(format!("{bug:?}"), &run_all(idempotent_runtime::MemoryStore::new(), Some(bug), false).await);
    }
    // Not `HeartbeatStopsAfterFirst`: a duplicate must arrive in the short time between the
    // claim's end and the slow handler's, which 1 history of 32 did. The store simulation
    // catches it on a paused clock.
    for bug in [Bug::ClaimLetsSecondIn, Bug::RecordDropped] {
        let store = Arc::new(Planted::new(idempotent_runtime::MemoryStore::new(), Some(bug)));
        report(format!("{bug:?}"), &run_all(store, None, false).await);
    }
}
