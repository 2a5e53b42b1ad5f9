//! The three SQL stores, one test body each, run per backend: the conformance suite on the pooled
//! and on the transactional store, the table as a DBA sees it, purging (also 200,000 expired rows
//! while claims flow), the lease heartbeat and late steps, transactional mode, lock waits, killed
//! connections and a stalled network.
//!
//! Every body is written once, in [`sql_tests!`], and expanded in the modules `postgres`, `mysql`
//! and `sqlite`, so `cargo test postgres` (or `mysql`, `sqlite`) selects one backend. Each module
//! states only what differs: how it makes a fresh store, its placeholders, and the few statements
//! a test runs by hand. MySQL runs against MariaDB 10.11 here. Tests that need a network (killed
//! connections, a stalled proxy) run on PostgreSQL and MariaDB only.

#![allow(clippy::items_after_statements, reason = "test helpers stay next to their one use")]

use idempotent_tests::StoreSteps;
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotent_runtime::admin::{self, ListQuery, Released, State};
use idempotent_runtime::stores::sql::{SqlStore, SqlTxStore, TimedOut, is_unique_violation, sqlx};
use idempotent_runtime::{Claim, Error, Key, Store, StoreError, Token, idempotent};
use idempotent_tests::conformance::claim_request as request;
use serde::{Deserialize, Serialize};
use sqlx::AssertSqlSafe;

/// Tables made by these tests are named `idem_t_<unix seconds>_<tag>_<random>`; ones older than an
/// hour (left by a failed run, or by the conformance suite, which keeps its store) are dropped
/// when a new one is made.
const STALE_AFTER_SECS: u64 = 3600;

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

fn fresh_table(tag: &str) -> String {
    format!("idem_t_{}_{tag}_{}", now_secs(), &uuid::Uuid::new_v4().simple().to_string()[..12])
}

fn is_stale(table: &str) -> bool {
    let made = table.split('_').nth(2).and_then(|s| s.parse::<u64>().ok());
    made.is_some_and(|made| now_secs().saturating_sub(made) > STALE_AFTER_SECS)
}

fn is_deadlock(error: &StoreError) -> bool {
    let (StoreError::Backend { source, .. } | StoreError::Aborted { source, .. }) = error else { return false };
    source
        .downcast_ref::<sqlx::Error>()
        .and_then(sqlx::Error::as_database_error)
        .is_some_and(|e| e.code().as_deref() == Some("40001"))
}

