//! The memory store against the conformance suite, plus what is particular to it.

use idempotent_runtime::{MemoryStore, Store};

idempotent_tests::conformance_suite!(conformance_memory, async { Some(MemoryStore::new()) });

// The same cases on Tokio's paused clock: the memory store expires leases and records by it.
idempotent_tests::conformance_suite!(conformance_memory_paused, async { Some(MemoryStore::new()) }, paused);

// The local replay cache over the memory store. Here rather than in `cache.rs`: its CPU-heavy
// cases would slow the Redis cases running there in parallel past the client's response timeout.
#[cfg(feature = "cache")]
idempotent_tests::conformance_suite!(conformance_cached_memory, async {
    Some(idempotent_runtime::stores::cache::CachedStore::new(MemoryStore::new()))
});

#[tokio::test]
async fn memory_store_forgets_expired_entries_as_new_keys_arrive() {
    use idempotent_runtime::{Call, Error};
    use std::time::Duration;

    let store = MemoryStore::new();
    let run = |k: u32, retention: Duration| {
        Call::new("sweep", &k).retention(retention).lease(retention).run(&store, async move { Ok::<_, Error>(k) })
    };
    for k in 0..10_000 {
        run(k, Duration::from_millis(100)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    for k in 10_000..20_000 {
        run(k, Duration::from_secs(60)).await.unwrap();
    }
    // The 10,000 expired records were swept while the next 10,000 arrived, without a purge call.
    assert!(store.len() < 12_000, "{} entries held for 10,000 live ones", store.len());
    assert!(store.len() >= 10_000);
    store.purge_expired().await.unwrap();
    assert_eq!(store.len(), 10_000);
}

/// The heartbeat's cost: a body shorter than a third of its lease makes no renewal (two store
/// round trips in all: claim and complete); a longer one renews every third of the lease.
#[tokio::test(start_paused = true)]
async fn memory_heartbeat_renews_only_bodies_longer_than_a_third_of_their_lease() {
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::Duration;

    use idempotent_runtime::{Call, Error};
    use idempotent_tests::stress::Counted;

    let store = Counted::new(MemoryStore::new());
    let ops = |store: &Counted<MemoryStore>| {
        (store.ops.claims.load(Relaxed), store.ops.completes.load(Relaxed), store.ops.extends.load(Relaxed))
    };
    let short = Call::new("heartbeat", &"short").lease(Duration::from_secs(3));
    let body = async {
        tokio::time::sleep(Duration::from_millis(999)).await;
        Ok::<_, Error>(1)
    };
    assert_eq!(short.run(&store, body).await.unwrap(), 1);
    assert_eq!(ops(&store), (1, 1, 0), "claims, completes, renewals of a body shorter than lease/3");

    let long = Call::new("heartbeat", &"long").lease(Duration::from_millis(300));
    let body = async {
        tokio::time::sleep(Duration::from_millis(1050)).await;
        Ok::<_, Error>(2)
    };
    assert_eq!(long.run(&store, body).await.unwrap(), 2);
    // Renewals at 100, 200, ..., 1000 ms of a 1050 ms body.
    assert_eq!(ops(&store), (2, 2, 10), "claims, completes, renewals after a body of 3.5 leases");
}

/// A step's lease check sends nothing within the lease: a call with one step, well within its
/// lease, sends two claims (the call's and the step's lookup), one renewal (the fence of the
/// step's record) and two completions.
#[tokio::test(start_paused = true)]
async fn memory_a_step_within_the_lease_adds_only_its_records_fence() {
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::Duration;

    use idempotent_runtime::{Call, Error, step};
    use idempotent_tests::stress::Counted;

    let store = Counted::new(MemoryStore::new());
    let call = Call::new("step-requests", &"k").lease(Duration::from_secs(3));
    let body = async { step("charge", async { Ok::<_, Error>(1) }).await };
    assert_eq!(call.run(&store, body).await.unwrap(), 1);
    let ops = (store.ops.claims.load(Relaxed), store.ops.extends.load(Relaxed), store.ops.completes.load(Relaxed));
    assert_eq!(ops, (2, 1, 2), "claims, renewals and completions of a call with one step");
}

/// Under `tokio::time::pause`, the way users test time-dependent code, leases and records expire
/// by the paused clock (the store used `std::time::Instant` and never expired anything).
#[tokio::test(start_paused = true)]
async fn memory_store_expires_by_tokios_paused_clock() {
    use std::time::Duration;

    use idempotent_runtime::{Claim, ClaimRequest, Key, Token};

    let store = MemoryStore::new();
    let key = Key::new("paused", &"k").unwrap();
    let (first, second) = (Token::new(), Token::new());
    let claim = |token| ClaimRequest::new(&key, token, None, Duration::from_secs(1));
    assert_eq!(store.claim(&claim(&first)).await.unwrap(), Claim::Claimed);
    assert!(matches!(store.claim(&claim(&second)).await.unwrap(), Claim::InProgress { .. }));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(store.claim(&claim(&second)).await.unwrap(), Claim::Claimed, "the 1 s lease ended 4 s ago");
}

/// A claim that says when it was sent is counted from then, as its caller counts it, and it
/// judges the entries it meets at that moment too: one that ends between the send and the step
/// still counts as live for it.
#[tokio::test(start_paused = true)]
async fn memory_claim_counts_its_lease_from_when_it_was_sent() {
    use std::time::Duration;

    use idempotent_runtime::{Claim, ClaimRequest, Key, Token};
    use tokio::time::Instant;

    let store = MemoryStore::new();
    let key = Key::new("sent", &"k").unwrap();
    let (first, second, third) = (Token::new(), Token::new(), Token::new());
    let lease = Duration::from_secs(60);
    let sent = Instant::now();
    tokio::time::sleep(Duration::from_secs(40)).await;
    let claim = ClaimRequest::new(&key, &first, None, lease).sent_at(sent);
    assert_eq!(store.claim(&claim).await.unwrap(), Claim::Claimed);
    // 59 s after the send the claim is live, with 1 s left; 61 s after it, it has ended (a lease
    // counted from the store's step would last until 100 s).
    tokio::time::sleep(Duration::from_secs(19)).await;
    let Claim::InProgress { lease_remaining, .. } =
        store.claim(&ClaimRequest::new(&key, &second, None, lease)).await.unwrap()
    else {
        panic!("the first claim's lease runs until 60 s after its send");
    };
    assert_eq!(lease_remaining, Some(Duration::from_secs(1)));
    tokio::time::sleep(Duration::from_secs(2)).await;
    // A claim sent before the end and reaching the store after it still finds the key held.
    let late = ClaimRequest::new(&key, &third, None, lease).sent_at(Instant::now() - Duration::from_secs(2));
    assert!(matches!(store.claim(&late).await.unwrap(), Claim::InProgress { .. }));
    assert_eq!(store.claim(&ClaimRequest::new(&key, &second, None, lease)).await.unwrap(), Claim::Claimed);
}

mod bounded {
    use std::time::Duration;

    use idempotent_runtime::stores::memory::{MemoryLimits, WhenFull};
    use idempotent_runtime::{Call, Claim, ClaimRequest, Error, Key, MemoryStore, Store, StoreError, Token};

    async fn run(store: &MemoryStore, key: u32, retention: Duration) -> Result<u32, Error> {
        Call::new("bounded", &key)
            .lease(retention.min(Duration::from_secs(60)))
            .retention(retention)
            .run(store, async move { Ok::<_, Error>(key) })
            .await
    }

    fn full(result: &Result<u32, Error>) -> bool {
        matches!(result, Err(Error::Store { operation: "claim", source: StoreError::Full(_), .. }))
    }

    /// Full by entries: a new key is refused with a typed error, nothing stored is forgotten, the
    /// keys it holds keep replaying, and a claim in progress keeps its claim.
    #[tokio::test]
    async fn memory_store_full_refuses_new_keys_and_forgets_nothing() {
        let store = MemoryStore::with_limits(MemoryLimits::default().max_entries(100));
        for k in 0..99 {
            assert_eq!(run(&store, k, Duration::from_secs(60)).await.unwrap(), k);
        }
        let key = Key::new("bounded", &"running").unwrap();
        let owner = Token::new();
        assert_eq!(
            store.claim(&ClaimRequest::new(&key, &owner, None, Duration::from_secs(60))).await.unwrap(),
            Claim::Claimed
        );
        assert_eq!(store.len(), 100);
        let refused = run(&store, 1000, Duration::from_secs(60)).await;
        assert!(full(&refused), "{refused:?}");
        let message = refused.unwrap_err().to_string();
        assert!(message.contains("full") && message.contains("100 entries"), "{message}");
        for k in 0..99 {
            assert_eq!(run(&store, k, Duration::from_secs(60)).await.unwrap(), k, "key {k} still replays");
        }
        assert!(matches!(
            store.claim(&ClaimRequest::new(&key, &Token::new(), None, Duration::from_secs(60))).await.unwrap(),
            Claim::InProgress { .. }
        ));
        assert_eq!(store.len(), 100);
    }

    /// Full by bytes: each entry is charged its key, its outcome and 400 bytes.
    #[tokio::test]
    async fn memory_store_full_by_bytes_refuses_new_keys() {
        let store = MemoryStore::with_limits(MemoryLimits::default().max_bytes(64 * 1024));
        let big = |k: u32| Call::new("bytes", &k).run(&store, async move { Ok::<_, Error>("x".repeat(4000)) });
        let mut admitted = 0;
        while big(admitted).await.is_ok() {
            admitted += 1;
            assert!(admitted < 100, "the byte bound did not hold");
        }
        assert!((12..=15).contains(&admitted), "{admitted} records of ~4.4 KB in 64 KiB");
        assert!(store.bytes() <= 64 * 1024 + 4400, "{} bytes charged", store.bytes());
        assert!(matches!(big(0).await, Ok(s) if s.len() == 4000), "a stored record still replays");
    }

    /// Expired entries make room before anything is refused, on the paused clock too.
    #[tokio::test(start_paused = true)]
    async fn memory_store_full_of_expired_entries_admits_new_keys() {
        let store = MemoryStore::with_limits(MemoryLimits::default().max_entries(50));
        for k in 0..50 {
            run(&store, k, Duration::from_secs(2)).await.unwrap();
        }
        assert!(full(&run(&store, 50, Duration::from_secs(2)).await));
        tokio::time::sleep(Duration::from_secs(3)).await;
        for k in 50..100 {
            assert_eq!(run(&store, k, Duration::from_secs(60)).await.unwrap(), k, "key {k} after the others expired");
        }
        assert!(store.len() <= 50, "{}", store.len());
    }

    /// With `EvictOldestCompleted`, the records that expire first make room; claims in progress
    /// are never evicted, and an evicted key runs again (the documented cost).
    #[tokio::test]
    async fn memory_store_evicts_the_oldest_completed_records_when_asked() {
        let limits = MemoryLimits::default().max_entries(64).when_full(WhenFull::EvictOldestCompleted);
        let store = MemoryStore::with_limits(limits);
        let key = Key::new("bounded", &"running").unwrap();
        let owner = Token::new();
        assert_eq!(
            store.claim(&ClaimRequest::new(&key, &owner, None, Duration::from_secs(60))).await.unwrap(),
            Claim::Claimed
        );
        for k in 0..1000 {
            // Increasing retentions: the first keys expire first, so they are evicted first.
            run(&store, k, Duration::from_secs(60 + u64::from(k))).await.unwrap();
            assert!(store.len() <= 64, "{} entries", store.len());
        }
        assert!(
            matches!(
                store.claim(&ClaimRequest::new(&key, &Token::new(), None, Duration::from_secs(60))).await.unwrap(),
                Claim::InProgress { .. }
            ),
            "the claim in progress survived every eviction"
        );
        let latest = Call::new("bounded", &999u32).run(&store, async { Ok::<u32, Error>(7) }).await.unwrap();
        assert_eq!(latest, 999, "the newest record is replayed");
        let evicted = Call::new("bounded", &0u32).run(&store, async { Ok::<u32, Error>(7) }).await.unwrap();
        assert_eq!(evicted, 7, "the oldest record was evicted: its key ran again");
    }

    /// The counters follow every change: claims, completions, releases, sweeps, purges.
    #[tokio::test(start_paused = true)]
    async fn memory_store_counts_entries_and_bytes_exactly() {
        let store = MemoryStore::new();
        assert_eq!((store.len(), store.bytes()), (0, 0));
        run(&store, 1, Duration::from_secs(10)).await.unwrap();
        let one = store.bytes();
        assert!(one > 400, "{one}");
        let _ = Call::new("bounded", &2u32).run(&store, async { Err::<u32, _>(Error::Fingerprint("x".into())) }).await;
        assert_eq!((store.len(), store.bytes()), (1, one), "a released claim is gone from the counters");
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert_eq!(store.purge_expired().await.unwrap(), 1);
        assert_eq!((store.len(), store.bytes()), (0, 0));
    }
}

/// A claim whose reply arrives after its lease has ended must not start the body: by then another
/// caller may hold the key and be running it. Found by the simulation (issue 21's report): the
/// late reply started a second body beside the new owner's.
#[tokio::test(start_paused = true)]
async fn memory_claim_answered_after_its_lease_does_not_start_the_body() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
    use std::time::Duration;

    use idempotent_runtime::{Call, Claim, ClaimRequest, Error, StoreError};

    /// The memory store, whose first claim is applied at once but answered `lease + 10 ms` later.
    struct LateFirstReply {
        inner: MemoryStore,
        delayed: AtomicBool,
    }
    impl Store for LateFirstReply {
        async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
            let claim = self.inner.claim(request).await;
            if !self.delayed.swap(true, SeqCst) {
                tokio::time::sleep(request.lease + Duration::from_millis(10)).await;
            }
            claim
        }
        idempotent_runtime::forward_store!(direct LateFirstReply::inner; complete release extend detach);
    }
    impl LateFirstReply {
        fn inner(&self) -> &MemoryStore {
            &self.inner
        }
    }

    let store = LateFirstReply { inner: MemoryStore::new(), delayed: AtomicBool::new(false) };
    let lease = Duration::from_millis(300);
    let (running, bodies, overlaps) = (AtomicBool::new(false), AtomicU32::new(0), AtomicU32::new(0));
    let call = |delay: Duration| {
        let (running, bodies, overlaps, store) = (&running, &bodies, &overlaps, &store);
        async move {
            tokio::time::sleep(delay).await;
            Call::new("late-claim-reply", &"k")
                .lease(lease)
                .run(store, async move {
                    bodies.fetch_add(1, SeqCst);
                    if running.swap(true, SeqCst) {
                        overlaps.fetch_add(1, SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    running.store(false, SeqCst);
                    Ok::<_, Error>(7)
                })
                .await
        }
    };
    // The first caller's claim lands at 0 ms and its reply at 310 ms; the second claims the
    // expired key at 301 ms and runs its body until 401 ms.
    let (late, second) = tokio::join!(call(Duration::ZERO), call(lease + Duration::from_millis(1)));
    assert_eq!(second.unwrap(), 7);
    assert_eq!(overlaps.load(SeqCst), 0, "two bodies of one key ran at once");
    assert_eq!(bodies.load(SeqCst), 1, "the late claim reply started a second body");
    assert!(matches!(late, Err(Error::InProgress { .. })), "{late:?}");
}

/// README: a claim answered after its lease is renewed before the body starts, and the call gives
/// up with `Error::Store` after three lapsed or late renewals, without running the body. Here
/// every claim and every renewal is answered `lease + 10 ms` after it was applied.
#[tokio::test(start_paused = true)]
async fn memory_a_call_whose_claims_and_renewals_are_all_late_gives_up_without_running() {
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    use std::time::Duration;

    use idempotent_runtime::{Call, Claim, ClaimRequest, Error, Key, StoreError, Token};

    struct AlwaysLate {
        inner: MemoryStore,
        claims: AtomicU32,
        renewals: AtomicU32,
    }
    impl Store for AlwaysLate {
        async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
            self.claims.fetch_add(1, SeqCst);
            let claim = self.inner.claim(request).await;
            tokio::time::sleep(request.lease + Duration::from_millis(10)).await;
            claim
        }
        async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
            self.renewals.fetch_add(1, SeqCst);
            let renewed = self.inner.extend(key, token, lease).await;
            tokio::time::sleep(lease + Duration::from_millis(10)).await;
            renewed
        }
        idempotent_runtime::forward_store!(direct AlwaysLate::inner; complete release detach);
    }
    impl AlwaysLate {
        fn inner(&self) -> &MemoryStore {
            &self.inner
        }
    }

    let store = AlwaysLate { inner: MemoryStore::new(), claims: AtomicU32::new(0), renewals: AtomicU32::new(0) };
    let bodies = AtomicU32::new(0);
    let result = Call::new("always-late", &"k")
        .lease(Duration::from_millis(300))
        .run(&store, async {
            bodies.fetch_add(1, SeqCst);
            Ok::<_, Error>(7)
        })
        .await;
    assert!(
        matches!(&result, Err(Error::Store { source, .. }) if source.to_string().contains("answered after its lease")),
        "{result:?}"
    );
    assert_eq!(bodies.load(SeqCst), 0, "the body ran on a claim it could not count on");
    assert_eq!((store.claims.load(SeqCst), store.renewals.load(SeqCst)), (3, 3), "claims and renewals sent");
}

