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
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::{
    Call, Claim, ClaimRequest, Completion, Detached, Error, Fingerprint, Key, OnCancel, Record, Store, StoreError,
    Token, idempotent,
};

use crate::StoreSteps;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::Barrier;

mod batched;
pub use batched::{
    a_key_in_both_halves_of_a_batch_answers_in_one_order, batched_claims_and_completions_answer_as_single_steps,
    batched_claims_answer_as_single_claims, batched_completions_answer_as_single_completions,
    batched_steps_follow_leases_and_retentions, batched_steps_keep_each_answer_on_its_request,
};

/// Expands to one `#[tokio::test]` per conformance case, in a module named `$name`.
#[macro_export]
macro_rules! conformance_suite {
    ($name:ident, $make:expr) => {
        $crate::conformance_suite!($name, $make, purges);
    };
    // A transactional store (one transaction per test): the cases that hold inside one
    // transaction. Left out: purging (a transaction purges nothing), the cases that drop a call
    // or panic in it (its claim stays in the transaction, which its owner rolls back: a
    // transactional store detaches nothing), the lease cases (a claim in a transaction lives as long as the
    // transaction, with no heartbeat: 12,800 calls serialized on one transaction's connection, as
    // in `exactly_once_across_many_keys`, can outlast their 30 s lease on a loaded machine) and
    // the direct store-step case (its lease expiry parts).
    ($name:ident, $make:expr, transactional) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            $crate::conformance_suite!(@cases $make, purges;
                concurrent_duplicates_run_the_body_once,
                concurrent_duplicates_wait_for_the_first_result,
                replays_return_identical_values,
                errors_release_the_key,
                recorded_errors_are_replayed,
                invalid_durations_are_refused_before_claiming,
                fingerprint_mismatch_is_refused_on_every_path,
                retention_expiry_lets_the_key_run_again,
                scopes_keep_equal_keys_apart,
                invalid_keys_never_reach_the_body,
                oversized_results_are_never_run_twice,
                undecodable_records_are_a_typed_error,
                a_resent_claim_finds_its_own_claim,
                batched_claims_answer_as_single_claims,
                batched_completions_answer_as_single_completions,
                batched_steps_keep_each_answer_on_its_request,
                batched_claims_and_completions_answer_as_single_steps,
                a_key_in_both_halves_of_a_batch_answers_in_one_order
            );
        }
    };
    // An in-process store on Tokio's paused clock (one thread, time advancing only when every
    // task waits): every case that does not need a second thread, its leases and retentions
    // expiring in virtual time.
    ($name:ident, $make:expr, paused) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            $crate::conformance_suite!(@paused $make;
                concurrent_duplicates_run_the_body_once,
                concurrent_duplicates_wait_for_the_first_result,
                exactly_once_across_many_keys,
                replays_return_identical_values,
                errors_release_the_key,
                recorded_errors_are_replayed,
                cancellation_keeps_the_claim_until_the_lease_ends,
                cancellation_with_release_policy_frees_the_key,
                a_live_body_keeps_its_claim_past_the_lease,
                a_crashed_owners_claim_frees_after_its_lease,
                a_late_completion_nobody_contested_is_recorded,
                a_late_completion_after_the_claim_was_dropped_is_recorded,
                a_late_completion_after_a_takeover_is_refused,
                a_body_whose_heartbeat_failed_is_still_recorded,
                a_resent_claim_finds_its_own_claim,
                a_claim_answered_after_its_lease_runs_the_body_on_a_live_lease,
                a_call_dropped_while_recording_is_still_recorded,
                a_completion_slower_than_its_lease_keeps_the_key,
                a_detached_completion_slower_than_its_lease_keeps_the_key,
                a_call_dropped_while_claiming_does_not_strand_the_key,
                invalid_durations_are_refused_before_claiming,
                fingerprint_mismatch_is_refused_on_every_path,
                retention_expiry_lets_the_key_run_again,
                purge_removes_expired_records,
                scopes_keep_equal_keys_apart,
                invalid_keys_never_reach_the_body,
                oversized_results_are_never_run_twice,
                undecodable_records_are_a_typed_error,
                store_steps_are_fenced_by_the_token,
                batched_claims_answer_as_single_claims,
                batched_completions_answer_as_single_completions,
                batched_steps_keep_each_answer_on_its_request,
                batched_claims_and_completions_answer_as_single_steps,
                a_key_in_both_halves_of_a_batch_answers_in_one_order,
                batched_steps_follow_leases_and_retentions
            );
        }
    };
    (@paused $make:expr; $($case:ident),*) => {$(
        #[::tokio::test(flavor = "current_thread", start_paused = true)]
        async fn $case() {
            let Some(store) = $make.await else { return };
            $crate::conformance::$case(::std::sync::Arc::new(store), $crate::conformance::Expiry::purges).await;
        }
    )*};
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
                cancellation_keeps_the_claim_until_the_lease_ends,
                cancellation_with_release_policy_frees_the_key,
                a_live_body_keeps_its_claim_past_the_lease,
                a_crashed_owners_claim_frees_after_its_lease,
                a_late_completion_nobody_contested_is_recorded,
                a_late_completion_after_the_claim_was_dropped_is_recorded,
                a_late_completion_after_a_takeover_is_refused,
                a_body_whose_heartbeat_failed_is_still_recorded,
                a_resent_claim_finds_its_own_claim,
                a_claim_answered_after_its_lease_runs_the_body_on_a_live_lease,
                a_call_dropped_while_recording_is_still_recorded,
                a_completion_slower_than_its_lease_keeps_the_key,
                a_detached_completion_slower_than_its_lease_keeps_the_key,
                a_call_dropped_while_claiming_does_not_strand_the_key,
                invalid_durations_are_refused_before_claiming,
                fingerprint_mismatch_is_refused_on_every_path,
                retention_expiry_lets_the_key_run_again,
                purge_removes_expired_records,
                scopes_keep_equal_keys_apart,
                invalid_keys_never_reach_the_body,
                oversized_results_are_never_run_twice,
                undecodable_records_are_a_typed_error,
                store_steps_are_fenced_by_the_token,
                batched_claims_answer_as_single_claims,
                batched_completions_answer_as_single_completions,
                batched_steps_keep_each_answer_on_its_request,
                batched_claims_and_completions_answer_as_single_steps,
                a_key_in_both_halves_of_a_batch_answers_in_one_order,
                batched_steps_follow_leases_and_retentions
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

