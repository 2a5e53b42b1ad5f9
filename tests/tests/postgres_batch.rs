#![cfg(all(feature = "postgres", feature = "cache"))]
//! The PostgreSQL store's batched steps are one statement per batch: counted from sqlx's own
//! statement log, in a test binary of their own so that the counting subscriber is the process's
//! only one (tracing caches whether a log site is wanted, across the threads of one process).
//! The conformance cases (`batched_*`) check what the answers are.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_runtime::stores::sql::{PostgresStore, sqlx};
use idempotent_runtime::{Claim, ClaimRequest, Completion, Key, Store, Token};
use tracing_subscriber::layer::SubscriberExt as _;

/// Taken by each test of this binary: the statement count is the whole process's.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The statements sqlx has logged (target `sqlx::query`) in this process.
static STATEMENTS: AtomicUsize = AtomicUsize::new(0);

struct Statements;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Statements {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() == "sqlx::query" {
            STATEMENTS.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Installs the counting subscriber, once for the process.
fn count_statements() {
    static INSTALLED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    INSTALLED.get_or_init(|| {
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Statements))
            .expect("the binary's only subscriber");
    });
}

/// `step`'s value, and how many statements sqlx sent while it ran.
async fn statements_of<T>(step: impl Future<Output = T>) -> (T, usize) {
    let before = STATEMENTS.load(Ordering::Relaxed);
    let value = step.await;
    (value, STATEMENTS.load(Ordering::Relaxed) - before)
}

/// Claims of `keys`, each with its token.
fn claims_of<'a>(keys: &'a [Key], tokens: &'a [Token], lease: Duration) -> Vec<ClaimRequest<'a>> {
    keys.iter().zip(tokens).map(|(key, token)| ClaimRequest::new(key, token, None, lease)).collect()
}

/// Completions of `requests`, each with its outcome.
fn completions_of<'a>(requests: &[ClaimRequest<'a>], outcomes: &'a [String], lease: Duration) -> Vec<Completion<'a>> {
    requests
        .iter()
        .zip(outcomes)
        .map(|(request, outcome)| Completion::new(request.key, request.token, None, outcome.as_bytes(), lease))
        .collect()
}

