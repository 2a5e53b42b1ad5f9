//! The PostgreSQL store, and its transactional variant.
//!
//! # Schema
//!
//! [`PostgresStore::create_table`] runs this (for the default table name); to create the table
//! by hand, run it yourself:
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS idempotency_records (
//!     idempotency_key TEXT PRIMARY KEY,
//!     state TEXT NOT NULL,
//!     token TEXT NOT NULL,
//!     fingerprint TEXT,
//!     outcome TEXT,
//!     expires_at TIMESTAMPTZ NOT NULL
//! );
//! CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
//! ```
//!
//! `outcome` is JSON text: `SELECT outcome::jsonb FROM idempotency_records` reads it as JSON.
//!
//! # Statements
//!
//! A claim is one `INSERT ... ON CONFLICT (idempotency_key) DO UPDATE ... WHERE <the row has
//! expired> RETURNING`; only when it returns nothing (a live row) does a `SELECT` read that row.
//! Times come from `clock_timestamp()`, the server's clock at the moment of the statement (not
//! `now()`, which stands still at the start of a transaction).
//!
//! In [`PostgresTxStore`], run the transaction at READ COMMITTED (the default): at REPEATABLE READ
//! a duplicate that waited for the first transaction fails with a serialization error instead of
//! replaying.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Executor, Postgres, Row, Transaction};

use super::{CLAIM_ATTEMPTS, DEFAULT_TABLE, Found, PurgeTask, Statements, TableName, TableNameError, Verdict};
use crate::store::DEFAULT_MAX_RECORD_BYTES;
use crate::{Claim, ClaimRequest, Detached, Key, Store, StoreError, Token};

const BACKEND: &str = "postgres";

fn statements(table: TableName) -> Statements {
    let t = &table.full;
    let index = format!("{}_expires_at", table.name);
    let create = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (\n    \
             idempotency_key TEXT PRIMARY KEY,\n    \
             state TEXT NOT NULL,\n    \
             token TEXT NOT NULL,\n    \
             fingerprint TEXT,\n    \
             outcome TEXT,\n    \
             expires_at TIMESTAMPTZ NOT NULL\n)"
        )
        .into(),
        format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (expires_at)").into(),
    ];
    let claim = format!(
        "INSERT INTO {t} AS r (idempotency_key, state, token, fingerprint, outcome, expires_at) \
         VALUES ($1, 'in_progress', $2, $3, NULL, clock_timestamp() + $4 * INTERVAL '1 microsecond') \
         ON CONFLICT (idempotency_key) DO UPDATE SET state = 'in_progress', token = EXCLUDED.token, \
         fingerprint = EXCLUDED.fingerprint, outcome = NULL, expires_at = EXCLUDED.expires_at \
         WHERE r.expires_at <= clock_timestamp() \
         RETURNING r.token"
    );
    let read = format!(
        "SELECT state, token, fingerprint, outcome, \
         CAST(EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000000 AS BIGINT) \
         FROM {t} WHERE idempotency_key = $1"
    );
    let live = "expires_at > clock_timestamp()";
    // A row this token already completed matches too, and is written back unchanged.
    let complete = format!(
        "UPDATE {t} SET outcome = CASE WHEN state = 'in_progress' THEN $3 ELSE outcome END, \
         expires_at = CASE WHEN state = 'in_progress' \
         THEN clock_timestamp() + $4 * INTERVAL '1 microsecond' ELSE expires_at END, \
         state = 'completed' \
         WHERE idempotency_key = $1 AND token = $2 AND {live}"
    );
    let release =
        format!("DELETE FROM {t} WHERE idempotency_key = $1 AND token = $2 AND state = 'in_progress' AND {live}");
    let extend = format!(
        "UPDATE {t} SET expires_at = clock_timestamp() + $3 * INTERVAL '1 microsecond' \
         WHERE idempotency_key = $1 AND token = $2 AND state = 'in_progress' AND {live}"
    );
    let purge = format!("DELETE FROM {t} WHERE expires_at <= clock_timestamp()");
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

fn backend(error: sqlx::Error) -> StoreError {
    StoreError::backend(BACKEND, error)
}

/// A store in a PostgreSQL table, shared by every application server using the database.
///
/// Cloning gives another handle on the same pool and table.
///
/// ```no_run
/// use idempotent_runtime::stores::sql::{PostgresStore, sqlx};
///
/// # async fn setup() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1:5432/app").await?;
/// let store = PostgresStore::new(pool);
/// store.create_table().await?;
/// let purging = store.spawn_purge(std::time::Duration::from_secs(600));
/// // ... use `store` with #[idempotent(store = ...)] ...
/// purging.shutdown().await;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    sql: Arc<Statements>,
    max_record_bytes: usize,
}

