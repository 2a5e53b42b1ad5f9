//! The idempotent consumer on a real NATS JetStream (`idempotent_runtime::consume::jetstream`).
//!
//! 1. Kill and redeliver: competing worker processes (`tests/src/bin/consumer_worker.rs`) pull
//!    from one durable consumer while a producer publishes messages with a `Nats-Msg-Id` (some
//!    twice, which JetStream's duplicate window drops), malformed ones without and poison ones
//!    (their handler always fails). Workers SIGKILL themselves at scheduled ids, after the side
//!    effect ran and its record was written (Redis store), before the ack; JetStream redelivers
//!    after `ack_wait`; killed workers are restarted. The handler panics at other scheduled ids,
//!    once, before the side effect. Then: one side effect per id in the PostgreSQL ledger, nothing
//!    pending or unacknowledged on the consumer, every panic retried, and the dead-letter stream
//!    holds exactly the malformed and the poison messages.
//! 2. Settlement by outcome, in process: a reused id with another body and a message without an
//!    id go to the dead-letter subject with their reason, a message whose id is claimed elsewhere
//!    is `nak`ed with the delay (not in a hot loop) and acked once the claim completes; a panicking
//!    handler is a failure the consumer survives; a handler that always fails or panics is
//!    dead-lettered after the attempts; a handler longer than `ack_wait` is not redelivered while
//!    it runs; a dead-letter copy is read under its original id.

#![cfg(all(feature = "jetstream", feature = "postgres", feature = "redis"))]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_runtime::consume::jetstream::async_nats::jetstream::{self, Context, consumer::pull, stream};
use idempotent_runtime::consume::jetstream::async_nats::{self, HeaderMap};
use idempotent_runtime::consume::jetstream::{Consumer, DEAD_LETTER_MESSAGE_ID, DEAD_LETTER_REASON};
use idempotent_runtime::consume::{DEFAULT_MAX_ATTEMPTS, Disposition, Settled};
use idempotent_runtime::{Call, Error, MemoryStore};
use idempotent_tests::consume::{
    Fleet, Ledger, LogCapture, assert_exactly_once, kill_schedule, malformed_body, message_id, panic_schedule,
    poison_id,
};
use idempotent_tests::{fresh, services};

const MESSAGES: usize = 1000;
const MALFORMED: usize = 20;
const DUPLICATE_EVERY: usize = 50;
const WORKERS: usize = 3;
const KILLS: usize = 10;
const PANICS: usize = 5;
const POISON: usize = 5;
/// The consumer's default cap on the handler's runs of one message.
const MAX_ATTEMPTS: usize = DEFAULT_MAX_ATTEMPTS as usize;
const ACK_WAIT: Duration = Duration::from_secs(2);

/// A work stream and a dead-letter stream under fresh names.
struct Streams {
    js: Context,
    work: String,
    dead: String,
    work_subject: String,
    dead_subject: String,
}

impl Streams {
    async fn create(url: &str) -> Streams {
        let client = async_nats::connect(url).await.expect("connect to NATS");
        let js = jetstream::new(client);
        let suffix = fresh::suffix();
        let streams = Streams {
            js,
            work: format!("IDEM_WORK_{suffix}"),
            dead: format!("IDEM_DEAD_{suffix}"),
            work_subject: format!("idem.{suffix}.work"),
            dead_subject: format!("idem.{suffix}.dead"),
        };
        for (name, subject) in [(&streams.work, &streams.work_subject), (&streams.dead, &streams.dead_subject)] {
            let config = stream::Config { name: name.clone(), subjects: vec![subject.clone()], ..Default::default() };
            streams.js.create_stream(config).await.expect("create a stream");
        }
        streams
    }

    async fn consumer(&self, name: &str) -> jetstream::consumer::PullConsumer {
        self.consumer_waiting(name, ACK_WAIT).await
    }

    async fn consumer_waiting(&self, name: &str, ack_wait: Duration) -> jetstream::consumer::PullConsumer {
        let stream = self.js.get_stream(&self.work).await.expect("the work stream");
        let config = pull::Config { durable_name: Some(name.to_owned()), ack_wait, ..Default::default() };
        stream.create_consumer(config).await.expect("create the consumer")
    }

    /// Publishes; returns whether JetStream stored it (`false`: a duplicate within its window).
    async fn publish(&self, headers: Option<(&str, &str)>, body: &[u8]) -> bool {
        let mut map = HeaderMap::new();
        if let Some((name, value)) = headers {
            map.insert(name, value);
        }
        let ack = self
            .js
            .publish_with_headers(self.work_subject.clone(), map, body.to_vec().into())
            .await
            .expect("publish")
            .await
            .expect("a publish ack");
        !ack.duplicate
    }

    /// The dead-letter stream's messages: (payload, reason header, original id header).
    async fn dead_letters(&self) -> Vec<(String, String, Option<String>)> {
        let mut dead = self.js.get_stream(&self.dead).await.expect("the dead-letter stream");
        let state = dead.info().await.expect("its info").state.clone();
        let mut letters = Vec::new();
        for sequence in state.first_sequence..=state.last_sequence {
            if state.messages == 0 {
                break;
            }
            let message = dead.get_raw_message(sequence).await.expect("a dead letter");
            let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
            letters.push((
                String::from_utf8(message.payload.to_vec()).expect("a text payload"),
                header(DEAD_LETTER_REASON).expect("a dead letter carries its reason"),
                header(DEAD_LETTER_MESSAGE_ID),
            ));
        }
        letters
    }

    /// The work stream's consumer `durable` once nothing is pending or unacknowledged on it (or
    /// after 10 s): its info, to assert on.
    async fn drained(&self, durable: &str) -> jetstream::consumer::Info {
        let stream = self.js.get_stream(&self.work).await.expect("the stream");
        let mut pull = stream.get_consumer::<pull::Config>(durable).await.expect("the consumer");
        drained(&mut pull).await
    }

