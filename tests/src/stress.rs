//! The stress harness: many keys, many concurrent duplicate callers per key, random delays and
//! random body failures, against any [`Store`]; then a check of every key and every caller.
//!
//! Each caller runs one idempotent call through [`Call`]. Its body waits a random time, then does
//! one of: succeed, fail with a transient error (released, so a retry runs again), fail with a
//! final error (recorded and replayed), panic, or hang until its caller drops it (cancellation).
//! A body's **side effect** is a commit in the [`Ledger`], outside the store: it happens only on
//! success or on a final error, the two outcomes that are recorded.
//!
//! After all callers have finished, every key is called once more without faults, and the run
//! counts:
//!
//! - **double executions**: commits beyond the first, per key (must be 0);
//! - **lost records**: keys whose completion the store acknowledged but that did not replay
//!   (must be 0);
//! - **stuck keys**: keys still in progress after every caller finished and the settle time passed
//!   (must be 0);
//! - **wrong results**: callers that got a value other than the one recorded, or an error that is
//!   neither their own body's nor a typed [`Error`] (must be 0);
//! - **overlapping bodies**: a body started while another body of the same key was running (must
//!   be 0).
//!
//! The sizes come from the environment so the same test runs short in CI and long on demand:
//! `IDEMPOTENT_STRESS_KEYS`, `IDEMPOTENT_STRESS_CALLERS` and `IDEMPOTENT_STRESS_SEED`.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use idempotent_runtime::{
    Call, Claim, ClaimRequest, Detached, Error, Key, OnCancel, RecordErrorsIf, Store, StoreError, Token,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{Semaphore, oneshot};

/// The sizes and rates of one stress run.
#[derive(Debug, Clone)]
pub struct StressConfig {
    /// How many distinct keys.
    pub keys: usize,
    /// How many concurrent duplicate callers per key.
    pub callers: usize,
    /// How many keys are being called at once (each with all its callers).
    pub keys_in_flight: usize,
    /// The seed of every random choice (failure kinds, delays).
    pub seed: u64,
    /// The claims' lease.
    pub lease: Duration,
    /// How long records are kept.
    pub retention: Duration,
    /// Per mille of bodies that fail with a transient (released) error.
    pub transient_per_mille: u64,
    /// Per mille of bodies that fail with a final (recorded) error.
    pub final_per_mille: u64,
    /// Per mille of bodies that panic.
    pub panic_per_mille: u64,
    /// Per mille of bodies that hang until their caller drops them.
    pub cancel_per_mille: u64,
    /// The longest random delay inside a body, and before a caller starts.
    pub max_delay: Duration,
    /// How long the final check waits for a key to leave the in-progress state (detached releases
    /// still on their way, or, after faults, leases that must run out) or for the store to answer.
    pub settle: Duration,
    /// A pause between starting one key and the next, to spread a run over time (for fault runs).
    pub key_interval: Duration,
    /// A timeout each caller puts on its call, as an application would; `None` waits for ever.
    pub call_timeout: Option<Duration>,
}

impl StressConfig {
    /// `keys` keys (or `IDEMPOTENT_STRESS_KEYS`) × 16 callers (or `IDEMPOTENT_STRESS_CALLERS`),
    /// seed from `IDEMPOTENT_STRESS_SEED` or the clock, 2% panics, 2% cancellations, 8% transient
    /// and 3% final errors, delays up to 3 ms.
    #[must_use]
    pub fn from_env(keys: usize) -> Self {
        let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        let seed = var("IDEMPOTENT_STRESS_SEED").unwrap_or_else(|| {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            u64::try_from(nanos.as_nanos() & u128::from(u64::MAX)).unwrap_or(1)
        });
        StressConfig {
            keys: var("IDEMPOTENT_STRESS_KEYS").map_or(keys, |k| usize::try_from(k).unwrap_or(keys)),
            callers: var("IDEMPOTENT_STRESS_CALLERS").map_or(16, |c| usize::try_from(c).unwrap_or(16)),
            keys_in_flight: 32,
            seed,
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(600),
            transient_per_mille: 80,
            final_per_mille: 30,
            panic_per_mille: 20,
            cancel_per_mille: 20,
            max_delay: Duration::from_millis(3),
            settle: Duration::from_secs(5),
            key_interval: Duration::ZERO,
            call_timeout: None,
        }
    }

