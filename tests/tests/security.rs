//! Keys cannot escape their scope, their prefix or their row, and a guessed key does not leak a
//! result when the fingerprint names the caller. See RELIABILITY.md ("Threat model").
//!
//! Each store gets keys built to break out: SQL quotes and comments, `LIKE` and glob wildcards,
//! Redis hash tags and separators, backslashes, and keys that differ only by a trailing space, by
//! case, or by Unicode normalisation. Each key must keep its own record (checked through the store
//! and, for the servers, by looking at what was written), and the table or key space must hold
//! nothing else.

use std::collections::HashMap;
use std::sync::Mutex;

use idempotent_runtime::{Call, Error, Key, MemoryStore, Store};

/// Keys meant to escape, or to collide with one another.
fn hostile_keys() -> Vec<String> {
    [
        "order-1",
        "order-1 ",
        "order-1  ",
        " order-1",
        "ORDER-1",
        "order-1\u{a0}",
        "caf\u{e9}",
        "cafe\u{301}",
        "stra\u{df}e",
        "strasse",
        "'; DROP TABLE idempotency_records; --",
        "' OR '1'='1",
        "\\'; SELECT 1; --",
        "%",
        "_",
        "order-%",
        "*",
        "order-1*",
        "[o]rder-1",
        "{order-1}",
        "order-1:extra",
        ":",
        "other-scope:order-1",
        "\u{1F600}",
        "\"quoted\"",
        "x\\y",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect()
}

/// Calls every hostile key twice in `scope`; each must run once and replay its own key text.
async fn keys_keep_their_own_records<S: Store>(store: &S, scope: &str) -> Vec<String> {
    let keys = hostile_keys();
    let runs = Mutex::new(HashMap::<String, u32>::new());
    for round in 0..2 {
        for key in &keys {
            let got = Call::new(scope, key)
                .run(store, async {
                    *runs.lock().unwrap().entry(key.clone()).or_default() += 1;
                    Ok::<_, Error>(key.clone())
                })
                .await;
            assert_eq!(got.as_ref().ok(), Some(key), "round {round}: key {key:?} got {got:?}");
        }
    }
    for key in &keys {
        assert_eq!(runs.lock().unwrap().get(key).copied(), Some(1), "{key:?} must run exactly once");
    }
    keys.iter().map(|k| Key::new(scope, k).unwrap().as_str().to_owned()).collect()
}

#[tokio::test]
async fn memory_hostile_keys_keep_their_own_records() {
    let store = MemoryStore::new();
    let written = keys_keep_their_own_records(&store, "sec").await;
    assert_eq!(store.len(), written.len());
}

/// The threat model's case: a caller who guesses another caller's key. Without a fingerprint it
/// gets the other caller's recorded result; with the caller's identity in the fingerprint (or in
/// the key or scope) it gets `FingerprintMismatch` and nothing of the other's result.
#[tokio::test]
async fn memory_guessed_keys_leak_nothing_when_the_fingerprint_names_the_caller() {
    let store = MemoryStore::new();
    let statement = |user: &'static str, fingerprinted: bool| {
        let call = Call::new("statements", "req-7");
        let call = if fingerprinted { call.fingerprint(&user) } else { call };
        call.run(&store, async move { Ok::<_, Error>(format!("balance of {user}: 100")) })
    };
    assert_eq!(statement("alice", true).await.unwrap(), "balance of alice: 100");
    let mallory = statement("mallory", true).await;
    assert!(matches!(mallory, Err(Error::FingerprintMismatch { .. })), "{mallory:?}");
    assert!(!mallory.unwrap_err().to_string().contains("alice"), "the error must not carry the other's result");

    // Without a fingerprint, the key alone decides: a guessed key replays the other's result.
    let unfingerprinted = Call::new("statements-open", "req-7");
    assert_eq!(
        unfingerprinted.run(&store, async { Ok::<_, Error>("alice's secret".to_owned()) }).await.unwrap(),
        "alice's secret"
    );
    let guess = Call::new("statements-open", "req-7").run(&store, async { Ok::<_, Error>(String::new()) }).await;
    assert_eq!(guess.unwrap(), "alice's secret", "documented: keys are bearer secrets without a fingerprint");
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_hostile_keys_stay_inside_the_prefix() {
    use idempotent_runtime::stores::redis::redis;
    let Some(url) = idempotent_tests::services::redis_url("redis_hostile_keys_stay_inside_the_prefix") else {
        return;
    };
    let (store, cleanup) = idempotent_tests::fresh::redis_at(&url).await;
    let written = keys_keep_their_own_records(&store, "sec").await;
    let mut raw = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    for key in &written {
        let name = format!("{}{key}", store.prefix());
        let exists: bool = redis::cmd("EXISTS").arg(&name).query_async(&mut raw).await.unwrap();
        assert!(exists, "{name:?} holds the record");
    }
    // Nothing else under the prefix. (The prefix is a UUID: no glob characters of its own.)
    let mut cursor = 0u64;
    let mut found = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{}*", store.prefix()))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut raw)
            .await
            .unwrap();
        found += batch.len();
        if next == 0 {
            break;
        }
        cursor = next;
    }
    assert_eq!(found, written.len(), "one Redis key per idempotency key, all under the prefix");
    cleanup.run().await;
}

/// For the SQL stores: the statements that count the rows of one key (a parameter) and of the table.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
fn count_sql(table: &str, placeholder: &str) -> (String, String) {
    (
        format!("SELECT COUNT(*) FROM {table} WHERE idempotency_key = {placeholder}"),
        format!("SELECT COUNT(*) FROM {table}"),
    )
}

/// Each key is exactly one row, found by a parameterised, binary equality; the table (whose
/// default name one key tries to drop) holds nothing else.
macro_rules! assert_rows_exact {
    ($pool:expr, $table:expr, $placeholder:expr, $written:expr) => {{
        use idempotent_runtime::stores::sql::sqlx;
        let (one, all) = count_sql($table, $placeholder);
        for key in $written {
            let rows: i64 =
                sqlx::query_scalar(sqlx::AssertSqlSafe(one.clone())).bind(key.as_str()).fetch_one($pool).await.unwrap();
            assert_eq!(rows, 1, "{key:?} is one row");
        }
        let total: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(all)).fetch_one($pool).await.unwrap();
        assert_eq!(usize::try_from(total).unwrap(), $written.len(), "one row per key, nothing else");
    }};
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_hostile_keys_stay_in_their_rows() {
    let Some((store, cleanup)) = idempotent_tests::fresh::postgres("postgres_hostile_keys_stay_in_their_rows").await
    else {
        return;
    };
    let written = keys_keep_their_own_records(&store, "sec").await;
    assert_rows_exact!(store.pool(), store.table(), "$1", &written);
    cleanup.run().await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mysql_hostile_keys_stay_in_their_rows() {
    let Some((store, cleanup)) = idempotent_tests::fresh::mysql("mysql_hostile_keys_stay_in_their_rows").await else {
        return;
    };
    let written = keys_keep_their_own_records(&store, "sec").await;
    // `BINARY` so that MariaDB's PAD SPACE collations cannot make this check lenient.
    let placeholder = "BINARY ?";
    assert_rows_exact!(store.pool(), store.table(), placeholder, &written);
    cleanup.run().await;
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_hostile_keys_stay_in_their_rows() {
    let (store, cleanup) = idempotent_tests::fresh::sqlite("security").await;
    let written = keys_keep_their_own_records(&store, "sec").await;
    assert_rows_exact!(store.pool(), store.table(), "?1", &written);
    cleanup.run().await;
}