    async fn delete(self) {
        for name in [&self.work, &self.dead] {
            let _ = self.js.delete_stream(name).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_workers_sigkilled_before_the_ack_apply_each_message_once() {
    workers_sigkilled_before_the_ack("jetstream_workers_sigkilled_before_the_ack_apply_each_message_once", "").await;
}

/// The same fleet with the store behind a `BatchingStore` in each worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_workers_sigkilled_before_the_ack_apply_each_message_once_through_batching() {
    workers_sigkilled_before_the_ack(
        "jetstream_workers_sigkilled_before_the_ack_apply_each_message_once_through_batching",
        "batching-",
    )
    .await;
}

/// The kill-and-redeliver scenario; `wrapper` prefixes the workers' store argument
/// (`batching-`: the store behind a `BatchingStore`).
async fn workers_sigkilled_before_the_ack(test: &str, wrapper: &str) {
    let Some(nats) = services::nats_url(test) else { return };
    let Some(redis) = services::redis_url(test) else { return };
    let Some(pg) = services::postgres_url(test) else { return };
    let (store, cleanup) = fresh::redis_at(&redis).await;
    let ledger = Ledger::create(&pg).await;
    let streams = Streams::create(&nats).await;
    let mut consumer = streams.consumer("workers").await;

    let kill_ids = kill_schedule(MESSAGES, KILLS);
    let panic_ids = panic_schedule(MESSAGES, PANICS, KILLS);
    let expected = MESSAGES + MALFORMED + POISON;
    let args = vec![
        "jetstream".to_owned(),
        nats.clone(),
        format!("{}|workers|{}", streams.work, streams.dead_subject),
        format!("{wrapper}redis:{redis}|{}", store.prefix()),
        format!("{pg}|{}", ledger.table),
        kill_ids.join(","),
        panic_ids.join(","),
    ];
    let started = Instant::now();
    let fleet = Fleet::start(env!("CARGO_BIN_EXE_consumer_worker"), WORKERS, args);
    let tally = tokio::task::spawn_blocking(move || fleet.run_until_settled(expected, Duration::from_secs(60)));
    let (mut stored, mut dropped) = (0, 0);
    for i in 0..MESSAGES {
        let id = message_id(i);
        let body = format!("{{\"amount\":{i}}}");
        let copies = if i % DUPLICATE_EVERY == 0 { 2 } else { 1 };
        for _ in 0..copies {
            if streams.publish(Some(("Nats-Msg-Id", &id)), body.as_bytes()).await { stored += 1 } else { dropped += 1 }
        }
        if i % (MESSAGES / MALFORMED) == 0 {
            assert!(streams.publish(None, malformed_body(i / (MESSAGES / MALFORMED)).as_bytes()).await);
            stored += 1;
        }
        if i % (MESSAGES / POISON) == 7 {
            let poison = poison_id(i / (MESSAGES / POISON));
            assert!(streams.publish(Some(("Nats-Msg-Id", &poison)), poison.as_bytes()).await);
            stored += 1;
        }
    }
    assert_eq!((stored, dropped), (expected, MESSAGES.div_ceil(DUPLICATE_EVERY)), "JetStream drops duplicate ids");
    let tally = tally.await.expect("the fleet");

    // Acks are asynchronous: wait until the consumer has none pending (or fail after 10 s).
    let deadline = Instant::now() + Duration::from_secs(10);
    let info = loop {
        let info = consumer.info().await.expect("the consumer's info").clone();
        if (info.num_pending, info.num_ack_pending) == (0, 0) || Instant::now() > deadline {
            break info;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let elapsed = started.elapsed();

    let counts = ledger.counts().await;
    let doubles = assert_exactly_once(&counts, MESSAGES);
    assert_eq!(tally.kills, KILLS, "every scheduled kill happened once: {tally:?}");
    assert_eq!(tally.acked, MESSAGES, "{tally:?}");
    let poison_ids: Vec<String> = (0..POISON).map(poison_id).collect();
    let mut dead_ids = tally.dead_lettered.clone();
    dead_ids.sort();
    let mut expected_dead = vec!["-".to_owned(); MALFORMED];
    expected_dead.extend(poison_ids.iter().cloned());
    expected_dead.sort();
    assert_eq!(dead_ids, expected_dead, "dead-lettered: the messages without an id and the poison ones, once each");
    // A poison message is dead-lettered at its MAX_ATTEMPTS-th delivery; a delivery that a killed
    // worker had pulled but not started also counts, so it may have run fewer times.
    assert_eq!(tally.failed.keys().cloned().collect::<Vec<_>>(), poison_ids, "{tally:?}");
    assert!(tally.failed.values().all(|&n| (1..MAX_ATTEMPTS).contains(&n)), "{:?}", tally.failed);
    let panicked_once: BTreeMap<String, usize> = panic_ids.iter().map(|id| (id.clone(), 1)).collect();
    assert_eq!(tally.panicked, panicked_once, "each scheduled panic was retried once: {tally:?}");
    assert_eq!(ledger.panicked().await, panic_ids, "each scheduled panic happened once");
    assert!(tally.redelivered >= KILLS, "each killed delivery came back as a redelivery: {tally:?}");
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0), "nothing pending or unacknowledged: {info:?}");
    let letters = streams.dead_letters().await;
    assert_malformed_and_poison(&letters, &poison_ids);
    println!(
        "JetStream kill-and-redeliver ({wrapper}redis): {MESSAGES} messages with ids ({dropped} duplicate publishes dropped by \
         JetStream) + {MALFORMED} without an id + {POISON} poison, {WORKERS} competing workers ({} processes \
         started), {} SIGKILLs after the record and before the ack, {} panics before the side effect (each retried \
         once), {} deliveries settled as redelivered, {} retried ({} after a poison failure: {:?}); double effects \
         {doubles}, ledger rows {}, pending 0, unacknowledged 0, dead letters {} ({MALFORMED} malformed, {POISON} \
         poison); {:.1} s",
        tally.started,
        tally.kills,
        tally.panicked.values().sum::<usize>(),
        tally.redelivered,
        tally.retried,
        tally.failed.values().sum::<usize>(),
        tally.failed.values().collect::<Vec<_>>(),
        counts.values().sum::<i64>(),
        letters.len(),
        elapsed.as_secs_f64()
    );

    streams.delete().await;
    ledger.drop_table().await;
    cleanup.run().await;
}

/// The dead-letter stream holds exactly the malformed messages (without an id) and the poison
/// ones (with their id), each with its reason.
fn assert_malformed_and_poison(letters: &[(String, String, Option<String>)], poison_ids: &[String]) {
    let mut bodies: Vec<String> = letters.iter().map(|(body, _, _)| body.clone()).collect();
    bodies.sort();
    let mut expected: Vec<String> = (0..MALFORMED).map(malformed_body).chain(poison_ids.iter().cloned()).collect();
    expected.sort();
    assert_eq!(bodies, expected, "the dead-letter stream holds exactly the malformed and the poison messages");
    for (body, reason, id) in letters {
        if body.starts_with("poison") {
            assert!(reason.contains("poison") && id.as_deref() == Some(body.as_str()), "{body}: {reason} {id:?}");
        } else {
            assert!(reason.contains("no id") && id.is_none(), "{body}: {reason} {id:?}");
        }
    }
}

type Seen = Arc<Mutex<Vec<Settled>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_settles_each_outcome_as_documented() {
    const TEST: &str = "jetstream_settles_each_outcome_as_documented";
    const DELAY: Duration = Duration::from_millis(300);
    let Some(nats) = services::nats_url(TEST) else { return };
    let streams = Streams::create(&nats).await;
    let pull = streams.consumer("settle").await;
    let store = Arc::new(MemoryStore::new());

    // Another caller holds the claim on "busy" until told to finish.
    let (finish, finished) = tokio::sync::oneshot::channel::<()>();
    let (claimed, is_claimed) = tokio::sync::oneshot::channel::<()>();
    let holder = tokio::spawn({
        let store = Arc::clone(&store);
        async move {
            Call::new("settle", "busy")
                .fingerprint(b"busy-body".as_slice())
                .run(&*store, async move {
                    let _ = claimed.send(());
                    let _ = finished.await;
                    Ok::<_, Error>("done elsewhere".to_owned())
                })
                .await
        }
    });
    is_claimed.await.expect("the holder claimed the key");

    let seen: Seen = Arc::default();
    let attempts: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (store, seen, attempts, js) =
            (Arc::clone(&store), Arc::clone(&seen), Arc::clone(&attempts), streams.js.clone());
        let dead_subject = streams.dead_subject.clone();
        async move {
            Consumer::new(js, pull)
                // The key is an application header here: JetStream would drop a reused Nats-Msg-Id.
                .id_from(|m| Some(m.headers.as_ref()?.get("Idempotency-Key")?.as_str().to_owned()))
                .dead_letter(dead_subject)
                .concurrency(4)
                .retry_delay(DELAY)
                .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                .run_until(
                    |message| {
                        let (store, attempts) = (Arc::clone(&store), Arc::clone(&attempts));
                        async move {
                            if message.id() == "busy" {
                                attempts.lock().unwrap().push(Instant::now());
                            }
                            let body = message.payload().to_vec();
                            Call::new("settle", message.id())
                                .fingerprint(&body)
                                .run(
                                    &*store,
                                    async move { Ok::<_, Error>(String::from_utf8_lossy(&body).into_owned()) },
                                )
                                .await
                        }
                    },
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
        }
    });

    streams.publish(Some(("Idempotency-Key", "a")), b"first").await;
    wait_for(&seen, |s| s.iter().any(|s| s.message_id.as_deref() == Some("a"))).await;
    streams.publish(Some(("Idempotency-Key", "a")), b"another body").await; // the key reused: dead-letter
    streams.publish(None, b"no id").await; // dead-letter
    streams.publish(Some(("Idempotency-Key", "busy")), b"busy-body").await; // in progress elsewhere: nak
    wait_for(&seen, |s| s.iter().filter(|s| s.disposition == Disposition::Retry).count() >= 2).await;
    finish.send(()).expect("the holder is waiting");
    assert_eq!(holder.await.expect("the holder").expect("the holder's call"), "done elsewhere");
    wait_for(&seen, |s| s.iter().any(|s| s.message_id.as_deref() == Some("busy") && s.disposition == Disposition::Ack))
        .await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task").expect("the consumer");

    let seen = seen.lock().unwrap().clone();
    let of = |id: Option<&str>| -> Vec<(Disposition, bool)> {
        seen.iter().filter(|s| s.message_id.as_deref() == id).map(|s| (s.disposition, s.redelivered)).collect()
    };
    assert_eq!(of(Some("a")), vec![(Disposition::Ack, false), (Disposition::DeadLetter, false)], "{seen:?}");
    assert_eq!(of(None), vec![(Disposition::DeadLetter, false)]);
    let busy = of(Some("busy"));
    assert!(busy.len() >= 3, "at least two naks, then the ack: {busy:?}");
    assert!(busy[..busy.len() - 1].iter().all(|(d, _)| *d == Disposition::Retry), "{busy:?}");
    assert_eq!(busy.last(), Some(&(Disposition::Ack, true)), "the nak'ed message is acked once the claim completed");
    let times = attempts.lock().unwrap().clone();
    assert_eq!(times.len(), busy.len(), "one attempt per settlement");
    for pair in times.windows(2) {
        assert!(pair[1] - pair[0] >= DELAY, "attempts {:?} apart, under the nak delay {DELAY:?}", pair[1] - pair[0]);
    }
    let mut letters = streams.dead_letters().await;
    letters.sort();
    assert_eq!(letters.len(), 2, "{letters:?}");
    assert_eq!(letters[0].0, "another body");
    assert!(letters[0].1.contains("fingerprint mismatch"), "the reason is carried: {:?}", letters[0]);
    assert_eq!(letters[0].2.as_deref(), Some("a"), "with the original id");
    assert_eq!(letters[1].0, "no id");
    assert!(letters[1].1.contains("no id"), "{:?}", letters[1]);
    streams.delete().await;
}

async fn wait_for(seen: &Seen, done: impl Fn(&[Settled]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done(&seen.lock().unwrap()) {
        assert!(Instant::now() < deadline, "not settled in time: {:?}", seen.lock().unwrap());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A handler's own error (not an idempotency error).
struct Declined;

impl std::fmt::Display for Declined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("declined")
    }
}

impl idempotent_runtime::consume::HandlerError for Declined {
    fn idempotency_error(&self) -> Option<&Error> {
        None
    }
}

/// The settlements of one message id, in order: (disposition, reason).
fn settlements_of(seen: &Seen, id: &str) -> Vec<(Disposition, Option<String>)> {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|s| s.message_id.as_deref() == Some(id))
        .map(|s| (s.disposition, s.reason.clone()))
        .collect()
}

/// Waits (10 s at most) until the consumer has nothing pending or unacknowledged; returns its info.
async fn drained(consumer: &mut jetstream::consumer::PullConsumer) -> jetstream::consumer::Info {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info = consumer.info().await.expect("the consumer's info").clone();
        if (info.num_pending, info.num_ack_pending) == (0, 0) || Instant::now() > deadline {
            return info;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// A current-thread runtime: the log capture sees every task of the test.
#[tokio::test]
async fn jetstream_a_panicking_handler_is_retried_and_the_consumer_keeps_running() {
    const TEST: &str = "jetstream_a_panicking_handler_is_retried_and_the_consumer_keeps_running";
    let Some(nats) = services::nats_url(TEST) else { return };
    let logs = LogCapture::install();
    let streams = Streams::create(&nats).await;
    let pull = streams.consumer("panic").await;

    let seen: Seen = Arc::default();
    let panicked = Arc::new(AtomicBool::new(false));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (js, seen, panicked) = (streams.js.clone(), Arc::clone(&seen), Arc::clone(&panicked));
        async move {
            Consumer::new(js, pull)
                .retry_delay(Duration::from_millis(100))
                .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                .run_until(
                    |message| {
                        let panicked = Arc::clone(&panicked);
                        async move {
                            let first = message.payload() == b"panics once" && !panicked.swap(true, Ordering::SeqCst);
                            assert!(!first, "boom: this handler panics on its first run");
                            Ok::<_, Error>(())
                        }
                    },
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
        }
    });

    streams.publish(Some(("Nats-Msg-Id", "p")), b"panics once").await;
    wait_for(&seen, |s| s.iter().any(|s| s.message_id.as_deref() == Some("p"))).await;
    streams.publish(Some(("Nats-Msg-Id", "q")), b"fine").await; // the consumer still runs
    wait_for(&seen, |s| {
        s.iter().any(|s| s.message_id.as_deref() == Some("p") && s.disposition == Disposition::Ack)
            && s.iter().any(|s| s.message_id.as_deref() == Some("q"))
    })
    .await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task did not panic").expect("the consumer");

    let p = settlements_of(&seen, "p");
    assert_eq!(p.len(), 2, "a retry after the panic, then the ack: {p:?}");
    assert_eq!(p[0].0, Disposition::Retry, "{p:?}");
    assert!(p[0].1.as_deref().is_some_and(|r| r.contains("panicked") && r.contains("boom")), "{p:?}");
    assert_eq!(p[1], (Disposition::Ack, None));
    assert_eq!(settlements_of(&seen, "q"), vec![(Disposition::Ack, None)]);
    let logged: Vec<String> = logs
        .events()
        .into_iter()
        .filter(|e| e.starts_with("ERROR idempotent::consume:") && e.contains("boom"))
        .collect();
    assert_eq!(logged.len(), 1, "the panic is logged once, as an error: {:?}", logs.events());
    let info = streams.drained("panic").await;
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0), "{info:?}");
    streams.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_message_that_always_fails_is_dead_lettered_after_the_default_attempts() {
    const TEST: &str = "jetstream_a_message_that_always_fails_is_dead_lettered_after_the_default_attempts";
    let Some(nats) = services::nats_url(TEST) else { return };
    let streams = Streams::create(&nats).await;
    let pull = streams.consumer("poison").await;

    let seen: Seen = Arc::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (js, seen, runs) = (streams.js.clone(), Arc::clone(&seen), Arc::clone(&runs));
        let dead_subject = streams.dead_subject.clone();
        async move {
            // The defaults, but for a short retry delay.
            Consumer::new(js, pull)
                .dead_letter(dead_subject)
                .retry_delay(Duration::from_millis(50))
                .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                .run_until(
                    |message| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        async move {
                            match message.payload() {
                                b"always panics" => panic!("this handler panics every time"),
                                b"always fails" => Err(Declined),
                                _ => Ok(()),
                            }
                        }
                    },
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
        }
    });

    streams.publish(Some(("Nats-Msg-Id", "fails")), b"always fails").await;
    streams.publish(Some(("Nats-Msg-Id", "panics")), b"always panics").await;
    wait_for(&seen, |s| s.iter().filter(|s| s.disposition == Disposition::DeadLetter).count() == 2).await;
    streams.publish(Some(("Nats-Msg-Id", "after")), b"fine").await;
    wait_for(&seen, |s| s.iter().any(|s| s.message_id.as_deref() == Some("after"))).await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task").expect("the consumer");

    for id in ["fails", "panics"] {
        let settled = settlements_of(&seen, id);
        let dispositions: Vec<Disposition> = settled.iter().map(|(d, _)| *d).collect();
        let mut expected = vec![Disposition::Retry; MAX_ATTEMPTS - 1];
        expected.push(Disposition::DeadLetter);
        assert_eq!(dispositions, expected, "{id}: {MAX_ATTEMPTS} runs, then the dead-letter subject: {settled:?}");
        let last = settled.last().and_then(|(_, r)| r.clone()).unwrap_or_default();
        assert!(last.contains(&format!("{MAX_ATTEMPTS} of {MAX_ATTEMPTS}")), "the reason says why: {last}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2 * MAX_ATTEMPTS + 1, "the handler ran that often, and once for `after`");
    let mut letters = streams.dead_letters().await;
    letters.sort();
    let ids: Vec<Option<&str>> = letters.iter().map(|(_, _, id)| id.as_deref()).collect();
    assert_eq!(ids, vec![Some("fails"), Some("panics")], "{letters:?}");
    streams.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_handler_longer_than_ack_wait_is_not_redelivered_while_it_runs() {
    const TEST: &str = "jetstream_a_handler_longer_than_ack_wait_is_not_redelivered_while_it_runs";
    const SHORT_ACK_WAIT: Duration = Duration::from_secs(1);
    const HANDLER_TAKES: Duration = Duration::from_millis(3500);
    let Some(nats) = services::nats_url(TEST) else { return };
    let streams = Streams::create(&nats).await;
    let pull = streams.consumer_waiting("slow", SHORT_ACK_WAIT).await;

    let seen: Seen = Arc::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (js, seen, runs) = (streams.js.clone(), Arc::clone(&seen), Arc::clone(&runs));
        async move {
            Consumer::new(js, pull)
                .concurrency(4) // room for a redelivery to run beside the first delivery
                .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                .run_until(
                    |_message| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        async move {
                            tokio::time::sleep(HANDLER_TAKES).await;
                            Ok::<_, Error>(())
                        }
                    },
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
        }
    });

    let started = Instant::now();
    streams.publish(Some(("Nats-Msg-Id", "slow")), b"slow").await;
    wait_for(&seen, |s| s.iter().any(|s| s.message_id.as_deref() == Some("slow"))).await;
    let took = started.elapsed();
    // A redelivery would have come at the latest one ack_wait after the ack: wait that long again.
    tokio::time::sleep(SHORT_ACK_WAIT + Duration::from_millis(500)).await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task").expect("the consumer");

    assert!(took >= HANDLER_TAKES, "the handler ran its {HANDLER_TAKES:?} ({took:?})");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once, not again while it ran: {seen:?}");
    assert_eq!(settlements_of(&seen, "slow"), vec![(Disposition::Ack, None)]);
    let info = streams.drained("slow").await;
    assert_eq!(info.num_redelivered, 0, "JetStream redelivered nothing: {info:?}");
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0), "{info:?}");
    println!("a {HANDLER_TAKES:?} handler with ack_wait {SHORT_ACK_WAIT:?}: settled after {took:?}, 1 run");
    streams.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_dead_letter_copy_is_read_under_its_original_id() {
    const TEST: &str = "jetstream_a_dead_letter_copy_is_read_under_its_original_id";
    let Some(nats) = services::nats_url(TEST) else { return };
    let client = async_nats::connect(&nats).await.expect("connect to NATS");
    let js = jetstream::new(client);
    let suffix = fresh::suffix();
    // One stream keeps both subjects: the original `Nats-Msg-Id` is within its duplicate window
    // when the copy arrives.
    let (name, work, dead) =
        (format!("IDEM_BOTH_{suffix}"), format!("idem.{suffix}.work"), format!("idem.{suffix}.dead"));
    let config =
        stream::Config { name: name.clone(), subjects: vec![work.clone(), dead.clone()], ..Default::default() };
    let stream = js.create_stream(config).await.expect("create the stream");
    let consumer_of = |durable: &str, subject: &str| pull::Config {
        durable_name: Some(durable.to_owned()),
        filter_subject: subject.to_owned(),
        ack_wait: ACK_WAIT,
        ..Default::default()
    };
    let work_pull = stream.create_consumer(consumer_of("work", &work)).await.expect("the work consumer");
    let dead_pull = stream.create_consumer(consumer_of("replay", &dead)).await.expect("the dead-letter consumer");

    for (id, body) in [(Some("order-1"), "declined"), (None, "no id")] {
        let mut headers = HeaderMap::new();
        if let Some(id) = id {
            headers.insert("Nats-Msg-Id", id);
        }
        js.publish_with_headers(work.clone(), headers, body.as_bytes().to_vec().into())
            .await
            .expect("publish")
            .await
            .expect("a publish ack");
    }

    // The work consumer dead-letters both: a final failure of the handler, a message without an id.
    let work_seen: Seen = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let working = tokio::spawn({
        let (js, seen, dead) = (js.clone(), Arc::clone(&work_seen), dead.clone());
        async move {
            Consumer::new(js, work_pull)
                .dead_letter(dead)
                .on_failure(|_: &Declined| Disposition::DeadLetter)
                .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                .run_until(|_message| async move { Err::<(), _>(Declined) }, async move {
                    let _ = stopped.await;
                })
                .await
        }
    });
    wait_for(&work_seen, |s| s.iter().filter(|s| s.disposition == Disposition::DeadLetter).count() == 2).await;
    stop.send(()).expect("the consumer runs");
    working.await.expect("the consumer task").expect("the consumer");

    // A consumer of the dead-letter subject with the default settings (a replay tool).
    let replay_seen: Seen = Arc::default();
    let ids: Arc<Mutex<Vec<String>>> = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let replaying = tokio::spawn({
        let (js, seen, ids) = (js.clone(), Arc::clone(&replay_seen), Arc::clone(&ids));
        async move {
            Consumer::new(js, dead_pull)
                .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                .run_until(
                    |message| {
                        ids.lock().unwrap().push(message.id().to_owned());
                        async move { Ok::<_, Error>(()) }
                    },
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
        }
    });
    wait_for(&replay_seen, |s| s.len() == 2).await;
    stop.send(()).expect("the consumer runs");
    replaying.await.expect("the consumer task").expect("the consumer");

    let ids = ids.lock().unwrap().clone();
    assert_eq!(ids, vec!["order-1".to_owned()], "the copy runs under the original id, the id-less one not at all");
    let replayed = replay_seen.lock().unwrap().clone();
    let of = |id: Option<&str>| -> Vec<Disposition> {
        replayed.iter().filter(|s| s.message_id.as_deref() == id).map(|s| s.disposition).collect()
    };
    assert_eq!(of(Some("order-1")), vec![Disposition::Ack], "{replayed:?}");
    assert_eq!(of(None), vec![Disposition::DeadLetter], "a copy of a message without an id has none: {replayed:?}");
    // The copies (stream sequences 3 and 4) carry ids of their own, from the originals' (1 and 2).
    let mut copy_ids = Vec::new();
    for sequence in [3, 4] {
        let copy = stream.get_raw_message(sequence).await.expect("a dead-letter copy");
        assert_eq!(copy.subject.as_str(), dead, "sequence {sequence} is a copy");
        copy_ids.push(copy.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned()));
    }
    copy_ids.sort();
    assert_eq!(copy_ids, vec![Some(format!("{name}.work.1")), Some(format!("{name}.work.2"))]);
    let _ = js.delete_stream(&name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_max_attempts_sets_the_cap() {
    const TEST: &str = "jetstream_max_attempts_sets_the_cap";
    let Some(nats) = services::nats_url(TEST) else { return };
    let streams = Streams::create(&nats).await;
    let pull = streams.consumer("attempts").await;

    let seen: Seen = Arc::default();
    let runs: Arc<Mutex<Vec<(String, i64)>>> = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (js, seen, runs) = (streams.js.clone(), Arc::clone(&seen), Arc::clone(&runs));
        let dead_subject = streams.dead_subject.clone();
        async move {
            Consumer::new(js, pull)
                .dead_letter(dead_subject)
                .max_attempts(3)
                .retry_delay(Duration::from_millis(50))
                .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                .run_until(
                    |message| {
                        runs.lock().unwrap().push((message.id().to_owned(), message.delivered()));
                        async move {
                            // "twice" fails on its first two attempts, "always" on every one.
                            if message.id() == "always" || message.delivered() < 3 { Err(Declined) } else { Ok(()) }
                        }
                    },
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
        }
    });

    streams.publish(Some(("Nats-Msg-Id", "twice")), b"fails twice").await;
    streams.publish(Some(("Nats-Msg-Id", "always")), b"always fails").await;
    wait_for(&seen, |s| {
        s.iter().any(|s| s.message_id.as_deref() == Some("twice") && s.disposition == Disposition::Ack)
            && s.iter().any(|s| s.disposition == Disposition::DeadLetter)
    })
    .await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task").expect("the consumer");

    let runs = runs.lock().unwrap().clone();
    let of = |id: &str| -> Vec<i64> { runs.iter().filter(|(i, _)| i == id).map(|(_, d)| *d).collect() };
    assert_eq!(of("twice"), vec![1, 2, 3], "{runs:?}");
    assert_eq!(of("always"), vec![1, 2, 3], "dead-lettered on the third: {runs:?}");
    let settled = seen.lock().unwrap().clone();
    let attempts = |id: &str| -> Vec<(Disposition, u32)> {
        settled.iter().filter(|s| s.message_id.as_deref() == Some(id)).map(|s| (s.disposition, s.attempt)).collect()
    };
    assert_eq!(attempts("twice"), vec![(Disposition::Retry, 1), (Disposition::Retry, 2), (Disposition::Ack, 3)]);
    assert_eq!(
        attempts("always"),
        vec![(Disposition::Retry, 1), (Disposition::Retry, 2), (Disposition::DeadLetter, 3)]
    );
    let letters = streams.dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert!(letters[0].1.contains("attempt 3 of 3"), "{letters:?}");
    streams.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_lower_max_deliver_is_the_cap() {
    const TEST: &str = "jetstream_a_lower_max_deliver_is_the_cap";
    let Some(nats) = services::nats_url(TEST) else { return };
    let streams = Streams::create(&nats).await;
    let work = streams.js.get_stream(&streams.work).await.expect("the work stream");
    let config =
        pull::Config { durable_name: Some("capped".into()), ack_wait: ACK_WAIT, max_deliver: 2, ..Default::default() };
    let pull = work.create_consumer(config).await.expect("create the consumer");

    let seen: Seen = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (js, seen, dead_subject) = (streams.js.clone(), Arc::clone(&seen), streams.dead_subject.clone());
        async move {
            // The default max_attempts (5) is above the consumer's max_deliver (2).
            Consumer::new(js, pull)
                .dead_letter(dead_subject)
                .retry_delay(Duration::from_millis(50))
                .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                .run_until(|_message| async move { Err::<(), _>(Declined) }, async move {
                    let _ = stopped.await;
                })
                .await
        }
    });
    streams.publish(Some(("Nats-Msg-Id", "capped")), b"always fails").await;
    wait_for(&seen, |s| s.iter().any(|s| s.disposition == Disposition::DeadLetter)).await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task").expect("the consumer");

    let settled: Vec<(Disposition, u32)> = seen.lock().unwrap().iter().map(|s| (s.disposition, s.attempt)).collect();
    assert_eq!(
        settled,
        vec![(Disposition::Retry, 1), (Disposition::DeadLetter, 2)],
        "JetStream would not deliver a third"
    );
    let letters = streams.dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert!(letters[0].1.contains("attempt 2 of 2"), "{letters:?}");
    streams.delete().await;
}

