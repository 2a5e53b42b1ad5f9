//! The MySQL / MariaDB store, and its transactional variant.
//!
//! The SQL keeps to what MySQL 8 and MariaDB 10.11 share (no `RETURNING`, no row aliases in
//! `ON DUPLICATE KEY UPDATE`).
//!
//! # Schema
//!
//! [`MySqlStore::create_table`] runs this (for the default table name); to create the table by
//! hand, run it yourself:
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS idempotency_records (
//!     idempotency_key VARBINARY(511) NOT NULL,
//!     state VARCHAR(16) NOT NULL,
//!     token VARCHAR(64) NOT NULL,
//!     fingerprint VARCHAR(255),
//!     outcome LONGTEXT,
//!     expires_at DATETIME(6) NOT NULL,
//!     PRIMARY KEY (idempotency_key),
//!     INDEX idempotency_records_expires_at (expires_at)
//! ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
//! ```
//!
//! The binary collation keeps keys case- and accent-sensitive (`Req-1` and `req-1` are two keys).
//! `expires_at` is UTC (`UTC_TIMESTAMP(6)`), whatever the session time zone.
//!
//! # Statements
//!
//! A claim is one `INSERT ... ON DUPLICATE KEY UPDATE` whose every assignment is
//! `IF(<the row has expired>, <new value>, <old value>)`, with `expires_at` assigned last so that
//! every condition sees the old row, under left-to-right and simultaneous assignment alike. It is
//! followed by a `SELECT ... FOR UPDATE` that tells whether this call's token now owns the row, or
//! reads the live row for replay (skipped when the statement reports a takeover).
//!
//! In [`MySqlTxStore`], the locking read sees the latest committed row even under REPEATABLE READ,
//! so a duplicate that waited for the first transaction replays its committed result.

use std::sync::Arc;
use std::time::Duration;

use sqlx::mysql::{MySqlConnection, MySqlPool};
use sqlx::{Executor, MySql, Row, Transaction};

use super::{CLAIM_ATTEMPTS, DEFAULT_TABLE, Found, PurgeTask, Statements, TableName, TableNameError, Verdict};
use crate::store::DEFAULT_MAX_RECORD_BYTES;
use crate::{Claim, ClaimRequest, Detached, Key, Store, StoreError, Token};

const BACKEND: &str = "mysql";

/// `ON DUPLICATE KEY UPDATE` reports 2 affected rows when it changed an existing row.
const TAKEN_OVER: u64 = 2;

fn statements(table: TableName) -> Statements {
    let t = &table.full;
    let index = format!("{}_expires_at", table.name);
    let create = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (\n    \
             idempotency_key VARBINARY(511) NOT NULL,\n    \
             state VARCHAR(16) NOT NULL,\n    \
             token VARCHAR(64) NOT NULL,\n    \
             fingerprint VARCHAR(255),\n    \
             outcome LONGTEXT,\n    \
             expires_at DATETIME(6) NOT NULL,\n    \
             PRIMARY KEY (idempotency_key),\n    \
             INDEX {index} (expires_at)\n\
             ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
        )
        .into(),
    ];
    let expired = "expires_at <= UTC_TIMESTAMP(6)";
    let claim = format!(
        "INSERT INTO {t} (idempotency_key, state, token, fingerprint, outcome, expires_at) \
         VALUES (?, 'in_progress', ?, ?, NULL, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
         ON DUPLICATE KEY UPDATE \
         state = IF({expired}, VALUES(state), state), \
         token = IF({expired}, VALUES(token), token), \
         fingerprint = IF({expired}, VALUES(fingerprint), fingerprint), \
         outcome = IF({expired}, NULL, outcome), \
         expires_at = IF({expired}, VALUES(expires_at), expires_at)"
    );
    let read = format!(
        "SELECT state, token, fingerprint, outcome, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) \
         FROM {t} WHERE idempotency_key = ? FOR UPDATE"
    );
    let live = "expires_at > UTC_TIMESTAMP(6)";
    // A row this token already completed matches too, and is written back unchanged. MySQL
    // assigns left to right, each assignment seeing the ones before: `state` goes last.
    let complete = format!(
        "UPDATE {t} SET outcome = IF(state = 'in_progress', ?, outcome), \
         expires_at = IF(state = 'in_progress', UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, expires_at), \
         state = 'completed' \
         WHERE idempotency_key = ? AND token = ? AND {live}"
    );
    let release =
        format!("DELETE FROM {t} WHERE idempotency_key = ? AND token = ? AND state = 'in_progress' AND {live}");
    let extend = format!(
        "UPDATE {t} SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
         WHERE idempotency_key = ? AND token = ? AND state = 'in_progress' AND {live}"
    );
    let purge = format!("DELETE FROM {t} WHERE {expired}");
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

/// How often [`MySqlStore`] runs a claim again after InnoDB chose it as a deadlock victim.
const DEADLOCK_RETRIES: u32 = 3;

/// `true` for InnoDB's "deadlock found" (SQLSTATE 40001, error 1213).
fn is_deadlock(error: &StoreError) -> bool {
    let StoreError::Backend { source, .. } = error else { return false };
    source
        .downcast_ref::<sqlx::Error>()
        .and_then(sqlx::Error::as_database_error)
        .is_some_and(|e| e.code().as_deref() == Some("40001"))
}

/// A store in a MySQL or MariaDB (InnoDB) table, shared by every application server using the
/// database.
///
/// Cloning gives another handle on the same pool and table.
///
/// ```no_run
/// use idempotent_runtime::stores::sql::{MySqlStore, sqlx};
///
/// # async fn setup() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::MySqlPool::connect("mysql://app@127.0.0.1:3306/app").await?;
/// let store = MySqlStore::new(pool);
/// store.create_table().await?;
/// let purging = store.spawn_purge(std::time::Duration::from_secs(600));
/// // ... use `store` with #[idempotent(store = ...)] ...
/// purging.shutdown().await;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    sql: Arc<Statements>,
    max_record_bytes: usize,
}

