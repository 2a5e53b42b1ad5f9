//! What a SQL backend contributes to the one SQL store: its statements, their bind order, how it
//! encodes durations, how it reports a won claim, which of its errors are worth one more try, and
//! how it begins a transaction. Everything else lives once, in `steps.rs`, `store.rs` and `tx.rs`.

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Row, Type};

use super::{MAX_IDENTIFIER_BYTES, TableNameError};
use crate::{Claim, Fingerprint, Record, StoreError, Token};

/// A boxed statement future: the dialects run on concrete connection types, and the steps that
/// call them stay generic without naming sqlx's executor bounds.
pub type Running<'c> = Pin<Box<dyn Future<Output = Result<Ran, sqlx::Error>> + Send + 'c>>;

/// What a backend contributes (see the module docs). Sealed: implemented by the three dialects.
pub trait Backend: Debug + Send + Sync + Sized + 'static {
    /// The sqlx database.
    type Db: Database;
    /// The name in errors and logs: `postgres`, `mysql`, `sqlite`.
    const NAME: &'static str;
    /// How a claim statement reports that it won.
    const CLAIM: ClaimReport;
    /// The statement [`begin`](super::SqlStore::begin) opens a transaction with (`None`, the
    /// default: the backend's own `BEGIN`).
    const BEGIN: Option<&'static str> = None;

    /// The store's statements, for `table`; `t` is its full name, as the SQL writes it.
    fn statements(t: &str, table: &TableName) -> Statements;

    /// A lease or retention as the statements bind it (default: whole microseconds).
    fn duration(duration: Duration) -> Value {
        Value::Micros(super::micros(duration))
    }

    /// Runs `statement` with `params` bound in the statement's order.
    fn run<'c>(
        conn: &'c mut <Self::Db as Database>::Connection,
        statement: &'c Statement,
        params: &'c Params<'c>,
    ) -> Running<'c>;

    /// Runs one of the dialect's [`Batched`] statements with `arrays`. Only dialects that have
    /// them are asked; the default says it has none.
    fn run_batch<'c>(
        conn: &'c mut <Self::Db as Database>::Connection,
        statement: &'c Statement,
        arrays: &'c Arrays<'c>,
    ) -> RunningBatch<'c> {
        let _ = (conn, statement, arrays);
        Box::pin(async { Err(sqlx::Error::InvalidArgument(format!("{} has no batched statements", Self::NAME))) })
    }

    /// Runs the dialect's [`Batched::both`] with the claims' `claims` and the completions'
    /// `completions`. Only dialects that have it are asked; the default says it has none.
    fn run_both<'c>(
        conn: &'c mut <Self::Db as Database>::Connection,
        statement: &'c Statement,
        claims: &'c Arrays<'c>,
        completions: &'c Arrays<'c>,
    ) -> RunningBatch<'c> {
        let _ = (conn, statement, claims, completions);
        Box::pin(async { Err(sqlx::Error::InvalidArgument(format!("{} has no batched statements", Self::NAME))) })
    }

    /// `true` for an error after which the same autocommit statement may simply run again
    /// (InnoDB's deadlock victim).
    fn retryable(error: &sqlx::Error) -> bool {
        let _ = error;
        false
    }

    /// `true` for an error after which the same statement cannot succeed: the server refused the
    /// statement or its values (SQLSTATE classes 22 data, 23 integrity, 25 transaction state,
    /// 42 syntax or missing objects, 0A unsupported, 45 and P0 raised by a trigger or
    /// procedure), or the row could not be decoded. I/O, pool, TLS errors and the other
    /// database errors (connection, resources, operator intervention, lock timeouts) may pass.
    fn refused(error: &sqlx::Error) -> bool {
        match error {
            sqlx::Error::Database(e) => {
                e.kind() != sqlx::error::ErrorKind::Other
                    || e.code().is_some_and(|code| {
                        ["22", "23", "25", "42", "0A", "45", "P0"].iter().any(|class| code.starts_with(class))
                    })
            }
            sqlx::Error::ColumnDecode { .. }
            | sqlx::Error::ColumnNotFound(_)
            | sqlx::Error::ColumnIndexOutOfBounds { .. }
            | sqlx::Error::Decode(_)
            | sqlx::Error::Encode(_)
            | sqlx::Error::TypeNotFound { .. }
            | sqlx::Error::InvalidArgument(_)
            | sqlx::Error::Configuration(_) => true,
            _ => false,
        }
    }

    /// `true` for an error that says the connection itself is gone: an I/O error on its socket,
    /// a connection exception (SQLSTATE class 08), or the server shutting the session down
    /// (57P01 to 57P03: terminated by an administrator, a crash, a restart). The statement may
    /// or may not have run; the pooled store sends the step again on a fresh connection (see
    /// `SqlStore::resending`), which its token makes safe.
    fn connection_lost(error: &sqlx::Error) -> bool {
        match error {
            sqlx::Error::Io(_) => true,
            sqlx::Error::Database(e) => {
                e.code().is_some_and(|code| code.starts_with("08") || ["57P01", "57P02", "57P03"].contains(&&*code))
            }
            _ => false,
        }
    }
}