/// A consumer (`max_deliver` 1, `concurrency` as given) whose handler always fails, started on a
/// message while its dead-letter subject has no stream: the dead-letter copy of that only
/// delivery fails.
struct FailingCopy {
    seen: Seen,
    runs: Arc<AtomicUsize>,
    stop: tokio::sync::oneshot::Sender<()>,
    consumer: tokio::task::JoinHandle<Result<(), async_nats::Error>>,
}

impl FailingCopy {
    /// Starts the consumer `name` on `streams` and returns once its handler has run.
    async fn start(streams: &Streams, name: &str, concurrency: usize) -> FailingCopy {
        streams.js.delete_stream(&streams.dead).await.expect("delete the dead-letter stream");
        let work = streams.js.get_stream(&streams.work).await.expect("the work stream");
        let config =
            pull::Config { durable_name: Some(name.into()), ack_wait: ACK_WAIT, max_deliver: 1, ..Default::default() };
        let pull = work.create_consumer(config).await.expect("create the consumer");
        let (seen, runs): (Seen, _) = (Arc::default(), Arc::new(AtomicUsize::new(0)));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let consumer = tokio::spawn({
            let (js, seen, runs, dead_subject) =
                (streams.js.clone(), Arc::clone(&seen), Arc::clone(&runs), streams.dead_subject.clone());
            async move {
                Consumer::new(js, pull)
                    .dead_letter(dead_subject)
                    .concurrency(concurrency)
                    .retry_delay(Duration::from_millis(100))
                    .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                    .run_until(
                        move |_message| {
                            runs.fetch_add(1, Ordering::SeqCst);
                            async move { Err::<(), _>(Declined) }
                        },
                        async move {
                            let _ = stopped.await;
                        },
                    )
                    .await
            }
        });
        streams.publish(Some(("Nats-Msg-Id", name)), b"always fails").await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while runs.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "the message was not delivered");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        FailingCopy { seen, runs, stop, consumer }
    }
}

