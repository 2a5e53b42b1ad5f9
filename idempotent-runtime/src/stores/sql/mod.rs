#![allow(clippy::doc_markdown, reason = "the docs name PostgreSQL, MySQL, MariaDB, SQLite and InnoDB often, as prose")]

//! The SQL stores: PostgreSQL, MySQL/MariaDB and SQLite, through [`sqlx`] (runtime queries only).
//!
//! | Store | Feature | Transactional variant | Tested by `.ci/run` on |
//! |---|---|---|---|
//! | [`PostgresStore`] | `postgres` | [`PostgresTxStore`] | PostgreSQL 15 |
//! | [`MySqlStore`] | `mysql` | [`MySqlTxStore`] | MariaDB 10.11 (MySQL 8: untested, see [`mysql`]) |
//! | [`SqliteStore`] | `sqlite` | [`SqliteTxStore`] | the bundled SQLite |
//!
//! They are one implementation, [`SqlStore`] and [`SqlTxStore`], over a [`Dialect`]: each backend
//! contributes only its SQL text, the order its parameters bind in, how it encodes a duration,
//! how its claim statement reports a win, which of its errors are retried (InnoDB deadlocks) and
//! how it begins a transaction (SQLite: `BEGIN IMMEDIATE`). The names above are aliases, such as
//! `type PostgresStore = SqlStore<PostgresDialect>`.
//!
//! # The table
//!
//! Every store keeps one row per key in one table, `idempotency_records` unless you name another
//! (optionally schema-qualified, such as `billing.idempotency`; letters, digits and `_` only, since
//! the name is written into the SQL). The columns:
//!
//! | Column | Holds |
//! |---|---|
//! | `idempotency_key` | `scope:key`, the primary key (at most 511 bytes) |
//! | `state` | `in_progress` or `completed` |
//! | `token` | the owner token of the call that claimed the key (32 hex digits) |
//! | `fingerprint` | the request fingerprint (64 hex digits), or NULL |
//! | `outcome` | the recorded result as JSON text (NULL while in progress) |
//! | `expires_at` | when the lease (in progress) or the retention (completed) ends, in UTC |
//!
//! `create_table()` creates it and an index on `expires_at` (for purging) if they do not exist. It
//! does not use sqlx migrations, so it cannot clash with your own `_sqlx_migrations`. To create the
//! table by hand or in your own migrations instead, take the SQL from the backend's module docs
//! ([`postgres`], [`mysql`], [`sqlite`]) or from `create_table_sql()`.
//!
//! # Atomicity and clocks
//!
//! Each protocol step is one atomic statement: a claim is an upsert that inserts the key, or takes
//! over an expired row, or leaves a live row alone (on PostgreSQL the same statement also returns
//! the live row for replay; on MySQL and SQLite one `SELECT` follows, only then). Completion,
//! release and the lease heartbeat (`extend`) are `UPDATE`/`DELETE ... WHERE token = ? AND
//! state = 'in_progress' AND expires_at > <now>`, so a caller whose lease ended (taken over or
//! not) changes nothing and gets [`StoreError::NotOwner`]. A
//! completed row keeps its token: a completion repeated by the same caller (an earlier attempt
//! whose reply was lost) matches it, leaves it unchanged and returns `Ok(())`. Unique violations
//! are never raised and caught: a PostgreSQL transaction is never aborted by a duplicate key.
//!
//! Every expiry decision uses the **database's** clock, never the application's, so any number
//! of application servers agree on which leases have ended.
//!
//! # Transactional mode
//!
//! The `*TxStore` types claim the key and record the result **inside your transaction**, so your
//! business write and the idempotency record commit together or not at all. A concurrent duplicate
//! blocks on the row lock until the first transaction ends, then replays its committed result, or,
//! if it rolled back, runs the body itself. The body runs its own queries on the same transaction
//! through `conn()`. See [`PostgresTxStore`] for an example, and [`SqlTxStore`] for how long a
//! duplicate waits on the claimed row and what it gets when the server's lock timeout ends the
//! wait. Use the default isolation level (READ COMMITTED on PostgreSQL, REPEATABLE READ on
//! InnoDB).
//!
//! # Timeouts
//!
//! The statements of every call of the pooled stores are bounded by [`SqlStore::with_timeout`]
//! (default [`DEFAULT_TIMEOUT`], 5 s): on a stalled network the call fails with a [`TimedOut`]
//! error and drops the connection it was using, so the pool opens fresh ones. The wait for a
//! pooled connection is bounded by the pool's `acquire_timeout` ([`SqlStore`], "Timeouts").
//!
//! # Purging
//!
//! Expired rows stay until deleted: call [`Store::purge_expired`]
//! from a job of your own, or let `spawn_purge(interval)` run it in the background ([`PurgeTask`]).
//! A purge deletes in batches of [`SqlStore::with_purge_batch`] rows (default
//! [`DEFAULT_PURGE_BATCH`]), one short statement each, so claims keep flowing while it runs.

