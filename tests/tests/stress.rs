//! Stress: many keys × 16 concurrent duplicate callers, random delays and random body failures
//! (transient and final errors, panics, cancellations), on every store. Each run prints its counts
//! and fails on any double execution, lost record, stuck key, wrong result or overlapping body.
//!
//! CI runs the short version; `IDEMPOTENT_STRESS_KEYS=10000` runs the long one (see RELIABILITY.md):
//!
//! ```text
//! IDEMPOTENT_STRESS_KEYS=10000 cargo test -p idempotent-tests --release --test stress -- --nocapture --test-threads 1
//! ```

use idempotent_runtime::MemoryStore;
use idempotent_tests::stress::{self, StressConfig};

/// Keys per run in the short (CI) version; callers per key are 16 in both versions.
const SHORT_KEYS: usize = 400;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_memory_many_keys() {
    let mut config = StressConfig::from_env(SHORT_KEYS * 5);
    config.keys_in_flight = 128;
    let report = stress::run("memory", MemoryStore::new(), config).await;
    println!("{report}");
    report.assert_clean();
}

/// The same run with a store whose claim is a check followed, after a pause, by a write (not
/// atomic): the harness must see the double executions. This shows the stress tests can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_memory_harness_catches_a_racy_store() {
    let mut config = StressConfig::from_env(200);
    config.keys = 200;
    config.settle = std::time::Duration::from_millis(200);
    let report = stress::run("memory-racy", racy::RacyStore::default(), config).await;
    println!("{report}");
    assert!(report.double_executions > 0, "a non-atomic claim must show double executions:\n{report}");
    assert!(report.overlapping_bodies > 0, "and overlapping bodies:\n{report}");
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_redis_many_keys() {
    let Some((store, cleanup)) = idempotent_tests::fresh::redis("stress_redis_many_keys").await else { return };
    let report = stress::run("redis", store, StressConfig::from_env(SHORT_KEYS)).await;
    println!("{report}");
    cleanup.run().await;
    report.assert_clean();
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_postgres_many_keys() {
    let Some((store, cleanup)) = idempotent_tests::fresh::postgres("stress_postgres_many_keys").await else { return };
    let report = stress::run("postgres", store, StressConfig::from_env(SHORT_KEYS)).await;
    println!("{report}");
    cleanup.run().await;
    report.assert_clean();
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_mysql_many_keys() {
    let Some((store, cleanup)) = idempotent_tests::fresh::mysql("stress_mysql_many_keys").await else { return };
    let report = stress::run("mysql", store, StressConfig::from_env(SHORT_KEYS)).await;
    println!("{report}");
    cleanup.run().await;
    report.assert_clean();
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_sqlite_many_keys() {
    let (store, cleanup) = idempotent_tests::fresh::sqlite("stress").await;
    let report = stress::run("sqlite", store, StressConfig::from_env(SHORT_KEYS)).await;
    println!("{report}");
    cleanup.run().await;
    report.assert_clean();
}

/// A deliberately broken store for the harness's self-test. Not used anywhere else.
mod racy {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::time::Duration;

    use idempotent_runtime::{Claim, ClaimRequest, Detached, Fingerprint, Key, Record, Store, StoreError, Token};

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
                Some(Entry::Done(fp, outcome)) => {
                    Some(Claim::Completed(Record { fingerprint: fp.clone(), outcome: outcome.clone() }))
                }
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

        async fn complete(&self, key: &Key, token: &Token, outcome: &[u8], _: Duration) -> Result<(), StoreError> {
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
            if let Detached::Release { key, token } = step {
                let mut map = self.0.lock().unwrap();
                if matches!(map.get(key.as_str()), Some(Entry::Running(owner, _)) if owner == &token) {
                    map.remove(key.as_str());
                }
            }
        }
    }
}