/// The memory store whose completions fail, as a backend error would, while `failing` is set.
struct FailingCompletions {
    inner: MemoryStore,
    failing: std::sync::atomic::AtomicBool,
}

impl Store for FailingCompletions {
    async fn complete(
        &self,
        completion: &idempotent_runtime::Completion<'_>,
    ) -> Result<(), idempotent_runtime::StoreError> {
        if self.failing.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(idempotent_runtime::StoreError::backend("failing-completions", "the completion failed"));
        }
        self.inner.complete(completion).await
    }
    idempotent_runtime::forward_store!(direct FailingCompletions::inner; claim release extend detach);
}

impl FailingCompletions {
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }
}

/// The renewals while recording are capped: a store that accepts renewals but keeps failing
/// completions blocks the key for at most one lease after the body ended plus the lease itself.
/// Then the caller gets its result (unrecorded, logged) and the key frees itself.
#[tokio::test(start_paused = true)]
async fn memory_renewals_while_recording_stop_one_lease_after_the_body() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
    use std::time::Duration;

    use idempotent_runtime::{Call, Error};
    use tokio::time::Instant;

    let lease = Duration::from_millis(300);
    let store = FailingCompletions { inner: MemoryStore::new(), failing: AtomicBool::new(true) };
    let bodies = AtomicU32::new(0);
    let call = || {
        Call::new("failing-completions", &"k").lease(lease).run(&store, async {
            bodies.fetch_add(1, SeqCst);
            Ok::<_, Error>(7)
        })
    };
    let start = Instant::now();
    assert_eq!(call().await.unwrap(), 7, "the caller gets its result, though it was not recorded");
    let gave_up = start.elapsed();
    assert!(gave_up <= lease * 2, "the caller kept the key for {gave_up:?}, over two leases");
    assert!(gave_up > lease, "the completion was retried for only {gave_up:?}, not past the first lease");
    // The last renewal's lease has ended by two leases after the body: the key is free again.
    tokio::time::sleep_until(start + lease * 2 + Duration::from_millis(1)).await;
    store.failing.store(false, SeqCst);
    assert_eq!(call().await.unwrap(), 7);
    assert_eq!(bodies.load(SeqCst), 2, "the unrecorded result's key was taken over after its lease");
}

