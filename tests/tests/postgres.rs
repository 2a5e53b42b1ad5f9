#![cfg(feature = "postgres")]
//! The PostgreSQL store against the conformance suite, plus what is particular to it: fencing at
//! the store level, the table as a DBA sees it, purging, transactional mode, killed connections.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotent_runtime::stores::sql::{PostgresStore, PostgresTxStore, is_unique_violation, sqlx};
use idempotent_runtime::{Claim, ClaimRequest, Error, Fingerprint, Key, Store, StoreError, Token, idempotent};
use idempotent_tests::services;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Row};

idempotent_tests::conformance_suite!(conformance_postgres, async {
    let url = services::postgres_url("conformance_postgres")?;
    Some(fresh_store(&url, "conf").await)
});

/// Tables made by these tests are named `idem_t_<unix seconds>_<uuid>`; ones older than an hour
/// (left by a failed run) are dropped when a new one is made.
const STALE_AFTER_SECS: u64 = 3600;

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

fn fresh_table(tag: &str) -> String {
    format!("idem_t_{}_{tag}_{}", now_secs(), &uuid::Uuid::new_v4().simple().to_string()[..12])
}

async fn pool(url: &str, max: u32, app: &str) -> PgPool {
    let options: PgConnectOptions = url.parse().expect("POSTGRES_URL");
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(options.application_name(app))
        .await
        .expect("connect to PostgreSQL")
}

async fn drop_stale_tables(pool: &PgPool) {
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema() AND tablename LIKE 'idem\\_t\\_%'",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    for name in names {
        let made = name.split('_').nth(2).and_then(|s| s.parse::<u64>().ok()).unwrap_or(u64::MAX);
        if now_secs().saturating_sub(made) > STALE_AFTER_SECS && made != u64::MAX {
            let _ = sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {name}"))).execute(pool).await;
        }
    }
}

async fn fresh_store(url: &str, tag: &str) -> PostgresStore {
    fresh_store_named(url, tag, "idempotent-tests").await
}

/// A store whose connections carry `application_name = app`, so a test can find and kill them.
async fn fresh_store_named(url: &str, tag: &str, app: &str) -> PostgresStore {
    let pool = pool(url, 16, app).await;
    drop_stale_tables(&pool).await;
    let store = PostgresStore::with_table(pool, &fresh_table(tag)).unwrap();
    store.create_table().await.expect("create_table");
    store
}

