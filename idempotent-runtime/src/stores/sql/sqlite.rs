//! The SQLite store: the embedded default for one machine, in a file that survives restarts.
//!
//! [`SqliteStore::open`] makes one in a line: it creates the file and the table, and turns on WAL
//! and a busy timeout so concurrent writers wait for each other instead of failing with
//! `SQLITE_BUSY`. Several processes on one machine may share the file.
//!
//! # Schema
//!
//! [`SqliteStore::create_table`] runs this (for the default table name); to create the table by
//! hand, run it yourself:
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS idempotency_records (
//!     idempotency_key TEXT PRIMARY KEY NOT NULL,
//!     state TEXT NOT NULL,
//!     token TEXT NOT NULL,
//!     fingerprint TEXT,
//!     outcome TEXT,
//!     expires_at TEXT NOT NULL
//! );
//! CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
//! ```
//!
//! `expires_at` is UTC text such as `2030-01-31 12:00:00.250` (`strftime('%Y-%m-%d %H:%M:%f')`),
//! which sorts as it compares.
//!
//! # Statements
//!
//! A claim is one `INSERT ... ON CONFLICT (idempotency_key) DO UPDATE ... WHERE <the row has
//! expired> RETURNING`; only when it returns nothing (a live row) does a `SELECT` read that row.
//! [`SqliteStore::begin`] starts its transactions with `BEGIN IMMEDIATE`, so a transaction takes
//! the write lock (waiting its turn) before it reads anything.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqliteSynchronous};
use sqlx::{Executor, Row, Sqlite, Transaction};

use super::{CLAIM_ATTEMPTS, DEFAULT_TABLE, Found, PurgeTask, Statements, TableName, TableNameError, Verdict};
use crate::store::DEFAULT_MAX_RECORD_BYTES;
use crate::{Claim, ClaimRequest, Detached, Key, Store, StoreError, Token};

const BACKEND: &str = "sqlite";

/// How long a writer waits for another's lock before failing with `SQLITE_BUSY`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

const NOW: &str = "strftime('%Y-%m-%d %H:%M:%f', 'now')";

fn statements(table: TableName) -> Statements {
    let t = &table.full;
    // SQLite puts the schema on the index's name, and wants the table unqualified.
    let index = match &table.schema {
        Some(schema) => format!("{schema}.{}_expires_at", table.name),
        None => format!("{}_expires_at", table.name),
    };
    let create = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (\n    \
             idempotency_key TEXT PRIMARY KEY NOT NULL,\n    \
             state TEXT NOT NULL,\n    \
             token TEXT NOT NULL,\n    \
             fingerprint TEXT,\n    \
             outcome TEXT,\n    \
             expires_at TEXT NOT NULL\n)"
        )
        .into(),
        format!("CREATE INDEX IF NOT EXISTS {index} ON {} (expires_at)", table.name).into(),
    ];
    let claim = format!(
        "INSERT INTO {t} AS r (idempotency_key, state, token, fingerprint, outcome, expires_at) \
         VALUES (?1, 'in_progress', ?2, ?3, NULL, strftime('%Y-%m-%d %H:%M:%f', 'now', ?4)) \
         ON CONFLICT (idempotency_key) DO UPDATE SET state = 'in_progress', token = excluded.token, \
         fingerprint = excluded.fingerprint, outcome = NULL, expires_at = excluded.expires_at \
         WHERE r.expires_at <= {NOW} \
         RETURNING token"
    );
    let read = format!(
        "SELECT state, token, fingerprint, outcome, \
         CAST((julianday(expires_at) - julianday('now')) * 86400000000.0 AS INTEGER) \
         FROM {t} WHERE idempotency_key = ?1"
    );
    let live = format!("expires_at > {NOW}");
    // A row this token already completed matches too, and is written back unchanged.
    let complete = format!(
        "UPDATE {t} SET outcome = CASE WHEN state = 'in_progress' THEN ?3 ELSE outcome END, \
         expires_at = CASE WHEN state = 'in_progress' \
         THEN strftime('%Y-%m-%d %H:%M:%f', 'now', ?4) ELSE expires_at END, \
         state = 'completed' \
         WHERE idempotency_key = ?1 AND token = ?2 AND {live}"
    );
    let release =
        format!("DELETE FROM {t} WHERE idempotency_key = ?1 AND token = ?2 AND state = 'in_progress' AND {live}");
    let extend = format!(
        "UPDATE {t} SET expires_at = strftime('%Y-%m-%d %H:%M:%f', 'now', ?3) \
         WHERE idempotency_key = ?1 AND token = ?2 AND state = 'in_progress' AND {live}"
    );
    let purge = format!("DELETE FROM {t} WHERE expires_at <= {NOW}");
    Statements {
        table,
        create,
        claim: claim.into(),
        read: read.into(),
        complete: complete.into(),
        release: release.into(),
        extend: extend.into(),
        purge: purge.into(),
    }
}

