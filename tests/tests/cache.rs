#![cfg(feature = "cache")]
//! `CachedStore`: replays from the local cache with no store round trip, the fingerprint checked
//! on every replay, claims in progress never cached, expiry with the retention, records learned
//! from the store kept for a bounded time, bounds on entries and bytes, and what a manual delete
//! in the store means. Against the real Redis (skipped loudly without it), and the memory store.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_runtime::stores::cache::CachedStore;
use idempotent_runtime::{Call, Error, Key, MemoryStore, Store};

// The conformance suite over the cached memory store is in `memory.rs`.
#[cfg(feature = "redis")]
idempotent_tests::conformance_suite!(
    conformance_cached_redis,
    async { Some(CachedStore::new(redis_store("conformance_cached_redis").await?.0)) },
    self_expiring
);

/// Runs the body once per key on `store` and counts the runs.
async fn charge<S: Store>(store: &S, runs: &AtomicUsize, key: &str, amount: i64) -> Result<i64, Error> {
    Call::new("cache", key)
        .fingerprint(&amount)
        .lease(Duration::from_millis(200))
        .retention(Duration::from_millis(400))
        .run(store, async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(amount)
        })
        .await
}

#[cfg(feature = "redis")]
use idempotent_runtime::RedisStore;
#[cfg(feature = "redis")]
use idempotent_runtime::stores::redis::redis;