    /// `true` when `IDEMPOTENT_STRESS_KEYS` asks for a long run.
    #[must_use]
    pub fn long_run_requested() -> bool {
        std::env::var("IDEMPOTENT_STRESS_KEYS").is_ok()
    }
}

/// The value a successful body returns and the store records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// The key's index.
    pub key: u64,
    /// Which body run produced it (unique in the whole test process).
    pub run: u64,
}

/// The error type of the stressed function.
#[derive(Debug, Serialize, Deserialize)]
pub enum StressError {
    /// An idempotency error: typed, never recorded.
    #[serde(skip)]
    Idempotency(Error),
    /// A failure a retry may fix (released): the run's id.
    Transient(u64),
    /// A final failure (recorded and replayed): the run's id.
    Final(u64),
}

impl From<Error> for StressError {
    fn from(error: Error) -> Self {
        StressError::Idempotency(error)
    }
}

/// The side effects of the bodies, counted outside any store.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Per key: the ids of the runs that committed.
    commits: Mutex<HashMap<u64, Vec<u64>>>,
    /// Per key: when each run committed.
    commit_times: Mutex<HashMap<u64, Vec<Instant>>>,
    /// Per key: how many bodies are running now.
    running: Mutex<HashMap<u64, u32>>,
    overlaps: AtomicU64,
}

impl Ledger {
    fn enter(&self, key: u64) {
        let mut running = self.running.lock().unwrap();
        let count = running.entry(key).or_default();
        if *count > 0 {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        *count += 1;
    }

    fn leave(&self, key: u64) {
        *self.running.lock().unwrap().entry(key).or_default() -= 1;
    }

    fn commit(&self, key: u64, run: u64) {
        self.commits.lock().unwrap().entry(key).or_default().push(run);
        self.commit_times.lock().unwrap().entry(key).or_default().push(Instant::now());
    }

    fn commits_after(&self, key: u64, moment: Instant) -> u64 {
        self.commit_times.lock().unwrap().get(&key).map_or(0, |t| t.iter().filter(|&&c| c > moment).count() as u64)
    }

    fn commits(&self, key: u64) -> Vec<u64> {
        self.commits.lock().unwrap().get(&key).cloned().unwrap_or_default()
    }
}

/// A [`Store`] that forwards every call to the real store and counts what happened; it records
/// which keys the store acknowledged as completed, to find lost records later.
#[derive(Debug)]
pub struct Counted<S> {
    inner: S,
    /// Operations and failures, by kind.
    pub ops: OpCounts,
    completed: Mutex<HashMap<String, Instant>>,
}

/// Store operations seen by [`Counted`].
#[derive(Debug, Default)]
pub struct OpCounts {
    /// `claim` calls.
    pub claims: AtomicU64,
    /// `complete` calls.
    pub completes: AtomicU64,
    /// `release` calls.
    pub releases: AtomicU64,
    /// Releases handed to `detach` (a panic, a cancellation, a drop while claiming).
    pub detached_releases: AtomicU64,
    /// Completions handed to `detach` (a drop while recording).
    pub detached_completions: AtomicU64,
    /// `extend` calls (lease renewals).
    pub extends: AtomicU64,
    /// Operations that failed with a backend or corruption error.
    pub backend_errors: AtomicU64,
    /// `complete` calls that failed with a backend error (a body ran; unless a retry records its
    /// result, the store does not hold it).
    pub failed_completions: AtomicU64,
    /// `complete`/`release` calls refused with `NotOwner`.
    pub not_owner: AtomicU64,
}

impl<S: Store> Counted<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Counted { inner, ops: OpCounts::default(), completed: Mutex::new(HashMap::new()) }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn was_completed(&self, key: &Key) -> bool {
        self.completed.lock().unwrap().contains_key(key.as_str())
    }

    /// When the store first acknowledged a completion of `key`.
    fn acknowledged_at(&self, key: &Key) -> Option<Instant> {
        self.completed.lock().unwrap().get(key.as_str()).copied()
    }