/// How a backend's claim statement tells the caller that it won the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimReport {
    /// It returns the row it wrote (with the caller's token), or on PostgreSQL also the live row
    /// that stopped it. No row: read the live row with [`Statements::read`], or, without one
    /// (PostgreSQL), run the claim again: the live row is not in the statement's snapshot yet.
    Row,
    /// It reports through the affected rows and the insert id (MySQL/MariaDB): see
    /// [`Ran::won`]; otherwise read the live row.
    Affected,
}

/// One statement and the order its parameters bind in.
#[derive(Debug)]
pub struct Statement {
    pub sql: Arc<str>,
    pub args: &'static [Arg],
    /// Whether it returns the row columns (`state, token, fingerprint, outcome, remaining µs`).
    pub returns_row: bool,
}

impl Statement {
    /// A statement that returns no row.
    pub fn exec(sql: String, args: &'static [Arg]) -> Self {
        Statement { sql: sql.into(), args, returns_row: false }
    }

    /// A statement that returns at most one row of the row columns.
    pub fn row(sql: String, args: &'static [Arg]) -> Self {
        Statement { sql: sql.into(), args, returns_row: true }
    }
}

/// A statement parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arg {
    Key,
    Token,
    Fingerprint,
    /// The lease or retention, as [`Backend::duration`] encodes it.
    Duration,
    Outcome,
    /// How many rows one purge batch deletes.
    Limit,
}

/// A duration as bound: microseconds, or SQLite's date modifier text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Micros(i64),
    Text(String),
}

/// The values a statement may bind.
#[derive(Debug, Default)]
pub struct Params<'a> {
    pub key: &'a str,
    pub token: &'a str,
    pub fingerprint: Option<&'a str>,
    pub duration: Option<Value>,
    pub outcome: &'a str,
    pub limit: i64,
}

/// What a statement did.
#[derive(Debug, Default)]
pub struct Ran {
    pub affected: u64,
    pub insert_id: u64,
    /// The row it returned (for statements that return one), or why it could not be read.
    pub row: Option<Result<Found, String>>,
}

impl Ran {
    /// What a statement that returns no row did: its affected rows and insert id.
    pub fn done(affected: u64, insert_id: u64) -> Self {
        Ran { affected, insert_id, row: None }
    }

    /// MySQL/MariaDB: the upsert won when it took over an expired row (2 affected rows) or
    /// inserted one (1 row, and no `LAST_INSERT_ID(1)` from the branch that leaves a live row
    /// alone). Anything else is read back; that read also recognises a won claim, so this
    /// shortcut never decides alone.
    pub fn won(&self) -> bool {
        self.affected == 2 || (self.affected == 1 && self.insert_id == 0)
    }
}

/// The statements of one store, built once from its table name.
#[derive(Debug)]
pub struct Statements {
    pub table: TableName,
    pub create: Vec<Statement>,
    pub claim: Statement,
    /// Reads the live row after a claim that did not return it (`None`: the claim always does).
    pub read: Option<Statement>,
    pub fenced: Fenced,
    /// Run in order on one connection; the last one deletes a batch and its affected rows count.
    pub purge: Vec<Statement>,
    /// Run before a transactional store commits (PostgreSQL: a statement that fails in an aborted
    /// transaction, whose `COMMIT` would otherwise report a rollback as success).
    pub check_before_commit: Option<Statement>,
    /// The claim and the completion of several keys in one statement each, where the dialect has
    /// them (PostgreSQL); `None`: a batch is one statement per key.
    pub batched: Option<Batched>,
}

