//! `BatchingStore`: the conformance suite through it (memory, Redis here; the SQL stores in
//! `sql.rs`), and what is particular to it: concurrent steps reach the store as batches, a batch
//! that fails or panics fails its steps and not the queue, a caller dropped on the way leaves the
//! others' steps answered.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::stores::batching::BatchingStore;
use idempotent_runtime::{
    BatchAnswers, Call, Claim, ClaimRequest, Completion, Error, Key, MemoryStore, Store, StoreError, Token,
};
use tokio::sync::Semaphore;

idempotent_tests::conformance_suite!(conformance_batching_memory, async {
    Some(BatchingStore::new(MemoryStore::new()))
});

idempotent_tests::conformance_suite!(
    conformance_batching_memory_paused,
    async { Some(BatchingStore::new(MemoryStore::new())) },
    paused
);

#[cfg(feature = "redis")]
idempotent_tests::conformance_suite!(
    conformance_batching_redis,
    async {
        let url = idempotent_tests::services::redis_url("conformance_batching_redis")?;
        let prefix = format!("idempotent-test:{}:", uuid::Uuid::new_v4().simple());
        let store = idempotent_runtime::RedisStore::connect(&url).await.expect("connect to Redis");
        Some(BatchingStore::new(store.with_prefix(prefix).expect("valid prefix")))
    },
    self_expiring
);

/// A memory store that counts the steps it is sent, one by one and in batches, and can hold its
/// batches at a gate or panic in its next one.
#[derive(Default)]
struct Watched {
    inner: MemoryStore,
    single_claims: AtomicUsize,
    single_completions: AtomicUsize,
    claim_batches: Mutex<Vec<usize>>,
    completion_batches: Mutex<Vec<usize>>,
    /// Each batch of both steps: its claims and its completions.
    both_batches: Mutex<Vec<(usize, usize)>>,
    gate: Option<Arc<Semaphore>>,
    panic_next: AtomicBool,
}

impl Watched {
    fn inner(&self) -> &MemoryStore {
        &self.inner
    }

    /// Waits at the gate, if there is one, and panics if told to.
    async fn pass(&self) {
        if let Some(gate) = &self.gate {
            gate.acquire().await.expect("the gate stays open").forget();
        }
        assert!(!self.panic_next.swap(false, Ordering::SeqCst), "a store bug in its batch");
    }
}

impl Store for Watched {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.single_claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(request).await
    }

    async fn complete(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
        self.single_completions.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(completion).await
    }

    async fn claim_many(&self, requests: &[ClaimRequest<'_>]) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
        self.claim_batches.lock().unwrap().push(requests.len());
        self.pass().await;
        self.inner.claim_many(requests).await
    }

    async fn complete_many(&self, completions: &[Completion<'_>]) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        self.completion_batches.lock().unwrap().push(completions.len());
        self.pass().await;
        self.inner.complete_many(completions).await
    }

    /// Counted, then sent as the trait's default does: each non-empty half as its batch.
    async fn claim_and_complete_many(
        &self,
        requests: &[ClaimRequest<'_>],
        completions: &[Completion<'_>],
    ) -> (BatchAnswers<Claim>, BatchAnswers<()>) {
        self.both_batches.lock().unwrap().push((requests.len(), completions.len()));
        let claims = async { if requests.is_empty() { Ok(Vec::new()) } else { self.claim_many(requests).await } };
        let records =
            async { if completions.is_empty() { Ok(Vec::new()) } else { self.complete_many(completions).await } };
        futures_util::future::join(claims, records).await
    }

    idempotent_runtime::forward_store!(direct Watched::inner; release extend detach process_local);
}

/// Spawns `step` and returns its task once the task's first poll has run: a claim is then queued
/// (or sent), whatever the machine's load.
async fn spawn_polled<F>(step: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let (polled, first_poll) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut step = std::pin::pin!(step);
        let first = std::future::poll_fn(|cx| std::task::Poll::Ready(step.as_mut().poll(cx))).await;
        let _ = polled.send(());
        match first {
            std::task::Poll::Ready(output) => output,
            std::task::Poll::Pending => step.await,
        }
    });
    first_poll.await.expect("the task's first poll ran");
    task
}

/// Runs `calls` calls on distinct keys at once, in this task, and counts the bodies run.
async fn run_concurrently<S: Store>(store: &S, calls: u32) -> usize {
    let runs = AtomicUsize::new(0);
    let results = futures_util::future::join_all((0..calls).map(|k| {
        let runs = &runs;
        Call::new("batching", &k).run(store, async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(k)
        })
    }))
    .await;
    for (k, result) in (0..calls).zip(results) {
        assert_eq!(result.expect("the call succeeds"), k);
    }
    runs.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "current_thread")]