/// The memory store behind a wrapper whose first completion hangs (its caller is dropped while it
/// is in flight), whose next two fail as a backend error would, and which finishes detached steps
/// itself, so that the completion finished in the background meets those failures.
#[derive(Clone)]
struct StalledThenFailing {
    inner: MemoryStore,
    attempts: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl Store for StalledThenFailing {
    async fn complete(
        &self,
        completion: &idempotent_runtime::Completion<'_>,
    ) -> Result<(), idempotent_runtime::StoreError> {
        match self.attempts.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => tokio::time::sleep(std::time::Duration::from_secs(60)).await,
            1 | 2 => {
                return Err(idempotent_runtime::StoreError::backend("stalled-then-failing", "the completion failed"));
            }
            _ => {}
        }
        self.inner.complete(completion).await
    }

    fn detach(&self, step: idempotent_runtime::Detached) {
        idempotent_runtime::stores::spawn_detached(self.clone(), step);
    }

    idempotent_runtime::forward_store!(direct StalledThenFailing::inner; claim release extend);
}

impl StalledThenFailing {
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }
}

/// A completion left to the background after the renewals' cap (the end of the lease the claim
/// held when its body ended) sends no renewal, but its claim, renewed until then, still lives for
/// up to a lease after it: the completion is retried while it may, and lands. A 300 ms lease: the
/// body ends at once, the call renews at 100 and 200 ms (the claim lives until 500 ms), stops at
/// the cap (300 ms), and is dropped at 320 ms; the background completion fails twice, then lands.
#[tokio::test(start_paused = true)]
async fn memory_a_completion_detached_after_the_renewals_cap_is_retried_while_its_claim_lives() {
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    use std::time::Duration;

    use idempotent_runtime::{Call, Error};

    let lease = Duration::from_millis(300);
    let store = StalledThenFailing { inner: MemoryStore::new(), attempts: std::sync::Arc::default() };
    let bodies = AtomicU32::new(0);
    let call = || {
        Call::new("stalled-then-failing", &"k").lease(lease).run(&store, async {
            bodies.fetch_add(1, SeqCst);
            Ok::<_, Error>(7)
        })
    };
    assert!(tokio::time::timeout(Duration::from_millis(320), call()).await.is_err(), "dropped while recording");
    // Past every lease the claim could have had (500 ms) and the completions' retries.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(store.attempts.load(SeqCst), 4, "the hung completion, two failures in the background, then the record");
    assert_eq!(call().await.unwrap(), 7);
    assert_eq!(bodies.load(SeqCst), 1, "the result recorded in the background is replayed, not run again");
}

