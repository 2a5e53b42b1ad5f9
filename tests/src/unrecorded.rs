//! Completions that a shared store finished in the background and that ended without a record,
//! counted per scope from the log.
//!
//! When a caller is dropped while its result is being recorded, the protocol hands the completion
//! to [`Store::detach`](idempotent_runtime::Store::detach), and a shared store finishes it on a
//! task of its own (`spawn_detached`), retrying until the claim's lease ends. If it never gets a
//! record in (the store unreachable for the whole lease, a `WAIT` never met, or the claim taken
//! over), nobody is left to tell: the result is unrecorded, and a later call runs the body again,
//! as README's guarantees allow for a result left unrecorded for a whole lease. A foreground
//! completion that fails so is counted by the stress harness's store wrapper; this one never
//! passes through it, and `spawn_detached` reports it only in the log, so it is counted there.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Mutex, OnceLock};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};

/// The message `spawn_detached` logs (at `WARN`, target `idempotent`) for a step that failed.
const FAILED: &str = "detached step failed; the claim ends with its lease";

/// Failed detached completions, by scope.
static FAILED_BY_SCOPE: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);

/// Whether [`watch`] installed the counting layer (set by its first call).
static INSTALLED: OnceLock<bool> = OnceLock::new();

/// Installs the counting log layer as this process's global `tracing` subscriber, once; `false`
/// if another global subscriber was installed first (then nothing is counted).
pub fn watch() -> bool {
    *INSTALLED
        .get_or_init(|| tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Counter)).is_ok())
}

/// How many detached completions of keys in `scope` failed so far; `None` unless [`watch`] is
/// counting.
#[must_use]
pub fn failed_in(scope: &str) -> Option<u64> {
    (INSTALLED.get() == Some(&true)).then(|| {
        let counts = FAILED_BY_SCOPE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        counts.as_ref().and_then(|counts| counts.get(scope).copied()).unwrap_or(0)
    })
}

struct Counter;

impl<S: Subscriber> Layer<S> for Counter {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> tracing::subscriber::Interest {
        if metadata.is_event() && metadata.target() == "idempotent" && *metadata.level() == Level::WARN {
            tracing::subscriber::Interest::always()
        } else {
            tracing::subscriber::Interest::never()
        }
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        if fields.message == FAILED && fields.what == "completion" {
            let mut counts = FAILED_BY_SCOPE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            *counts.get_or_insert_with(HashMap::new).entry(fields.scope).or_default() += 1;
        }
    }
}

/// The fields of `spawn_detached`'s event that tell what failed and where.
#[derive(Default)]
struct Fields {
    message: String,
    what: String,
    scope: String,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "what" => value.clone_into(&mut self.what),
            "scope" => value.clone_into(&mut self.scope),
            _ => {}
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        }
    }
}