/// A dialect's statements over arrays ([`Backend::run_batch`]): one row per request they
/// answer, led by the request's key.
#[derive(Debug)]
pub struct Batched {
    /// Claims. A row for each key claimed or found live, with the columns of [`Found`] after the
    /// key.
    pub claim: Statement,
    /// Completions, in autocommit mode only (they adopt a key that is gone or expired). A row for
    /// each key recorded (or recorded before by its token).
    pub complete: Statement,
    /// Claims and completions of distinct keys in one statement, in autocommit mode only: the
    /// rows of both, a claim's row marked by a second column `TRUE` before the columns of
    /// [`Found`], a completion's by `FALSE`.
    pub both: Option<Statement>,
}

/// The arrays a batched statement binds: the requests' columns, one element per request, their
/// keys distinct (the outcomes for completions only: empty for claims).
#[derive(Debug, Default)]
pub struct Arrays<'a> {
    pub keys: Vec<&'a str>,
    pub tokens: Vec<&'a str>,
    pub fingerprints: Vec<Option<&'a str>>,
    pub micros: Vec<i64>,
    pub outcomes: Vec<&'a str>,
}

/// The rows of a batched statement: each request's key and, for a claim, its row (`None`: a
/// completion's).
pub type BatchRows = Vec<(String, Option<Result<Found, String>>)>;

/// A batched statement under way.
pub type RunningBatch<'c> = Pin<Box<dyn Future<Output = Result<BatchRows, sqlx::Error>> + Send + 'c>>;

/// The column types of the table, in the dialect's words.
pub struct Columns<'a> {
    pub key: &'a str,
    pub state: &'a str,
    pub token: &'a str,
    pub text: &'a str,
    pub outcome: &'a str,
    pub expires_at: &'a str,
    /// Lines after the columns (keys and indexes declared inside the table), each ending in `,`.
    pub inside: &'a [String],
    /// What follows the closing parenthesis.
    pub options: &'a str,
}

impl Columns<'_> {
    /// `CREATE TABLE IF NOT EXISTS` for `table`, laid out as the module docs show it.
    pub fn create(&self, table: &str) -> Statement {
        let Columns { key, state, token, text, outcome, expires_at, .. } = self;
        let columns = [
            format!("idempotency_key {key}"),
            format!("state {state}"),
            format!("token {token}"),
            format!("fingerprint {text}"),
            format!("outcome {outcome}"),
            format!("expires_at {expires_at}"),
        ];
        let lines = columns.iter().chain(self.inside).map(String::as_str).collect::<Vec<_>>().join(",\n    ");
        Statement::exec(format!("CREATE TABLE IF NOT EXISTS {table} (\n    {lines}\n){}", self.options), &[])
    }
}

/// The steps fenced by the token (and, for renewal and release, the lease), written alike for
/// every dialect but the completion's upsert.
#[derive(Debug)]
pub struct Fenced {
    /// Completes the row this token holds, its lease live or lapsed (a row this token completed
    /// already is written back unchanged). Also inside a transaction, where the transaction's row
    /// lock keeps every other caller out for as long as it lasts.
    pub complete: Statement,
    /// Writes the completed record over a row that is gone or expired (a late completion that
    /// nobody contested); leaves a live row alone. Binds key, token, fingerprint, outcome and
    /// the retention; reports through [`Ran::won`].
    pub adopt: Statement,
    pub extend: Statement,
    pub release: Statement,
    /// Release inside a transaction of the caller's: fenced by the token only (see `SqlTxStore`,
    /// "Leases").
    pub release_in_tx: Statement,
}

/// What the fenced steps differ in from one dialect to the next.
pub struct Fencing<'a> {
    pub table: &'a str,
    /// `idempotency_key = <placeholder> AND token = <placeholder>`.
    pub key_and_token: &'a str,
    /// The clock: the current time, as the statement sees it.
    pub now: &'a str,
    /// The completion's outcome placeholder, and its new `expires_at` (now + the retention).
    pub outcome: &'a str,
    pub retained_until: String,
    pub complete_args: &'static [Arg],
    /// The heartbeat's new `expires_at` (now + the lease).
    pub leased_until: String,
    pub extend_args: &'static [Arg],
    /// The completion's upsert over a gone or expired row (see [`Fenced::adopt`]).
    pub adopt: Statement,
}

