//! The store conformance suite: the behaviour every [`Store`] must show, through the attribute.
//!
//! A store plugs in with one line in its test file:
//!
//! ```ignore
//! idempotent_tests::conformance_suite!(conformance_memory, async { Some(MemoryStore::new()) });
//! ```
//!
//! The expression yields `Option<impl Store + 'static>`: `None` skips (a server is absent; see
//! [`services`](crate::services)). It is evaluated once per test, so each test may get a fresh,
//! isolated store. Stores whose backend expires records by itself (Redis) add `self_expiring`:
//!
//! ```ignore
//! idempotent_tests::conformance_suite!(conformance_redis, async { ... }, self_expiring);
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::{Claim, ClaimRequest, Error, Fingerprint, Key, Record, Store, StoreError, Token, idempotent};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::Barrier;

/// Expands to one `#[tokio::test]` per conformance case, in a module named `$name`.
#[macro_export]
macro_rules! conformance_suite {
    ($name:ident, $make:expr) => {
        $crate::conformance_suite!($name, $make, purges);
    };
    ($name:ident, $make:expr, $expiry:ident) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            $crate::conformance_suite!(@cases $make, $expiry;
                concurrent_duplicates_run_the_body_once,
                concurrent_duplicates_wait_for_the_first_result,
                exactly_once_across_many_keys,
                replays_return_identical_values,
                errors_release_the_key,
                recorded_errors_are_replayed,
                panics_release_the_key,
                cancellation_releases_the_key,
                lease_expiry_allows_takeover_and_fences_the_stale_owner,
                fingerprint_mismatch_is_refused_on_every_path,
                retention_expiry_lets_the_key_run_again,
                purge_removes_expired_records,
                scopes_keep_equal_keys_apart,
                invalid_keys_never_reach_the_body,
                oversized_results_are_never_run_twice,
                undecodable_records_are_a_typed_error,
                store_steps_are_fenced_by_the_token
            );
        }
    };
    (@cases $make:expr, $expiry:ident; $($case:ident),*) => {$(
        #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $case() {
            let Some(store) = $make.await else { return };
            $crate::conformance::$case(::std::sync::Arc::new(store), $crate::conformance::Expiry::$expiry).await;
        }
    )*};
}

/// How a store gets rid of expired records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// `purge_expired` deletes them (memory, SQL).
    #[allow(non_camel_case_types)]
    purges,
    /// The backend drops them by itself and `purge_expired` returns 0 (Redis).
    #[allow(non_camel_case_types)]
    self_expiring,
}

/// The error type of the functions under test.
#[derive(Debug, Serialize, Deserialize)]
pub enum TestError {
    /// An idempotency error (never recorded).
    #[serde(skip)]
    Idempotency(Error),
    /// A failure a retry may fix.
    Transient(String),
    /// A failure that is final.
    Final(String),
}

impl From<Error> for TestError {
    fn from(error: Error) -> Self {
        TestError::Idempotency(error)
    }
}

impl TestError {
    fn is_final(&self) -> bool {
        matches!(self, TestError::Final(_))
    }
}

/// Counts how often each body ran, outside any store.
#[derive(Debug, Default)]
pub struct Ledger(Mutex<HashMap<String, u32>>);

impl Ledger {
    fn hit(&self, key: &str) -> u32 {
        let mut counts = self.0.lock().unwrap();
        let count = counts.entry(key.to_owned()).or_default();
        *count += 1;
        *count
    }