    fn count<T>(&self, result: &Result<T, StoreError>) {
        match result {
            Err(StoreError::NotOwner) => {
                self.ops.not_owner.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.ops.backend_errors.fetch_add(1, Ordering::Relaxed);
            }
            Ok(_) => {}
        }
    }
}

impl<S: Store> Store for Counted<S> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.ops.claims.fetch_add(1, Ordering::Relaxed);
        let result = self.inner.claim(request).await;
        self.count(&result);
        result
    }

    async fn complete(&self, key: &Key, token: &Token, outcome: &[u8], retention: Duration) -> Result<(), StoreError> {
        self.ops.completes.fetch_add(1, Ordering::Relaxed);
        let result = self.inner.complete(key, token, outcome, retention).await;
        self.count(&result);
        match &result {
            Ok(()) => {
                self.completed.lock().unwrap().entry(key.as_str().to_owned()).or_insert_with(Instant::now);
            }
            Err(StoreError::NotOwner) => {}
            Err(_) => {
                self.ops.failed_completions.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        self.ops.releases.fetch_add(1, Ordering::Relaxed);
        let result = self.inner.release(key, token).await;
        self.count(&result);
        result
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        self.ops.extends.fetch_add(1, Ordering::Relaxed);
        let result = self.inner.extend(key, token, lease).await;
        self.count(&result);
        result
    }

    fn detach(&self, step: Detached) {
        let counter = match &step {
            Detached::Release { .. } => &self.ops.detached_releases,
            _ => &self.ops.detached_completions,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.inner.detach(step);
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.inner.purge_expired().await
    }

    fn max_record_bytes(&self) -> usize {
        self.inner.max_record_bytes()
    }
}

/// What a stress run observed.
#[derive(Debug, Default, Clone)]
pub struct StressReport {
    /// The store's name.
    pub store: String,
    /// The seed, to rerun the same choices.
    pub seed: u64,
    /// Keys.
    pub keys: usize,
    /// Callers per key.
    pub callers: usize,
    /// Calls made by the callers (keys × callers), plus the final check's calls.
    pub calls: u64,
    /// Store operations (claims + completes + releases).
    pub store_ops: u64,
    /// Store operations that failed with a backend error.
    pub store_errors: u64,
    /// Bodies that ran (to any end).
    pub bodies: u64,
    /// Bodies that succeeded.
    pub ok_bodies: u64,
    /// Injected faults, by kind.
    pub injected_transient: u64,
    /// Final (recorded) errors injected.
    pub injected_final: u64,
    /// Panics injected.
    pub injected_panics: u64,
    /// Cancellations injected.
    pub injected_cancels: u64,
    /// Callers that got a replayed result (value or recorded error) without running the body.
    pub replays: u64,
    /// Callers refused with `InProgress`.
    pub in_progress: u64,
    /// Callers that got `Error::Store` (a typed store failure).
    pub store_failures: u64,
    /// Callers that got `Error::LeaseLost`.
    pub lease_lost: u64,
    /// Callers whose own timeout ([`StressConfig::call_timeout`]) ran out.
    pub timed_out: u64,
    /// Of those, callers whose body had started (so its result may be unrecorded).
    pub timed_out_after_body: u64,
    /// `complete` calls that failed with a backend error (retried or not).
    pub failed_completions: u64,
    /// Commits beyond the first, per key.
    pub double_executions: u64,
    /// Keys the store acknowledged as completed that did not replay.
    pub lost_records: u64,
    /// Body runs that committed after the store had acknowledged a completion of their key
    /// (double executions among calls that saw their record acknowledged; part of
    /// `double_executions`).
    pub runs_after_acknowledged: u64,
    /// Keys still in progress at the end.
    pub stuck_keys: u64,
    /// Callers that got something other than the recorded result or a typed error.
    pub wrong_results: u64,
    /// Bodies that started while another body of the same key ran.
    pub overlapping_bodies: u64,
    /// Keys whose first commit happened only in the final check (every caller failed or was refused).
    pub completed_by_check: u64,
    /// Examples of what went wrong (at most 10).
    pub problems: Vec<String>,
    /// The longest any caller waited for its call.
    pub slowest_call: Duration,
    /// Wall time of the callers' phase.
    pub elapsed: Duration,
}

impl fmt::Display for StressReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        #[allow(clippy::cast_precision_loss)]
        let rate = (self.keys * self.callers) as f64 / secs;
        writeln!(
            f,
            "STRESS {}: {} keys x {} callers = {} calls ({} store ops, {} store errors) in {:.1} s ({rate:.0} calls/s), seed {}",
            self.store, self.keys, self.callers, self.calls, self.store_ops, self.store_errors, secs, self.seed
        )?;
        writeln!(
            f,
            "  slowest call {} ms; bodies run {} (ok {}); injected: transient {}, final {}, panics {}, cancellations {}",
            self.slowest_call.as_millis(),
            self.bodies,
            self.ok_bodies,
            self.injected_transient,
            self.injected_final,
            self.injected_panics,
            self.injected_cancels
        )?;
        writeln!(
            f,
            "  callers: replayed {}, in-progress {}, store errors {}, lease lost {}, timed out {} ({} after their body started); keys first completed by the check {}",
            self.replays,
            self.in_progress,
            self.store_failures,
            self.lease_lost,
            self.timed_out,
            self.timed_out_after_body,
            self.completed_by_check
        )?;
        write!(
            f,
            "  double executions {} ({} after an acknowledged record), lost records {}, stuck keys {}, wrong results {}, overlapping bodies {}, failed completion attempts {}",
            self.double_executions,
            self.runs_after_acknowledged,
            self.lost_records,
            self.stuck_keys,
            self.wrong_results,
            self.overlapping_bodies,
            self.failed_completions
        )?;
        for problem in &self.problems {
            write!(f, "\n  PROBLEM: {problem}")?;
        }
        Ok(())
    }
}