/// A message's last delivery (`max_deliver` 1) is dead-lettered while the dead-letter subject
/// has no stream to store it (an operator's mistake, or JetStream unable to store for a while):
/// the copy fails. JetStream would not deliver the message again, so a `-NAK` would leave it,
/// never handled and never dead-lettered, where only its stream sequence finds it. The consumer
/// must keep it in progress and publish the copy once the subject takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_dead_letter_copy_that_fails_on_the_last_delivery_is_published_once_it_can_be() {
    const TEST: &str = "jetstream_a_dead_letter_copy_that_fails_on_the_last_delivery_is_published_once_it_can_be";
    let Some(nats) = services::nats_url(TEST) else { return };
    let streams = Streams::create(&nats).await;
    let FailingCopy { seen, runs, stop, consumer } = FailingCopy::start(&streams, "last", 16).await;
    // Longer than `ack_wait`, so a message not kept in progress would be past saving.
    tokio::time::sleep(ACK_WAIT + Duration::from_secs(1)).await;
    let config = stream::Config {
        name: streams.dead.clone(),
        subjects: vec![streams.dead_subject.clone()],
        ..Default::default()
    };
    streams.js.create_stream(config).await.expect("create the dead-letter stream");
    wait_for(&seen, |s| s.iter().any(|s| s.disposition == Disposition::DeadLetter)).await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task").expect("the consumer");

    let letters = streams.dead_letters().await;
    assert_eq!(letters.len(), 1, "one copy: {letters:?}");
    assert_eq!(letters[0].2.as_deref(), Some("last"), "{letters:?}");
    assert!(letters[0].1.contains("attempt 1 of 1"), "{letters:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "JetStream delivered it once");
    let info = streams.drained("last").await;
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0), "the delivery was settled");
    streams.delete().await;
}

