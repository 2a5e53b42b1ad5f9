//! A slow and flaky network between the store and its server: the stress run goes through a TCP
//! proxy ([`idempotent_tests::proxy`]) that delays every chunk past the client's timeouts, stalls
//! traffic, kills every connection and refuses new ones, then heals. The same store object is
//! used throughout (recovery without a restart), and the run must end with no double execution,
//! no lost record and no stuck key, and with some callers having received the faults as typed
//! `Error::Store` errors (so the faults did reach them) on every store.
//!
//! Each test has its own proxy and its own keys or table, so these tests run side by side and
//! disturb no other test.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idempotent_tests::proxy::{FaultProxy, Mode};
use idempotent_tests::stress::{self, StressConfig, StressReport};

/// One step of a fault script: at `at` after the start, do `what`.
#[derive(Debug, Clone, Copy)]
enum Step {
    Mode(Mode),
    Kill,
}

/// The faults every proxy test injects, in order.
fn script() -> Vec<(Duration, Step)> {
    let ms = Duration::from_millis;
    vec![
        (ms(500), Step::Mode(Mode::Delay(ms(2500)))),
        (ms(3500), Step::Mode(Mode::Pass)),
        (ms(4000), Step::Mode(Mode::Stall)),
        (ms(6500), Step::Mode(Mode::Pass)),
        (ms(7000), Step::Kill),
        (ms(7200), Step::Mode(Mode::Refuse)),
        (ms(7200), Step::Kill),
        (ms(8000), Step::Mode(Mode::Pass)),
    ]
}

/// Plays the script on the proxy; returns how many faults it injected.
async fn play(proxy: Arc<FaultProxy>, steps: Vec<(Duration, Step)>) -> u64 {
    let start = Instant::now();
    let mut faults = 0;
    for (at, step) in steps {
        tokio::time::sleep(at.saturating_sub(start.elapsed())).await;
        match step {
            Step::Mode(mode) => {
                if mode != Mode::Pass {
                    faults += 1;
                }
                proxy.set_mode(mode);
            }
            Step::Kill => {
                faults += 1;
                proxy.kill_connections();
            }
        }
        println!("FAULT at {:>5} ms: {step:?}", start.elapsed().as_millis());
    }
    faults
}

/// The run's sizes: spread over ~10 s so that the faults hit it in the middle.
fn config(lease: Duration) -> StressConfig {
    let mut config = StressConfig::from_env(400);
    config.callers = config.callers.min(8);
    config.keys_in_flight = 16;
    config.key_interval = Duration::from_millis(10_000 / config.keys.max(1) as u64);
    config.lease = lease;
    // Claims orphaned by the faults free themselves when their lease ends.
    config.settle = lease + Duration::from_secs(10);
    config
}

fn print(report: &StressReport, proxy: &FaultProxy, faults: u64) {
    let stats = proxy.stats();
    println!("{report}");
    println!(
        "  proxy: {faults} faults injected; {} connections accepted, {} refused, {} killed, {} chunks delayed or stalled",
        stats.accepted.load(Ordering::Relaxed),
        stats.refused.load(Ordering::Relaxed),
        stats.killed.load(Ordering::Relaxed),
        stats.held_chunks.load(Ordering::Relaxed),
    );
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_slow_and_flaky_network_through_a_proxy() {
    let Some(url) = idempotent_tests::services::redis_url("redis_slow_and_flaky_network_through_a_proxy") else {
        return;
    };
    let target = url.trim_start_matches("redis://").trim_end_matches('/');
    let proxy = Arc::new(FaultProxy::start(target).await.expect("start the proxy"));
    let (store, cleanup) = idempotent_tests::fresh::redis_at(&format!("redis://{}", proxy.addr())).await;
    let faults = play(Arc::clone(&proxy), script());
    let (report, injected) =
        stress::run_with_faults("redis via proxy", store, config(Duration::from_secs(15)), faults).await;
    print(&report, &proxy, injected);
    cleanup.run().await;
    assert!(report.store_failures > 0, "the faults must reach the callers as typed store errors:\n{report}");
    report.assert_clean();
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_slow_and_flaky_network_through_a_proxy() {
    let Some(url) = idempotent_tests::services::postgres_url("postgres_slow_and_flaky_network_through_a_proxy") else {
        return;
    };
    let proxy = Arc::new(FaultProxy::start("127.0.0.1:5432").await.expect("start the proxy"));
    let proxied = url.replacen("127.0.0.1:5432", &proxy.addr().to_string(), 1);
    assert_ne!(proxied, url, "POSTGRES_URL must name 127.0.0.1:5432 for the proxy test");
    let (store, cleanup) = idempotent_tests::fresh::postgres_at(&proxied, 16).await.expect("a store via the proxy");
    let config = config(Duration::from_secs(15));
    let faults = play(Arc::clone(&proxy), script());
    let (report, injected) = Box::pin(stress::run_with_faults("postgres via proxy", store, config, faults)).await;
    print(&report, &proxy, injected);
    cleanup.run().await;
    assert!(report.store_failures > 0, "the faults must reach the callers as typed store errors:\n{report}");
    report.assert_clean();
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_slow_and_flaky_network_through_a_proxy() {
    let Some(url) = idempotent_tests::services::mysql_url("mysql_slow_and_flaky_network_through_a_proxy") else {
        return;
    };
    let proxy = Arc::new(FaultProxy::start("127.0.0.1:3306").await.expect("start the proxy"));
    let proxied = url.replacen("127.0.0.1:3306", &proxy.addr().to_string(), 1);
    assert_ne!(proxied, url, "MYSQL_URL must name 127.0.0.1:3306 for the proxy test");
    let (store, cleanup) = idempotent_tests::fresh::mysql_at(&proxied, 16).await.expect("a store via the proxy");
    let config = config(Duration::from_secs(15));
    let faults = play(Arc::clone(&proxy), script());
    let (report, injected) = stress::run_with_faults("mysql via proxy", store, config, faults).await;
    print(&report, &proxy, injected);
    cleanup.run().await;
    assert!(report.store_failures > 0, "the faults must reach the callers as typed store errors:\n{report}");
    report.assert_clean();
}