impl Fencing<'_> {
    /// For the dialects with numbered placeholders (`$1`, `?1`): key 1, token 2, then the
    /// outcome 3 and the retention 4 of a completion, or the lease 3 of a heartbeat.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub fn numbered(table: &str, now: &str, placeholder: char, until: impl Fn(u8) -> String) -> Fenced {
        // Key 1, token 2, fingerprint 3, outcome 4, retention 5; the row is taken over only
        // when it has expired.
        let adopt = Statement::exec(
            format!(
                "INSERT INTO {table} AS r (idempotency_key, state, token, fingerprint, outcome, expires_at) \
                 VALUES ({placeholder}1, 'completed', {placeholder}2, {placeholder}3, {placeholder}4, {until5}) \
                 ON CONFLICT (idempotency_key) DO UPDATE SET state = 'completed', token = excluded.token, \
                 fingerprint = excluded.fingerprint, outcome = excluded.outcome, expires_at = excluded.expires_at \
                 WHERE r.expires_at <= {now}",
                until5 = until(5)
            ),
            &[Arg::Key, Arg::Token, Arg::Fingerprint, Arg::Outcome, Arg::Duration],
        );
        Fencing {
            adopt,
            table,
            key_and_token: &format!("idempotency_key = {placeholder}1 AND token = {placeholder}2"),
            now,
            outcome: &format!("{placeholder}3"),
            retained_until: until(4),
            complete_args: &[Arg::Key, Arg::Token, Arg::Outcome, Arg::Duration],
            leased_until: until(3),
            extend_args: &[Arg::Key, Arg::Token, Arg::Duration],
        }
        .statements()
    }

    pub fn statements(self) -> Fenced {
        let Fencing { table: t, key_and_token, now, outcome, retained_until, leased_until, adopt, .. } = self;
        let owned = format!("{key_and_token} AND state = 'in_progress'");
        let live = format!("{owned} AND expires_at > {now}");
        // A row this token already completed matches too, and is written back unchanged (a
        // completion repeated after a lost reply). `state` is assigned last: MySQL assigns left to
        // right, each assignment seeing the ones before.
        let complete = Statement::exec(
            format!(
                "UPDATE {t} SET outcome = CASE WHEN state = 'in_progress' THEN {outcome} ELSE outcome END, \
                 expires_at = CASE WHEN state = 'in_progress' THEN {retained_until} ELSE expires_at END, \
                 state = 'completed' WHERE {key_and_token}"
            ),
            self.complete_args,
        );
        let release =
            |condition: &str| Statement::exec(format!("DELETE FROM {t} WHERE {condition}"), &[Arg::Key, Arg::Token]);
        Fenced {
            complete,
            adopt,
            extend: Statement::exec(
                format!("UPDATE {t} SET expires_at = {leased_until} WHERE {live}"),
                self.extend_args,
            ),
            release: release(&live),
            release_in_tx: release(&owned),
        }
    }
}

/// Runs a statement on any sqlx backend; each dialect's [`Backend::run`] calls it with its own
/// types (so the bounds are checked there, once) and the way it reads affected rows.
pub fn run<'c, DB>(
    conn: &'c mut DB::Connection,
    statement: &'c Statement,
    params: &'c Params<'c>,
    ran: fn(&DB::QueryResult) -> Ran,
) -> Running<'c>
where
    DB: Database,
    DB::Arguments: IntoArguments<DB>,
    for<'e> &'e mut DB::Connection: Executor<'e, Database = DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB>,
    for<'q> i64: Encode<'q, DB>,
    for<'q> String: Encode<'q, DB>,
    i64: Type<DB> + for<'r> Decode<'r, DB>,
    String: Type<DB> + for<'r> Decode<'r, DB>,
    usize: ColumnIndex<DB::Row>,
{
    Box::pin(async move {
        let mut query = sqlx::query::<DB>(sqlx::AssertSqlSafe(Arc::clone(&statement.sql)));
        for arg in statement.args {
            query = match (arg, &params.duration) {
                (Arg::Key, _) => query.bind(params.key),
                (Arg::Token, _) => query.bind(params.token),
                (Arg::Fingerprint, _) => query.bind(params.fingerprint),
                (Arg::Outcome, _) => query.bind(params.outcome),
                (Arg::Limit, _) => query.bind(params.limit),
                (Arg::Duration, Some(Value::Micros(micros))) => query.bind(*micros),
                (Arg::Duration, Some(Value::Text(text))) => query.bind(text.clone()),
                (Arg::Duration, None) => unreachable!("every statement with a duration is given one"),
            };
        }
        if !statement.returns_row {
            return Ok(ran(&query.execute(&mut *conn).await?));
        }
        let row = query.fetch_optional(&mut *conn).await?;
        let row = row.map(|row| found(&row, 0));
        Ok(Ran { row, ..Ran::default() })
    })
}