/// A call whose task panics elsewhere (the other branch of a `join!`) is dropped, while its body
/// waits, by the panic's unwinding: the body was cancelled, it did not panic. Under
/// `OnCancel::Keep` (the default) its claim stays for the lease, so a retry at once finds it in
/// progress and does not run the body while the first body's charge may still land.
#[tokio::test(start_paused = true)]
async fn memory_a_call_dropped_by_another_futures_panic_keeps_its_claim() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    use std::time::Duration;

    use idempotent_runtime::{Call, Error};

    let store = Arc::new(MemoryStore::new());
    let runs = Arc::new(AtomicU32::new(0));
    let charge = |store: Arc<MemoryStore>, runs: Arc<AtomicU32>| async move {
        Call::new("sibling-panic", "order-1")
            .run(&*store, async {
                runs.fetch_add(1, SeqCst);
                // The charge is sent; its answer takes a while.
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok::<_, Error>(1)
            })
            .await
    };
    let first = charge(store.clone(), runs.clone());
    let task = tokio::spawn(async move {
        let sibling = async {
            tokio::task::yield_now().await;
            panic!("another branch of the handler panics (planted)");
        };
        let ((), _) = tokio::join!(sibling, first);
    });
    assert!(task.await.unwrap_err().is_panic());
    assert_eq!(runs.load(SeqCst), 1, "the first body started before the panic");
    let retry = charge(store.clone(), runs.clone()).await;
    assert!(matches!(retry, Err(Error::InProgress { .. })), "a retry at once: {retry:?}");
    assert_eq!(runs.load(SeqCst), 1, "the body ran again while the first one's charge was in flight");
}

