//! Unary RPC throughput with and without the gRPC idempotency layer: a tonic server and a tonic
//! client in one process, over loopback.
//!
//! Each run measures, for `--seconds` each, with `--concurrency` calls in flight on one channel:
//!
//! - `plain`: the server without the layer (the calls carry no key).
//! - `memory first` / `redis first`: under the layer on that store, every call with a new key
//!   (a claim and a record).
//! - `memory replay` / `redis replay`: the keys the `first` phase completed, again (one lookup
//!   that finds the record, and the replay).
//!
//! It prints a Markdown table of the medians over `--runs`, each ratio taken against `plain` of
//! the same run, with the load average at the start and the end. Redis comes from `REDIS_URL`
//! (default `redis://127.0.0.1:6379`); its phases are left out when it is unreachable. Records
//! expire after two minutes.
//!
//! ```text
//! cargo run --release -p idempotent-tests --bin grpc_bench -- --runs 5 --seconds 3 --concurrency 32
//! ```

#![allow(clippy::cast_precision_loss, reason = "call counts far below 2^52")]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idempotent_runtime::grpc::GrpcIdempotencyLayer;
use idempotent_runtime::stores::memory::MemoryLimits;
use idempotent_runtime::{MemoryStore, RedisStore, Store};
use idempotent_tests::grpc::{Bank, PAY, PayRequest, PaymentsClient, PaymentsServer};
use tokio::net::TcpListener;
use tonic::transport::Channel;
use tonic::transport::server::TcpIncoming;

const USAGE: &str = "usage: grpc_bench [--runs 5] [--seconds 3] [--concurrency 32]";

struct Options {
    runs: usize,
    seconds: f64,
    concurrency: usize,
}

fn options() -> Options {
    let mut options = Options { runs: 5, seconds: 3.0, concurrency: 32 };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| panic!("{flag} needs a value\n{USAGE}"));
        match flag.as_str() {
            "--runs" => options.runs = value.parse().expect(USAGE),
            "--seconds" => options.seconds = value.parse().expect(USAGE),
            "--concurrency" => options.concurrency = value.parse().expect(USAGE),
            _ => panic!("unknown flag {flag}\n{USAGE}"),
        }
    }
    options
}

/// Serves the bank on a free loopback port, under `layer` if there is one; returns a client.
async fn serve<St: Store + 'static>(layer: Option<GrpcIdempotencyLayer<St>>) -> PaymentsClient<Channel> {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = PaymentsServer::new(Bank::default());
    // As `Server::serve` sets it: without it every answer waits for the client's delayed ACK.
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    if let Some(layer) = layer {
        let server = tonic::transport::Server::builder().layer(layer).add_service(service);
        tokio::spawn(async move { server.serve_with_incoming(incoming).await.unwrap() });
    } else {
        let server = tonic::transport::Server::builder().add_service(service);
        tokio::spawn(async move { server.serve_with_incoming(incoming).await.unwrap() });
    }
    PaymentsClient::connect(format!("http://{addr}")).await.unwrap()
}

/// The keys a phase sends: none, or `prefix-n` for `n` counting up (modulo `wrap` when set).
#[derive(Clone)]
struct Keys {
    prefix: Option<Arc<str>>,
    wrap: Option<u64>,
}

/// Calls `Pay` for `seconds` with `concurrency` calls in flight; the number of calls that
/// succeeded (a failed call stops the program: the figures would mean nothing).
async fn drive(client: &PaymentsClient<Channel>, options: &Options, keys: &Keys) -> u64 {
    let next = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs_f64(options.seconds);
    let tasks: Vec<_> = (0..options.concurrency)
        .map(|_| {
            let (mut client, keys, next) = (client.clone(), keys.clone(), Arc::clone(&next));
            tokio::spawn(async move {
                let mut done = 0u64;
                while Instant::now() < end {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let message = PayRequest {
                        request_id: String::new(),
                        user: "bench".into(),
                        amount: 1,
                        behaviour: String::new(),
                    };
                    let mut request = tonic::Request::new(message);
                    if let Some(prefix) = &keys.prefix {
                        let n = keys.wrap.map_or(n, |wrap| n % wrap);
                        request.metadata_mut().insert("idempotency-key", format!("{prefix}-{n}").parse().unwrap());
                    }
                    client.pay(request).await.expect("a benchmark call failed");
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut calls = 0;
    for task in tasks {
        calls += task.await.unwrap();
    }
    calls
}

/// The `first` and `replay` rates (calls/s) of the layer on `store`.
async fn layered<St: Store + 'static>(store: St, options: &Options) -> (f64, f64) {
    let layer = GrpcIdempotencyLayer::new(store)
        .scope("grpc-bench")
        .keys_shared_by_all_callers()
        .method(PAY)
        .retention(Duration::from_secs(120));
    let client = serve(Some(layer)).await;
    let prefix: Arc<str> = uuid::Uuid::new_v4().simple().to_string().into();
    let first = drive(&client, options, &Keys { prefix: Some(Arc::clone(&prefix)), wrap: None }).await;
    let replay = drive(&client, options, &Keys { prefix: Some(prefix), wrap: Some(first) }).await;
    (first as f64 / options.seconds, replay as f64 / options.seconds)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 { values[mid] } else { f64::midpoint(values[mid - 1], values[mid]) }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(|e| format!("unknown ({e})"), |l| l.trim().to_owned())
}

#[tokio::main]
async fn main() {
    let options = options();
    println!("load average at start: {}", load_average());
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let redis = RedisStore::connect(&redis_url).await.ok();
    if redis.is_none() {
        println!("no Redis at {redis_url}: its phases are left out");
    }
    let mut rows: Vec<(&str, Vec<f64>, Vec<f64>)> = Vec::new();
    for run in 0..options.runs {
        // Every phase gets a server and a connection of its own, made just before it.
        let plain_client = serve::<MemoryStore>(None).await;
        let plain = drive(&plain_client, &options, &Keys { prefix: None, wrap: None }).await as f64 / options.seconds;
        let mut phases = vec![("plain", plain)];
        // Bounded far above what a phase writes: under the default 64 MiB a first phase of
        // about 100,000 calls (3 s on a fast machine) filled the store, and its next claim was
        // refused (`Unavailable`), which stopped the program.
        let memory = MemoryStore::with_limits(MemoryLimits::default().max_entries(50_000_000).max_bytes(16 << 30));
        let (first, replay) = layered(memory, &options).await;
        phases.extend([("memory first", first), ("memory replay", replay)]);
        if let Some(redis) = &redis {
            let (first, replay) = layered(redis.clone(), &options).await;
            phases.extend([("redis first", first), ("redis replay", replay)]);
        }
        let line: Vec<String> = phases.iter().map(|(name, rate)| format!("{name} {rate:.0}/s")).collect();
        println!("run {}: {}", run + 1, line.join(", "));
        for (i, (name, rate)) in phases.into_iter().enumerate() {
            if rows.len() <= i {
                rows.push((name, Vec::new(), Vec::new()));
            }
            rows[i].1.push(rate);
            rows[i].2.push(rate / plain);
        }
    }
    println!(
        "\nunary Pay, tonic client and server in one process, {} in flight, {} s per phase, medians of {} runs\n",
        options.concurrency, options.seconds, options.runs
    );
    println!("| phase | calls/s | × plain (same run) |\n|---|---:|---:|");
    for (name, rates, ratios) in rows {
        println!("| {name} | {:.0} | {:.2} |", median(rates), median(ratios));
    }
    println!("\nload average at end: {}", load_average());
}
