//! Histories on the transactional SQL stores: every call runs in a transaction of its own, its body
//! writes its effect in that transaction, and the caller commits, rolls back or drops it. Faults:
//! calls dropped mid-way (on MariaDB only while the body works: see
//! [`Backend::DROPS_MID_STATEMENT`]), bodies that fail, panic, work slowly or swallow a failed
//! statement, duplicates that wait only briefly for a claim (a short lock timeout), connections
//! killed by the server at any moment, commits attempted after an error.
//!
//! The guarantee judged is the transactional one, stricter than the pooled stores': the body's
//! effect and its record commit together or not at all. So whatever happened, each key ends with
//! either no effect and no record, or one effect and one completed record holding the value that
//! effect's body returned; every caller whose commit succeeded after an `Ok`, and every replay, got
//! that value; and a probe after the history replays it (or, with no record, runs once and
//! commits). No lease is involved: a claim is a row of an open transaction, and a duplicate waits
//! on it.
//!
//! The plans are drawn from a seed, like the other histories, but run in real time on real
//! servers, so the interleavings are not replayed exactly; the judgement does not depend on them.

use std::cell::{Cell, RefCell};
use std::fmt::Write as _;
use std::rc::Rc;
use std::time::Duration;

use idempotent_runtime::stores::sql::{Dialect, SqlStore, SqlTxStore, sqlx};
use idempotent_runtime::{Call, Error};

use super::callers::{BODY_PANIC, CatchUnwind};
use super::rng::SplitMix64;

/// The scope of these histories' keys.
pub const SCOPE: &str = "simtx";

/// The queries a history needs beyond the store: the effects table, the body's writes, and the
/// faults. Implemented for the three dialects.
#[allow(async_fn_in_trait, reason = "used on one thread (a LocalSet), where no Send bound is needed")]
pub trait Backend: Dialect + Sized {
    /// Whether a call may be dropped at any point, in the middle of a statement too. Not on
    /// MariaDB: sqlx 0.9's MySQL connection can wait for ever on the next statement of the
    /// transaction after one was dropped mid-flight (RELIABILITY.md), so there calls are dropped
    /// only while the body works between its statements.
    const DROPS_MID_STATEMENT: bool;
    /// Creates the table of effects, `{table}`.
    async fn create_effects(store: &SqlStore<Self>, table: &str);
    /// Writes the effect `value` of `key` in the transaction.
    async fn effect(tx: &SqlTxStore<Self>, table: &str, key: &str, value: i64) -> Result<(), sqlx::Error>;
    /// Runs a statement that fails, in the transaction (a body that swallows the error: on
    /// PostgreSQL this aborts the transaction).
    async fn failing_statement(tx: &SqlTxStore<Self>) -> Result<(), sqlx::Error>;
    /// Makes a duplicate in this transaction wait at most briefly for another's claim (PostgreSQL
    /// `lock_timeout`, 100 ms; MariaDB `innodb_lock_wait_timeout`, 1 s, for the connection's
    /// session), as the docs advise; SQLite has its busy timeout at `begin()` only.
    async fn short_lock_wait(tx: &SqlTxStore<Self>);
    /// The server's id of the transaction's connection, if connections can be killed.
    async fn connection_id(tx: &SqlTxStore<Self>) -> Option<i64>;
    /// Has the server close connection `id`.
    async fn kill(store: &SqlStore<Self>, id: i64);
    /// The committed effects of `key`.
    async fn effects(store: &SqlStore<Self>, table: &str, key: &str) -> Vec<i64>;
    /// The committed rows of the store's table for `key`: state and outcome.
    async fn rows(store: &SqlStore<Self>, key: &str) -> Vec<(String, Option<String>)>;
    /// Drops the table of effects.
    async fn drop_effects(store: &SqlStore<Self>, table: &str);
}