/// 64 new keys claimed in one statement, recorded in one, replayed in one; a key asked for twice
/// in one batch costs its own single claim after the batch's statement.
#[tokio::test(flavor = "current_thread")]
async fn postgres_batched_steps_are_one_statement_each() {
    let Some(url) = idempotent_tests::services::postgres_url("postgres_batched_steps_are_one_statement_each") else {
        return;
    };
    let _alone = ONE_AT_A_TIME.lock().await;
    count_statements();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&url).await.unwrap();
    let table = format!("idem_batch_{}", uuid::Uuid::new_v4().simple());
    let store = PostgresStore::with_table(pool.clone(), &table).unwrap();
    store.create_table().await.unwrap();

    let keys: Vec<Key> = (0..64).map(|i| Key::new("batch", &i).unwrap()).collect();
    let tokens: Vec<Token> = keys.iter().map(|_| Token::new()).collect();
    let lease = Duration::from_secs(30);
    let mut requests = claims_of(&keys, &tokens, lease);
    let (claims, statements) = statements_of(store.claim_many(&requests)).await;
    assert!(claims.unwrap().iter().all(|c| matches!(c, Ok(Claim::Claimed))));
    assert_eq!(statements, 1, "64 new keys");

    let outcomes: Vec<String> = (0..64).map(|i| format!(r#"{{"Ok":{i}}}"#)).collect();
    let (recorded, statements) = statements_of(store.complete_many(&completions_of(&requests, &outcomes, lease))).await;
    assert!(recorded.unwrap().iter().all(Result::is_ok));
    assert_eq!(statements, 1, "64 completions");

    let other = Token::new();
    requests.push(ClaimRequest::new(&keys[5], &other, None, lease));
    let (replays, statements) = statements_of(store.claim_many(&requests)).await;
    let replays = replays.unwrap();
    assert!(replays.iter().all(|c| matches!(c, Ok(Claim::Completed(_)))), "{replays:?}");
    assert_eq!(statements, 2, "64 replays in one statement, and the repeated key's own claim");

    // Through `AnyStore` and `CachedStore` too: the batch reaches the store's statement.
    let any = idempotent_runtime::AnyStore::new(idempotent_runtime::stores::cache::CachedStore::new(store.clone()));
    let keys: Vec<Key> = (0..16).map(|i| Key::new("batch-any", &i).unwrap()).collect();
    let requests = claims_of(&keys, &tokens, lease);
    let (claims, statements) = statements_of(any.claim_many(&requests)).await;
    assert!(claims.unwrap().iter().all(|c| matches!(c, Ok(Claim::Claimed))));
    assert_eq!(statements, 1, "16 new keys through AnyStore and CachedStore");
    let (recorded, statements) = statements_of(any.complete_many(&completions_of(&requests, &outcomes, lease))).await;
    assert!(recorded.unwrap().iter().all(Result::is_ok));
    assert_eq!(statements, 1, "16 completions through AnyStore and CachedStore");

    // Claims and completions of other keys together: one statement (a commit) for both.
    let keys: Vec<Key> = (0..64).map(|i| Key::new("batch-both", &i).unwrap()).collect();
    let (held, new) = keys.split_at(32);
    let held_claims = claims_of(held, &tokens, lease);
    assert!(store.claim_many(&held_claims).await.unwrap().iter().all(|c| matches!(c, Ok(Claim::Claimed))));
    let new_claims = claims_of(new, &tokens[32..], lease);
    let completions = completions_of(&held_claims, &outcomes, lease);
    let ((claims, recorded), statements) =
        statements_of(store.claim_and_complete_many(&new_claims, &completions)).await;
    assert!(claims.unwrap().iter().all(|c| matches!(c, Ok(Claim::Claimed))));
    assert!(recorded.unwrap().iter().all(Result::is_ok));
    assert_eq!(statements, 1, "32 new keys and 32 completions");
    // A key in both halves: the two halves' statements, concurrently (on this one connection, in turn).
    let (again, statements) = statements_of(store.claim_and_complete_many(&held_claims[..1], &completions[..1])).await;
    assert!(again.0.unwrap()[0].is_ok() && again.1.unwrap()[0].is_ok());
    assert_eq!(statements, 2, "a key in both halves");

    // In a transaction, the claims too (its completions are one statement each: a batch
    // adopts keys that are gone, which a transaction's completion never does).
    let keys: Vec<Key> = (0..16).map(|i| Key::new("batch-tx", &i).unwrap()).collect();
    let requests = claims_of(&keys, &tokens, lease);
    let tx = store.begin().await.unwrap();
    let (claims, statements) = statements_of(tx.claim_many(&requests)).await;
    assert!(claims.unwrap().iter().all(|c| matches!(c, Ok(Claim::Claimed))));
    assert_eq!(statements, 1, "16 new keys in a transaction");
    assert!(tx.complete_many(&completions_of(&requests, &outcomes, lease)).await.unwrap().iter().all(Result::is_ok));
    tx.commit().await.unwrap();

    // Calls that know nothing of each other, through `BatchingStore`: 64 at once, their claims
    // and completions in a few statements (each alone: 128; a claim and a completion of one call
    // are never in one batch, so at least 2).
    let batching = idempotent_runtime::stores::batching::BatchingStore::new(store.clone());
    let calls = (0..64).map(|k| {
        idempotent_runtime::Call::new("batching", &k)
            .run(&batching, async move { Ok::<_, idempotent_runtime::Error>(k) })
    });
    let (results, statements) = statements_of(futures_util::future::join_all(calls)).await;
    assert!(results.into_iter().enumerate().all(|(k, result)| result.unwrap() == k), "each call its own result");
    assert!(statements <= 3, "64 concurrent calls through BatchingStore: {statements} statements");

    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}"))).execute(&pool).await.unwrap();
}