/// The memory store, each release of which takes as long as a slow remote store's round trip.
struct SlowRelease {
    inner: MemoryStore,
    delay: std::time::Duration,
}

impl SlowRelease {
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }
}

impl Store for SlowRelease {
    idempotent_runtime::forward_store!(direct SlowRelease::inner; claim complete extend detach);

    async fn release(
        &self,
        key: &idempotent_runtime::Key,
        token: &idempotent_runtime::Token,
    ) -> Result<(), idempotent_runtime::StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.release(key, token).await
    }
}

/// A body that handled a failed step and returned `Ok` has finished: a call dropped after that
/// (here while the failed step's key is being released) has its result recorded in the
/// background, as any call dropped while recording, and the body never runs again.
#[tokio::test(start_paused = true)]
async fn memory_a_call_dropped_after_its_body_ended_while_a_failed_step_is_released_is_recorded() {
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    use std::time::Duration;

    use idempotent_runtime::{Call, Error, step};

    let store = SlowRelease { inner: MemoryStore::new(), delay: Duration::from_secs(1) };
    let orders = AtomicU32::new(0);
    let order = || {
        Call::new("drained", "order-2").run(&store, async {
            // The quote fails; the body goes on with a default (the step's key is released).
            let quote = step("quote", async { Err::<u32, Error>(Error::Fingerprint("no quote (planted)".into())) });
            let price = quote.await.unwrap_or(7);
            orders.fetch_add(1, SeqCst);
            Ok::<_, Error>(price)
        })
    };
    // The caller gives up after 500 ms: the body has ended, the step's release is in flight.
    assert!(tokio::time::timeout(Duration::from_millis(500), order()).await.is_err());
    assert_eq!(orders.load(SeqCst), 1, "the body ended before the drop");
    // Past the call's lease (60 s), a retry.
    tokio::time::sleep(Duration::from_secs(61)).await;
    assert_eq!(order().await.unwrap(), 7);
    assert_eq!(orders.load(SeqCst), 1, "the order was placed again: the finished body's result was not recorded");
}

/// Runs `retry` on the paused clock and checks that it did not wait for a step's claim that
/// nobody holds (such a claim is waited out for its lease, 60 s by default): `what` names that
/// claim.
async fn at_once<T>(retry: impl std::future::Future<Output = T>, what: &str) -> T {
    let started = tokio::time::Instant::now();
    let output = retry.await;
    let waited = started.elapsed();
    assert!(waited < std::time::Duration::from_secs(1), "the retry's step waited {waited:?} for {what}");
    output
}

/// A step dropped before its lookup was answered (a zero budget for it; a `select!`) frees its
/// key, as a step dropped later does: the next run of the body does not wait for a claim that
/// nobody will record or renew.
#[tokio::test(start_paused = true)]
async fn memory_a_step_dropped_before_its_lookup_leaves_no_claim_behind() {
    use std::time::Duration;

    use idempotent_runtime::{Call, Error, step};

    let store = MemoryStore::new();
    let run = |budget: Option<Duration>| {
        Call::new("dropped-step", "order-3").run(&store, async move {
            let quote = step("quote", async { Ok::<u32, Error>(5) });
            match budget {
                Some(budget) => match tokio::time::timeout(budget, quote).await {
                    Ok(quote) => quote,
                    Err(_) => Err(Error::Fingerprint("no quote in time (planted)".into())),
                },
                None => quote.await,
            }
        })
    };
    assert!(run(Some(Duration::ZERO)).await.is_err(), "the first run gave up on its step");
    assert_eq!(at_once(run(None), "a claim left by a step that was dropped").await.unwrap(), 5);
}