/// A lease or retention as an SQLite date modifier, such as `+60.000000 seconds`.
fn modifier(duration: Duration) -> String {
    let micros = super::micros(duration);
    format!("+{}.{:06} seconds", micros / 1_000_000, micros % 1_000_000)
}

fn backend(error: sqlx::Error) -> StoreError {
    StoreError::backend(BACKEND, error)
}

/// A store in an SQLite table, for one machine.
///
/// Cloning gives another handle on the same pool and table.
///
/// ```
/// use idempotent_runtime::stores::sql::SqliteStore;
/// use idempotent_runtime::{Error, idempotent};
///
/// #[idempotent(key = order, store = store)]
/// async fn ship(store: &SqliteStore, order: u64) -> Result<String, Error> {
///     Ok(format!("shipped {order}"))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = std::env::temp_dir().join(format!("idempotent-doc-{}", uuid::Uuid::new_v4().simple()));
/// # std::fs::create_dir_all(&dir)?;
/// # let path = dir.join("idempotency.db");
/// let store = SqliteStore::open(&path).await?;
/// assert_eq!(ship(&store, 7).await?, "shipped 7");
/// assert_eq!(ship(&store, 7).await?, "shipped 7"); // replayed from the file
/// # store.pool().close().await;
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    sql: Arc<Statements>,
    max_record_bytes: usize,
}

impl SqliteStore {
    /// Opens (creating it if needed) the database file at `path`, in WAL mode with a busy timeout,
    /// and creates the table `idempotency_records` in it if it does not exist.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, sqlx::Error> {
        let pool = SqlitePool::connect_with(Self::connect_options(path)).await?;
        let store = Self::new(pool);
        store.create_table().await?;
        Ok(store)
    }

    /// The connection options [`open`](Self::open) uses, to build a pool of your own: the file is
    /// created if missing, in WAL mode, `synchronous = NORMAL`, with a 30 s busy timeout.
    pub fn connect_options(path: impl AsRef<Path>) -> SqliteConnectOptions {
        SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT)
    }

    /// A store in the table `idempotency_records` of `pool`'s database (see
    /// [`create_table`](Self::create_table)).
    #[must_use]
    pub fn new(pool: SqlitePool) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).unwrap_or_else(|_| unreachable!("the default table name is valid"))
    }

    /// A store in `table` (`name` or `schema.name`: letters, digits and `_`).
    pub fn with_table(pool: SqlitePool, table: &str) -> Result<Self, TableNameError> {
        let sql = Arc::new(statements(TableName::parse(table)?));
        Ok(SqliteStore { pool, sql, max_record_bytes: DEFAULT_MAX_RECORD_BYTES })
    }

    /// Records outcomes of at most `limit` encoded bytes (default 1 MiB); larger results are not
    /// recorded and replay as [`Error::Unrecordable`](crate::Error::Unrecordable).
    #[must_use]
    pub fn with_max_record_bytes(mut self, limit: usize) -> Self {
        self.max_record_bytes = limit;
        self
    }

    /// Creates the table and its index if they do not exist (see the [module docs](self)).
    pub async fn create_table(&self) -> Result<(), sqlx::Error> {
        for statement in &self.sql.create {
            sqlx::query(super::sql(statement)).execute(&self.pool).await?;
        }
        Ok(())
    }

    /// The SQL [`create_table`](Self::create_table) runs, for your own migrations.
    #[must_use]
    pub fn create_table_sql(&self) -> String {
        super::script(&self.sql.create)
    }

    /// The table's name.
    #[must_use]
    pub fn table(&self) -> &str {
        &self.sql.table.full
    }

    /// The pool.
    #[must_use]
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Begins a transaction (`BEGIN IMMEDIATE`) on the pool, to claim keys and record results
    /// inside it.
    pub async fn begin(&self) -> Result<SqliteTxStore, sqlx::Error> {
        Ok(self.in_transaction(self.pool.begin_with("BEGIN IMMEDIATE").await?))
    }

    /// Claims keys and records results inside `tx`, a transaction you began (preferably with
    /// `BEGIN IMMEDIATE`: a deferred transaction that read before it writes may fail with
    /// `SQLITE_BUSY` when another connection wrote in between).
    #[must_use]
    pub fn in_transaction(&self, tx: Transaction<'static, Sqlite>) -> SqliteTxStore {
        SqliteTxStore {
            tx: tokio::sync::Mutex::new(tx),
            sql: Arc::clone(&self.sql),
            max_record_bytes: self.max_record_bytes,
        }
    }

    /// Purges expired rows now and then every `every`, on the current Tokio runtime, until the
    /// returned task is shut down or dropped. Failures are logged and retried at the next interval.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    pub fn spawn_purge(&self, every: Duration) -> PurgeTask {
        super::spawn_purge(self.clone(), every, BACKEND)
    }
}