async fn memory_batching_sends_concurrent_steps_to_the_store_as_batches() {
    let store = BatchingStore::new(Watched::default());
    assert_eq!(run_concurrently(&store, 64).await, 64);
    let watched = store.inner();
    let (claims, completions) =
        (watched.claim_batches.lock().unwrap().clone(), watched.completion_batches.lock().unwrap().clone());
    assert_eq!(watched.single_claims.load(Ordering::SeqCst), 0, "no claim sent alone");
    assert_eq!(watched.single_completions.load(Ordering::SeqCst), 0, "no completion sent alone");
    assert_eq!(claims.iter().sum::<usize>(), 64, "every claim sent once: {claims:?}");
    assert_eq!(completions.iter().sum::<usize>(), 64, "every completion sent once: {completions:?}");
    // The first step of each kind goes at once, alone; the rest came while it was on its way.
    assert!(claims.len() <= 3, "64 concurrent claims in {} batches: {claims:?}", claims.len());
    assert!(completions.len() <= 3, "64 concurrent completions in {} batches: {completions:?}", completions.len());

    // Replays: one more batch of claims, answered from the records.
    assert_eq!(run_concurrently(&store, 64).await, 0, "no body runs again");
    let claims = watched.claim_batches.lock().unwrap().clone();
    assert_eq!(claims.iter().sum::<usize>(), 128);
}

/// Claims and completions that wait while a batch is on its way go to the store together, as one
/// `claim_and_complete_many` (on PostgreSQL one statement).
#[tokio::test(flavor = "current_thread")]
async fn memory_batching_sends_waiting_claims_and_completions_in_one_batch() {
    let gate = Arc::new(Semaphore::new(1));
    let store = Arc::new(BatchingStore::new(Watched { gate: Some(Arc::clone(&gate)), ..Watched::default() }));
    let keys: Vec<Key> = (0..3).map(|i| Key::new("both", &i).unwrap()).collect();
    let tokens: Vec<Token> = keys.iter().map(|_| Token::new()).collect();
    let lease = Duration::from_secs(30);
    let claim = |i: usize| {
        let (store, key, token) = (Arc::clone(&store), keys[i].clone(), tokens[i].clone());
        async move { store.claim(&ClaimRequest::new(&key, &token, None, lease)).await }
    };
    assert_eq!(claim(0).await.unwrap(), Claim::Claimed);
    // The gate is shut: this claim's batch waits on its way; the next two steps wait behind it.
    let held = spawn_polled(claim(1)).await;
    let completion = {
        let (store, key, token) = (Arc::clone(&store), keys[0].clone(), tokens[0].clone());
        spawn_polled(async move { store.complete(&Completion::new(&key, &token, None, b"{}", lease)).await }).await
    };
    let third = spawn_polled(claim(2)).await;
    gate.add_permits(8);
    assert_eq!(held.await.unwrap().unwrap(), Claim::Claimed);
    completion.await.unwrap().unwrap();
    assert_eq!(third.await.unwrap().unwrap(), Claim::Claimed);
    let batches = store.inner().both_batches.lock().unwrap().clone();
    assert_eq!(batches, [(1, 0), (1, 0), (1, 1)], "the completion and the claim that waited went as one batch");
}

