//! The transactional SQL store: claims and records inside one transaction of the caller's.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::{Database, Transaction};

use super::Dialect;
use super::dialect::Statements;
use super::steps::{self, Session};
use crate::{Claim, ClaimRequest, Completion, Detached, Key, Store, StoreError, Token};

/// A SQL store working inside one transaction: the key is claimed and the result recorded in the
/// same transaction as the body's own writes, so they commit together or not at all. The one
/// implementation behind [`PostgresTxStore`](super::PostgresTxStore),
/// [`MySqlTxStore`](super::MySqlTxStore) and [`SqliteTxStore`](super::SqliteTxStore); made by
/// [`SqlStore::begin`](super::SqlStore::begin) or
/// [`SqlStore::in_transaction`](super::SqlStore::in_transaction).
///
/// The body reaches the transaction through [`conn`](Self::conn). After the call,
/// [`commit`](Self::commit) or [`rollback`](Self::rollback); dropping it rolls back. An `Err` from
/// the body deletes the claim inside the transaction; a panic or a dropped future leaves it there,
/// with whatever the body had written: roll the transaction back (dropping it does).
/// [`commit`](Self::commit) refuses such a transaction, which holds a claim that no call recorded
/// or released: committed, its partial work would stay, and once the claim's lease ended a retry
/// would run the body again.
///
/// # Recording is committing
///
/// The record is a row of this transaction, so the call's `Ok` is only true once the
/// transaction commits. If the completion statement fails inside the transaction (a trigger or
/// constraint refuses it, the transaction was already aborted by a failed statement of the
/// body's, the connection is lost), the call does **not** return the body's `Ok`: it returns
/// [`Error::Store`](crate::Error::Store) at `complete`, whose source is [`StoreError::Aborted`],
/// at once (it is not retried for a lease: nothing in this transaction can succeed any more).
/// Roll back and retry in a new transaction; the body runs again there, since nothing of the
/// first attempt was committed. After such a failure [`commit`](Self::commit) refuses: it rolls
/// back and returns an error. On PostgreSQL, `commit` also checks first that the transaction
/// was not aborted by any failed statement (whose `COMMIT` the server answers with `ROLLBACK`,
/// which sqlx reports as success), and returns that statement's error instead.
///
/// # Duplicates wait on the row
///
/// The claim is an uncommitted row: a concurrent duplicate (in its own transaction, or through
/// the pooled store) blocks on that row until this transaction ends, then replays its committed
/// result, or runs the body itself if this one rolled back. How long it may wait is the server's
/// lock timeout, and what it gets then is [`Error::Store`](crate::Error::Store) with the server's
/// error as the source:
///
/// | Backend | Setting (default) | The waiting duplicate gets | Its own transaction |
/// |---|---|---|---|
/// | PostgreSQL | `lock_timeout` (0: no limit) | SQLSTATE `55P03` (lock not available) | aborted: roll back |
/// | MySQL/MariaDB | `innodb_lock_wait_timeout` (50 s) | error 1205 (lock wait timeout) | the statement is undone; roll back |
/// | SQLite | the busy timeout, 30 s from [`SqliteStore::open`](super::SqliteStore::open) | `SQLITE_BUSY` from `begin()` | never started |
///
/// So on PostgreSQL set one, for example `SET lock_timeout = '5s'` for the pool's connections
/// (`PgConnectOptions::options`) or `SET LOCAL lock_timeout = '5s'` on the transaction.
/// `tests/tests/sql.rs` (`<backend>::tx_duplicate_waits_for_the_lock_timeout`) checks each row of this
/// table. These stores add no timeout of their own: a statement cut off mid-transaction would
/// leave the transaction in an unknown state.
///
/// # Dropping a call on MySQL and MariaDB
///
/// Do not drop a call (with a `timeout` or `select!`) while one of its statements may be in
/// flight on MySQL or MariaDB: sqlx 0.9's MySQL connection can then wait for ever on the
/// transaction's next statement, its `ROLLBACK` included, and so can [`commit`](Self::commit)
/// and [`rollback`](Self::rollback). Bound the work with the server's limits instead
/// (`innodb_lock_wait_timeout`, MariaDB's `max_statement_time`). `tests/tests/sqlx_upstream.rs`
/// shows it with sqlx alone.
///
/// # Leases
///
/// A lease means nothing here: the claim is an uncommitted row that lives exactly as long as the
/// transaction, and no other caller can take it over meanwhile. So `extend` (the lease heartbeat)
/// returns `Ok(())` without a round trip, completion and release are fenced by the token only
/// (not by the lease's end, unlike the pooled store), and nothing is purged from inside a
/// transaction.
pub struct SqlTxStore<D: Dialect> {
    tx: tokio::sync::Mutex<Transaction<'static, D::Db>>,
    sql: Arc<Statements>,
    max_record_bytes: usize,
    /// A step of ours failed in the transaction: it must not commit.
    failed: AtomicBool,
    /// The claims this transaction made that no call has recorded or released yet: a call
    /// dropped while its body ran leaves one (and a panic, which also sets `failed`).
    open: std::sync::Mutex<Vec<(Key, Token)>>,
}

