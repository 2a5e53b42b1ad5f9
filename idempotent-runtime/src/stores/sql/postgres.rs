//! The PostgreSQL store, and its transactional variant.
//!
//! # Schema
//!
//! [`PostgresStore::create_table`](super::SqlStore::create_table) runs this (for the default
//! table name); to create the table by hand, run it yourself:
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
//! A claim is one statement, whether it wins or finds a live row: a `WITH` that first reads the
//! key's live row (`live`), and only when there is none runs the
//! `INSERT ... ON CONFLICT (idempotency_key) DO UPDATE ... WHERE <the row has expired>
//! RETURNING` that claims it (`claimed`); it returns the claimed row or the live one. A replay is
//! therefore one round trip, and a read-only one: it locks no row, takes no transaction id and
//! waits for no WAL flush. A first execution is two statements (the claim and the completion).
//!
//! Both parts run on one snapshot, taken when the statement starts. A row that another
//! transaction committed after that is not in `live`, and the insert, which does see it, leaves
//! it alone when it is live: the statement then returns no row at all, and the store runs it
//! again, with a fresh snapshot. A live row that changed after the snapshot is returned as it was
//! then (in progress rather than completed, at worst): the caller waits or retries.
//!
//! Times come from `clock_timestamp()`, the server's clock at the moment of the statement (not
//! `now()`, which stands still at the start of a transaction). Completion, release and the lease
//! heartbeat (`extend`) are single `UPDATE`/`DELETE` statements fenced by the token and by
//! `expires_at > clock_timestamp()`. A purge deletes batches of at most
//! [`with_purge_batch`](super::SqlStore::with_purge_batch) rows, picked with
//! `FOR UPDATE SKIP LOCKED` so it never waits on a row a claim is writing.
//!
//! [`Store::claim_many`](crate::Store::claim_many) and
//! [`Store::complete_many`](crate::Store::complete_many) are one statement per batch, over
//! arrays (`unnest`): the claim's `live` and `claimed` parts for every key at once (the inserts in
//! key order, so two batches never deadlock on each other), and the completion's two statements
//! (the fenced update, the adoption of a key nobody holds) as one `INSERT ... ON CONFLICT DO
//! UPDATE`. Each key's row is reached through the primary key only, so a plan made while the
//! table was small stays a lookup per key as it grows. A key asked for twice in one batch, or one
//! the statement could not answer (the snapshot case above, another owner's key), gets its single
//! statement after it. [`Store::claim_and_complete_many`](crate::Store::claim_and_complete_many)
//! is both statements as one (the completions' `INSERT` and the claims' parts as parts of one
//! `WITH`): one commit for a batch of both, when no key is in both halves (else the two
//! statements). [`PostgresTxStore`] claims a batch in one statement too, and records it
//! one completion at a time. On one 2-core machine, windows of 16 and 64 fresh keys claimed and
//! recorded this way went through 2.8 to 2.9 × and 4.7 to 5.3 × as many keys per second as the
//! same keys each claimed and recorded on their own, concurrently, at a fifth to an eighth of
//! PostgreSQL's CPU per key (two runs of `examples/src/bin/batch_load.rs`; BENCHMARKS.md).
//!
//! In [`PostgresTxStore`], run the transaction at READ COMMITTED (the default): at REPEATABLE READ
//! a duplicate that waited for the first transaction fails with a serialization error instead of
//! replaying.

use std::sync::Arc;

use sqlx::postgres::{PgConnection, PgRow};
use sqlx::{Postgres, Row as _};

use super::dialect::TableName;
use super::dialect::{
    Arg, Arrays, Backend, Batched, ClaimReport, Columns, Fencing, Params, Ran, Running, RunningBatch, Statement,
    Statements, found,
};
use super::{SqlStore, SqlTxStore};

/// The PostgreSQL dialect of [`SqlStore`] and [`SqlTxStore`].
#[derive(Debug, Clone, Copy)]
pub struct PostgresDialect;