impl PostgresStore {
    /// A store in the table `idempotency_records` (see [`create_table`](Self::create_table)).
    #[must_use]
    pub fn new(pool: PgPool) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).unwrap_or_else(|_| unreachable!("the default table name is valid"))
    }

    /// A store in `table` (`name` or `schema.name`: letters, digits and `_`).
    pub fn with_table(pool: PgPool, table: &str) -> Result<Self, TableNameError> {
        let sql = Arc::new(statements(TableName::parse(table)?));
        Ok(PostgresStore { pool, sql, max_record_bytes: DEFAULT_MAX_RECORD_BYTES })
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
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Begins a transaction on the pool, to claim keys and record results inside it.
    pub async fn begin(&self) -> Result<PostgresTxStore, sqlx::Error> {
        Ok(self.in_transaction(self.pool.begin().await?))
    }

    /// Claims keys and records results inside `tx`, a transaction you began.
    #[must_use]
    pub fn in_transaction(&self, tx: Transaction<'static, Postgres>) -> PostgresTxStore {
        PostgresTxStore {
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

impl Store for PostgresStore {
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

/// A [`PostgresStore`] working inside one transaction: the key is claimed and the result recorded
/// in the same transaction as the body's own writes, so they commit together or not at all.
///
/// A concurrent duplicate (in its own transaction) blocks on the claimed row until this
/// transaction ends, then replays the committed result, or runs the body if this one rolled back.
/// The body reaches the transaction through [`conn`](Self::conn). After the call,
/// [`commit`](Self::commit) or [`rollback`](Self::rollback); dropping it rolls back.
///
/// An `Err` from the body deletes the claim inside the transaction; a panic or a dropped future
/// leaves it there: roll the transaction back (dropping it does).
///
/// ```no_run
/// use idempotent_runtime::stores::sql::{PostgresStore, PostgresTxStore, sqlx};
/// use idempotent_runtime::{Error, idempotent};
///
/// #[derive(Debug)]
/// enum PayError { Insufficient, Db(sqlx::Error), Idempotency(Error) }
/// impl From<Error> for PayError { fn from(e: Error) -> Self { PayError::Idempotency(e) } }
/// impl From<sqlx::Error> for PayError { fn from(e: sqlx::Error) -> Self { PayError::Db(e) } }
///
/// #[idempotent(key = request_id, store = tx)]
/// async fn deduct_balance(tx: &PostgresTxStore, request_id: &str, user: &str, amount: i64) -> Result<i64, PayError> {
///     let update = sqlx::query("UPDATE users SET balance = balance - $1 WHERE id = $2 AND balance >= $1")
///         .bind(amount)
///         .bind(user);
///     match update.execute(&mut *tx.conn().await).await?.rows_affected() {
///         0 => Err(PayError::Insufficient),
///         _ => Ok(amount),
///     }
/// }
///
/// # async fn pay(store: &PostgresStore) -> Result<i64, PayError> {
/// let tx = store.begin().await?;
/// let result = deduct_balance(&tx, "req-1", "alice", 100).await;
/// match result {
///     Ok(_) => tx.commit().await?,
///     Err(_) => tx.rollback().await?,
/// }
/// result
/// # }
/// ```
#[derive(Debug)]
pub struct PostgresTxStore {
    tx: tokio::sync::Mutex<Transaction<'static, Postgres>>,
    sql: Arc<Statements>,
    max_record_bytes: usize,
}

impl PostgresTxStore {
    /// The transaction's connection, for the body's own queries: `.execute(&mut *tx.conn().await)`.
    ///
    /// Drop it before the call ends (keep it inside one statement, as above): the store needs the
    /// connection to record the result.
    pub async fn conn(&self) -> tokio::sync::MappedMutexGuard<'_, PgConnection> {
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
    pub fn into_transaction(self) -> Transaction<'static, Postgres> {
        self.tx.into_inner()
    }
}

impl Store for PostgresTxStore {
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

async fn claim(conn: &mut PgConnection, sql: &Statements, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
    let mut last_seen = None;
    for _ in 0..CLAIM_ATTEMPTS {
        let claimed = sqlx::query(super::sql(&sql.claim))
            .bind(request.key.as_str())
            .bind(request.token.as_str())
            .bind(request.fingerprint.map(crate::Fingerprint::as_str))
            .bind(super::micros(request.lease))
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
    executor: impl Executor<'c, Database = Postgres>,
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
        .bind(super::micros(retention))
        .execute(executor)
        .await
        .map_err(backend)?;
    if done.rows_affected() == 1 { Ok(()) } else { Err(StoreError::NotOwner) }
}

async fn release<'c>(
    executor: impl Executor<'c, Database = Postgres>,
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
    executor: impl Executor<'c, Database = Postgres>,
    sql: &Statements,
    key: &Key,
    token: &Token,
    lease: Duration,
) -> Result<(), StoreError> {
    let done = sqlx::query(super::sql(&sql.extend))
        .bind(key.as_str())
        .bind(token.as_str())
        .bind(super::micros(lease))
        .execute(executor)
        .await
        .map_err(backend)?;
    if done.rows_affected() == 1 { Ok(()) } else { Err(StoreError::NotOwner) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn postgres_documented_schema_is_the_one_created() {
        let docs = include_str!("postgres.rs")
            .lines()
            .filter_map(|line| line.strip_prefix("//! "))
            .collect::<Vec<_>>()
            .join("\n");
        let created = super::super::script(
            &super::statements(super::super::TableName::parse("idempotency_records").unwrap()).create,
        );
        assert!(docs.contains(&created), "module docs:\n{docs}\ncreated:\n{created}");
    }
}
