//! Two copies of one process claim one key on Redis, each with the owner token it makes next:
//! run by `redis_copies_of_one_process_never_share_an_owner_token` (tests/tests/redis.rs).
//!
//! `token_fork <redis-url> <prefix>` runs a few calls (so this thread has made tokens), then forks
//! while it has no other thread: the child holds the same memory, as a virtual machine restored
//! twice from one snapshot, or a server forked into workers after it started, does. Each copy
//! then opens a connection of its own and runs one call on the same key, whose body takes 2 s,
//! and prints one line: `ran`, `in progress`, `replayed` or the error.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fork::Fork;
use idempotent_runtime::{Call, Error, RedisStore};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a Tokio runtime")
}

async fn store(url: &str, prefix: &str) -> RedisStore {
    RedisStore::connect(url).await.expect("connect to Redis").with_prefix(prefix).expect("a valid prefix")
}

/// The threads of this process (`/proc/self/task`).
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, Iterator::count)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, prefix] = &args[..] else { panic!("usage: token_fork <redis-url> <prefix>") };
    let warm_up = runtime();
    warm_up.block_on(async {
        let store = store(url, prefix).await;
        for i in 0..3u32 {
            Call::new("token-fork-warm-up", &i)
                .run(&store, async { Ok::<_, Error>(()) })
                .await
                .expect("a warm-up call");
        }
    });
    warm_up.shutdown_timeout(Duration::from_secs(5));
    assert_eq!(threads(), 1, "the process must have one thread when it forks");
    let child = match fork::fork().expect("fork") {
        Fork::Parent(child) => Some(child),
        Fork::Child => None,
    };
    let ran = AtomicBool::new(false);
    let outcome = runtime().block_on(async {
        let store = store(url, prefix).await;
        Call::new("token-fork", "one-key")
            .run(&store, async {
                ran.store(true, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(2)).await;
                Ok::<_, Error>(())
            })
            .await
    });
    let line = match outcome {
        Ok(()) if ran.load(Ordering::SeqCst) => "ran".to_owned(),
        Ok(()) => "replayed".to_owned(),
        Err(Error::InProgress { .. }) => "in progress".to_owned(),
        Err(error) => format!("error: {error}"),
    };
    println!("{line}");
    if let Some(child) = child {
        fork::waitpid(child).expect("the child ends");
    }
}