/// A store in a PostgreSQL table, shared by every application server using the database.
///
/// [`SqlStore`] with the PostgreSQL dialect: its methods and timeouts are documented there.
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
pub type PostgresStore = SqlStore<PostgresDialect>;

/// A [`PostgresStore`] working inside one transaction: [`SqlTxStore`] with the PostgreSQL dialect.
///
/// The key is claimed and the result recorded in the same transaction as the body's own writes,
/// so they commit together or not at all.
///
/// A concurrent duplicate blocks on the claimed row until this transaction ends (PostgreSQL's
/// `lock_timeout` bounds the wait; it is off by default), then replays the committed result, or
/// runs the body if this one rolled back. See [`SqlTxStore`] for the waits and the rest.
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
pub type PostgresTxStore = SqlTxStore<PostgresDialect>;

/// The row columns every row-returning statement ends with (see `dialect::Found`).
const REMAINING: &str = "CAST(EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000000 AS BIGINT)";

impl Backend for PostgresDialect {
    type Db = Postgres;
    const NAME: &'static str = "postgres";
    const CLAIM: ClaimReport = ClaimReport::Row;

    fn statements(t: &str, table: &TableName) -> Statements {
        let until = |n: u8| format!("{NOW} + ${n} * INTERVAL '1 microsecond'");
        Statements {
            create: vec![
                Columns {
                    key: "TEXT PRIMARY KEY",
                    state: "TEXT NOT NULL",
                    token: "TEXT NOT NULL",
                    text: "TEXT",
                    outcome: "TEXT",
                    expires_at: "TIMESTAMPTZ NOT NULL",
                    inside: &[],
                    options: "",
                }
                .create(t),
                Statement::exec(format!("CREATE INDEX IF NOT EXISTS {} ON {t} (expires_at)", table.index()), &[]),
            ],
            claim: Statement::row(
                format!(
                    "WITH live AS (\
                     SELECT state, token, fingerprint, outcome, {REMAINING} AS remaining FROM {t} \
                     WHERE idempotency_key = $1 AND expires_at > {NOW}), \
                     claimed AS (\
                     INSERT INTO {t} AS r (idempotency_key, state, token, fingerprint, outcome, expires_at) \
                     SELECT $1, 'in_progress', $2, $3, NULL, {until4} WHERE NOT EXISTS (SELECT 1 FROM live) \
                     ON CONFLICT (idempotency_key) DO UPDATE SET state = 'in_progress', token = EXCLUDED.token, \
                     fingerprint = EXCLUDED.fingerprint, outcome = NULL, expires_at = EXCLUDED.expires_at \
                     WHERE r.expires_at <= {NOW} \
                     RETURNING r.state, r.token, r.fingerprint, r.outcome) \
                     SELECT state, token, fingerprint, outcome, CAST(0 AS BIGINT) FROM claimed \
                     UNION ALL \
                     SELECT state, token, fingerprint, outcome, remaining FROM live",
                    until4 = until(4)
                ),
                &[Arg::Key, Arg::Token, Arg::Fingerprint, Arg::Duration],
            ),
            read: None,
            fenced: Fencing::numbered(t, NOW, '$', until),
            purge: vec![Statement::exec(
                format!(
                    "DELETE FROM {t} WHERE idempotency_key IN (SELECT idempotency_key FROM {t} \
                     WHERE expires_at <= {NOW} LIMIT $1 FOR UPDATE SKIP LOCKED) AND expires_at <= {NOW}"
                ),
                &[Arg::Limit],
            )],
            // An aborted transaction answers `COMMIT` with `ROLLBACK`, which sqlx reports as
            // success; this statement fails there instead (SQLSTATE 25P02).
            check_before_commit: Some(Statement::exec("SELECT 1".to_owned(), &[])),
            batched: Some(batched(t)),
            table: table.clone(),
        }
    }

    fn run_batch<'c>(conn: &'c mut PgConnection, statement: &'c Statement, arrays: &'c Arrays<'c>) -> RunningBatch<'c> {
        Box::pin(async move {
            let rows = fetch_batch(conn, statement, &[arrays]).await?;
            rows.iter().map(|row| Ok((row.try_get(0)?, statement.returns_row.then(|| found(row, 1))))).collect()
        })
    }

