//! Timing helpers shared by the criterion benches (included with `#[path]`, not a bench itself).

use std::hint::black_box;
use std::time::{Duration, Instant};

use idempotent_runtime::Error;

/// How many fresh keys one store takes before it is replaced (outside the timed region).
const KEYS_PER_STORE: u64 = 10_000;

/// A single-threaded runtime with time enabled, as the protocol needs.
pub(crate) fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// Times `iters` calls of `call(store, i)` with fresh keys, replacing the store every
/// [`KEYS_PER_STORE`] calls outside the timed region.
///
/// A replaced store is dropped only once its successor is full. Dropped at once, its tables were
/// the top of the heap, which glibc handed back to the kernel, and the next store faulted the
/// same memory in again page by page inside the timed region: 0.08 page faults per call for the
/// memory store, whose 64 shards' tables each stay below glibc's `mmap` threshold, and far fewer
/// for the naive map, whose one large table glibc keeps (see BENCHMARKS.md). A process that
/// keeps its store reuses freed memory instead.
pub(crate) fn time_first_executions<S>(
    iters: u64,
    new_store: fn() -> S,
    call: &impl AsyncFn(&S, u64) -> Result<u64, Error>,
) -> Duration {
    let rt = current_thread();
    let mut total = Duration::ZERO;
    let mut done = 0;
    let mut previous = None;
    while done < iters {
        let chunk = (iters - done).min(KEYS_PER_STORE);
        let store = new_store();
        total += rt.block_on(async {
            let start = Instant::now();
            for id in 0..chunk {
                black_box(call(&store, id).await.unwrap());
            }
            start.elapsed()
        });
        drop(previous.replace(store));
        done += chunk;
    }
    total
}
