#![cfg(feature = "metrics")]
//! What a call reports: the metrics it emits (captured with `metrics-util`'s debugging recorder,
//! installed for this thread only) and its `tracing` span (captured by a subscriber layer that
//! keeps every span's fields and every event). Each test runs its calls on a current-thread
//! runtime inside the capture, so parallel tests never see each other's calls.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::{Call, Error, MemoryStore, RecordErrors, idempotent};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;

fn block_on<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a runtime").block_on(future)
}

// ---------------------------------------------------------------- metrics

/// Runs `calls` with a recorder for this thread and returns every metric emitted, as
/// `(name, sorted labels, value)`.
/// A metric as emitted: name, sorted labels, value.
type Emitted = (String, Vec<(String, String)>, DebugValue);

fn metrics_of(calls: impl Future<Output = ()>) -> Vec<Emitted> {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || block_on(calls));
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let mut labels: Vec<_> = key.key().labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
            labels.sort();
            (key.key().name().to_owned(), labels, value)
        })
        .collect()
}

fn calls_counted(metrics: &[Emitted], scope: &str) -> HashMap<String, u64> {
    metrics
        .iter()
        .filter(|(name, labels, _)| {
            name == "idempotent_calls_total" && labels.contains(&("scope".into(), scope.into()))
        })
        .map(|(_, labels, value)| {
            let outcome = labels.iter().find(|(k, _)| k == "outcome").expect("an outcome label").1.clone();
            let DebugValue::Counter(count) = value else { panic!("not a counter: {value:?}") };
            (outcome, *count)
        })
        .collect()
}