macro_rules! backend {
    ($dialect:ty, $anywhere:literal, $p1:literal, $p2:literal, $wait:expr, $id:expr, $kill:expr, $fail:expr) => {
        impl Backend for $dialect {
            const DROPS_MID_STATEMENT: bool = $anywhere;
            async fn create_effects(store: &SqlStore<Self>, table: &str) {
                let create = format!("CREATE TABLE {table} (k VARCHAR(255) NOT NULL, v BIGINT NOT NULL)");
                sqlx::query(sqlx::AssertSqlSafe(create)).execute(store.pool()).await.expect("create the effects table");
            }
            async fn effect(tx: &SqlTxStore<Self>, table: &str, key: &str, value: i64) -> Result<(), sqlx::Error> {
                let insert = format!("INSERT INTO {table} (k, v) VALUES ({}, {})", $p1, $p2);
                sqlx::query(sqlx::AssertSqlSafe(insert)).bind(key).bind(value).execute(&mut *tx.conn().await).await?;
                Ok(())
            }
            async fn failing_statement(tx: &SqlTxStore<Self>) -> Result<(), sqlx::Error> {
                sqlx::query($fail).execute(&mut *tx.conn().await).await.map(|_| ())
            }
            async fn short_lock_wait(tx: &SqlTxStore<Self>) {
                let wait: Option<&'static str> = $wait;
                if let Some(wait) = wait {
                    let _ = sqlx::query(wait).execute(&mut *tx.conn().await).await;
                }
            }
            async fn connection_id(tx: &SqlTxStore<Self>) -> Option<i64> {
                let id: Option<&'static str> = $id;
                let id = id?;
                sqlx::query_scalar::<_, i64>(id).fetch_one(&mut *tx.conn().await).await.ok()
            }
            async fn kill(store: &SqlStore<Self>, id: i64) {
                let kill: fn(i64) -> String = $kill;
                let _ = sqlx::query(sqlx::AssertSqlSafe(kill(id))).execute(store.pool()).await;
            }
            async fn effects(store: &SqlStore<Self>, table: &str, key: &str) -> Vec<i64> {
                let select = format!("SELECT v FROM {table} WHERE k = {}", $p1);
                sqlx::query_scalar(sqlx::AssertSqlSafe(select))
                    .bind(key)
                    .fetch_all(store.pool())
                    .await
                    .expect("read effects")
            }
            async fn rows(store: &SqlStore<Self>, key: &str) -> Vec<(String, Option<String>)> {
                let select = format!("SELECT state, outcome FROM {} WHERE idempotency_key = {}", store.table(), $p1);
                sqlx::query_as(sqlx::AssertSqlSafe(select))
                    .bind(key)
                    .fetch_all(store.pool())
                    .await
                    .expect("read records")
            }
            async fn drop_effects(store: &SqlStore<Self>, table: &str) {
                let drop = format!("DROP TABLE IF EXISTS {table}");
                let _ = sqlx::query(sqlx::AssertSqlSafe(drop)).execute(store.pool()).await;
            }
        }
    };
}

#[cfg(feature = "postgres")]
backend!(
    idempotent_runtime::stores::sql::PostgresDialect,
    true,
    "$1",
    "$2",
    Some("SET LOCAL lock_timeout = '100ms'"),
    Some("SELECT CAST(pg_backend_pid() AS BIGINT)"),
    |id| format!("SELECT pg_terminate_backend({id})"),
    "SELECT 1 / 0"
);
#[cfg(feature = "mysql")]
backend!(
    idempotent_runtime::stores::sql::MySqlDialect,
    false,
    "?",
    "?",
    Some("SET SESSION innodb_lock_wait_timeout = 1"),
    Some("SELECT CAST(CONNECTION_ID() AS SIGNED)"),
    |id| format!("KILL CONNECTION {id}"),
    "SELECT * FROM simtx_no_such_table"
);
#[cfg(feature = "sqlite")]
backend!(
    idempotent_runtime::stores::sql::SqliteDialect,
    true,
    "?",
    "?",
    None,
    None,
    |_| String::new(),
    "SELECT * FROM simtx_no_such_table"
);