    fn count(&self, key: &str) -> u32 {
        self.0.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    fn total(&self) -> u32 {
        self.0.lock().unwrap().values().sum()
    }
}

fn unique(name: &str) -> String {
    format!("{name}-{}", uuid::Uuid::new_v4().simple())
}

/// Runs once per key; returns which run it was and a payload, after holding for `hold`.
#[idempotent(key = key, store = store, scope = "conformance-counted", fingerprint = payload, lease = lease)]
async fn counted<S: Store>(
    store: &S,
    ledger: &Ledger,
    key: &str,
    payload: &str,
    hold: Duration,
    lease: Duration,
) -> Result<(u32, String), TestError> {
    let run = ledger.hit(key);
    tokio::time::sleep(hold).await;
    Ok((run, format!("{payload}#{run}")))
}

/// The same, but a concurrent duplicate waits for the first call's result.
#[idempotent(key = key, store = store, scope = "conformance-counted", fingerprint = payload, wait = "20s")]
async fn counted_waiting<S: Store>(
    store: &S,
    ledger: &Ledger,
    key: &str,
    payload: &str,
    hold: Duration,
) -> Result<(u32, String), TestError> {
    let run = ledger.hit(key);
    tokio::time::sleep(hold).await;
    Ok((run, format!("{payload}#{run}")))
}

async fn quick<S: Store>(store: &S, ledger: &Ledger, key: &str) -> Result<(u32, String), TestError> {
    counted(store, ledger, key, "p", Duration::ZERO, Duration::from_secs(30)).await
}

/// What [`counted`] returns.
type CountedResult = Result<(u32, String), TestError>;

fn is_in_progress<T>(result: &Result<T, TestError>) -> bool {
    matches!(result, Err(TestError::Idempotency(Error::InProgress { .. })))
}

/// Of 64 concurrent calls with one key, exactly one runs; the others get `InProgress` or its result.
pub async fn concurrent_duplicates_run_the_body_once<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Arc::new(Ledger::default());
    let key = unique("contended");
    let barrier = Arc::new(Barrier::new(64));
    let calls = (0..64).map(|_| {
        let (store, ledger, key, barrier) = (store.clone(), ledger.clone(), key.clone(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            counted(&*store, &ledger, &key, "p", Duration::from_millis(300), Duration::from_secs(30)).await
        })
    });
    let results = futures_join(calls.collect::<Vec<_>>()).await;
    assert_eq!(ledger.count(&key), 1, "the body must run exactly once");
    let winners = results.iter().filter(|r| matches!(r, Ok((1, _)))).count();
    assert!(winners >= 1, "someone must get the first result");
    for result in &results {
        assert!(
            is_in_progress(result) || matches!(result, Ok((1, payload)) if payload == "p#1"),
            "every duplicate gets InProgress or the one recorded result, got {result:?}"
        );
    }
    assert!(results.iter().any(is_in_progress), "duplicates arriving during the body must see it in progress");
}

/// With `wait`, all 64 concurrent callers get the first call's result.
pub async fn concurrent_duplicates_wait_for_the_first_result<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Arc::new(Ledger::default());
    let key = unique("waited");
    let barrier = Arc::new(Barrier::new(64));
    let calls = (0..64).map(|_| {
        let (store, ledger, key, barrier) = (store.clone(), ledger.clone(), key.clone(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            counted_waiting(&*store, &ledger, &key, "p", Duration::from_millis(300)).await
        })
    });
    for result in futures_join(calls.collect::<Vec<_>>()).await {
        assert_eq!(result.unwrap(), (1, "p#1".to_owned()));
    }
    assert_eq!(ledger.count(&key), 1);
}

/// 200 keys × 64 concurrent duplicates: each body runs once, and no key is left in progress.
pub async fn exactly_once_across_many_keys<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    const KEYS: usize = 200;
    const DUPLICATES: usize = 64;
    let ledger = Arc::new(Ledger::default());
    let prefix = unique("many");
    let mut calls = Vec::with_capacity(KEYS * DUPLICATES);
    for duplicate in 0..DUPLICATES {
        for k in 0..KEYS {
            let (store, ledger) = (store.clone(), ledger.clone());
            let key = format!("{prefix}-{k}");
            calls.push(tokio::spawn(async move {
                let hold = Duration::from_millis((duplicate % 3) as u64);
                let result = counted(&*store, &ledger, &key, "p", hold, Duration::from_secs(30)).await;
                (key, result)
            }));
        }
    }
    let mut outcomes: HashMap<String, Vec<CountedResult>> = HashMap::new();
    for (key, result) in futures_join(calls).await {
        outcomes.entry(key).or_default().push(result);
    }
    assert_eq!(outcomes.len(), KEYS);
    for (key, results) in &outcomes {
        assert_eq!(ledger.count(key), 1, "{key} ran {} times", ledger.count(key));
        for result in results {
            assert!(
                is_in_progress(result) || matches!(result, Ok((1, p)) if p == "p#1"),
                "{key}: unexpected {result:?}"
            );
        }
        // Nothing is left in progress: a later call replays.
        assert_eq!(quick(&*store, &ledger, key).await.unwrap(), (1, "p#1".to_owned()), "{key} left in progress");
    }
    assert_eq!(ledger.total() as usize, KEYS);
}

#[idempotent(key = key, store = store, scope = "conformance-echo")]
async fn echo<S: Store, T: Serialize + DeserializeOwned + Send>(
    store: &S,
    ledger: &Ledger,
    key: &str,
    value: T,
) -> Result<T, TestError> {
    ledger.hit(key);
    Ok(value)
}

