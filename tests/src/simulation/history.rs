//! The history log: every store step (what was asked, which fault was injected, what the store
//! answered, what the caller was told) and every caller event, in the order they happened.
//!
//! The oracle reads it; a failing seed prints it step by step.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// A small number naming one owner token within a history.
pub type TokenId = usize;

/// Which store step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// [`Store::claim`](idempotent_runtime::Store::claim).
    Claim,
    /// [`Store::extend`](idempotent_runtime::Store::extend).
    Extend,
    /// [`Store::complete`](idempotent_runtime::Store::complete).
    Complete,
    /// [`Store::release`](idempotent_runtime::Store::release).
    Release,
}

/// The fault injected into one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// None: the step went through.
    None,
    /// The step failed before reaching the store.
    Fail,
    /// The store applied the step; its reply was lost.
    LoseReply,
    /// The request took this long to reach the store.
    DelayBefore(Duration),
    /// The store applied the step; its reply took this long to come back.
    DelayAfter(Duration),
    /// The request took the first this long to reach the store, and the reply the second to come
    /// back: together past the lease, shared between the two legs (see [`Timing::split_delays`]).
    ///
    /// [`Timing::split_delays`]: super::scheduler::Timing::split_delays
    DelaySplit(Duration, Duration),
}

impl Fault {
    /// The store could not be reached in time for this step.
    #[must_use]
    pub fn injected(self) -> bool {
        self != Fault::None
    }

    /// How long the request took to reach the store (zero if it was not delayed on its way).
    #[must_use]
    pub fn before(self) -> Duration {
        match self {
            Fault::DelayBefore(before) | Fault::DelaySplit(before, _) => before,
            _ => Duration::ZERO,
        }
    }

    /// How long the store's reply took to come back (zero if it was not delayed).
    #[must_use]
    pub fn after(self) -> Duration {
        match self {
            Fault::DelayAfter(after) | Fault::DelaySplit(_, after) => after,
            _ => Duration::ZERO,
        }
    }
}

/// A store's answer, or what a caller was told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The request never reached the store.
    NotSent,
    /// `Claim::Claimed`.
    Claimed,
    /// `Claim::Completed`, with the recorded bytes.
    Completed(Vec<u8>),
    /// `Claim::InProgress`.
    InProgress,
    /// `Ok(())` (extend, complete, release).
    Ok,
    /// `StoreError::NotOwner`.
    NotOwner,
    /// Any other store error.
    Failed(String),
    /// The caller was dropped while the request was with the store: it was sent, and the store
    /// may have applied it, then or later (a SQL statement runs on after its client stops waiting).
    Unknown,
}

/// One store step.
#[derive(Debug, Clone)]
pub struct Step {
    /// Which step.
    pub op: Op,
    /// The key's number.
    pub key: usize,
    /// The owner token.
    pub token: TokenId,
    /// The caller and attempt whose task made it (`None` for a step finished in the background).
    pub caller: Option<(usize, u32)>,
    /// A step finished for a dropped call ([`Store::detach`](idempotent_runtime::Store::detach)).
    pub detached: bool,
    /// The fault injected.
    pub fault: Fault,
    /// The lease asked for (claim, extend), or the history's lease.
    pub lease: Duration,
    /// The outcome written (complete).
    pub outcome: Option<Vec<u8>>,
    /// When the request left for the store, and its sequence number.
    pub sent: (Duration, u64),
    /// When the store's answer came back, and its sequence number.
    pub replied: (Duration, u64),
    /// What the store answered.
    pub store: Reply,
    /// What the caller was told.
    pub delivered: Reply,
}

/// How a body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyEnd {
    /// It returned `Ok`.
    Ok,
    /// It returned `Err` after its side effect.
    Err,
    /// It panicked after its side effect.
    Panic,
    /// Its future was dropped (the call was cancelled) while it ran.
    Dropped,
}

/// How one call of a caller ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallEnd {
    /// `Ok` with this value.
    Ok(String),
    /// The body's own `Err`.
    BodyErr,
    /// A library error, by variant name.
    Error(&'static str),
    /// The caller's deadline dropped the call.
    Cancelled,
    /// The planted panic of the body came out of the call (as it must: it is the body's own).
    BodyPanic,
    /// Any other panic: the library's. A violation.
    EscapedPanic(String),
}

