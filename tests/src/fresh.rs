//! Fresh, isolated stores on the real servers for the reliability tests: a random Redis prefix, a
//! new SQL table, a new SQLite file. Each comes with a [`Cleanup`] that removes what it made.
//!
//! A missing server skips (or fails, under `IDEMPOTENT_REQUIRE_SERVICES=1`), as [`crate::services`]
//! decides.

#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::time::Duration;

/// Removes what a fresh store made (keys, table, file). Call [`Cleanup::run`] at the end of a test.
#[derive(Debug)]
pub enum Cleanup {
    /// Delete every Redis key under this prefix.
    #[cfg(feature = "redis")]
    Redis {
        /// The server.
        url: String,
        /// The store's prefix.
        prefix: String,
    },
    /// Drop this table.
    #[cfg(feature = "postgres")]
    Postgres(idempotent_runtime::stores::sql::sqlx::PgPool, String),
    /// Drop this table.
    #[cfg(feature = "mysql")]
    MySql(idempotent_runtime::stores::sql::sqlx::MySqlPool, String),
    /// Delete this directory.
    Dir(std::path::PathBuf),
    /// Nothing to remove.
    Nothing,
}

impl Cleanup {
    /// Removes what the store made; failures are printed, not raised.
    pub async fn run(self) {
        match self {
            #[cfg(feature = "redis")]
            Cleanup::Redis { url, prefix } => {
                if let Err(e) = delete_redis_prefix(&url, &prefix).await {
                    eprintln!("cleanup: could not delete Redis keys under {prefix:?}: {e}");
                }
            }
            #[cfg(feature = "postgres")]
            Cleanup::Postgres(pool, table) => {
                use idempotent_runtime::stores::sql::sqlx;
                let drop = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")));
                if let Err(e) = drop.execute(&pool).await {
                    eprintln!("cleanup: could not drop {table}: {e}");
                }
                pool.close().await;
            }
            #[cfg(feature = "mysql")]
            Cleanup::MySql(pool, table) => {
                use idempotent_runtime::stores::sql::sqlx;
                let drop = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")));
                if let Err(e) = drop.execute(&pool).await {
                    eprintln!("cleanup: could not drop {table}: {e}");
                }
                pool.close().await;
            }
            Cleanup::Dir(dir) => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Cleanup::Nothing => {}
        }
    }
}

/// A short random suffix for names.
#[must_use]
pub fn suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// A fresh table name, `idem_rel_<tag>_<random>` (letters, digits and `_` only).
#[must_use]
pub fn table_name(tag: &str) -> String {
    format!("idem_rel_{tag}_{}", suffix())
}

/// A Redis store under a fresh prefix, built on `url` (a proxy's URL, for example).
#[cfg(feature = "redis")]
pub async fn redis_at(url: &str) -> (idempotent_runtime::RedisStore, Cleanup) {
    let prefix = format!("idempotent-rel:{}:", suffix());
    let store = idempotent_runtime::RedisStore::connect(url)
        .await
        .expect("connect to Redis")
        .with_prefix(prefix.clone())
        .expect("valid prefix");
    (store, Cleanup::Redis { url: url.to_owned(), prefix })
}

/// A Redis store under a fresh prefix on the test server, reached through a [`FaultProxy`] of
/// its own (to cut or refuse its connections), or `None` (skipped loudly) without a server.
///
/// [`FaultProxy`]: crate::proxy::FaultProxy
#[cfg(feature = "redis")]
pub async fn redis_behind_proxy(
    test: &str,
) -> Option<(idempotent_runtime::RedisStore, Cleanup, crate::proxy::FaultProxy)> {
    let url = crate::services::redis_url(test)?;
    let target = url.trim_start_matches("redis://").trim_end_matches('/').to_owned();
    let proxy = crate::proxy::FaultProxy::start(&target).await.expect("start the proxy");
    let (store, cleanup) = redis_at(&format!("redis://{}", proxy.addr())).await;
    Some((store, cleanup, proxy))
}