impl StressReport {
    /// Panics with the report unless there were no double executions, lost records, stuck keys,
    /// wrong results or overlapping bodies.
    pub fn assert_clean(&self) {
        assert!(
            self.double_executions == 0
                && self.lost_records == 0
                && self.stuck_keys == 0
                && self.wrong_results == 0
                && self.overlapping_bodies == 0,
            "the stress run broke exactly-once:\n{self}"
        );
    }

    fn problem(&mut self, text: String) {
        if self.problems.len() < 10 {
            self.problems.push(text);
        }
    }
}

/// A small, seedable generator (`SplitMix64`), so a run's choices can be replayed from its seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` mixed with `stream`.
    #[must_use]
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut rng = Rng(seed ^ stream.wrapping_mul(0xA24B_AED4_963E_E407));
        rng.next_u64();
        rng
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// A duration in `0..=max`, in microseconds.
    pub fn delay(&mut self, max: Duration) -> Duration {
        let micros = u64::try_from(max.as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(self.below(micros.saturating_add(1)))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    Succeed,
    Transient,
    Final,
    Panic,
    Cancel,
}

const PANIC_MESSAGE: &str = "stress: injected panic";

/// Silences the panics this harness injects on purpose; other panics print as usual.
fn quiet_injected_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let injected = info.payload().downcast_ref::<&str>().is_some_and(|m| *m == PANIC_MESSAGE);
            if !injected {
                previous(info);
            }
        }));
    });
}

static NEXT_RUN: AtomicU64 = AtomicU64::new(1);

/// What one caller saw.
#[derive(Debug)]
enum Seen {
    Returned { ran: bool, result: Result<Receipt, StressError> },
    Panicked,
    Cancelled,
    TimedOut { ran: bool },
}

#[derive(Debug, Default)]
struct Injected {
    bodies: AtomicU64,
    ok: AtomicU64,
    transient: AtomicU64,
    final_: AtomicU64,
    panics: AtomicU64,
    cancels: AtomicU64,
}

struct Shared<S> {
    store: Counted<S>,
    /// The longest a caller waited for its call, in microseconds.
    slowest_micros: AtomicU64,
    ledger: Ledger,
    injected: Injected,
    scope: String,
    config: StressConfig,
}

fn is_final(error: &StressError) -> bool {
    matches!(error, StressError::Final(_))
}