impl<D: Dialect> std::fmt::Debug for SqlTxStore<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlTxStore")
            .field("backend", &D::NAME)
            .field("table", &self.sql.table.full)
            .finish_non_exhaustive()
    }
}

impl<D: Dialect> SqlTxStore<D> {
    pub(super) fn new(tx: Transaction<'static, D::Db>, sql: Arc<Statements>, max_record_bytes: usize) -> Self {
        SqlTxStore {
            tx: tokio::sync::Mutex::new(tx),
            sql,
            max_record_bytes,
            failed: AtomicBool::new(false),
            open: std::sync::Mutex::default(),
        }
    }

    /// The transaction's connection, for the body's own queries: `.execute(&mut *tx.conn().await)`.
    ///
    /// Drop it before the call ends (keep it inside one statement): the store needs the
    /// connection to record the result.
    pub async fn conn(&self) -> tokio::sync::MappedMutexGuard<'_, <D::Db as Database>::Connection> {
        tokio::sync::MutexGuard::map(self.tx.lock().await, |tx| &mut **tx)
    }

    /// Commits the transaction: the body's writes and the recorded result become visible together.
    ///
    /// # Errors
    ///
    /// The commit's own error; or, without committing (the transaction is rolled back), an
    /// [`sqlx::Error::InvalidArgument`] when a completion failed in this transaction (see
    /// [Recording is committing](Self#recording-is-committing)) or a call in it was dropped or
    /// panicked before it recorded its result, or on PostgreSQL the error of the check that the
    /// transaction is not aborted.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        let mut tx = self.tx.into_inner();
        let open = self.open.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
        let refusal = if let Some((key, _)) = open.first() {
            Some(format!(
                "the transaction was rolled back, not committed: the idempotent call of key {:?} in it claimed \
                 its key and was dropped (or panicked) before it recorded or released it, so the body's work in \
                 it may be partial; run the whole transaction again",
                key.as_str()
            ))
        } else if self.failed.load(Ordering::Acquire) {
            Some(
                "the transaction was rolled back, not committed: an idempotent call in it could not record its \
                 result (it returned Error::Store with StoreError::Aborted); run the whole transaction again"
                    .to_owned(),
            )
        } else {
            None
        };
        if let Some(refusal) = refusal {
            tx.rollback().await?;
            return Err(sqlx::Error::InvalidArgument(refusal));
        }
        if let Some(check) = &self.sql.check_before_commit {
            let checked = D::run(&mut tx, check, &super::dialect::Params::default()).await;
            if let Err(e) = checked {
                tx.rollback().await?;
                return Err(e);
            }
        }
        tx.commit().await
    }

    /// Rolls the transaction back: neither the body's writes nor the claim remain.
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        self.tx.into_inner().rollback().await
    }

    /// The transaction itself, handed over as it is: committing it yourself skips the checks
    /// [`commit`](Self::commit) makes.
    #[must_use]
    pub fn into_transaction(self) -> Transaction<'static, D::Db> {
        self.tx.into_inner()
    }
}