/// One thing that happened.
#[derive(Debug, Clone)]
pub enum Event {
    /// A store step.
    Step(Step),
    /// A caller started a call.
    CallStart {
        /// Caller.
        caller: usize,
        /// Attempt (0 for the first call).
        attempt: u32,
        /// Key number.
        key: usize,
        /// What this call does (for the printout).
        plan: String,
    },
    /// A body started: its side effect.
    BodyStart {
        /// Caller.
        caller: usize,
        /// Attempt.
        attempt: u32,
        /// Key number.
        key: usize,
    },
    /// A body ended.
    BodyEnd {
        /// Caller.
        caller: usize,
        /// Attempt.
        attempt: u32,
        /// How.
        how: BodyEnd,
    },
    /// A call ended.
    CallEnd {
        /// Caller.
        caller: usize,
        /// Attempt.
        attempt: u32,
        /// How.
        how: CallEnd,
    },
    /// The end-of-history probe of a key (a lease after every caller stopped).
    Probe {
        /// Key number.
        key: usize,
        /// What the store answered a fresh claim.
        store: Reply,
    },
}

/// An event, when it happened and its sequence number.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Time since the history started (the simulated clock, or real time on real servers).
    pub at: Duration,
    /// Order in the log.
    pub seq: u64,
    /// What happened.
    pub event: Event,
}

/// The log of one history, shared by the store wrapper and the callers.
#[derive(Debug, Clone)]
pub struct History(Arc<Mutex<Log>>);

#[derive(Debug)]
struct Log {
    start: Instant,
    next_seq: u64,
    entries: Vec<Entry>,
    tokens: HashMap<String, TokenId>,
}

impl History {
    /// An empty history starting now.
    #[must_use]
    pub fn new() -> Self {
        History(Arc::new(Mutex::new(Log {
            start: Instant::now(),
            next_seq: 0,
            entries: Vec::with_capacity(256),
            tokens: HashMap::new(),
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Log> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The time and a fresh sequence number, for a step's send or reply.
    #[must_use]
    pub fn stamp(&self) -> (Duration, u64) {
        let mut log = self.lock();
        log.next_seq += 1;
        (log.start.elapsed(), log.next_seq)
    }

    /// The small number of `token` in this history.
    #[must_use]
    pub fn token_id(&self, token: &idempotent_runtime::Token) -> TokenId {
        let mut log = self.lock();
        let next = log.tokens.len();
        *log.tokens.entry(token.as_str().to_owned()).or_insert(next)
    }

    /// Appends `event`, now.
    pub fn log(&self, event: Event) {
        let mut log = self.lock();
        log.next_seq += 1;
        let entry = Entry { at: log.start.elapsed(), seq: log.next_seq, event };
        log.entries.push(entry);
    }

    /// Every entry so far, in order.
    #[must_use]
    pub fn entries(&self) -> Vec<Entry> {
        self.lock().entries.clone()
    }
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reply::Completed(bytes) => write!(f, "Completed({})", String::from_utf8_lossy(bytes)),
            other => write!(f, "{other:?}"),
        }
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:>9.3?} #{:<5} ", self.at, self.seq)?;
        match &self.event {
            Event::Step(s) => {
                let who = match s.caller {
                    Some((c, a)) => format!("c{c}.{a}"),
                    None => "bg".to_owned(),
                };
                write!(f, "{who:<7} {:?} k{} t{}", s.op, s.key, s.token)?;
                if s.detached {
                    f.write_str(" (detached)")?;
                }
                if let Some(outcome) = &s.outcome {
                    write!(f, " {}", String::from_utf8_lossy(outcome))?;
                }
                if s.fault.injected() {
                    write!(f, " FAULT {:?}", s.fault)?;
                }
                write!(f, " -> store {} / caller {}", s.store, s.delivered)?;
                write!(f, " (sent {:.3?} #{}, store replied {:.3?} #{})", s.sent.0, s.sent.1, s.replied.0, s.replied.1)
            }
            Event::CallStart { caller, attempt, key, plan } => write!(f, "c{caller}.{attempt:<4} call k{key}: {plan}"),
            Event::BodyStart { caller, attempt, key } => write!(f, "c{caller}.{attempt:<4} BODY STARTS on k{key}"),
            Event::BodyEnd { caller, attempt, how } => write!(f, "c{caller}.{attempt:<4} body ends: {how:?}"),
            Event::CallEnd { caller, attempt, how } => write!(f, "c{caller}.{attempt:<4} call ends: {how:?}"),
            Event::Probe { key, store } => write!(f, "probe   k{key}: a fresh claim gets {store}"),
        }
    }
}
