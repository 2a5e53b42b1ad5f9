//! What the edge simulations (HTTP, gRPC) share: the network between a history's clients and
//! its server (the faults a [`FaultProxy`] injects, drawn from the history's seed, and the task
//! that injects them at their moments), the faults of the store in the histories that have them,
//! and the waits that end a history: for its callers, then for a quiet server.

use std::time::Duration;

use tokio::time::Instant;

use super::faults::FaultRates;
use super::rng::SplitMix64;
use crate::proxy::{FaultProxy, Mode};

/// How long a history may take: far more than its plan (about 6 s at most).
pub const HISTORY_LIMIT: Duration = Duration::from_secs(60);

/// How often each store step fails, loses its reply or is delayed past the lease, in histories
/// with store faults. Steps finished in the background have none here, as before the store
/// simulation gave them faults: under the layers a handler is never dropped, so the only such
/// steps are a panicking handler's releases.
pub const STORE_FAULTS: FaultRates = FaultRates { fail: 6, lose_reply: 6, delay: 3, extend_fail: 6, background: false };

/// A fault of the network, at a moment of the history.
#[derive(Debug, Clone, Copy)]
pub enum NetFault {
    /// The next answer to come back is lost: its connection is cut after the server sent it.
    LoseOneResponse,
    /// New connections are refused for this long.
    Refuse(Duration),
    /// Traffic is held for this long, then delivered.
    Stall(Duration),
    /// Every open connection is closed.
    Kill,
}

/// Draws up to three faults within the first `within` ms of a history.
pub fn draw_faults(rng: &mut SplitMix64, within: u64) -> Vec<(Duration, NetFault)> {
    (0..rng.below(4))
        .map(|_| {
            let at = rng.millis(within);
            let fault = match rng.below(4) {
                0 => NetFault::LoseOneResponse,
                1 => NetFault::Refuse(rng.millis(500)),
                2 => NetFault::Stall(rng.millis(800)),
                _ => NetFault::Kill,
            };
            (at, fault)
        })
        .collect()
}

/// Injects `faults` at their moments; a refusal or a stall heals after its time.
pub async fn break_the_network(proxy: &FaultProxy, mut faults: Vec<(Duration, NetFault)>) {
    faults.sort_by_key(|(at, _)| *at);
    let start = Instant::now();
    for (at, fault) in faults {
        tokio::time::sleep_until(start + at).await;
        match fault {
            NetFault::LoseOneResponse => proxy.set_mode(Mode::LoseOneResponse),
            NetFault::Refuse(d) | NetFault::Stall(d) => {
                proxy.set_mode(if matches!(fault, NetFault::Refuse(_)) { Mode::Refuse } else { Mode::Stall });
                tokio::time::sleep(d).await;
                proxy.set_mode(Mode::Pass);
            }
            NetFault::Kill => proxy.kill_connections(),
        }
    }
}

/// Waits for each caller until `deadline`: the last outcomes of those that finished, and the
/// indices of those that did not.
pub async fn finish<T>(callers: Vec<tokio::task::JoinHandle<T>>, deadline: Instant) -> (Vec<T>, Vec<usize>) {
    let (mut finals, mut unfinished) = (Vec::new(), Vec::new());
    for (i, caller) in callers.into_iter().enumerate() {
        match tokio::time::timeout_at(deadline, caller).await {
            Ok(done) => finals.push(done.expect("a caller task")),
            Err(_) => unfinished.push(i),
        }
    }
    (finals, unfinished)
}

/// Waits until the server is quiet: not `busy` (no handler running, no request in flight), and
/// its `progress` (runs and answers so far) unchanged for 300 ms. What the network held is
/// delivered when it heals, maybe after its client left, so a request can reach the server after
/// every caller has finished. `false` at `deadline`.
pub async fn settle(busy: impl Fn() -> bool, progress: impl Fn() -> (usize, usize), deadline: Instant) -> bool {
    let (mut seen, mut quiet_since) = (None, Instant::now());
    while Instant::now() < deadline {
        let busy = busy();
        let now = Some(progress());
        if busy || now != seen {
            (seen, quiet_since) = (if busy { None } else { now }, Instant::now());
        } else if quiet_since.elapsed() >= Duration::from_millis(300) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}
