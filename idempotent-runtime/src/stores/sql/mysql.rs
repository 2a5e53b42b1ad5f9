//! The MySQL / MariaDB store, and its transactional variant.
//!
//! **Tested on MariaDB 10.11 only** (the only server `.ci/run` starts). The SQL is written to run
//! on MySQL 8 as well, but no test runs it there, and MySQL 8 treats some of it differently:
//!
//! - `VALUES(column)` inside `ON DUPLICATE KEY UPDATE` (the claim) is deprecated since MySQL
//!   8.0.20 (it warns, and a later release may remove it; MySQL's replacement, a row alias
//!   `INSERT ... AS new ... UPDATE x = new.x`, is not MariaDB syntax). MariaDB keeps `VALUES()`.
//! - The claim reads `LAST_INSERT_ID(1)` back from the statement's OK packet to tell a live
//!   duplicate from a fresh insert. Both servers document this use of `LAST_INSERT_ID(expr)`; if
//!   a server reported otherwise, the claim would read the row back and still decide correctly,
//!   at the cost of one more statement.
//! - A purge batch runs its `DELETE` (of a batch picked with `FOR UPDATE SKIP LOCKED` in a
//!   derived table) after `SET TRANSACTION ISOLATION LEVEL READ COMMITTED`, which both servers
//!   apply to the next transaction only. MySQL 8 has `SKIP LOCKED` too; whether it honours it
//!   inside a derived table, as MariaDB does, no test shows.
//!
//! # Schema
//!
//! [`MySqlStore::create_table`](super::SqlStore::create_table) runs this (for the default table
//! name); to create the table by hand, run it yourself:
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
//! every condition sees the old row, under left-to-right and simultaneous assignment alike. The
//! branch that leaves a live row alone also calls `LAST_INSERT_ID(1)`. So the statement's own
//! reply tells the outcome: 2 affected rows is a takeover, 1 with insert id 0 a fresh insert
//! (both won: a first execution is two statements, this and the completion), and anything else a
//! live row, which a `SELECT ... FOR UPDATE` then reads for replay (a replay is two statements).
//! MySQL has no `RETURNING`, so the read cannot be folded into the claim.
//!
//! Completion, release and the lease heartbeat (`extend`) are single `UPDATE`/`DELETE`
//! statements fenced by the token and by `expires_at > UTC_TIMESTAMP(6)`. InnoDB may choose a
//! contended claim as a deadlock victim; the pooled store runs that statement again (up to three
//! times), the transactional store leaves it to the caller, whose whole transaction was rolled
//! back.
//!
//! A purge deletes batches of at most [`with_purge_batch`](super::SqlStore::with_purge_batch)
//! rows through the `expires_at` index at READ COMMITTED, where InnoDB locks only the rows it
//! deletes: at the default REPEATABLE READ it would also lock the gaps of the index range it
//! scans, and a claim whose new `expires_at` falls into such a gap would wait for the batch. A
//! batch is picked with `FOR UPDATE SKIP LOCKED` (which MariaDB has since 10.6: an older server
//! refuses the purge's statement), then deleted row by row through the primary key: an expired row that a transaction holds (a
//! [`MySqlTxStore`] call took its key over and has not committed) is passed over, not waited on,
//! so the purge neither stalls behind a long transaction nor fails at the lock timeout.
//!
//! In [`MySqlTxStore`], the locking read sees the latest committed row even under REPEATABLE READ,
//! so a duplicate that waited for the first transaction replays its committed result.

use sqlx::MySql;
use sqlx::mysql::MySqlConnection;

use super::dialect::TableName;
use super::dialect::{Arg, Backend, ClaimReport, Columns, Fencing, Params, Ran, Running, Statement, Statements};
use super::{SqlStore, SqlTxStore};

/// The MySQL/MariaDB dialect of [`SqlStore`] and [`SqlTxStore`].
#[derive(Debug, Clone, Copy)]
pub struct MySqlDialect;

/// A store in a MySQL or MariaDB (InnoDB) table, shared by every application server using the
/// database.
///
/// [`SqlStore`] with the MySQL dialect: its methods and timeouts are documented there.
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
pub type MySqlStore = SqlStore<MySqlDialect>;

/// A [`MySqlStore`] working inside one transaction: [`SqlTxStore`] with the MySQL dialect.
///
/// The key is claimed and the result recorded in the same transaction as the body's own writes,
/// so they commit together or not at all. A concurrent duplicate blocks on the claimed row until
/// this transaction ends (up to `innodb_lock_wait_timeout`, 50 s by default), then replays the
/// committed result, or runs the body if this one rolled back. See [`SqlTxStore`] for the waits.
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
pub type MySqlTxStore = SqlTxStore<MySqlDialect>;

impl Backend for MySqlDialect {
    type Db = MySql;
    const NAME: &'static str = "mysql";
    const CLAIM: ClaimReport = ClaimReport::Affected;

