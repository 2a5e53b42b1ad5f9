//! What a call reports about itself: a `tracing` span per call and, with the feature `metrics`,
//! a counter of calls and a histogram of store-step latencies on the [`metrics`] facade.
//!
//! # The span
//!
//! Every call (the attribute, the HTTP layer, a hand-written [`Call`](crate::Call)) runs inside one
//! `info`-level span named `idempotent` (target `idempotent`), so it shows up as one unit in a trace,
//! next to (and inside) a `#[tracing::instrument]` span of the function. Its fields:
//!
//! | field | value |
//! |---|---|
//! | `scope` | the key's scope, e.g. `"payments"` |
//! | `key` | the raw key, **only** if the call opted in with [`Call::trace_key`](crate::Call::trace_key); absent otherwise, because keys can be secrets |
//! | `outcome` | one of [`Outcome`]'s names, recorded when the call ends |
//! | `elapsed_us` | the whole call's duration in microseconds, recorded when it ends |
//! | `steps_executed`, `steps_replayed` | how many [`step`](crate::step)s of this run of the body ran and were recorded, or were replayed from an earlier run (recorded when the call ends, if it had steps) |
//!
//! The library's events (`executed`, `replayed`, store failures, ...) are emitted inside the span
//! and never carry the key themselves.
//!
//! # Metrics (feature `metrics`)
//!
//! Install any `metrics` recorder (Prometheus, OpenTelemetry, ...). Without one nothing is
//! recorded, but the feature still costs each call what it costs with one, short of the
//! recorder's own work: a clock reading per store step (two for a step the call did not time
//! already), and the lookups of the metrics' keys. Counted with callgrind on the memory store
//! (`cargo bench -p idempotent-runtime --bench instructions`, with and without `--features
//! metrics`): about 460 instructions more per replay (2,334 to 2,350 against 1,876 to 1,881) and
//! about 720 more per first execution (4,441 to 4,443 against 3,712 to 3,726), and one and two
//! more clock readings. Beside a Redis call, whose client alone counts 21,897 instructions for a
//! replay and 40,954 for a first execution (BENCHMARKS.md), that is about 2 %. Turn the feature
//! on where a recorder will listen.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `idempotent_calls_total` | counter | `scope`, `outcome` ([`Outcome::as_str`]) |
//! | `idempotent_store_step_seconds` | histogram | `store` ([`Store::name`], e.g. `redis`), `step` (`claim`, `complete`, `release`, `extend`) |
//! | `idempotent_cache_lookups_total` | counter | `result` (`hit`, `miss`): [`CachedStore`](crate::stores::cache::CachedStore) only |
//! | `idempotent_steps_total` | counter | `result` (`executed`: the step ran and was recorded; `replayed`: an earlier run's record was returned) |
//! | `idempotent_batch_steps` | histogram | `store` (the store behind it): the claims and completions of each batch a [`BatchingStore`](crate::stores::batching::BatchingStore) sent, one sample per batch |
//!
//! A step's latency is recorded whether the step succeeded or failed.
//!
//! ```
//! # #[cfg(feature = "metrics")] {
//! use idempotent_runtime::{Call, Error, MemoryStore};
//! use metrics_util::debugging::{DebugValue, DebuggingRecorder};
//!
//! let recorder = DebuggingRecorder::new();
//! let snapshotter = recorder.snapshotter();
//! metrics::with_local_recorder(&recorder, || {
//!     let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
//!     runtime.block_on(async {
//!         let store = MemoryStore::new();
//!         for _ in 0..2 {
//!             Call::new("payments", "req-1").run(&store, async { Ok::<_, Error>(1) }).await.unwrap();
//!         }
//!     });
//! });
//! let calls: Vec<_> = snapshotter
//!     .snapshot()
//!     .into_vec()
//!     .into_iter()
//!     .filter(|(key, ..)| key.key().name() == "idempotent_calls_total")
//!     .map(|(key, _, _, value)| (key.key().labels().map(|l| l.value().to_owned()).collect::<Vec<_>>(), value))
//!     .collect();
//! assert!(calls.contains(&(vec!["payments".into(), "executed".into()], DebugValue::Counter(1))));
//! assert!(calls.contains(&(vec!["payments".into(), "replayed".into()], DebugValue::Counter(1))));
//! # }
//! ```