/// The batched statements are prepared once per connection, and a prepared statement keeps its
/// generic plan: planned while the table is small, the plan must still find each key through the
/// primary key, never scan the table (a join of the arrays to the table did: a hash join over a
/// sequential scan, kept as the table grew, 3 to 4 times the PostgreSQL CPU per key within
/// seconds of a fresh table in `batch_load`).
#[tokio::test(flavor = "current_thread")]
async fn postgres_batched_statements_never_scan_the_table_whatever_its_size_when_planned() {
    let Some(url) = idempotent_tests::services::postgres_url("postgres_batched_statements_never_scan_the_table") else {
        return;
    };
    let _alone = ONE_AT_A_TIME.lock().await;
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&url).await.unwrap();
    let table = format!("idem_plan_{}", uuid::Uuid::new_v4().simple());
    let store = PostgresStore::with_table(pool.clone(), &table).unwrap();
    store.create_table().await.unwrap();
    let (key, token) = (Key::new("plan", &1).unwrap(), Token::new());
    let lease = Duration::from_secs(30);
    store.claim_many(&[ClaimRequest::new(&key, &token, None, lease)]).await.unwrap();
    store.complete_many(&[Completion::new(&key, &token, None, b"{}", lease)]).await.unwrap();
    let (other, other_token) = (Key::new("plan", &2).unwrap(), Token::new());
    let (claims, records) = store
        .claim_and_complete_many(
            &[ClaimRequest::new(&other, &other_token, None, lease)],
            &[Completion::new(&key, &token, None, b"{}", lease)],
        )
        .await;
    assert!(claims.unwrap()[0].is_ok() && records.unwrap()[0].is_ok());

    // The statements as the store prepared them, prepared again here and planned generically on
    // the (nearly empty) table.
    let mut conn = pool.acquire().await.unwrap();
    let texts: Vec<String> = sqlx::query_scalar(
        "SELECT statement FROM pg_prepared_statements WHERE statement LIKE '%unnest%' AND name NOT LIKE 'batch_plan_%' \
         AND statement NOT LIKE '%pg_prepared_statements%'",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    assert_eq!(texts.len(), 3, "the claim, the completion and both: {texts:?}");
    sqlx::raw_sql("SET plan_cache_mode = force_generic_plan").execute(&mut *conn).await.unwrap();
    for (i, text) in texts.iter().enumerate() {
        let prepare = format!("PREPARE batch_plan_{i} AS {text}");
        sqlx::raw_sql(sqlx::AssertSqlSafe(prepare)).execute(&mut *conn).await.unwrap();
        let arrays = "'{k}'::text[], '{t}'::text[], '{NULL}'::text[], '{1}'::bigint[], '{}'::text[]";
        // The statement of both binds the claims' arrays, then the completions'.
        let args = if text.contains("$10") { format!("{arrays}, {arrays}") } else { arrays.to_owned() };
        let explain = format!("EXPLAIN EXECUTE batch_plan_{i}({args})");
        let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(explain)).fetch_all(&mut *conn).await.unwrap();
        let plan = plan.join("\n");
        assert!(!plan.contains("Seq Scan"), "statement {text}\nplanned as\n{plan}");
    }
    sqlx::raw_sql("DEALLOCATE ALL; RESET plan_cache_mode").execute(&mut *conn).await.unwrap();
    drop(conn);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}"))).execute(&pool).await.unwrap();
}

/// Returns once a session other than `conn`'s waits for a lock in a statement on `table` (as
/// `pg_stat_activity` shows it), polling every 10 ms for at most 10 s.
async fn wait_for_a_lock_wait(conn: &mut sqlx::PgConnection, table: &str) {
    let pattern = format!("%{table}%");
    for _ in 0..1000 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid() \
             AND query LIKE $1",
        )
        .bind(&pattern)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no session waited for a lock on {table} within 10 s");
}

