#![cfg(feature = "sqlite")]
//! The SQLite store against the conformance suite, plus what is particular to it: fencing at the
//! store level, the table as a DBA sees it, purging, transactional mode, two handles on one file.
//! Each test uses its own file in the temp directory: no server is needed.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use idempotent_runtime::stores::sql::{SqliteStore, SqliteTxStore, is_unique_violation, sqlx};
use idempotent_runtime::{Claim, ClaimRequest, Error, Fingerprint, Key, Store, Token, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::SqlitePool;
use sqlx::{AssertSqlSafe, Row};

idempotent_tests::conformance_suite!(conformance_sqlite, async {
    let (store, dir) = fresh_store("conf").await;
    // The suite keeps the store to the end of the test: leave the file for a later run to sweep.
    std::mem::forget(dir);
    Some(store)
});

/// A fresh directory for one test's database file; removed by [`Cleanup`] when the test passes.
struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn fresh_dir(tag: &str) -> Cleanup {
    sweep_stale_dirs();
    let dir = std::env::temp_dir().join(format!("idempotent-sqlite-{tag}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    Cleanup(dir)
}

/// Removes test directories older than an hour (left by failed tests and the conformance suite).
fn sweep_stale_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for entry in entries.flatten() {
        let stale = entry.file_name().to_string_lossy().starts_with("idempotent-sqlite-")
            && entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age.as_secs() > 3600));
        if stale {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A store opened the one-line way, on a file of its own. (The conformance stores' files stay in
/// the temp directory: the suite keeps the store until the test ends.)
async fn fresh_store(tag: &str) -> (SqliteStore, Cleanup) {
    let dir = fresh_dir(tag);
    let store = SqliteStore::open(dir.0.join("idempotency.db")).await.expect("open SQLite");
    (store, dir)
}

fn request<'a>(
    key: &'a Key,
    token: &'a Token,
    fingerprint: Option<&'a Fingerprint>,
    lease_ms: u64,
) -> ClaimRequest<'a> {
    ClaimRequest { key, token, fingerprint, lease: Duration::from_millis(lease_ms) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_records_read_as_json_in_a_db_shell() {
    let (store, _dir) = fresh_store("shell").await;
    let key = Key::new("orders", &"A-1").unwrap();
    let token = Token::new();
    store.claim(&request(&key, &token, None, 30_000)).await.unwrap();
    store.complete(&key, &token, br#"{"Ok":{"id":7,"name":"x"}}"#, Duration::from_secs(3600)).await.unwrap();
    let sql = format!(
        "SELECT state, json_extract(outcome, '$.Ok.name'), \
         expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now', '+59 minutes') \
         FROM {} WHERE idempotency_key = 'orders:A-1'",
        store.table()
    );
    let row = sqlx::query(AssertSqlSafe(sql)).fetch_one(store.pool()).await.unwrap();
    assert_eq!(row.get::<String, _>(0), "completed");
    assert_eq!(row.get::<String, _>(1), "x");
    assert!(row.get::<bool, _>(2), "expires_at is now + retention by the database's clock");
    assert!(store.create_table_sql().contains("CREATE TABLE IF NOT EXISTS idempotency_records"));
    store.create_table().await.expect("create_table is idempotent too");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_table_names_are_validated_and_may_name_an_attached_schema() {
    let (store, dir) = fresh_store("names").await;
    let pool = store.pool().clone();
    for bad in ["x; DROP TABLE users", "a.b.c", "1x", "x-y", ""] {
        assert!(SqliteStore::with_table(pool.clone(), bad).is_err(), "{bad:?}");
    }
    // `main.records` names the main database's schema explicitly.
    let store = SqliteStore::with_table(pool, "main.records").unwrap();
    store.create_table().await.unwrap();
    let key = Key::new("s", &"k").unwrap();
    let token = Token::new();
    assert_eq!(store.claim(&request(&key, &token, None, 30_000)).await.unwrap(), Claim::Claimed);
    store.complete(&key, &token, b"{}", Duration::from_secs(60)).await.unwrap();
    drop(dir);
}

/// Two stores on one file, as two processes would open it: concurrent duplicates across both run
/// the body once, and WAL with a busy timeout keeps concurrent writers from failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_two_handles_on_one_file_run_each_key_once() {
    let dir = fresh_dir("shared");
    let path = dir.0.join("idempotency.db");
    let (a, b) = (SqliteStore::open(&path).await.unwrap(), SqliteStore::open(&path).await.unwrap());
    let ran = Arc::new(std::sync::atomic::AtomicU32::new(0));
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
    assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 50, "each of the 50 keys ran once");
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode").fetch_one(a.pool()).await.unwrap();
    assert_eq!(mode, "wal");
}

#[idempotent(key = k, store = store, scope = "shared")]
async fn once_per_key(store: &SqliteStore, ran: &std::sync::atomic::AtomicU32, k: u32) -> Result<u32, PayError> {
    ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(5)).await;
    Ok(k)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_purge_removes_only_expired_rows_and_the_task_stops() {
    let (store, _dir) = fresh_store("purge").await;
    let count = || async {
        let sql = format!("SELECT count(*) FROM {}", store.table());
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql)).fetch_one(store.pool()).await.unwrap()
    };
    for i in 0..10 {
        let key = Key::new("p", &i).unwrap();
        let token = Token::new();
        store.claim(&request(&key, &token, None, 30_000)).await.unwrap();
        // Even keys expire at once, odd ones live for an hour.
        let retention = if i % 2 == 0 { Duration::from_millis(1) } else { Duration::from_secs(3600) };
        store.complete(&key, &token, b"{}", retention).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(store.purge_expired().await.unwrap(), 5);
    assert_eq!(count().await, 5);

    // The background task purges what expires later, and stops on shutdown.
    for i in 10..13 {
        let key = Key::new("p", &i).unwrap();
        store.claim(&request(&key, &Token::new(), None, 50)).await.unwrap(); // abandoned claims
    }
    let task = store.spawn_purge(Duration::from_millis(100));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while count().await > 5 {
        assert!(tokio::time::Instant::now() < deadline, "the purge task did not remove the expired claims");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::timeout(Duration::from_secs(5), task.shutdown()).await.expect("shutdown returns promptly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_unique_violations_are_recognised() {
    let (store, _dir) = fresh_store("unique").await;
    let pool = store.pool();
    sqlx::query("CREATE TABLE orders (order_no TEXT PRIMARY KEY)").execute(pool).await.unwrap();
    let insert = || sqlx::query("INSERT INTO orders (order_no) VALUES (?)").bind("A-1");
    insert().execute(pool).await.unwrap();
    let duplicate = insert().execute(pool).await.unwrap_err();
    assert!(is_unique_violation(&duplicate), "{duplicate:?}");
    let other = sqlx::query("SELECT * FROM no_such_table_here").execute(pool).await.unwrap_err();
    assert!(!is_unique_violation(&other));
}

// ---- Transactional mode: deduct_balance from the design notes ----

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

/// How the body behaves after its UPDATE: return, or fail.
#[derive(Clone, Copy)]
enum After {
    Return,
    Fail,
}

async fn debit(tx: &SqliteTxStore, user: &str, amount: i64) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE idem_test_users SET balance = balance - ?1 WHERE id = ?2 AND balance >= ?1 RETURNING balance",
    )
    .bind(amount)
    .bind(user)
    .fetch_optional(&mut *tx.conn().await)
    .await
}

#[idempotent(key = request_id, store = tx, fingerprint = (user, amount))]
async fn deduct_balance(tx: &SqliteTxStore, request_id: &str, user: &str, amount: i64) -> Result<Receipt, PayError> {
    deduct(tx, user, amount, After::Return).await
}

#[idempotent(key = request_id, store = tx, fingerprint = (user, amount), scope = "deduct_balance")]
async fn deduct_then(
    tx: &SqliteTxStore,
    request_id: &str,
    user: &str,
    amount: i64,
    after: After,
) -> Result<Receipt, PayError> {
    deduct(tx, user, amount, after).await
}

async fn deduct(tx: &SqliteTxStore, user: &str, amount: i64, after: After) -> Result<Receipt, PayError> {
    let balance_after = debit(tx, user, amount).await?.ok_or(PayError::Insufficient)?;
    match after {
        After::Return => {}
        After::Fail => return Err(PayError::Injected),
    }
    Ok(Receipt { id: uuid::Uuid::new_v4().to_string(), user: user.to_owned(), amount, balance_after })
}

/// Runs one call in its own transaction, committing on `Ok` and rolling back on `Err`.
async fn in_tx<F, Fut>(store: &SqliteStore, call: F) -> Result<Receipt, PayError>
where
    F: FnOnce(Arc<SqliteTxStore>) -> Fut,
    Fut: Future<Output = Result<Receipt, PayError>>,
{
    let tx = Arc::new(store.begin().await?);
    let result = call(Arc::clone(&tx)).await;
    let tx = Arc::into_inner(tx).expect("the call is over");
    match &result {
        Ok(_) => tx.commit().await?,
        Err(_) => tx.rollback().await?,
    }
    result
}

/// A user with `balance`, in the store's database file.
async fn new_user(pool: &SqlitePool, balance: i64) -> String {
    sqlx::query("CREATE TABLE IF NOT EXISTS idem_test_users (id TEXT PRIMARY KEY, balance INTEGER NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    let id = format!("user-{}", uuid::Uuid::new_v4().simple());
    sqlx::query("INSERT INTO idem_test_users (id, balance) VALUES (?, ?)")
        .bind(&id)
        .bind(balance)
        .execute(pool)
        .await
        .unwrap();
    id
}

async fn balance(pool: &SqlitePool, user: &str) -> i64 {
    sqlx::query_scalar("SELECT balance FROM idem_test_users WHERE id = ?").bind(user).fetch_one(pool).await.unwrap()
}

async fn key_rows(store: &SqliteStore, key: &str) -> i64 {
    let sql = format!("SELECT count(*) FROM {} WHERE idempotency_key = ?", store.table());
    sqlx::query_scalar(AssertSqlSafe(sql)).bind(key).fetch_one(store.pool()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_transactional_duplicates_deduct_once_and_share_the_receipt() {
    let (store, _dir) = fresh_store("txdup").await;
    let user = new_user(store.pool(), 1_000).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let calls: Vec<_> = (0..64)
        .map(|_| {
            let (store, user, barrier) = (store.clone(), user.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                in_tx(&store, |tx| async move { deduct_balance(&tx, "req-1", &user, 100).await }).await
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_transactional_failure_leaves_neither_deduction_nor_key() {
    let (store, _dir) = fresh_store("txfail").await;
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
    let receipt = in_tx(&store, |tx| async move { deduct_balance(&tx, "req-r", &user, 300).await }).await.unwrap();
    assert_eq!(receipt.balance_after, 700);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_transactional_balance_never_goes_negative() {
    let (store, _dir) = fresh_store("txneg").await;
    let user = new_user(store.pool(), 1_000).await;
    // 40 distinct requests of 100 each, every one sent twice, against a balance of 1,000.
    let calls: Vec<_> = (0..80)
        .map(|i| {
            let (store, user) = (store.clone(), user.clone());
            tokio::spawn(async move {
                let request_id = format!("req-{}", i % 40);
                in_tx(&store, |tx| async move { deduct_balance(&tx, &request_id, &user, 100).await }).await
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
}
