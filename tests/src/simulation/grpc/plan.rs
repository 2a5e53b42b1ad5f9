//! A history's plan, drawn from its seed: the layer's settings, the handler's runs, the callers
//! and their retry loops, the network's faults.

use std::collections::BTreeMap;
use std::time::Duration;

use tonic::Code;

use crate::grpc::PayRequest;
use crate::simulation::edge::{NetFault, draw_faults};
use crate::simulation::rng::SplitMix64;

/// How a run of the handler ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    /// Pays, answers `OK` with a receipt.
    Paid,
    /// Pays, then fails with this code (`UNAVAILABLE` or `INTERNAL`): recorded, never run again.
    PaidThenFailed(Code),
    /// Declines without paying: `FAILED_PRECONDITION`, a final answer (recorded).
    Declined,
    /// Does nothing and says so: `UNAVAILABLE` marked [`not_processed`](idempotent_runtime::grpc::not_processed).
    NotProcessed,
    /// Panics before paying.
    Panic,
}

impl Ending {
    /// Whether the layer records the answer.
    pub(super) fn recorded(self) -> bool {
        matches!(self, Ending::Paid | Ending::PaidThenFailed(_) | Ending::Declined)
    }

    /// Whether the run pays.
    pub(super) fn pays(self) -> bool {
        matches!(self, Ending::Paid | Ending::PaidThenFailed(_))
    }
}

/// One run of the handler, as planned.
#[derive(Debug, Clone, Copy)]
pub(super) struct Behaviour {
    pub(super) work: Duration,
    pub(super) ending: Ending,
}

/// Which message a caller sends under its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MessageForm {
    /// The key's message.
    Same,
    /// Another amount: another request under the same key.
    Other,
}

/// One caller: a client process with a channel of its own that resends the same call with the
/// same key, by a retry loop of its own or through [`GrpcRetryLayer`](idempotent_runtime::grpc::GrpcRetryLayer).
#[derive(Debug, Clone)]
pub(super) struct CallerPlan {
    pub(super) user: usize,
    pub(super) key: usize,
    pub(super) message: MessageForm,
    pub(super) delay: Duration,
    /// Attempts at most (1: it sends once).
    pub(super) attempts: u32,
    /// The seed of its back-off's jitter.
    pub(super) jitter: u64,
    /// Each attempt's deadline.
    pub(super) deadline: Option<Duration>,
    /// Whether its call goes through `GrpcRetryLayer` on its channel (with the same retried codes,
    /// attempts, back-off and budget) instead of the hand-written loop.
    pub(super) layered: bool,
}

/// A history's plan.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    pub(super) lease: Duration,
    /// Whether the key comes from the message's `request_id` (AIP-155) instead of the
    /// `idempotency-key` metadata.
    pub(super) keyed_by_message: bool,
    pub(super) wait: Option<Duration>,
    /// The runs of each (user, key), in order; runs past the list pay.
    pub(super) behaviours: BTreeMap<(usize, usize), Vec<Behaviour>>,
    pub(super) callers: Vec<CallerPlan>,
    pub(super) faults: Vec<(Duration, NetFault)>,
}

/// The plan of `seed`'s history.
pub(super) fn draw(seed: u64) -> Plan {
    let mut rng = SplitMix64::new(seed);
    let lease = Duration::from_secs(rng.pick(&[2, 3, 60]));
    let keyed_by_message = rng.chance(35);
    let wait = rng.chance(30).then(|| rng.millis(1500));
    let (users, keys) = (1 + rng.below(2), 1 + rng.below(2));
    let mut behaviours = BTreeMap::new();
    for user in 0..users {
        for key in 0..keys {
            let runs = (0..=rng.below(3))
                .map(|_| Behaviour {
                    work: if rng.chance(20) { rng.millis(3000) } else { rng.millis(200) },
                    ending: match rng.below(100) {
                        0..45 => Ending::Paid,
                        45..53 => Ending::PaidThenFailed(Code::Unavailable),
                        53..60 => Ending::PaidThenFailed(Code::Internal),
                        60..70 => Ending::Declined,
                        70..85 => Ending::NotProcessed,
                        _ => Ending::Panic,
                    },
                })
                .collect();
            behaviours.insert((usize::try_from(user).unwrap_or(0), usize::try_from(key).unwrap_or(0)), runs);
        }
    }
    let callers = (0..2 + rng.below(4))
        .map(|_| CallerPlan {
            user: usize::try_from(rng.below(users)).unwrap_or(0),
            key: usize::try_from(rng.below(keys)).unwrap_or(0),
            message: if rng.chance(85) { MessageForm::Same } else { MessageForm::Other },
            delay: rng.millis(300),
            attempts: 1 + u32::try_from(rng.below(6)).unwrap_or(0),
            jitter: rng.next_u64(),
            deadline: rng.chance(35).then(|| Duration::from_millis(50) + rng.millis(700)),
            layered: false,
        })
        .collect::<Vec<_>>();
    // Which callers retry through `GrpcRetryLayer`: drawn from a stream of the seed's own, so the
    // rest of each seed's plan is what it was before the layer had callers.
    let mut kinds = SplitMix64::new(seed ^ 0x1A7E_12ED_CA11_0000);
    let callers = callers.into_iter().map(|caller| CallerPlan { layered: kinds.chance(50), ..caller }).collect();
    // Within the first 600 ms, while most calls are under way: most are answered within half a
    // second, and a fault armed after the last call (a response to lose) does nothing.
    let faults = draw_faults(&mut rng, 600);
    Plan { lease, keyed_by_message, wait, behaviours, callers, faults }
}

/// The message `form` sends for key `key`, with the key's text in `request_id` if the plan keys
/// by message. The same for every user: who sends it is the caller's metadata, as an
/// authenticated caller's identity would be.
pub(super) fn message(plan: &Plan, key: usize, key_text: &str, form: MessageForm) -> PayRequest {
    let amount = i64::try_from(100 + key).unwrap_or(100);
    PayRequest {
        request_id: if plan.keyed_by_message { key_text.to_owned() } else { String::new() },
        user: String::new(),
        amount: if form == MessageForm::Other { amount + 900 } else { amount },
        behaviour: String::new(),
    }
}
