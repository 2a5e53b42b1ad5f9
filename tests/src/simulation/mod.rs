//! Deterministic simulation of the protocol (issue 21): many callers, a few keys, the real `Call`
//! protocol over the real stores behind a fault injector, every history judged by an oracle
//! written from README's guarantees.
//!
//! Read in this order: [`rng`] (the seed), [`callers`] (what callers do), [`faults`] (what the
//! store wrapper does to each step), [`bugs`] (rules broken on purpose), [`history`] (the log),
//! [`scheduler`] (one history), [`oracle`] (the verdict). This file runs many histories.
//! [`transactions`] is apart: histories on the transactional SQL stores, with a judgement of
//! their own (the body's effect and its record commit together, once). [`http`] is apart too:
//! histories at the HTTP edge, judged by what an API's clients see, and so is [`grpc`]: the same at
//! the gRPC edge, with tonic clients. [`edge`] holds what the two share: the network's faults, the
//! store's fault rates, and the waits that end a history.
//!
//! `IDEMPOTENT_SIM_SEED=<n>` replays one history and prints it step by step;
//! `IDEMPOTENT_SIM_HISTORIES=<n>` explores `n` histories; `IDEMPOTENT_SIM_BUG=<name>` plants a bug
//! (one of [`Bug::ALL`], by name) in a replay.

pub mod bugs;
pub mod callers;
pub mod edge;
pub mod faults;
#[cfg(feature = "grpc")]
pub mod grpc;
pub mod history;
#[cfg(feature = "http")]
pub mod http;
pub mod oracle;
pub mod rng;
pub mod scheduler;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod transactions;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use idempotent_runtime::MemoryStore;

pub use bugs::Bug;
use history::Entry;
use oracle::Verdict;

/// The lease of the simulated calls on the paused clock.
pub const SIM_LEASE: Duration = Duration::from_millis(300);

/// The first seed of the default run; the default run's seeds are `DEFAULT_SEED..DEFAULT_SEED + n`.
pub const DEFAULT_SEED: u64 = 0x1D3E_0021_0000;

/// Percent of the delayed store requests split around the store's application in the
/// exploration that splits them (`simulation_memory_split_delays`); the default run splits none,
/// so its seeds keep the histories they were found with.
pub const SPLIT_DELAYS: u32 = 50;

/// A seed's history on the memory store, with its verdict.
#[derive(Debug)]
pub struct Run {
    /// The seed.
    pub seed: u64,
    /// The log.
    pub entries: Vec<Entry>,
    /// The oracle's verdict.
    pub verdict: Verdict,
}

/// Runs the history of `seed` on a fresh memory store, on a current-thread runtime whose clock is
/// paused (so the history is the same every time), with `split_delays` percent of its delayed
/// store requests split around the store's application.
#[must_use]
pub fn memory_history(seed: u64, bug: Option<Bug>, split_delays: u32) -> Run {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    let (entries, verdict) = runtime.block_on(scheduler::run_history(
        seed,
        MemoryStore::new(),
        bug,
        scheduler::Timing { lease: SIM_LEASE, settle: Duration::ZERO, expiry_slack: Duration::ZERO, split_delays },
        "m",
    ));
    Run { seed, entries, verdict }
}

/// The totals of many histories.
#[derive(Debug, Default)]
pub struct Summary {
    /// Histories run.
    pub histories: u64,
    /// Calls made.
    pub calls: u64,
    /// Bodies run.
    pub bodies: u64,
    /// Histories with at least one violation.
    pub violating: u64,
    /// Every violation found.
    pub violations: u64,
    /// The first failing seed and its first violation.
    pub first_failure: Option<(u64, String)>,
    /// Re-runs by design, by cause.
    pub causes: BTreeMap<&'static str, u64>,
    /// Wall time.
    pub elapsed: Duration,
}

impl Summary {
    /// Adds one history's verdict.
    pub fn add(&mut self, seed: u64, verdict: &Verdict) {
        self.histories += 1;
        self.calls += verdict.calls;
        self.bodies += verdict.bodies;
        self.violations += verdict.violations.len() as u64;
        if let Some(first) = verdict.violations.first() {
            self.violating += 1;
            self.first_failure.get_or_insert_with(|| (seed, first.clone()));
        }
        for (cause, n) in &verdict.causes {
            *self.causes.entry(cause).or_default() += n;
        }
    }