impl Store for SqliteStore {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(backend)?;
        claim(&mut conn, &self.sql, request).await
    }

    async fn complete(&self, key: &Key, token: &Token, outcome: &[u8], retention: Duration) -> Result<(), StoreError> {
        complete(&self.pool, &self.sql, key, token, outcome, retention).await
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        release(&self.pool, &self.sql, key, token).await
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        extend(&self.pool, &self.sql, key, token, lease).await
    }

    fn detach(&self, step: Detached) {
        crate::stores::spawn_detached(self.clone(), step);
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let done = sqlx::query(super::sql(&self.sql.purge)).execute(&self.pool).await.map_err(backend)?;
        Ok(done.rows_affected())
    }

    fn max_record_bytes(&self) -> usize {
        self.max_record_bytes
    }
}

/// A [`SqliteStore`] working inside one transaction: the key is claimed and the result recorded in
/// the same transaction as the body's own writes, so they commit together or not at all.
///
/// SQLite has one writer at a time, so transactions from [`SqliteStore::begin`] run one after
/// another; a duplicate's transaction starts after the first one ended and replays its committed
/// result, or runs the body if it rolled back. The body reaches the transaction through
/// [`conn`](Self::conn); after the call, [`commit`](Self::commit) or [`rollback`](Self::rollback);
/// dropping it rolls back.
#[derive(Debug)]
pub struct SqliteTxStore {
    tx: tokio::sync::Mutex<Transaction<'static, Sqlite>>,
    sql: Arc<Statements>,
    max_record_bytes: usize,
}

impl SqliteTxStore {
    /// The transaction's connection, for the body's own queries: `.execute(&mut *tx.conn().await)`.
    ///
    /// Drop it before the call ends (keep it inside one statement): the store needs the connection
    /// to record the result.
    pub async fn conn(&self) -> tokio::sync::MappedMutexGuard<'_, SqliteConnection> {
        tokio::sync::MutexGuard::map(self.tx.lock().await, |tx| &mut **tx)
    }

    /// Commits the transaction: the body's writes and the recorded result become visible together.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        self.tx.into_inner().commit().await
    }

    /// Rolls the transaction back: neither the body's writes nor the claim remain.
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        self.tx.into_inner().rollback().await
    }

    /// The transaction itself.
    #[must_use]
    pub fn into_transaction(self) -> Transaction<'static, Sqlite> {
        self.tx.into_inner()
    }
}

impl Store for SqliteTxStore {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let mut tx = self.tx.lock().await;
        claim(&mut tx, &self.sql, request).await
    }

    async fn complete(&self, key: &Key, token: &Token, outcome: &[u8], retention: Duration) -> Result<(), StoreError> {
        let mut tx = self.tx.lock().await;
        complete(&mut **tx, &self.sql, key, token, outcome, retention).await
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        let mut tx = self.tx.lock().await;
        release(&mut **tx, &self.sql, key, token).await
    }

    /// A claim inside a transaction lasts as long as the transaction: there is no lease to renew.
    async fn extend(&self, _: &Key, _: &Token, _: Duration) -> Result<(), StoreError> {
        Ok(())
    }

    // detach: nothing to do. The claim lives only in this transaction, which rolls back when
    // dropped uncommitted.

    fn max_record_bytes(&self) -> usize {
        self.max_record_bytes
    }
}