/// The columns of a [`Found`] in `row`, from column `first` on (state, token, fingerprint,
/// outcome, remaining microseconds).
pub fn found<R: Row>(row: &R, first: usize) -> Result<Found, String>
where
    i64: Type<R::Database> + for<'r> Decode<'r, R::Database>,
    String: Type<R::Database> + for<'r> Decode<'r, R::Database>,
    usize: ColumnIndex<R>,
{
    let column = |e: sqlx::Error| format!("{e}; does the table have the documented columns and types?");
    Ok(Found {
        state: row.try_get(first).map_err(column)?,
        token: row.try_get(first + 1).map_err(column)?,
        fingerprint: row.try_get(first + 2).map_err(column)?,
        outcome: row.try_get(first + 3).map_err(column)?,
        remaining_micros: row.try_get(first + 4).map_err(column)?,
    })
}

/// A validated, optionally schema-qualified table name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    /// As given: `table` or `schema.table`.
    pub full: String,
    /// The part before the dot, if any.
    pub schema: Option<String>,
    /// The table itself.
    pub name: String,
}

impl TableName {
    /// The name of the index on `expires_at`.
    pub fn index(&self) -> String {
        format!("{}_expires_at", self.name)
    }
}

impl TableName {
    pub fn parse(full: &str) -> Result<Self, TableNameError> {
        let refuse = || TableNameError(full.to_owned());
        let (schema, name) = match full.split_once('.') {
            Some((schema, name)) => (Some(schema), name),
            None => (None, full),
        };
        for part in schema.into_iter().chain([name]) {
            if !is_identifier(part) {
                return Err(refuse());
            }
        }
        Ok(TableName { full: full.to_owned(), schema: schema.map(str::to_owned), name: name.to_owned() })
    }
}

fn is_identifier(part: &str) -> bool {
    let mut chars = part.chars();
    let Some(first) = chars.next() else {
        return false;
    };
    part.len() <= MAX_IDENTIFIER_BYTES
        && (first.is_ascii_alphabetic() || first == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The state column's values.
pub const IN_PROGRESS: &str = "in_progress";
pub const COMPLETED: &str = "completed";

/// A row read back after a claim lost the upsert.
#[derive(Debug)]
pub struct Found {
    pub state: String,
    pub token: Option<String>,
    pub fingerprint: Option<String>,
    pub outcome: Option<String>,
    /// Microseconds until `expires_at` by the database's clock (negative when past).
    pub remaining_micros: i64,
}

/// What a read-back row means for the claimer.
pub enum Verdict {
    /// The row is this caller's claim (MySQL, which reads back after every insert).
    Mine,
    /// A live row of another call.
    Live(Claim),
    /// The row expired between the upsert and the read: claim again.
    Expired,
}

impl Found {
    pub fn verdict(self, ours: &Token) -> Result<Verdict, StoreError> {
        let fingerprint = self.fingerprint.map(Fingerprint::parse).transpose()?;
        match self.state.as_str() {
            IN_PROGRESS if self.token.as_deref() == Some(ours.as_str()) => Ok(Verdict::Mine),
            _ if self.remaining_micros <= 0 => Ok(Verdict::Expired),
            IN_PROGRESS => Ok(Verdict::Live(Claim::InProgress {
                fingerprint,
                lease_remaining: Some(Duration::from_micros(self.remaining_micros.unsigned_abs())),
            })),
            COMPLETED => match self.outcome {
                Some(outcome) => Ok(Verdict::Live(Claim::Completed(Record::new(fingerprint, outcome.into_bytes())))),
                None => Err(StoreError::Corrupt("a completed record has no outcome (NULL)".into())),
            },
            other => Err(StoreError::Corrupt(format!(
                "unknown state {other:?} (expected {IN_PROGRESS:?} or {COMPLETED:?}); was the row written by something else?"
            ))),
        }
    }
}
