//! The SQL store: one implementation over a pool of any of the three dialects.

use std::collections::HashSet;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use sqlx::{Pool, Transaction};

use super::dialect::Statements;
use super::dialect::TableName;
use super::steps::{self, Session};
use super::{DEFAULT_TABLE, Dialect, PurgeTask, SqlTxStore, TableNameError, TimedOut};
use crate::error::BatchFailure;
use crate::setters::setters;
use crate::store::DEFAULT_MAX_RECORD_BYTES;
use crate::{BatchAnswers, Claim, ClaimRequest, Completion, Detached, Key, Store, StoreError, Token};

/// How long the statements of one store call may take before it fails with [`TimedOut`] (change
/// it with [`SqlStore::with_timeout`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// How many expired rows one purge statement deletes at most (change it with
/// [`SqlStore::with_purge_batch`]).
pub const DEFAULT_PURGE_BATCH: u32 = 1000;

/// How many times `create_table` runs a statement again that another session's `CREATE` raced.
const MAX_CREATE_RACES: u32 = 3;

/// Whether a `CREATE ... IF NOT EXISTS` failed because another session created the same object
/// at the same moment: a unique violation in the catalog (PostgreSQL's `pg_type` or `pg_class`
/// index), or PostgreSQL's duplicate table (`42P07`) or duplicate object (`42710`). Run again, the
/// statement finds the object and does nothing.
fn created_meanwhile(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(e) = error else { return false };
    matches!(e.kind(), sqlx::error::ErrorKind::UniqueViolation)
        || matches!(e.code().as_deref(), Some("42P07" | "42710"))
}

/// A store in a SQL table, shared by every application server using the database: the one
/// implementation behind [`PostgresStore`](super::PostgresStore), [`MySqlStore`](super::MySqlStore)
/// and [`SqliteStore`](super::SqliteStore), which are this type with their dialect.
///
/// Cloning gives another handle on the same pool and table.
///
/// # Timeouts
///
/// Once a call has its connection, its statements are bounded by a timeout (default
/// [`DEFAULT_TIMEOUT`]): on a stalled network or a stuck server the call fails with a
/// [`StoreError::Backend`] whose source is [`TimedOut`], and the connection it was using is
/// dropped instead of going back to the pool, so later calls get fresh ones.
///
/// Waiting for a connection is bounded by the pool's own `acquire_timeout` (sqlx's default is
/// 30 s; it fails with `sqlx::Error::PoolTimedOut`). That wait includes sqlx's liveness ping of
/// an idle connection (`test_before_acquire`, on by default), which a stalled network stalls
/// too, as does the handshake of a new connection: set `acquire_timeout` no longer than you
/// would wait. On a stalled network a call thus fails within `acquire_timeout` + the timeout
/// (plus, for a step sent again after a lost connection, the first send's time). A
/// busy pool (more concurrent calls than connections) only ever waits there, never in
/// [`TimedOut`].
///
/// # The pool
///
/// Each step takes a connection from the pool for one statement (two, rarely) and gives it
/// back. sqlx pings a connection it hands out (`test_before_acquire`, on by default) and one it
/// gets back, so on a default pool a step costs three round trips to the server. The store does
/// not need the first ping: build its pool with `test_before_acquire(false)` and a step costs
/// two. A step whose connection the server has closed meanwhile (killed, timed out, a restart)
/// fails with the connection error, and the store sends it once more on a fresh connection,
/// with a timeout of its own: every step, since the same token sending one twice has the effect
/// of sending it once. A release sent again that finds the claim gone succeeds: its first send
/// may have deleted it before the connection was lost.
///
/// Measured with `consume_load` (16 messages in flight; PostgreSQL 15, the brokers and the
/// consumer on one 2-core machine), the two pools side by side in each run: without the first
/// ping the consumer spent 15 to 29 % less CPU per message, and the medians of the paired
/// messages-per-second ratios were 1.03 to 1.48 (four sets of five runs on each broker, on two
/// machines; BENCHMARKS.md, "Message consumers"). The stores that
/// [`AnyStore::from_url`](crate::AnyStore::from_url) makes build their pools this way.
///
/// ```no_run
/// use idempotent_runtime::stores::sql::{PostgresStore, sqlx};
///
/// # async fn setup() -> Result<(), sqlx::Error> {
/// let pool = sqlx::postgres::PgPoolOptions::new()
///     .test_before_acquire(false)
///     .connect("postgres://postgres@127.0.0.1:5432/app")
///     .await?;
/// let store = PostgresStore::new(pool);
/// # Ok(())
/// # }
/// ```
pub struct SqlStore<D: Dialect> {
    pool: Pool<D::Db>,
    sql: Arc<Statements>,
    max_record_bytes: usize,
    timeout: Duration,
    purge_batch: u32,
    dialect: PhantomData<fn() -> D>,
}

impl<D: Dialect> Clone for SqlStore<D> {
    fn clone(&self) -> Self {
        SqlStore { pool: self.pool.clone(), sql: Arc::clone(&self.sql), dialect: PhantomData, ..*self }
    }
}

