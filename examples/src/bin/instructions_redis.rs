//! A fixed workload per case, for counting the instructions the *client* spends on one Redis call
//! with callgrind (`scripts/instructions redis_raw redis_first redis_replay`): the server runs in
//! its own process, which valgrind does not count, so the figure is this process's work per call,
//! whatever the machine's load.
//!
//! `instructions_redis <case> <calls>` with the cases `redis_raw` (`SET key 1 NX PX` on the store's
//! connection, the floor), `redis_first` (an `#[idempotent]` fn with a new key each call: a claim
//! and a record) and `redis_replay` (2,000 recorded keys, in turn: one claim that finds the record).
//! One call at a time on a current-thread runtime. Redis from `REDIS_URL`.

use idempotent_runtime::stores::redis::redis;
use idempotent_runtime::{Error, RedisStore, Store, idempotent};

const KEYS: u64 = 2_000;

#[idempotent(key = id, store = store, scope = "instructions", retention = "10m")]
async fn op<S: Store>(store: &S, id: &str) -> Result<u64, Error> {
    Ok(id.len() as u64)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(case), Some(calls)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: instructions_redis <redis_raw|redis_first|redis_replay> <calls>");
        return;
    };
    let calls: u64 = calls.parse().expect("a number of calls");
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    // Each process its own prefix: the first calls' keys must be new.
    let prefix = format!("idempotent-instructions:{}:", std::process::id());
    let store =
        RedisStore::connect(&url).await.expect("Redis at REDIS_URL").with_prefix(prefix.clone()).expect("a prefix");
    let mut connection = store.connection();
    for key in 0..KEYS {
        op(&store, &format!("k-{key}")).await.expect("a recorded call");
    }
    let keys: Vec<String> = (0..calls).map(|i| format!("k-{}", KEYS + i)).collect();
    for (i, first) in (0u64..).zip(&keys) {
        match case.as_str() {
            "redis_raw" => {
                let set: redis::Value = redis::cmd("SET")
                    .arg(format!("{prefix}raw:{first}"))
                    .arg(1)
                    .arg("NX")
                    .arg("PX")
                    .arg(600_000)
                    .query_async(&mut connection)
                    .await
                    .expect("SET");
                assert_eq!(set, redis::Value::Okay);
            }
            "redis_first" => drop(op(&store, first).await.expect("a first call")),
            "redis_replay" => drop(op(&store, &format!("k-{}", i % KEYS)).await.expect("a replay")),
            other => panic!("unknown case {other}"),
        }
    }
    // Leave nothing behind (not part of the difference between two runs: both delete).
    let pattern = format!("{prefix}*");
    let found: Vec<String> = redis::cmd("KEYS").arg(&pattern).query_async(&mut connection).await.expect("KEYS");
    for chunk in found.chunks(1000) {
        let _: () = redis::cmd("DEL").arg(chunk).query_async(&mut connection).await.expect("DEL");
    }
}