use std::future::Future;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};

use tokio::time::Instant;
use tracing::Span;
use tracing::field::Empty;

use crate::{Key, Store};

/// How a call ended, as the span's `outcome` field and the `outcome` label of
/// `idempotent_calls_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The body ran and its result (an `Ok`, or an `Err` the error policy records) was recorded.
    Executed,
    /// A recorded result was returned; the body did not run.
    Replayed,
    /// Another call with the key was running (after waiting, if `wait` was set); the body did not run.
    InProgress,
    /// The key was used with a different request; the body did not run.
    FingerprintMismatch,
    /// The body returned an `Err` that is not recorded, so the key was released for a retry.
    Released,
    /// The body ran, but its lease had ended and another caller took the key over: not recorded.
    LeaseLost,
    /// The store failed: at the claim (the body did not run), or while recording for the whole
    /// lease (the body ran, its result was returned but not recorded).
    StoreError,
    /// The body ran but its result was too large or not serialisable, so replays get
    /// [`Error::Unrecordable`](crate::Error::Unrecordable); also such a replay.
    Unrecordable,
    /// The caller's future was dropped, or the body panicked, before the call finished (what then
    /// happens to the claim is the cancellation policy's: see [`OnCancel`](crate::OnCancel)).
    Cancelled,
    /// The key, the fingerprint, a duration or the scope was invalid, or a recorded result could
    /// not be decoded; the body did not run.
    Invalid,
}

impl Outcome {
    const ALL: [Outcome; 10] = [
        Outcome::Executed,
        Outcome::Replayed,
        Outcome::InProgress,
        Outcome::FingerprintMismatch,
        Outcome::Released,
        Outcome::LeaseLost,
        Outcome::StoreError,
        Outcome::Unrecordable,
        Outcome::Cancelled,
        Outcome::Invalid,
    ];