async fn round_trip<S: Store, T>(store: &S, value: T)
where
    T: Serialize + DeserializeOwned + Clone + PartialEq + std::fmt::Debug + Send,
{
    let ledger = Ledger::default();
    let key = unique("echo");
    let first = echo(store, &ledger, &key, value.clone()).await.unwrap();
    let replayed = echo(store, &ledger, &key, value.clone()).await.unwrap();
    assert_eq!(first, value);
    assert_eq!(replayed, value, "replay must return the recorded value exactly");
    assert_eq!(ledger.count(&key), 1, "a replay must not run the body");
}

/// Nested data for [`replays_return_identical_values`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    id: u64,
    user: String,
    amount: i64,
    tags: Vec<String>,
    note: Option<String>,
    ratio: f64,
}

/// Values come back exactly, including `()`, zero, `false`, `""`, `None` and empty collections.
pub async fn replays_return_identical_values<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let store = &*store;
    round_trip(store, ()).await;
    round_trip(store, 0i64).await;
    round_trip(store, false).await;
    round_trip(store, String::new()).await;
    round_trip(store, None::<String>).await;
    round_trip(store, Vec::<u8>::new()).await;
    round_trip(store, std::collections::BTreeMap::<String, u32>::new()).await;
    round_trip(store, (i64::MIN, u64::MAX, -0.0f64, f64::MAX)).await;
    round_trip(store, "ünïcødé ✓ \"quotes\" \\ \n\t\u{1F600}".to_owned()).await;
    round_trip(store, vec![0u8, 1, 254, 255]).await;
    round_trip(
        store,
        Receipt { id: 7, user: "alice".into(), amount: -100, tags: vec![], note: None, ratio: 0.1 + 0.2 },
    )
    .await;
}

#[idempotent(key = key, store = store, scope = "conformance-fallible")]
async fn fallible<S: Store>(store: &S, ledger: &Ledger, key: &str, fail: Option<TestError>) -> Result<u32, TestError> {
    let run = ledger.hit(key);
    fail.map_or(Ok(run), Err)
}

#[idempotent(key = key, store = store, scope = "conformance-recording", record_err)]
async fn recording<S: Store>(store: &S, ledger: &Ledger, key: &str, fail: Option<TestError>) -> Result<u32, TestError> {
    let run = ledger.hit(key);
    fail.map_or(Ok(run), Err)
}

#[idempotent(key = key, store = store, scope = "conformance-selective", record_err = TestError::is_final)]
async fn selective<S: Store>(store: &S, ledger: &Ledger, key: &str, fail: Option<TestError>) -> Result<u32, TestError> {
    let run = ledger.hit(key);
    fail.map_or(Ok(run), Err)
}

/// An `Err` that is not recorded releases the key: a retry runs the body again.
pub async fn errors_release_the_key<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("released");
    let failed = fallible(&*store, &ledger, &key, Some(TestError::Transient("down".into()))).await;
    assert!(matches!(failed, Err(TestError::Transient(_))), "{failed:?}");
    assert_eq!(fallible(&*store, &ledger, &key, None).await.unwrap(), 2, "the retry runs again");
    assert_eq!(fallible(&*store, &ledger, &key, None).await.unwrap(), 2, "and is then replayed");
    assert_eq!(ledger.count(&key), 2);
}

/// With `record_err`, errors are replayed; with a predicate, only the final ones are.
pub async fn recorded_errors_are_replayed<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("recorded");
    let first = recording(&*store, &ledger, &key, Some(TestError::Transient("no".into()))).await;
    assert!(matches!(first, Err(TestError::Transient(ref m)) if m == "no"));
    let replay = recording(&*store, &ledger, &key, None).await;
    assert!(matches!(replay, Err(TestError::Transient(ref m)) if m == "no"), "{replay:?}");
    assert_eq!(ledger.count(&key), 1);

    let final_key = unique("final");
    let _ = selective(&*store, &ledger, &final_key, Some(TestError::Final("insufficient".into()))).await;
    let replay = selective(&*store, &ledger, &final_key, None).await;
    assert!(matches!(replay, Err(TestError::Final(ref m)) if m == "insufficient"), "{replay:?}");
    assert_eq!(ledger.count(&final_key), 1);

    let transient_key = unique("transient");
    let _ = selective(&*store, &ledger, &transient_key, Some(TestError::Transient("timeout".into()))).await;
    assert_eq!(selective(&*store, &ledger, &transient_key, None).await.unwrap(), 2);
}