/// A statement of both halves that PostgreSQL chooses as a deadlock victim runs again, and its
/// answers are the ones a first run would give. Another transaction holds the row of the key the
/// batch completes; the batch, having inserted the row of the new key it claims, waits for that
/// row; then the transaction claims the batch's new key by hand, and waits for the batch's insert.
/// PostgreSQL's deadlock check runs first in the batch (its `deadlock_timeout` is the shorter, and
/// it has waited longer), and rolls its statement back; the store sends it again, it waits for
/// the transaction's commit, and answers: the key is held by the transaction's claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_batch_chosen_as_a_deadlock_victim_runs_again() {
    let Some(url) = idempotent_tests::services::postgres_url("postgres_a_batch_chosen_as_a_deadlock_victim_runs_again")
    else {
        return;
    };
    let _alone = ONE_AT_A_TIME.lock().await;
    count_statements();
    // Which of two waiting sessions PostgreSQL rolls back depends on their `deadlock_timeout`s:
    // the store's session checks after 1 s (the server's default, set here whatever the server
    // says), this test's other session after 10 s, so the store's statement is the victim.
    let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let options = options.options([("deadlock_timeout", "1s")]);
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with(options).await.unwrap();
    let table = format!("idem_deadlock_{}", uuid::Uuid::new_v4().simple());
    let store = PostgresStore::with_table(pool.clone(), &table).unwrap();
    store.create_table().await.unwrap();
    let lease = Duration::from_secs(30);
    let (completed, claimed) = (Key::new("deadlock", &"completed").unwrap(), Key::new("deadlock", &"claimed").unwrap());
    let (owner, newcomer) = (Token::new(), Token::new());
    let claim = store.claim(&ClaimRequest::new(&completed, &owner, None, lease)).await.unwrap();
    assert!(matches!(claim, Claim::Claimed));

    // Another session holds the completed key's row, in a transaction it keeps open.
    let mut other = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.unwrap();
    sqlx::raw_sql("SET deadlock_timeout = '10s'; BEGIN").execute(&mut other).await.unwrap();
    let lock = format!("SELECT 1 FROM {table} WHERE idempotency_key = $1 FOR UPDATE");
    sqlx::query(sqlx::AssertSqlSafe(lock)).bind(completed.as_str()).execute(&mut other).await.unwrap();

    let batch = {
        let store = store.clone();
        let (completed, claimed) = (completed.clone(), claimed.clone());
        let (owner, newcomer) = (owner.clone(), newcomer.clone());
        tokio::spawn(async move {
            let claims = [ClaimRequest::new(&claimed, &newcomer, None, lease)];
            let completions = [Completion::new(&completed, &owner, None, br#"{"Ok":1}"#, lease)];
            statements_of(store.claim_and_complete_many(&claims, &completions)).await
        })
    };
    // The batch has inserted the claimed key's row and waits for the completed one; this session
    // now inserts the claimed key and waits for the batch's insert: a cycle. Once the batch's
    // statement is rolled back its insert goes through; it commits, and the batch's second run
    // finds the key held.
    wait_for_a_lock_wait(&mut other, &table).await;
    let insert = format!(
        "INSERT INTO {table} (idempotency_key, state, token, expires_at) \
         VALUES ($1, 'in_progress', 'by-hand', now() + interval '30 seconds')"
    );
    let asked = std::time::Instant::now();
    sqlx::query(sqlx::AssertSqlSafe(insert)).bind(claimed.as_str()).execute(&mut other).await.unwrap();
    let waited = asked.elapsed();
    assert!(!batch.is_finished(), "the batch waits for this session's commit (finished: it failed as the victim)");
    sqlx::raw_sql("COMMIT").execute(&mut other).await.unwrap();

    let ((claims, records), statements) = batch.await.unwrap();
    let claims = claims.expect("the deadlock victim's statement ran again");
    assert!(matches!(claims[0], Ok(Claim::InProgress { .. })), "held by the other session's claim: {claims:?}");
    assert!(records.unwrap()[0].is_ok(), "recorded by its owner");
    assert!(
        waited >= Duration::from_millis(300),
        "this session waited for the batch's insert until PostgreSQL rolled the batch back ({waited:?})"
    );
    assert!(statements >= 2, "the statement of both, sent twice: {statements} statements");
    let replay = store.claim(&ClaimRequest::new(&completed, &newcomer, None, lease)).await.unwrap();
    assert!(matches!(replay, Claim::Completed(_)), "{replay:?}");

    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}"))).execute(&pool).await.unwrap();
}