    /// Histories per second of wall time.
    #[must_use]
    pub fn per_second(&self) -> f64 {
        // Exact below 2^52 histories.
        #[allow(clippy::cast_precision_loss)]
        let histories = self.histories as f64;
        histories / self.elapsed.as_secs_f64().max(1e-9)
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "histories {}, calls {}, bodies {}, violations {} (in {} histories), {:.0} histories/s ({:.1?}); re-runs by cause: {:?}",
            self.histories,
            self.calls,
            self.bodies,
            self.violations,
            self.violating,
            self.per_second(),
            self.elapsed,
            self.causes
        )
    }
}

/// Runs the memory-store histories of `seeds` (with `split_delays`, as [`memory_history`]),
/// stopping at the first violation if `stop`.
pub fn explore(seeds: impl IntoIterator<Item = u64>, bug: Option<Bug>, stop: bool, split_delays: u32) -> Summary {
    callers::quiet_planted_panics();
    let started = Instant::now();
    let mut summary = Summary::default();
    for seed in seeds {
        let run = memory_history(seed, bug, split_delays);
        summary.add(seed, &run.verdict);
        if stop && !run.verdict.violations.is_empty() {
            break;
        }
    }
    summary.elapsed = started.elapsed();
    summary
}

/// The one line that replays `seed`'s history (in the exploration that splits delays if
/// `split_delays` is not 0).
#[must_use]
pub fn repro_line(seed: u64, bug: Option<Bug>, split_delays: u32) -> String {
    let bug = bug.map(|b| format!("IDEMPOTENT_SIM_BUG={b:?} ")).unwrap_or_default();
    let test = if split_delays == 0 { "simulation_memory" } else { "simulation_memory_split_delays" };
    format!(
        "{bug}IDEMPOTENT_SIM_SEED={seed} cargo test -p idempotent-tests --test simulation {test} -- --nocapture --exact"
    )
}

/// A history, step by step, with its verdict.
#[must_use]
pub fn render(seed: u64, entries: &[Entry], verdict: &Verdict) -> String {
    use std::fmt::Write as _;
    let mut text = format!("history of seed {seed} ({} events):\n", entries.len());
    for entry in entries {
        let _ = writeln!(text, "  {entry}");
    }
    let _ = writeln!(text, "re-runs by cause: {:?}", verdict.causes);
    if verdict.violations.is_empty() {
        text.push_str("no violation\n");
    }
    for violation in &verdict.violations {
        let _ = writeln!(text, "VIOLATION: {violation}");
    }
    text
}

/// `IDEMPOTENT_SIM_SEED`, if set.
#[must_use]
pub fn env_seed() -> Option<u64> {
    std::env::var("IDEMPOTENT_SIM_SEED").ok().map(|v| v.trim().parse().expect("IDEMPOTENT_SIM_SEED is a u64"))
}

/// `IDEMPOTENT_SIM_HISTORIES`, if set.
#[must_use]
pub fn env_histories() -> Option<u64> {
    std::env::var("IDEMPOTENT_SIM_HISTORIES").ok().map(|v| v.trim().parse().expect("IDEMPOTENT_SIM_HISTORIES is a u64"))
}

/// `IDEMPOTENT_SIM_FROM`, if set: the first seed of an exploration (the memory store's
/// `IDEMPOTENT_SIM_HISTORIES` histories, or the real-server tests' 32), for exploring seeds past
/// the ones explored before.
#[must_use]
pub fn env_from() -> Option<u64> {
    std::env::var("IDEMPOTENT_SIM_FROM").ok().map(|v| v.trim().parse().expect("IDEMPOTENT_SIM_FROM is a u64"))
}

/// `IDEMPOTENT_SIM_BUG`, if set: a name of [`Bug::ALL`].
#[must_use]
pub fn env_bug() -> Option<Bug> {
    let name = std::env::var("IDEMPOTENT_SIM_BUG").ok()?;
    Some(
        Bug::ALL.into_iter().find(|b| format!("{b:?}") == name.trim()).expect("IDEMPOTENT_SIM_BUG names a planted bug"),
    )
}