#[idempotent(key = key, store = store, scope = "conformance-panicky", wait = "10s")]
async fn panicky<S: Store>(store: &S, ledger: &Ledger, key: &str, panic: bool) -> Result<u32, TestError> {
    let run = ledger.hit(key);
    assert!(!panic, "the body panics on purpose");
    Ok(run)
}

/// A panicking body releases its claim: the retry (which waits if the release is still on its way)
/// runs the body.
pub async fn panics_release_the_key<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Arc::new(Ledger::default());
    let key = unique("panicked");
    let task = {
        let (store, ledger, key) = (store.clone(), ledger.clone(), key.clone());
        tokio::spawn(async move { panicky(&*store, &ledger, &key, true).await })
    };
    assert!(task.await.unwrap_err().is_panic());
    assert_eq!(panicky(&*store, &ledger, &key, false).await.unwrap(), 2);
    assert_eq!(ledger.count(&key), 2);
}

/// A dropped (timed-out) call releases its claim: the retry runs the body.
pub async fn cancellation_releases_the_key<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("cancelled");
    let slow = counted(&*store, &ledger, &key, "p", Duration::from_secs(30), Duration::from_secs(30));
    assert!(tokio::time::timeout(Duration::from_millis(200), slow).await.is_err());
    assert_eq!(ledger.count(&key), 1, "the first call started its body");
    let retry = counted_waiting(&*store, &ledger, &key, "p", Duration::ZERO).await.unwrap();
    assert_eq!(retry, (2, "p#2".to_owned()));
}

