//! One history: draw it from its seed, run its callers through the real `Call` protocol over the
//! fault injector, let every lease run out, probe each key, and hand the log to the oracle.
//!
//! The memory store runs on a current-thread Tokio runtime with a paused clock: time moves only
//! when every task waits, straight to the next timer, so a history of many simulated seconds takes
//! microseconds and the same seed gives the same interleaving every time (the runtime polls tasks
//! in a fixed order; nothing here reads the real clock or a random source but the seed). A
//! hand-rolled scheduler of this kind, rather than `turmoil` or `shuttle`, drives our real code
//! and real memory store unchanged, needs no new crate, and lets the fault injector sit exactly at
//! the `Store` boundary, where the protocol's faults happen. The real servers run the same
//! schedules in real time.

use std::time::Duration;

use idempotent_runtime::{Claim, ClaimRequest, Key, Store, Token};

use super::bugs::{Bug, Planted};
use super::callers::{self, Caller};
use super::faults::{FaultRates, FaultStore};
use super::history::{Entry, Event, History, Reply};
use super::oracle::{self, Verdict};
use super::rng::SplitMix64;

/// The scope of the simulation's keys.
pub const SCOPE: &str = "sim";

/// One history drawn from a seed: its keys, callers and fault rates.
#[derive(Debug, Clone)]
pub struct Drawn {
    /// How many keys the callers share.
    pub keys: usize,
    /// The callers.
    pub callers: Vec<Caller>,
    /// How often faults strike.
    pub rates: FaultRates,
    /// The fault injector's own generator.
    pub fault_rng: SplitMix64,
}

/// Draws the history of `seed`, with durations scaled to `lease`.
#[must_use]
pub fn draw(seed: u64, lease: Duration) -> Drawn {
    let mut rng = SplitMix64::new(seed);
    let keys = 1 + usize::try_from(rng.below(3)).unwrap_or(0);
    let count = 2 + usize::try_from(rng.below(9)).unwrap_or(0);
    let rates = match rng.below(6) {
        0 => FaultRates::NONE,
        1 => FaultRates { fail: 5, lose_reply: 0, delay: 0, extend_fail: 0, background: true },
        2 => FaultRates { fail: 2, lose_reply: 6, delay: 3, extend_fail: 0, background: true },
        3 => FaultRates { fail: 0, lose_reply: 2, delay: 2, extend_fail: 60, background: true },
        4 => FaultRates { fail: 8, lose_reply: 8, delay: 6, extend_fail: 25, background: true },
        _ => FaultRates { fail: 0, lose_reply: 0, delay: 15, extend_fail: 0, background: true },
    };
    let mut caller_rng = rng.fork();
    let callers = (0..count).map(|id| Caller::draw(id, keys, lease, &mut caller_rng.fork())).collect();
    Drawn { keys, callers, rates, fault_rng: rng.fork() }
}

/// The times a history runs on.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Every claim's lease; the history's durations are drawn in proportion to it.
    pub lease: Duration,
    /// Added to the lease before the end-of-history probe (real servers: clock slack).
    pub settle: Duration,
    /// How long past its lease the store may still hold a claim (see
    /// [`oracle::judge_with_expiry_slack`]).
    pub expiry_slack: Duration,
    /// Percent of the delayed store requests whose delay is split: part on the way to the store,
    /// the rest on the way back ([`Fault::DelaySplit`]). With 0 every delay is whole, as the
    /// default exploration's seeds were drawn.
    ///
    /// [`Fault::DelaySplit`]: super::history::Fault::DelaySplit
    pub split_delays: u32,
}

/// Runs the history of `seed` on `inner` (with `bug` planted), keys under `prefix`, and judges it.
pub async fn run_history<S: Store + 'static>(
    seed: u64,
    inner: S,
    bug: Option<Bug>,
    timing: Timing,
    prefix: &str,
) -> (Vec<Entry>, Verdict) {
    let Timing { lease, settle, expiry_slack, split_delays } = timing;
    let drawn = draw(seed, lease);
    let history = History::new();
    let store =
        FaultStore::new(Planted::new(inner, bug), history.clone(), drawn.rates, drawn.fault_rng, lease, split_delays);
    let tasks: Vec<_> = drawn
        .callers
        .into_iter()
        .map(|caller| {
            let (store, history, prefix) = (store.clone(), history.clone(), prefix.to_owned());
            tokio::spawn(async move { callers::run(caller, &store, lease, SCOPE, &prefix, history).await })
        })
        .collect();
    for task in tasks {
        if let Err(e) = task.await {
            history.log(Event::CallEnd {
                caller: usize::MAX,
                attempt: 0,
                how: super::history::CallEnd::EscapedPanic(format!("a caller task failed: {e}")),
            });
        }
    }
    // Every caller has stopped, and so has every step left to finish in the background: after
    // one lease no key may stay blocked.
    store.background_ended().await;
    tokio::time::sleep(lease + lease / 10 + settle).await;
    for key in 0..drawn.keys {
        let name = Key::new(SCOPE, &format!("{prefix}-{key}")).expect("a valid key");
        let token = Token::new();
        let reply = match store.inner().claim(&ClaimRequest::new(&name, &token, None, lease)).await {
            Ok(Claim::Claimed) => Reply::Claimed,
            Ok(Claim::Completed(record)) => Reply::Completed(record.outcome.to_vec()),
            Ok(_) => Reply::InProgress,
            Err(e) => Reply::Failed(e.to_string()),
        };
        history.log(Event::Probe { key, store: reply });
    }
    let entries = history.entries();
    let verdict = oracle::judge_with_expiry_slack(&entries, expiry_slack);
    (entries, verdict)
}
