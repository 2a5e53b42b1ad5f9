//! The memory store against the conformance suite, plus what is particular to it.

use idempotent_runtime::{MemoryStore, Store};

idempotent_tests::conformance_suite!(conformance_memory, async { Some(MemoryStore::new()) });

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