/// As above, but the dead-letter subject never gets a stream, and the consumer is stopped while
/// the copy keeps failing, with its one slot taken by that message: `run_until` returns (the
/// message is given up with an `ERROR` naming its stream sequence), it does not wait for a copy
/// that cannot be stored.
// A current-thread runtime: the log capture sees every task of the test.
#[tokio::test]
async fn jetstream_a_consumer_stopped_while_a_last_delivery_copy_fails_returns() {
    const TEST: &str = "jetstream_a_consumer_stopped_while_a_last_delivery_copy_fails_returns";
    let Some(nats) = services::nats_url(TEST) else { return };
    let logs = LogCapture::install();
    let streams = Streams::create(&nats).await;
    let FailingCopy { seen, stop, consumer, .. } = FailingCopy::start(&streams, "given-up", 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.send(()).expect("the consumer runs");
    let returned = tokio::time::timeout(Duration::from_secs(5), consumer).await;
    returned.expect("run_until returns once stopped").expect("the consumer task").expect("the consumer");
    assert!(seen.lock().unwrap().is_empty(), "nothing was settled: {:?}", seen.lock().unwrap());
    let sequence = format!("{}.given-up.1", streams.work);
    let given_up: Vec<String> = logs
        .events()
        .into_iter()
        .filter(|e| e.starts_with("ERROR idempotent::consume:") && e.contains("before the consumer stopped"))
        .collect();
    assert_eq!(given_up.len(), 1, "given up once, at ERROR: {:?}", logs.events());
    assert!(given_up[0].contains(&sequence), "the log names {sequence}: {given_up:?}");
    streams.delete().await;
}

/// The store is down (a real Redis behind a proxy that refuses connections) for the consumer's
/// `max_deliver` deliveries: each is `nak`ed as "not the message's fault" (README: "a store outage
/// ... makes a message wait, never dead-letters it"). But JetStream does not deliver a message
/// again after `max_deliver`: once the store is back, the message must still be handled (or at
/// least dead-lettered), not dropped with its work never done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_store_outage_through_max_deliver_does_not_lose_the_message() {
    const TEST: &str = "jetstream_a_store_outage_through_max_deliver_does_not_lose_the_message";
    let Some(nats) = services::nats_url(TEST) else { return };
    let Some((store, cleanup, proxy)) = fresh::redis_behind_proxy(TEST).await else { return };
    let store = Arc::new(store);
    let streams = Streams::create(&nats).await;
    let work = streams.js.get_stream(&streams.work).await.expect("the work stream");
    let config =
        pull::Config { durable_name: Some("outage".into()), ack_wait: ACK_WAIT, max_deliver: 3, ..Default::default() };
    let pull = work.create_consumer(config).await.expect("create the consumer");

    // The store goes down.
    proxy.set_mode(idempotent_tests::proxy::Mode::Refuse);
    proxy.kill_connections();

    let seen: Seen = Arc::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (js, seen, runs, store) = (streams.js.clone(), Arc::clone(&seen), Arc::clone(&runs), Arc::clone(&store));
        let dead_subject = streams.dead_subject.clone();
        async move {
            Consumer::new(js, pull)
                .dead_letter(dead_subject)
                .retry_delay(Duration::from_millis(100))
                .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                .run_until(
                    |message| {
                        let (runs, store) = (Arc::clone(&runs), Arc::clone(&store));
                        async move {
                            Call::new("outage", message.id())
                                .run(&*store, async move {
                                    runs.fetch_add(1, Ordering::SeqCst);
                                    Ok::<_, Error>(())
                                })
                                .await
                        }
                    },
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
        }
    });

    streams.publish(Some(("Nats-Msg-Id", "order-1")), b"charge").await;
    wait_for(&seen, |s| s.len() >= 3).await; // the max_deliver deliveries, each settled
    // The store is back; the message had its max_deliver deliveries, all nak'ed for the outage.
    proxy.set_mode(idempotent_tests::proxy::Mode::Pass);
    tokio::time::sleep(ACK_WAIT + Duration::from_secs(2)).await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task").expect("the consumer");

    let settled: Vec<(Disposition, u32, Option<String>)> =
        seen.lock().unwrap().iter().map(|s| (s.disposition, s.attempt, s.reason.clone())).collect();
    let info = streams.drained("outage").await;
    let letters = streams.dead_letters().await;
    println!(
        "settlements {settled:?}; body runs {}; consumer pending {} / unacked {}; dead letters {}",
        runs.load(Ordering::SeqCst),
        info.num_pending,
        info.num_ack_pending,
        letters.len()
    );
    assert!(
        runs.load(Ordering::SeqCst) == 1 || !letters.is_empty(),
        "the message was neither handled once the store came back nor dead-lettered: \
         JetStream dropped it after max_deliver nak's for the outage. settlements {settled:?}, dead letters {letters:?}"
    );
    streams.delete().await;
    cleanup.run().await;
}