async fn claim(conn: &mut SqliteConnection, sql: &Statements, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
    let mut last_seen = None;
    for _ in 0..CLAIM_ATTEMPTS {
        let claimed = sqlx::query(super::sql(&sql.claim))
            .bind(request.key.as_str())
            .bind(request.token.as_str())
            .bind(request.fingerprint.map(crate::Fingerprint::as_str))
            .bind(modifier(request.lease))
            .fetch_optional(&mut *conn)
            .await
            .map_err(backend)?;
        if claimed.is_some() {
            return Ok(Claim::Claimed);
        }
        let row = sqlx::query(super::sql(&sql.read))
            .bind(request.key.as_str())
            .fetch_optional(&mut *conn)
            .await
            .map_err(backend)?;
        let Some(row) = row else { continue }; // released or purged since: claim again
        let found = Found {
            state: row.try_get(0).map_err(|e| super::column_error(&e))?,
            token: row.try_get(1).map_err(|e| super::column_error(&e))?,
            fingerprint: row.try_get(2).map_err(|e| super::column_error(&e))?,
            outcome: row.try_get(3).map_err(|e| super::column_error(&e))?,
            remaining_micros: row.try_get(4).map_err(|e| super::column_error(&e))?,
        };
        last_seen.clone_from(&found.fingerprint);
        match found.verdict(request.token)? {
            Verdict::Mine => return Ok(Claim::Claimed),
            Verdict::Live(claim) => return Ok(claim),
            Verdict::Expired => {}
        }
    }
    // The row kept changing under us: report it as busy, to be retried.
    Ok(Claim::InProgress { fingerprint: last_seen.map(crate::Fingerprint::from_stored), lease_remaining: None })
}

async fn complete<'c>(
    executor: impl Executor<'c, Database = Sqlite>,
    sql: &Statements,
    key: &Key,
    token: &Token,
    outcome: &[u8],
    retention: Duration,
) -> Result<(), StoreError> {
    let done = sqlx::query(super::sql(&sql.complete))
        .bind(key.as_str())
        .bind(token.as_str())
        .bind(super::outcome_text(outcome)?)
        .bind(modifier(retention))
        .execute(executor)
        .await
        .map_err(backend)?;
    if done.rows_affected() == 1 { Ok(()) } else { Err(StoreError::NotOwner) }
}

async fn release<'c>(
    executor: impl Executor<'c, Database = Sqlite>,
    sql: &Statements,
    key: &Key,
    token: &Token,
) -> Result<(), StoreError> {
    let done = sqlx::query(super::sql(&sql.release))
        .bind(key.as_str())
        .bind(token.as_str())
        .execute(executor)
        .await
        .map_err(backend)?;
    if done.rows_affected() == 1 { Ok(()) } else { Err(StoreError::NotOwner) }
}

async fn extend<'c>(
    executor: impl Executor<'c, Database = Sqlite>,
    sql: &Statements,
    key: &Key,
    token: &Token,
    lease: Duration,
) -> Result<(), StoreError> {
    let done = sqlx::query(super::sql(&sql.extend))
        .bind(key.as_str())
        .bind(token.as_str())
        .bind(modifier(lease))
        .execute(executor)
        .await
        .map_err(backend)?;
    if done.rows_affected() == 1 { Ok(()) } else { Err(StoreError::NotOwner) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sqlite_documented_schema_is_the_one_created() {
        let docs = include_str!("sqlite.rs")
            .lines()
            .filter_map(|line| line.strip_prefix("//! "))
            .collect::<Vec<_>>()
            .join("\n");
        let created = super::super::script(
            &super::statements(super::super::TableName::parse("idempotency_records").unwrap()).create,
        );
        assert!(docs.contains(&created), "module docs:\n{docs}\ncreated:\n{created}");
    }

    #[test]
    fn sqlite_modifiers_are_seconds_with_micros() {
        assert_eq!(super::modifier(std::time::Duration::from_millis(60_250)), "+60.250000 seconds");
    }
}
