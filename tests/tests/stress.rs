//! Stress: many keys × 16 concurrent duplicate callers, random delays, and bodies that make their
//! side effect and then fail, panic, are cancelled while running (`OnCancel::Keep` and `Release`)
//! or while their result is recorded, plus callers dropped while claiming, on every store. Each run
//! prints its counts (double executions by promise, re-runs by design by documented limit) and
//! fails on any double execution in a promise, lost record, stuck key, wrong result or overlapping
//! body, or if an edge was never reached. The seed is fixed (`IDEMPOTENT_STRESS_SEED` overrides).
//!
//! CI runs the short version; `IDEMPOTENT_STRESS_KEYS=10000` runs the long one (see RELIABILITY.md):
//!
//! ```text
//! IDEMPOTENT_STRESS_KEYS=10000 cargo test -p idempotent-tests --release --test stress -- --nocapture --test-threads 1
//! ```

use idempotent_runtime::MemoryStore;
use idempotent_tests::stress::{self, Plan, StressConfig};

/// Keys per run in the short (CI) version; callers per key are 16 in both versions.
const SHORT_KEYS: usize = 400;

/// The PostgreSQL and MariaDB runs: a lease of 3 s and 16 keys in flight (256 concurrent calls on
/// a pool of 16 connections). With a 500 ms lease, a completion that waits for a pooled
/// connection longer than the lease loses its claim under this load (the caller gets
/// `Error::LeaseLost`, and the next caller runs the body again): see RELIABILITY.md.
fn pooled_config() -> StressConfig {
    let mut config = StressConfig::from_env(SHORT_KEYS);
    config.lease = std::time::Duration::from_secs(3);
    config.keys_in_flight = 16;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_memory_many_keys() {
    let mut config = StressConfig::from_env(SHORT_KEYS * 5);
    config.keys_in_flight = 128;
    let report = stress::run("memory", MemoryStore::new(), config).await;
    println!("{report}");
    report.assert_clean();
    report.assert_edges_seen();
}

/// The same run with a store whose claim is a check followed, after a pause, by a write (not
/// atomic): the harness must see the double executions. This shows the stress tests can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_memory_harness_catches_a_racy_store() {
    let mut config = StressConfig::from_env(200);
    config.keys = 200;
    config.settle = std::time::Duration::from_millis(200);
    // Its claims never expire: a claim kept by a cancellation would hold its waiters for their
    // whole wait.
    config.mix.retain(|(plan, _)| !matches!(plan, Plan::Cancel | Plan::EffectThenCancel));
    let report = stress::run("memory-racy", racy::RacyStore::default(), config).await;
    println!("{report}");
    assert!(report.double_executions > 0, "a non-atomic claim must show double executions:\n{report}");
    assert!(report.overlapping_bodies > 0, "and overlapping bodies:\n{report}");
}

/// The real memory store behind a wrapper that drops every background step (as a store without
/// `detach` would): results whose caller was dropped while recording are lost, and the harness
/// must count the re-runs under "cancelled while recording".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_memory_harness_catches_lost_background_completions() {
    let mut config = StressConfig::from_env(200);
    config.keys = 200;
    // Many drops while recording, so the count cannot be 0 by chance.
    config.mix = vec![(Plan::CancelWhileRecording, 200)];
    let report = stress::run("memory-no-detach", broken::NoDetach(MemoryStore::new()), config).await;
    println!("{report}");
    assert!(report.broken.cancel_while_recording > 0, "lost background completions must show:\n{report}");
    assert!(report.double_executions >= report.broken.cancel_while_recording, "{report}");
}