/// After the lease, a duplicate takes over; the stale owner's late result is refused with
/// `LeaseLost`, and the new owner's result is the one replayed.
pub async fn lease_expiry_allows_takeover_and_fences_the_stale_owner<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Arc::new(Ledger::default());
    let key = unique("leased");
    let stale = {
        let (store, ledger, key) = (store.clone(), ledger.clone(), key.clone());
        tokio::spawn(async move {
            counted(&*store, &ledger, &key, "p", Duration::from_millis(1500), Duration::from_millis(400)).await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(is_in_progress(&quick(&*store, &ledger, &key).await), "within the lease, the key is in progress");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let taken_over = counted(&*store, &ledger, &key, "p", Duration::ZERO, Duration::from_secs(30)).await;
    assert_eq!(taken_over.unwrap(), (2, "p#2".to_owned()), "after the lease a duplicate takes over");
    let stale = stale.await.unwrap();
    assert!(matches!(stale, Err(TestError::Idempotency(Error::LeaseLost { .. }))), "{stale:?}");
    assert_eq!(quick(&*store, &ledger, &key).await.unwrap(), (2, "p#2".to_owned()), "the new owner's record stands");
    assert_eq!(ledger.count(&key), 2);
}

/// A reused key with another request is refused while it runs, after it completes, and for waiters.
pub async fn fingerprint_mismatch_is_refused_on_every_path<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Arc::new(Ledger::default());
    let key = unique("fingerprinted");
    let first = {
        let (store, ledger, key) = (store.clone(), ledger.clone(), key.clone());
        tokio::spawn(async move {
            counted(&*store, &ledger, &key, "pay 100", Duration::from_millis(500), Duration::from_secs(30)).await
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let mismatch = |r: &Result<(u32, String), TestError>| {
        matches!(r, Err(TestError::Idempotency(Error::FingerprintMismatch { .. })))
    };
    let long = Duration::from_secs(30);
    let running = counted(&*store, &ledger, &key, "pay 999", Duration::ZERO, long).await;
    assert!(mismatch(&running), "in progress: {running:?}");
    let same = counted(&*store, &ledger, &key, "pay 100", Duration::ZERO, long).await;
    assert!(is_in_progress(&same), "same request while running: {same:?}");
    let waiter = counted_waiting(&*store, &ledger, &key, "pay 999", Duration::ZERO).await;
    assert!(mismatch(&waiter), "a waiter with another request: {waiter:?}");
    assert_eq!(first.await.unwrap().unwrap(), (1, "pay 100#1".to_owned()));
    let completed = counted(&*store, &ledger, &key, "pay 999", Duration::ZERO, long).await;
    assert!(mismatch(&completed), "completed: {completed:?}");
    let replay = counted(&*store, &ledger, &key, "pay 100", Duration::ZERO, long).await;
    assert_eq!(replay.unwrap(), (1, "pay 100#1".to_owned()));
    assert_eq!(ledger.count(&key), 1, "a mismatched request never runs");
}

#[idempotent(key = key, store = store, scope = "conformance-short", retention = retention, lease = retention)]
async fn short_lived<S: Store>(store: &S, ledger: &Ledger, key: &str, retention: Duration) -> Result<u32, TestError> {
    Ok(ledger.hit(key))
}

/// A completed record is replayed during its retention and forgotten after it.
pub async fn retention_expiry_lets_the_key_run_again<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("retained");
    let retention = Duration::from_secs(1);
    assert_eq!(short_lived(&*store, &ledger, &key, retention).await.unwrap(), 1);
    assert_eq!(short_lived(&*store, &ledger, &key, retention).await.unwrap(), 1, "replayed within retention");
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(short_lived(&*store, &ledger, &key, retention).await.unwrap(), 2, "runs again after retention");
}

/// `purge_expired` deletes expired records (or, on a self-expiring store, has nothing to delete).
pub async fn purge_removes_expired_records<S: Store + 'static>(store: Arc<S>, expiry: Expiry) {
    let ledger = Ledger::default();
    let prefix = unique("purged");
    let retention = Duration::from_secs(1);
    for k in 0..20 {
        short_lived(&*store, &ledger, &format!("{prefix}-{k}"), retention).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let purged = store.purge_expired().await.expect("purge_expired");
    match expiry {
        Expiry::purges => assert!(purged >= 20, "purged {purged} of 20 expired records"),
        Expiry::self_expiring => assert_eq!(purged, 0, "a self-expiring store has nothing to purge"),
    }
    assert_eq!(store.purge_expired().await.expect("purge_expired"), 0, "nothing is left to purge");
    for k in 0..20 {
        let key = format!("{prefix}-{k}");
        assert_eq!(short_lived(&*store, &ledger, &key, retention).await.unwrap(), 2, "{key} runs again");
    }
}

#[idempotent(key = key, store = store, scope = "conformance-other")]
async fn other_scope<S: Store>(store: &S, ledger: &Ledger, key: &str) -> Result<u32, TestError> {
    Ok(ledger.hit(key))
}

/// Two functions with the same key do not share records.
pub async fn scopes_keep_equal_keys_apart<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("shared");
    assert_eq!(quick(&*store, &ledger, &key).await.unwrap(), (1, "p#1".to_owned()));
    assert_eq!(other_scope(&*store, &ledger, &key).await.unwrap(), 2, "another scope runs its own body");
    assert_eq!(other_scope(&*store, &ledger, &key).await.unwrap(), 2);
    assert_eq!(quick(&*store, &ledger, &key).await.unwrap(), (1, "p#1".to_owned()));
}

/// Empty, over-long and control-character keys are typed errors and never run the body.
pub async fn invalid_keys_never_reach_the_body<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    for key in [String::new(), "k".repeat(256), "new\nline".to_owned(), "nul\0".to_owned()] {
        let result = quick(&*store, &ledger, &key).await;
        assert!(matches!(result, Err(TestError::Idempotency(Error::InvalidKey(_)))), "{key:?}: {result:?}");
    }
    assert_eq!(ledger.total(), 0);
    let longest = "k".repeat(255);
    assert_eq!(quick(&*store, &ledger, &longest).await.unwrap().0, 1, "255 bytes is allowed");
}

#[idempotent(key = key, store = store, scope = "conformance-big")]
async fn big<S: Store>(store: &S, ledger: &Ledger, key: &str, size: usize) -> Result<String, TestError> {
    ledger.hit(key);
    Ok("x".repeat(size))
}

/// A result over the store's limit is returned to its caller but not replayed as a value: replays
/// get `Unrecordable`, and the body never runs twice.
pub async fn oversized_results_are_never_run_twice<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("big");
    let size = store.max_record_bytes() + 1;
    assert_eq!(big(&*store, &ledger, &key, size).await.unwrap().len(), size);
    let replay = big(&*store, &ledger, &key, size).await;
    assert!(matches!(replay, Err(TestError::Idempotency(Error::Unrecordable { .. }))), "{replay:?}");
    assert_eq!(ledger.count(&key), 1);
}

#[idempotent(key = key, store = store, scope = "conformance-typed")]
async fn as_text<S: Store>(store: &S, key: &str) -> Result<String, TestError> {
    Ok("not a number".to_owned())
}