/// A Redis store under a fresh prefix, and a plain connection to act as an operator.
#[cfg(feature = "redis")]
async fn redis_store(test: &str) -> Option<(RedisStore, redis::aio::MultiplexedConnection)> {
    let url = idempotent_tests::services::redis_url(test)?;
    let prefix = format!("idempotent-test:{}:", uuid::Uuid::new_v4().simple());
    let store = RedisStore::connect(&url).await.expect("connect to Redis").with_prefix(prefix).expect("a valid prefix");
    let raw = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
    Some((store, raw))
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_cache_replays_without_a_round_trip_and_a_manual_delete_waits_for_invalidate() {
    let Some((redis_store, mut raw)) = redis_store("redis_cache_replays_without_a_round_trip").await else { return };
    let store = CachedStore::new(redis_store.clone());
    let runs = AtomicUsize::new(0);
    let k = uuid::Uuid::new_v4().to_string();
    assert_eq!(charge(&store, &runs, &k, 100).await.unwrap(), 100);
    assert_eq!((store.stats().hits, store.stats().misses), (0, 1));
    assert_eq!(charge(&store, &runs, &k, 100).await.unwrap(), 100);
    assert_eq!((store.stats().hits, store.stats().misses), (1, 1), "the replay came from the cache");

    // An operator deletes the record in Redis: this process keeps replaying its copy (no round
    // trip reaches Redis), while a process without a copy runs the request again.
    let name = redis_store.redis_key(&Key::new("cache", &k).unwrap());
    let deleted: u64 = redis::cmd("DEL").arg(&name).query_async(&mut raw).await.unwrap();
    assert_eq!(deleted, 1, "the record was in Redis under {name}");
    assert_eq!(charge(&store, &runs, &k, 100).await.unwrap(), 100);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "replayed from the cache despite the delete");
    let other_process = CachedStore::new(redis_store.clone());
    charge(&other_process, &runs, &k, 100).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 2, "a process without a copy ran it again");
    // After `invalidate`, this process asks Redis again: it finds the other process's record.
    let deleted: u64 = redis::cmd("DEL").arg(&name).query_async(&mut raw).await.unwrap();
    assert_eq!(deleted, 1);
    store.invalidate(&Key::new("cache", &k).unwrap());
    charge(&store, &runs, &k, 100).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 3, "invalidated: the manual delete took effect");
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_cache_checks_the_fingerprint_on_every_replay() {
    let Some((redis_store, _)) = redis_store("redis_cache_checks_the_fingerprint").await else { return };
    let store = CachedStore::new(redis_store);
    let runs = AtomicUsize::new(0);
    let k = uuid::Uuid::new_v4().to_string();
    charge(&store, &runs, &k, 100).await.unwrap();
    for _ in 0..3 {
        assert!(matches!(charge(&store, &runs, &k, 5).await, Err(Error::FingerprintMismatch { .. })));
    }
    assert_eq!(store.stats().hits, 3, "the mismatches were found in the cache");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_cache_never_caches_a_claim_in_progress() {
    let Some((redis_store, _)) = redis_store("redis_cache_never_caches_a_claim_in_progress").await else { return };
    let store = CachedStore::new(redis_store);
    let k = uuid::Uuid::new_v4().to_string();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let (finish_tx, finish_rx) = tokio::sync::oneshot::channel::<()>();
    let first = Call::new("cache", &k).run(&store, async {
        started_tx.send(()).unwrap();
        finish_rx.await.unwrap();
        Ok::<_, Error>(1)
    });
    let duplicates = async {
        started_rx.await.unwrap();
        for _ in 0..3 {
            let result = Call::new("cache", &k).run(&store, async { Ok::<_, Error>(2) }).await;
            assert!(matches!(result, Err(Error::InProgress { .. })), "{result:?}");
        }
        assert_eq!(store.stats().entries, 0, "nothing cached while the claim runs");
        finish_tx.send(()).unwrap();
    };
    let (first, ()) = tokio::join!(first, duplicates);
    assert_eq!(first.unwrap(), 1);
    assert_eq!((store.stats().hits, store.stats().misses), (0, 4), "every claim in progress went to Redis");
    assert_eq!(Call::new("cache", &k).run(&store, async { Ok::<_, Error>(2) }).await.unwrap(), 1);
    assert_eq!(store.stats().hits, 1, "the completed record is cached");
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_cache_expires_with_the_retention() {
    let Some((redis_store, _)) = redis_store("redis_cache_expires_with_the_retention").await else { return };
    let store = CachedStore::new(redis_store);
    let runs = AtomicUsize::new(0);
    let k = uuid::Uuid::new_v4().to_string();
    charge(&store, &runs, &k, 100).await.unwrap();
    charge(&store, &runs, &k, 100).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The retention is 400 ms: after it, neither the cache nor Redis has the record.
    tokio::time::sleep(Duration::from_millis(600)).await;
    charge(&store, &runs, &k, 100).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the key ran again after its retention");
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_cache_keeps_records_found_in_the_store_for_the_learned_ttl_only() {
    let Some((redis_store, _)) = redis_store("redis_cache_keeps_records_found_in_the_store").await else { return };
    let writer = CachedStore::new(redis_store.clone());
    let reader = CachedStore::new(redis_store.clone()).with_learned_ttl(Duration::from_secs(2));
    let never = CachedStore::new(redis_store).with_learned_ttl(Duration::ZERO);
    let runs = AtomicUsize::new(0);
    let k = uuid::Uuid::new_v4().to_string();
    let once = async |store: &CachedStore<RedisStore>| {
        let value = Call::new("cache", &k).run(store, async { Ok::<_, Error>(runs.fetch_add(1, Ordering::SeqCst)) });
        assert_eq!(value.await.unwrap(), 0, "the writer's result");
    };
    once(&writer).await;
    for store in [&reader, &never] {
        for _ in 0..3 {
            once(store).await;
        }
    }
    assert_eq!((reader.stats().hits, reader.stats().misses), (2, 1), "learned from Redis, then cached");
    assert_eq!((never.stats().hits, never.stats().misses), (0, 3), "learned_ttl zero: never cached");
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    once(&reader).await;
    assert_eq!(reader.stats().misses, 2, "after the learned TTL the reader asks Redis again");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once, in the writer");
}

#[tokio::test]
async fn memory_cache_is_bounded_by_entries_and_by_bytes() {
    let by_entries = CachedStore::new(MemoryStore::new()).with_max_entries(10);
    let by_bytes = CachedStore::new(MemoryStore::new()).with_max_bytes(8 * 1024);
    let value = Arc::new("x".repeat(1024));
    for store in [&by_entries, &by_bytes] {
        for i in 0..200 {
            let value = Arc::clone(&value);
            Call::new("bounded", &i).run(store, async move { Ok::<_, Error>(value.to_string()) }).await.unwrap();
        }
    }
    let entries = by_entries.stats().entries;
    assert!((1..=10).contains(&entries), "at most 10 entries: {entries}");
    // Each record is over 1 KiB (key, outcome, overhead): at most 7 fit in 8 KiB.
    let entries = by_bytes.stats().entries;
    assert!((1..=7).contains(&entries), "at most 8 KiB: {entries} entries");
}

/// A batch of claims through the cache: the records this process wrote are answered from the
/// cache, and only the other keys reach the store, in one batch of its own; records the store
/// answers are learned. The records a batch of completions wrote are cached.
#[tokio::test]
async fn memory_cache_answers_a_batch_from_its_records_and_sends_the_rest_as_one_batch() {
    use idempotent_runtime::{Claim, ClaimRequest, Completion, StoreError, Token};

    /// The memory store, counting the batches and single claims that reach it.
    #[derive(Default)]
    struct Counting {
        inner: MemoryStore,
        batches: AtomicUsize,
        batched: AtomicUsize,
        singles: AtomicUsize,
    }
    impl Counting {
        fn inner(&self) -> &MemoryStore {
            &self.inner
        }
    }
    impl Store for Counting {
        async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
            self.singles.fetch_add(1, Ordering::SeqCst);
            self.inner.claim(request).await
        }
        async fn claim_many(
            &self,
            requests: &[ClaimRequest<'_>],
        ) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
            self.batches.fetch_add(1, Ordering::SeqCst);
            self.batched.fetch_add(requests.len(), Ordering::SeqCst);
            self.inner.claim_many(requests).await
        }
        idempotent_runtime::forward_store!(direct Counting::inner;
            complete complete_many release extend detach process_local);
    }

    let store = CachedStore::new(Counting::default());
    let keys: Vec<Key> = (0..6).map(|i| Key::new("cache-batch", &i).unwrap()).collect();
    let tokens: Vec<Token> = keys.iter().map(|_| Token::new()).collect();
    let lease = Duration::from_secs(30);
    let requests: Vec<ClaimRequest<'_>> =
        keys.iter().zip(&tokens).map(|(key, token)| ClaimRequest::new(key, token, None, lease)).collect();
    let claims = store.claim_many(&requests).await.unwrap();
    assert!(claims.iter().all(|c| matches!(c, Ok(Claim::Claimed))), "{claims:?}");
    // Four recorded through the cache (kept), two straight in the store behind it (learned later).
    let completions: Vec<Completion<'_>> =
        keys.iter().zip(&tokens).map(|(key, token)| Completion::new(key, token, None, b"{\"Ok\":1}", lease)).collect();
    assert!(store.complete_many(&completions[..4]).await.unwrap().iter().all(Result::is_ok));
    assert!(store.inner().complete_many(&completions[4..]).await.unwrap().iter().all(Result::is_ok));

    let readers: Vec<Token> = keys.iter().map(|_| Token::new()).collect();
    let reads: Vec<ClaimRequest<'_>> =
        keys.iter().zip(&readers).map(|(key, token)| ClaimRequest::new(key, token, None, lease)).collect();
    let before = (store.stats().hits, store.inner().batches.load(Ordering::SeqCst));
    let replays = store.claim_many(&reads).await.unwrap();
    assert!(replays.iter().all(|c| matches!(c, Ok(Claim::Completed(_)))), "{replays:?}");
    assert_eq!(store.stats().hits - before.0, 4, "the four records the cache kept");
    assert_eq!(store.inner().batches.load(Ordering::SeqCst) - before.1, 1, "one batch for the rest");
    assert_eq!(store.inner().batched.load(Ordering::SeqCst), 6 + 2, "the first batch's six keys, then two");
    assert_eq!(store.inner().singles.load(Ordering::SeqCst), 0, "no single claim");
    // The two the store answered are learned: now all six come from the cache.
    store.claim_many(&reads).await.unwrap();
    assert_eq!(store.stats().hits - before.0, 4 + 6);
}