/// The `p`-th percentile of `samples` (sorted in place), in milliseconds.
fn percentile_ms(samples: &mut [Duration], p: f64) -> f64 {
    samples.sort();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    let rank = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[rank].as_secs_f64() * 1000.0
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Receipt {
    id: String,
    user: String,
    amount: i64,
    balance_after: i64,
}

#[derive(Debug)]
#[allow(dead_code, reason = "the payloads are read through Debug in assertion messages")]
enum PayError {
    Insufficient,
    Injected,
    Db(sqlx::Error),
    Idempotency(Error),
}

impl From<Error> for PayError {
    fn from(e: Error) -> Self {
        PayError::Idempotency(e)
    }
}

impl From<sqlx::Error> for PayError {
    fn from(e: sqlx::Error) -> Self {
        PayError::Db(e)
    }
}

/// How the body behaves after its UPDATE: hold the transaction open, or fail.
#[derive(Clone, Copy)]
enum After {
    Return,
    Hold(Duration),
    Fail,
}

/// Counts `InnoDB` deadlock victims the tests ran again (printed, for the record).
static DEADLOCKS: AtomicU32 = AtomicU32::new(0);

/// The test bodies, expanded once per backend module. The module provides: `type D` (the
/// dialect) and `type Db`; `fn q(sql)` (its placeholders from `?`); `async fn fresh(tag) ->
/// Option<Fresh>`; `async fn admin(fresh)`; `const SHELL: &str` (state, `$.Ok.name` of the outcome,
/// and 1 if `expires_at` is over 59 minutes away, for `{t}`, key `orders:A-1`); `async fn
/// with_schema(fresh) -> (table, cleanup statement)`; `const SERIES: &str` (`{t}` filled with
/// `{n}` expired rows in one statement).
macro_rules! sql_tests {
    () => {
        use super::*;

        type Sql = SqlStore<D>;
        type Tx = SqlTxStore<D>;
        type Pool = sqlx::Pool<Db>;

        idempotent_tests::conformance_suite!(conformance, async { fresh("conf").await.map(|f| f.keep()) });
        idempotent_tests::conformance_suite!(conformance_batching, async {
            fresh("confb").await.map(|f| idempotent_runtime::stores::batching::BatchingStore::new(f.keep()))
        });
        idempotent_tests::conformance_suite!(
            conformance_tx,
            async {
                let store = fresh("conftx").await?.keep();
                Some(store.begin().await.expect("begin"))
            },
            transactional
        );

        impl Fresh<Sql> {
            /// Drops the table (or deletes the file's directory).
            async fn cleanup(self) {
                match self.cleanup {
                    Cleanup::DropTable => {
                        let sql = format!("DROP TABLE IF EXISTS {}", self.store.table());
                        let _ = sqlx::raw_sql(AssertSqlSafe(sql)).execute(self.store.pool()).await;
                    }
                    Cleanup::Dir(dir) => {
                        self.store.pool().close().await;
                        let _ = std::fs::remove_dir_all(dir);
                    }
                }
            }
        }

        async fn count(store: &Sql) -> i64 {
            let sql = format!("SELECT COUNT(*) FROM {}", store.table());
            sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(store.pool()).await.unwrap()
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn records_read_as_json_in_a_db_shell() {
            let Some(fresh) = fresh("shell").await else { return };
            let store = &fresh.store;
            let key = Key::new("orders", &"A-1").unwrap();
            let token = Token::new();
            store.claim(&request(&key, &token, None, 30_000)).await.unwrap();
            store.complete_as(&key, &token, br#"{"Ok":{"id":7,"name":"x"}}"#, Duration::from_secs(3600)).await.unwrap();
            let sql = SHELL.replace("{t}", store.table());
            let (state, name, later): (String, String, i64) =
                sqlx::query_as(AssertSqlSafe(sql)).fetch_one(store.pool()).await.unwrap();
            assert_eq!((state.as_str(), name.as_str()), ("completed", "x"));
            assert_eq!(later, 1, "expires_at is now + retention by the database's clock");
            assert!(store.create_table_sql().contains("CREATE TABLE IF NOT EXISTS idem_t_"));
            store.create_table().await.expect("create_table is idempotent too");
            fresh.cleanup().await;
        }

        /// Several processes starting at once each create the table (`AnyStore::from_url` does):
        /// on PostgreSQL, concurrent `CREATE TABLE IF NOT EXISTS` can fail with a unique violation
        /// in the catalog instead of finding the table, and the store must not fail for it.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn create_table_run_by_many_stores_at_once_succeeds() {
            let Some(fresh) = fresh("create").await else { return };
            for round in 0..6 {
                let table = fresh_table(&format!("cc{round}"));
                let stores: Vec<Sql> =
                    (0..8).map(|_| Sql::with_table(fresh.store.pool().clone(), &table).unwrap()).collect();
                let created = futures_util::future::join_all(stores.iter().map(Sql::create_table)).await;
                for result in created {
                    result.unwrap_or_else(|e| panic!("round {round}: create_table failed: {e:?}"));
                }
                let key = Key::new("s", &"k").unwrap();
                assert_eq!(stores[0].claim(&request(&key, &Token::new(), None, 30_000)).await.unwrap(), Claim::Claimed);
                let sql = format!("DROP TABLE IF EXISTS {table}");
                sqlx::raw_sql(AssertSqlSafe(sql)).execute(fresh.store.pool()).await.unwrap();
            }
            fresh.cleanup().await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn table_names_are_validated_and_may_name_a_schema() {
            let Some(fresh) = fresh("names").await else { return };
            for bad in ["x; DROP TABLE users", "a.b.c", "1x", "x-y", ""] {
                assert!(Sql::with_table(fresh.store.pool().clone(), bad).is_err(), "{bad:?}");
            }
            let (table, cleanup) = with_schema(&fresh).await;
            let store = Sql::with_table(fresh.store.pool().clone(), &table).unwrap();
            store.create_table().await.unwrap();
            let key = Key::new("s", &"k").unwrap();
            let token = Token::new();
            assert_eq!(store.claim(&request(&key, &token, None, 30_000)).await.unwrap(), Claim::Claimed);
            store.complete_as(&key, &token, b"{}", Duration::from_secs(60)).await.unwrap();
            sqlx::raw_sql(AssertSqlSafe(cleanup)).execute(store.pool()).await.unwrap();
            fresh.cleanup().await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn purge_removes_only_expired_rows_and_the_task_stops() {
            let Some(fresh) = fresh("purge").await else { return };
            // Batches of 3, so the ten rows take several statements.
            let store = fresh.store.clone().with_purge_batch(3);
            for i in 0..10 {
                let key = Key::new("p", &i).unwrap();
                let token = Token::new();
                store.claim(&request(&key, &token, None, 30_000)).await.unwrap();
                // Even keys expire at once, odd ones live for an hour.
                let retention = if i % 2 == 0 { Duration::from_millis(1) } else { Duration::from_secs(3600) };
                store.complete_as(&key, &token, b"{}", retention).await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert_eq!(store.purge_expired().await.unwrap(), 5);
            assert_eq!(count(&store).await, 5);

            // The background task purges what expires later, and stops on shutdown.
            for i in 10..13 {
                let key = Key::new("p", &i).unwrap();
                store.claim(&request(&key, &Token::new(), None, 50)).await.unwrap(); // abandoned claims
            }
            let task = store.spawn_purge(Duration::from_millis(100));
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while count(&store).await > 5 {
                assert!(tokio::time::Instant::now() < deadline, "the purge task did not remove the expired claims");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tokio::time::timeout(Duration::from_secs(5), task.shutdown()).await.expect("shutdown returns promptly");
            fresh.cleanup().await;
        }

        /// A purge passes over an expired row that a business transaction holds (it took the key
        /// over and has not committed yet): it deletes the other expired rows and returns, where
        /// waiting on that row's lock would stall every purge until the transaction ends, or fail
        /// it at the server's lock timeout. SQLite locks the whole database, so it has no such row.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn purge_passes_over_a_row_a_transaction_holds() {
            if !ROW_LOCKS {
                eprintln!("{}: skipped: this backend locks the whole database, not rows", module_path!());
                return;
            }
            let Some(fresh) = fresh("purgeheld").await else { return };
            // Batches of 2, so the purge runs several statements after the held row.
            let store = fresh.store.clone().with_purge_batch(2);
            let keys: Vec<Key> = (0..5).map(|i| Key::new("held", &i).unwrap()).collect();
            for key in &keys {
                let token = Token::new();
                store.claim(&request(key, &token, None, 30_000)).await.unwrap();
                store.complete_as(key, &token, b"{}", Duration::from_millis(1)).await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            // The first key, the one that expired first, taken over in a transaction: its row is
            // locked, and still expired to everyone else, until the transaction ends.
            let (tx, token) = (store.begin().await.unwrap(), Token::new());
            assert_eq!(tx.claim(&request(&keys[0], &token, None, 30_000)).await.unwrap(), Claim::Claimed);
            let purge = tokio::time::timeout(Duration::from_secs(20), store.purge_expired()).await;
            let purged = purge.expect("the purge waited on the row the transaction holds");
            assert_eq!(purged.expect("the purge"), 4, "every expired row but the held one");
            tx.complete_as(&keys[0], &token, b"{}", Duration::from_secs(3600)).await.unwrap();
            tx.commit().await.unwrap();
            assert_eq!(count(&store).await, 1, "the key the transaction claimed, live");
            fresh.cleanup().await;
        }

        /// 200,000 expired rows are purged in batches while 8 callers keep claiming and
        /// completing new keys: every claim succeeds, and the claims' p99 during the purge is
        /// printed (the numbers go to BENCHMARKS.md; no timing is asserted).
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn purge_of_200k_expired_rows_lets_claims_flow() {
            const ROWS: u64 = 200_000;
            let Some(fresh) = fresh("bulk").await else { return };
            let store = fresh.store.clone();
            let started = std::time::Instant::now();
            let fill = SERIES.replace("{t}", store.table()).replace("{n}", &ROWS.to_string());
            sqlx::raw_sql(AssertSqlSafe(fill)).execute(store.pool()).await.unwrap();
            let filled = started.elapsed();
            assert_eq!(count(&store).await, i64::try_from(ROWS).unwrap());

            let purging = Arc::new(std::sync::atomic::AtomicBool::new(true));
            let claimers: Vec<_> = (0..8)
                .map(|c| {
                    let (store, purging) = (store.clone(), Arc::clone(&purging));
                    tokio::spawn(async move {
                        let mut latencies = Vec::new();
                        let mut i = 0u32;
                        while purging.load(Ordering::SeqCst) || latencies.len() < 10 {
                            let key = Key::new("flow", &format!("{c}-{i}")).unwrap();
                            let token = Token::new();
                            let t = std::time::Instant::now();
                            let claim = store.claim(&request(&key, &token, None, 60_000)).await;
                            latencies.push(t.elapsed());
                            assert_eq!(claim.unwrap(), Claim::Claimed, "a claim during the purge");
                            store.complete_as(&key, &token, b"{}", Duration::from_secs(3600)).await.unwrap();
                            i += 1;
                        }
                        latencies
                    })
                })
                .collect();
            let t = std::time::Instant::now();
            let purged = store.purge_expired().await.unwrap();
            let took = t.elapsed();
            purging.store(false, Ordering::SeqCst);
            let mut latencies = Vec::new();
            for claimer in claimers {
                latencies.extend(claimer.await.unwrap());
            }
            assert_eq!(purged, ROWS, "every expired row, and no live one");
            assert_eq!(count(&store).await, i64::try_from(latencies.len()).unwrap(), "the claims' rows remain");
            let claims = latencies.len();
            let (p50, p99) = (percentile_ms(&mut latencies, 0.50), percentile_ms(&mut latencies, 0.99));
            eprintln!(
                "{}: filled {ROWS} expired rows in {filled:.2?}; purged in {took:.2?} (batches of {}); \
                 {claims} claims meanwhile, p50 {p50:.2} ms, p99 {p99:.2} ms",
                module_path!(),
                idempotent_runtime::stores::sql::DEFAULT_PURGE_BATCH
            );
            fresh.cleanup().await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn unique_violations_are_recognised() {
            let Some(fresh) = fresh("orders").await else { return };
            let pool = fresh.store.pool();
            let table = fresh_table("orders");
            sqlx::query(AssertSqlSafe(format!("CREATE TABLE {table} (order_no VARCHAR(64) PRIMARY KEY)")))
                .execute(pool)
                .await
                .unwrap();
            let insert = || sqlx::query(AssertSqlSafe(q(&format!("INSERT INTO {table} (order_no) VALUES (?)")))).bind("A-1");
            insert().execute(pool).await.unwrap();
            let duplicate = insert().execute(pool).await.unwrap_err();
            assert!(is_unique_violation(&duplicate), "{duplicate:?}");
            let other = sqlx::query("SELECT * FROM no_such_table_here").execute(pool).await.unwrap_err();
            assert!(!is_unique_violation(&other));
            sqlx::query(AssertSqlSafe(format!("DROP TABLE {table}"))).execute(pool).await.unwrap();
            fresh.cleanup().await;
        }

        /// The lease heartbeat and the steps that come too late, called directly: `extend` moves a
        /// live lease; after the lease ended (even with nobody taking over) complete, extend and
        /// release are refused and change nothing; a completion repeated with the same token is
        /// `Ok`, with another token `NotOwner`.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn extend_and_late_steps_are_fenced_by_lease_and_token() {
            let Some(fresh) = fresh("lease").await else { return };
            let store = &fresh.store;
            let key = Key::new("lease", &"k").unwrap();
            let (mine, other) = (Token::new(), Token::new());
            let retention = Duration::from_secs(60);
            assert_eq!(store.claim(&request(&key, &mine, None, 300)).await.unwrap(), Claim::Claimed);
            // A heartbeat keeps a short lease alive well past its first end.
            for _ in 0..4 {
                tokio::time::sleep(Duration::from_millis(150)).await;
                store.extend(&key, &mine, Duration::from_millis(300)).await.unwrap();
            }
            assert!(matches!(store.extend(&key, &other, retention).await, Err(StoreError::NotOwner)));
            match store.claim(&request(&key, &other, None, 30_000)).await.unwrap() {
                // SQLite keeps expires_at to the millisecond and adds one: the remainder may be up
                // to two over.
                Claim::InProgress { lease_remaining: Some(left), .. } => assert!(left <= Duration::from_millis(302), "{left:?}"),
                found => panic!("the extended lease is live: {found:?}"),
            }
            // The lease ends; nobody takes over: renewal and release are refused, and the late
            // completion is recorded (refusing it would run the body again).
            tokio::time::sleep(Duration::from_millis(450)).await;
            assert!(matches!(store.extend(&key, &mine, retention).await, Err(StoreError::NotOwner)));
            assert!(matches!(store.release(&key, &mine).await, Err(StoreError::NotOwner)));
            assert_eq!(count(store).await, 1, "the expired claim is still there, unchanged");
            store.complete_as(&key, &mine, br#"{"Ok":0}"#, retention).await.expect("the uncontested late completion");
            assert!(matches!(store.claim(&request(&key, &other, None, 30_000)).await.unwrap(), Claim::Completed(_)));

            // A repeated completion (its reply was lost) is Ok for the same token only.
            let key = Key::new("lease", &"k2").unwrap();
            assert_eq!(store.claim(&request(&key, &other, None, 30_000)).await.unwrap(), Claim::Claimed);
            store.complete_as(&key, &other, br#"{"Ok":1}"#, retention).await.unwrap();
            store.complete_as(&key, &other, br#"{"Ok":2}"#, retention).await.expect("the same token again");
            assert!(matches!(store.complete_as(&key, &mine, b"{}", retention).await, Err(StoreError::NotOwner)));
            assert!(matches!(store.extend(&key, &other, retention).await, Err(StoreError::NotOwner)));
            match store.claim(&request(&key, &mine, None, 30_000)).await.unwrap() {
                Claim::Completed(record) => assert_eq!(record.outcome, &br#"{"Ok":1}"#[..], "the first completion stands"),
                found => panic!("{found:?}"),
            }
            let missing = Key::new("lease", &"missing").unwrap();
            assert!(matches!(store.extend(&missing, &mine, retention).await, Err(StoreError::NotOwner)));
            // The transactional store's extend is Ok at once: its claim lives as long as its transaction.
            let tx = store.begin().await.unwrap();
            tx.extend(&missing, &mine, retention).await.unwrap();
            tx.rollback().await.unwrap();
            fresh.cleanup().await;
        }

        // ---- Transactional mode: deduct_balance from the design notes ----

        async fn debit(tx: &Tx, user: &str, amount: i64) -> Result<Option<i64>, sqlx::Error> {
            let mut conn = tx.conn().await;
            let update = q("UPDATE idem_test_users SET balance = balance - ? WHERE id = ? AND balance >= ?");
            let debited =
                sqlx::query(AssertSqlSafe(update)).bind(amount).bind(user).bind(amount).execute(&mut *conn).await?;
            if debited.rows_affected() == 0 {
                return Ok(None);
            }
            let select = q("SELECT balance FROM idem_test_users WHERE id = ?");
            sqlx::query_scalar(AssertSqlSafe(select)).bind(user).fetch_one(&mut *conn).await.map(Some)
        }

        #[idempotent(key = request_id, store = tx, fingerprint = (user, amount))]
        async fn deduct_balance(tx: &Tx, request_id: &str, user: &str, amount: i64) -> Result<Receipt, PayError> {
            deduct(tx, user, amount, After::Return).await
        }

        #[idempotent(key = request_id, store = tx, fingerprint = (user, amount), scope = "deduct_balance")]
        async fn deduct_then(
            tx: &Tx,
            request_id: &str,
            user: &str,
            amount: i64,
            after: After,
        ) -> Result<Receipt, PayError> {
            deduct(tx, user, amount, after).await
        }

        async fn deduct(tx: &Tx, user: &str, amount: i64, after: After) -> Result<Receipt, PayError> {
            let balance_after = debit(tx, user, amount).await?.ok_or(PayError::Insufficient)?;
            match after {
                After::Return => {}
                After::Hold(hold) => tokio::time::sleep(hold).await,
                After::Fail => return Err(PayError::Injected),
            }
            Ok(Receipt { id: uuid::Uuid::new_v4().to_string(), user: user.to_owned(), amount, balance_after })
        }

        /// Runs one call in its own transaction, committing on `Ok` and rolling back on `Err`. A
        /// transaction `InnoDB` rolled back as a deadlock victim is run again, as an application would.
        async fn in_tx<F, Fut>(store: &Sql, call: F) -> Result<Receipt, PayError>
        where
            F: Fn(Arc<Tx>) -> Fut,
            Fut: Future<Output = Result<Receipt, PayError>>,
        {
            let mut deadlocks = 0;
            loop {
                let tx = Arc::new(store.begin().await?);
                let result = call(Arc::clone(&tx)).await;
                let tx = Arc::into_inner(tx).expect("the call is over");
                match &result {
                    Ok(_) => tx.commit().await?,
                    Err(_) => tx.rollback().await?,
                }
                match result {
                    Err(PayError::Idempotency(Error::Store { source, .. })) if deadlocks < 10 && is_deadlock(&source) => {
                        deadlocks += 1;
                        DEADLOCKS.fetch_add(1, Ordering::SeqCst);
                    }
                    result => return result,
                }
            }
        }

        static USERS: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

        /// A user with `balance`, in a table shared by these tests (each test has its own user).
        async fn new_user(pool: &Pool, balance: i64) -> String {
            USERS
                .get_or_init(|| async {
                    let create = "CREATE TABLE IF NOT EXISTS idem_test_users (id VARCHAR(64) PRIMARY KEY, balance BIGINT NOT NULL)";
                    sqlx::query(create).execute(pool).await.unwrap();
                })
                .await;
            let id = format!("user-{}", uuid::Uuid::new_v4().simple());
            let insert = q("INSERT INTO idem_test_users (id, balance) VALUES (?, ?)");
            sqlx::query(AssertSqlSafe(insert)).bind(&id).bind(balance).execute(pool).await.unwrap();
            id
        }

        async fn balance(pool: &Pool, user: &str) -> i64 {
            let select = q("SELECT balance FROM idem_test_users WHERE id = ?");
            sqlx::query_scalar(AssertSqlSafe(select)).bind(user).fetch_one(pool).await.unwrap()
        }

        async fn key_rows(store: &Sql, key: &str) -> i64 {
            let sql = q(&format!("SELECT COUNT(*) FROM {} WHERE idempotency_key = ?", store.table()));
            sqlx::query_scalar(AssertSqlSafe(sql)).bind(key).fetch_one(store.pool()).await.unwrap()
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn transactional_duplicates_deduct_once_and_share_the_receipt() {
            let Some(fresh) = fresh("txdup").await else { return };
            let store = fresh.store.clone();
            let user = new_user(store.pool(), 1_000).await;
            let barrier = Arc::new(tokio::sync::Barrier::new(64));
            let calls: Vec<_> = (0..64)
                .map(|_| {
                    let (store, user, barrier) = (store.clone(), user.clone(), barrier.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        in_tx(&store, |tx| {
                            let user = user.clone();
                            async move { deduct_balance(&tx, "req-1", &user, 100).await }
                        })
                        .await
                    })
                })
                .collect();
            let mut receipts = HashSet::new();
            for call in calls {
                let receipt = call.await.unwrap().expect("every duplicate gets the receipt");
                receipts.insert(receipt.id.clone());
                assert_eq!((receipt.amount, receipt.balance_after), (100, 900));
            }
            assert_eq!(receipts.len(), 1, "all 64 callers get the same receipt");
            assert_eq!(balance(store.pool(), &user).await, 900, "deducted exactly once");
            eprintln!("InnoDB deadlock victims retried so far: {}", DEADLOCKS.load(Ordering::SeqCst));
            fresh.cleanup().await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn transactional_failure_leaves_neither_deduction_nor_key() {
            let Some(fresh) = fresh("txfail").await else { return };
            let store = fresh.store.clone();
            let user = new_user(store.pool(), 1_000).await;
            let failed = in_tx(&store, |tx| {
                let user = user.clone();
                async move { deduct_then(&tx, "req-f", &user, 300, After::Fail).await }
            })
            .await;
            assert!(matches!(failed, Err(PayError::Injected)), "{failed:?}");
            assert_eq!(balance(store.pool(), &user).await, 1_000, "the deduction rolled back");
            assert_eq!(key_rows(&store, "deduct_balance:req-f").await, 0, "the key rolled back");

            // A rollback after success also leaves nothing, and a duplicate then runs.
            let tx = store.begin().await.unwrap();
            deduct_balance(&tx, "req-r", &user, 300).await.unwrap();
            tx.rollback().await.unwrap();
            assert_eq!((balance(store.pool(), &user).await, key_rows(&store, "deduct_balance:req-r").await), (1_000, 0));
            let receipt = in_tx(&store, |tx| {
                let user = user.clone();
                async move { deduct_balance(&tx, "req-r", &user, 300).await }
            })
            .await
            .unwrap();
            assert_eq!(receipt.balance_after, 700);
            fresh.cleanup().await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn transactional_balance_never_goes_negative() {
            let Some(fresh) = fresh("txneg").await else { return };
            let store = fresh.store.clone();
            let user = new_user(store.pool(), 1_000).await;
            // 40 distinct requests of 100 each, every one sent twice, against a balance of 1,000.
            let calls: Vec<_> = (0..80)
                .map(|i| {
                    let (store, user) = (store.clone(), user.clone());
                    tokio::spawn(async move {
                        let request_id = format!("req-{}", i % 40);
                        in_tx(&store, |tx| {
                            let (user, request_id) = (user.clone(), request_id.clone());
                            async move { deduct_balance(&tx, &request_id, &user, 100).await }
                        })
                        .await
                    })
                })
                .collect();
            let mut paid = HashSet::new();
            let mut refused = 0;
            for call in calls {
                match call.await.unwrap() {
                    Ok(receipt) => {
                        paid.insert(receipt.id);
                    }
                    Err(PayError::Insufficient) => refused += 1,
                    Err(other) => panic!("unexpected {other:?}"),
                }
            }
            assert_eq!(paid.len(), 10, "ten distinct payments fit in the balance");
            assert!(refused >= 30, "{refused} refusals");
            assert_eq!(balance(store.pool(), &user).await, 0, "never negative, never over-deducted");
            eprintln!("InnoDB deadlock victims retried so far: {}", DEADLOCKS.load(Ordering::SeqCst));
            fresh.cleanup().await;
        }

        /// In the transactional mode recording is committing: a completion that the database
        /// refuses inside the transaction (here a trigger) is an error the caller sees at once, not
        /// the body's `Ok` after a lease of retries, and the transaction refuses to commit.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn tx_completion_refused_in_the_transaction_is_an_error_not_ok() {
            let Some(fresh) = fresh("txrefused").await else { return };
            let store = fresh.store.clone();
            for statement in refuse_completions(store.table()) {
                sqlx::raw_sql(AssertSqlSafe(statement)).execute(store.pool()).await.unwrap();
            }
            let user = new_user(store.pool(), 1_000).await;
            let tx = store.begin().await.unwrap();
            let started = std::time::Instant::now();
            let result = deduct_then(&tx, "req-t", &user, 100, After::Return).await;
            let elapsed = started.elapsed();
            assert!(
                matches!(
                    &result,
                    Err(PayError::Idempotency(Error::Store { operation: "complete", source: StoreError::Aborted { .. }, .. }))
                ),
                "the refused completion must be an error, not the body's Ok: {result:?}"
            );
            assert!(elapsed < Duration::from_secs(5), "refusals are not retried for the 60 s lease ({elapsed:?})");
            let committed = tx.commit().await;
            assert!(committed.is_err(), "a transaction whose completion failed does not commit: {committed:?}");
            assert_eq!(balance(store.pool(), &user).await, 1_000, "nothing was deducted");
            assert_eq!(key_rows(&store, "deduct_balance:req-t").await, 0, "nothing was recorded");
            fresh.cleanup().await;
        }

        /// A call dropped while its body runs (a timeout around it; `OnCancel::Keep`, the
        /// default) leaves its claim and the body's partial work in the transaction. Committed,
        /// they would stay: the key claimed with no record for its lease, then a retry running the
        /// body a second time. `commit` refuses instead, and the retry runs once.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn tx_commit_refuses_after_a_call_dropped_in_its_body() {
            let Some(fresh) = fresh("txdropped").await else { return };
            let store = fresh.store.clone();
            let user = new_user(store.pool(), 1_000).await;
            let tx = store.begin().await.unwrap();
            let call = deduct_then(&tx, "req-d", &user, 100, After::Hold(Duration::from_secs(30)));
            assert!(tokio::time::timeout(Duration::from_millis(300), call).await.is_err(), "the body was still running");
            let committed = tx.commit().await;
            assert!(
                matches!(&committed, Err(sqlx::Error::InvalidArgument(reason)) if reason.contains("deduct_balance:req-d")),
                "a transaction holding a dropped call's claim does not commit: {committed:?}"
            );
            assert_eq!(balance(store.pool(), &user).await, 1_000, "the dropped body's debit rolled back");
            assert_eq!(key_rows(&store, "deduct_balance:req-d").await, 0, "its claim rolled back");
            let receipt = in_tx(&store, |tx| {
                let user = user.clone();
                async move { deduct_balance(&tx, "req-d", &user, 100).await }
            })
            .await
            .unwrap();
            assert_eq!((receipt.balance_after, balance(store.pool(), &user).await), (900, 900), "the retry ran once");
            fresh.cleanup().await;
        }

        /// A duplicate waits on the row the first transaction claimed until the server's lock
        /// timeout, then gets a typed store error carrying the server's code; once the first
        /// transaction commits, a new duplicate replays its receipt.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn tx_duplicate_waits_for_the_lock_timeout() {
            let Some(fresh) = fresh("txwait").await else { return };
            let store = fresh.store.clone();
            let user = new_user(store.pool(), 1_000).await;
            let first = store.begin().await.unwrap();
            let receipt = deduct_balance(&first, "req-w", &user, 100).await.unwrap();

            let waited = std::time::Instant::now();
            let error = duplicate_under_lock_timeout(&store, &user).await;
            let waited = waited.elapsed();
            eprintln!("{}: the duplicate waited {waited:.2?} and got: {error}", module_path!());
            assert!(is_lock_timeout(&error), "{error:?}");
            assert!(waited >= LOCK_TIMEOUT, "it waited for the lock ({waited:?})");

            first.commit().await.unwrap();
            let replay = in_tx(&store, |tx| {
                let user = user.clone();
                async move { deduct_balance(&tx, "req-w", &user, 100).await }
            })
            .await
            .unwrap();
            assert_eq!(replay, receipt);
            assert_eq!(balance(store.pool(), &user).await, 900);
            fresh.cleanup().await;
        }

        // ---- The operator's view (`Admin`, what the `idempotent` command runs) ----

        /// An operator's release is bounded by the store's timeout, like every step of a call.
        /// A transactional call that took over an expired claim holds its row until its
        /// transaction ends; the release of the expired claim as inspected (its `DELETE`) waits
        /// for that row lock: on PostgreSQL without a `lock_timeout` for as long as the
        /// transaction stays open, on MariaDB for `innodb_lock_wait_timeout` (50 s), on SQLite
        /// for the busy timeout (30 s). It must fail with `TimedOut` instead, deleting nothing.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn admin_release_of_a_row_an_open_transaction_holds_is_bounded_by_the_timeout() {
            let Some(fresh) = fresh("admrel").await else { return };
            let store = fresh.store.clone().with_timeout(Duration::from_secs(1));
            let key = Key::new("adm", &"held").unwrap();
            let crashed = Token::new();
            assert_eq!(store.claim(&request(&key, &crashed, None, 1)).await.unwrap(), Claim::Claimed);
            tokio::time::sleep(Duration::from_millis(50)).await;
            let seen = admin::Admin::inspect(&store, &key).await.unwrap().expect("the expired claim");
            assert_eq!((seen.state, seen.token.as_str()), (State::Expired, crashed.as_str()));

            let tx = store.begin().await.unwrap();
            let taker = Token::new();
            assert_eq!(tx.claim(&request(&key, &taker, None, 30_000)).await.unwrap(), Claim::Claimed);
            let started = std::time::Instant::now();
            let released = tokio::time::timeout(Duration::from_secs(8), admin::Admin::release(&store, &key, &seen)).await;
            let waited = started.elapsed();
            tx.rollback().await.unwrap();
            eprintln!("{}: the release returned after {waited:.2?}: {released:?}", module_path!());
            let released = released.unwrap_or_else(|_| {
                panic!("the release was still waiting after {waited:.2?}, with the store's timeout at 1 s")
            });
            assert!(
                matches!(&released, Err(StoreError::Backend { source, .. }) if source.downcast_ref::<TimedOut>().is_some()),
                "{released:?}"
            );
            // The message names what held it up here, a lock an open transaction holds, as a cause.
            let message = released.unwrap_err().to_string();
            assert!(message.contains("held by an open transaction"), "{message}");
            assert!(waited < Duration::from_secs(3), "{waited:?}");
            // The transaction rolled back: the expired claim is as inspected, and is released,
            // by this release or by the timed-out one, whose `DELETE` the server may still run
            // once the lock is free (fenced as inspected: the taker's claim was never at risk).
            let again = admin::Admin::release(&store, &key, &seen).await.unwrap();
            assert!(matches!(again, Released::Deleted | Released::Changed), "{again:?}");
            assert_eq!(admin::Admin::inspect(&store, &key).await.unwrap(), None);
            fresh.cleanup().await;
        }

        /// Scopes are case-sensitive (`pay` and `Pay` are two scopes, whose keys never share a
        /// record), and a listing of one scope shows that scope's records only.
        #[tokio::test]
        async fn admin_list_of_a_scope_leaves_out_scopes_that_differ_in_case() {
            let Some(fresh) = fresh("admscope").await else { return };
            let store = &fresh.store;
            for scope in ["pay", "Pay", "PAY", "payx", "pa*"] {
                let key = Key::new(scope, &"1").unwrap();
                assert_eq!(store.claim(&request(&key, &Token::new(), None, 30_000)).await.unwrap(), Claim::Claimed);
            }
            let page = admin::Admin::list(store, &ListQuery::new(10).scope("pay")).await.unwrap();
            let keys: Vec<&str> = page.entries.iter().map(|e| e.key.as_str()).collect();
            assert_eq!(keys, ["pay:1"], "list --scope pay");
            let page = admin::Admin::list(store, &ListQuery::new(10).scope("Pay").state(State::Running)).await.unwrap();
            let keys: Vec<&str> = page.entries.iter().map(|e| e.key.as_str()).collect();
            assert_eq!(keys, ["Pay:1"], "list --scope Pay --state running");
            let page = admin::Admin::list(store, &ListQuery::new(10).scope("pa*")).await.unwrap();
            let keys: Vec<&str> = page.entries.iter().map(|e| e.key.as_str()).collect();
            assert_eq!(keys, ["pa*:1"], "list --scope 'pa*'");
            fresh.cleanup().await;
        }
    };
}

/// The tests that need a network between store and server: killed connections, a stalled proxy.
macro_rules! network_tests {
    () => {
        /// A pool of 16 that records the connection id of every connection it opens (`ids`).
        async fn pool_at(url: &str, ids: Option<Arc<std::sync::Mutex<Vec<i64>>>>) -> Pool {
            let mut pool =
                sqlx::pool::PoolOptions::<Db>::new().max_connections(16).acquire_timeout(Duration::from_secs(60));
            if let Some(ids) = ids {
                pool = pool.after_connect(move |conn, _| {
                    let ids = Arc::clone(&ids);
                    Box::pin(async move {
                        let id = sqlx::query_scalar(CONNECTION_ID).fetch_one(&mut *conn).await?;
                        ids.lock().unwrap().push(id);
                        Ok(())
                    })
                });
            }
            pool.connect(url).await.expect("connect to the server")
        }

        /// A store in a fresh table; tables of failed runs older than an hour are dropped.
        async fn fresh(tag: &str) -> Option<Fresh<Sql>> {
            let url = url(&format!("{}::{tag}", module_path!()))?;
            let ids = Arc::default();
            let pool = pool_at(&url, Some(Arc::clone(&ids))).await;
            let tables: Vec<String> = sqlx::query_scalar(LIST_TABLES).fetch_all(&pool).await.unwrap_or_default();
            for table in tables.into_iter().filter(|t| is_stale(t)) {
                let _ = sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}"))).execute(&pool).await;
            }
            let store = Sql::with_table(pool, &fresh_table(tag)).unwrap();
            store.create_table().await.expect("create_table");
            Some(Fresh { store, ids, cleanup: Cleanup::DropTable })
        }

        async fn admin(_: &Fresh<Sql>) -> Pool {
            pool_at(&url("admin").unwrap(), None).await
        }

        /// A pool through the proxy; no liveness ping before handing out an idle connection, so
        /// the first stalled call times out in its statement.
        async fn proxied_pool(addr: std::net::SocketAddr, acquire: Duration) -> Pool {
            let pool = sqlx::pool::PoolOptions::<Db>::new().test_before_acquire(false).acquire_timeout(acquire);
            pool.connect(&proxied_url(addr)).await.unwrap()
        }

        /// The sqlx error inside a call's `Error::Store` at `claim`.
        fn claim_error(result: Result<Receipt, PayError>) -> sqlx::Error {
            match result {
                Err(PayError::Idempotency(Error::Store {
                    operation: "claim",
                    source: StoreError::Backend { source, .. },
                    ..
                })) => *source.downcast::<sqlx::Error>().expect("a sqlx error"),
                other => panic!("expected a store error at claim, got {other:?}"),
            }
        }

        /// A transaction's connection id, for `kill`.
        async fn connection_id(tx: &Tx) -> i64 {
            sqlx::query_scalar(CONNECTION_ID).fetch_one(&mut *tx.conn().await).await.unwrap()
        }

        async fn kill(admin: &Pool, id: i64) {
            // No bind parameters in KILL; `id` is an integer.
            let _ = sqlx::raw_sql(AssertSqlSafe(KILL.replace("{id}", &id.to_string()))).execute(admin).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn killed_connections_give_typed_errors_and_the_pool_recovers() {
            let Some(fresh) = fresh("kill").await else { return };
            let store = fresh.store.clone();
            let admin = admin(&fresh).await;
            let user = new_user(store.pool(), 1_000).await;

            // A holds the key inside its transaction; B (a duplicate) waits on A's row lock. Both die.
            let tx_a = Arc::new(store.begin().await.unwrap());
            let tx_b = Arc::new(store.begin().await.unwrap());
            let (id_a, id_b) = (connection_id(&tx_a).await, connection_id(&tx_b).await);
            let a = tokio::spawn({
                let (tx, user) = (Arc::clone(&tx_a), user.clone());
                async move { deduct_then(&tx, "req-k", &user, 100, After::Hold(Duration::from_millis(600))).await }
            });
            tokio::time::sleep(Duration::from_millis(200)).await;
            let b = tokio::spawn({
                let (tx, user) = (Arc::clone(&tx_b), user.clone());
                async move { deduct_then(&tx, "req-k", &user, 100, After::Return).await }
            });
            tokio::time::sleep(Duration::from_millis(200)).await;
            // The waiter first: killed after A, it could take the key over before it dies.
            kill(&admin, id_b).await;
            kill(&admin, id_a).await;

            let b = b.await.unwrap();
            assert!(
                matches!(
                    &b,
                    Err(PayError::Idempotency(Error::Store {
                        operation: "claim",
                        source: StoreError::Backend { .. },
                        ..
                    }))
                ),
                "the waiting duplicate gets a typed store error, got {b:?}"
            );
            // A's body ran, but its result could not be recorded and its transaction cannot commit.
            let _ = a.await.unwrap();
            let commit = Arc::into_inner(tx_a).unwrap().commit().await;
            assert!(commit.is_err(), "a killed transaction does not commit");
            drop(tx_b);
            assert_eq!(balance(store.pool(), &user).await, 1_000, "the killed transaction's deduction is gone");
            assert_eq!(key_rows(&store, "deduct_balance:req-k").await, 0, "and so is its claim");

            // The pool recovers: the retry deducts once, and its duplicate replays.
            let pay = |tx: Arc<Tx>| {
                let user = user.clone();
                async move { deduct_balance(&tx, "req-k", &user, 100).await }
            };
            let retry = in_tx(&store, pay).await.expect("the retry succeeds on a fresh connection");
            let replay = in_tx(&store, pay).await.unwrap();
            assert_eq!(retry, replay);
            assert_eq!(balance(store.pool(), &user).await, 900);

            // The pooled store: connections killed while bodies run. No body runs twice, every
            // failure is typed, and later calls succeed.
            let ran = Arc::new(AtomicU32::new(0));
            let calls: Vec<_> = (0..32)
                .map(|i| {
                    let (store, ran) = (store.clone(), Arc::clone(&ran));
                    tokio::spawn(async move { slow_once(&store, &ran, i % 8).await })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(150)).await;
            let ids: Vec<i64> = fresh.ids.lock().unwrap().clone();
            for id in ids {
                kill(&admin, id).await; // some are gone already
            }
            for call in calls {
                match call.await.unwrap() {
                    Ok(_) | Err(PayError::Idempotency(Error::InProgress { .. } | Error::Store { .. })) => {}
                    Err(other) => panic!("untyped failure {other:?}"),
                }
            }
            assert!(ran.load(Ordering::SeqCst) <= 8, "at most one run per key, got {}", ran.load(Ordering::SeqCst));
            for k in 0..8 {
                match slow_once(&store, &ran, k).await {
                    Ok(_) | Err(PayError::Idempotency(Error::InProgress { .. })) => {}
                    Err(other) => panic!("after the kill, key {k}: {other:?}"),
                }
            }
            assert!(ran.load(Ordering::SeqCst) <= 8);
            assert!(slow_once(&store, &ran, 100).await.is_ok(), "a new key runs on the recovered pool");
            fresh.cleanup().await;
        }

        /// A pool that hands out idle connections without pinging them (`test_before_acquire(false)`,
        /// a round trip less per step) keeps a connection the server has closed until a step
        /// uses it. The step sends again on a fresh connection: a claim, a replay, a completion
        /// and a release each succeed at once, and no body runs twice.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn steps_on_a_connection_the_server_closed_send_again() {
            let Some(fresh) = fresh("closed").await else { return };
            let admin = admin(&fresh).await;
            let ids = Arc::new(std::sync::Mutex::new(Vec::new()));
            let pool = sqlx::pool::PoolOptions::<Db>::new()
                .max_connections(1)
                .test_before_acquire(false)
                .after_connect({
                    let ids = Arc::clone(&ids);
                    move |conn, _| {
                        let ids = Arc::clone(&ids);
                        Box::pin(async move {
                            let id = sqlx::query_scalar(CONNECTION_ID).fetch_one(&mut *conn).await?;
                            ids.lock().unwrap().push(id);
                            Ok(())
                        })
                    }
                })
                .connect(&url("closed").unwrap())
                .await
                .unwrap();
            let store = Sql::with_table(pool, fresh.store.table()).unwrap();
            let ran = AtomicU32::new(0);
            // Kills the pool's one connection while it sits idle, then waits until the server
            // has closed it.
            let close_idle = async || {
                let id = *ids.lock().unwrap().last().unwrap();
                kill(&admin, id).await;
                let alive = CONNECTION_ALIVE.replace("{id}", &id.to_string());
                while sqlx::query_scalar::<_, i64>(AssertSqlSafe(alive.clone())).fetch_one(&admin).await.unwrap() > 0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            };
            #[idempotent(key = k, store = store, scope = "closed")]
            async fn counted(store: &Sql, ran: &AtomicU32, k: u32) -> Result<u32, Error> {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok(k)
            }

            assert_eq!(counted(&store, &ran, 1).await.unwrap(), 1);
            close_idle().await;
            let started = std::time::Instant::now();
            assert_eq!(counted(&store, &ran, 2).await.expect("the claim sends again on a new connection"), 2);
            assert!(started.elapsed() < Duration::from_secs(2), "no back-off: {:?}", started.elapsed());
            close_idle().await;
            assert_eq!(counted(&store, &ran, 2).await.expect("the replay sends again"), 2);
            assert_eq!(ran.load(Ordering::SeqCst), 2, "each key ran once");

            // The completion's connection closed while the body ran.
            let key = Key::new("closed", &"step").unwrap();
            let token = Token::new();
            assert_eq!(store.claim(&request(&key, &token, None, 60_000)).await.unwrap(), Claim::Claimed);
            close_idle().await;
            store.complete_as(&key, &token, br#"{"Ok":3}"#, Duration::from_secs(60)).await.expect("sent again");
            close_idle().await;
            let stranger = store.extend(&key, &Token::new(), Duration::from_secs(60)).await;
            assert!(matches!(stranger, Err(StoreError::NotOwner)), "fenced as before: {stranger:?}");

            // A release: the key is free at once, not when its lease ends.
            let held = Key::new("closed", &"release").unwrap();
            assert_eq!(store.claim(&request(&held, &token, None, 60_000)).await.unwrap(), Claim::Claimed);
            close_idle().await;
            store.release(&held, &token).await.expect("the release is sent again");
            let next = store.claim(&request(&held, &Token::new(), None, 60_000)).await.unwrap();
            assert_eq!(next, Claim::Claimed, "released, not held until the lease ends");
            let lost = store.release(&held, &token).await;
            assert!(matches!(lost, Err(StoreError::NotOwner)), "a release on a live connection is fenced: {lost:?}");
            assert_eq!(ids.lock().unwrap().len(), 6, "a new connection after each close, and only then");
            store.pool().close().await;
            fresh.cleanup().await;
        }

        #[idempotent(key = k, store = store, scope = "slow")]
        async fn slow_once(store: &Sql, ran: &AtomicU32, k: u32) -> Result<u32, PayError> {
            ran.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok(k)
        }

        /// Through a proxy that stalls every byte, each step fails within the store's timeout (a
        /// statement under way: `TimedOut`) or the pool's `acquire_timeout` (a new connection,
        /// whose handshake stalls: `PoolTimedOut`), both typed; once the network heals, the same
        /// store works again.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn stalled_network_fails_within_the_timeout_and_the_pool_recovers() {
            let Some(fresh) = fresh("stall").await else { return };
            let proxy = idempotent_tests::proxy::FaultProxy::start(SERVER).await.unwrap();
            let (timeout, acquire) = (Duration::from_millis(800), Duration::from_secs(2));
            let store = Sql::with_table(proxied_pool(proxy.addr(), acquire).await, fresh.store.table())
                .unwrap()
                .with_timeout(timeout);
            let key = Key::new("stall", &"k").unwrap();
            let token = Token::new();
            assert_eq!(store.claim(&request(&key, &token, None, 60_000)).await.unwrap(), Claim::Claimed);
            // sqlx pings a connection as it goes back to the pool: wait until it is idle there.
            while store.pool().num_idle() == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }

            proxy.set_mode(idempotent_tests::proxy::Mode::Stall);
            let other = Key::new("stall", &"other").unwrap();
            let steps: [(&str, std::pin::Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + '_>>); 4] = [
                ("claim", Box::pin(async { store.claim(&request(&other, &token, None, 60_000)).await.map(drop) })),
                ("complete", Box::pin(store.complete_as(&key, &token, b"{}", Duration::from_secs(60)))),
                ("extend", Box::pin(store.extend(&key, &token, Duration::from_secs(60)))),
                ("purge", Box::pin(async { store.purge_expired().await.map(drop) })),
            ];
            let mut timed_out = 0;
            for (operation, step) in steps {
                let t = std::time::Instant::now();
                let failed = tokio::time::timeout(Duration::from_secs(20), step).await.expect("bounded").unwrap_err();
                let took = t.elapsed();
                let StoreError::Backend { source, .. } = &failed else { panic!("{operation}: {failed:?}") };
                if let Some(e) = source.downcast_ref::<TimedOut>() {
                    assert_eq!((e.operation, e.after), (operation, timeout));
                    assert!(took >= timeout, "{operation} failed after {took:?}");
                    timed_out += 1;
                } else {
                    let pool_timed_out =
                        matches!(source.downcast_ref::<sqlx::Error>(), Some(sqlx::Error::PoolTimedOut));
                    assert!(pool_timed_out, "{operation}: {failed:?}");
                    assert!(took >= acquire, "{operation} failed after {took:?}");
                }
                assert!(took < timeout + acquire + Duration::from_secs(5), "{operation} failed after {took:?}");
            }
            assert!(timed_out >= 1, "the statement on the idle connection timed out");

            proxy.set_mode(idempotent_tests::proxy::Mode::Pass);
            store.complete_as(&key, &token, br#"{"Ok":1}"#, Duration::from_secs(60)).await.expect("the pool recovered");
            let replay = store.claim(&request(&key, &Token::new(), None, 60_000)).await.unwrap();
            assert!(matches!(replay, Claim::Completed(_)), "{replay:?}");
            store.pool().close().await;
            fresh.cleanup().await;
        }
    };
}

/// A fresh store in its own table (or file) and what removes it.
struct Fresh<S> {
    store: S,
    ids: Arc<std::sync::Mutex<Vec<i64>>>,
    cleanup: Cleanup,
}

enum Cleanup {
    DropTable,
    Dir(std::path::PathBuf),
}

#[cfg(feature = "postgres")]
mod postgres {
    use idempotent_runtime::stores::sql::PostgresDialect;

    type D = PostgresDialect;
    type Db = sqlx::Postgres;

    /// `?` placeholders, numbered `$1, $2, ...`.
    fn q(sql: &str) -> String {
        let mut n = 0;
        sql.chars()
            .map(|c| {
                if c == '?' {
                    n += 1;
                    format!("${n}")
                } else {
                    c.to_string()
                }
            })
            .collect()
    }

    const SHELL: &str = "SELECT state, outcome::jsonb -> 'Ok' ->> 'name', \
        CAST(CAST(expires_at > now() + interval '59 minutes' AS INT) AS BIGINT) FROM {t} WHERE idempotency_key = 'orders:A-1'";
    const SERIES: &str = "INSERT INTO {t} (idempotency_key, state, token, fingerprint, outcome, expires_at) \
        SELECT 'old:' || i, 'completed', md5(i::text), NULL, '{}', now() - interval '1 hour' \
        FROM generate_series(1, {n}) AS i";
    const CONNECTION_ID: &str = "SELECT CAST(pg_backend_pid() AS BIGINT)";
    const KILL: &str = "SELECT pg_terminate_backend({id})";
    const CONNECTION_ALIVE: &str = "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = {id}";
    const LIST_TABLES: &str =
        "SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema() AND tablename LIKE 'idem\\_t\\_%'";
    const SERVER: &str = "127.0.0.1:5432";
    /// Whether a transaction locks rows (not the whole database).
    const ROW_LOCKS: bool = true;

    fn url(test: &str) -> Option<String> {
        idempotent_tests::services::postgres_url(test)
    }

    fn proxied_url(addr: std::net::SocketAddr) -> String {
        format!("postgres://postgres@{addr}/test")
    }

    const LOCK_TIMEOUT: Duration = Duration::from_millis(500);

    /// SQLSTATE 55P03, lock not available.
    fn is_lock_timeout(error: &sqlx::Error) -> bool {
        error.as_database_error().and_then(sqlx::error::DatabaseError::code).is_some_and(|code| code == "55P03")
    }

    async fn with_schema(fresh: &Fresh<Sql>) -> (String, String) {
        let schema = format!("idem_s_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {schema}"))).execute(fresh.store.pool()).await.unwrap();
        (format!("{schema}.records"), format!("DROP SCHEMA {schema} CASCADE"))
    }

    async fn duplicate_under_lock_timeout(store: &Sql, user: &str) -> sqlx::Error {
        let tx = store.begin().await.unwrap();
        let set = format!("SET LOCAL lock_timeout = '{}ms'", LOCK_TIMEOUT.as_millis());
        sqlx::raw_sql(AssertSqlSafe(set)).execute(&mut *tx.conn().await).await.unwrap();
        let result = deduct_balance(&tx, "req-w", user, 100).await;
        tx.rollback().await.unwrap();
        claim_error(result)
    }

    fn refuse_completions(table: &str) -> Vec<String> {
        let function = format!("{table}_refuse");
        vec![
            format!(
                "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
                 IF NEW.state = 'completed' THEN RAISE EXCEPTION 'completion refused by a test trigger'; END IF; \
                 RETURN NEW; END $$"
            ),
            format!(
                "CREATE TRIGGER {function} BEFORE INSERT OR UPDATE ON {table} FOR EACH ROW EXECUTE FUNCTION {function}()"
            ),
        ]
    }

    /// The issue's case: the body swallows the error of a statement of its own, which aborts the
    /// PostgreSQL transaction; the completion then fails, the call is an error, and `commit`
    /// refuses (PostgreSQL answers `COMMIT` in an aborted transaction with `ROLLBACK`, which sqlx
    /// reports as success: the caller saw `Ok(42)` and nothing was stored).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tx_aborted_by_the_body_is_never_reported_as_committed() {
        let Some(fresh) = fresh("txabort").await else { return };
        let store = fresh.store.clone();
        let user = new_user(store.pool(), 1_000).await;
        let tx = store.begin().await.unwrap();
        let started = std::time::Instant::now();
        let result = idempotent_runtime::Call::new("txabort", "k")
            .run(&tx, async {
                debit(&tx, &user, 100).await.unwrap();
                let swallowed = sqlx::query("SELECT 1/0").execute(&mut *tx.conn().await).await;
                assert!(swallowed.is_err());
                Ok::<_, Error>(42)
            })
            .await;
        assert!(
            matches!(&result, Err(Error::Store { operation: "complete", source: StoreError::Aborted { .. }, .. })),
            "{result:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(5), "not retried for a lease");
        assert!(tx.commit().await.is_err(), "an aborted transaction is not reported as committed");
        assert_eq!(balance(store.pool(), &user).await, 1_000);

        // Aborted by a statement after the call: `commit` still reports it, not success.
        let tx = store.begin().await.unwrap();
        let value = idempotent_runtime::Call::new("txabort", "k2").run(&tx, async { Ok::<_, Error>(1) }).await.unwrap();
        assert_eq!(value, 1);
        let _ = sqlx::query("SELECT 1/0").execute(&mut *tx.conn().await).await;
        let committed = tx.commit().await;
        assert!(committed.is_err(), "{committed:?}");
        assert_eq!(key_rows(&store, "txabort:k2").await, 0);
        fresh.cleanup().await;
    }

    /// `Call::run_with`'s documented limit (RELIABILITY row 19), made to happen: a call dropped
    /// while its claim waits on a row lock (another transaction's uncommitted claim of the key)
    /// leaves that statement to the server. Its background release, on another connection, finds
    /// nothing of its own; when the lock goes, the dropped claim lands, held by nobody. Retries
    /// then get `InProgress` until that lease ends, and after it the body runs once: it never runs
    /// while the dropped claim holds the key, and never twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_claim_in_flight_holds_the_key_one_lease_and_nothing_runs_twice() {
        use idempotent_runtime::{Call, Detached};

        /// The pooled store, handing over the answer to the release a dropped call left to the
        /// background.
        struct Watched {
            inner: Sql,
            released: tokio::sync::mpsc::UnboundedSender<Result<(), StoreError>>,
        }
        impl Watched {
            fn inner(&self) -> &Sql {
                &self.inner
            }
        }
        impl Store for Watched {
            idempotent_runtime::forward_store!(direct Watched::inner; claim complete release extend);
            fn detach(&self, step: Detached) {
                let (inner, released) = (self.inner.clone(), self.released.clone());
                let release = matches!(step, Detached::Release { .. });
                tokio::spawn(async move {
                    let answer = step.finish(&inner).await;
                    if release {
                        let _ = released.send(answer);
                    }
                });
            }
        }

        async fn call(store: &impl Store, lease: Duration, runs: &AtomicU32) -> Result<u32, Error> {
            let body = async { Ok::<_, Error>(runs.fetch_add(1, Ordering::SeqCst)) };
            Call::new("dropclaim", "k").lease(lease).run(store, body).await
        }

        let Some(fresh) = fresh("dropclaim").await else { return };
        let store = fresh.store.clone();
        let runs = Arc::new(AtomicU32::new(0));
        let lease = Duration::from_secs(3);
        let count = |sql: String| {
            let pool = store.pool().clone();
            async move { sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql)).fetch_one(&pool).await.unwrap() }
        };
        let waiting_on_a_lock = format!(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%{}%'",
            store.table()
        );

        // Another transaction claims the key and keeps its row locked.
        let tx = store.begin().await.unwrap();
        let key = Key::new("dropclaim", &"k").unwrap();
        let holder = Token::new();
        assert_eq!(tx.claim(&request(&key, &holder, None, 60_000)).await.unwrap(), Claim::Claimed);
        // A call's claim waits on that row, and the call is dropped while it waits.
        let (released, mut release_answers) = tokio::sync::mpsc::unbounded_channel();
        let watched = Watched { inner: store.clone(), released };
        let dropped_runs = Arc::clone(&runs);
        let waiting = tokio::spawn(async move { call(&watched, lease, &dropped_runs).await });
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while count(waiting_on_a_lock.clone()).await == 0 {
            assert!(std::time::Instant::now() < deadline, "the call's claim never waited on the lock");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        waiting.abort();
        assert!(waiting.await.unwrap_err().is_cancelled());
        // Its background release finds nothing of its own while the other claim is uncommitted;
        // the transaction ends only once that release has been answered.
        let answered = tokio::time::timeout(Duration::from_secs(10), release_answers.recv()).await;
        let answer = answered.expect("the dropped call's release was answered").expect("a release was detached");
        assert!(matches!(answer, Err(StoreError::NotOwner)), "{answer:?}");
        tx.rollback().await.unwrap();

        // The dropped claim lands once the lock is gone, held by nobody.
        let landed = std::time::Instant::now();
        let held = format!(
            "SELECT COUNT(*) FROM {} WHERE idempotency_key = 'dropclaim:k' AND token <> '{}'",
            store.table(),
            holder.as_str()
        );
        while count(held.clone()).await == 0 {
            assert!(landed.elapsed() < Duration::from_secs(5), "the dropped claim never landed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let retry = call(&store, lease, &runs).await;
        // The documented limit: should the release learn to wait for the dropped claim, the key
        // would be free here, and this assertion would change with that fix.
        assert!(matches!(retry, Err(Error::InProgress { .. })), "the key is held until the lease ends: {retry:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 0, "no body ran");

        // After that lease, the body runs, once.
        let ran = loop {
            match call(&store, lease, &runs).await {
                Ok(ran) => break ran,
                Err(Error::InProgress { .. }) if landed.elapsed() < lease * 2 => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => panic!("the key was not freed a lease after the dropped claim: {other:?}"),
            }
        };
        assert_eq!(ran, 0, "the first run of the body");
        assert!(landed.elapsed() >= lease.saturating_sub(Duration::from_millis(500)), "freed only at the lease's end");
        assert_eq!(call(&store, lease, &runs).await.unwrap(), 0, "replayed, not run again");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        fresh.cleanup().await;
    }

    sql_tests!();
    network_tests!();
}

#[cfg(feature = "mysql")]
mod mysql {
    use idempotent_runtime::stores::sql::MySqlDialect;

    type D = MySqlDialect;
    type Db = sqlx::MySql;

    fn q(sql: &str) -> String {
        sql.to_owned()
    }

    const SHELL: &str = "SELECT state, JSON_VALUE(outcome, '$.Ok.name'), \
        CAST(expires_at > UTC_TIMESTAMP(6) + INTERVAL 59 MINUTE AS SIGNED) FROM {t} WHERE idempotency_key = 'orders:A-1'";
    const SERIES: &str = "INSERT INTO {t} (idempotency_key, state, token, fingerprint, outcome, expires_at) \
        SELECT CONCAT('old:', seq), 'completed', MD5(seq), NULL, '{}', UTC_TIMESTAMP(6) - INTERVAL 1 HOUR \
        FROM seq_1_to_{n}";
    const CONNECTION_ID: &str = "SELECT CAST(CONNECTION_ID() AS SIGNED)";
    const KILL: &str = "KILL {id}";
    const CONNECTION_ALIVE: &str =
        "SELECT CAST(COUNT(*) AS SIGNED) FROM information_schema.processlist WHERE id = {id}";
    const LIST_TABLES: &str = "SELECT CAST(table_name AS CHAR) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name LIKE 'idem\\_t\\_%'";
    const SERVER: &str = "127.0.0.1:3306";
    /// Whether a transaction locks rows (not the whole database).
    const ROW_LOCKS: bool = true;

    fn url(test: &str) -> Option<String> {
        idempotent_tests::services::mysql_url(test)
    }

    fn proxied_url(addr: std::net::SocketAddr) -> String {
        format!("mysql://root@{addr}/test")
    }

    const LOCK_TIMEOUT: Duration = Duration::from_secs(1);

    /// Error 1205, "Lock wait timeout exceeded" (its SQLSTATE, HY000, says nothing).
    fn is_lock_timeout(error: &sqlx::Error) -> bool {
        error
            .as_database_error()
            .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
            .is_some_and(|e| e.number() == 1205)
    }

    async fn with_schema(fresh: &Fresh<Sql>) -> (String, String) {
        let database = format!("idem_d_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {database}"))).execute(fresh.store.pool()).await.unwrap();
        (format!("{database}.records"), format!("DROP DATABASE {database}"))
    }

    async fn duplicate_under_lock_timeout(store: &Sql, user: &str) -> sqlx::Error {
        let tx = store.begin().await.unwrap();
        let set = format!("SET SESSION innodb_lock_wait_timeout = {}", LOCK_TIMEOUT.as_secs());
        sqlx::raw_sql(AssertSqlSafe(set)).execute(&mut *tx.conn().await).await.unwrap();
        let result = deduct_balance(&tx, "req-w", user, 100).await;
        sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = DEFAULT").execute(&mut *tx.conn().await).await.unwrap();
        tx.rollback().await.unwrap();
        claim_error(result)
    }

    fn refuse_completions(table: &str) -> Vec<String> {
        vec![format!(
            "CREATE TRIGGER {table}_refuse BEFORE UPDATE ON {table} FOR EACH ROW BEGIN \
             IF NEW.state = 'completed' THEN SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'completion refused by a test trigger'; \
             END IF; END"
        )]
    }

    sql_tests!();
    network_tests!();

    /// A step dropped in the middle of its statement (a call under a `timeout`) must not hand its
    /// connection to the next step: sqlx 0.9's MySQL connection can wait for ever on the next
    /// statement after one was dropped, as a transaction's `ROLLBACK` does
    /// (`tests/tests/sqlx_upstream.rs`). The pool holds one connection, so the step after each
    /// dropped one gets the same connection unless it was discarded. It passed before any change
    /// of the store: it pins that the pooled store does not share the transactional one's limit.
    #[tokio::test(flavor = "current_thread")]
    async fn a_step_dropped_mid_statement_does_not_poison_the_pool() {
        let Some(url) = url("mysql::dropped_step") else { return };
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(3))
            .connect(&url)
            .await
            .unwrap();
        let store = Sql::with_table(pool.clone(), &fresh_table("dropped")).unwrap();
        store.create_table().await.unwrap();
        let (mut dropped, mut stuck) = (0, Vec::new());
        for i in 0..24u32 {
            let (key, token) = (Key::new("s", &format!("k{i}")).unwrap(), Token::new());
            assert_eq!(store.claim(&request(&key, &token, None, 60_000)).await.unwrap(), Claim::Claimed);
            let completion =
                idempotent_runtime::Completion::new(&key, &token, None, br#"{"Ok":2}"#, Duration::from_secs(600));
            let gap = Duration::from_micros(30 * u64::from(i / 3 % 4));
            if !idempotent_tests::poll_then_drop(store.complete(&completion), 2 + 2 * (i % 3), gap).await {
                dropped += 1;
            }
            let next = Key::new("s", &format!("next{i}")).unwrap();
            let claimed =
                tokio::time::timeout(Duration::from_secs(10), store.claim(&request(&next, &token, None, 60_000))).await;
            if !matches!(claimed, Ok(Ok(Claim::Claimed))) {
                stuck.push((i, format!("{claimed:?}")));
            }
        }
        eprintln!("{dropped} of 24 completions dropped mid-statement; steps after them that failed: {stuck:?}");
        assert!(dropped > 0, "the test dropped no statement");
        assert!(stuck.is_empty(), "the step after a dropped one must get a working connection: {stuck:?}");
        let _ = sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {}", store.table()))).execute(&pool).await;
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use idempotent_runtime::stores::sql::{SqliteDialect, SqliteStore};

    type D = SqliteDialect;
    type Db = sqlx::Sqlite;

    fn q(sql: &str) -> String {
        sql.to_owned()
    }

    const SHELL: &str = "SELECT state, json_extract(outcome, '$.Ok.name'), \
        expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now', '+59 minutes') FROM {t} WHERE idempotency_key = 'orders:A-1'";
    const SERIES: &str = "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {n}) \
        INSERT INTO {t} (idempotency_key, state, token, fingerprint, outcome, expires_at) \
        SELECT 'old:' || i, 'completed', hex(i), NULL, '{}', strftime('%Y-%m-%d %H:%M:%f', 'now', '-1 hour') FROM s";
    /// Whether a transaction locks rows: SQLite locks the whole database.
    const ROW_LOCKS: bool = false;
    const LOCK_TIMEOUT: Duration = Duration::from_millis(500);

    /// `SQLITE_BUSY` (code 5): the duplicate's `BEGIN IMMEDIATE` waited out the busy timeout.
    fn is_lock_timeout(error: &sqlx::Error) -> bool {
        error.as_database_error().and_then(sqlx::error::DatabaseError::code).is_some_and(|code| code == "5")
    }

    /// Removes test directories older than an hour (left by failed tests and the conformance suite).
    fn sweep_stale_dirs() {
        let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
        for entry in entries.flatten() {
            let stale = entry.file_name().to_string_lossy().starts_with("idempotent-sqlite-")
                && entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t.elapsed().is_ok_and(|age| age.as_secs() > STALE_AFTER_SECS));
            if stale {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }

    fn fresh_dir(tag: &str) -> std::path::PathBuf {
        sweep_stale_dirs();
        let dir = std::env::temp_dir().join(format!("idempotent-sqlite-{tag}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A store opened the one-line way, on a file of its own, with a table named as on the servers.
    async fn fresh(tag: &str) -> Option<Fresh<Sql>> {
        let dir = fresh_dir(tag);
        let opened = SqliteStore::open(dir.join("idempotency.db")).await.expect("open SQLite");
        let store = Sql::with_table(opened.pool().clone(), &fresh_table(tag)).unwrap();
        store.create_table().await.expect("create_table");
        // Each file needs its own users table (`new_user` creates it once per test binary).
        let users = "CREATE TABLE IF NOT EXISTS idem_test_users (id VARCHAR(64) PRIMARY KEY, balance BIGINT NOT NULL)";
        sqlx::query(users).execute(store.pool()).await.unwrap();
        Some(Fresh { store, ids: Arc::default(), cleanup: Cleanup::Dir(dir) })
    }

    #[allow(clippy::unused_async, reason = "the same signature as the servers' with_schema")]
    async fn with_schema(_: &Fresh<Sql>) -> (String, String) {
        // `main.records` names the main database's schema explicitly.
        ("main.records".to_owned(), "DROP TABLE main.records".to_owned())
    }

    /// The duplicate's `BEGIN IMMEDIATE` waits for the first transaction's write lock, up to the
    /// busy timeout of its pool.
    async fn duplicate_under_lock_timeout(store: &Sql, user: &str) -> sqlx::Error {
        let options =
            SqliteStore::connect_options(store.pool().connect_options().get_filename()).busy_timeout(LOCK_TIMEOUT);
        let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
        let impatient = Sql::with_table(pool, store.table()).unwrap();
        match impatient.begin().await {
            Ok(tx) => {
                let result = deduct_balance(&tx, "req-w", user, 100).await;
                panic!("the duplicate's transaction began while the first held the lock: {result:?}")
            }
            Err(e) => e,
        }
    }

    fn refuse_completions(table: &str) -> Vec<String> {
        vec![format!(
            "CREATE TRIGGER {table}_refuse BEFORE UPDATE ON {table} FOR EACH ROW WHEN NEW.state = 'completed' \
             BEGIN SELECT RAISE(ABORT, 'completion refused by a test trigger'); END"
        )]
    }

    sql_tests!();

    /// A claim lasts its whole lease from the moment its request was sent, which is where the
    /// client counts its lease from. SQLite keeps `now` to the millisecond, so an end written as
    /// `now + lease` fell up to a millisecond before that (found by the real-server simulation on
    /// 2026-12-05: a second claim granted 0.5 ms before the first one's lease ended).
    #[tokio::test]
    async fn sqlite_claims_last_their_whole_lease_from_the_request() {
        let Some(fresh) = fresh("whole_lease").await else { return };
        let store = &fresh.store;
        let end_ms = format!(
            "SELECT CAST(strftime('%s', expires_at) AS INTEGER) * 1000 + CAST(substr(expires_at, 21, 3) AS INTEGER) \
             FROM {} WHERE idempotency_key = ?",
            store.table()
        );
        let lease = Duration::from_secs(60);
        for i in 0..50 {
            let key = Key::new("whole_lease", &i).unwrap();
            let sent = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
            let token = Token::new();
            assert_eq!(store.claim(&request(&key, &token, None, 60_000)).await.unwrap(), Claim::Claimed);
            let end: i64 = sqlx::query_scalar(AssertSqlSafe(end_ms.clone()))
                .bind(key.as_str())
                .fetch_one(store.pool())
                .await
                .unwrap();
            let earliest = (sent + lease).as_micros();
            assert!(
                u128::try_from(end).unwrap() * 1000 >= earliest,
                "claim {i} ends at {end} ms, before its request ({} µs) plus its lease",
                sent.as_micros()
            );
        }
        fresh.cleanup().await;
    }

    /// Two stores on one file, as two processes would open it: concurrent duplicates across both
    /// run the body once, and WAL with a busy timeout keeps concurrent writers from failing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_handles_on_one_file_run_each_key_once() {
        let dir = fresh_dir("shared");
        let path = dir.join("idempotency.db");
        let (a, b) = (SqliteStore::open(&path).await.unwrap(), SqliteStore::open(&path).await.unwrap());
        let ran = Arc::new(AtomicU32::new(0));
        let calls: Vec<_> = (0..400)
            .map(|i| {
                let (store, ran) = (if i % 2 == 0 { a.clone() } else { b.clone() }, Arc::clone(&ran));
                tokio::spawn(async move { once_per_key(&store, &ran, i % 50).await })
            })
            .collect();
        for call in calls {
            match call.await.unwrap() {
                Ok(_) | Err(PayError::Idempotency(Error::InProgress { .. })) => {}
                Err(other) => panic!("{other:?}"),
            }
        }
        assert_eq!(ran.load(Ordering::SeqCst), 50, "each of the 50 keys ran once");
        let mode: String = sqlx::query_scalar("PRAGMA journal_mode").fetch_one(a.pool()).await.unwrap();
        assert_eq!(mode, "wal");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[idempotent(key = k, store = store, scope = "shared")]
    async fn once_per_key(store: &SqliteStore, ran: &AtomicU32, k: u32) -> Result<u32, PayError> {
        ran.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(5)).await;
        Ok(k)
    }
}

impl<S> Fresh<S> {
    /// The store alone, its table or file left for a later run's sweep (the conformance suite
    /// keeps the store to the end of the test).
    fn keep(self) -> S {
        self.store
    }
}