#[idempotent(key = key, store = store, scope = "conformance-typed")]
async fn as_number<S: Store>(store: &S, ledger: &Ledger, key: &str) -> Result<u64, TestError> {
    Ok(u64::from(ledger.hit(key)))
}

/// A record that does not decode as the function's type (the type changed) is a typed error.
pub async fn undecodable_records_are_a_typed_error<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("typed");
    as_text(&*store, &key).await.unwrap();
    let result = as_number(&*store, &ledger, &key).await;
    assert!(matches!(result, Err(TestError::Idempotency(Error::Decode { .. }))), "{result:?}");
    assert_eq!(ledger.count(&key), 0);
}

fn claim_request<'a>(
    key: &'a Key,
    token: &'a Token,
    fingerprint: Option<&'a Fingerprint>,
    lease_ms: u64,
) -> ClaimRequest<'a> {
    ClaimRequest { key, token, fingerprint, lease: Duration::from_millis(lease_ms) }
}

/// The store's three steps, called directly: only the claimant's token completes or releases; a
/// completed or released claim is no longer the caller's; an expired lease is taken over and its
/// stale owner fenced off; a record past its retention is claimable again.
pub async fn store_steps_are_fenced_by_the_token<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let scope = unique("steps");
    let key = Key::new(&scope, &"k1").unwrap();
    let (first, second) = (Token::new(), Token::new());
    let fp = Fingerprint::of(&("alice", 100)).unwrap();
    let retention = Duration::from_secs(60);

    assert_eq!(store.claim(&claim_request(&key, &first, Some(&fp), 30_000)).await.unwrap(), Claim::Claimed);
    match store.claim(&claim_request(&key, &second, None, 30_000)).await.unwrap() {
        Claim::InProgress { fingerprint, lease_remaining } => {
            assert_eq!(fingerprint.as_ref(), Some(&fp));
            let left = lease_remaining.expect("the store knows the lease");
            assert!(left > Duration::from_secs(25) && left <= Duration::from_secs(30), "{left:?}");
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    // Only the owner may complete or release.
    assert!(matches!(store.complete(&key, &second, b"{}", retention).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.release(&key, &second).await, Err(StoreError::NotOwner)));
    store.complete(&key, &first, br#"{"Ok":1}"#, retention).await.unwrap();
    // Completed: replayed, and no longer completable or releasable.
    let replay = store.claim(&claim_request(&key, &second, None, 30_000)).await.unwrap();
    assert_eq!(replay, Claim::Completed(Record { fingerprint: Some(fp), outcome: br#"{"Ok":1}"#.to_vec() }));
    assert!(matches!(store.complete(&key, &first, b"{}", retention).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.release(&key, &first).await, Err(StoreError::NotOwner)));

    // A released claim can be claimed again.
    let other = Key::new(&scope, &"k2").unwrap();
    assert_eq!(store.claim(&claim_request(&other, &first, None, 30_000)).await.unwrap(), Claim::Claimed);
    store.release(&other, &first).await.unwrap();
    assert!(matches!(store.release(&other, &first).await, Err(StoreError::NotOwner)));
    assert_eq!(store.claim(&claim_request(&other, &second, None, 30_000)).await.unwrap(), Claim::Claimed);

    // An expired lease is taken over, and the stale owner is fenced off.
    let leased = Key::new(&scope, &"k3").unwrap();
    assert_eq!(store.claim(&claim_request(&leased, &first, None, 100)).await.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(store.claim(&claim_request(&leased, &second, None, 30_000)).await.unwrap(), Claim::Claimed);
    assert!(matches!(store.complete(&leased, &first, b"{}", retention).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.release(&leased, &first).await, Err(StoreError::NotOwner)));
    store.complete(&leased, &second, br#"{"Ok":2}"#, retention).await.unwrap();

    // A completed record whose retention ended is claimable again.
    let retained = Key::new(&scope, &"k4").unwrap();
    assert_eq!(store.claim(&claim_request(&retained, &first, None, 30_000)).await.unwrap(), Claim::Claimed);
    store.complete(&retained, &first, b"{}", Duration::from_millis(100)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(store.claim(&claim_request(&retained, &second, None, 30_000)).await.unwrap(), Claim::Claimed);
}

async fn futures_join<T: Send + 'static>(handles: impl IntoIterator<Item = tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut results = Vec::new();
    for handle in handles {
        results.push(handle.await.expect("task panicked"));
    }
    results
}
