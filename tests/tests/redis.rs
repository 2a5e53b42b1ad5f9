#![cfg(feature = "redis")]
//! The Redis store against a real server: its step semantics, the record format an operator sees,
//! prefix isolation, heavy contention through the attribute, and the conformance suite.
//!
//! Every test works under its own random prefix and deletes its keys at the end.

use idempotent_tests::StoreSteps;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::stores::redis::redis::{self, AsyncCommands};
use idempotent_runtime::stores::redis::{DEFAULT_PREFIX, RedisStore};
use idempotent_runtime::{
    Claim, ClaimRequest, Completion, Detached, Error, Fingerprint, Key, Record, Store, StoreError, Token, idempotent,
};
use tokio::sync::Barrier;

idempotent_tests::conformance_suite!(
    conformance_redis,
    async {
        let url = idempotent_tests::services::redis_url("conformance_redis")?;
        let prefix = format!("idempotent-test:{}:", uuid::Uuid::new_v4().simple());
        Some(RedisStore::connect(&url).await.expect("connect to Redis").with_prefix(prefix).expect("valid prefix"))
    },
    self_expiring
);

/// A store under a fresh prefix, and a plain connection to look at what it wrote.
async fn setup(url: &str) -> (RedisStore, redis::aio::MultiplexedConnection) {
    let prefix = format!("idempotent-test:{}:", uuid::Uuid::new_v4().simple());
    let store = RedisStore::connect(url).await.expect("connect to Redis").with_prefix(prefix).expect("valid prefix");
    let raw = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
    (store, raw)
}

/// Every Redis key under `prefix`, found with SCAN (the prefixes used here hold no glob characters).
async fn keys_under(raw: &mut redis::aio::MultiplexedConnection, prefix: &str) -> Vec<String> {
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(raw)
            .await
            .unwrap();
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    keys.sort();
    keys
}

async fn cleanup(raw: &mut redis::aio::MultiplexedConnection, prefix: &str) {
    for key in keys_under(raw, prefix).await {
        let _: () = raw.del(key).await.unwrap();
    }
}

async fn claim(store: &RedisStore, key: &Key, token: &Token, fp: Option<&Fingerprint>, lease: Duration) -> Claim {
    store.claim(&ClaimRequest::new(key, token, fp, lease)).await.expect("claim")
}

/// Long enough that no record expires while a test SCANs a large keyspace.
const LEASE: Duration = Duration::from_secs(600);

/// Two copies of one process (a `fork` child beside its parent, as a virtual machine restored
/// twice from one snapshot makes them) each run a call on the same key at once: one runs the
/// body, the other finds it in progress. Tokens counted up from per-thread randomness are the
/// same in both copies, and the second claim then looked like a resend of the first: both ran.
#[cfg(all(feature = "http", feature = "grpc"))] // the test program's other modes need them
#[tokio::test]
async fn redis_copies_of_one_process_never_share_an_owner_token() {
    let Some(url) = idempotent_tests::services::redis_url("redis_copies_of_one_process_never_share_an_owner_token")
    else {
        return;
    };
    let prefix = format!("idempotent-test:{}:", uuid::Uuid::new_v4().simple());
    let mut copies = idempotent_tests::output_lines(env!("CARGO_BIN_EXE_fork_copies"), &["token", &url, &prefix]);
    copies.sort_unstable();
    // Both copies claim within milliseconds of each other and the body takes 2 s, so the second
    // finds it in progress; one that started after the body ended would get the replay.
    assert!(
        copies == ["in progress", "ran"] || copies == ["ran", "replayed"],
        "the body runs in exactly one copy: {copies:?}"
    );
    let (_, mut raw) = setup(&url).await;
    cleanup(&mut raw, &prefix).await;
}

#[tokio::test]
async fn redis_claim_complete_and_replay() {
    let Some(url) = idempotent_tests::services::redis_url("redis_claim_complete_and_replay") else {
        return;
    };
    let (store, mut raw) = setup(&url).await;
    let key = Key::new("pay", &"req-1").unwrap();
    let fp = Fingerprint::of(&("alice", 100)).unwrap();
    let (owner, other) = (Token::new(), Token::new());

    assert_eq!(claim(&store, &key, &owner, Some(&fp), LEASE).await, Claim::Claimed);
    let Claim::InProgress { fingerprint, lease_remaining } = claim(&store, &key, &other, None, LEASE).await else {
        panic!("a live claim must be reported in progress")
    };
    assert_eq!(fingerprint.as_ref(), Some(&fp));
    let remaining = lease_remaining.expect("Redis knows the PTTL");
    assert!(remaining > Duration::from_secs(595) && remaining <= LEASE, "{remaining:?}");

    // Completion is fenced by the token.
    let outcome = br#"{"Ok":"receipt"}"#;
    assert!(matches!(store.complete_as(&key, &other, outcome, LEASE).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.release(&key, &other).await, Err(StoreError::NotOwner)));
    store.complete_as(&key, &owner, outcome, Duration::from_secs(60)).await.unwrap();

    let replay = claim(&store, &key, &Token::new(), None, LEASE).await;
    assert_eq!(replay, Claim::Completed(Record::new(Some(fp.clone()), outcome.to_vec())));
    // Once completed, a repeated completion by the same token succeeds and changes nothing (its
    // first reply may have been lost); nobody else can complete it, and nobody can release it.
    store.complete_as(&key, &owner, b"{}", LEASE).await.unwrap();
    assert!(matches!(store.complete_as(&key, &other, b"{}", LEASE).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.release(&key, &owner).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.extend(&key, &owner, LEASE).await, Err(StoreError::NotOwner)));
    assert_eq!(claim(&store, &key, &Token::new(), None, LEASE).await, replay);
    cleanup(&mut raw, store.prefix()).await;
}