#[tokio::test(flavor = "current_thread")]
async fn memory_batching_holds_a_batch_to_its_maximum_size() {
    let store = BatchingStore::new(Watched::default()).max_batch(8);
    assert_eq!(run_concurrently(&store, 40).await, 40);
    let claims = store.inner().claim_batches.lock().unwrap().clone();
    assert!(claims.iter().all(|&n| n <= 8), "{claims:?}");
    assert_eq!(claims.iter().sum::<usize>(), 40);
    assert!(claims.len() >= 5, "{claims:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn memory_batching_a_lone_step_is_sent_at_once() {
    // A step that finds no batch on its way waits for no company.
    let store = BatchingStore::new(Watched::default());
    for k in 0..3 {
        tokio::time::timeout(Duration::from_secs(5), Call::new("lone", &k).run(&store, async { Ok::<_, Error>(k) }))
            .await
            .expect("answered without waiting for other steps")
            .unwrap();
    }
    assert_eq!(*store.inner().claim_batches.lock().unwrap(), [1, 1, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_batching_a_batch_that_panics_fails_its_steps_and_the_next_batch_is_sent() {
    let store = BatchingStore::new(Watched::default());
    store.inner().panic_next.store(true, Ordering::SeqCst);
    let runs = AtomicUsize::new(0);
    let call = |k: u32| {
        let runs = &runs;
        Call::new("panicking", &k).run(&store, async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(k)
        })
    };
    let failed = call(1).await.expect_err("the batch panicked");
    assert!(
        matches!(&failed, Error::Store { operation: "claim", .. }) && failed.to_string().contains("panicked"),
        "{failed}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "no body runs on a failed claim");
    // The queue goes on: the next steps are sent and answered.
    assert_eq!(call(1).await.expect("claimed now"), 1);
    assert_eq!(call(2).await.expect("claimed now"), 2);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_batching_a_caller_dropped_on_the_way_leaves_the_other_steps_answered() {
    let gate = Arc::new(Semaphore::new(0));
    let store = Arc::new(BatchingStore::new(Watched { gate: Some(Arc::clone(&gate)), ..Watched::default() }));
    let (keys, tokens): (Vec<Key>, Vec<Token>) =
        (0..3).map(|k| (Key::new("dropped", &k).unwrap(), Token::new())).unzip();
    let claim = |i: usize| {
        let (store, key, token) = (Arc::clone(&store), keys[i].clone(), tokens[i].clone());
        spawn_polled(async move { store.claim(&ClaimRequest::new(&key, &token, None, Duration::from_secs(60))).await })
    };
    // The first claim goes alone and is held at the gate; the other two wait for it.
    let first = claim(0).await;
    while store.inner().claim_batches.lock().unwrap().is_empty() {
        tokio::task::yield_now().await;
    }
    let (second, third) = (claim(1).await, claim(2).await);
    first.abort();
    second.abort();
    gate.add_permits(2);
    let answer = tokio::time::timeout(Duration::from_secs(5), third).await.expect("answered").unwrap();
    assert_eq!(answer.unwrap(), Claim::Claimed);
    assert_eq!(*store.inner().claim_batches.lock().unwrap(), [1, 2]);
    // The dropped callers' claims were made: their keys are held by their tokens until their
    // leases end, as after a claim whose answer was lost.
    for (key, token) in keys.iter().zip(&tokens).take(2) {
        let other = Token::new();
        let found = store.inner().inner().claim(&ClaimRequest::new(key, &other, None, Duration::from_secs(60))).await;
        assert!(matches!(found, Ok(Claim::InProgress { .. })), "{found:?}");
        let again = store.inner().inner().claim(&ClaimRequest::new(key, token, None, Duration::from_secs(60))).await;
        assert_eq!(again.unwrap(), Claim::Claimed, "its owner's claim");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_batching_a_call_dropped_while_its_claim_waits_does_not_strand_the_key() {
    // The call's drop asks for its claim's release before the store has the claim (it waits
    // behind a batch on its way): the release must follow the claim, or the key stays claimed
    // for the whole lease.
    let gate = Arc::new(Semaphore::new(0));
    let store = Arc::new(BatchingStore::new(Watched { gate: Some(Arc::clone(&gate)), ..Watched::default() }));
    let runs = Arc::new(AtomicUsize::new(0));
    let call = |k: u32| {
        let (store, runs) = (Arc::clone(&store), Arc::clone(&runs));
        spawn_polled(async move {
            Call::new("stranded", &k)
                .lease(Duration::from_secs(60))
                .run(&*store, async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(k)
                })
                .await
        })
    };
    let ahead = call(1).await;
    while store.inner().claim_batches.lock().unwrap().is_empty() {
        tokio::task::yield_now().await;
    }
    let dropped = call(2).await;
    dropped.abort();
    assert!(dropped.await.unwrap_err().is_cancelled());
    gate.add_permits(1_000);
    assert_eq!(ahead.await.unwrap().unwrap(), 1);
    assert_eq!(*store.inner().claim_batches.lock().unwrap(), [1, 1], "the dropped call's claim was still sent");
    // Its claim was made, and released after it: the key is free now, not in 60 s.
    let again = tokio::time::timeout(Duration::from_secs(5), call(2).await).await.expect("answered at once").unwrap();
    assert_eq!(again.expect("the key is free"), 2);
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the dropped call's body never ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_batching_in_flight_lets_that_many_batches_go_side_by_side() {
    let gate = Arc::new(Semaphore::new(0));
    let watched = Watched { gate: Some(Arc::clone(&gate)), ..Watched::default() };
    let store = Arc::new(BatchingStore::new(watched).in_flight(2));
    let claim = |k: u32| {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            let (key, token) = (Key::new("side-by-side", &k).unwrap(), Token::new());
            store.claim(&ClaimRequest::new(&key, &token, None, Duration::from_secs(60))).await
        })
    };
    let sent = || store.inner().claim_batches.lock().unwrap().len();
    let first = claim(1);
    while sent() < 1 {
        tokio::task::yield_now().await;
    }
    // The first batch is held at the store; a second may go beside it, a third waits.
    let second = claim(2);
    tokio::time::timeout(Duration::from_secs(5), async {
        while sent() < 2 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("a second batch sent while the first is on its way");
    let third = claim(3);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(sent(), 2, "no third batch while two are on their way");
    gate.add_permits(3);
    for answer in [first, second, third] {
        assert_eq!(answer.await.unwrap().unwrap(), Claim::Claimed);
    }
    assert_eq!(*store.inner().claim_batches.lock().unwrap(), [1, 1, 1]);
}

#[test]
fn memory_batching_outside_a_tokio_runtime_fails_the_step_and_leaves_the_queue_working() {
    use std::future::Future as _;
    use std::task::{Context, Poll, Waker};

    let store = BatchingStore::new(MemoryStore::new());
    let (key, token) = (Key::new("no-runtime", "a").unwrap(), Token::new());
    let request = ClaimRequest::new(&key, &token, None, Duration::from_secs(60));
    let mut claim = std::pin::pin!(store.claim(&request));
    match claim.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Err(e)) => assert!(e.to_string().contains("within a Tokio runtime"), "{e}"),
        other => panic!("expected a typed error at once, got {other:?}"),
    }
    // The step was never queued, so it holds up no step after it.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let claimed = runtime.block_on(async { tokio::time::timeout(Duration::from_secs(5), store.claim(&request)).await });
    assert_eq!(claimed.expect("answered").unwrap(), Claim::Claimed);
}