/// The body: waits, then does what `plan` says. Its side effect is the ledger commit.
async fn body<S>(
    shared: &Shared<S>,
    key: u64,
    plan: Plan,
    delay: Duration,
    cancel: Option<oneshot::Sender<()>>,
) -> Result<Receipt, StressError> {
    let run = NEXT_RUN.fetch_add(1, Ordering::Relaxed);
    shared.injected.bodies.fetch_add(1, Ordering::Relaxed);
    shared.ledger.enter(key);
    if delay > Duration::ZERO {
        tokio::time::sleep(delay).await;
    } else {
        tokio::task::yield_now().await;
    }
    // Each failure leaves the "running" set before it happens: what runs after it is not an overlap.
    match plan {
        Plan::Succeed => {
            shared.ledger.commit(key, run);
            shared.ledger.leave(key);
            shared.injected.ok.fetch_add(1, Ordering::Relaxed);
            Ok(Receipt { key, run })
        }
        Plan::Final => {
            shared.ledger.commit(key, run);
            shared.ledger.leave(key);
            shared.injected.final_.fetch_add(1, Ordering::Relaxed);
            Err(StressError::Final(run))
        }
        Plan::Transient => {
            shared.ledger.leave(key);
            shared.injected.transient.fetch_add(1, Ordering::Relaxed);
            Err(StressError::Transient(run))
        }
        Plan::Panic => {
            shared.ledger.leave(key);
            shared.injected.panics.fetch_add(1, Ordering::Relaxed);
            std::panic::panic_any(PANIC_MESSAGE);
        }
        Plan::Cancel => {
            shared.ledger.leave(key);
            shared.injected.cancels.fetch_add(1, Ordering::Relaxed);
            if let Some(cancel) = cancel {
                let _ = cancel.send(());
            }
            std::future::pending().await
        }
    }
}

fn plan_for(config: &StressConfig, rng: &mut Rng) -> Plan {
    let roll = rng.below(1000);
    let mut edge = config.transient_per_mille;
    if roll < edge {
        return Plan::Transient;
    }
    edge += config.final_per_mille;
    if roll < edge {
        return Plan::Final;
    }
    edge += config.panic_per_mille;
    if roll < edge {
        return Plan::Panic;
    }
    edge += config.cancel_per_mille;
    if roll < edge {
        return Plan::Cancel;
    }
    Plan::Succeed
}

fn call_for<S>(shared: &Shared<S>, key: u64, wait: bool) -> Call {
    // A cancelled caller releases its claim (the harness's cancellations are retried at once).
    let call = Call::new(&shared.scope, &key)
        .on_cancel(OnCancel::Release)
        .fingerprint(&("stress", key))
        .lease(shared.config.lease)
        .retention(shared.config.retention);
    if wait { call.wait(Duration::from_secs(10)) } else { call }
}

/// One duplicate caller.
async fn caller<S: Store + 'static>(shared: Arc<Shared<S>>, key: u64, index: usize) -> Seen {
    let mut rng = Rng::new(shared.config.seed, key.wrapping_mul(1 << 20) ^ index as u64);
    let plan = plan_for(&shared.config, &mut rng);
    let start = rng.delay(shared.config.max_delay);
    let delay = rng.delay(shared.config.max_delay);
    let wait = index.is_multiple_of(2);
    if start > Duration::ZERO {
        tokio::time::sleep(start).await;
    }
    let (cancel_tx, cancel_rx) = oneshot::channel();
    let began = Instant::now();
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let task = {
        let (shared, ran) = (Arc::clone(&shared), Arc::clone(&ran));
        tokio::spawn(async move {
            let call = call_for(&shared, key, wait);
            let inner = Arc::clone(&shared);
            let run = call.run_with(&shared.store, RecordErrorsIf(is_final), async move {
                ran.store(true, Ordering::SeqCst);
                body(&inner, key, plan, delay, Some(cancel_tx)).await
            });
            let timeout = async {
                match shared.config.call_timeout {
                    Some(limit) => tokio::time::sleep(limit).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                result = run => Some(Some(result)),
                Ok(()) = cancel_rx => Some(None),
                () = timeout => None,
            }
        })
    };
    let outcome = task.await;
    let micros = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
    shared.slowest_micros.fetch_max(micros, Ordering::Relaxed);
    match outcome {
        Ok(Some(Some(result))) => Seen::Returned { ran: ran.load(Ordering::SeqCst), result },
        Ok(Some(None)) => Seen::Cancelled,
        Ok(None) => Seen::TimedOut { ran: ran.load(Ordering::SeqCst) },
        Err(e) if e.is_panic() => Seen::Panicked,
        Err(e) => panic!("a caller task failed: {e}"),
    }
}

