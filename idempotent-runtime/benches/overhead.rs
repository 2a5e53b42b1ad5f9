//! What `#[idempotent]` with the memory store costs over the bare function.
//!
//! Three groups, each comparing the bare `async fn`, the same fn under `#[idempotent]` with a
//! [`MemoryStore`], and the naive "check, then execute, then insert" of the design notes (a
//! `Mutex<HashMap>` looked up before the body and written after it: not atomic, shown for its cost):
//!
//! - `first_execution`: every call has a new key. The stores are replaced every
//!   10,000 calls (`KEYS_PER_STORE` in `support/timing.rs`), outside the timed region, so they hold 0 to 10,000 keys;
//!   each is dropped once the next is full, so that the next reuses its memory (see `time_first_executions`).
//! - `replay`: every call hits one of 1,024 completed keys.
//! - `contention`: 64 tasks on a 2-thread runtime share 4 keys; the body yields once, as real
//!   work awaits something. Most callers meet a running call and get `InProgress` (about 950 of
//!   1,024 in the check round, printed first); the others run the body or replay.
//!
//! Run with `cargo bench -p idempotent-runtime --bench overhead`; see BENCHMARKS.md.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
#[path = "support/timing.rs"]
mod timing;
use idempotent_runtime::{Error, MemoryStore, idempotent};
use serde::Serialize;
use serde::de::DeserializeOwned;
use timing::{current_thread, time_first_executions};

/// How many completed keys the replay benchmarks cycle through.
const REPLAY_KEYS: u64 = 1024;
/// Tasks and keys of the contention benchmark.
const TASKS: u64 = 64;
const CONTENDED_KEYS: u64 = 4;

static EXECUTIONS: AtomicU64 = AtomicU64::new(0);

#[allow(clippy::unused_async, reason = "the baseline is an async fn like the wrapped one")]
async fn bare(id: u64) -> Result<u64, Error> {
    Ok(black_box(id))
}

#[idempotent(key = id, store = store, scope = "bench")]
async fn wrapped(store: &MemoryStore, id: u64) -> Result<u64, Error> {
    Ok(black_box(id))
}

async fn bare_yielding(id: u64) -> Result<u64, Error> {
    EXECUTIONS.fetch_add(1, Ordering::Relaxed);
    tokio::task::yield_now().await;
    Ok(black_box(id))
}

#[idempotent(key = id, store = store, scope = "bench")]
async fn wrapped_yielding(store: &MemoryStore, id: u64) -> Result<u64, Error> {
    bare_yielding(id).await
}

/// The design notes' naive approach: look the key up, run the body, insert the result.
#[derive(Default)]
struct NaiveStore {
    records: Mutex<HashMap<String, Vec<u8>>>,
}

impl NaiveStore {
    async fn call<T, F>(&self, scope: &str, id: u64, body: F) -> Result<T, Error>
    where
        T: Serialize + DeserializeOwned,
        F: Future<Output = Result<T, Error>>,
    {
        let key = format!("{scope}:{id}");
        let found = self.records.lock().unwrap().get(&key).cloned();
        if let Some(bytes) = found {
            return serde_json::from_slice(&bytes).map_err(|e| Error::Fingerprint(e.to_string()));
        }
        let value = body.await?;
        let bytes = serde_json::to_vec(&value).map_err(|e| Error::Fingerprint(e.to_string()))?;
        self.records.lock().unwrap().insert(key, bytes);
        Ok(value)
    }
}

fn first_execution(c: &mut Criterion) {
    let mut group = c.benchmark_group("first_execution");
    group.bench_function("bare", |b| {
        b.iter_custom(|iters| time_first_executions(iters, || (), &async |(), id| bare(id).await));
    });
    group.bench_function("idempotent_memory", |b| {
        b.iter_custom(|iters| {
            time_first_executions(iters, MemoryStore::new, &async |store, id| wrapped(store, id).await)
        });
    });
    group.bench_function("naive_check_execute_insert", |b| {
        b.iter_custom(|iters| {
            time_first_executions(iters, NaiveStore::default, &async |store, id| {
                store.call("bench", id, bare(id)).await
            })
        });
    });
    group.finish();
}