/// What a body does after writing its effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    /// Returns `Ok` at once.
    Ok,
    /// Works for a while, then returns `Ok`.
    Slow(Duration),
    /// Returns its own `Err` (the claim is released in the transaction).
    Err,
    /// Panics.
    Panic,
    /// Runs a statement that fails, ignores the error, and returns `Ok`.
    Swallow,
}

/// What the caller does with the transaction after the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Commit,
    Rollback,
    Drop,
}

/// One attempt of a caller.
#[derive(Debug, Clone)]
struct Attempt {
    delay: Duration,
    body: Body,
    /// After anything but the body's own `Err` (whose partial work a caller that commits it
    /// chose to keep). After an error of the store's, a panic or a cancellation the docs say to
    /// roll back, and `commit` must refuse what it cannot commit whole.
    end: End,
    cancel_after: Option<Duration>,
    kill_after: Option<Duration>,
    short_lock_wait: bool,
}

/// A history's plan: which key each caller uses, and its attempts.
#[derive(Debug, Clone)]
struct Plan {
    keys: usize,
    callers: Vec<(usize, Vec<Attempt>)>,
}

fn draw(seed: u64) -> Plan {
    let mut rng = SplitMix64::new(seed);
    let keys = 1 + usize::try_from(rng.below(2)).unwrap_or(0);
    let callers = (0..2 + rng.below(4))
        .map(|_| {
            let key = usize::try_from(rng.below(keys as u64)).unwrap_or(0);
            let attempts = (0..=rng.below(3))
                .map(|_| Attempt {
                    delay: rng.millis(150),
                    body: match rng.below(100) {
                        0..50 => Body::Ok,
                        50..65 => Body::Slow(rng.millis(300)),
                        65..78 => Body::Err,
                        78..88 => Body::Panic,
                        _ => Body::Swallow,
                    },
                    end: match rng.below(100) {
                        0..75 => End::Commit,
                        75..90 => End::Rollback,
                        _ => End::Drop,
                    },
                    cancel_after: rng.chance(12).then(|| rng.millis(250)),
                    kill_after: rng.chance(10).then(|| rng.millis(250)),
                    short_lock_wait: rng.chance(25),
                })
                .collect();
            (key, attempts)
        })
        .collect();
    Plan { keys, callers }
}

/// How an attempt's call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Called {
    /// `Ok`, with whether this attempt's body ran.
    Ok { value: i64, ran: bool },
    /// The body's own `Err`.
    BodyErr,
    /// The body's write failed, and the body returned that error.
    BodyFailed(String),
    /// An idempotency error.
    Error(String),
    /// The body's planted panic.
    Panicked,
    /// Another panic: the library's.
    ForeignPanic(String),
    /// Dropped by the deadline.
    Cancelled,
}

/// One attempt, as it happened.
#[derive(Debug, Clone)]
struct Done {
    caller: usize,
    key: usize,
    attempt: usize,
    called: Called,
    /// `Some(result)` when a commit was attempted.
    commit: Option<Result<(), String>>,
}

/// A history's verdict.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Calls made.
    pub calls: u64,
    /// Bodies run.
    pub bodies: u64,
    /// Commits that succeeded.
    pub commits: u64,
    /// Commits that failed or were refused.
    pub refused: u64,
    /// What broke the guarantee.
    pub violations: Vec<String>,
    /// The history, for a failure's report.
    pub log: String,
}