impl<D: Dialect> std::fmt::Debug for SqlStore<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlStore")
            .field("backend", &D::NAME)
            .field("table", &self.sql.table.full)
            .field("max_record_bytes", &self.max_record_bytes)
            .field("timeout", &self.timeout)
            .field("purge_batch", &self.purge_batch)
            .finish_non_exhaustive()
    }
}

impl<D: Dialect> SqlStore<D> {
    /// A store in the table `idempotency_records` (see [`create_table`](Self::create_table)).
    #[must_use]
    pub fn new(pool: Pool<D::Db>) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).unwrap_or_else(|_| unreachable!("the default table name is valid"))
    }

    /// A store in `table` (`name` or `schema.name`, a database name on MySQL: letters, digits
    /// and `_`).
    pub fn with_table(pool: Pool<D::Db>, table: &str) -> Result<Self, TableNameError> {
        let table = TableName::parse(table)?;
        let sql = Arc::new(D::statements(&table.full, &table));
        Ok(SqlStore {
            pool,
            sql,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            timeout: DEFAULT_TIMEOUT,
            purge_batch: DEFAULT_PURGE_BATCH,
            dialect: PhantomData,
        })
    }

    setters! {
        /// Records outcomes of at most `max_record_bytes` encoded bytes (default 1 MiB; on MySQL
        /// keep it under the server's `max_allowed_packet`); larger results are not recorded and
        /// replay as [`Error::Unrecordable`](crate::Error::Unrecordable).
        pub fn with_max_record_bytes(max_record_bytes: usize);
        /// Bounds the statements of every call by `timeout` (default [`DEFAULT_TIMEOUT`]; the
        /// wait for a pooled connection is the pool's `acquire_timeout`, see
        /// [Timeouts](SqlStore#timeouts)). A call that takes longer fails with [`TimedOut`] as the
        /// source of [`StoreError::Backend`]; its connection is dropped, not reused.
        ///
        /// Keep it above the longest wait on a row lock you expect: a claim on a key that a
        /// transactional store holds in an open transaction waits for that transaction (MySQL).
        pub fn with_timeout(timeout: Duration);
    }

    /// Deletes at most `rows` expired rows per statement when purging (default
    /// [`DEFAULT_PURGE_BATCH`], at least 1), so a purge never holds many locks at once.
    #[must_use]
    pub fn with_purge_batch(mut self, rows: u32) -> Self {
        self.purge_batch = rows.max(1);
        self
    }

    /// Creates the table and its index if they do not exist (see the [module docs](super)).
    ///
    /// Safe to run from several processes at once (replicas starting together): PostgreSQL may
    /// answer a `CREATE ... IF NOT EXISTS` that raced another session's with a duplicate in its
    /// catalog instead of finding the object, and such a statement is run again, when the object
    /// is there.
    pub async fn create_table(&self) -> Result<(), sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        for statement in &self.sql.create {
            let mut raced = 0;
            loop {
                match D::run(&mut conn, statement, &super::dialect::Params::default()).await {
                    Err(e) if created_meanwhile(&e) && raced < MAX_CREATE_RACES => raced += 1,
                    Err(e) => return Err(e),
                    Ok(_) => break,
                }
            }
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
    pub fn pool(&self) -> &Pool<D::Db> {
        &self.pool
    }

    /// Begins a transaction on the pool, to claim keys and record results inside it (SQLite:
    /// with `BEGIN IMMEDIATE`).
    pub async fn begin(&self) -> Result<SqlTxStore<D>, sqlx::Error> {
        let tx = match D::BEGIN {
            Some(statement) => self.pool.begin_with(statement).await?,
            None => self.pool.begin().await?,
        };
        Ok(self.in_transaction(tx))
    }

    /// Claims keys and records results inside `tx`, a transaction you began (on SQLite,
    /// preferably with `BEGIN IMMEDIATE`: a deferred transaction that read before it writes may
    /// fail with `SQLITE_BUSY` when another connection wrote in between).
    #[must_use]
    pub fn in_transaction(&self, tx: Transaction<'static, D::Db>) -> SqlTxStore<D> {
        SqlTxStore::new(tx, Arc::clone(&self.sql), self.max_record_bytes)
    }

    /// Purges expired rows now and then every `every`, on the current Tokio runtime, until the
    /// returned task is shut down or dropped. Failures are logged and retried at the next interval.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    pub fn spawn_purge(&self, every: Duration) -> PurgeTask {
        super::spawn_purge(self.clone(), every, D::NAME)
    }

    /// Runs one step on a pooled connection, its statements within the store's timeout (the
    /// operator's methods in `admin.rs` run theirs so too).
    pub(super) async fn step<T>(
        &self,
        operation: &'static str,
        step: impl AsyncFnOnce(&mut Session<'_, D>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(steps::backend::<D>)?;
        let result = tokio::time::timeout(self.timeout, step(&mut Session { conn: &mut conn, autocommit: true })).await;
        let Ok(result) = result else {
            // Its statement may still be under way: drop the connection (closing its socket)
            // and let the pool open a fresh one.
            drop(conn.detach());
            return Err(StoreError::backend(D::NAME, TimedOut { backend: D::NAME, operation, after: self.timeout }));
        };
        if result.as_ref().is_err_and(connection_lost::<D>) {
            // Not back to the pool, which would ping it first: it is gone.
            drop(conn.detach());
        }
        result
    }

    /// Runs a step, and sends it once more, on a fresh connection, if the first send found its
    /// connection gone ([`connection_lost`]): the server closed it while it sat idle in the pool,
    /// say. Every step may be sent twice by its token to the effect of once (a release, whose
    /// second send takes `NotOwner` for success, does the same by hand below). The second send
    /// has a timeout of its own.
    ///
    /// So a pool that does not ping each connection before handing it out
    /// (`test_before_acquire(false)`, a round trip less per step) loses no call to a connection
    /// the server closed.
    async fn resending<T, F>(&self, send: impl Fn() -> F) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        match send().await {
            Err(error) if connection_lost::<D>(&error) => send().await,
            result => result,
        }
    }
}