#[idempotent(key = id, store = store, scope = "observed", fingerprint = amount)]
async fn pay(store: &MemoryStore, id: &str, amount: i64) -> Result<i64, Error> {
    Ok(amount)
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Refused {
    Idempotency(String),
    Declined,
}

impl From<Error> for Refused {
    fn from(error: Error) -> Self {
        Refused::Idempotency(error.to_string())
    }
}

#[test]
fn memory_metrics_count_calls_by_scope_and_outcome() {
    let metrics = metrics_of(async {
        let store = MemoryStore::new();
        pay(&store, "a", 1).await.unwrap(); // executed
        pay(&store, "a", 1).await.unwrap(); // replayed
        pay(&store, "a", 1).await.unwrap(); // replayed
        assert!(matches!(pay(&store, "a", 2).await, Err(Error::FingerprintMismatch { .. })));
        assert!(matches!(pay(&store, "", 1).await, Err(Error::InvalidKey(_))));

        // Released: an unrecorded `Err`; recorded errors count as executed, then replayed.
        let declined = || Call::new("observed", "b").run(&store, async { Err::<i64, _>(Refused::Declined) });
        assert!(matches!(declined().await, Err(Refused::Declined)));
        let recorded =
            || Call::new("observed", "c").run_with(&store, RecordErrors, async { Err::<i64, _>(Refused::Declined) });
        assert!(matches!(recorded().await, Err(Refused::Declined)));
        assert!(matches!(recorded().await, Err(Refused::Declined)));

        // In progress: a duplicate while the first call's body waits.
        let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
        let (finish_tx, finish_rx) = tokio::sync::oneshot::channel::<()>();
        let first = Call::new("observed", "d").run(&store, async {
            started_tx.send(()).unwrap();
            finish_rx.await.unwrap();
            Ok::<_, Error>(4)
        });
        let duplicate = async {
            started_rx.await.unwrap();
            let result = Call::new("observed", "d").run(&store, async { Ok::<_, Error>(5) }).await;
            finish_tx.send(()).unwrap();
            result
        };
        let (first, duplicate) = tokio::join!(first, duplicate);
        assert_eq!(first.unwrap(), 4);
        assert!(matches!(duplicate, Err(Error::InProgress { .. })));

        // Unrecordable: over the store's record limit (the caller still gets the result).
        let tiny = MemoryStore::with_max_record_bytes(8);
        let big = || Call::new("observed", "e").run(&tiny, async { Ok::<_, Error>("x".repeat(64)) });
        assert_eq!(big().await.unwrap().len(), 64);
        assert!(matches!(big().await, Err(Error::Unrecordable { .. })));

        // Cancelled: the caller's future is dropped while the body runs.
        let cancelled = Call::new("observed", "f").run(&store, std::future::pending::<Result<i64, Error>>());
        assert!(tokio::time::timeout(Duration::from_millis(20), cancelled).await.is_err());
    });
    let counted = calls_counted(&metrics, "observed");
    let expected: HashMap<String, u64> = [
        ("executed", 3),
        ("replayed", 3),
        ("fingerprint_mismatch", 1),
        ("released", 1),
        ("in_progress", 1),
        ("unrecordable", 2),
        ("cancelled", 1),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(counted, expected, "{metrics:#?}");
    // A key refused before it had a scope is counted with the scope it was given.
    assert_eq!(calls_counted(&metrics, "observed").get("invalid"), None);
    let invalid: u64 = metrics
        .iter()
        .filter(|(name, labels, _)| {
            name == "idempotent_calls_total" && labels.contains(&("outcome".into(), "invalid".into()))
        })
        .map(|(.., value)| if let DebugValue::Counter(n) = value { *n } else { 0 })
        .sum();
    assert_eq!(invalid, 1, "{metrics:#?}");
}

#[test]
fn memory_metrics_count_a_lost_lease() {
    let metrics = metrics_of(async {
        // Lease lost: the body blocks its thread past its 30 ms lease (so the heartbeat cannot
        // renew it), then a second call takes the key over and records first.
        let store = MemoryStore::new();
        let stale = Call::new("edges", "g").lease(Duration::from_millis(30)).run(&store, async {
            std::thread::sleep(Duration::from_millis(60));
            let takeover = Call::new("edges", "g").run(&store, async { Ok::<_, Error>(2) }).await;
            assert_eq!(takeover.unwrap(), 2);
            Ok::<_, Error>(1)
        });
        let stale = Box::pin(stale).await;
        assert!(matches!(stale, Err(Error::LeaseLost { .. })), "{stale:?}");
    });
    let counted = calls_counted(&metrics, "edges");
    assert_eq!(counted.get("lease_lost"), Some(&1), "{metrics:#?}");
    assert_eq!(counted.get("executed"), Some(&1), "{metrics:#?}");
}

#[cfg(feature = "sqlite")]
#[test]
fn sqlite_metrics_count_a_store_error() {
    use idempotent_runtime::stores::sql::{SqliteStore, sqlx};
    let metrics = metrics_of(async {
        // A real store whose table was never created: every step fails in the database.
        let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.expect("an in-memory SQLite database");
        let store = SqliteStore::new(pool);
        let result = Call::new("down", "h").run(&store, async { Ok::<_, Error>(1) }).await;
        assert!(matches!(result, Err(Error::Store { operation: "claim", .. })), "{result:?}");
    });
    assert_eq!(calls_counted(&metrics, "down"), HashMap::from([("store_error".to_owned(), 1)]), "{metrics:#?}");
    let failed_claims = metrics.iter().filter(|(name, labels, _)| {
        name == "idempotent_store_step_seconds" && labels.contains(&("store".into(), "sqlite".into()))
    });
    assert_eq!(failed_claims.count(), 1, "a failed step is timed too: {metrics:#?}");
}

#[test]
fn memory_metrics_time_each_store_step() {
    let metrics = metrics_of(async {
        let store = MemoryStore::new();
        pay(&store, "a", 1).await.unwrap(); // claim, complete
        pay(&store, "a", 1).await.unwrap(); // claim
        let _ = Call::new("observed", "b").run(&store, async { Err::<i64, _>(Refused::Declined) }).await; // claim, release
    });
    let steps: HashMap<String, usize> = metrics
        .iter()
        .filter(|(name, ..)| name == "idempotent_store_step_seconds")
        .map(|(_, labels, value)| {
            assert!(labels.contains(&("store".into(), "memory".into())), "{labels:?}");
            let step = labels.iter().find(|(k, _)| k == "step").expect("a step label").1.clone();
            let DebugValue::Histogram(samples) = value else { panic!("not a histogram: {value:?}") };
            assert!(samples.iter().all(|s| s.into_inner() >= 0.0 && s.into_inner() < 10.0), "seconds: {samples:?}");
            (step, samples.len())
        })
        .collect();
    let expected: HashMap<String, usize> =
        [("claim", 3), ("complete", 1), ("release", 1)].into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    assert_eq!(steps, expected, "{metrics:#?}");
}

/// A step's latency runs from when the call sent it to its reply: claims answered 100 ms late are
/// recorded as taking at least that, and the completion, not slowed, as taking less. (A claim's
/// start is the clock reading its lease is counted from, and its end the one the call checks the
/// lease against: the metric reads the clock once per claim.)
#[test]
fn memory_metrics_time_a_slow_claim_from_its_sending_to_its_reply() {
    use idempotent_runtime::{Claim, ClaimRequest, Store, StoreError};

    struct SlowClaims(MemoryStore);
    impl SlowClaims {
        fn inner(&self) -> &MemoryStore {
            &self.0
        }
    }
    impl Store for SlowClaims {
        async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
            tokio::time::sleep(Duration::from_millis(100)).await;
            self.0.claim(request).await
        }
        idempotent_runtime::forward_store!(direct SlowClaims::inner; complete release extend detach);
    }

    let metrics = metrics_of(async {
        let store = SlowClaims(MemoryStore::new());
        for _ in 0..2 {
            Call::new("slow", "a").run(&store, async { Ok::<_, Error>(1) }).await.unwrap(); // executed, replayed
        }
    });
    let samples = |step: &str| -> Vec<f64> {
        metrics
            .iter()
            .filter(|(name, labels, _)| {
                name == "idempotent_store_step_seconds" && labels.contains(&("step".into(), step.into()))
            })
            .flat_map(|(.., value)| {
                let DebugValue::Histogram(samples) = value else { panic!("not a histogram: {value:?}") };
                samples.iter().map(|s| s.into_inner()).collect::<Vec<_>>()
            })
            .collect()
    };
    let (claims, completions) = (samples("claim"), samples("complete"));
    assert_eq!(claims.len(), 2, "{metrics:#?}");
    assert!(claims.iter().all(|s| (0.100..10.0).contains(s)), "claims answered 100 ms late: {claims:?}");
    assert_eq!(completions.len(), 1, "{metrics:#?}");
    assert!(completions[0] < 0.100, "a completion not slowed: {completions:?}");
}

/// A `CachedStore` counts its lookups by result: a claim answered from the cache is a hit, one that
/// went to the store a miss (the first call, and the first replay, which finds the record in the
/// store only when this process did not complete it; here it did, so the replays all hit).
#[cfg(feature = "cache")]
#[test]
fn memory_metrics_count_cache_lookups_by_result() {
    use idempotent_runtime::stores::cache::CachedStore;
    let metrics = metrics_of(async {
        let store = CachedStore::new(MemoryStore::new());
        for _ in 0..3 {
            Call::new("cached", "a").run(&store, async { Ok::<_, Error>(1) }).await.unwrap();
        }
        Call::new("cached", "b").run(&store, async { Ok::<_, Error>(2) }).await.unwrap();
    });
    let lookups: HashMap<String, u64> = metrics
        .iter()
        .filter(|(name, ..)| name == "idempotent_cache_lookups_total")
        .map(|(_, labels, value)| {
            let [(label, result)] = labels.as_slice() else { panic!("one label: {labels:?}") };
            assert_eq!(label, "result");
            let DebugValue::Counter(count) = value else { panic!("not a counter: {value:?}") };
            (result.clone(), *count)
        })
        .collect();
    let expected: HashMap<String, u64> =
        [("hit", 2), ("miss", 2)].into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    assert_eq!(lookups, expected, "{metrics:#?}");
}

/// A `BatchingStore` records the size of every batch it sends, labelled with the store behind
/// it: each claim and each completion is in exactly one batch, and calls made together share one.
#[test]
#[allow(clippy::float_cmp, clippy::cast_precision_loss, reason = "the samples are small counts, exact in an f64")]
fn memory_metrics_record_the_size_of_each_batch() {
    use idempotent_runtime::stores::batching::BatchingStore;
    const CALLS: usize = 8;
    let metrics = metrics_of(async {
        let store = BatchingStore::new(MemoryStore::new());
        let calls = (0..CALLS).map(|i| {
            let store = store.clone();
            async move { Call::new("batched", &i).run(&store, async { Ok::<_, Error>(i) }).await.unwrap() }
        });
        futures_util::future::join_all(calls).await;
    });
    let batches: Vec<f64> = metrics
        .iter()
        .filter(|(name, ..)| name == "idempotent_batch_steps")
        .flat_map(|(_, labels, value)| {
            assert_eq!(labels, &[("store".to_owned(), "memory".to_owned())], "{metrics:#?}");
            let DebugValue::Histogram(samples) = value else { panic!("not a histogram: {value:?}") };
            samples.iter().map(|s| s.into_inner()).collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(batches.iter().sum::<f64>(), (2 * CALLS) as f64, "every claim and completion once: {batches:?}");
    assert!(batches.iter().any(|&steps| steps > 1.0), "calls made together share a batch: {batches:?}");
}

// ---------------------------------------------------------------- spans

#[derive(Debug, Clone, Default)]
struct SpanRecord {
    name: String,
    parent: Option<String>,
    fields: HashMap<String, String>,
}

/// Keeps every span (name, parent, fields as recorded) and the text of every event.
#[derive(Clone, Default)]
struct Capture {
    spans: Arc<Mutex<HashMap<u64, SpanRecord>>>,
    events: Arc<Mutex<Vec<String>>>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Capture {
    fn on_new_span(&self, attrs: &tracing::span::Attributes<'_>, id: &tracing::span::Id, ctx: Context<'_, S>) {
        let mut record = SpanRecord { name: attrs.metadata().name().to_owned(), ..SpanRecord::default() };
        record.parent = ctx.span(id).and_then(|span| span.parent()).map(|parent| parent.name().to_owned());
        attrs.record(&mut Fields(&mut record.fields));
        self.spans.lock().unwrap().insert(id.into_u64(), record);
    }

    fn on_record(&self, id: &tracing::span::Id, values: &tracing::span::Record<'_>, _: Context<'_, S>) {
        if let Some(record) = self.spans.lock().unwrap().get_mut(&id.into_u64()) {
            values.record(&mut Fields(&mut record.fields));
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        self.events.lock().unwrap().push(format!("{fields:?}"));
    }
}

/// Runs `calls` under the capture and returns the `idempotent` spans and all events.
fn spans_of(calls: impl Future<Output = ()>) -> (Vec<SpanRecord>, Vec<String>) {
    let capture = Capture::default();
    let subscriber = tracing_subscriber::registry().with(capture.clone());
    tracing::subscriber::with_default(subscriber, || block_on(calls));
    let spans = capture.spans.lock().unwrap().values().filter(|s| s.name == "idempotent").cloned().collect();
    let events = capture.events.lock().unwrap().clone();
    (spans, events)
}

const SECRET: &str = "secret-key-7f3a";

#[tracing::instrument(skip(store))]
async fn checkout(store: &MemoryStore, cart: u32) -> Result<i64, Error> {
    pay(store, SECRET, 10).await
}

#[test]
fn memory_span_carries_scope_outcome_and_timing_never_the_key() {
    let (spans, events) = spans_of(async {
        let store = MemoryStore::new();
        checkout(&store, 1).await.unwrap();
        checkout(&store, 1).await.unwrap();
        assert!(pay(&store, SECRET, 11).await.is_err());
        // An unrecorded error and a store failure path log events: none may carry the key.
        let declined = format!("{SECRET}-declined");
        let _ = Call::new("observed", &declined).run(&store, async { Err::<i64, _>(Refused::Declined) }).await;
        let tiny = MemoryStore::with_max_record_bytes(4);
        let _ =
            Call::new("observed", SECRET).run(&tiny, async { Ok::<_, Error>("too long to record".to_owned()) }).await;
    });
    let mut outcomes: Vec<_> = spans.iter().map(|s| s.fields.get("outcome").cloned().unwrap_or_default()).collect();
    outcomes.sort();
    assert_eq!(outcomes, ["executed", "fingerprint_mismatch", "released", "replayed", "unrecordable"], "{spans:#?}");
    for span in &spans {
        assert_eq!(span.fields.get("scope").map(String::as_str), Some("observed"), "{span:?}");
        assert!(span.fields.get("elapsed_us").is_some_and(|us| us.parse::<u64>().is_ok()), "{span:?}");
        assert!(!span.fields.contains_key("key"), "no key without opting in: {span:?}");
        assert!(!format!("{span:?}").contains(SECRET), "{span:?}");
    }
    // The call is one unit inside the caller's `#[tracing::instrument]` span.
    let nested = spans.iter().filter(|s| s.parent.as_deref() == Some("checkout")).count();
    assert_eq!(nested, 2, "{spans:#?}");
    assert!(!events.is_empty(), "the library logs events");
    for event in &events {
        assert!(!event.contains(SECRET), "an event carries the key: {event}");
    }
}

#[test]
fn memory_span_carries_the_key_when_asked() {
    let (spans, _) = spans_of(async {
        let store = MemoryStore::new();
        Call::new("opted-in", "visible-key").trace_key(true).run(&store, async { Ok::<_, Error>(1) }).await.unwrap();
    });
    assert_eq!(spans.len(), 1, "{spans:#?}");
    assert_eq!(spans[0].fields.get("key").map(String::as_str), Some("visible-key"));
    assert_eq!(spans[0].fields.get("outcome").map(String::as_str), Some("executed"));
}

/// The store label works through pointers: an `Arc` of a store is labelled by the store's name.
#[test]
fn memory_metrics_label_a_store_behind_a_pointer_by_its_type() {
    let metrics = metrics_of(async {
        let store = Arc::new(MemoryStore::new());
        Call::new("arc", "a").run(&store, async { Ok::<_, Error>(1) }).await.unwrap();
    });
    let stores: Vec<_> = metrics
        .iter()
        .filter(|(name, ..)| name == "idempotent_store_step_seconds")
        .filter_map(|(_, labels, _)| labels.iter().find(|(k, _)| k == "store").map(|(_, v)| v.clone()))
        .collect();
    assert!(!stores.is_empty() && stores.iter().all(|s| s == "memory"), "{stores:?}");
}