/// Runs the history of `seed` on `store`, its keys under `prefix`, its effects in `effects` (a
/// table made by [`Backend::create_effects`]). Call it inside a `LocalSet`.
pub async fn run_history<D: Backend + 'static>(seed: u64, store: &SqlStore<D>, effects: &str, prefix: &str) -> Verdict {
    let plan = draw(seed);
    let key_of = |k: usize| format!("{prefix}k{k}");
    let bodies = Rc::new(Cell::new(0u64));
    // Where each caller is, for the report of a history that does not finish.
    let steps = Rc::new(RefCell::new(vec!["starting"; plan.callers.len()]));
    let mut tasks = Vec::new();
    for (caller, (key, attempts)) in plan.callers.iter().cloned().enumerate() {
        let (store, effects, key_name, bodies) = (store.clone(), effects.to_owned(), key_of(key), Rc::clone(&bodies));
        let steps = Rc::clone(&steps);
        let value_base = i64::try_from(seed % (1 << 40)).unwrap_or(0) * 64 + i64::try_from(caller).unwrap_or(0) * 8;
        tasks.push(tokio::task::spawn_local(async move {
            let mut done = Vec::new();
            for (n, attempt) in attempts.iter().enumerate() {
                steps.borrow_mut()[caller] = "pausing";
                tokio::time::sleep(attempt.delay).await;
                let value = value_base + i64::try_from(n).unwrap_or(0);
                let at = |step| steps.borrow_mut()[caller] = step;
                let (called, commit) = run_attempt(&store, &effects, &key_name, attempt, value, &bodies, &at).await;
                let committed = matches!(commit, Some(Ok(())));
                let ok = matches!(called, Called::Ok { .. });
                done.push(Done { caller, key, attempt: n, called, commit });
                if ok && committed {
                    break;
                }
            }
            steps.borrow_mut()[caller] = "done";
            done
        }));
    }
    let mut log = Vec::new();
    let mut verdict = Verdict::default();
    let deadline = tokio::time::Instant::now() + HISTORY_LIMIT;
    let aborts: Vec<_> = tasks.iter().map(tokio::task::JoinHandle::abort_handle).collect();
    for task in tasks {
        let Ok(done) = tokio::time::timeout_at(deadline, task).await else {
            verdict.violations.push(format!(
                "the callers did not finish within {HISTORY_LIMIT:?}; each caller's step then: {:?}",
                steps.borrow()
            ));
            aborts.iter().for_each(tokio::task::AbortHandle::abort);
            let _ = writeln!(verdict.log, "history of seed {seed} (transactional): {plan:?}");
            return verdict;
        };
        log.extend(done.expect("a caller task"));
    }
    verdict.bodies = bodies.get();
    for k in 0..plan.keys {
        judge(store, effects, &key_of(k), k, &log, &mut verdict).await;
    }
    verdict.calls = log.len() as u64;
    verdict.commits = log.iter().filter(|d| matches!(d.commit, Some(Ok(())))).count() as u64;
    verdict.refused = log.iter().filter(|d| matches!(d.commit, Some(Err(_)))).count() as u64;
    let _ = writeln!(verdict.log, "history of seed {seed} (transactional): {plan:?}");
    for done in &log {
        let _ = writeln!(verdict.log, "  {done:?}");
    }
    verdict
}

/// How long a history's callers may take: far more than their plans (about 2 s at most).
const HISTORY_LIMIT: Duration = Duration::from_secs(60);

