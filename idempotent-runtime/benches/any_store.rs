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
//! step or per call. Criterion measures one line after the other, so a machine whose load changes
//! meanwhile skews the difference; the bench therefore first prints a *paired* measurement:
//! batches of 1,000 concrete and 1,000 erased calls alternate for 300 rounds (on one store
//! shared by both), and the median
//! per-call time of each and the median of the per-round differences are reported.
//!
//! Run with `cargo bench -p idempotent-runtime --bench any_store`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
#[path = "support/timing.rs"]
mod timing;
use idempotent_runtime::stores::AnyStore;
use idempotent_runtime::{Claim, ClaimRequest, Completion, Error, Key, MemoryStore, Store, Token, idempotent};
use timing::{current_thread, time_first_executions};

/// How many completed keys the replay benchmarks cycle through.
const KEYS: u64 = 1024;

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
    let request = ClaimRequest::new(key, token, None, Duration::from_secs(60));
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

/// Per-call nanoseconds of one batch of `BATCH` calls of `step`, with the numbers from `from` on.
async fn batch_ns(from: u64, step: &impl AsyncFn(u64) -> bool) -> f64 {
    let start = Instant::now();
    for i in from..from + BATCH {
        black_box(step(i).await);
    }
    #[allow(clippy::cast_precision_loss, reason = "nanoseconds of a batch are far below 2^52")]
    let ns = start.elapsed().as_nanos() as f64 / BATCH as f64;
    ns
}

const BATCH: u64 = 1000;
const ROUNDS: u64 = 300;

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Alternates batches of `concrete` and `erased` calls and prints the medians.
fn paired(
    rt: &tokio::runtime::Runtime,
    name: &str,
    concrete: impl AsyncFn(u64) -> bool,
    erased: impl AsyncFn(u64) -> bool,
) {
    let (mut a, mut b, mut diff) = (Vec::new(), Vec::new(), Vec::new());
    rt.block_on(async {
        for round in 0..ROUNDS {
            // Alternate which goes first, so that a drift in load favours neither.
            let (x, y) = if round % 2 == 0 {
                let x = batch_ns(round * BATCH, &concrete).await;
                (x, batch_ns(round * BATCH, &erased).await)
            } else {
                let y = batch_ns(round * BATCH, &erased).await;
                (batch_ns(round * BATCH, &concrete).await, y)
            };
            a.push(x);
            b.push(y);
            diff.push(y - x);
        }
    });
    println!(
        "paired {name}: concrete {:.1} ns, any {:.1} ns, any - concrete {:.1} ns per call (medians of {ROUNDS} rounds of {BATCH} calls)",
        median(a),
        median(b),
        median(diff)
    );
}

fn paired_measurements() {
    let rt = current_thread();
    let memory = MemoryStore::new();
    let any = AnyStore::new(memory.clone());
    let keys: Vec<Key> = (0..KEYS).map(|i| Key::new("paired", &i.to_string()).unwrap()).collect();
    let token = Token::new();
    rt.block_on(async {
        for key in &keys {
            let owner = Token::new();
            let request = ClaimRequest::new(key, &owner, None, Duration::from_secs(3600));
            memory.claim(&request).await.unwrap();
            memory
                .complete(&Completion::new(key, &owner, None, b"{\"Ok\":1}", Duration::from_secs(3600)))
                .await
                .unwrap();
        }
        for id in 0..KEYS {
            concrete(&memory, 1_000_000 + id).await.unwrap();
        }
    });
    #[allow(clippy::cast_possible_truncation, reason = "the index is below KEYS")]
    let key = |i: u64| &keys[(i % KEYS) as usize];
    paired(
        &rt,
        "step/release_not_owner",
        async |i| release_step(&memory, key(i), &token).await,
        async |i| release_step(&any, key(i), &token).await,
    );
    paired(
        &rt,
        "step/claim_replay",
        async |i| claim_step(&memory, key(i), &token).await,
        async |i| claim_step(&any, key(i), &token).await,
    );
    // `concrete` and `erased` share the scope "bench": the same records, replayed through each.
    paired(
        &rt,
        "call/replay",
        async |i| concrete(&memory, 1_000_000 + i % KEYS).await.is_ok(),
        async |i| erased(&any, 1_000_000 + i % KEYS).await.is_ok(),
    );
    // New keys each call, in two ranges of one store that grows alike for both.
    paired(
        &rt,
        "call/first_execution",
        async |i| concrete(&memory, 10_000_000 + i).await.is_ok(),
        async |i| erased(&any, 20_000_000 + i).await.is_ok(),
    );
}

fn steps(c: &mut Criterion) {
    paired_measurements();

    let rt = current_thread();
    let memory = MemoryStore::new();
    let any = AnyStore::new(memory.clone());
    let keys: Vec<Key> = (0..KEYS).map(|i| Key::new("bench", &i.to_string()).unwrap()).collect();
    rt.block_on(async {
        for key in &keys {
            let token = Token::new();
            let request = ClaimRequest::new(key, &token, None, Duration::from_secs(3600));
            memory.claim(&request).await.unwrap();
            memory
                .complete(&Completion::new(key, &token, None, b"{\"Ok\":1}", Duration::from_secs(3600)))
                .await
                .unwrap();
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
