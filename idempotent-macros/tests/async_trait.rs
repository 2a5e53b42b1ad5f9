//! `#[idempotent]` on `#[async_trait]` methods keeps its guarantee when called through `dyn`:
//! of 64 concurrent duplicates, exactly one runs the body.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use async_trait::async_trait;
use idempotent_runtime::{Error, MemoryStore, idempotent};
use tokio::sync::{Barrier, Semaphore, mpsc};

const DUPLICATES: usize = 64;

#[async_trait]
trait Payments: Send + Sync {
    fn store(&self) -> &MemoryStore;
    fn runs(&self) -> &AtomicU32;

    /// A default method: waits for the running duplicate and replays its result.
    #[idempotent(key = key, store = self.store(), fingerprint = amount, wait = "30s")]
    async fn pay_waiting(&self, key: &str, amount: i64) -> Result<u32, Error> {
        Ok(self.runs().fetch_add(1, Ordering::SeqCst) + 1)
    }

    async fn pay(&self, key: &str, amount: i64) -> Result<u32, Error>;
}

struct Provider {
    store: MemoryStore,
    runs: AtomicU32,
    /// The body holds here until the test lets it finish.
    gate: Semaphore,
}

#[async_trait]
impl Payments for Provider {
    fn store(&self) -> &MemoryStore {
        &self.store
    }

    fn runs(&self) -> &AtomicU32 {
        &self.runs
    }

    #[idempotent(key = key, store = self.store, fingerprint = amount)]
    async fn pay(&self, key: &str, amount: i64) -> Result<u32, Error> {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        self.gate.acquire().await.expect("the gate is never closed").forget();
        Ok(run)
    }
}

fn provider() -> Arc<Provider> {
    Arc::new(Provider { store: MemoryStore::new(), runs: AtomicU32::new(0), gate: Semaphore::new(0) })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_async_trait_dyn_concurrent_duplicates_run_the_body_once() {
    let provider = provider();
    let payments: Arc<dyn Payments> = provider.clone();
    let barrier = Arc::new(Barrier::new(DUPLICATES));
    let (done, mut results) = mpsc::unbounded_channel();
    for _ in 0..DUPLICATES {
        let (payments, barrier, done) = (payments.clone(), barrier.clone(), done.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            done.send(payments.pay("order-1", 100).await).expect("the test is listening");
        });
    }
    // The one body that runs is held at the gate, so the other 63 must all come back first,
    // each refused as in progress.
    for _ in 1..DUPLICATES {
        let result = results.recv().await.expect("a result");
        assert!(matches!(result, Err(Error::InProgress { .. })), "a duplicate ran or failed otherwise: {result:?}");
    }
    provider.gate.add_permits(1);
    assert_eq!(results.recv().await.expect("the running call").unwrap(), 1);
    assert_eq!(payments.pay("order-1", 100).await.unwrap(), 1, "a later retry replays");
    assert!(matches!(payments.pay("order-1", 5).await, Err(Error::FingerprintMismatch { .. })));
    assert_eq!(provider.runs.load(Ordering::SeqCst), 1, "the body must run exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_async_trait_dyn_default_method_duplicates_wait_for_one_result() {
    let provider = provider();
    let payments: Arc<dyn Payments> = provider.clone();
    let barrier = Arc::new(Barrier::new(DUPLICATES));
    let calls: Vec<_> = (0..DUPLICATES)
        .map(|_| {
            let (payments, barrier) = (payments.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                payments.pay_waiting("order-2", 7).await
            })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.expect("no panic").unwrap(), 1, "every duplicate gets the one result");
    }
    assert_eq!(provider.runs.load(Ordering::SeqCst), 1, "the body must run exactly once");
}