use std::time::Duration;

use crate::{Store, StoreError};

mod admin;
mod dialect;
#[cfg(test)]
use dialect::TableName;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;
mod steps;
mod store;
mod tx;

#[cfg(feature = "mysql")]
pub use mysql::{MySqlDialect, MySqlStore, MySqlTxStore};
#[cfg(feature = "postgres")]
pub use postgres::{PostgresDialect, PostgresStore, PostgresTxStore};
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteDialect, SqliteStore, SqliteTxStore};
pub use store::{DEFAULT_PURGE_BATCH, DEFAULT_TIMEOUT, SqlStore};
pub use tx::SqlTxStore;

/// A SQL backend of [`SqlStore`] and [`SqlTxStore`]: [`PostgresDialect`], [`MySqlDialect`] or
/// [`SqliteDialect`]. Sealed: what a dialect contributes is internal to this crate.
pub trait Dialect: dialect::Backend {}

impl<T: dialect::Backend> Dialect for T {}

pub use super::TimedOut;

/// The `sqlx` these stores are built on, so your pools and transactions are of the same version.
pub use sqlx;

/// The table the stores use unless told otherwise.
pub const DEFAULT_TABLE: &str = "idempotency_records";

/// The longest part (schema or table) of a table name, in bytes. It leaves room for the index
/// name, `<table>_expires_at`, within PostgreSQL's 63-byte limit.
const MAX_IDENTIFIER_BYTES: usize = 48;

/// A table name was refused: it is written into the SQL, so only plain identifiers are accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid table name {0:?}: use `table` or `schema.table`, each part starting with a letter or `_` \
     and holding only ASCII letters, digits and `_`, at most 48 bytes"
)]
pub struct TableNameError(pub String);

/// `true` when `error` is a unique-constraint (or primary-key) violation, on any of the backends.
///
/// It serves the other way to make a write idempotent: give it a natural unique key (an order
/// number) and treat a duplicate as "already done". On PostgreSQL a failed statement aborts the
/// surrounding transaction, so inside one, prefer `INSERT ... ON CONFLICT DO NOTHING` and check
/// the rows affected.
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```ignore")]
/// use idempotent_runtime::stores::sql::{is_unique_violation, sqlx};
///
/// /// Places the order once: `false` when this order number was placed before.
/// async fn place_order(pool: &sqlx::SqlitePool, order_no: &str) -> Result<bool, sqlx::Error> {
///     let insert = sqlx::query("INSERT INTO orders (order_no) VALUES (?)").bind(order_no);
///     match insert.execute(pool).await {
///         Ok(_) => Ok(true),
///         Err(e) if is_unique_violation(&e) => Ok(false),
///         Err(e) => Err(e),
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), sqlx::Error> {
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// sqlx::query("CREATE TABLE orders (order_no TEXT PRIMARY KEY)").execute(&pool).await?;
/// assert!(place_order(&pool, "A-1001").await?);
/// assert!(!place_order(&pool, "A-1001").await?); // a retry: already placed
/// # Ok(())
/// # }
/// ```
#[must_use]
pub fn is_unique_violation(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if e.is_unique_violation())
}