/// A completion finished in the background that never gets its record in is counted, per scope,
/// from `spawn_detached`'s log event: the failover test relies on that count to tell such a re-run
/// from a broken promise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_failed_background_completions_are_counted() {
    use std::time::Duration;

    use idempotent_runtime::{Call, Error};
    use idempotent_tests::unrecorded;

    assert!(unrecorded::watch(), "no other global tracing subscriber in this test binary");
    let store = broken::CompletionsFail(MemoryStore::new());
    let scope = "unrecorded-self-test";
    // The caller gives up while its completion is in flight (an application's timeout): the
    // completion goes on in the background, fails until the 1 s lease ends (each attempt takes
    // 500 ms, so not before 600 ms), and is dropped.
    let call = Call::new(scope, &1u32).lease(Duration::from_secs(1)).run(&store, async { Ok::<_, Error>(1) });
    assert!(tokio::time::timeout(Duration::from_millis(100), call).await.is_err(), "the call was dropped");
    assert_eq!(unrecorded::failed_in(scope), Some(0), "still retrying within the lease");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(unrecorded::failed_in(scope), Some(1));
    assert_eq!(unrecorded::failed_in("another-scope"), Some(0));
}

/// The real memory store behind a wrapper that gives every claim a tenth of the lease it was
/// asked for: claims kept by cancelled bodies end early, and the harness must count the re-runs
/// under "cancelled (keep) within the lease".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_memory_harness_catches_kept_claims_that_end_early() {
    let mut config = StressConfig::from_env(200);
    config.keys = 200;
    // Many cancellations after a side effect, so the count cannot be 0 by chance.
    config.mix = vec![(Plan::EffectThenCancel, 200)];
    let report = stress::run("memory-short-leases", broken::ShortLeases(MemoryStore::new()), config).await;
    println!("{report}");
    assert!(report.broken.cancel_keep > 0, "re-runs within a kept claim's lease must show:\n{report}");
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_redis_many_keys() {
    let Some((store, cleanup)) = idempotent_tests::fresh::redis("stress_redis_many_keys").await else { return };
    let report = stress::run("redis", store, StressConfig::from_env(SHORT_KEYS)).await;
    println!("{report}");
    cleanup.run().await;
    report.assert_clean();
    report.assert_edges_seen();
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_postgres_many_keys() {
    let Some((store, cleanup)) = idempotent_tests::fresh::postgres("stress_postgres_many_keys").await else { return };
    let report = Box::pin(stress::run("postgres", store, pooled_config())).await;
    println!("{report}");
    cleanup.run().await;
    report.assert_clean();
    report.assert_edges_seen();
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_mysql_many_keys() {
    let Some((store, cleanup)) = idempotent_tests::fresh::mysql("stress_mysql_many_keys").await else { return };
    let report = stress::run("mysql", store, pooled_config()).await;
    println!("{report}");
    cleanup.run().await;
    report.assert_clean();
    report.assert_edges_seen();
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_sqlite_many_keys() {
    let (store, cleanup) = idempotent_tests::fresh::sqlite("stress").await;
    let report = stress::run("sqlite", store, StressConfig::from_env(SHORT_KEYS)).await;
    println!("{report}");
    cleanup.run().await;
    report.assert_clean();
    report.assert_edges_seen();
}

/// A deliberately broken store for the harness's self-test. Not used anywhere else.
mod racy {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::time::Duration;

    use idempotent_runtime::{
        Claim, ClaimRequest, Completion, Detached, Fingerprint, Key, Record, Store, StoreError, Token,
    };

    enum Entry {
        Running(Token, Option<Fingerprint>),
        Done(Option<Fingerprint>, Vec<u8>),
    }

    #[derive(Default)]
    pub struct RacyStore(Mutex<HashMap<String, Entry>>);

    impl Store for RacyStore {
        async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
            let found = match self.0.lock().unwrap().get(request.key.as_str()) {
                Some(Entry::Running(_, fp)) => {
                    Some(Claim::InProgress { fingerprint: fp.clone(), lease_remaining: None })
                }
                Some(Entry::Done(fp, outcome)) => Some(Claim::Completed(Record::new(fp.clone(), outcome.clone()))),
                None => None,
            };
            if let Some(found) = found {
                return Ok(found);
            }
            // The bug: time passes between the check and the write.
            tokio::time::sleep(Duration::from_millis(1)).await;
            let entry = Entry::Running(request.token.clone(), request.fingerprint.cloned());
            self.0.lock().unwrap().insert(request.key.as_str().to_owned(), entry);
            Ok(Claim::Claimed)
        }

        async fn complete(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
            let (key, token, outcome) = (completion.key, completion.token, completion.outcome);
            let mut map = self.0.lock().unwrap();
            match map.get(key.as_str()) {
                Some(Entry::Running(owner, fp)) if owner == token => {
                    let fp = fp.clone();
                    map.insert(key.as_str().to_owned(), Entry::Done(fp, outcome.to_vec()));
                    Ok(())
                }
                _ => Err(StoreError::NotOwner),
            }
        }

        async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
            let mut map = self.0.lock().unwrap();
            match map.get(key.as_str()) {
                Some(Entry::Running(owner, _)) if owner == token => {
                    map.remove(key.as_str());
                    Ok(())
                }
                _ => Err(StoreError::NotOwner),
            }
        }

        async fn extend(&self, key: &Key, token: &Token, _: Duration) -> Result<(), StoreError> {
            match self.0.lock().unwrap().get(key.as_str()) {
                Some(Entry::Running(owner, _)) if owner == token => Ok(()),
                _ => Err(StoreError::NotOwner),
            }
        }

        fn detach(&self, step: Detached) {
            let mut map = self.0.lock().unwrap();
            match step {
                Detached::Release { key, token } => {
                    if matches!(map.get(key.as_str()), Some(Entry::Running(owner, _)) if owner == &token) {
                        map.remove(key.as_str());
                    }
                }
                Detached::Complete { key, token, outcome, .. } => {
                    if let Some(Entry::Running(owner, fp)) = map.get(key.as_str())
                        && owner == &token
                    {
                        let done = Entry::Done(fp.clone(), outcome);
                        map.insert(key.as_str().to_owned(), done);
                    }
                }
                _ => {}
            }
        }
    }
}

/// Wrappers around the real memory store that break one promise each, for the harness's
/// self-tests. Not used anywhere else.
mod broken {
    use std::time::Duration;

    use idempotent_runtime::{Claim, ClaimRequest, Completion, Detached, Key, MemoryStore, Store, StoreError, Token};

    /// Forwards everything except `detach`, which drops the step.
    pub struct NoDetach(pub MemoryStore);

    impl Store for NoDetach {
        async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
            self.0.claim(request).await
        }

        async fn complete(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
            self.0.complete(completion).await
        }

        async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
            self.0.release(key, token).await
        }

        async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
            self.0.extend(key, token, lease).await
        }

        fn detach(&self, step: Detached) {
            drop(step);
        }
    }

    /// A shared store (its steps detached to a task, as Redis and SQL stores do) whose
    /// completions never succeed: each waits 500 ms and fails as a store that is down would.
    #[derive(Clone)]
    pub struct CompletionsFail(pub MemoryStore);

    impl Store for CompletionsFail {
        async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
            self.0.claim(request).await
        }

        async fn complete(&self, _: &Completion<'_>) -> Result<(), StoreError> {
            tokio::time::sleep(Duration::from_millis(500)).await;
            Err(StoreError::backend("completions-fail", "the store is down"))
        }

        async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
            self.0.release(key, token).await
        }

        async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
            self.0.extend(key, token, lease).await
        }

        fn detach(&self, step: Detached) {
            idempotent_runtime::stores::spawn_detached(self.clone(), step);
        }
    }

    /// Forwards everything, with a tenth of each lease asked for.
    pub struct ShortLeases(pub MemoryStore);

    impl Store for ShortLeases {
        async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
            let mut shortened = *request;
            shortened.lease = request.lease / 10;
            self.0.claim(&shortened).await
        }

        async fn complete(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
            self.0.complete(completion).await
        }

        async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
            self.0.release(key, token).await
        }

        async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
            self.0.extend(key, token, lease / 10).await
        }

        fn detach(&self, step: Detached) {
            self.0.detach(step);
        }
    }
}