/// A step whose body panics frees its key with the call's: the panic releases the call's key,
/// and the retry runs the step at once instead of waiting out the step's claim (one lease, 60 s)
/// inside it.
#[tokio::test(start_paused = true)]
async fn memory_a_step_that_panics_leaves_no_claim_behind() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};

    use idempotent_runtime::{Call, Error, step};

    let store = Arc::new(MemoryStore::new());
    let quotes = Arc::new(AtomicU32::new(0));
    let order = |store: Arc<MemoryStore>, quotes: Arc<AtomicU32>| async move {
        Call::new("panicking-step", "order-4")
            .run(&*store, async {
                step("quote", async {
                    assert!(quotes.fetch_add(1, SeqCst) > 0, "the quote service's client panics (planted)");
                    Ok::<u32, Error>(5)
                })
                .await
            })
            .await
    };
    let first = tokio::spawn(order(store.clone(), quotes.clone()));
    assert!(first.await.unwrap_err().is_panic());
    assert_eq!(at_once(order(store, quotes.clone()), "the claim of a step that panicked").await.unwrap(), 5);
    assert_eq!(quotes.load(SeqCst), 2, "the step's body ran again, once");
}

/// A call dropped under `OnCancel::Release` while a step's body runs releases the step's key with
/// its own: the retry the release allows runs the step at once, not after the step's lease.
#[tokio::test(start_paused = true)]
async fn memory_a_call_released_on_cancel_while_a_step_runs_leaves_no_claim_behind() {
    use std::time::Duration;

    use idempotent_runtime::{Call, Error, OnCancel, step};

    let store = MemoryStore::new();
    let order = |slow: bool| {
        Call::new("cancelled-step", "order-5").on_cancel(OnCancel::Release).run(&store, async move {
            step("quote", async move {
                if slow {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                }
                Ok::<u32, Error>(5)
            })
            .await
        })
    };
    assert!(tokio::time::timeout(Duration::from_millis(100), order(true)).await.is_err(), "cancelled in the step");
    assert_eq!(at_once(order(false), "the claim of a step whose call was cancelled").await.unwrap(), 5);
}

/// A call dropped while it frees the key of a step that failed (its body returned that step's
/// `Err`, so the call releases its own key next) frees the step's key too: the retry runs the
/// step at once. The step's release was in flight when the drop came; here each release takes a
/// second, and the caller gives up after half of one.
#[tokio::test(start_paused = true)]
async fn memory_a_call_dropped_while_a_failed_steps_key_is_released_leaves_no_claim_behind() {
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    use std::time::Duration;

    use idempotent_runtime::{Call, Error, step};

    let store = SlowRelease { inner: MemoryStore::new(), delay: Duration::from_secs(1) };
    let quotes = AtomicU32::new(0);
    let order = || {
        Call::new("dropped-releasing", "order-6").run(&store, async {
            step("quote", async {
                if quotes.fetch_add(1, SeqCst) == 0 {
                    return Err(Error::Fingerprint("no quote (planted)".into()));
                }
                Ok::<u32, Error>(5)
            })
            .await
        })
    };
    assert!(tokio::time::timeout(Duration::from_millis(500), order()).await.is_err(), "dropped while releasing");
    assert_eq!(at_once(order(), "the claim of a step whose release was dropped").await.unwrap(), 5);
    assert_eq!(quotes.load(SeqCst), 2, "the step's body ran again, once");
}

/// The memory store, whose `slow`-th claim (counted from 1) is answered `delay` after it landed,
/// as a slow network would answer it, or with an error if `lost` (its answer was lost: a timeout).
struct SlowClaimReply {
    inner: MemoryStore,
    claims: std::sync::atomic::AtomicU32,
    slow: u32,
    delay: std::time::Duration,
    lost: bool,
}

impl SlowClaimReply {
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }
}

impl Store for SlowClaimReply {
    idempotent_runtime::forward_store!(direct SlowClaimReply::inner; complete release extend detach);

    async fn claim(
        &self,
        request: &idempotent_runtime::ClaimRequest<'_>,
    ) -> Result<idempotent_runtime::Claim, idempotent_runtime::StoreError> {
        let claim = self.inner.claim(request).await;
        if self.claims.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == self.slow {
            tokio::time::sleep(self.delay).await;
            if self.lost {
                return Err(idempotent_runtime::StoreError::backend("slow-claim-reply", "the answer was lost"));
            }
        }
        claim
    }
}

/// A call dropped under `OnCancel::Release` while its step's lookup is in flight (the lookup's
/// claim of the step's key has landed, its answer has not) frees the step's key with its own.
#[tokio::test(start_paused = true)]
async fn memory_a_call_released_on_cancel_during_a_steps_lookup_leaves_no_claim_behind() {
    use std::time::Duration;

    use idempotent_runtime::{Call, Error, OnCancel, step};

    // Claim 1 is the call's, claim 2 its step's lookup.
    let store = SlowClaimReply {
        inner: MemoryStore::new(),
        claims: 0.into(),
        slow: 2,
        delay: Duration::from_secs(1),
        lost: false,
    };
    let order = || {
        Call::new("dropped-lookup", "order-7")
            .on_cancel(OnCancel::Release)
            .run(&store, async { step("quote", async { Ok::<u32, Error>(5) }).await })
    };
    assert!(tokio::time::timeout(Duration::from_millis(500), order()).await.is_err(), "dropped in the lookup");
    assert_eq!(at_once(order(), "the claim of a lookup whose call was dropped").await.unwrap(), 5);
}

/// A step whose lookup failed after its claim of the step's key had landed (the store's answer
/// was lost) frees that key: the body gets the step's error and returns it, the call releases its
/// own key, and the retry runs the step at once.
#[tokio::test(start_paused = true)]
async fn memory_a_step_whose_lookup_failed_after_claiming_leaves_no_claim_behind() {
    use std::time::Duration;

    use idempotent_runtime::{Call, Error, step};

    // Claim 1 is the call's, claim 2 its step's lookup: it lands, and its answer is an error.
    let store = SlowClaimReply {
        inner: MemoryStore::new(),
        claims: 0.into(),
        slow: 2,
        delay: Duration::from_millis(10),
        lost: true,
    };
    let order = || {
        Call::new("failed-lookup", "order-8").run(&store, async { step("quote", async { Ok::<u32, Error>(5) }).await })
    };
    let first = order().await;
    assert!(matches!(first, Err(Error::Store { operation: "step", .. })), "the lookup's error: {first:?}");
    assert_eq!(at_once(order(), "the claim of a lookup that failed").await.unwrap(), 5);
}