/// A pull consumer with `AckPolicy::All` (which JetStream accepts for a pull consumer): the
/// consumer acks each message as it finishes, concurrently, and an ack of a later message acks
/// every earlier one, also one whose handler is still running and then fails. That message must
/// not be lost: either the consumer refuses the policy, or the failed message runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_an_ack_all_consumer_does_not_lose_a_failed_message() {
    const TEST: &str = "jetstream_an_ack_all_consumer_does_not_lose_a_failed_message";
    let Some(nats) = services::nats_url(TEST) else { return };
    let streams = Streams::create(&nats).await;
    let work = streams.js.get_stream(&streams.work).await.expect("the work stream");
    let config = pull::Config {
        durable_name: Some("ackall".into()),
        ack_wait: ACK_WAIT,
        ack_policy: jetstream::consumer::AckPolicy::All,
        ..Default::default()
    };
    let pull = match work.create_consumer(config).await {
        Ok(pull) => pull,
        Err(e) => {
            println!("JetStream refuses an AckPolicy::All pull consumer: {e}");
            streams.delete().await;
            return;
        }
    };

    let seen: Seen = Arc::default();
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let failed_once = Arc::new(AtomicBool::new(false));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (js, seen, runs, failed_once) =
            (streams.js.clone(), Arc::clone(&seen), Arc::clone(&runs), Arc::clone(&failed_once));
        async move {
            Consumer::new(js, pull)
                .concurrency(2)
                .retry_delay(Duration::from_millis(50))
                .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                .run_until(
                    |message| {
                        runs.lock().unwrap().push(message.id().to_owned());
                        let failed_once = Arc::clone(&failed_once);
                        async move {
                            if message.id() == "slow-fails-once" && !failed_once.swap(true, Ordering::SeqCst) {
                                tokio::time::sleep(Duration::from_millis(500)).await;
                                return Err(Declined);
                            }
                            Ok(())
                        }
                    },
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
        }
    });
    streams.publish(Some(("Nats-Msg-Id", "slow-fails-once")), b"slow").await;
    streams.publish(Some(("Nats-Msg-Id", "fast")), b"fast").await;
    // Time for the retry (50 ms delay) and, were the nak lost, for a redelivery after ack_wait.
    let deadline = Instant::now() + ACK_WAIT * 3;
    while Instant::now() < deadline && !consumer.is_finished() {
        if seen
            .lock()
            .unwrap()
            .iter()
            .any(|s| s.message_id.as_deref() == Some("slow-fails-once") && s.disposition == Disposition::Ack)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    let result = consumer.await.expect("the consumer task");
    let runs = runs.lock().unwrap().clone();
    let settled: Vec<(Option<String>, Disposition)> =
        seen.lock().unwrap().iter().map(|s| (s.message_id.clone(), s.disposition)).collect();
    println!("run result {result:?}; runs {runs:?}; settled {settled:?}");
    let slow_runs = runs.iter().filter(|id| *id == "slow-fails-once").count();
    assert!(
        result.is_err() || slow_runs >= 2,
        "the failed message never ran again (JetStream took it as acked by the later message's ack): runs {runs:?}, \
         settled {settled:?}"
    );
    streams.delete().await;
}