#[tokio::test]
async fn redis_release_is_fenced_and_frees_the_key() {
    let Some(url) = idempotent_tests::services::redis_url("redis_release_is_fenced_and_frees_the_key") else {
        return;
    };
    let (store, mut raw) = setup(&url).await;
    let key = Key::new("pay", &"req-2").unwrap();
    let owner = Token::new();
    assert_eq!(claim(&store, &key, &owner, None, LEASE).await, Claim::Claimed);
    assert!(matches!(store.release(&key, &Token::new()).await, Err(StoreError::NotOwner)));
    let exists: bool = raw.exists(store.redis_key(&key)).await.unwrap();
    assert!(exists, "a release with the wrong token must not delete the claim");
    store.release(&key, &owner).await.unwrap();
    let exists: bool = raw.exists(store.redis_key(&key)).await.unwrap();
    assert!(!exists, "a release deletes the key");
    assert!(matches!(store.release(&key, &owner).await, Err(StoreError::NotOwner)));
    assert_eq!(claim(&store, &key, &Token::new(), None, LEASE).await, Claim::Claimed);
    cleanup(&mut raw, store.prefix()).await;
}

#[tokio::test]
async fn redis_expired_lease_is_taken_over_and_fences_the_old_owner() {
    let Some(url) = idempotent_tests::services::redis_url("redis_expired_lease_is_taken_over") else {
        return;
    };
    let (store, mut raw) = setup(&url).await;
    let key = Key::new("pay", &"req-3").unwrap();
    let (old, new) = (Token::new(), Token::new());
    assert_eq!(claim(&store, &key, &old, None, Duration::from_millis(50)).await, Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(claim(&store, &key, &new, None, LEASE).await, Claim::Claimed, "an expired lease counts as absent");
    assert!(matches!(store.complete_as(&key, &old, b"{}", LEASE).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.release(&key, &old).await, Err(StoreError::NotOwner)));
    store.complete_as(&key, &new, br#"{"Ok":2}"#, LEASE).await.unwrap();
    assert!(
        matches!(claim(&store, &key, &old, None, LEASE).await, Claim::Completed(r) if r.outcome == br#"{"Ok":2}"#[..])
    );

    // A claim whose lease ran out with nobody taking over: Redis dropped it, so nobody holds the
    // key, and the late completion writes the record (refusing it would run the body again).
    let lapsed = Key::new("pay", &"req-3b").unwrap();
    assert_eq!(claim(&store, &lapsed, &old, None, Duration::from_millis(30)).await, Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(80)).await;
    assert!(matches!(store.release(&lapsed, &old).await, Err(StoreError::NotOwner)), "release stays fenced");
    store.complete_as(&lapsed, &old, br#"{"Ok":3}"#, LEASE).await.expect("the uncontested late completion");
    assert!(
        matches!(claim(&store, &lapsed, &new, None, LEASE).await, Claim::Completed(r) if r.outcome == br#"{"Ok":3}"#[..])
    );
    cleanup(&mut raw, store.prefix()).await;
}

#[tokio::test]
async fn redis_key_layout_is_one_readable_string() {
    let Some(url) = idempotent_tests::services::redis_url("redis_key_layout_is_one_readable_string") else {
        return;
    };
    let (store, mut raw) = setup(&url).await;
    let key = Key::new("payments", &"req-42").unwrap();
    let name = store.redis_key(&key);
    assert_eq!(name, format!("{}payments:req-42", store.prefix()));
    let fp = Fingerprint::of(&42).unwrap();
    let token = Token::new();

    assert_eq!(claim(&store, &key, &token, Some(&fp), Duration::from_secs(10)).await, Claim::Claimed);
    let kind: String = redis::cmd("TYPE").arg(&name).query_async(&mut raw).await.unwrap();
    assert_eq!(kind, "string");
    let value: String = raw.get(&name).await.unwrap();
    assert_eq!(value, format!("idempotent/1 running {} {}\n", token.as_str(), fp.as_str()));
    let pttl: i64 = raw.pttl(&name).await.unwrap();
    assert!(pttl > 9_000 && pttl <= 10_000, "the lease is the key's expiry, got PTTL {pttl}");

    // Completion swaps the lease for the retention, keeps the token and the fingerprint, and
    // stores the outcome bytes exactly (they need not be UTF-8).
    let outcome: &[u8] = b"{\"Ok\":\"\xff\x00\"}";
    store.complete_as(&key, &token, outcome, Duration::from_secs(3600)).await.unwrap();
    let value: Vec<u8> = raw.get(&name).await.unwrap();
    let mut expected = format!("idempotent/1 done {} {}\n", token.as_str(), fp.as_str()).into_bytes();
    expected.extend_from_slice(outcome);
    assert_eq!(value, expected);
    let pttl: i64 = raw.pttl(&name).await.unwrap();
    assert!(pttl > 3_590_000 && pttl <= 3_600_000, "the retention is the key's expiry, got PTTL {pttl}");

    // Without a fingerprint the header says `-`, and the record reads back without one.
    let bare = Key::new("payments", &"req-43").unwrap();
    let token = Token::new();
    assert_eq!(claim(&store, &bare, &token, None, LEASE).await, Claim::Claimed);
    store.complete_as(&bare, &token, b"{\"Ok\":null}", LEASE).await.unwrap();
    let value: String = raw.get(store.redis_key(&bare)).await.unwrap();
    assert_eq!(value, format!("idempotent/1 done {} -\n{{\"Ok\":null}}", token.as_str()));
    let replay = claim(&store, &bare, &Token::new(), None, LEASE).await;
    assert_eq!(replay, Claim::Completed(Record::new(None, b"{\"Ok\":null}".to_vec())));

    assert_eq!(keys_under(&mut raw, store.prefix()).await, vec![name, store.redis_key(&bare)]);
    cleanup(&mut raw, store.prefix()).await;
}

/// The heartbeat: only the owner of a live claim moves its expiry.
#[tokio::test]
async fn redis_extend_moves_the_lease_of_the_owner_only() {
    let Some(url) = idempotent_tests::services::redis_url("redis_extend_moves_the_lease_of_the_owner_only") else {
        return;
    };
    let (store, mut raw) = setup(&url).await;
    let key = Key::new("pay", &"extend").unwrap();
    let name = store.redis_key(&key);
    let owner = Token::new();
    assert_eq!(claim(&store, &key, &owner, None, Duration::from_secs(5)).await, Claim::Claimed);
    store.extend(&key, &owner, Duration::from_secs(500)).await.unwrap();
    let pttl: i64 = raw.pttl(&name).await.unwrap();
    assert!(pttl > 490_000 && pttl <= 500_000, "extend sets the lease from now, got PTTL {pttl}");
    assert!(matches!(store.extend(&key, &Token::new(), LEASE).await, Err(StoreError::NotOwner)));
    let value: String = raw.get(&name).await.unwrap();
    assert!(value.starts_with("idempotent/1 running "), "a refused extend changes nothing: {value:?}");
    let missing = Key::new("pay", &"extend-missing").unwrap();
    assert!(matches!(store.extend(&missing, &owner, LEASE).await, Err(StoreError::NotOwner)));
    // A lease that ran out cannot be extended: Redis dropped the key.
    let lapsed = Key::new("pay", &"extend-lapsed").unwrap();
    assert_eq!(claim(&store, &lapsed, &owner, None, Duration::from_millis(30)).await, Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(80)).await;
    assert!(matches!(store.extend(&lapsed, &owner, LEASE).await, Err(StoreError::NotOwner)));
    let exists: bool = raw.exists(store.redis_key(&lapsed)).await.unwrap();
    assert!(!exists, "a refused extend must not bring the key back");
    cleanup(&mut raw, store.prefix()).await;
}

#[tokio::test]
async fn redis_prefixes_isolate_stores_and_odd_keys_stay_inside() {
    let Some(url) = idempotent_tests::services::redis_url("redis_prefixes_isolate_stores") else {
        return;
    };
    let (a, mut raw) = setup(&url).await;
    let (b, _) = setup(&url).await;
    let odd = ["*", "{tag}", "a b", "ключ 🔑", "x:y:z", ":", "*:{", "..", "\\*", "[a-z]?"];
    let mut expected = Vec::new();
    for text in odd {
        let key = Key::new("odd", &text).unwrap();
        let token = Token::new();
        assert_eq!(claim(&a, &key, &token, None, LEASE).await, Claim::Claimed, "{text:?}");
        a.complete_as(&key, &token, text.as_bytes(), LEASE).await.unwrap();
        let name = a.redis_key(&key);
        assert_eq!(name, format!("{}odd:{text}", a.prefix()));
        let exists: bool = raw.exists(&name).await.unwrap();
        assert!(exists, "{name:?} must be the literal key");
        expected.push(name);
        // The same key under another prefix is another record.
        assert_eq!(claim(&b, &key, &Token::new(), None, LEASE).await, Claim::Claimed, "{text:?}");
    }
    // Each odd key replays its own record, never another's.
    for text in odd {
        let key = Key::new("odd", &text).unwrap();
        let Claim::Completed(record) = claim(&a, &key, &Token::new(), None, LEASE).await else { panic!("{text:?}") };
        assert_eq!(record.outcome, text.as_bytes());
    }
    expected.sort();
    assert_eq!(keys_under(&mut raw, a.prefix()).await, expected, "every key lives under its store's prefix");
    assert_eq!(keys_under(&mut raw, b.prefix()).await.len(), odd.len());
    cleanup(&mut raw, a.prefix()).await;
    cleanup(&mut raw, b.prefix()).await;
}

#[tokio::test]
async fn redis_invalid_prefixes_are_refused() {
    let Some(url) = idempotent_tests::services::redis_url("redis_invalid_prefixes_are_refused") else {
        return;
    };
    let store = RedisStore::connect(&url).await.unwrap();
    assert_eq!(store.prefix(), DEFAULT_PREFIX);
    for bad in ["", "a\nb", "tab\there", "nul\0", &"p".repeat(300)] {
        let error = store.clone().with_prefix(bad).expect_err(bad);
        assert!(error.to_string().contains("invalid Redis key prefix"), "{error}");
    }
    assert_eq!(store.with_prefix("app:{idem}:").unwrap().prefix(), "app:{idem}:");
}

#[tokio::test]
async fn redis_foreign_data_is_reported_not_overwritten() {
    let Some(url) = idempotent_tests::services::redis_url("redis_foreign_data_is_reported") else {
        return;
    };
    let (store, mut raw) = setup(&url).await;
    let string_key = Key::new("foreign", &"string").unwrap();
    let _: () = raw.set(store.redis_key(&string_key), "not ours").await.unwrap();
    let hash_key = Key::new("foreign", &"hash").unwrap();
    let _: () = raw.hset(store.redis_key(&hash_key), "state", "weird").await.unwrap();

    for key in [&string_key, &hash_key] {
        let token = Token::new();
        let request = ClaimRequest::new(key, &token, None, LEASE);
        match store.claim(&request).await {
            Err(StoreError::Corrupt(message)) => {
                assert!(message.contains(&store.redis_key(key)), "{message}");
            }
            other => panic!("expected Corrupt for {key}, got {other:?}"),
        }
        // Not ours: a completion never overwrites it (a value of another type is reported as such).
        let completed = store.complete_as(key, &token, b"{}", LEASE).await;
        assert!(matches!(completed, Err(StoreError::NotOwner | StoreError::Corrupt(_))), "{completed:?}");
        assert!(matches!(store.release(key, &token).await, Err(StoreError::NotOwner)));
    }
    let value: String = raw.get(store.redis_key(&string_key)).await.unwrap();
    assert_eq!(value, "not ours");
    let state: String = raw.hget(store.redis_key(&hash_key), "state").await.unwrap();
    assert_eq!(state, "weird");
    cleanup(&mut raw, store.prefix()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_detached_release_runs_on_the_runtime() {
    let Some(url) = idempotent_tests::services::redis_url("redis_detached_release_runs_on_the_runtime") else {
        return;
    };
    let (store, mut raw) = setup(&url).await;
    let key = Key::new("detached", &"k").unwrap();
    let token = Token::new();
    assert_eq!(claim(&store, &key, &token, None, LEASE).await, Claim::Claimed);
    store.detach(Detached::Release { key: key.clone(), token: Token::new() }); // not the owner: nothing happens
    store.detach(Detached::Release { key: key.clone(), token: token.clone() });
    let mut gone = false;
    for _ in 0..200 {
        let exists: bool = raw.exists(store.redis_key(&key)).await.unwrap();
        if !exists {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(gone, "the detached release must delete the claim");

    // Outside any runtime it does nothing, and does not panic.
    assert_eq!(claim(&store, &key, &token, None, LEASE).await, Claim::Claimed);
    let (outside, k, t) = (store.clone(), key.clone(), token.clone());
    std::thread::spawn(move || outside.detach(Detached::Release { key: k, token: t })).join().unwrap();
    assert!(matches!(claim(&store, &key, &Token::new(), None, LEASE).await, Claim::InProgress { .. }));
    cleanup(&mut raw, store.prefix()).await;
}

#[tokio::test]
async fn redis_connect_failures_are_typed() {
    let Some(_url) = idempotent_tests::services::redis_url("redis_connect_failures_are_typed") else {
        return;
    };
    for url in ["not a url", "redis://127.0.0.1:1"] {
        match RedisStore::connect(url).await {
            Err(StoreError::Backend { backend: "redis", .. }) => {}
            other => panic!("{url}: expected a redis backend error, got {other:?}"),
        }
    }
}

/// A server that accepts connections and never answers: calls must time out, not hang.
#[tokio::test]
async fn redis_hung_server_gives_a_timeout_error() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    let sockets = held.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            sockets.lock().unwrap().push(socket);
        }
    });
    let started = std::time::Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(20), async {
        let store = RedisStore::connect(&format!("redis://{address}")).await?;
        let key = Key::new("hung", &"k").unwrap();
        let token = Token::new();
        store.claim(&ClaimRequest::new(&key, &token, None, LEASE)).await
    })
    .await
    .expect("a hung server must not hang the call");
    assert!(matches!(outcome, Err(StoreError::Backend { backend: "redis", .. })), "{outcome:?}");
    eprintln!("hung server: failed after {:?} with {}", started.elapsed(), outcome.unwrap_err());
}

#[derive(Debug)]
enum PayError {
    Idempotency(Error),
}

impl From<Error> for PayError {
    fn from(error: Error) -> Self {
        PayError::Idempotency(error)
    }
}

/// Counts body runs per key, outside Redis.
#[derive(Default)]
struct Ledger(Mutex<HashMap<u32, u32>>);

impl Ledger {
    fn hit(&self, key: u32) {
        *self.0.lock().unwrap().entry(key).or_default() += 1;
    }
}

#[idempotent(key = order, store = store, scope = "orders", fingerprint = amount, retention = "120s")]
async fn charge(store: &RedisStore, ledger: &Ledger, order: u32, amount: u64) -> Result<String, PayError> {
    ledger.hit(order);
    tokio::time::sleep(Duration::from_millis(20)).await;
    Ok(format!("order {order} charged {amount}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_64_duplicates_of_200_keys_run_each_body_once() {
    const KEYS: u32 = 200;
    const DUPLICATES: usize = 64;
    let Some(url) = idempotent_tests::services::redis_url("redis_64_duplicates_of_200_keys") else {
        return;
    };
    let (store, mut raw) = setup(&url).await;
    let store = Arc::new(store);
    let ledger = Arc::new(Ledger::default());
    let barrier = Arc::new(Barrier::new(KEYS as usize * DUPLICATES));
    let started = std::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for order in 0..KEYS {
        for _ in 0..DUPLICATES {
            let (store, ledger, barrier) = (store.clone(), ledger.clone(), barrier.clone());
            tasks.spawn(async move {
                barrier.wait().await;
                (order, charge(&store, &ledger, order, u64::from(order) * 10).await)
            });
        }
    }
    let (mut replayed, mut in_progress) = (0, 0);
    while let Some(joined) = tasks.join_next().await {
        let (order, result) = joined.unwrap();
        match result {
            Ok(receipt) => {
                assert_eq!(receipt, format!("order {order} charged {}", order * 10));
                replayed += 1;
            }
            Err(PayError::Idempotency(Error::InProgress { .. })) => in_progress += 1,
            Err(other) => {
                panic!("order {order}: expected the receipt or InProgress, got {other:?}")
            }
        }
    }
    let counts = ledger.0.lock().unwrap().clone();
    assert_eq!(counts.len(), KEYS as usize);
    assert!(counts.values().all(|&n| n == 1), "a body ran more than once: {counts:?}");
    eprintln!(
        "{} calls in {:?}: {KEYS} ran, {} got the value, {in_progress} got InProgress",
        KEYS as usize * DUPLICATES,
        started.elapsed(),
        replayed
    );
    assert!(in_progress > 0, "with 64 simultaneous duplicates some must find the key in progress");
    // Every later call replays.
    for order in 0..KEYS {
        assert_eq!(
            charge(&store, &ledger, order, u64::from(order) * 10).await.unwrap(),
            format!("order {order} charged {}", order * 10)
        );
    }
    assert!(ledger.0.lock().unwrap().values().all(|&n| n == 1));
    cleanup(&mut raw, store.prefix()).await;
}

#[idempotent(key = order, store = store, scope = "slow", wait = "5s")]
async fn slow_charge(store: &RedisStore, ledger: &Ledger, order: u32) -> Result<u32, PayError> {
    ledger.hit(order);
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(order * 2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_wait_mode_replays_the_running_call() {
    let Some(url) = idempotent_tests::services::redis_url("redis_wait_mode_replays_the_running_call") else {
        return;
    };
    let (store, mut raw) = setup(&url).await;
    let store = Arc::new(store);
    let ledger = Arc::new(Ledger::default());
    let first = {
        let (store, ledger) = (store.clone(), ledger.clone());
        tokio::spawn(async move { slow_charge(&store, &ledger, 7).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let waiters: Vec<_> = (0..8)
        .map(|_| {
            let (store, ledger) = (store.clone(), ledger.clone());
            tokio::spawn(async move { slow_charge(&store, &ledger, 7).await })
        })
        .collect();
    assert_eq!(first.await.unwrap().unwrap(), 14);
    for waiter in waiters {
        assert_eq!(waiter.await.unwrap().unwrap(), 14, "a waiting duplicate gets the first call's value");
    }
    assert_eq!(ledger.0.lock().unwrap()[&7], 1);
    cleanup(&mut raw, store.prefix()).await;
}

#[idempotent(key = order, store = store, scope = "big")]
async fn big_result(store: &RedisStore, ledger: &Ledger, order: u32) -> Result<String, PayError> {
    ledger.hit(order);
    Ok("x".repeat(100))
}

#[tokio::test]
async fn redis_record_limit_is_configurable() {
    let Some(url) = idempotent_tests::services::redis_url("redis_record_limit_is_configurable") else {
        return;
    };
    let (store, mut raw) = setup(&url).await;
    let store = store.with_max_record_bytes(64);
    assert_eq!(store.max_record_bytes(), 64);
    let ledger = Ledger::default();
    assert_eq!(big_result(&store, &ledger, 1).await.unwrap().len(), 100);
    assert!(matches!(big_result(&store, &ledger, 1).await, Err(PayError::Idempotency(Error::Unrecordable { .. }))));
    assert_eq!(ledger.0.lock().unwrap()[&1], 1, "an unrecordable result still never runs twice");
    cleanup(&mut raw, store.prefix()).await;
}

/// The warnings logged while running `future` (target `idempotent`).
async fn warnings_of<F: std::future::Future>(future: F) -> (F::Output, Vec<String>) {
    use tracing_subscriber::layer::{Context, SubscriberExt as _};

    struct Warnings(Arc<Mutex<Vec<String>>>);
    struct Message<'a>(&'a mut String);
    impl tracing::field::Visit for Message<'_> {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            let _ = std::fmt::Write::write_fmt(self.0, format_args!("{}={value:?} ", field.name()));
        }
    }
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
        fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
            if *event.metadata().level() == tracing::Level::WARN {
                let mut text = String::new();
                event.record(&mut Message(&mut text));
                self.0.lock().unwrap().push(text);
            }
        }
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry().with(Warnings(seen.clone()));
    let output = tracing::instrument::WithSubscriber::with_subscriber(future, subscriber).await;
    let warnings = seen.lock().unwrap().clone();
    (output, warnings)
}

/// `connect` reads the server's INFO: the shared server (noeviction) connects without a warning;
/// a private server under an evicting `maxmemory-policy` connects with a warning that names the
/// policy and the fix.
#[tokio::test]
async fn redis_connect_warns_when_the_server_may_evict_records() {
    let Some(url) = idempotent_tests::services::redis_url("redis_connect_warns_when_the_server_may_evict_records")
    else {
        return;
    };
    let (connected, warnings) = warnings_of(RedisStore::connect(&url)).await;
    connected.expect("the shared server is a supported Redis");
    assert!(warnings.is_empty(), "{warnings:?}");

    let test = "redis_connect_warns_when_the_server_may_evict_records";
    if !idempotent_tests::services::programs_installed(test, &["redis-server"]) {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = idempotent_tests::fresh::temp_dir("redis-evicting");
    let mut server = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--maxmemory-policy", "allkeys-lru", "--dir", &dir.display().to_string()])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start a private redis-server");
    let private = format!("redis://127.0.0.1:{port}");
    let mut store = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (connected, warnings) = warnings_of(RedisStore::connect(&private)).await;
        if let Ok(connected) = connected {
            store = Some((connected, warnings));
            break;
        }
    }
    let _ = server.kill();
    let _ = server.wait();
    let (_, warnings) = store.expect("the private server came up");
    assert!(
        warnings.iter().any(|w| w.contains("allkeys-lru") && w.contains("noeviction")),
        "no eviction warning: {warnings:?}"
    );
}

/// A connection cut after the server did a step and before its reply came back (the proxy's
/// [`Mode::LoseOneResponse`]): the store sends the step once more on a new connection, and the
/// second send, finding the first one's effect, answers as the first would have. Each step is
/// checked in Redis itself, and the proxy counts each lost reply, so a step that did not meet its
/// fault fails the test too.
#[tokio::test]
async fn redis_steps_whose_reply_was_lost_are_sent_again() {
    use idempotent_tests::proxy::{FaultProxy, Mode};
    use std::sync::atomic::Ordering;

    let Some(url) = idempotent_tests::services::redis_url("redis_steps_whose_reply_was_lost_are_sent_again") else {
        return;
    };
    let target = url.trim_start_matches("redis://").trim_end_matches('/');
    let proxy = FaultProxy::start(target).await.expect("start the proxy");
    let (store, mut raw) = setup(&format!("redis://{}", proxy.addr())).await;
    let (key, other) = (Key::new("lost", &"a").unwrap(), Key::new("lost", &"b").unwrap());
    let (owner, stranger) = (Token::new(), Token::new());
    let lost = || proxy.stats().lost_responses.load(Ordering::Relaxed);
    let lose_the_next_reply = || {
        proxy.set_mode(Mode::LoseOneResponse);
        lost() + 1
    };
    let value = async |raw: &mut redis::aio::MultiplexedConnection, key: &Key| -> Option<String> {
        raw.get(store.redis_key(key)).await.unwrap()
    };

    let expected = lose_the_next_reply();
    let claimed = store.claim(&ClaimRequest::new(&key, &owner, None, LEASE)).await;
    assert_eq!(claimed.expect("the claim is sent again"), Claim::Claimed);
    assert_eq!(lost(), expected, "the claim's reply was lost");
    let running = value(&mut raw, &key).await.expect("the claim is in Redis");
    assert!(running.starts_with(&format!("idempotent/1 running {} ", owner.as_str())), "{running}");

    let expected = lose_the_next_reply();
    store.extend(&key, &owner, LEASE).await.expect("the renewal is sent again");
    assert_eq!(lost(), expected, "the renewal's reply was lost");

    let expected = lose_the_next_reply();
    let refused = store.extend(&key, &stranger, LEASE).await;
    assert!(matches!(refused, Err(StoreError::NotOwner)), "a stranger's renewal sent twice: {refused:?}");
    assert_eq!(lost(), expected, "the stranger's reply was lost");

    let expected = lose_the_next_reply();
    store.complete_as(&key, &owner, b"{\"Ok\":7}", LEASE).await.expect("the completion is sent again");
    assert_eq!(lost(), expected, "the completion's reply was lost");
    let done = value(&mut raw, &key).await.expect("the record is in Redis");
    assert_eq!(done, format!("idempotent/1 done {} -\n{{\"Ok\":7}}", owner.as_str()));

    let expected = lose_the_next_reply();
    let replayed = store.claim(&ClaimRequest::new(&key, &stranger, None, LEASE)).await;
    assert_eq!(
        replayed.expect("the replay is sent again"),
        Claim::Completed(Record::new(None, b"{\"Ok\":7}".to_vec()))
    );
    assert_eq!(lost(), expected, "the replay's reply was lost");

    assert_eq!(claim(&store, &other, &owner, None, LEASE).await, Claim::Claimed);
    let expected = lose_the_next_reply();
    store.release(&other, &owner).await.expect("the release is sent again, and its first send freed the key");
    assert_eq!(lost(), expected, "the release's reply was lost");
    assert_eq!(value(&mut raw, &other).await, None, "the release deleted the claim");
    assert_eq!(claim(&store, &other, &stranger, None, LEASE).await, Claim::Claimed, "the key is free at once");

    // An operator's release sent again cannot tell its own deletion from another caller's change:
    // it says so instead of answering `Changed`.
    let third = Key::new("lost", &"c").unwrap();
    assert_eq!(claim(&store, &third, &owner, None, LEASE).await, Claim::Claimed);
    let seen = idempotent_runtime::admin::Admin::inspect(&store, &third).await.unwrap().expect("the claim is listed");
    let expected = lose_the_next_reply();
    let released = idempotent_runtime::admin::Admin::release(&store, &third, &seen).await;
    assert_eq!(lost(), expected, "the operator's release's reply was lost");
    let Err(error @ StoreError::Backend { .. }) = released else { panic!("{released:?}") };
    assert!(error.to_string().contains("inspect the key again"), "{error}");
    assert_eq!(value(&mut raw, &third).await, None, "the first send deleted the claim");

    // A batch's pipeline, whose replies were lost, is sent again whole: every claim finds its own
    // (or the batch's first claim of a repeated key), every completion its own record.
    let batch: Vec<Key> = (0..8).map(|i| Key::new("lost-batch", &i).unwrap()).collect();
    let tokens: Vec<Token> = batch.iter().map(|_| Token::new()).collect();
    let mut requests: Vec<ClaimRequest<'_>> =
        batch.iter().zip(&tokens).map(|(key, token)| ClaimRequest::new(key, token, None, LEASE)).collect();
    requests.push(ClaimRequest::new(&batch[0], &stranger, None, LEASE));
    let expected = lose_the_next_reply();
    let claims = store.claim_many(&requests).await.expect("the batch is sent again");
    assert_eq!(lost(), expected, "the batch's replies were lost");
    assert!(claims[..8].iter().all(|c| matches!(c, Ok(Claim::Claimed))), "{claims:?}");
    assert!(matches!(claims[8], Ok(Claim::InProgress { lease_remaining: Some(_), .. })), "{:?}", claims[8]);
    let completions: Vec<Completion<'_>> =
        batch.iter().zip(&tokens).map(|(key, token)| Completion::new(key, token, None, b"{\"Ok\":8}", LEASE)).collect();
    let expected = lose_the_next_reply();
    let recorded = store.complete_many(&completions).await.expect("the batch is sent again");
    assert_eq!(lost(), expected, "the batch's replies were lost");
    assert!(recorded.iter().all(Result::is_ok), "{recorded:?}");
    for (key, token) in batch.iter().zip(&tokens) {
        let done = value(&mut raw, key).await.expect("the record is in Redis");
        assert_eq!(done, format!("idempotent/1 done {} -\n{{\"Ok\":8}}", token.as_str()));
    }

    // Through the protocol: a lost claim reply and a lost completion reply; the body runs once.
    let runs = std::sync::atomic::AtomicU32::new(0);
    let call = || {
        idempotent_runtime::Call::new("lost", &"call").run(&store, async {
            runs.fetch_add(1, Ordering::SeqCst);
            // The claim's reply is lost before the body runs; the completion's, after it.
            proxy.set_mode(Mode::LoseOneResponse);
            Ok::<_, Error>(String::from("charged"))
        })
    };
    let expected = lose_the_next_reply() + 1;
    assert_eq!(call().await.expect("the call succeeds"), "charged");
    assert_eq!(lost(), expected, "both replies were lost");
    assert_eq!(call().await.expect("the retry replays"), "charged");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
    cleanup(&mut raw, store.prefix()).await;
}

/// Sends `complete` until the replica acknowledges it (a completion sent again by its token is
/// accepted), for at most 20 s: a replica just linked or resumed may take longer than one `WAIT`.
async fn acknowledged<F: Future<Output = Result<(), StoreError>>>(complete: impl Fn() -> F) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match complete().await {
            Ok(()) => return,
            Err(error) if tokio::time::Instant::now() < deadline => {
                eprintln!("the replica has not acknowledged yet ({error}); sending the completion again");
            }
            Err(error) => panic!("the replica acknowledged no completion within 20 s: {error}"),
        }
    }
}

/// With `with_replica_acks`, a completion sent again (its first reply lost, the record already
/// written by it) must still wait for a replica to have the record. On Redis 8, `WAIT` counts
/// only the writes of its own connection, and the new connection had written nothing (Redis 7.0
/// waits for every write made before it, so there the test passes either way). The replica is
/// stopped, so no acknowledgement can come: the completion must fail with `ReplicasMissing`,
/// however it is sent again (by the store on the lost connection, or by its caller after an
/// error), and succeed once the replica runs again and has the record.
#[tokio::test]
async fn redis_replica_acks_of_a_resent_completion_wait_for_the_replica() {
    use idempotent_runtime::stores::redis::ReplicasMissing;
    use idempotent_tests::proxy::{FaultProxy, Mode};
    use idempotent_tests::replicated::Replicated;
    use std::sync::atomic::Ordering;

    let test = "redis_replica_acks_of_a_resent_completion_wait_for_the_replica";
    let Some(pair) = Replicated::start(test) else { return };
    let proxy = FaultProxy::start(&format!("127.0.0.1:{}", pair.master_port)).await.expect("start the proxy");
    let store = RedisStore::connect(&format!("redis://{}", proxy.addr()))
        .await
        .expect("connect to the master")
        .with_replica_acks(1, Duration::from_millis(300));
    let (key, owner) = (Key::new("acks", &"k").unwrap(), Token::new());
    // A first completion, with the replica running, loads the script on this new server: the
    // completion below is then one `EVALSHA`, as on a server that has served calls.
    let warm = Key::new("acks", &"warm-up").unwrap();
    assert_eq!(claim(&store, &warm, &owner, None, LEASE).await, Claim::Claimed);
    acknowledged(|| store.complete_as(&warm, &owner, b"{\"Ok\":0}", LEASE)).await;
    assert_eq!(claim(&store, &key, &owner, None, LEASE).await, Claim::Claimed);

    pair.signal_replica("-STOP");
    proxy.set_mode(Mode::LoseOneResponse);
    let complete = || store.complete_as(&key, &owner, b"{\"Ok\":1}", LEASE);
    let missing = |outcome: &Result<(), StoreError>| matches!(outcome, Err(StoreError::Backend { source, .. }) if source.downcast_ref::<ReplicasMissing>().is_some());
    let mut outcome = complete().await;
    if !missing(&outcome) {
        // The caller's retry, as the protocol makes after a failed completion.
        outcome = complete().await;
    }
    assert_eq!(proxy.stats().lost_responses.load(Ordering::Relaxed), 1, "the first completion's reply was lost");
    assert!(missing(&outcome), "no replica can have acknowledged the record, yet: {outcome:?}");

    pair.signal_replica("-CONT");
    acknowledged(complete).await;
    let client = redis::Client::open(Replicated::url(pair.replica_port)).unwrap();
    let mut replica = client.get_multiplexed_async_connection().await.unwrap();
    let on_replica: Option<String> = replica.get(store.redis_key(&key)).await.unwrap();
    assert_eq!(on_replica, Some(format!("idempotent/1 done {} -\n{{\"Ok\":1}}", owner.as_str())));

    // A batch of completions waits once, at the end of its pipeline, and each of its records is
    // acknowledged only if the replica has them all.
    let batch: Vec<Key> = (0..4).map(|i| Key::new("acks-batch", &i).unwrap()).collect();
    let requests: Vec<ClaimRequest<'_>> = batch.iter().map(|key| ClaimRequest::new(key, &owner, None, LEASE)).collect();
    let claims = store.claim_many(&requests).await.unwrap();
    assert!(claims.iter().all(|c| matches!(c, Ok(Claim::Claimed))), "{claims:?}");
    let completions: Vec<Completion<'_>> =
        batch.iter().map(|key| Completion::new(key, &owner, None, b"{\"Ok\":2}", LEASE)).collect();
    pair.signal_replica("-STOP");
    let recorded = store.complete_many(&completions).await.expect("the batch was answered");
    assert!(recorded.iter().all(missing), "no replica can have acknowledged these records: {recorded:?}");
    pair.signal_replica("-CONT");
    acknowledged(|| async {
        let recorded = store.complete_many(&completions).await?;
        recorded.into_iter().collect::<Result<Vec<()>, _>>().map(drop)
    })
    .await;
    for key in &batch {
        let on_replica: Option<String> = replica.get(store.redis_key(key)).await.unwrap();
        assert_eq!(on_replica, Some(format!("idempotent/1 done {} -\n{{\"Ok\":2}}", owner.as_str())));
    }
}

/// Whether the server behind `raw` has `SET`'s `IFEQ` option (Valkey 8.1, Redis 8.4): a `SET ...
/// IFEQ` on a key that does not exist writes nothing either way, and an older server refuses it.
async fn has_set_ifeq(raw: &mut redis::aio::MultiplexedConnection) -> bool {
    let probe = format!("idempotent-test:{}:ifeq-probe", uuid::Uuid::new_v4().simple());
    let reply: redis::RedisResult<Option<String>> =
        redis::cmd("SET").arg(&probe).arg("x").arg("IFEQ").arg("y").query_async(raw).await;
    match reply {
        Ok(None) => true,
        Err(e) if e.to_string().contains("syntax error") => false,
        other => panic!("unexpected reply to SET ... IFEQ on a missing key: {other:?}"),
    }
}

/// On a server with `SET ... IFEQ`, the usual completion (the key still holds the call's claim)
/// is that one native command, no script: a user refused `EVAL` and `EVALSHA` by an ACL
/// completes calls, one by one and in a batch, and a store told not to use the native command
/// cannot (which shows the ACL does refuse the script). On an older server the first
/// completion's refused `SET` costs nothing: the script completes the call, and the store sends
/// the script only from then on. `IDEMPOTENT_EXPECT_SET_IFEQ=1` (set by `scripts/valkey`) makes a
/// server without the option a failure instead of the second case.
#[tokio::test]
async fn redis_completions_are_one_native_set_where_the_server_has_ifeq() {
    let test = "redis_completions_are_one_native_set_where_the_server_has_ifeq";
    let Some(url) = idempotent_tests::services::redis_url(test) else { return };
    let (store, mut raw) = setup(&url).await;
    let key = Key::new("native", &"k").unwrap();
    let outcome = br#"{"Ok":"receipt"}"#;

    if !has_set_ifeq(&mut raw).await {
        assert!(
            std::env::var("IDEMPOTENT_EXPECT_SET_IFEQ").as_deref() != Ok("1"),
            "IDEMPOTENT_EXPECT_SET_IFEQ=1, but the server at {url} refuses SET ... IFEQ"
        );
        eprintln!("{test}: this server has no SET ... IFEQ; checking the fallback to the script");
        let owner = Token::new();
        assert_eq!(claim(&store, &key, &owner, None, LEASE).await, Claim::Claimed);
        assert!(format!("{store:?}").contains("native_completion: true"), "{store:?}");
        store.complete_as(&key, &owner, outcome, LEASE).await.expect("the script completes the call");
        assert!(format!("{store:?}").contains("native_completion: false"), "{store:?}");
        let replay = claim(&store, &key, &Token::new(), None, LEASE).await;
        assert_eq!(replay, Claim::Completed(Record::new(None, outcome.to_vec())));
        cleanup(&mut raw, store.prefix()).await;
        return;
    }

    let user = format!("idempotent-test-noscript-{}", uuid::Uuid::new_v4().simple());
    let _: () = idempotent_tests::services::acl_user_without_scripts(&user)
        .query_async(&mut raw)
        .await
        .expect("create the ACL user");
    let port = url.rsplit(':').next().and_then(|p| p.trim_end_matches('/').parse::<u16>().ok()).unwrap_or(6379);
    let as_user = format!("redis://{user}:any@127.0.0.1:{port}");
    let noscript =
        RedisStore::connect(&as_user).await.expect("connect as the user").with_prefix(store.prefix()).unwrap();

    // One by one, with a fingerprint.
    let (owner, fp) = (Token::new(), Fingerprint::of(&("alice", 100)).unwrap());
    assert_eq!(claim(&noscript, &key, &owner, Some(&fp), LEASE).await, Claim::Claimed);
    let completion = Completion::new(&key, &owner, Some(&fp), outcome, LEASE);
    noscript.complete(&completion).await.expect("completed by SET ... IFEQ, no script");
    let replay = claim(&noscript, &key, &Token::new(), None, LEASE).await;
    assert_eq!(replay, Claim::Completed(Record::new(Some(fp), outcome.to_vec())));

    // A batch.
    let keys: Vec<Key> = (0..5).map(|i| Key::new("native-batch", &i).unwrap()).collect();
    let tokens: Vec<Token> = keys.iter().map(|_| Token::new()).collect();
    let claims: Vec<ClaimRequest<'_>> =
        keys.iter().zip(&tokens).map(|(key, token)| ClaimRequest::new(key, token, None, LEASE)).collect();
    for claimed in noscript.claim_many(&claims).await.expect("claim the batch") {
        assert_eq!(claimed.expect("claim"), Claim::Claimed);
    }
    let completions: Vec<Completion<'_>> =
        keys.iter().zip(&tokens).map(|(key, token)| Completion::new(key, token, None, outcome, LEASE)).collect();
    for completed in noscript.complete_many(&completions).await.expect("complete the batch") {
        completed.expect("completed by SET ... IFEQ, no script");
    }
    for key in &keys {
        assert_eq!(
            claim(&noscript, key, &Token::new(), None, LEASE).await,
            Claim::Completed(Record::new(None, outcome.to_vec()))
        );
    }

    // The same user, told not to use the native command, is refused the script.
    let scripted = noscript.clone().with_native_completion(false);
    let (other, owner) = (Key::new("native", &"scripted").unwrap(), Token::new());
    assert_eq!(claim(&scripted, &other, &owner, None, LEASE).await, Claim::Claimed);
    let refused = scripted.complete_as(&other, &owner, outcome, LEASE).await;
    let refused_script =
        matches!(&refused, Err(e @ StoreError::Rejected { .. }) if e.to_string().contains("'evalsha'"));
    assert!(refused_script, "{refused:?}");

    let _: () = redis::cmd("ACL").arg("DELUSER").arg(&user).query_async(&mut raw).await.unwrap();
    cleanup(&mut raw, store.prefix()).await;
}
