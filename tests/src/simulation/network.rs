//! The network of the edge simulations (HTTP, gRPC): the faults a [`FaultProxy`] between a
//! history's clients and its server injects, drawn from the history's seed, and the task that
//! injects them at their moments.

use std::time::Duration;

use tokio::time::Instant;

use super::rng::SplitMix64;
use crate::proxy::{FaultProxy, Mode};

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
