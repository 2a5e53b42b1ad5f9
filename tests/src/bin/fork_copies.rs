//! Two copies of one process, made by `fork` while it has one thread: the child holds the same
//! memory, as a virtual machine restored twice from one snapshot, or a server forked into workers
//! after it started, does. Run by the tests named `*_copies_of_one_process_*`.
//!
//! - `fork_copies token <redis-url> <prefix>`: three calls on Redis (so this thread has made
//!   owner tokens), the fork, then in each copy one call on the same key, whose body takes 2 s,
//!   over a connection of its own. Each copy prints one line: `ran`, `in progress`, `replayed` or
//!   the error.
//! - `fork_copies outbound-key <url>`: one `POST` to `url` through `IdempotentRetry` (so this
//!   thread has made a fresh key), the fork, then in each copy one `POST` to `url` with no key of
//!   its own, for the middleware to give it one. Each copy prints `sent` or the error.
//! - `fork_copies grpc-key`: the gRPC client's `IdempotencyKeys` interceptor gives one request a
//!   key, the fork, then it gives one request a key in each copy, which prints it.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fork::Fork;
use idempotent_runtime::client::{IdempotentRetry, RetryPolicy};
use idempotent_runtime::grpc::IdempotencyKeys;
use idempotent_runtime::{Call, Error, RedisStore};
use reqwest_middleware::ClientBuilder;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a Tokio runtime")
}

/// Runs `before` on a runtime that is shut down after it, forks, runs `after` in each copy and
/// prints its line; the parent waits for the child.
fn in_two_copies<B: Future<Output = ()>, A: Future<Output = String>>(before: B, after: impl Fn() -> A) {
    let warm_up = runtime();
    warm_up.block_on(before);
    warm_up.shutdown_timeout(Duration::from_secs(5));
    let threads = std::fs::read_dir("/proc/self/task").map_or(0, Iterator::count);
    assert_eq!(threads, 1, "the process must have one thread when it forks");
    let child = match fork::fork().expect("fork") {
        Fork::Parent(child) => Some(child),
        Fork::Child => None,
    };
    println!("{}", runtime().block_on(after()));
    if let Some(child) = child {
        fork::waitpid(child).expect("the child ends");
    }
}

async fn store(url: &str, prefix: &str) -> RedisStore {
    RedisStore::connect(url).await.expect("connect to Redis").with_prefix(prefix).expect("a valid prefix")
}

/// The `idempotency-key` that `IdempotencyKeys` gives a request without one.
fn grpc_key() -> String {
    use tonic::service::Interceptor as _;
    let request = IdempotencyKeys.call(tonic::Request::new(())).expect("the interceptor accepts the request");
    let key = request.metadata().get("idempotency-key").expect("a key was given");
    key.to_str().expect("a text key").to_owned()
}

async fn post(url: &str) -> String {
    let client = ClientBuilder::new(reqwest::Client::new()).with(IdempotentRetry::new(RetryPolicy::default())).build();
    match client.post(url).send().await {
        Ok(response) if response.status().is_success() => "sent".to_owned(),
        Ok(response) => format!("error: status {}", response.status()),
        Err(error) => format!("error: {error}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match &args[1..] {
        [mode, url, prefix] if mode == "token" => in_two_copies(
            async {
                let store = store(url, prefix).await;
                for i in 0..3u32 {
                    let call = Call::new("fork-copies-warm-up", &i).run(&store, async { Ok::<_, Error>(()) });
                    call.await.expect("a warm-up call");
                }
            },
            || async {
                let store = store(url, prefix).await;
                let ran = AtomicBool::new(false);
                let outcome = Call::new("fork-copies", "one-key")
                    .run(&store, async {
                        ran.store(true, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        Ok::<_, Error>(())
                    })
                    .await;
                match outcome {
                    Ok(()) if ran.load(Ordering::SeqCst) => "ran".to_owned(),
                    Ok(()) => "replayed".to_owned(),
                    Err(Error::InProgress { .. }) => "in progress".to_owned(),
                    Err(error) => format!("error: {error}"),
                }
            },
        ),
        [mode, url] if mode == "outbound-key" => in_two_copies(
            async {
                assert_eq!(post(url).await, "sent", "the warm-up request");
            },
            || post(url),
        ),
        [mode] if mode == "grpc-key" => in_two_copies(
            async {
                grpc_key();
            },
            || async { grpc_key() },
        ),
        _ => panic!("usage: fork_copies token <redis-url> <prefix> | outbound-key <url> | grpc-key"),
    }
}