/// The amount in a payment message's payload (panics on a malformed one, as `.expect` does).
fn amount_in(data: &[u8]) -> u64 {
    std::str::from_utf8(data).ok().and_then(|text| text.parse().ok()).expect("a payment message holds an amount")
}

/// The payment handler's `async fn`.
async fn pay(amount: u64) -> Result<u64, Error> {
    tokio::task::yield_now().await;
    Ok(amount)
}

/// A handler written as a closure that calls an `async fn` with an argument it decodes first:
/// the decoding runs when the handler is called, before its future is polled. A panic there is a
/// panic of the handler like any other: retried, then dead-lettered, the consumer keeps running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_handler_that_panics_before_its_future_is_a_failure_not_a_crash() {
    const TEST: &str = "jetstream_a_handler_that_panics_before_its_future_is_a_failure_not_a_crash";
    let Some(nats) = services::nats_url(TEST) else { return };
    let streams = Streams::create(&nats).await;
    let pull = streams.consumer("early").await;

    let seen: Seen = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (js, seen, dead_subject) = (streams.js.clone(), Arc::clone(&seen), streams.dead_subject.clone());
        async move {
            Consumer::new(js, pull)
                .dead_letter(dead_subject)
                .max_attempts(2)
                .retry_delay(Duration::from_millis(50))
                .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                .run_until(|message| pay(amount_in(message.payload())), async move {
                    let _ = stopped.await;
                })
                .await
        }
    });

    streams.publish(Some(("Nats-Msg-Id", "malformed")), b"twelve").await;
    streams.publish(Some(("Nats-Msg-Id", "fine")), b"12").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && !consumer.is_finished() && seen.lock().unwrap().len() < 3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    let ended = consumer.await;
    let settled: Vec<(Option<String>, Disposition, u32)> =
        seen.lock().unwrap().iter().map(|s| (s.message_id.clone(), s.disposition, s.attempt)).collect();
    println!("consumer: {ended:?}; settled {settled:?}");
    assert!(ended.is_ok(), "the consumer task panicked: {ended:?}; settled {settled:?}");
    assert_eq!(settlements_of(&seen, "fine"), vec![(Disposition::Ack, None)]);
    let malformed: Vec<Disposition> = settlements_of(&seen, "malformed").into_iter().map(|(d, _)| d).collect();
    assert_eq!(malformed, vec![Disposition::Retry, Disposition::DeadLetter]);
    streams.delete().await;
}