    /// The name used in spans and metrics: `executed`, `replayed`, `in_progress`,
    /// `fingerprint_mismatch`, `released`, `lease_lost`, `store_error`, `unrecordable`,
    /// `cancelled`, `invalid`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::Replayed => "replayed",
            Outcome::InProgress => "in_progress",
            Outcome::FingerprintMismatch => "fingerprint_mismatch",
            Outcome::Released => "released",
            Outcome::LeaseLost => "lease_lost",
            Outcome::StoreError => "store_error",
            Outcome::Unrecordable => "unrecordable",
            Outcome::Cancelled => "cancelled",
            Outcome::Invalid => "invalid",
        }
    }

    /// The outcome for an idempotency error that ends a call.
    pub(crate) fn of_error(error: &crate::Error) -> Self {
        match error {
            crate::Error::InProgress { .. } => Outcome::InProgress,
            crate::Error::FingerprintMismatch { .. } => Outcome::FingerprintMismatch,
            crate::Error::LeaseLost { .. } => Outcome::LeaseLost,
            crate::Error::Store { .. } => Outcome::StoreError,
            crate::Error::Unrecordable { .. } => Outcome::Unrecordable,
            _ => Outcome::Invalid,
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

const UNSET: u8 = u8::MAX;

/// Watches one call: owns its span, learns its outcome from the protocol's hooks, and reports
/// when dropped (so a cancelled call is reported too).
pub(crate) struct CallObserver {
    span: Span,
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    scope: Option<ScopeLabel>,
    started: Option<Instant>,
    outcome: AtomicU8,
    steps_executed: AtomicU32,
    steps_replayed: AtomicU32,
}

impl CallObserver {
    /// Starts watching a call in `scope` (`None` when the key was invalid before a scope was known).
    pub(crate) fn start(key: Option<&Key>, trace_key: bool) -> Self {
        // The scope is read only when the span is enabled (field values are evaluated then) or
        // metrics are recorded.
        let span = tracing::info_span!(target: "idempotent", "idempotent", scope = key.map(Key::scope), key = Empty, outcome = Empty, elapsed_us = Empty, steps_executed = Empty, steps_replayed = Empty);
        if trace_key && let Some(key) = key {
            span.record("key", key.key());
        }
        // Timing costs two clock reads, and only the span shows the time (no metric does): only
        // when a subscriber listens to the span.
        let listening = !span.is_disabled();
        CallObserver {
            span,
            scope: key.filter(|_| cfg!(feature = "metrics")).map(ScopeLabel::of),
            started: listening.then(Instant::now),
            outcome: AtomicU8::new(UNSET),
            steps_executed: AtomicU32::new(0),
            steps_replayed: AtomicU32::new(0),
        }
    }

    /// The call's span, to run the call in.
    pub(crate) fn span(&self) -> &Span {
        &self.span
    }

    /// Notes how the call ended; the first note wins.
    ///
    /// Only the call's own future notes outcomes (its protocol and the steps it serves), one
    /// poll at a time, so a load and a store do what a compare-and-swap would, without its
    /// locked instruction.
    pub(crate) fn outcome(&self, outcome: Outcome) {
        let index = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        if self.outcome.load(Ordering::Relaxed) == UNSET {
            #[allow(clippy::cast_possible_truncation)] // ten outcomes
            self.outcome.store(index as u8, Ordering::Relaxed);
        }
    }

    /// Notes a step of the body: run and recorded, or replayed from an earlier run's record.
    pub(crate) fn step(&self, replayed: bool) {
        let (count, result) =
            if replayed { (&self.steps_replayed, "replayed") } else { (&self.steps_executed, "executed") };
        count.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(target: "idempotent", result, "step");
        #[cfg(feature = "metrics")]
        {
            increment(step_key(replayed));
        }
        #[cfg(not(feature = "metrics"))]
        let _ = result;
    }

    /// Notes the outcome of an error that ends the call, and passes it on.
    pub(crate) fn error(&self, error: crate::Error) -> crate::Error {
        self.outcome(Outcome::of_error(&error));
        error
    }
}

impl Drop for CallObserver {
    fn drop(&mut self) {
        let outcome = Outcome::ALL.get(usize::from(self.outcome.load(Ordering::Relaxed))).copied();
        let outcome = outcome.unwrap_or(Outcome::Cancelled);
        self.span.record("outcome", outcome.as_str());
        let (executed, replayed) =
            (self.steps_executed.load(Ordering::Relaxed), self.steps_replayed.load(Ordering::Relaxed));
        if executed + replayed > 0 {
            self.span.record("steps_executed", executed);
            self.span.record("steps_replayed", replayed);
        }
        if let Some(started) = self.started {
            let elapsed = started.elapsed();
            self.span.record("elapsed_us", u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX));
        }
        #[cfg(feature = "metrics")]
        {
            let owned;
            let key = match self.scope.take() {
                Some(ScopeLabel::Interned(keys)) => &keys[outcome as usize],
                // Past the interned scopes, or a key refused before it had a scope (labelled "").
                scope => {
                    let scope = match scope {
                        Some(ScopeLabel::Owned(scope)) => scope,
                        _ => String::new(),
                    };
                    owned = metrics::Key::from_parts(
                        "idempotent_calls_total",
                        vec![
                            metrics::Label::new("scope", scope),
                            metrics::Label::from_static_parts("outcome", outcome.as_str()),
                        ],
                    );
                    &owned
                }
            };
            increment(key);
        }
    }
}

/// A call's scope as its metric label: interned (no allocation per call) or, past the interned
/// ones, its own copy.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
enum ScopeLabel {
    #[cfg(feature = "metrics")]
    Interned(&'static CallKeys),
    Owned(String),
}

impl ScopeLabel {
    #[cfg(feature = "metrics")]
    fn of(key: &Key) -> Self {
        interned(key.scope_bytes()).map_or_else(|| ScopeLabel::Owned(key.scope().to_owned()), ScopeLabel::Interned)
    }

    #[cfg(not(feature = "metrics"))]
    fn of(key: &Key) -> Self {
        ScopeLabel::Owned(key.scope().to_owned())
    }
}

/// The key of `idempotent_steps_total` for a step run or replayed (built, and hashed, at compile
/// time).
#[cfg(feature = "metrics")]
fn step_key(replayed: bool) -> &'static metrics::Key {
    static EXECUTED: [metrics::Label; 1] = [metrics::Label::from_static_parts("result", "executed")];
    static REPLAYED: [metrics::Label; 1] = [metrics::Label::from_static_parts("result", "replayed")];
    static KEYS: [metrics::Key; 2] = [
        metrics::Key::from_static_parts("idempotent_steps_total", &EXECUTED),
        metrics::Key::from_static_parts("idempotent_steps_total", &REPLAYED),
    ];
    &KEYS[usize::from(replayed)]
}

/// Counts a lookup in a [`CachedStore`](crate::stores::cache::CachedStore)'s replay cache in
/// `idempotent_cache_lookups_total` (feature `metrics`).
#[cfg(all(feature = "metrics", feature = "cache"))]
pub(crate) fn cache_lookup(hit: bool) {
    static HIT: [metrics::Label; 1] = [metrics::Label::from_static_parts("result", "hit")];
    static MISS: [metrics::Label; 1] = [metrics::Label::from_static_parts("result", "miss")];
    static KEYS: [metrics::Key; 2] = [
        metrics::Key::from_static_parts("idempotent_cache_lookups_total", &MISS),
        metrics::Key::from_static_parts("idempotent_cache_lookups_total", &HIT),
    ];
    increment(&KEYS[usize::from(hit)]);
}

/// Without the feature `metrics`, nothing.
#[cfg(all(not(feature = "metrics"), feature = "cache"))]
pub(crate) fn cache_lookup(_hit: bool) {}

/// Records in `idempotent_batch_steps` that a [`BatchingStore`](crate::stores::batching::BatchingStore)
/// sent `steps` claims and completions to `store` as one batch (feature `metrics`).
#[cfg(feature = "metrics")]
#[allow(clippy::cast_precision_loss, reason = "a batch holds far fewer than 2^52 steps")]
pub(crate) fn batch_sent(store: &'static str, steps: usize) {
    describe();
    metrics::histogram!("idempotent_batch_steps", "store" => store).record(steps as f64);
}

/// Without the feature `metrics`, nothing.
#[cfg(not(feature = "metrics"))]
pub(crate) fn batch_sent(_store: &'static str, _steps: usize) {}

/// Adds one to the library's counter `key`.
#[cfg(feature = "metrics")]
fn increment(key: &metrics::Key) {
    describe();
    metrics::with_recorder(|recorder| recorder.register_counter(key, metadata())).increment(1);
}

/// The metadata of the library's metrics (target `idempotent`, level info).
#[cfg(feature = "metrics")]
fn metadata() -> &'static metrics::Metadata<'static> {
    static METADATA: metrics::Metadata<'static> =
        metrics::Metadata::new("idempotent", metrics::Level::INFO, Some(module_path!()));
    &METADATA
}

/// The keys of `idempotent_store_step_seconds` for the store named `store`, one per [`StoreStep`],
/// made once per store name ([`leaked_keys`]). Store names are `'static` and few. Each thread
/// remembers the store it timed last, compared by text, not address: one name can come at more
/// than one address (a first HTTP request's claim and completion passed `"memory"` at two, and a
/// comparison by address missed on every step).
#[cfg(feature = "metrics")]
fn latency_keys(store: &'static str) -> &'static [metrics::Key; 4] {
    use std::cell::Cell;
    use std::collections::HashMap;
    use std::sync::{LazyLock, RwLock};
    type Keys = &'static [metrics::Key; 4];
    static STORES: LazyLock<RwLock<HashMap<&'static str, Keys>>> = LazyLock::new(RwLock::default);
    thread_local! {
        static LAST: Cell<Option<(&'static str, Keys)>> = const { Cell::new(None) };
    }
    if let Some((name, keys)) = LAST.get()
        && name == store
    {
        return keys;
    }
    let known = STORES.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(store).copied();
    let keys = known.unwrap_or_else(|| {
        let steps = StoreStep::ALL.map(StoreStep::as_str);
        let keys = leaked_keys("idempotent_store_step_seconds", ("store", store), "step", steps);
        *STORES.write().unwrap_or_else(std::sync::PoisonError::into_inner).entry(store).or_insert(keys)
    });
    LAST.set(Some((store, keys)));
    keys
}

/// The keys of metric `name` labelled `first` and, each, `label` with one of `values`: made and
/// hashed once, and kept for the process's life, so that recording with them allocates and
/// hashes nothing.
#[cfg(feature = "metrics")]
fn leaked_keys<const N: usize>(
    name: &'static str,
    first: (&'static str, &'static str),
    label: &'static str,
    values: [&'static str; N],
) -> &'static [metrics::Key; N] {
    Box::leak(Box::new(values.map(|value| {
        let labels: &'static [metrics::Label; 2] = Box::leak(Box::new([
            metrics::Label::from_static_parts(first.0, first.1),
            metrics::Label::from_static_parts(label, value),
        ]));
        metrics::Key::from_static_parts(name, labels)
    })))
}

/// The keys of `idempotent_calls_total` for one scope, one per [`Outcome`] (in `Outcome::ALL`'s
/// order).
#[cfg(feature = "metrics")]
type CallKeys = [metrics::Key; Outcome::ALL.len()];

/// The keys of `idempotent_calls_total` for `scope`, made once per distinct scope and kept for
/// the process's life (the scope's text leaked with them), for the first
/// [`MAX_INTERNED_SCOPES`] distinct scopes of the process; `None` past them (a program that makes
/// scopes from data), whose calls then allocate their labels when they end. Each thread
/// remembers the last few scopes it saw.
#[cfg(feature = "metrics")]
fn interned(scope: &[u8]) -> Option<&'static CallKeys> {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::sync::{LazyLock, RwLock};
    static SCOPES: LazyLock<RwLock<HashMap<&'static str, &'static CallKeys>>> = LazyLock::new(RwLock::default);
    thread_local! {
        static RECENT: RefCell<Vec<(&'static str, &'static CallKeys)>> = const { RefCell::new(Vec::new()) };
    }
    let recent = RECENT.with_borrow(|recent| recent.iter().find(|(known, _)| known.as_bytes() == scope).copied());
    if let Some((_, keys)) = recent {
        return Some(keys);
    }
    // A scope this thread has not seen lately is checked for UTF-8 (it always is: it came from a `str`).
    let scope = std::str::from_utf8(scope).ok()?;
    let known =
        SCOPES.read().unwrap_or_else(std::sync::PoisonError::into_inner).get_key_value(scope).map(|(s, k)| (*s, *k));
    let known = if let Some(known) = known {
        known
    } else {
        let mut scopes = SCOPES.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((scope, keys)) = scopes.get_key_value(scope) {
            (*scope, *keys)
        } else if scopes.len() >= MAX_INTERNED_SCOPES {
            return None;
        } else {
            let leaked: &'static str = Box::leak(scope.to_owned().into_boxed_str());
            let outcomes = Outcome::ALL.map(Outcome::as_str);
            let keys = leaked_keys("idempotent_calls_total", ("scope", leaked), "outcome", outcomes);
            scopes.insert(leaked, keys);
            (leaked, keys)
        }
    };
    RECENT.with_borrow_mut(|recent| {
        if recent.len() >= RECENT_SCOPES {
            recent.remove(0);
        }
        recent.push(known);
    });
    Some(known.1)
}