impl MySqlStore {
    /// A store in the table `idempotency_records` (see [`create_table`](Self::create_table)).
    #[must_use]
    pub fn new(pool: MySqlPool) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).unwrap_or_else(|_| unreachable!("the default table name is valid"))
    }

    /// A store in `table` (`name` or `database.name`: letters, digits and `_`).
    pub fn with_table(pool: MySqlPool, table: &str) -> Result<Self, TableNameError> {
        let sql = Arc::new(statements(TableName::parse(table)?));
        Ok(MySqlStore { pool, sql, max_record_bytes: DEFAULT_MAX_RECORD_BYTES })
    }

    /// Records outcomes of at most `limit` encoded bytes (default 1 MiB; keep it under the
    /// server's `max_allowed_packet`); larger results are not recorded and replay as
    /// [`Error::Unrecordable`](crate::Error::Unrecordable).
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
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Begins a transaction on the pool, to claim keys and record results inside it.
    pub async fn begin(&self) -> Result<MySqlTxStore, sqlx::Error> {
        Ok(self.in_transaction(self.pool.begin().await?))
    }

    /// Claims keys and records results inside `tx`, a transaction you began.
    #[must_use]
    pub fn in_transaction(&self, tx: Transaction<'static, MySql>) -> MySqlTxStore {
        MySqlTxStore {
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

impl Store for MySqlStore {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(backend)?;
        let mut attempt = 0;
        loop {
            match claim(&mut conn, &self.sql, request).await {
                // InnoDB may pick a contended upsert as a deadlock victim. Outside a transaction of
                // the caller's, only that statement was rolled back: run the claim again.
                Err(e) if attempt < DEADLOCK_RETRIES && is_deadlock(&e) => attempt += 1,
                result => return result,
            }
        }
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

/// A [`MySqlStore`] working inside one transaction: the key is claimed and the result recorded in
/// the same transaction as the body's own writes, so they commit together or not at all.
///
/// A concurrent duplicate (in its own transaction) blocks on the claimed row until this
/// transaction ends (up to `innodb_lock_wait_timeout`), then replays the committed result, or runs
/// the body if this one rolled back. The body reaches the transaction through
/// [`conn`](Self::conn). After the call, [`commit`](Self::commit) or [`rollback`](Self::rollback);
/// dropping it rolls back.
///
/// An `Err` from the body deletes the claim inside the transaction; a panic or a dropped future
/// leaves it there: roll the transaction back (dropping it does).
///
/// Concurrent claims in transactions can deadlock in InnoDB (its duplicate-key checks take gap
/// locks). The victim's whole transaction is rolled back by the server and the call fails with a
/// retryable [`Error::Store`](crate::Error::Store): run the transaction again, as for any deadlock.
///
/// ```no_run
/// use idempotent_runtime::stores::sql::{MySqlStore, MySqlTxStore, sqlx};
/// use idempotent_runtime::{Error, idempotent};
///
/// #[derive(Debug)]
/// enum PayError { Insufficient, Db(sqlx::Error), Idempotency(Error) }
/// impl From<Error> for PayError { fn from(e: Error) -> Self { PayError::Idempotency(e) } }
/// impl From<sqlx::Error> for PayError { fn from(e: sqlx::Error) -> Self { PayError::Db(e) } }
///
/// #[idempotent(key = request_id, store = tx)]
/// async fn deduct_balance(tx: &MySqlTxStore, request_id: &str, user: &str, amount: i64) -> Result<i64, PayError> {
///     let update = sqlx::query("UPDATE users SET balance = balance - ? WHERE id = ? AND balance >= ?")
///         .bind(amount)
///         .bind(user)
///         .bind(amount);
///     match update.execute(&mut *tx.conn().await).await?.rows_affected() {
///         0 => Err(PayError::Insufficient),
///         _ => Ok(amount),
///     }
/// }
///
/// # async fn pay(store: &MySqlStore) -> Result<i64, PayError> {
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
pub struct MySqlTxStore {
    tx: tokio::sync::Mutex<Transaction<'static, MySql>>,
    sql: Arc<Statements>,
    max_record_bytes: usize,
}

impl MySqlTxStore {
    /// The transaction's connection, for the body's own queries: `.execute(&mut *tx.conn().await)`.
    ///
    /// Drop it before the call ends (keep it inside one statement, as above): the store needs the
    /// connection to record the result.
    pub async fn conn(&self) -> tokio::sync::MappedMutexGuard<'_, MySqlConnection> {
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
    pub fn into_transaction(self) -> Transaction<'static, MySql> {
        self.tx.into_inner()
    }
}

impl Store for MySqlTxStore {
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

async fn claim(conn: &mut MySqlConnection, sql: &Statements, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
    let mut last_seen = None;
    for _ in 0..CLAIM_ATTEMPTS {
        let upsert = sqlx::query(super::sql(&sql.claim))
            .bind(request.key.as_str())
            .bind(request.token.as_str())
            .bind(request.fingerprint.map(crate::Fingerprint::as_str))
            .bind(super::micros(request.lease))
            .execute(&mut *conn)
            .await
            .map_err(backend)?;
        if upsert.rows_affected() == TAKEN_OVER {
            return Ok(Claim::Claimed);
        }
        // Inserted (ours) or left alone (someone else's): the token tells which.
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
    executor: impl Executor<'c, Database = MySql>,
    sql: &Statements,
    key: &Key,
    token: &Token,
    outcome: &[u8],
    retention: Duration,
) -> Result<(), StoreError> {
    let done = sqlx::query(super::sql(&sql.complete))
        .bind(super::outcome_text(outcome)?)
        .bind(super::micros(retention))
        .bind(key.as_str())
        .bind(token.as_str())
        .execute(executor)
        .await
        .map_err(backend)?;
    // The connection reports matched rows (CLIENT_FOUND_ROWS), so 1 means ours.
    if done.rows_affected() == 1 { Ok(()) } else { Err(StoreError::NotOwner) }
}

async fn release<'c>(
    executor: impl Executor<'c, Database = MySql>,
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
    executor: impl Executor<'c, Database = MySql>,
    sql: &Statements,
    key: &Key,
    token: &Token,
    lease: Duration,
) -> Result<(), StoreError> {
    let done = sqlx::query(super::sql(&sql.extend))
        .bind(super::micros(lease))
        .bind(key.as_str())
        .bind(token.as_str())
        .execute(executor)
        .await
        .map_err(backend)?;
    if done.rows_affected() == 1 { Ok(()) } else { Err(StoreError::NotOwner) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn mysql_documented_schema_is_the_one_created() {
        let docs = include_str!("mysql.rs")
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