/// Runs the stress test on `store`, concurrently with `faults` (which injects faults of its own,
/// returns how many, and must end by itself), then checks every key.
pub async fn run_with_faults<S, F>(name: &str, store: S, config: StressConfig, faults: F) -> (StressReport, u64)
where
    S: Store + 'static,
    F: Future<Output = u64> + Send + 'static,
{
    quiet_injected_panics();
    let scope = format!("stress-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let shared = Arc::new(Shared {
        store: Counted::new(store),
        slowest_micros: AtomicU64::new(0),
        ledger: Ledger::default(),
        injected: Injected::default(),
        scope,
        config: config.clone(),
    });
    let started = Instant::now();
    let faults = tokio::spawn(faults);
    let permits = Arc::new(Semaphore::new(config.keys_in_flight.max(1)));
    let mut keys = Vec::with_capacity(config.keys);
    for key in 0..config.keys as u64 {
        if config.key_interval > Duration::ZERO && key > 0 {
            tokio::time::sleep(config.key_interval).await;
        }
        let permit = Arc::clone(&permits).acquire_owned().await.expect("semaphore");
        let shared = Arc::clone(&shared);
        keys.push(tokio::spawn(async move {
            let callers: Vec<_> =
                (0..shared.config.callers).map(|i| tokio::spawn(caller(Arc::clone(&shared), key, i))).collect();
            let mut seen = Vec::with_capacity(callers.len());
            for c in callers {
                seen.push(c.await.expect("caller"));
            }
            drop(permit);
            seen
        }));
    }
    let mut seen_per_key = Vec::with_capacity(config.keys);
    for k in keys {
        seen_per_key.push(k.await.expect("key task"));
    }
    let elapsed = started.elapsed();
    let faults_injected = faults.await.expect("the fault injector panicked");

    let mut report = StressReport {
        store: name.to_owned(),
        seed: config.seed,
        keys: config.keys,
        callers: config.callers,
        elapsed,
        ..StressReport::default()
    };
    check(&shared, &seen_per_key, &mut report).await;
    (report, faults_injected)
}

/// Runs the stress test on `store` without outside faults.
pub async fn run<S: Store + 'static>(name: &str, store: S, config: StressConfig) -> StressReport {
    run_with_faults(name, store, config, async { 0 }).await.0
}