    fn statements(t: &str, table: &TableName) -> Statements {
        let expired = format!("expires_at <= {NOW}");
        let until = format!("{NOW} + INTERVAL ? MICROSECOND");
        Statements {
            create: vec![
                Columns {
                    key: "VARBINARY(511) NOT NULL",
                    state: "VARCHAR(16) NOT NULL",
                    token: "VARCHAR(64) NOT NULL",
                    text: "VARCHAR(255)",
                    outcome: "LONGTEXT",
                    expires_at: "DATETIME(6) NOT NULL",
                    inside: &[
                        "PRIMARY KEY (idempotency_key)".to_owned(),
                        format!("INDEX {} (expires_at)", table.index()),
                    ],
                    options: " ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
                }
                .create(t),
            ],
            claim: Statement::exec(
                format!(
                    "INSERT INTO {t} (idempotency_key, state, token, fingerprint, outcome, expires_at) \
                     VALUES (?, 'in_progress', ?, ?, NULL, {until}) \
                     ON DUPLICATE KEY UPDATE \
                     state = IF({expired}, VALUES(state), state), \
                     token = IF({expired}, VALUES(token), token), \
                     fingerprint = IF({expired}, VALUES(fingerprint), fingerprint), \
                     outcome = IF({expired}, NULL, IF(LAST_INSERT_ID(1), outcome, outcome)), \
                     expires_at = IF({expired}, VALUES(expires_at), expires_at)"
                ),
                &[Arg::Key, Arg::Token, Arg::Fingerprint, Arg::Duration],
            ),
            read: Some(Statement::row(
                format!(
                    "SELECT state, token, fingerprint, outcome, TIMESTAMPDIFF(MICROSECOND, {NOW}, expires_at) \
                     FROM {t} WHERE idempotency_key = ? FOR UPDATE"
                ),
                &[Arg::Key],
            )),
            // The connection reports matched rows (CLIENT_FOUND_ROWS), so 1 means ours.
            fenced: Fencing {
                table: t,
                key_and_token: "idempotency_key = ? AND token = ?",
                now: NOW,
                outcome: "?",
                retained_until: until.clone(),
                complete_args: &[Arg::Outcome, Arg::Duration, Arg::Key, Arg::Token],
                leased_until: until.clone(),
                extend_args: &[Arg::Duration, Arg::Key, Arg::Token],
                // Takes over only an expired row, `expires_at` assigned last (MySQL assigns left
                // to right); a live row is left alone and sets `LAST_INSERT_ID(1)`, as the claim.
                adopt: Statement::exec(
                    format!(
                        "INSERT INTO {t} (idempotency_key, state, token, fingerprint, outcome, expires_at) \
                         VALUES (?, 'completed', ?, ?, ?, {until}) \
                         ON DUPLICATE KEY UPDATE \
                         state = IF({expired}, VALUES(state), state), \
                         token = IF({expired}, VALUES(token), token), \
                         fingerprint = IF({expired}, VALUES(fingerprint), fingerprint), \
                         outcome = IF({expired}, VALUES(outcome), IF(LAST_INSERT_ID(1), outcome, outcome)), \
                         expires_at = IF({expired}, VALUES(expires_at), expires_at)"
                    ),
                    &[Arg::Key, Arg::Token, Arg::Fingerprint, Arg::Outcome, Arg::Duration],
                ),
            }
            .statements(),
            purge: vec![
                Statement::exec("SET TRANSACTION ISOLATION LEVEL READ COMMITTED".to_owned(), &[]),
                // The batch is picked first (`STRAIGHT_JOIN`), passing over rows another
                // transaction holds, and each of its rows is then deleted by its key.
                Statement::exec(
                    format!(
                        "DELETE t FROM (SELECT idempotency_key FROM {t} WHERE {expired} \
                         ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED) AS batch \
                         STRAIGHT_JOIN {t} AS t FORCE INDEX (PRIMARY) ON t.idempotency_key = batch.idempotency_key \
                         WHERE t.{expired}"
                    ),
                    &[Arg::Limit],
                ),
            ],
            check_before_commit: None,
            batched: None,
            table: table.clone(),
        }
    }

    fn run<'c>(conn: &'c mut MySqlConnection, statement: &'c Statement, params: &'c Params<'c>) -> Running<'c> {
        super::dialect::run::<MySql>(conn, statement, params, |done| {
            Ran::done(done.rows_affected(), done.last_insert_id())
        })
    }

    /// InnoDB's "deadlock found" (SQLSTATE 40001, error 1213).
    fn retryable(error: &sqlx::Error) -> bool {
        error.as_database_error().is_some_and(|e| e.code().as_deref() == Some("40001"))
    }
}

/// The clock of every statement.
const NOW: &str = "UTC_TIMESTAMP(6)";
