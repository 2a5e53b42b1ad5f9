//! A history's plan, drawn from its seed: the route and its settings, the handler's runs, the
//! callers, the network's faults.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;

use crate::simulation::edge::{NetFault, draw_faults};
use crate::simulation::rng::SplitMix64;

/// How a run of the handler ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    /// Charges, answers `201`.
    Created,
    /// Charges, then fails: `500`.
    ChargedThenFailed,
    /// Declines without charging: `402`, a final answer.
    Declined,
    /// Does nothing and says so: `503` with [`NotProcessed`].
    NotProcessed,
    /// Panics before charging.
    Panic,
}

impl Ending {
    /// Whether the layer records the answer.
    pub(super) fn recorded(self) -> bool {
        matches!(self, Ending::Created | Ending::ChargedThenFailed | Ending::Declined)
    }

    pub(super) fn charges(self) -> bool {
        matches!(self, Ending::Created | Ending::ChargedThenFailed)
    }
}

/// One run of the handler, as planned.
#[derive(Debug, Clone, Copy)]
pub(super) struct Behaviour {
    pub(super) work: Duration,
    pub(super) ending: Ending,
}

/// How a caller writes the request's body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyForm {
    /// The key's body.
    Canonical,
    /// The same JSON, keys reordered and spaced: the same request under `json_fingerprint`.
    Reformatted,
    /// Another amount: another request.
    Other,
}

/// One caller: a client process sending the request.
#[derive(Debug, Clone)]
pub(super) struct CallerPlan {
    pub(super) user: usize,
    pub(super) key: usize,
    pub(super) body: BodyForm,
    pub(super) delay: Duration,
    /// Attempts and jitter seed of its `IdempotentRetry`; `None`: it sends once.
    pub(super) retry: Option<(u32, u64)>,
    /// Each attempt's timeout.
    pub(super) timeout: Option<Duration>,
}

/// Which way into the HTTP support a history's route takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    /// [`IdempotencyLayer`] over the route.
    Layer,
    /// `#[idempotent]` on the handler, with [`IdempotencyKeyHeader`] and [`RunToCompletionLayer`].
    Attribute,
}

/// A history's plan.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    pub(super) route: Route,
    pub(super) lease: Duration,
    pub(super) json_fingerprint: bool,
    pub(super) wait: Option<Duration>,
    /// The runs of each (user, key), in order; runs past the list create.
    pub(super) behaviours: BTreeMap<(usize, usize), Vec<Behaviour>>,
    pub(super) callers: Vec<CallerPlan>,
    pub(super) faults: Vec<(Duration, NetFault)>,
    /// Whether each run of the handler calls a downstream service before its ending.
    pub(super) downstream: bool,
}

pub(super) fn draw(seed: u64) -> Plan {
    let mut rng = SplitMix64::new(seed);
    let lease = Duration::from_secs(rng.pick(&[2, 3, 60]));
    let json_fingerprint = rng.chance(50);
    let wait = rng.chance(30).then(|| rng.millis(1500));
    let (users, keys) = (1 + rng.below(2), 1 + rng.below(2));
    let mut behaviours = BTreeMap::new();
    for user in 0..users {
        for key in 0..keys {
            let runs = (0..=rng.below(3))
                .map(|_| Behaviour {
                    work: if rng.chance(20) { rng.millis(3000) } else { rng.millis(200) },
                    ending: match rng.below(100) {
                        0..45 => Ending::Created,
                        45..60 => Ending::ChargedThenFailed,
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
            body: match rng.below(100) {
                0..80 => BodyForm::Canonical,
                80..90 => BodyForm::Reformatted,
                _ => BodyForm::Other,
            },
            delay: rng.millis(300),
            retry: rng.chance(85).then(|| (1 + u32::try_from(rng.below(6)).unwrap_or(0), rng.next_u64())),
            timeout: rng.chance(35).then(|| Duration::from_millis(50) + rng.millis(700)),
        })
        .collect();
    let faults = draw_faults(&mut rng, 2000);
    let route = if rng.chance(50) { Route::Layer } else { Route::Attribute };
    let downstream = rng.chance(50);
    Plan { route, lease, json_fingerprint, wait, behaviours, callers, faults, downstream }
}

/// The body of `key`'s request, as `form` writes it.
pub(super) fn request_body(key: usize, form: BodyForm) -> Bytes {
    let amount = 100 + key;
    match form {
        BodyForm::Canonical => format!(r#"{{"amount":{amount},"currency":"eur"}}"#).into(),
        BodyForm::Reformatted => format!(r#"{{ "currency": "eur",  "amount": {amount} }}"#).into(),
        BodyForm::Other => format!(r#"{{"amount":{},"currency":"eur"}}"#, amount + 900).into(),
    }
}

/// Whether the layer takes `a` and `b` for the same request.
pub(super) fn same_request(plan: &Plan, a: &[u8], b: &[u8]) -> bool {
    if plan.json_fingerprint {
        serde_json::from_slice::<serde_json::Value>(a).ok() == serde_json::from_slice::<serde_json::Value>(b).ok()
    } else {
        a == b
    }
}