async fn check<S: Store + 'static>(shared: &Arc<Shared<S>>, seen_per_key: &[Vec<Seen>], report: &mut StressReport) {
    // 1. Every caller's result.
    for (key, seen) in seen_per_key.iter().enumerate() {
        let key = key as u64;
        let commits = shared.ledger.commits(key);
        let recorded = commits.first().copied();
        for s in seen {
            report.calls += 1;
            let verdict = match s {
                Seen::Panicked | Seen::Cancelled => Ok(()),
                Seen::TimedOut { ran } => {
                    report.timed_out += 1;
                    report.timed_out_after_body += u64::from(*ran);
                    Ok(())
                }
                Seen::Returned { ran, result } => judge(*ran, result, key, recorded, report),
            };
            if let Err(problem) = verdict {
                report.wrong_results += 1;
                report.problem(format!("key {key}: {problem}"));
            }
        }
    }

    // 2. Every key, once more: it must replay its one record, or (if nobody committed) run once.
    let settle_until = Instant::now() + shared.config.settle;
    for key in 0..seen_per_key.len() as u64 {
        let before = shared.ledger.commits(key);
        // Whether the store acknowledged a completion of this key before the check's own call.
        let completed = shared.store.was_completed(&Key::new(&shared.scope, &key).expect("key"));
        loop {
            report.calls += 1;
            let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let call = call_for(shared, key, false);
            let inner = Arc::clone(shared);
            let flag = Arc::clone(&ran);
            let result = call
                .run_with(&shared.store, RecordErrorsIf(is_final), async move {
                    flag.store(true, Ordering::SeqCst);
                    body(&inner, key, Plan::Succeed, Duration::ZERO, None).await
                })
                .await;
            let ran = ran.load(Ordering::SeqCst);
            let retry =
                matches!(&result, Err(StressError::Idempotency(Error::InProgress { .. } | Error::Store { .. })));
            if retry && Instant::now() < settle_until {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            match (&result, ran, before.first()) {
                (Err(StressError::Idempotency(e)), _, _) => {
                    report.stuck_keys += 1;
                    report.problem(format!("key {key} is not usable after the run: {e}"));
                }
                (_, true, Some(first)) => {
                    if completed {
                        report.lost_records += 1;
                        report.problem(format!("key {key}: its record (run {first}) was acknowledged but is gone"));
                    } else {
                        report.problem(format!(
                            "key {key}: run {first} committed but its result was never recorded; it ran again"
                        ));
                    }
                }
                (_, true, None) => report.completed_by_check += 1,
                (
                    Ok(Receipt { run, .. }) | Err(StressError::Final(run) | StressError::Transient(run)),
                    false,
                    first,
                ) => {
                    if first != Some(run) {
                        report.wrong_results += 1;
                        report.problem(format!("key {key}: the check replayed run {run}, the ledger says {first:?}"));
                    }
                }
            }
            break;
        }
        let commits = shared.ledger.commits(key);
        if let Some(acknowledged) = shared.store.acknowledged_at(&Key::new(&shared.scope, &key).expect("key")) {
            report.runs_after_acknowledged += shared.ledger.commits_after(key, acknowledged);
        }
        report.double_executions += commits.len().saturating_sub(1) as u64;
        if commits.len() > 1 {
            report.problem(format!("key {key} committed {} times: runs {commits:?}", commits.len()));
        }
    }

    let ops = &shared.store.ops;
    report.store_ops = ops.claims.load(Ordering::Relaxed)
        + ops.completes.load(Ordering::Relaxed)
        + ops.releases.load(Ordering::Relaxed)
        + ops.detached_releases.load(Ordering::Relaxed);
    report.store_errors = ops.backend_errors.load(Ordering::Relaxed);
    report.failed_completions = ops.failed_completions.load(Ordering::Relaxed);
    let injected = &shared.injected;
    report.bodies = injected.bodies.load(Ordering::Relaxed);
    report.ok_bodies = injected.ok.load(Ordering::Relaxed);
    report.injected_transient = injected.transient.load(Ordering::Relaxed);
    report.injected_final = injected.final_.load(Ordering::Relaxed);
    report.injected_panics = injected.panics.load(Ordering::Relaxed);
    report.injected_cancels = injected.cancels.load(Ordering::Relaxed);
    report.overlapping_bodies = shared.ledger.overlaps.load(Ordering::SeqCst);
    report.slowest_call = Duration::from_micros(shared.slowest_micros.load(Ordering::Relaxed));
}

/// Checks one caller's result against the key's recorded run.
fn judge(
    ran: bool,
    result: &Result<Receipt, StressError>,
    key: u64,
    recorded: Option<u64>,
    report: &mut StressReport,
) -> Result<(), String> {
    match result {
        Ok(receipt) => {
            if !ran {
                report.replays += 1;
            }
            if receipt.key != key {
                return Err(format!("got the receipt of key {}", receipt.key));
            }
            if Some(receipt.run) != recorded {
                return Err(format!("got run {} but the recorded run is {recorded:?}", receipt.run));
            }
            Ok(())
        }
        Err(StressError::Final(run)) => {
            if !ran {
                report.replays += 1;
            }
            if Some(*run) == recorded {
                Ok(())
            } else {
                Err(format!("got final error of run {run}, recorded {recorded:?}"))
            }
        }
        Err(StressError::Transient(_)) if ran => Ok(()),
        Err(StressError::Transient(run)) => Err(format!("got transient error of run {run} without running")),
        Err(StressError::Idempotency(error)) => match error {
            Error::InProgress { .. } => {
                report.in_progress += 1;
                Ok(())
            }
            Error::Store { .. } => {
                report.store_failures += 1;
                Ok(())
            }
            Error::LeaseLost { .. } => {
                report.lease_lost += 1;
                Ok(())
            }
            other => Err(format!("unexpected error: {other}")),
        },
    }
}