/// How many scopes a thread remembers.
#[cfg(feature = "metrics")]
const RECENT_SCOPES: usize = 8;

/// How many distinct scopes get allocation-free metric labels.
#[cfg(feature = "metrics")]
const MAX_INTERNED_SCOPES: usize = 1024;

/// Registers the metrics' descriptions with the recorder, once per process.
#[cfg(feature = "metrics")]
fn describe() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        metrics::describe_counter!("idempotent_calls_total", "Idempotent calls, by scope and outcome.");
        metrics::describe_histogram!(
            "idempotent_store_step_seconds",
            metrics::Unit::Seconds,
            "Latency of each idempotency store step (claim, complete, release, extend), by store."
        );
        metrics::describe_counter!(
            "idempotent_steps_total",
            "Steps of idempotent bodies, by result (executed and recorded, or replayed from an earlier run)."
        );
        metrics::describe_counter!(
            "idempotent_cache_lookups_total",
            "Lookups in a CachedStore's local replay cache, by result (hit, miss)."
        );
        metrics::describe_histogram!(
            "idempotent_batch_steps",
            metrics::Unit::Count,
            "Claims and completions a BatchingStore sent to its store as one batch, by store."
        );
    });
}

/// A store step, as the `step` label of `idempotent_store_step_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreStep {
    Claim,
    Complete,
    Release,
    Extend,
}