/// The module docs' setup: a stream that keeps `<prefix>.>` (the work subject and the dead-letter
/// subject both), a consumer without a filter subject, and `.dead_letter("<prefix>.dead-letter")`.
/// The dead-letter copy of a message without an id lands in the stream the consumer reads: it
/// must be dead-lettered once, not copied again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_dead_letter_subject_the_consumer_also_reads_does_not_loop() {
    const TEST: &str = "jetstream_a_dead_letter_subject_the_consumer_also_reads_does_not_loop";
    let Some(nats) = services::nats_url(TEST) else { return };
    let client = async_nats::connect(&nats).await.expect("connect to NATS");
    let js = jetstream::new(client);
    let suffix = fresh::suffix();
    let (name, prefix) = (format!("IDEM_ALL_{suffix}"), format!("idem.{suffix}"));
    let config = stream::Config { name: name.clone(), subjects: vec![format!("{prefix}.>")], ..Default::default() };
    let stream = js.create_stream(config).await.expect("create the stream");
    let config = pull::Config { durable_name: Some("workers".into()), ack_wait: ACK_WAIT, ..Default::default() };
    let pull = stream.create_consumer(config).await.expect("the consumer");

    let seen: Seen = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (js, seen, dead) = (js.clone(), Arc::clone(&seen), format!("{prefix}.dead-letter"));
        async move {
            Consumer::new(js, pull)
                .dead_letter(dead)
                .on_settled(move |s| seen.lock().unwrap().push(s.clone()))
                .run_until(|_message| async move { Ok::<_, Error>(()) }, async move {
                    let _ = stopped.await;
                })
                .await
        }
    });
    js.publish(format!("{prefix}.payments"), "no id".into()).await.expect("publish").await.expect("a publish ack");
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task").expect("the consumer");

    let dead = seen.lock().unwrap().iter().filter(|s| s.disposition == Disposition::DeadLetter).count();
    let stored = js.get_stream(&name).await.expect("the stream").info().await.expect("its info").state.messages;
    println!("dead-letter settlements in 3 s: {dead}; messages in the stream: {stored}");
    assert!(dead <= 2, "the copies are dead-lettered again and again: {dead} in 3 s, {stored} messages stored");
    let _ = js.delete_stream(&name).await;
}