fn replay(c: &mut Criterion) {
    let rt = current_thread();
    let store = MemoryStore::new();
    let naive = NaiveStore::default();
    rt.block_on(async {
        for id in 0..REPLAY_KEYS {
            wrapped(&store, id).await.unwrap();
            naive.call("bench", id, bare(id)).await.unwrap();
        }
    });
    let mut group = c.benchmark_group("replay");
    group.bench_function("bare", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for i in 0..iters {
                    black_box(bare(i % REPLAY_KEYS).await.unwrap());
                }
                start.elapsed()
            })
        });
    });
    group.bench_function("idempotent_memory", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for i in 0..iters {
                    black_box(wrapped(&store, i % REPLAY_KEYS).await.unwrap());
                }
                start.elapsed()
            })
        });
    });
    group.bench_function("naive_check_execute_insert", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for i in 0..iters {
                    let id = i % REPLAY_KEYS;
                    black_box(naive.call("bench", id, bare(id)).await.unwrap());
                }
                start.elapsed()
            })
        });
    });
    group.finish();
}

/// What one contention round did.
#[derive(Debug, Default, Clone, Copy)]
struct Round {
    elapsed: Duration,
    in_progress: u64,
}

/// Runs [`TASKS`] tasks of `per_task` calls each over [`CONTENDED_KEYS`] keys on `rt`.
fn contend<S, F>(
    rt: &tokio::runtime::Runtime,
    per_task: u64,
    store: &std::sync::Arc<S>,
    call: fn(std::sync::Arc<S>, u64) -> F,
) -> Round
where
    S: Send + Sync + 'static,
    F: Future<Output = Result<u64, Error>> + Send + 'static,
{
    rt.block_on(async {
        let start = Instant::now();
        let tasks: Vec<_> = (0..TASKS)
            .map(|task| {
                let store = store.clone();
                tokio::spawn(async move {
                    let mut in_progress = 0;
                    for i in 0..per_task {
                        match call(store.clone(), (task + i) % CONTENDED_KEYS).await {
                            Ok(v) => {
                                black_box(v);
                            }
                            Err(Error::InProgress { .. }) => in_progress += 1,
                            Err(e) => panic!("{e}"),
                        }
                    }
                    in_progress
                })
            })
            .collect();
        let mut in_progress = 0;
        for task in tasks {
            in_progress += task.await.unwrap();
        }
        Round { elapsed: start.elapsed(), in_progress }
    })
}

fn contention(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();

    // Correctness first: one round per approach, counting how often the body ran for 4 keys.
    for (name, run) in [
        ("idempotent_memory", contend_idempotent as fn(&tokio::runtime::Runtime, u64) -> Round),
        ("naive_check_execute_insert", contend_naive),
    ] {
        EXECUTIONS.store(0, Ordering::Relaxed);
        let round = run(&rt, 16);
        eprintln!(
            "contention check, {name}: {} calls on {CONTENDED_KEYS} keys ran the body {} times ({} got InProgress)",
            TASKS * 16,
            EXECUTIONS.load(Ordering::Relaxed),
            round.in_progress
        );
    }

    let mut group = c.benchmark_group("contention");
    let per_call = |rounds: &mut dyn FnMut(u64) -> Round, iters: u64| {
        // iters calls in total, split over the tasks; the time is scaled to exactly iters calls.
        let per_task = iters.div_ceil(TASKS).max(1);
        let round = rounds(per_task);
        let nanos = round.elapsed.as_nanos() * u128::from(iters) / u128::from(per_task * TASKS);
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    };
    group.bench_function("bare", |b| {
        b.iter_custom(|iters| per_call(&mut |n| contend_bare(&rt, n), iters));
    });
    group.bench_function("idempotent_memory", |b| {
        b.iter_custom(|iters| per_call(&mut |n| contend_idempotent(&rt, n), iters));
    });
    group.bench_function("naive_check_execute_insert", |b| {
        b.iter_custom(|iters| per_call(&mut |n| contend_naive(&rt, n), iters));
    });
    group.finish();
}

fn contend_bare(rt: &tokio::runtime::Runtime, per_task: u64) -> Round {
    contend(rt, per_task, &std::sync::Arc::new(()), |_, id| bare_yielding(id))
}

fn contend_idempotent(rt: &tokio::runtime::Runtime, per_task: u64) -> Round {
    contend(rt, per_task, &std::sync::Arc::new(MemoryStore::new()), |store, id| async move {
        wrapped_yielding(&store, id).await
    })
}

fn contend_naive(rt: &tokio::runtime::Runtime, per_task: u64) -> Round {
    contend(rt, per_task, &std::sync::Arc::new(NaiveStore::default()), |store, id| async move {
        store.call("bench", id, bare_yielding(id)).await
    })
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = first_execution, replay, contention
}
criterion_main!(benches);