/// A step's error that says its connection is gone ([`Backend::connection_lost`](super::dialect::Backend::connection_lost)).
fn connection_lost<D: Dialect>(error: &StoreError) -> bool {
    matches!(error, StoreError::Backend { source, .. } if source.downcast_ref::<sqlx::Error>().is_some_and(D::connection_lost))
}

impl<D: Dialect> Store for SqlStore<D> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.resending(|| self.step("claim", async |s| steps::claim(s, &self.sql, request).await)).await
    }

    async fn complete(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
        self.resending(|| self.step("complete", async |s| steps::complete(s, &self.sql, completion).await)).await
    }

    /// One statement for a batch where the dialect has one (PostgreSQL; see its module docs), else
    /// the default: the single claims, concurrently.
    async fn claim_many(&self, requests: &[ClaimRequest<'_>]) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
        let Some(batched) = self.sql.batched.as_ref().filter(|_| !requests.is_empty()) else {
            return Ok(crate::store::claim_each(self, requests).await);
        };
        self.resending(|| self.step("claim", async |s| steps::claim_many(s, &self.sql, &batched.claim, requests).await))
            .await
    }

    /// One statement for a batch where the dialect has one (PostgreSQL), else the default.
    async fn complete_many(&self, completions: &[Completion<'_>]) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let Some(batched) = self.sql.batched.as_ref().filter(|_| !completions.is_empty()) else {
            return Ok(crate::store::complete_each(self, completions).await);
        };
        let send = || {
            self.step("complete", async |s| steps::complete_many(s, &self.sql, &batched.complete, completions).await)
        };
        self.resending(send).await
    }

    /// One statement for both halves where the dialect has one (PostgreSQL) and no key is in
    /// both, else the default: the two halves' batches, concurrently.
    async fn claim_and_complete_many(
        &self,
        requests: &[ClaimRequest<'_>],
        completions: &[Completion<'_>],
    ) -> (BatchAnswers<Claim>, BatchAnswers<()>) {
        let both = self.sql.batched.as_ref().and_then(|batched| batched.both.as_ref());
        let Some(both) = both.filter(|_| !requests.is_empty() && !completions.is_empty()) else {
            return crate::store::claim_and_complete_each(self, requests, completions).await;
        };
        let recorded: HashSet<&Key> = completions.iter().map(|completion| completion.key).collect();
        if requests.iter().any(|request| recorded.contains(request.key)) {
            return crate::store::claim_and_complete_each(self, requests, completions).await;
        }
        let send = || {
            self.step("claim", async |s| {
                steps::claim_and_complete_many(s, &self.sql, both, requests, completions).await
            })
        };
        match self.resending(send).await {
            Ok((claims, records)) => (Ok(claims), Ok(records)),
            Err(error) => {
                let failure = BatchFailure::from(error);
                (Err(failure.error()), Err(failure.error()))
            }
        }
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        let send = || self.step("release", async |s| steps::release(s, &self.sql, key, token).await);
        match send().await {
            Err(error) if connection_lost::<D>(&error) => match send().await {
                // The first send may have deleted the claim before its connection was lost.
                // Either way it is not this token's any more, which is what a release is for.
                Err(StoreError::NotOwner) => Ok(()),
                result => result,
            },
            result => result,
        }
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        self.resending(|| self.step("extend", async |s| steps::extend(s, &self.sql, key, token, lease).await)).await
    }

    fn detach(&self, step: Detached) {
        crate::stores::spawn_detached(self.clone(), step);
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let mut purged = 0;
        loop {
            let batch = self.purge_batch;
            let deleted =
                self.resending(|| self.step("purge", async |s| steps::purge_batch(s, &self.sql, batch).await)).await?;
            purged += deleted;
            if deleted < u64::from(batch) {
                return Ok(purged);
            }
            // Between batches the locks are gone; let this runtime's other tasks run too.
            tokio::task::yield_now().await;
        }
    }

    fn max_record_bytes(&self) -> usize {
        self.max_record_bytes
    }

    fn name(&self) -> &'static str {
        D::NAME
    }
}
