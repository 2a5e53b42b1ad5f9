//! A store chosen at run time: `AnyStore` passes the conformance suite
//! over the memory store and Redis, `AnyStore::from_url` opens every backend from its URL
//! (against the real servers), and bad URLs are typed errors that name the fix.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idempotent_runtime::stores::{AnyStore, StoreUrlError};
use idempotent_runtime::{Call, Error, MemoryStore, Store};

idempotent_tests::conformance_suite!(conformance_any_memory, async { Some(AnyStore::new(MemoryStore::new())) });

#[cfg(feature = "redis")]
idempotent_tests::conformance_suite!(
    conformance_any_redis,
    async {
        let url = idempotent_tests::services::redis_url("conformance_any_redis")?;
        let prefix = format!("idempotent-test:{}:", uuid::Uuid::new_v4().simple());
        let store = idempotent_runtime::RedisStore::connect(&url).await.expect("connect to Redis");
        Some(AnyStore::new(store.with_prefix(prefix).expect("valid prefix")))
    },
    self_expiring
);

/// Runs a call twice under a fresh scope on `store`: the body runs once, the second call replays.
async fn runs_once_then_replays(store: &AnyStore) -> String {
    let scope = format!("any-{}", uuid::Uuid::new_v4().simple());
    let runs = AtomicU32::new(0);
    for _ in 0..2 {
        let value = Call::new(&scope, "k")
            .retention(Duration::from_secs(60))
            .run(store, async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Error>(42u32)
            })
            .await
            .expect("the call succeeds");
        assert_eq!(value, 42);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{store:?} ran the body once");
    scope
}