/// A call dropped while its body runs is treated like a crash (`OnCancel::Keep`, the default):
/// the body may have made side effects that are still landing, so retries are refused until the
/// lease ends, and only then does a retry run.
pub async fn cancellation_keeps_the_claim_until_the_lease_ends<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("cancelled");
    let slow = counted(&*store, &ledger, &key, "p", Duration::from_secs(30), Duration::from_millis(1500));
    assert!(tokio::time::timeout(Duration::from_millis(200), slow).await.is_err());
    assert_eq!(ledger.count(&key), 1, "the first call started its body");
    assert!(is_in_progress(&quick(&*store, &ledger, &key).await), "a retry within the lease must not run");
    tokio::time::sleep(Duration::from_millis(1800)).await;
    assert_eq!(quick(&*store, &ledger, &key).await.unwrap(), (2, "p#2".to_owned()), "after the lease a retry runs");
}

/// With `OnCancel::Release`, a dropped call releases its claim at once: the retry (which waits
/// while the release is on its way) runs the body.
pub async fn cancellation_with_release_policy_frees_the_key<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let (ledger, key) = (&Ledger::default(), &unique("released"));
    let call = |hold: Duration| {
        Call::new("conformance-release", key)
            .lease(Duration::from_secs(30))
            .on_cancel(OnCancel::Release)
            .wait(Duration::from_secs(10))
            .run(&*store, async move {
                let run = ledger.hit(key);
                tokio::time::sleep(hold).await;
                Ok::<_, TestError>(run)
            })
    };
    assert!(tokio::time::timeout(Duration::from_millis(200), call(Duration::from_secs(30))).await.is_err());
    assert_eq!(call(Duration::ZERO).await.unwrap(), 2, "the retry ran the body again");
}