/// A call dropped under `OnCancel::Release` after its step's lookup was answered but before the
/// step read the answer (a zero deadline: the call is polled once, and in that poll the lookup
/// claims the step's key and sends its answer) frees the step's key. Found by
/// `simulation_memory_steps_under_faults` (seed 32152127374533).
#[tokio::test(start_paused = true)]
async fn memory_a_call_released_on_cancel_before_its_step_read_the_lookup_leaves_no_claim_behind() {
    use std::time::Duration;

    use idempotent_runtime::{Call, Error, OnCancel, step};

    let store = MemoryStore::new();
    let order = || {
        Call::new("unread-lookup", "order-9")
            .on_cancel(OnCancel::Release)
            .run(&store, async { step("quote", async { Ok::<u32, Error>(5) }).await })
    };
    assert!(tokio::time::timeout(Duration::ZERO, order()).await.is_err(), "dropped after one poll");
    assert_eq!(at_once(order(), "the claim of a lookup its step never read").await.unwrap(), 5);
}

/// The memory store behind a partition that, while `cut` is set, fails every request of the
/// token that claimed first (its call and its steps) before the store gets it; other callers'
/// requests go through. The first token's later claims (its steps' lookups) and its renewals
/// are applied at once, and their replies come back `slow_lookups` and `slow_renewals` later.
struct CutOff {
    inner: MemoryStore,
    cut: std::sync::atomic::AtomicBool,
    first: std::sync::Mutex<Option<idempotent_runtime::Token>>,
    slow_lookups: std::time::Duration,
    slow_renewals: std::time::Duration,
    first_claims: std::sync::atomic::AtomicU32,
}

impl CutOff {
    /// A fresh memory store, reachable until `cut` is set, its first token's lookups answered
    /// `slow_lookups` late and its renewals `slow_renewals` late.
    fn new(slow_lookups: std::time::Duration, slow_renewals: std::time::Duration) -> Self {
        CutOff {
            inner: MemoryStore::new(),
            cut: std::sync::atomic::AtomicBool::new(false),
            first: std::sync::Mutex::default(),
            slow_lookups,
            slow_renewals,
            first_claims: std::sync::atomic::AtomicU32::new(0),
        }
    }

    fn is_first(&self, token: &idempotent_runtime::Token) -> bool {
        self.first.lock().unwrap().as_ref() == Some(token)
    }

    fn inner(&self) -> &MemoryStore {
        &self.inner
    }

    fn check(&self, token: &idempotent_runtime::Token) -> Result<(), idempotent_runtime::StoreError> {
        let first = self.first.lock().unwrap().get_or_insert_with(|| token.clone()).clone();
        if self.cut.load(std::sync::atomic::Ordering::SeqCst) && first == *token {
            return Err(idempotent_runtime::StoreError::backend("cut-off", "the store is unreachable"));
        }
        Ok(())
    }
}

impl Store for CutOff {
    async fn claim(
        &self,
        request: &idempotent_runtime::ClaimRequest<'_>,
    ) -> Result<idempotent_runtime::Claim, idempotent_runtime::StoreError> {
        self.check(request.token)?;
        let claim = self.inner.claim(request).await;
        if self.is_first(request.token) && self.first_claims.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 {
            tokio::time::sleep(self.slow_lookups).await;
        }
        claim
    }

    async fn complete(
        &self,
        completion: &idempotent_runtime::Completion<'_>,
    ) -> Result<(), idempotent_runtime::StoreError> {
        self.check(completion.token)?;
        self.inner.complete(completion).await
    }

    async fn release(
        &self,
        key: &idempotent_runtime::Key,
        token: &idempotent_runtime::Token,
    ) -> Result<(), idempotent_runtime::StoreError> {
        self.check(token)?;
        self.inner.release(key, token).await
    }

    async fn extend(
        &self,
        key: &idempotent_runtime::Key,
        token: &idempotent_runtime::Token,
        lease: std::time::Duration,
    ) -> Result<(), idempotent_runtime::StoreError> {
        self.check(token)?;
        let renewed = self.inner.extend(key, token, lease).await;
        if self.is_first(token) {
            tokio::time::sleep(self.slow_renewals).await;
        }
        renewed
    }

    idempotent_runtime::forward_store!(direct CutOff::inner; detach);
}