/// One attempt: begin, call, then commit, roll back or drop. `at` is told each step.
async fn run_attempt<D: Backend + 'static>(
    store: &SqlStore<D>,
    effects: &str,
    key: &str,
    attempt: &Attempt,
    value: i64,
    bodies: &Cell<u64>,
    at: &dyn Fn(&'static str),
) -> (Called, Option<Result<(), String>>) {
    at("begin");
    let tx = match store.begin().await {
        Ok(tx) => tx,
        Err(e) => return (Called::Error(format!("begin: {e}")), None),
    };
    if attempt.short_lock_wait {
        at("setting a lock wait");
        D::short_lock_wait(&tx).await;
    }
    at("reading the connection id");
    let killer = match attempt.kill_after {
        Some(after) => D::connection_id(&tx).await.map(|id| {
            let store = store.clone();
            tokio::task::spawn_local(async move {
                tokio::time::sleep(after).await;
                D::kill(&store, id).await;
            })
        }),
        None => None,
    };
    let ran = Cell::new(false);
    // When a slow body's work began (it runs no statement while it works).
    let (working, work_began) = (Cell::new(None), tokio::sync::Notify::new());
    let call = Call::new(SCOPE, key).run(&tx, async {
        ran.set(true);
        bodies.set(bodies.get() + 1);
        D::effect(&tx, effects, key, value).await.map_err(|e| Outcome::Failed(e.to_string()))?;
        match attempt.body {
            Body::Ok => {}
            Body::Slow(work) => {
                working.set(Some((tokio::time::Instant::now(), work)));
                work_began.notify_one();
                tokio::time::sleep(work).await;
            }
            Body::Err => return Err(Outcome::BodyErr),
            Body::Panic => panic!("{BODY_PANIC}"),
            Body::Swallow => {
                let _ = D::failing_statement(&tx).await;
            }
        }
        Ok::<i64, Outcome>(value)
    });
    let call = CatchUnwind(Box::pin(call));
    at("calling");
    let result = match attempt.cancel_after {
        Some(after) if D::DROPS_MID_STATEMENT => tokio::time::timeout(after, call).await.ok(),
        Some(after) => {
            // Dropped within the first half of a slow body's work, never mid-statement.
            let in_work = async {
                work_began.notified().await;
                let (began, work) = working.get().expect("set before the notice");
                if work < Duration::from_millis(2) {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep_until(began + after.min(work / 2)).await;
            };
            tokio::select! {
                result = call => Some(result),
                () = in_work => None,
            }
        }
        None => Some(call.await),
    };
    let called = match result {
        None => Called::Cancelled,
        Some(Ok(Ok(got))) => Called::Ok { value: got, ran: ran.get() },
        Some(Ok(Err(Outcome::BodyErr))) => Called::BodyErr,
        Some(Ok(Err(Outcome::Failed(e)))) => Called::BodyFailed(e),
        Some(Ok(Err(Outcome::Idempotency(e)))) => Called::Error(e.to_string()),
        Some(Err(panic)) if panic == BODY_PANIC => Called::Panicked,
        Some(Err(panic)) => Called::ForeignPanic(panic),
    };
    let may_commit = !matches!(called, Called::BodyErr | Called::BodyFailed(_));
    let commit = match (may_commit, attempt.end) {
        (true, End::Commit) => {
            at("committing");
            Some(tx.commit().await.map_err(|e| e.to_string()))
        }
        (true, End::Rollback) => {
            at("rolling back");
            let _ = tx.rollback().await;
            None
        }
        _ => None,
    };
    // A kill not sent yet is not sent: connections die during their attempt only (one killed
    // then may still be taken from the pool by a later attempt, which sees the error).
    if let Some(killer) = killer {
        killer.abort();
    }
    (called, commit)
}

/// A body's error, or the call's.
#[derive(Debug)]
enum Outcome {
    /// The body's planned `Err`.
    BodyErr,
    /// The body's write failed (its connection was killed, say).
    Failed(String),
    /// The call's own error.
    Idempotency(Error),
}

impl From<Error> for Outcome {
    fn from(e: Error) -> Self {
        Outcome::Idempotency(e)
    }
}

/// Judges key `k` from the database's committed state and what the callers saw, then probes it.
async fn judge<D: Backend>(
    store: &SqlStore<D>,
    effects: &str,
    key: &str,
    k: usize,
    log: &[Done],
    verdict: &mut Verdict,
) {
    for done in log.iter().filter(|d| d.key == k) {
        if let Called::ForeignPanic(text) = &done.called {
            verdict.violations.push(format!(
                "caller {} attempt {}: a panic that is not the body's: {text}",
                done.caller, done.attempt
            ));
        }
    }
    let Some(recorded) = check_state(store, effects, key, verdict, "after the history").await else { return };
    for done in log.iter().filter(|d| d.key == k) {
        let Called::Ok { value, ran } = done.called else { continue };
        let committed = matches!(done.commit, Some(Ok(())));
        if (committed || !ran) && recorded != Some(value) {
            verdict.violations.push(format!(
                "caller {} attempt {}: got Ok({value}) ({}, {}) but the committed record is {recorded:?}",
                done.caller,
                done.attempt,
                if ran { "executed" } else { "replayed" },
                if committed { "committed" } else { "not committed" }
            ));
        }
    }
    // The probe: with every transaction ended, the key replays its record, or runs once. A
    // connection killed during the history may still be in the pool: the probe's store errors are
    // tried again.
    let probe_value = -1;
    let mut tries = 0;
    let (tx, ran, probed) = loop {
        tries += 1;
        let tx = match store.begin().await {
            Ok(tx) => tx,
            Err(e) if tries == PROBE_TRIES => {
                verdict.violations.push(format!("the probe of {key} could not begin a transaction: {e}"));
                return;
            }
            Err(_) => continue,
        };
        let ran = Cell::new(false);
        let call = Call::new(SCOPE, key).run(&tx, async {
            ran.set(true);
            D::effect(&tx, effects, key, probe_value).await.map_err(|e| Outcome::Failed(e.to_string()))?;
            Ok::<i64, Outcome>(probe_value)
        });
        let probed = tokio::time::timeout(Duration::from_secs(20), call).await;
        let failed = matches!(&probed, Ok(Err(Outcome::Failed(_) | Outcome::Idempotency(Error::Store { .. }))));
        if !failed || tries == PROBE_TRIES {
            break (tx, ran, probed);
        }
        let _ = tx.rollback().await;
    };
    match (probed, recorded) {
        (Ok(Ok(value)), Some(expected)) if value == expected && !ran.get() => {}
        (Ok(Ok(value)), None) if value == probe_value && ran.get() => {
            tx.commit().await.expect("commit the probe");
            check_state(store, effects, key, verdict, "after the probe").await;
            return;
        }
        (probed, recorded) => verdict.violations.push(format!(
            "the probe of {key} got {probed:?} (body ran: {}) where the record is {recorded:?}",
            ran.get()
        )),
    }
    let _ = tx.rollback().await;
}

/// How often the probe is tried when the store fails it.
const PROBE_TRIES: u32 = 5;

/// Checks that `key` has no effect and no record, or one effect and one completed record of its
/// value; returns the recorded value (`None`: nothing committed), or `None` after a violation.
async fn check_state<D: Backend>(
    store: &SqlStore<D>,
    effects: &str,
    key: &str,
    verdict: &mut Verdict,
    when: &str,
) -> Option<Option<i64>> {
    let effects = D::effects(store, effects, key).await;
    let rows = D::rows(store, &format!("{SCOPE}:{key}")).await;
    let record = match rows.as_slice() {
        [] => None,
        [(state, Some(outcome))] if state == "completed" => {
            let parsed = serde_json::from_str::<serde_json::Value>(outcome).ok();
            parsed.and_then(|v| v.get("Ok").and_then(serde_json::Value::as_i64))
        }
        other => {
            verdict.violations.push(format!("{when}: {key} has the committed rows {other:?}"));
            return None;
        }
    };
    match (effects.as_slice(), record) {
        ([], None) => Some(None),
        ([effect], Some(value)) if *effect == value => Some(Some(value)),
        (effects, record) => {
            verdict.violations.push(format!(
                "{when}: {key} has the committed effects {effects:?} and the record {record:?} (the body's effect and its record must commit together, once)"
            ));
            None
        }
    }
}