impl<D: Dialect> SqlTxStore<D> {
    /// Marks the transaction as not committable when a step failed in it.
    fn note<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if result.is_err() {
            self.failed.store(true, Ordering::Release);
        }
        result
    }

    /// A failed completion: the transaction cannot commit this call's work any more.
    fn aborted(&self, error: StoreError) -> StoreError {
        self.failed.store(true, Ordering::Release);
        let source: Box<dyn std::error::Error + Send + Sync> = match error {
            StoreError::Backend { source, .. } | StoreError::Rejected { source, .. } => source,
            other => Box::new(other),
        };
        StoreError::Aborted { backend: D::NAME, source }
    }

    /// The claims made and not yet recorded or released.
    fn open(&self) -> std::sync::MutexGuard<'_, Vec<(Key, Token)>> {
        self.open.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `request`'s token now holds its key. A token may claim a key again (after a late reply):
    /// one entry.
    fn opened(&self, request: &ClaimRequest<'_>) {
        let mut open = self.open();
        if !open.iter().any(|(key, token)| key == request.key && token == request.token) {
            open.push((request.key.clone(), request.token.clone()));
        }
    }

    /// `token` has recorded or released its claim on `key`.
    fn closed(&self, key: &Key, token: &Token) {
        self.open().retain(|(k, t)| !(k == key && t == token));
    }
}

impl<D: Dialect> Store for SqlTxStore<D> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let mut tx = self.tx.lock().await;
        let result = steps::claim::<D>(&mut Session { conn: &mut tx, autocommit: false }, &self.sql, request).await;
        if let Ok(Claim::Claimed) = result {
            self.opened(request);
        }
        self.note(result)
    }

    /// Every failure is [`StoreError::Aborted`]: the record is part of this transaction, which
    /// cannot commit this call's work any more (see [Recording is committing](Self#recording-is-committing)).
    async fn complete(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
        let mut tx = self.tx.lock().await;
        let result =
            steps::complete::<D>(&mut Session { conn: &mut tx, autocommit: false }, &self.sql, completion).await;
        if result.is_ok() {
            self.closed(completion.key, completion.token);
        }
        result.map_err(|error| self.aborted(error))
    }

    /// One statement in the transaction where the dialect has one (PostgreSQL), else one claim
    /// after another on its connection.
    async fn claim_many(&self, requests: &[ClaimRequest<'_>]) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
        let Some(batched) = self.sql.batched.as_ref().filter(|_| !requests.is_empty()) else {
            return Ok(crate::store::claim_each(self, requests).await);
        };
        let mut tx = self.tx.lock().await;
        let session = &mut Session { conn: &mut **tx, autocommit: false };
        let claims = self.note(steps::claim_many::<D>(session, &self.sql, &batched.claim, requests).await)?;
        for (request, claim) in requests.iter().zip(&claims) {
            if let Ok(Claim::Claimed) = claim {
                self.opened(request);
            }
        }
        if claims.iter().any(Result::is_err) {
            self.failed.store(true, Ordering::Release);
        }
        Ok(claims)
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        let mut tx = self.tx.lock().await;
        let result =
            steps::release::<D>(&mut Session { conn: &mut tx, autocommit: false }, &self.sql, key, token).await;
        if result.is_ok() {
            self.closed(key, token);
        }
        self.note(result)
    }

    /// `Ok(())` at once, without a round trip: the claim lasts as long as the transaction (see
    /// "Leases" above).
    async fn extend(&self, _: &Key, _: &Token, _: Duration) -> Result<(), StoreError> {
        Ok(())
    }

    /// Nothing reaches the database: the claim lives only in this transaction. A call that left
    /// a step undone (it was dropped or its body panicked) leaves the transaction with partial
    /// work, so [`commit`](Self::commit) refuses from now on; roll it back.
    fn detach(&self, step: Detached) {
        self.failed.store(true, Ordering::Release);
        drop(step);
    }

    fn max_record_bytes(&self) -> usize {
        self.max_record_bytes
    }

    fn name(&self) -> &'static str {
        D::NAME
    }
}
