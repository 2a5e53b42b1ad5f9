//! The memory store against the conformance suite, plus what is particular to it.

use idempotent_runtime::{MemoryStore, Store};

idempotent_tests::conformance_suite!(conformance_memory, async { Some(MemoryStore::new()) });

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