#[tokio::test]
async fn memory_any_store_from_url() {
    let store = AnyStore::from_url("memory://").await.expect("memory:// opens");
    assert!(store.type_name().ends_with("MemoryStore"), "{store:?}");
    assert_eq!(store.name(), "memory");
    runs_once_then_replays(&store).await;
    assert_eq!(store.max_record_bytes(), idempotent_runtime::DEFAULT_MAX_RECORD_BYTES);

    // The wrapped store's own limit comes through, and is enforced on the erased store.
    let small = AnyStore::new(MemoryStore::with_max_record_bytes(16));
    assert_eq!(small.max_record_bytes(), 16);
    // An `AnyStore` wrapped again is the same store, not a store of a store (which would box
    // every step twice).
    let again = AnyStore::new(small.clone());
    assert!(again.type_name().ends_with("MemoryStore"), "{again:?}");
    assert_eq!(again.max_record_bytes(), 16);
    let result = Call::new("any-limit", "k").run(&small, async { Ok::<_, Error>("x".repeat(100)) }).await;
    assert_eq!(result.expect("the first caller gets its value").len(), 100);
    let replay = Call::new("any-limit", "k").run(&small, async { Ok::<_, Error>(String::new()) }).await;
    assert!(matches!(replay, Err(Error::Unrecordable { .. })), "{replay:?}");
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_any_store_from_url_keeps_records_in_the_file() {
    let dir = idempotent_tests::fresh::temp_dir("any-sqlite");
    let url = format!("sqlite://{}", dir.join("records.db").display());
    let store = AnyStore::from_url(&url).await.expect("sqlite:// opens");
    assert!(
        store.type_name().ends_with("SqlStore<idempotent_runtime::stores::sql::sqlite::SqliteDialect>"),
        "{store:?}"
    );
    assert_eq!(store.name(), "sqlite");
    let scope = runs_once_then_replays(&store).await;
    drop(store);

    // Reopened from the same URL: the record is still there, so the body does not run.
    let reopened = AnyStore::from_url(&url).await.expect("sqlite:// reopens");
    let value = Call::new(&scope, "k")
        .run(&reopened, async { Err::<u32, _>(Error::Fingerprint("the body must not run".into())) })
        .await
        .expect("replayed from the file");
    assert_eq!(value, 42);
    let _ = std::fs::remove_dir_all(dir);
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_any_store_from_url() {
    let Some(url) = idempotent_tests::services::redis_url("redis_any_store_from_url") else { return };
    let store = AnyStore::from_url(&url).await.expect("redis:// opens");
    assert!(store.type_name().ends_with("RedisStore"), "{store:?}");
    runs_once_then_replays(&store).await; // its keys expire after the 60 s retention
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_any_store_from_url_creates_its_table() {
    use idempotent_runtime::stores::sql::sqlx;
    let Some(url) = idempotent_tests::services::postgres_url("postgres_any_store_from_url_creates_its_table") else {
        return;
    };
    let store = AnyStore::from_url(&url).await.expect("postgres:// opens");
    assert!(
        store.type_name().ends_with("SqlStore<idempotent_runtime::stores::sql::postgres::PostgresDialect>"),
        "{store:?}"
    );
    let scope = runs_once_then_replays(&store).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let deleted = sqlx::query("DELETE FROM idempotency_records WHERE idempotency_key LIKE $1")
        .bind(format!("{scope}:%"))
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 1, "the record is in the default table");
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mysql_any_store_from_url_creates_its_table() {
    use idempotent_runtime::stores::sql::sqlx;
    let Some(url) = idempotent_tests::services::mysql_url("mysql_any_store_from_url_creates_its_table") else {
        return;
    };
    let store = AnyStore::from_url(&url).await.expect("mysql:// opens");
    assert!(store.type_name().ends_with("SqlStore<idempotent_runtime::stores::sql::mysql::MySqlDialect>"), "{store:?}");
    let scope = runs_once_then_replays(&store).await;
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    let deleted = sqlx::query("DELETE FROM idempotency_records WHERE idempotency_key LIKE ?")
        .bind(format!("{scope}:%"))
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 1, "the record is in the default table");
}

async fn url_error(url: &str) -> StoreUrlError {
    match AnyStore::from_url(url).await {
        Ok(store) => panic!("{url} opened {store:?}"),
        Err(error) => error,
    }
}

#[tokio::test]
async fn memory_any_store_bad_urls_are_typed_errors_that_name_the_fix() {
    let error = url_error("mongodb://db/app").await;
    assert!(matches!(&error, StoreUrlError::UnknownScheme { scheme, .. } if scheme == "mongodb"), "{error:?}");
    assert!(error.to_string().contains("expected memory://, sqlite://PATH, redis://"), "{error}");

    for (url, says) in [
        ("127.0.0.1:6379", "no `scheme://`"),
        ("://x", "scheme must be"),
        ("memory://extra", "nothing after"),
        ("sqlite://", "needs a file path"),
        ("sqlite://?mode=rwc", "needs a file path"),
        ("sqlite://:memory:", "use memory://"),
        ("sqlite://file::memory:?cache=shared", "use memory://"),
        ("redis://", "needs a host"),
        ("redis:///0", "needs a host"),
        ("postgres://user@/db", "needs a host"),
        ("mysql://", "needs a host"),
    ] {
        let error = url_error(url).await;
        assert!(matches!(error, StoreUrlError::Malformed { .. }), "{url}: {error:?}");
        assert!(error.to_string().contains(says), "{url}: {error}");
    }
}

/// `sqlite://:memory:` names SQLite's in-memory database, of which each connection has its own:
/// the store's pool would hold several databases, the table created in one only. Either the URL
/// is refused with a typed error that names `memory://`, or the store it opens is one database:
/// 32 first calls on 32 keys at once all run and record.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_any_store_from_url_in_memory_is_one_database_or_refused() {
    let store = match AnyStore::from_url("sqlite://:memory:").await {
        Err(error @ StoreUrlError::Malformed { .. }) => {
            assert!(error.to_string().contains("memory://"), "{error}");
            return;
        }
        Err(error) => panic!("sqlite://:memory:: {error:?}"),
        Ok(store) => store,
    };
    let scope = format!("any-mem-{}", uuid::Uuid::new_v4().simple());
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(32));
    let calls: Vec<_> = (0..32u32)
        .map(|k| {
            let (store, scope, start) = (store.clone(), scope.clone(), std::sync::Arc::clone(&start));
            tokio::spawn(async move {
                start.wait().await;
                Call::new(&scope, &k).run(&store, async { Ok::<_, Error>(k) }).await
            })
        })
        .collect();
    let mut failed = Vec::new();
    for call in calls {
        if let Err(error) = call.await.unwrap() {
            failed.push(error.to_string());
        }
    }
    assert!(failed.is_empty(), "{} of 32 calls failed, the first: {:?}", failed.len(), failed.first());
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_any_store_that_cannot_open_is_a_connect_error_without_the_password() {
    let test = "postgres_any_store_that_cannot_open_is_a_connect_error_without_the_password";
    let Some(url) = idempotent_tests::services::postgres_url(test) else { return };
    // The server answers, but the database does not exist (a refused connection would be
    // retried by the pool for its 30 s acquire timeout).
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let authority = rest.split('/').next().expect("a host");
    let (user, host) = authority
        .rsplit_once('@')
        .map_or(("postgres", authority), |(user_info, host)| (user_info.split(':').next().unwrap_or("postgres"), host));
    let wrong = format!("{scheme}://{user}:hunter2@{host}/no_such_db_{}", uuid::Uuid::new_v4().simple());
    let error = url_error(&wrong).await;
    assert!(matches!(error, StoreUrlError::Connect { .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.contains(&format!("{user}:***@{host}/no_such_db_")), "{message}");
    assert!(!message.contains("hunter2"), "{message}");
}