/// A background task that purges a store's expired rows at a fixed interval.
///
/// Made by the stores' `spawn_purge`. [`shutdown`](PurgeTask::shutdown) stops it after the purge
/// in progress, if any; dropping the handle aborts it at once.
#[derive(Debug)]
#[must_use = "dropping a PurgeTask stops it"]
pub struct PurgeTask {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl PurgeTask {
    /// Stops the task and waits until it has stopped (a purge under way is finished first).
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for PurgeTask {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// Runs `store.purge_expired()` now and then every `every` until stopped. Must run inside Tokio.
pub(crate) fn spawn_purge<S: Store + 'static>(store: S, every: Duration, backend: &'static str) -> PurgeTask {
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every.max(Duration::from_millis(1)));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = &mut stopped => break,
                _ = ticks.tick() => match store.purge_expired().await {
                    Ok(0) => {}
                    Ok(purged) => tracing::debug!(target: "idempotent", backend, purged, "purged expired records"),
                    Err(e) => tracing::warn!(
                        target: "idempotent", backend, error = %e,
                        "purging expired idempotency records failed; trying again at the next interval"
                    ),
                },
            }
        }
    });
    PurgeTask { stop: Some(stop), task: Some(task) }
}

/// How often a claim is retried when the row it lost to vanishes or expires before it is read.
pub(crate) const CLAIM_ATTEMPTS: usize = 4;

/// The longest duration written into SQL (100 years): longer ones are capped, which changes
/// nothing in practice and keeps the timestamp arithmetic inside every backend's range.
const MAX_DURATION: Duration = Duration::from_hours(100 * 365 * 24);

/// A lease or retention in whole microseconds, as bound into the SQL.
pub(crate) fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.min(MAX_DURATION).as_micros()).unwrap_or(i64::MAX)
}

/// The statements joined into one script.
pub(crate) fn script(statements: &[dialect::Statement]) -> String {
    statements.iter().map(|s| format!("{};", s.sql)).collect::<Vec<_>>().join("\n")
}

/// The outcome as the text the `outcome` column keeps.
pub(crate) fn outcome_text(outcome: &[u8]) -> Result<&str, StoreError> {
    std::str::from_utf8(outcome).map_err(|e| {
        StoreError::Corrupt(format!(
            "the outcome to record is not UTF-8 text ({e}); SQL stores keep outcomes as JSON text"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_table_names_are_plain_identifiers() {
        let plain = TableName::parse("idempotency_records").unwrap();
        assert_eq!((plain.schema, plain.name.as_str()), (None, "idempotency_records"));
        let qualified = TableName::parse("billing._Idem2").unwrap();
        assert_eq!((qualified.schema.as_deref(), qualified.name.as_str()), (Some("billing"), "_Idem2"));
        for bad in ["", ".", "a.", ".a", "a.b.c", "1abc", "a-b", "a b", "a;drop table x", "a\"b", "é", &"a".repeat(49)]
        {
            assert!(TableName::parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(TableName::parse(&"a".repeat(48)).is_ok());
    }

    /// Each backend's module docs show the schema `create_table` makes.
    #[test]
    fn sql_documented_schemas_are_the_ones_created() {
        fn check<D: dialect::Backend>(source: &str) {
            let docs = source.lines().filter_map(|line| line.strip_prefix("//! ")).collect::<Vec<_>>().join("\n");
            let table = TableName::parse("idempotency_records").unwrap();
            let created = script(&D::statements(&table.full, &table).create);
            assert!(docs.contains(&created), "{} module docs:\n{docs}\ncreated:\n{created}", D::NAME);
        }
        #[cfg(feature = "postgres")]
        check::<PostgresDialect>(include_str!("postgres.rs"));
        #[cfg(feature = "mysql")]
        check::<MySqlDialect>(include_str!("mysql.rs"));
        #[cfg(feature = "sqlite")]
        check::<SqliteDialect>(include_str!("sqlite.rs"));
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn sql_sqlite_modifiers_are_seconds_with_micros() {
        use dialect::Backend;
        let modifier = SqliteDialect::duration(Duration::from_millis(60_250));
        assert_eq!(modifier, dialect::Value::Text("+60.251000 seconds".into()), "one millisecond more");
    }

    #[test]
    fn sql_durations_are_capped_micros() {
        assert_eq!(micros(Duration::from_millis(1500)), 1_500_000);
        assert_eq!(micros(Duration::MAX), micros(MAX_DURATION));
    }
}