/// A Redis store under a fresh prefix on the test server.
#[cfg(feature = "redis")]
pub async fn redis(test: &str) -> Option<(idempotent_runtime::RedisStore, Cleanup)> {
    let url = crate::services::redis_url(test)?;
    Some(redis_at(&url).await)
}

#[cfg(feature = "redis")]
async fn delete_redis_prefix(url: &str, prefix: &str) -> Result<(), Box<dyn std::error::Error>> {
    use idempotent_runtime::stores::redis::redis;
    let mut conn = redis::Client::open(url)?.get_multiplexed_async_connection().await?;
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        if !batch.is_empty() {
            let () = redis::cmd("DEL").arg(&batch).query_async(&mut conn).await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// A PostgreSQL store in a fresh table, with a pool of `connections`, connecting to `url`.
///
/// # Errors
///
/// When the server cannot be reached or the table cannot be created.
#[cfg(feature = "postgres")]
pub async fn postgres_at(
    url: &str,
    connections: u32,
) -> Result<(idempotent_runtime::stores::sql::PostgresStore, Cleanup), String> {
    use idempotent_runtime::stores::sql::{PostgresStore, sqlx};
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .map_err(|e| format!("connect to PostgreSQL at {url}: {e}"))?;
    let table = table_name("pg");
    let store = PostgresStore::with_table(pool.clone(), &table).map_err(|e| e.to_string())?;
    store.create_table().await.map_err(|e| format!("create {table}: {e}"))?;
    Ok((store, Cleanup::Postgres(pool, table)))
}

/// A PostgreSQL store in a fresh table on the test server.
#[cfg(feature = "postgres")]
pub async fn postgres(test: &str) -> Option<(idempotent_runtime::stores::sql::PostgresStore, Cleanup)> {
    let url = crate::services::postgres_url(test)?;
    Some(postgres_at(&url, 16).await.expect("a fresh PostgreSQL store"))
}

/// A MySQL/MariaDB store in a fresh table, with a pool of `connections`, connecting to `url`.
///
/// # Errors
///
/// When the server cannot be reached or the table cannot be created.
#[cfg(feature = "mysql")]
pub async fn mysql_at(
    url: &str,
    connections: u32,
) -> Result<(idempotent_runtime::stores::sql::MySqlStore, Cleanup), String> {
    use idempotent_runtime::stores::sql::{MySqlStore, sqlx};
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .map_err(|e| format!("connect to MariaDB at {url}: {e}"))?;
    let table = table_name("my");
    let store = MySqlStore::with_table(pool.clone(), &table).map_err(|e| e.to_string())?;
    store.create_table().await.map_err(|e| format!("create {table}: {e}"))?;
    Ok((store, Cleanup::MySql(pool, table)))
}

/// A MySQL/MariaDB store in a fresh table on the test server.
#[cfg(feature = "mysql")]
pub async fn mysql(test: &str) -> Option<(idempotent_runtime::stores::sql::MySqlStore, Cleanup)> {
    let url = crate::services::mysql_url(test)?;
    Some(mysql_at(&url, 16).await.expect("a fresh MariaDB store"))
}

/// A fresh directory under the system's temporary directory.
#[must_use]
pub fn temp_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("idempotent-rel-{tag}-{}", suffix()));
    std::fs::create_dir_all(&dir).expect("create a temporary directory");
    dir
}

/// An SQLite store in a fresh file.
#[cfg(feature = "sqlite")]
pub async fn sqlite(tag: &str) -> (idempotent_runtime::stores::sql::SqliteStore, Cleanup) {
    let dir = temp_dir(tag);
    let store =
        idempotent_runtime::stores::sql::SqliteStore::open(dir.join("idempotency.db")).await.expect("open SQLite");
    (store, Cleanup::Dir(dir))
}
