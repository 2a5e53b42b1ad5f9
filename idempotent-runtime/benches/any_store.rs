//! What type erasure costs: the memory store called directly, and the same store behind
//! `AnyStore` (one boxed future and one indirect call per step).
//!
//! - `step/claim_replay`: `claim` on one of 1,024 completed keys (returns the record).
//! - `step/release_not_owner`: `release` with a foreign token (refused at once): the cheapest
//!   step, so the erasure's share is largest.
//! - `call/first_execution` and `call/replay`: a whole `#[idempotent]` call (claim and complete,
//!   or one claim), as in `overhead.rs`.
//!
//! The difference between a `concrete` and an `any` line of one group is the erasure's cost per
//! step or per call. Run with `cargo bench -p idempotent-runtime --bench any_store`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use idempotent_runtime::stores::AnyStore;
use idempotent_runtime::{Claim, ClaimRequest, Error, Key, MemoryStore, Store, Token, idempotent};

/// How many completed keys the replay benchmarks cycle through.
const KEYS: u64 = 1024;
/// How many first executions go into one store before it is replaced.
const KEYS_PER_STORE: u64 = 10_000;

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

#[idempotent(key = id, store = store, scope = "bench")]
async fn concrete(store: &MemoryStore, id: u64) -> Result<u64, Error> {
    Ok(black_box(id))
}

#[idempotent(key = id, store = store, scope = "bench")]
async fn erased(store: &AnyStore, id: u64) -> Result<u64, Error> {
    Ok(black_box(id))
}

/// `claim` on a completed key: `true` when it returns the record.
async fn claim_step<S: Store>(store: &S, key: &Key, token: &Token) -> bool {
    let request = ClaimRequest { key, token, fingerprint: None, lease: Duration::from_secs(60) };
    matches!(store.claim(&request).await, Ok(Claim::Completed(_)))
}

/// `release` with a token that does not own the key: `true` when it is refused.
async fn release_step<S: Store>(store: &S, key: &Key, token: &Token) -> bool {
    store.release(key, token).await.is_err()
}

/// Times `iters` calls of `step` over the keys, on a store holding them all completed.
fn time_steps<S: Store>(
    rt: &tokio::runtime::Runtime,
    iters: u64,
    store: &S,
    keys: &[Key],
    step: &impl AsyncFn(&S, &Key) -> bool,
) -> Duration {
    rt.block_on(async {
        let start = Instant::now();
        for i in 0..iters {
            #[allow(clippy::cast_possible_truncation, reason = "the index is below KEYS")]
            black_box(step(store, &keys[(i % KEYS) as usize]).await);
        }
        start.elapsed()
    })
}

fn steps(c: &mut Criterion) {
    let rt = current_thread();
    let memory = MemoryStore::new();
    let any = AnyStore::new(memory.clone());
    let keys: Vec<Key> = (0..KEYS).map(|i| Key::new("bench", &i.to_string()).unwrap()).collect();
    rt.block_on(async {
        for key in &keys {
            let token = Token::new();
            let request = ClaimRequest { key, token: &token, fingerprint: None, lease: Duration::from_secs(3600) };
            memory.claim(&request).await.unwrap();
            memory.complete(key, &token, b"{\"Ok\":1}", Duration::from_secs(3600)).await.unwrap();
        }
    });
    let token = Token::new();

    let mut group = c.benchmark_group("step");
    group.bench_function("claim_replay/concrete", |b| {
        b.iter_custom(|iters| {
            time_steps(&rt, iters, &memory, &keys, &async |s: &MemoryStore, k: &Key| claim_step(s, k, &token).await)
        });
    });
    group.bench_function("claim_replay/any", |b| {
        b.iter_custom(|iters| {
            time_steps(&rt, iters, &any, &keys, &async |s: &AnyStore, k: &Key| claim_step(s, k, &token).await)
        });
    });
    group.bench_function("release_not_owner/concrete", |b| {
        b.iter_custom(|iters| {
            time_steps(&rt, iters, &memory, &keys, &async |s: &MemoryStore, k: &Key| release_step(s, k, &token).await)
        });
    });
    group.bench_function("release_not_owner/any", |b| {
        b.iter_custom(|iters| {
            time_steps(&rt, iters, &any, &keys, &async |s: &AnyStore, k: &Key| release_step(s, k, &token).await)
        });
    });
    group.finish();
}

fn time_first_executions<S>(
    iters: u64,
    new_store: fn() -> S,
    call: &impl AsyncFn(&S, u64) -> Result<u64, Error>,
) -> Duration {
    let rt = current_thread();
    let mut total = Duration::ZERO;
    let mut done = 0;
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
        drop(store);
        done += chunk;
    }
    total
}

fn calls(c: &mut Criterion) {
    let mut group = c.benchmark_group("call");
    group.bench_function("first_execution/concrete", |b| {
        b.iter_custom(|iters| time_first_executions(iters, MemoryStore::new, &async |s, id| concrete(s, id).await));
    });
    group.bench_function("first_execution/any", |b| {
        b.iter_custom(|iters| {
            time_first_executions(iters, || AnyStore::new(MemoryStore::new()), &async |s, id| erased(s, id).await)
        });
    });

    let rt = current_thread();
    let memory = MemoryStore::new();
    let any = AnyStore::new(MemoryStore::new());
    rt.block_on(async {
        for id in 0..KEYS {
            concrete(&memory, id).await.unwrap();
            erased(&any, id).await.unwrap();
        }
    });
    group.bench_function("replay/concrete", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for i in 0..iters {
                    black_box(concrete(&memory, i % KEYS).await.unwrap());
                }
                start.elapsed()
            })
        });
    });
    group.bench_function("replay/any", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for i in 0..iters {
                    black_box(erased(&any, i % KEYS).await.unwrap());
                }
                start.elapsed()
            })
        });
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = steps, calls
}
criterion_main!(benches);
