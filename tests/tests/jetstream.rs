//! The idempotent consumer on a real NATS JetStream (`idempotent_runtime::consume::jetstream`).
//!
//! 1. Kill and redeliver: competing worker processes (`tests/src/bin/consumer_worker.rs`) pull
//!    from one durable consumer while a producer publishes messages with a `Nats-Msg-Id` (some
//!    twice, which JetStream's duplicate window drops) and malformed ones without. Workers SIGKILL
//!    themselves at scheduled ids, after the side effect ran and its record was written (Redis
//!    store), before the ack; JetStream redelivers after `ack_wait`; killed workers are restarted.
//!    Then: one side effect per id in the PostgreSQL ledger, nothing pending or unacknowledged on
//!    the consumer, and the dead-letter stream holds exactly the malformed messages.
//! 2. Settlement by outcome, in process: a reused id with another body and a message without an
//!    id go to the dead-letter subject with their reason, a message whose id is claimed elsewhere
//!    is `nak`ed with the delay (not in a hot loop) and acked once the claim completes.

#![cfg(all(feature = "jetstream", feature = "postgres", feature = "redis"))]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_runtime::consume::jetstream::async_nats::jetstream::{self, Context, consumer::pull, stream};
use idempotent_runtime::consume::jetstream::async_nats::{self, HeaderMap};
use idempotent_runtime::consume::jetstream::{Consumer, DEAD_LETTER_MESSAGE_ID, DEAD_LETTER_REASON};
use idempotent_runtime::consume::{Disposition, Settled};
use idempotent_runtime::{Call, Error, MemoryStore};
use idempotent_tests::consume::{Fleet, Ledger, assert_exactly_once, kill_schedule, malformed_body, message_id};
use idempotent_tests::{fresh, services};

const MESSAGES: usize = 1000;
const MALFORMED: usize = 20;
const DUPLICATE_EVERY: usize = 50;
const WORKERS: usize = 3;
const KILLS: usize = 10;
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
        let stream = self.js.get_stream(&self.work).await.expect("the work stream");
        let config = pull::Config { durable_name: Some(name.to_owned()), ack_wait: ACK_WAIT, ..Default::default() };
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

    async fn delete(self) {
        for name in [&self.work, &self.dead] {
            let _ = self.js.delete_stream(name).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_workers_sigkilled_before_the_ack_apply_each_message_once() {
    const TEST: &str = "jetstream_workers_sigkilled_before_the_ack_apply_each_message_once";
    let Some(nats) = services::nats_url(TEST) else { return };
    let Some(redis) = services::redis_url(TEST) else { return };
    let Some(pg) = services::postgres_url(TEST) else { return };
    let (store, cleanup) = fresh::redis_at(&redis).await;
    let ledger = Ledger::create(&pg).await;
    let streams = Streams::create(&nats).await;
    let mut consumer = streams.consumer("workers").await;

    let kill_ids = kill_schedule(MESSAGES, KILLS);
    let expected = MESSAGES + MALFORMED;
    let args = vec![
        "jetstream".to_owned(),
        nats.clone(),
        format!("{}|workers|{}", streams.work, streams.dead_subject),
        format!("redis:{redis}|{}", store.prefix()),
        format!("{pg}|{}", ledger.table),
        kill_ids.join(","),
    ];
    let started = Instant::now();
    let fleet = Fleet::start(env!("CARGO_BIN_EXE_consumer_worker"), WORKERS, args);
    let tally = tokio::task::spawn_blocking(move || fleet.run_until_settled(expected, Duration::from_secs(120)));
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
    assert!(tally.dead_lettered.iter().all(|id| id == "-"), "only messages without an id are dead-lettered: {tally:?}");
    assert_eq!(tally.dead_lettered.len(), MALFORMED, "{tally:?}");
    assert!(tally.redelivered >= KILLS, "each killed delivery came back as a redelivery: {tally:?}");
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0), "nothing pending or unacknowledged: {info:?}");
    let letters = streams.dead_letters().await;
    let mut bodies: Vec<String> = letters.iter().map(|(body, _, _)| body.clone()).collect();
    bodies.sort();
    let mut malformed: Vec<String> = (0..MALFORMED).map(malformed_body).collect();
    malformed.sort();
    assert_eq!(bodies, malformed, "the dead-letter stream holds exactly the malformed messages");
    assert!(letters.iter().all(|(_, reason, id)| reason.contains("no id") && id.is_none()), "{letters:?}");
    println!(
        "JetStream kill-and-redeliver: {MESSAGES} messages with ids ({dropped} duplicate publishes dropped by \
         JetStream) + {MALFORMED} without an id, {WORKERS} competing workers ({} processes started), {} SIGKILLs \
         after the record and before the ack, {} deliveries settled as redelivered, {} retried; double effects {doubles}, ledger rows {}, pending 0, unacknowledged 0, dead letters {} (all \
         malformed); {:.1} s",
        tally.started,
        tally.kills,
        tally.redelivered,
        tally.retried,
        counts.values().sum::<i64>(),
        letters.len(),
        elapsed.as_secs_f64()
    );

    streams.delete().await;
    ledger.drop_table().await;
    cleanup.run().await;
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