    /// A deadlock victim: its statement was rolled back whole. Batches lock their keys in key
    /// order, but the statement of both locks the completions' keys and the claims' in two
    /// steps, so two such statements over the same keys can deadlock.
    fn retryable(error: &sqlx::Error) -> bool {
        error.as_database_error().is_some_and(|e| e.code().as_deref() == Some("40P01"))
    }

    fn run_both<'c>(
        conn: &'c mut PgConnection,
        statement: &'c Statement,
        claims: &'c Arrays<'c>,
        completions: &'c Arrays<'c>,
    ) -> RunningBatch<'c> {
        Box::pin(async move {
            let rows = fetch_batch(conn, statement, &[claims, completions]).await?;
            let row = |row: &PgRow| {
                let claimed: bool = row.try_get(1)?;
                Ok((row.try_get(0)?, claimed.then(|| found(row, 2))))
            };
            rows.iter().map(row).collect()
        })
    }

    fn run<'c>(conn: &'c mut PgConnection, statement: &'c Statement, params: &'c Params<'c>) -> Running<'c> {
        super::dialect::run::<Postgres>(conn, statement, params, |done| Ran::done(done.rows_affected(), 0))
    }
}

/// Runs a batched statement with the five arrays of each of `arrays` bound in turn.
async fn fetch_batch(
    conn: &mut PgConnection,
    statement: &Statement,
    arrays: &[&Arrays<'_>],
) -> Result<Vec<PgRow>, sqlx::Error> {
    let mut query = sqlx::query::<Postgres>(sqlx::AssertSqlSafe(Arc::clone(&statement.sql)));
    for arrays in arrays {
        query = query
            .bind(&arrays.keys)
            .bind(&arrays.tokens)
            .bind(&arrays.fingerprints)
            .bind(&arrays.micros)
            .bind(&arrays.outcomes);
    }
    query.fetch_all(conn).await
}

/// The claim and the completion of many keys, each one statement over arrays (`unnest`); every
/// row returned leads with its key.
///
/// Both are prepared once per connection, like every other statement, so their plans must not
/// depend on how large the table was when they were planned: a plan made while the table was
/// empty (a hash join over a sequential scan of the table) would be kept as it grew and scan it
/// whole for every batch. So each key's row is found through the primary key alone: by a
/// `LATERAL` lookup with `LIMIT 1`, which the planner cannot turn into a join, and by `ON
/// CONFLICT`, whose arbiter is the primary key's index.
///
/// The claim is the single claim's statement over the arrays: the live rows, then one `INSERT ...
/// ON CONFLICT DO UPDATE` for the keys without one, which takes a free or expired row, in key
/// order (two batches over the same keys lock them in one order, and a deadlock between them
/// cannot form). The keys must be distinct: one statement cannot update a row twice. A key that
/// gets no row (its live row committed after the statement's snapshot) is left to a single claim,
/// as the single claim's statement is run again.
///
/// The completion is the single completion's two statements in one `INSERT ... ON CONFLICT DO
/// UPDATE`: a row still carrying the request's token is completed (left as it is if that token
/// completed it already), a key that is gone is written, an expired row of another token is
/// adopted. A key without a row back (another token holds it) is left to a single completion,
/// which refuses it. Only for the pooled store: in a transaction a completion never adopts.
fn batched(t: &str) -> Batched {
    // $1 keys, $2 tokens, $3 fingerprints, $4 leases or retentions in microseconds, $5 outcomes
    // (completions only: a claim binds an empty array, and unnest pads it with NULL). The
    // statement of both binds the claims' five arrays, then the completions' as $6 to $10.
    let input = |name: &str, first: usize| {
        let [k, tok, fp, micros, outcome] = [0, 1, 2, 3, 4].map(|i| first + i);
        format!(
            "{name} AS (SELECT * FROM unnest(${k}::text[], ${tok}::text[], ${fp}::text[], ${micros}::bigint[], \
             ${outcome}::text[]) AS i(k, tok, fp, micros, outcome))"
        )
    };
    let until = format!("{NOW} + i.micros * INTERVAL '1 microsecond'");
    // The live rows of the claims' keys, and the claims of the keys without one.
    let claim = |input: &str| {
        format!(
            "live AS (\
             SELECT i.k, r.state, r.token, r.fingerprint, r.outcome, r.remaining FROM {input} i CROSS JOIN LATERAL (\
             SELECT state, token, fingerprint, outcome, {REMAINING} AS remaining FROM {t} \
             WHERE idempotency_key = i.k AND expires_at > {NOW} LIMIT 1) r), \
             claimed AS (\
             INSERT INTO {t} AS r (idempotency_key, state, token, fingerprint, outcome, expires_at) \
             SELECT i.k, 'in_progress', i.tok, i.fp, NULL, {until} FROM {input} i \
             WHERE NOT EXISTS (SELECT 1 FROM live WHERE live.k = i.k) ORDER BY i.k \
             ON CONFLICT (idempotency_key) DO UPDATE SET state = 'in_progress', token = EXCLUDED.token, \
             fingerprint = EXCLUDED.fingerprint, outcome = NULL, expires_at = EXCLUDED.expires_at \
             WHERE r.expires_at <= {NOW} \
             RETURNING r.idempotency_key, r.state, r.token, r.fingerprint, r.outcome)"
        )
    };
    // Completed by this token already: everything stays. Still this token's claim: the outcome
    // and the retention, the claim's fingerprint kept. Gone, or another token's expired row: the
    // whole record.
    let kept = "r.token = EXCLUDED.token AND r.state <> 'in_progress'";
    let complete = |input: &str| {
        format!(
            "INSERT INTO {t} AS r (idempotency_key, state, token, fingerprint, outcome, expires_at) \
             SELECT i.k, 'completed', i.tok, i.fp, i.outcome, {until} FROM {input} i ORDER BY i.k \
             ON CONFLICT (idempotency_key) DO UPDATE SET \
             outcome = CASE WHEN {kept} THEN r.outcome ELSE EXCLUDED.outcome END, \
             expires_at = CASE WHEN {kept} THEN r.expires_at ELSE EXCLUDED.expires_at END, \
             fingerprint = CASE WHEN r.token = EXCLUDED.token THEN r.fingerprint ELSE EXCLUDED.fingerprint END, \
             state = 'completed', token = EXCLUDED.token \
             WHERE r.token = EXCLUDED.token OR r.expires_at <= {NOW} \
             RETURNING r.idempotency_key"
        )
    };
    let claimed = "SELECT idempotency_key, state, token, fingerprint, outcome, CAST(0 AS BIGINT) FROM claimed \
                   UNION ALL SELECT k, state, token, fingerprint, outcome, remaining FROM live";
    let claim_only = format!("WITH {}, {} {claimed}", input("input", 1), claim("input"));
    let complete_only = format!("WITH {} {}", input("input", 1), complete("input"));
    // A row's second column tells a claim's row (TRUE, its columns after it) from a completion's.
    let both = format!(
        "WITH {}, {}, recorded AS ({}), {} \
         SELECT idempotency_key, TRUE, state, token, fingerprint, outcome, CAST(0 AS BIGINT) FROM claimed \
         UNION ALL SELECT k, TRUE, state, token, fingerprint, outcome, remaining FROM live \
         UNION ALL SELECT idempotency_key, FALSE, NULL, NULL, NULL, NULL, NULL FROM recorded",
        input("claims", 1),
        input("records", 6),
        complete("records"),
        claim("claims"),
    );
    Batched {
        claim: Statement::row(claim_only, &[]),
        complete: Statement::exec(complete_only, &[]),
        both: Some(Statement::row(both, &[])),
    }
}

/// The clock of every statement.
const NOW: &str = "clock_timestamp()";