impl StoreStep {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    const ALL: [StoreStep; 4] = [StoreStep::Claim, StoreStep::Complete, StoreStep::Release, StoreStep::Extend];

    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            StoreStep::Claim => "claim",
            StoreStep::Complete => "complete",
            StoreStep::Release => "release",
            StoreStep::Extend => "extend",
        }
    }
}

/// Times `step` of `store` into `idempotent_store_step_seconds` (feature `metrics`). The
/// protocol sends every step through it, or through [`timed_since`].
#[cfg(feature = "metrics")]
pub(crate) fn timed<S: Store + ?Sized, F: Future>(
    store: &S,
    step: StoreStep,
    future: F,
) -> impl Future<Output = F::Output> {
    time(store.name(), step, Instant::now(), None, future)
}

/// Without the feature `metrics`, `step` itself (no wrapper future around it).
#[cfg(not(feature = "metrics"))]
pub(crate) fn timed<S: Store + ?Sized, F: Future>(_store: &S, _step: StoreStep, future: F) -> F {
    future
}

/// Like [`timed`], for a step the protocol sent at `sent`, a clock reading it took anyway (a
/// lease is counted from it), and noting in `replied`, if given, the reading taken when the reply
/// came: the clock is read once for the metric, where `timed` reads it twice, and the protocol
/// reads it no more after the reply.
#[cfg(feature = "metrics")]
pub(crate) fn timed_since<'a, S: Store + ?Sized, F: Future + 'a>(
    store: &S,
    step: StoreStep,
    sent: Instant,
    replied: Option<&'a mut Replied>,
    future: F,
) -> impl Future<Output = F::Output> + 'a {
    time(store.name(), step, sent, replied, future)
}