async fn drop_table(store: &PostgresStore) {
    sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {}", store.table()))).execute(store.pool()).await.unwrap();
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
async fn postgres_records_read_as_json_in_a_db_shell() {
    let Some(url) = services::postgres_url("postgres_records_read_as_json_in_a_db_shell") else {
        return;
    };
    let store = fresh_store(&url, "shell").await;
    let key = Key::new("orders", &"A-1").unwrap();
    let token = Token::new();
    store.claim(&request(&key, &token, None, 30_000)).await.unwrap();
    store.complete(&key, &token, br#"{"Ok":{"id":7,"name":"x"}}"#, Duration::from_secs(3600)).await.unwrap();
    let sql = format!(
        "SELECT state, outcome::jsonb -> 'Ok' ->> 'name', expires_at > now() + interval '59 minutes' \
         FROM {} WHERE idempotency_key = 'orders:A-1'",
        store.table()
    );
    let row = sqlx::query(AssertSqlSafe(sql)).fetch_one(store.pool()).await.unwrap();
    assert_eq!(row.get::<String, _>(0), "completed");
    assert_eq!(row.get::<String, _>(1), "x");
    assert!(row.get::<bool, _>(2), "expires_at is now + retention by the database's clock");
    assert!(store.create_table_sql().contains("CREATE TABLE IF NOT EXISTS idem_t_"));
    store.create_table().await.expect("create_table is idempotent too");
    drop_table(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_table_names_are_validated_and_may_name_a_schema() {
    let Some(url) = services::postgres_url("postgres_table_names_are_validated_and_may_name_a_schema") else {
        return;
    };
    let pool = pool(&url, 2, "idempotent-tests").await;
    for bad in ["x; DROP TABLE users", "a.b.c", "1x", "x-y", ""] {
        assert!(PostgresStore::with_table(pool.clone(), bad).is_err(), "{bad:?}");
    }
    let schema = format!("idem_s_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA {schema}"))).execute(&pool).await.unwrap();
    let store = PostgresStore::with_table(pool.clone(), &format!("{schema}.records")).unwrap();
    store.create_table().await.unwrap();
    let key = Key::new("s", &"k").unwrap();
    let token = Token::new();
    assert_eq!(store.claim(&request(&key, &token, None, 30_000)).await.unwrap(), Claim::Claimed);
    store.complete(&key, &token, b"{}", Duration::from_secs(60)).await.unwrap();
    sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE"))).execute(&pool).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_purge_removes_only_expired_rows_and_the_task_stops() {
    let Some(url) = services::postgres_url("postgres_purge_removes_only_expired_rows_and_the_task_stops") else {
        return;
    };
    let store = fresh_store(&url, "purge").await;
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
    drop_table(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_unique_violations_are_recognised() {
    let Some(url) = services::postgres_url("postgres_unique_violations_are_recognised") else {
        return;
    };
    let pool = pool(&url, 2, "idempotent-tests").await;
    let table = fresh_table("orders");
    sqlx::query(AssertSqlSafe(format!("CREATE TABLE {table} (order_no TEXT PRIMARY KEY)")))
        .execute(&pool)
        .await
        .unwrap();
    let insert = || sqlx::query(AssertSqlSafe(format!("INSERT INTO {table} (order_no) VALUES ($1)"))).bind("A-1");
    insert().execute(&pool).await.unwrap();
    let duplicate = insert().execute(&pool).await.unwrap_err();
    assert!(is_unique_violation(&duplicate), "{duplicate:?}");
    let other = sqlx::query("SELECT * FROM no_such_table_here").execute(&pool).await.unwrap_err();
    assert!(!is_unique_violation(&other));
    sqlx::query(AssertSqlSafe(format!("DROP TABLE {table}"))).execute(&pool).await.unwrap();
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

/// How the body behaves after its UPDATE: hold the transaction open, or fail.
#[derive(Clone, Copy)]
enum After {
    Return,
    Hold(Duration),
    Fail,
}

async fn debit(tx: &PostgresTxStore, user: &str, amount: i64) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE idem_test_users SET balance = balance - $1 WHERE id = $2 AND balance >= $1 RETURNING balance",
    )
    .bind(amount)
    .bind(user)
    .fetch_optional(&mut *tx.conn().await)
    .await
}

#[idempotent(key = request_id, store = tx, fingerprint = (user, amount))]
async fn deduct_balance(tx: &PostgresTxStore, request_id: &str, user: &str, amount: i64) -> Result<Receipt, PayError> {
    deduct(tx, user, amount, After::Return).await
}

#[idempotent(key = request_id, store = tx, fingerprint = (user, amount), scope = "deduct_balance")]
async fn deduct_then(
    tx: &PostgresTxStore,
    request_id: &str,
    user: &str,
    amount: i64,
    after: After,
) -> Result<Receipt, PayError> {
    deduct(tx, user, amount, after).await
}

async fn deduct(tx: &PostgresTxStore, user: &str, amount: i64, after: After) -> Result<Receipt, PayError> {
    let balance_after = debit(tx, user, amount).await?.ok_or(PayError::Insufficient)?;
    match after {
        After::Return => {}
        After::Hold(hold) => tokio::time::sleep(hold).await,
        After::Fail => return Err(PayError::Injected),
    }
    Ok(Receipt { id: uuid::Uuid::new_v4().to_string(), user: user.to_owned(), amount, balance_after })
}

/// Runs one call in its own transaction, committing on `Ok` and rolling back on `Err`.
async fn in_tx<F, Fut>(store: &PostgresStore, call: F) -> Result<Receipt, PayError>
where
    F: FnOnce(Arc<PostgresTxStore>) -> Fut,
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

static USERS: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

/// A user with `balance`, in a table shared by these tests (each test has its own user).
async fn new_user(pool: &PgPool, balance: i64) -> String {
    USERS
        .get_or_init(|| async {
            sqlx::query("CREATE TABLE IF NOT EXISTS idem_test_users (id TEXT PRIMARY KEY, balance BIGINT NOT NULL)")
                .execute(pool)
                .await
                .unwrap();
        })
        .await;
    let id = format!("user-{}", uuid::Uuid::new_v4().simple());
    sqlx::query("INSERT INTO idem_test_users (id, balance) VALUES ($1, $2)")
        .bind(&id)
        .bind(balance)
        .execute(pool)
        .await
        .unwrap();
    id
}

async fn balance(pool: &PgPool, user: &str) -> i64 {
    sqlx::query_scalar("SELECT balance FROM idem_test_users WHERE id = $1").bind(user).fetch_one(pool).await.unwrap()
}

async fn key_rows(store: &PostgresStore, key: &str) -> i64 {
    let sql = format!("SELECT count(*) FROM {} WHERE idempotency_key = $1", store.table());
    sqlx::query_scalar(AssertSqlSafe(sql)).bind(key).fetch_one(store.pool()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_transactional_duplicates_deduct_once_and_share_the_receipt() {
    let Some(url) = services::postgres_url("postgres_transactional_duplicates_deduct_once_and_share_the_receipt")
    else {
        return;
    };
    let store = fresh_store(&url, "txdup").await;
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
    drop_table(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_transactional_failure_leaves_neither_deduction_nor_key() {
    let Some(url) = services::postgres_url("postgres_transactional_failure_leaves_neither_deduction_nor_key") else {
        return;
    };
    let store = fresh_store(&url, "txfail").await;
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
    drop_table(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_transactional_balance_never_goes_negative() {
    let Some(url) = services::postgres_url("postgres_transactional_balance_never_goes_negative") else {
        return;
    };
    let store = fresh_store(&url, "txneg").await;
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
    drop_table(&store).await;
}

/// The backend process id of a transaction's connection.
async fn backend_pid(tx: &PostgresTxStore) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *tx.conn().await).await.unwrap()
}

async fn terminate(admin: &PgPool, pid: i32) {
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(pid).fetch_one(admin).await.unwrap();
    assert!(killed, "pg_terminate_backend({pid})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_killed_connections_give_typed_errors_and_the_pool_recovers() {
    let Some(url) = services::postgres_url("postgres_killed_connections_give_typed_errors_and_the_pool_recovers")
    else {
        return;
    };
    let store = fresh_store_named(&url, "kill", "idempotent-tests-kill").await;
    let admin = pool(&url, 2, "idempotent-tests-admin").await;
    let user = new_user(store.pool(), 1_000).await;

    // A holds the key inside its transaction; B (a duplicate) waits on A's row lock. Both die.
    let tx_a = Arc::new(store.begin().await.unwrap());
    let tx_b = Arc::new(store.begin().await.unwrap());
    let (pid_a, pid_b) = (backend_pid(&tx_a).await, backend_pid(&tx_b).await);
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
    terminate(&admin, pid_b).await;
    terminate(&admin, pid_a).await;

    let b = b.await.unwrap();
    assert!(
        matches!(
            &b,
            Err(PayError::Idempotency(Error::Store {
                operation: "claim",
                source: StoreError::Backend { backend: "postgres", .. },
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
    let retry = in_tx(&store, |tx| {
        let user = user.clone();
        async move { deduct_balance(&tx, "req-k", &user, 100).await }
    })
    .await
    .expect("the retry succeeds on a fresh connection");
    let replay = in_tx(&store, |tx| {
        let user = user.clone();
        async move { deduct_balance(&tx, "req-k", &user, 100).await }
    })
    .await
    .unwrap();
    assert_eq!(retry, replay);
    assert_eq!(balance(store.pool(), &user).await, 900);

    // The non-transactional store: connections killed while bodies run. No body runs twice, every
    // failure is typed, and later calls succeed.
    let ran = Arc::new(AtomicU32::new(0));
    let calls: Vec<_> = (0..32)
        .map(|i| {
            let (store, ran) = (store.clone(), Arc::clone(&ran));
            tokio::spawn(async move { slow_once(&store, &ran, i % 8).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let pids: Vec<i32> =
        sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = 'idempotent-tests-kill'")
            .fetch_all(&admin)
            .await
            .unwrap();
    for pid in &pids {
        let _ = sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(&admin).await;
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
    drop_table(&store).await;
}

#[idempotent(key = k, store = store, scope = "slow")]
async fn slow_once(store: &PostgresStore, ran: &AtomicU32, k: u32) -> Result<u32, PayError> {
    ran.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(k)
}
