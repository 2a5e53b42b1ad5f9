//! A flood of requests with fresh `Idempotency-Key`s behind `IdempotencyLayer` on the memory
//! store: does the store's bound hold the process's memory?
//!
//! Each run is its own process (its peak RSS is the process's): `--limits` picks the store's
//! bounds, `--seconds` how long the flood lasts, `--concurrency` how many requests are in flight.
//! The requests go through the real router and layer in-process (`tower::ServiceExt::oneshot`),
//! without sockets, so the flood is as fast as the layer allows. It prints one line:
//!
//! ```text
//! cargo run --release -p idempotent-examples --bin memory_flood -- --limits unbounded --seconds 15
//! cargo run --release -p idempotent-examples --bin memory_flood -- --limits default --seconds 15
//! cargo run --release -p idempotent-examples --bin memory_flood -- --limits 64MiB --seconds 15
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idempotent_runtime::MemoryStore;
use idempotent_runtime::http::IdempotencyLayer;
use idempotent_runtime::stores::memory::MemoryLimits;
use tower::ServiceExt as _;

/// The process's resident and peak resident memory in KiB, from `/proc/self/status`.
fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.to_owned())
}

#[tokio::main]
async fn main() {
    let limits_arg = arg("--limits", "default");
    let seconds: u64 = arg("--seconds", "15").parse().expect("--seconds takes a whole number");
    let concurrency: usize = arg("--concurrency", "64").parse().expect("--concurrency takes a whole number");
    let limits = match limits_arg.as_str() {
        "default" => MemoryLimits::default(),
        "unbounded" => MemoryLimits::default().max_entries(usize::MAX).max_bytes(usize::MAX),
        bytes => {
            let mib: usize = bytes.trim_end_matches("MiB").parse().expect("--limits: default, unbounded or <n>MiB");
            MemoryLimits::default().max_bytes(mib << 20)
        }
    };
    let store = MemoryStore::with_limits(limits);
    // Keys shared by every caller: the flood has one client.
    let app = Router::new()
        .route("/orders", post(|body: String| async move { (StatusCode::CREATED, body) }))
        .layer(IdempotencyLayer::new(store.clone()).keys_shared_by_all_callers());
    let (start_rss, _) = rss_kib();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let next = Arc::new(AtomicU64::new(0));
    let (created, refused, other) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (app, next, created, refused, other) =
                (app.clone(), next.clone(), created.clone(), refused.clone(), other.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let request = Request::post("/orders")
                        .header("idempotency-key", format!("flood-{n:016x}"))
                        .header("content-type", "application/json")
                        .body(Body::from(format!(r#"{{"item":"book","quantity":1,"n":{n}}}"#)))
                        .expect("a valid request");
                    let status = app.clone().oneshot(request).await.expect("the router is infallible").status();
                    let counter = match status {
                        StatusCode::CREATED => &created,
                        StatusCode::SERVICE_UNAVAILABLE => &refused,
                        _ => &other,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // RSS every 3 s: once the store is full it must stop growing.
    let mut samples = Vec::new();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(3).min(deadline.saturating_duration_since(Instant::now()))).await;
        samples.push(format!("{:.0}", rss_kib().0 as f64 / 1024.0));
    }
    for worker in workers {
        worker.await.expect("a flood worker panicked");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let (end_rss, peak_rss) = rss_kib();
    let total = created.load(Ordering::Relaxed) + refused.load(Ordering::Relaxed) + other.load(Ordering::Relaxed);
    println!(
        "limits={limits_arg} seconds={elapsed:.1} requests={total} created={} refused_503={} other={} \
         store_entries={} store_bytes={} rss_start_mib={:.1} rss_end_mib={:.1} rss_peak_mib={:.1} bytes_per_entry={:.0} rss_every_3s_mib=[{}]",
        created.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        other.load(Ordering::Relaxed),
        store.len(),
        store.bytes(),
        start_rss as f64 / 1024.0,
        end_rss as f64 / 1024.0,
        peak_rss as f64 / 1024.0,
        (end_rss.saturating_sub(start_rss) * 1024) as f64 / store.len().max(1) as f64,
        samples.join(" "),
    );
}