/// The lease heartbeat: a body that runs for several leases keeps its claim; duplicates meanwhile
/// are refused, and the one result is recorded and replayed.
pub async fn a_live_body_keeps_its_claim_past_the_lease<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Arc::new(Ledger::default());
    let key = unique("heartbeat");
    let lease = Duration::from_millis(900);
    let long = {
        let (store, ledger, key) = (store.clone(), ledger.clone(), key.clone());
        tokio::spawn(async move { counted(&*store, &ledger, &key, "p", Duration::from_millis(3200), lease).await })
    };
    for at in [1200, 2100, 2900] {
        tokio::time::sleep_until(tokio::time::Instant::now() + Duration::from_millis(at / 3)).await;
        assert!(is_in_progress(&quick(&*store, &ledger, &key).await), "a duplicate ran while the first body lived");
    }
    assert_eq!(long.await.unwrap().unwrap(), (1, "p#1".to_owned()));
    assert_eq!(quick(&*store, &ledger, &key).await.unwrap(), (1, "p#1".to_owned()), "the one result is replayed");
    assert_eq!(ledger.count(&key), 1);
}

/// A claim whose owner died (claimed straight through the store, never renewed) frees itself when
/// its lease ends; the dead owner can then neither renew, complete nor release it.
pub async fn a_crashed_owners_claim_frees_after_its_lease<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("crashed");
    let stored = Key::new("conformance-counted", &key.as_str()).unwrap();
    let dead = Token::new();
    assert_eq!(store.claim(&claim_request(&stored, &dead, None, 400)).await.unwrap(), Claim::Claimed);
    assert!(is_in_progress(&quick(&*store, &ledger, &key).await), "within the lease, the key is in progress");
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(quick(&*store, &ledger, &key).await.unwrap(), (1, "p#1".to_owned()), "after the lease a duplicate runs");
    assert!(matches!(store.extend(&stored, &dead, Duration::from_secs(30)).await, Err(StoreError::NotOwner)));
    assert!(matches!(
        store.complete_as(&stored, &dead, b"{}", Duration::from_secs(60)).await,
        Err(StoreError::NotOwner)
    ));
    assert!(matches!(store.release(&stored, &dead).await, Err(StoreError::NotOwner)));
    assert_eq!(quick(&*store, &ledger, &key).await.unwrap(), (1, "p#1".to_owned()), "the new owner's record stands");
}