/// A call cut off from the store while its body works loses its claim when the lease ends, and
/// a duplicate takes the key over and records its own result. When the store is reachable again,
/// the first body, still running, comes to a step it has not run: the step does not run (its
/// call gets `LeaseLost`). Before, the step's lookup claimed the step's key, which nobody held,
/// and ran the step after the operation's result had been recorded by another caller; only the
/// step's record was fenced. Found by the step exploration with overlapping duplicates
/// (2026-12-06).
#[tokio::test(start_paused = true)]
async fn memory_a_step_started_after_its_call_was_taken_over_does_not_run() {
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    use std::time::Duration;

    use idempotent_runtime::{Call, Error, step};

    let lease = Duration::from_millis(300);
    let store = CutOff::new(Duration::ZERO, Duration::ZERO);
    let (steps_run, bodies) = (AtomicU32::new(0), AtomicU32::new(0));
    let first = Call::new("cut-off", &"k").lease(lease).run(&store, async {
        bodies.fetch_add(1, SeqCst);
        store.cut.store(true, SeqCst);
        // Cut off for three leases: the renewals fail, the claim lapses, the duplicate takes over.
        tokio::time::sleep(lease * 3).await;
        store.cut.store(false, SeqCst);
        step("late", async {
            steps_run.fetch_add(1, SeqCst);
            Ok::<_, Error>(1)
        })
        .await
    });
    let duplicate = async {
        tokio::time::sleep(lease * 2).await;
        Call::new("cut-off", &"k")
            .lease(lease)
            .run(&store, async {
                bodies.fetch_add(1, SeqCst);
                Ok::<_, Error>(2)
            })
            .await
    };
    let (first, duplicate) = tokio::join!(first, duplicate);
    assert_eq!(duplicate.unwrap(), 2, "the duplicate took the lapsed key over and recorded its result");
    assert_eq!(bodies.load(SeqCst), 2);
    assert_eq!(steps_run.load(SeqCst), 0, "a step ran after another caller had taken the call over");
    assert!(matches!(first, Err(Error::LeaseLost { .. })), "{first:?}");
}

/// A step's lookup whose reply comes back after the call's lease has ended, the call's renewals
/// failing meanwhile: by the time the first body learns it may run the step, a duplicate has
/// taken the lapsed call over, run the step itself and recorded the call. The first body's step
/// does not run (its call gets `LeaseLost`). Before, the lease was checked only before the
/// lookup was sent, and the step ran a second time.
#[tokio::test(start_paused = true)]
async fn memory_a_step_whose_lookup_is_answered_after_a_takeover_does_not_run() {
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::Duration;

    use idempotent_runtime::Error;

    let lease = Duration::from_millis(300);
    let store = CutOff::new(lease * 2, Duration::ZERO);
    let counts = StepCounts::default();
    let order = || counts.order(&store, "slow-lookup", lease);
    let first = order();
    let duplicate = async {
        // The first call's lookup is on its way back: its renewals fail from now on, and its
        // claim lapses at the end of its first lease.
        tokio::time::sleep(Duration::from_millis(1)).await;
        store.cut.store(true, SeqCst);
        tokio::time::sleep(lease + Duration::from_millis(50)).await;
        let duplicate = order().await;
        // Reachable again before the first call's lookup is answered: its fence gets `NotOwner`.
        store.cut.store(false, SeqCst);
        duplicate
    };
    let (first, duplicate) = tokio::join!(first, duplicate);
    counts.assert_the_duplicate_alone_ran_the_step(duplicate);
    assert!(matches!(first, Err(Error::LeaseLost { .. })), "{first:?}");
}

/// A step's lookup answered after the call's lease ended is fenced, and the renewal that fences
/// it lands but is answered after a lease too: by then the claim it renewed has lapsed, and a
/// duplicate has taken the call over, run the step and recorded the call. The late renewal proves
/// nothing about now, so the first body's step does not run. Before, the fence counted any
/// acknowledged renewal, and the step ran a second time.
#[tokio::test(start_paused = true)]
async fn memory_a_step_fenced_by_a_renewal_answered_after_its_lease_does_not_run() {
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::Duration;

    let ms = Duration::from_millis;
    let lease = ms(300);
    // The lookup is answered at 350 ms, after the lease the claim started at 0; the fence then
    // sent renews the claim until 650 ms, and its answer comes at 800 ms.
    let store = CutOff::new(ms(350), ms(450));
    let counts = StepCounts::default();
    let order = || counts.order(&store, "late-fence", lease);
    let first = order();
    let duplicate = async {
        // Cut off just after the fence was sent: no renewal reaches the store after it.
        tokio::time::sleep(ms(351)).await;
        store.cut.store(true, SeqCst);
        // The claim lapses at 650 ms, and the duplicate takes it over.
        tokio::time::sleep(ms(310)).await;
        order().await
    };
    let (first, duplicate) = tokio::join!(first, duplicate);
    counts.assert_the_duplicate_alone_ran_the_step(duplicate);
    assert!(first.is_err(), "{first:?}");
}

/// What the two late-answer tests count: bodies started, and runs of their one step.
#[derive(Default)]
struct StepCounts {
    bodies: std::sync::atomic::AtomicU32,
    steps_run: std::sync::atomic::AtomicU32,
}

impl StepCounts {
    /// The order both callers make: a call on `scope`'s key `k` whose body runs one step,
    /// `charge`, which returns how many times it has run.
    async fn order(
        &self,
        store: &CutOff,
        scope: &str,
        lease: std::time::Duration,
    ) -> Result<u32, idempotent_runtime::Error> {
        use std::sync::atomic::Ordering::SeqCst;
        idempotent_runtime::Call::new(scope, &"k")
            .lease(lease)
            .run(store, async {
                self.bodies.fetch_add(1, SeqCst);
                let charge = async { Ok::<_, idempotent_runtime::Error>(self.steps_run.fetch_add(1, SeqCst) + 1) };
                idempotent_runtime::step("charge", charge).await
            })
            .await
    }

    /// Both bodies started, and the step ran once: the duplicate's.
    #[track_caller]
    fn assert_the_duplicate_alone_ran_the_step(&self, duplicate: Result<u32, idempotent_runtime::Error>) {
        use std::sync::atomic::Ordering::SeqCst;
        assert_eq!(duplicate.unwrap(), 1, "the duplicate took the lapsed key over and ran the step");
        assert_eq!(self.bodies.load(SeqCst), 2);
        assert_eq!(self.steps_run.load(SeqCst), 1, "the step ran again after another caller had taken the call over");
    }
}
