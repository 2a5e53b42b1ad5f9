//! The SQLite store: the embedded default for one machine, in a file that survives restarts.
//!
//! [`SqliteStore::open`](super::SqlStore::open) makes one in a line: it creates the file and the
//! table, and turns on WAL and a busy timeout so concurrent writers wait for each other instead
//! of failing with `SQLITE_BUSY`. Several processes on one machine may share the file.
//!
//! # Schema
//!
//! [`SqliteStore::create_table`](super::SqlStore::create_table) runs this (for the default table
//! name); to create the table by hand, run it yourself:
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
//! expired> RETURNING`; only when it returns nothing (a live row) does a `SELECT` read that row
//! (SQLite has no `INSERT` inside `WITH`). Completion, release and the lease heartbeat
//! (`extend`) are single statements fenced by the token and by `expires_at > <now>`; a purge
//! deletes batches of at most [`with_purge_batch`](super::SqlStore::with_purge_batch) rows, each
//! its own short write transaction, so claims get the write lock between batches.
//! [`SqliteStore::begin`](super::SqlStore::begin) starts its transactions with `BEGIN IMMEDIATE`,
//! so a transaction takes the write lock (waiting its turn) before it reads anything.

use std::path::Path;
use std::time::Duration;

use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqliteSynchronous};

use super::dialect::TableName;
use super::dialect::{Arg, Backend, ClaimReport, Columns, Fencing, Params, Ran, Running, Statement, Statements, Value};
use super::{SqlStore, SqlTxStore};

/// The SQLite dialect of [`SqlStore`] and [`SqlTxStore`].
#[derive(Debug, Clone, Copy)]
pub struct SqliteDialect;

/// A store in an SQLite table, for one machine.
///
/// [`SqlStore`] with the SQLite dialect: its methods and timeouts are documented there, and
/// [`open`](SqlStore::open) makes one in a line.
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
pub type SqliteStore = SqlStore<SqliteDialect>;

/// A [`SqliteStore`] working inside one transaction: [`SqlTxStore`] with the SQLite dialect.
///
/// SQLite has one writer at a time, so transactions from [`SqliteStore::begin`](SqlStore::begin)
/// run one after another; a duplicate's transaction starts after the first one ended (its
/// `BEGIN IMMEDIATE` waits up to the busy timeout) and replays its committed result, or runs the
/// body if it rolled back. See [`SqlTxStore`] for the rest.
pub type SqliteTxStore = SqlTxStore<SqliteDialect>;

/// How long a writer waits for another's lock before failing with `SQLITE_BUSY`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

impl SqlStore<SqliteDialect> {
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
}

impl Backend for SqliteDialect {
    type Db = Sqlite;
    const NAME: &'static str = "sqlite";
    const CLAIM: ClaimReport = ClaimReport::Row;
    const BEGIN: Option<&'static str> = Some("BEGIN IMMEDIATE");

    fn statements(t: &str, table: &TableName) -> Statements {
        // SQLite puts the schema on the index's name, and wants the table unqualified.
        let index = match &table.schema {
            Some(schema) => format!("{schema}.{}", table.index()),
            None => table.index(),
        };
        let until = |n: u8| format!("strftime('%Y-%m-%d %H:%M:%f', 'now', ?{n})");
        Statements {
            create: vec![
                Columns {
                    key: "TEXT PRIMARY KEY NOT NULL",
                    state: "TEXT NOT NULL",
                    token: "TEXT NOT NULL",
                    text: "TEXT",
                    outcome: "TEXT",
                    expires_at: "TEXT NOT NULL",
                    inside: &[],
                    options: "",
                }
                .create(t),
                Statement::exec(format!("CREATE INDEX IF NOT EXISTS {index} ON {} (expires_at)", table.name), &[]),
            ],
            claim: Statement::row(
                format!(
                    "INSERT INTO {t} AS r (idempotency_key, state, token, fingerprint, outcome, expires_at) \
                     VALUES (?1, 'in_progress', ?2, ?3, NULL, {until4}) \
                     ON CONFLICT (idempotency_key) DO UPDATE SET state = 'in_progress', token = excluded.token, \
                     fingerprint = excluded.fingerprint, outcome = NULL, expires_at = excluded.expires_at \
                     WHERE r.expires_at <= {NOW} \
                     RETURNING state, token, fingerprint, outcome, 0",
                    until4 = until(4)
                ),
                &[Arg::Key, Arg::Token, Arg::Fingerprint, Arg::Duration],
            ),
            read: Some(Statement::row(
                format!(
                    "SELECT state, token, fingerprint, outcome, \
                     CAST((julianday(expires_at) - julianday('now')) * 86400000000.0 AS INTEGER) \
                     FROM {t} WHERE idempotency_key = ?1"
                ),
                &[Arg::Key],
            )),
            fenced: Fencing::numbered(t, NOW, '?', until),
            purge: vec![Statement::exec(
                format!("DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} WHERE expires_at <= {NOW} LIMIT ?1)"),
                &[Arg::Limit],
            )],
            check_before_commit: None,
            batched: None,
            table: table.clone(),
        }
    }

    /// A lease or retention as an SQLite date modifier, one millisecond longer: `+60.001000
    /// seconds` for 60 s. SQLite's `now` is kept to the millisecond (the current time, cut
    /// down), so `now + lease` could end a claim up to a millisecond before its request plus its
    /// lease, where the caller counts the lease from; the extra millisecond keeps it after.
    fn duration(duration: Duration) -> Value {
        let micros = super::micros(duration).saturating_add(1_000);
        Value::Text(format!("+{}.{:06} seconds", micros / 1_000_000, micros % 1_000_000))
    }

    fn run<'c>(conn: &'c mut SqliteConnection, statement: &'c Statement, params: &'c Params<'c>) -> Running<'c> {
        super::dialect::run::<Sqlite>(conn, statement, params, |done| Ran::done(done.rows_affected(), 0))
    }
}

/// The clock of every statement.
const NOW: &str = "strftime('%Y-%m-%d %H:%M:%f', 'now')";