/// A completion that arrives after the lease ended, when nobody took the key over, is recorded:
/// refusing it would make the next retry run the body again. Renewal and release stay fenced by
/// the lease. The record keeps the request's fingerprint.
pub async fn a_late_completion_nobody_contested_is_recorded<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let key = Key::new(&unique("late"), &"k").unwrap();
    let (owner, next) = (Token::new(), Token::new());
    let fp = Fingerprint::of(&("alice", 100)).unwrap();
    assert_eq!(store.claim(&claim_request(&key, &owner, Some(&fp), 150)).await.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert!(matches!(store.extend(&key, &owner, Duration::from_secs(30)).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.release(&key, &owner).await, Err(StoreError::NotOwner)));
    let late = Completion::new(&key, &owner, Some(&fp), br#"{"Ok":1}"#, Duration::from_secs(60));
    store.complete(&late).await.expect("nobody contested the key: the late completion is recorded");
    store.complete(&late).await.expect("and repeating it succeeds");
    let recorded = Claim::Completed(Record::new(Some(fp), br#"{"Ok":1}"#.to_vec()));
    assert_eq!(store.claim(&claim_request(&key, &next, None, 30_000)).await.unwrap(), recorded, "replayed");
}

/// The same when the store has dropped the expired claim (Redis does by itself; the others when
/// purged): nobody holds the key, so the late completion writes the record, fingerprint included.
pub async fn a_late_completion_after_the_claim_was_dropped_is_recorded<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let key = Key::new(&unique("dropped"), &"k").unwrap();
    let owner = Token::new();
    let fp = Fingerprint::of(&("bob", 7)).unwrap();
    assert_eq!(store.claim(&claim_request(&key, &owner, Some(&fp), 150)).await.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(450)).await;
    store.purge_expired().await.unwrap();
    let late = Completion::new(&key, &owner, Some(&fp), br#"{"Ok":"late"}"#, Duration::from_secs(60));
    store.complete(&late).await.expect("nobody holds the key: the late completion is recorded");
    match store.claim(&claim_request(&key, &Token::new(), None, 30_000)).await.unwrap() {
        Claim::Completed(record) => {
            assert_eq!(record.outcome, &br#"{"Ok":"late"}"#[..]);
            assert_eq!(record.fingerprint, Some(fp), "the request's fingerprint travels with the completion");
        }
        other => panic!("expected the late record, got {other:?}"),
    }
}

/// A completion after another caller took the key over is refused, and the new owner's record
/// stands.
pub async fn a_late_completion_after_a_takeover_is_refused<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let key = Key::new(&unique("taken"), &"k").unwrap();
    let (owner, next) = (Token::new(), Token::new());
    assert_eq!(store.claim(&claim_request(&key, &owner, None, 150)).await.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert_eq!(store.claim(&claim_request(&key, &next, None, 30_000)).await.unwrap(), Claim::Claimed);
    let late = |token| Completion::new(&key, token, None, br#"{"Ok":"late"}"#, Duration::from_secs(60));
    assert!(matches!(store.complete(&late(&owner)).await, Err(StoreError::NotOwner)), "the new owner runs");
    store.complete_as(&key, &next, br#"{"Ok":"new"}"#, Duration::from_secs(60)).await.unwrap();
    assert!(matches!(store.complete(&late(&owner)).await, Err(StoreError::NotOwner)), "the new owner recorded");
    let recorded = Claim::Completed(Record::new(None, br#"{"Ok":"new"}"#.to_vec()));
    assert_eq!(store.claim(&claim_request(&key, &Token::new(), None, 30_000)).await.unwrap(), recorded);
}

/// A claim sent again by its own caller (a client that resent the request after losing the first
/// reply) finds its own claim: it is `Claimed`, not `InProgress`, so the key is not stranded.
pub async fn a_resent_claim_finds_its_own_claim<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let key = Key::new(&unique("resent"), &"k").unwrap();
    let (owner, other) = (Token::new(), Token::new());
    let fp = Fingerprint::of(&1).unwrap();
    assert_eq!(store.claim(&claim_request(&key, &owner, Some(&fp), 30_000)).await.unwrap(), Claim::Claimed);
    assert_eq!(store.claim(&claim_request(&key, &owner, Some(&fp), 30_000)).await.unwrap(), Claim::Claimed);
    assert!(matches!(store.claim(&claim_request(&key, &other, None, 30_000)).await.unwrap(), Claim::InProgress { .. }));
    store.complete(&Completion::new(&key, &owner, Some(&fp), br#"{"Ok":1}"#, Duration::from_secs(60))).await.unwrap();
}

/// A store whose first claim waits before it reaches the store and again before its reply
/// returns, so that the reply comes after the lease: the claim lands late, its lease counted by
/// the store from then (the request carries no `sent`, as a wrapper that holds a claim must not).
struct LateFirstClaim<S> {
    inner: Arc<S>,
    before: Duration,
    after: Duration,
    claims: AtomicU32,
}

impl<S> LateFirstClaim<S> {
    fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S: Store> Store for LateFirstClaim<S> {
    idempotent_runtime::forward_store!(direct LateFirstClaim::inner; complete release extend detach);

    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let unsent = ClaimRequest::new(request.key, request.token, request.fingerprint, request.lease);
        if self.claims.fetch_add(1, Ordering::SeqCst) > 0 {
            return self.inner.claim(&unsent).await;
        }
        tokio::time::sleep(self.before).await;
        let claim = self.inner.claim(&unsent).await;
        tokio::time::sleep(self.after).await;
        claim
    }
}

/// A claim answered after its lease (at 2.2 s, lease 2 s) whose key is still held by its own
/// token: the store counted that lease from when the claim landed (0.6 s after it was sent), so
/// it ends at 2.6 s, before a heartbeat counted from the reply would renew it (2.87 s). The call
/// must not run its body on that lease, nor count it from the reply or from a claim sent again
/// (which finds its own token and does not renew it). A duplicate at 2.7 s finds the key held,
/// and the body runs once.
pub async fn a_claim_answered_after_its_lease_runs_the_body_on_a_live_lease<S: Store + 'static>(
    store: Arc<S>,
    _: Expiry,
) {
    let (lease, before, after) = (Duration::from_secs(2), Duration::from_millis(600), Duration::from_millis(1_600));
    assert!(before + after > lease, "the first claim is answered after its lease");
    let ledger = Arc::new(Ledger::default());
    let key = unique("late-claim");
    let late = Arc::new(LateFirstClaim { inner: store.clone(), before, after, claims: AtomicU32::new(0) });
    let started = tokio::time::Instant::now();
    let first = tokio::spawn({
        let (late, ledger, key) = (late.clone(), ledger.clone(), key.clone());
        async move { counted(&*late, &ledger, &key, "p", Duration::from_secs(1), lease).await }
    });
    tokio::time::sleep_until(started + before + lease + Duration::from_millis(100)).await;
    let duplicate = counted(&*store, &ledger, &key, "p", Duration::ZERO, lease).await;
    assert!(is_in_progress(&duplicate), "the key is still held by the first call: {duplicate:?}");
    assert_eq!(first.await.unwrap().expect("the first call records its result"), (1, "p#1".to_owned()));
    assert_eq!(ledger.count(&key), 1, "the body ran once");
}

/// A real store whose lease heartbeat never reaches it: every `extend` fails.
struct NoHeartbeat<S> {
    inner: Arc<S>,
}

impl<S> NoHeartbeat<S> {
    fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S: Store> Store for NoHeartbeat<S> {
    idempotent_runtime::forward_store!(direct NoHeartbeat::inner; claim complete release detach);

    async fn extend(&self, _: &Key, _: &Token, _: Duration) -> Result<(), StoreError> {
        Err(StoreError::backend("test", "the heartbeat cannot reach the store"))
    }
}

/// A body that outlives its lease while the heartbeat cannot reach the store, with nobody else
/// claiming the key, is recorded when it finishes: the caller gets its result, the retry replays
/// it, and the body ran once.
pub async fn a_body_whose_heartbeat_failed_is_still_recorded<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("blip");
    let blip = NoHeartbeat { inner: store.clone() };
    let first = counted(&blip, &ledger, &key, "p", Duration::from_millis(900), Duration::from_millis(300)).await;
    assert_eq!(first.expect("the uncontested result is recorded"), (1, "p#1".to_owned()));
    assert_eq!(quick(&*store, &ledger, &key).await.unwrap(), (1, "p#1".to_owned()), "the retry replays it");
    assert_eq!(ledger.count(&key), 1, "the body ran once");
}

/// A real store with a pause in chosen steps, to drop a call at a chosen point.
struct Paused<S> {
    inner: Arc<S>,
    /// Pause after the claim has reached the store, before its reply is returned.
    after_claim: Duration,
    /// Pause before a completion is sent.
    before_complete: Duration,
    /// Finish detached steps through this wrapper (so a detached completion is paused too), not
    /// through the inner store.
    detach_here: bool,
}

impl<S> Clone for Paused<S> {
    fn clone(&self) -> Self {
        Paused { inner: self.inner.clone(), ..*self }
    }
}

impl<S: Store + 'static> Store for Paused<S> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let claim = self.inner.claim(request).await;
        tokio::time::sleep(self.after_claim).await;
        claim
    }

    async fn complete(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
        tokio::time::sleep(self.before_complete).await;
        self.inner.complete(completion).await
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        self.inner.release(key, token).await
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        self.inner.extend(key, token, lease).await
    }

    fn detach(&self, step: Detached) {
        if self.detach_here {
            idempotent_runtime::stores::spawn_detached(self.clone(), step);
        } else {
            self.inner.detach(step);
        }
    }
}

/// A call dropped while its result is being recorded is recorded in the background: the body
/// does not run again, and the retry replays the result.
pub async fn a_call_dropped_while_recording_is_still_recorded<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("recording");
    let paused = Paused {
        inner: store.clone(),
        after_claim: Duration::ZERO,
        before_complete: Duration::from_secs(30),
        detach_here: false,
    };
    let first = counted(&paused, &ledger, &key, "p", Duration::ZERO, Duration::from_secs(30));
    assert!(tokio::time::timeout(Duration::from_millis(300), first).await.is_err());
    assert_eq!(ledger.count(&key), 1, "the body ran before the drop");
    let retry = counted_waiting(&*store, &ledger, &key, "p", Duration::ZERO).await.unwrap();
    assert_eq!(retry, (1, "p#1".to_owned()), "the retry replays the first result");
    assert_eq!(ledger.count(&key), 1);
}

/// A completion slower than the lease keeps the key: the heartbeat goes on renewing the claim
/// while the result is being recorded, so a duplicate that comes after the lease the claim had
/// when the body ended gets `InProgress`, not a second run. The completion takes one and a third
/// leases; renewals are sent until the body's lease would have ended, so the claim lasts until at
/// least one and two-thirds leases after the body.
pub async fn a_completion_slower_than_its_lease_keeps_the_key<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("slow-completion");
    let lease = Duration::from_millis(1200);
    let slow = Paused {
        inner: store.clone(),
        after_claim: Duration::ZERO,
        before_complete: lease * 4 / 3,
        detach_here: false,
    };
    let first = counted(&slow, &ledger, &key, "p", Duration::ZERO, lease);
    let duplicate = async {
        // After the lease the claim had when its body ended, before the completion lands.
        tokio::time::sleep(lease + Duration::from_millis(200)).await;
        counted(&*store, &ledger, &key, "p", Duration::ZERO, lease).await
    };
    let (first, duplicate) = tokio::join!(first, duplicate);
    assert_eq!(ledger.count(&key), 1, "the duplicate ran the body while the first result was being recorded");
    assert!(is_in_progress(&duplicate), "the duplicate must get InProgress, got {duplicate:?}");
    assert_eq!(first.expect("the first result is recorded"), (1, "p#1".to_owned()));
    assert_eq!(quick(&*store, &ledger, &key).await.unwrap(), (1, "p#1".to_owned()), "a retry replays it");
    assert_eq!(ledger.count(&key), 1);
}

/// A completion left to finish in the background, its caller dropped while the result was being
/// recorded, is renewed like one its caller waits for: a duplicate that comes after the lease the
/// claim had when its body ended gets `InProgress`, not a second run. The caller is dropped 100 ms
/// into recording, and the background completion takes one and a third leases of its own.
pub async fn a_detached_completion_slower_than_its_lease_keeps_the_key<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("slow-detached");
    let lease = Duration::from_millis(1200);
    let slow =
        Paused { inner: store.clone(), after_claim: Duration::ZERO, before_complete: lease * 4 / 3, detach_here: true };
    let first = counted(&slow, &ledger, &key, "p", Duration::ZERO, lease);
    assert!(tokio::time::timeout(Duration::from_millis(100), first).await.is_err());
    assert_eq!(ledger.count(&key), 1, "the body ran before the drop");
    // After the lease the claim had when its body ended, before the background completion lands.
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let duplicate = counted(&*store, &ledger, &key, "p", Duration::ZERO, lease).await;
    assert!(is_in_progress(&duplicate), "the duplicate must get InProgress, got {duplicate:?}");
    let retry = counted_waiting(&*store, &ledger, &key, "p", Duration::ZERO).await.unwrap();
    assert_eq!(retry, (1, "p#1".to_owned()), "a retry replays the result recorded in the background");
    assert_eq!(ledger.count(&key), 1);
}

/// A call dropped while its claim request is in flight never runs the body, and does not strand
/// the key for a lease: the claim it may have made is released in the background.
pub async fn a_call_dropped_while_claiming_does_not_strand_the_key<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("claiming");
    let paused = Paused {
        inner: store.clone(),
        after_claim: Duration::from_secs(30),
        before_complete: Duration::ZERO,
        detach_here: false,
    };
    let first = counted(&paused, &ledger, &key, "p", Duration::ZERO, Duration::from_secs(60));
    assert!(tokio::time::timeout(Duration::from_millis(300), first).await.is_err());
    assert_eq!(ledger.count(&key), 0, "the body never started");
    let retry =
        tokio::time::timeout(Duration::from_secs(15), counted_waiting(&*store, &ledger, &key, "p", Duration::ZERO));
    let retry = retry.await.expect("the key was stranded for the 60 s lease").unwrap();
    assert_eq!(retry, (1, "p#1".to_owned()));
}

/// Leases and retentions given at run time are checked before anything is claimed.
pub async fn invalid_durations_are_refused_before_claiming<S: Store + 'static>(store: Arc<S>, _: Expiry) {
    let ledger = Ledger::default();
    let key = unique("durations");
    let run = |lease: Duration, retention: Duration| {
        Call::new("conformance-durations", &key)
            .lease(lease)
            .retention(retention)
            .run(&*store, async { Ok::<_, TestError>(ledger.hit(&key)) })
    };
    for (lease, retention, option) in [
        (Duration::ZERO, Duration::from_secs(60), "lease"),
        (Duration::from_micros(999), Duration::from_secs(60), "lease"),
        (Duration::from_secs(60), Duration::from_secs(59), "retention"),
        // Without an upper bound these overflowed after the body ran, or claimed a key for ages.
        (Duration::MAX, Duration::MAX, "lease"),
        (idempotent_runtime::MAX_LEASE + Duration::from_millis(1), Duration::MAX, "lease"),
        (Duration::from_secs(60), Duration::MAX, "retention"),
        (Duration::from_secs(60), idempotent_runtime::MAX_RETENTION + Duration::from_millis(1), "retention"),
    ] {
        match run(lease, retention).await {
            Err(TestError::Idempotency(Error::InvalidOption { option: got, .. })) => assert_eq!(got, option),
            other => panic!("lease {lease:?}, retention {retention:?}: expected InvalidOption, got {other:?}"),
        }
    }
    let waited = Call::new("conformance-durations", &key)
        .wait(Duration::MAX)
        .run(&*store, async { Ok::<_, TestError>(ledger.hit(&key)) })
        .await;
    assert!(matches!(waited, Err(TestError::Idempotency(Error::InvalidOption { option: "wait", .. }))), "{waited:?}");
    assert_eq!(ledger.count(&key), 0, "no invalid duration ran the body");
    // The largest accepted ones run, record and replay.
    let longest = || {
        Call::new("conformance-durations-max", &key)
            .lease(idempotent_runtime::MAX_LEASE)
            .retention(idempotent_runtime::MAX_RETENTION)
            .wait(idempotent_runtime::MAX_WAIT)
            .run(&*store, async { Ok::<_, TestError>(ledger.hit(&key)) })
    };
    assert_eq!(longest().await.unwrap(), 1);
    assert_eq!(longest().await.unwrap(), 1, "replayed");
    let stored = Key::new("conformance-durations-max", &key.as_str()).unwrap();
    assert!(matches!(
        store.claim(&claim_request(&stored, &Token::new(), None, 1000)).await.unwrap(),
        Claim::Completed(_)
    ));
    ledger.0.lock().unwrap().remove(&key);
    // 1 ms is accepted (whether the record lands within so short a lease depends on the store).
    // A store whose claim reply takes longer than the lease never starts the body (the claim may
    // have ended before the reply came): after three such replies the call fails, without running.
    let shortest = run(Duration::from_millis(1), Duration::from_millis(1)).await;
    match &shortest {
        Err(TestError::Idempotency(Error::InvalidOption { .. })) => panic!("1 ms is a valid lease: {shortest:?}"),
        Err(TestError::Idempotency(Error::Store { operation: "claim", .. })) => assert_eq!(ledger.count(&key), 0),
        _ => assert_eq!(ledger.count(&key), 1, "{shortest:?}"),
    }
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

/// The arguments of a direct [`Store::claim`]: a lease of `lease_ms` milliseconds.
#[must_use]
pub fn claim_request<'a>(
    key: &'a Key,
    token: &'a Token,
    fingerprint: Option<&'a Fingerprint>,
    lease_ms: u64,
) -> ClaimRequest<'a> {
    ClaimRequest::new(key, token, fingerprint, Duration::from_millis(lease_ms))
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
            // SQLite keeps time to the millisecond and adds one (a claim never ends early).
            assert!(left > Duration::from_secs(25) && left <= Duration::from_millis(30_002), "{left:?}");
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    // Only the owner may renew, complete or release.
    assert!(matches!(store.extend(&key, &second, retention).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.complete_as(&key, &second, b"{}", retention).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.release(&key, &second).await, Err(StoreError::NotOwner)));
    // A completion carries the fingerprint its claim was made with.
    let done = Completion::new(&key, &first, Some(&fp), br#"{"Ok":1}"#, retention);
    store.complete(&done).await.unwrap();
    // Completed: replayed. Its owner's repeated completion succeeds and changes nothing (a retry
    // whose first reply was lost); anything else is refused.
    let replay = store.claim(&claim_request(&key, &second, None, 30_000)).await.unwrap();
    let recorded = Claim::Completed(Record::new(Some(fp.clone()), br#"{"Ok":1}"#.to_vec()));
    assert_eq!(replay, recorded);
    store.complete(&done).await.expect("a repeated completion succeeds");
    assert!(matches!(store.complete_as(&key, &second, b"{}", retention).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.release(&key, &first).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.extend(&key, &first, retention).await, Err(StoreError::NotOwner)));
    assert_eq!(store.claim(&claim_request(&key, &second, None, 30_000)).await.unwrap(), recorded, "unchanged");

    // The owner's renewal moves the end of the lease.
    let renewed = Key::new(&scope, &"k0").unwrap();
    assert_eq!(store.claim(&claim_request(&renewed, &first, None, 1_000)).await.unwrap(), Claim::Claimed);
    store.extend(&renewed, &first, Duration::from_secs(30)).await.unwrap();
    match store.claim(&claim_request(&renewed, &second, None, 30_000)).await.unwrap() {
        Claim::InProgress { lease_remaining: Some(left), .. } => assert!(left > Duration::from_secs(25), "{left:?}"),
        other => panic!("expected a renewed claim, got {other:?}"),
    }

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
    assert!(matches!(store.complete_as(&leased, &first, b"{}", retention).await, Err(StoreError::NotOwner)));
    assert!(matches!(store.release(&leased, &first).await, Err(StoreError::NotOwner)));
    store.complete_as(&leased, &second, br#"{"Ok":2}"#, retention).await.unwrap();

    // A completed record whose retention ended is claimable again.
    let retained = Key::new(&scope, &"k4").unwrap();
    assert_eq!(store.claim(&claim_request(&retained, &first, None, 30_000)).await.unwrap(), Claim::Claimed);
    store.complete_as(&retained, &first, b"{}", Duration::from_millis(100)).await.unwrap();
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
