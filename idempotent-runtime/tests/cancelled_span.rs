//! A call cancelled while its body runs says so inside its `idempotent` span.
//!
//! Alone in its test binary: `tracing` decides once per callsite, for the whole process, whether
//! any subscriber wants it. Among the library's unit tests, which run calls on other threads with
//! no subscriber, the call's span was sometimes left disabled for this test's subscriber too (the
//! event arrived with no span in 4 of 8 runs of `cargo test -p idempotent-runtime --lib`, and in 6
//! of 20 with `tracing::callsite::rebuild_interest_cache` called first).

use std::sync::{Arc, Mutex};

use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;

use idempotent_runtime::{Call, Error, MemoryStore};

/// An event's message and the name of the span it was emitted in.
type Seen = (String, Option<String>);

/// The events seen.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<Seen>>>);

struct Message<'a>(&'a mut String);

impl tracing::field::Visit for Message<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            *self.0 = format!("{value:?}");
        }
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Events {
    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let mut message = String::new();
        event.record(&mut Message(&mut message));
        let span = ctx.event_span(event).map(|span| span.name().to_owned());
        self.0.lock().unwrap().push((message, span));
    }
}

#[test]
fn memory_a_cancelled_call_reports_inside_its_span() {
    let events = Events::default();
    let subscriber = tracing_subscriber::registry().with(events.clone());
    tracing::subscriber::with_default(subscriber, || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        runtime.block_on(async {
            let store = MemoryStore::new();
            let call = Call::new("spans", "k").run(&store, std::future::pending::<Result<(), Error>>());
            assert!(tokio::time::timeout(std::time::Duration::from_millis(5), call).await.is_err());
        });
    });
    let events = events.0.lock().unwrap().clone();
    let cancelled = events.iter().find(|(message, _)| message.contains("cancelled while the body ran"));
    assert_eq!(cancelled.and_then(|(_, span)| span.as_deref()), Some("idempotent"), "{events:?}");
}