/// What [`timed`] and [`timed_since`] do: awaits `future`, then records the time since `sent`.
#[cfg(feature = "metrics")]
async fn time<F: Future>(
    store: &'static str,
    step: StoreStep,
    sent: Instant,
    replied: Option<&mut Replied>,
    future: F,
) -> F::Output {
    let output = future.await;
    let now = Instant::now();
    if let Some(replied) = replied {
        replied.0 = Some(now);
    }
    let histogram =
        metrics::with_recorder(|recorder| recorder.register_histogram(&latency_keys(store)[step as usize], metadata()));
    histogram.record(now.saturating_duration_since(sent).as_secs_f64());
    output
}

/// Without the feature `metrics`, `step` itself: the clock is read only if the protocol asks
/// `replied` for the reply's time.
#[cfg(not(feature = "metrics"))]
pub(crate) fn timed_since<S: Store + ?Sized, F: Future>(
    _store: &S,
    _step: StoreStep,
    _sent: Instant,
    _replied: Option<&mut Replied>,
    future: F,
) -> F {
    future
}

/// When a step's reply came: the clock reading its latency was recorded with, or, where none was
/// taken, a reading taken when asked.
#[derive(Default)]
pub(crate) struct Replied(Option<Instant>);

impl Replied {
    /// The time of the reply (no later than now).
    pub(crate) fn at(&self) -> Instant {
        self.0.unwrap_or_else(Instant::now)
    }
}

#[cfg(test)]
mod tests {
    use super::{Outcome, StoreStep};

    /// A scope's counter keys are indexed by `outcome as usize`: `ALL` lists the outcomes in
    /// their declaration order.
    #[test]
    fn outcomes_are_listed_in_declaration_order() {
        for (index, outcome) in Outcome::ALL.into_iter().enumerate() {
            assert_eq!(outcome as usize, index, "{outcome}");
        }
    }

    /// A store's latency keys are indexed by `step as usize`: `ALL` lists the steps in their
    /// declaration order.
    #[test]
    fn store_steps_are_listed_in_declaration_order() {
        for (index, step) in StoreStep::ALL.into_iter().enumerate() {
            assert_eq!(step as usize, index, "{step:?}");
        }
    }
}
