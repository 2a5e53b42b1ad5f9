//! A fixed workload per case, for counting instructions with callgrind (`scripts/instructions`):
//! instruction counts do not depend on what else the machine is doing, so they can be compared
//! across runs on a busy machine, where wall-clock figures cannot.
//!
//! `cargo bench -p idempotent-runtime --bench instructions -- <case> <calls>` runs `calls` calls of
//! one case after a fixed warm-up: `memory_replay`, `memory_first`, `naive_replay`, `naive_first`,
//! `memory_replay_default_scope` and `memory_first_default_scope` (the function without
//! `scope = "..."`, on a store of its own), and `memory_replay_uuid` and `memory_first_uuid` (that
//! function's form with a UUID string for its key, as a `request_id: &str` usually is).
//! The per-call count is the difference between two runs with different `calls`, divided by the
//! difference, so the warm-up and start-up cancel out.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Mutex;

use idempotent_runtime::{Error, MemoryStore, idempotent};

const KEYS: u64 = 2_000;

/// The most calls the UUID cases take: their keys are all made before the first call.
const UUID_CALLS: u64 = 10_000;

#[idempotent(key = id, store = store, scope = "bench")]
async fn wrapped(store: &MemoryStore, id: u64) -> Result<u64, Error> {
    Ok(black_box(id))
}

/// The same function without `scope`: its default scope, the module path and the name, is what
/// most users get.
#[idempotent(key = id, store = store)]
async fn wrapped_default_scope(store: &MemoryStore, id: u64) -> Result<u64, Error> {
    Ok(black_box(id))
}

/// The same with a UUID string for its key: under its default scope
/// (`instructions.wrapped_uuid`), `scope:key` is 62 bytes long.
#[idempotent(key = id, store = store)]
async fn wrapped_uuid(store: &MemoryStore, id: &str) -> Result<usize, Error> {
    Ok(black_box(id.len()))
}

/// A UUID-shaped key (36 characters) for call `i`.
fn uuid(i: u64) -> String {
    format!("{:08x}-0000-4000-8000-{:012x}", i >> 16, i & 0xffff)
}

/// The design notes' naive approach, as in the `overhead` bench.
#[derive(Default)]
struct Naive(Mutex<HashMap<String, Vec<u8>>>);

impl Naive {
    fn call(&self, id: u64) -> Result<u64, Error> {
        let key = format!("bench:{id}");
        let found = self.0.lock().unwrap().get(&key).cloned();
        if let Some(bytes) = found {
            return serde_json::from_slice(&bytes).map_err(|e| Error::Fingerprint(e.to_string()));
        }
        let value = black_box(id);
        let bytes = serde_json::to_vec(&value).map_err(|e| Error::Fingerprint(e.to_string()))?;
        self.0.lock().unwrap().insert(key, bytes);
        Ok(value)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes `--bench`; skip flags.
    let mut rest = args.iter().skip(1).filter(|a| !a.starts_with("--"));
    let (Some(case), Some(calls)) = (rest.next(), rest.next()) else {
        eprintln!(
            "usage: instructions <memory_replay|memory_first|memory_replay_default_scope|memory_first_default_scope|\
             memory_replay_uuid|memory_first_uuid|naive_replay|naive_first> <calls>"
        );
        return;
    };
    let calls: u64 = calls.parse().expect("a number of calls");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let (store, default_store, uuid_store) = (MemoryStore::new(), MemoryStore::new(), MemoryStore::new());
    // Made before the calls and as many whatever `calls` is, so that formatting them is not
    // counted (the per-call count is a difference of two runs).
    let uuids: Vec<String> = if case.ends_with("_uuid") {
        assert!(calls <= UUID_CALLS, "the UUID cases take at most {UUID_CALLS} calls");
        (0..KEYS + UUID_CALLS).map(uuid).collect()
    } else {
        Vec::new()
    };
    let naive = Naive::default();
    let uuid_key = |n: u64| uuids[usize::try_from(n).unwrap()].as_str();
    runtime.block_on(async {
        for id in 0..KEYS {
            wrapped(&store, id).await.unwrap();
            wrapped_default_scope(&default_store, id).await.unwrap();
            if let Some(key) = uuids.get(usize::try_from(id).unwrap()) {
                wrapped_uuid(&uuid_store, key).await.unwrap();
            }
            naive.call(id).unwrap();
        }
        for i in 0..calls {
            match case.as_str() {
                "memory_replay" => drop(black_box(wrapped(&store, i % KEYS).await)),
                "memory_first" => drop(black_box(wrapped(&store, KEYS + i).await)),
                "memory_replay_default_scope" => drop(black_box(wrapped_default_scope(&default_store, i % KEYS).await)),
                "memory_first_default_scope" => drop(black_box(wrapped_default_scope(&default_store, KEYS + i).await)),
                "memory_replay_uuid" => drop(black_box(wrapped_uuid(&uuid_store, uuid_key(i % KEYS)).await)),
                "memory_first_uuid" => drop(black_box(wrapped_uuid(&uuid_store, uuid_key(KEYS + i)).await)),
                "naive_replay" => drop(black_box(naive.call(i % KEYS))),
                "naive_first" => drop(black_box(naive.call(KEYS + i))),
                other => panic!("unknown case {other}"),
            }
        }
    });
}
