//! The idempotent consumer on a real RabbitMQ (`idempotent_runtime::consume::amqp`).
//!
//! 1. Kill and redeliver: competing worker processes (`tests/src/bin/consumer_worker.rs`) consume
//!    one queue while a producer publishes messages with ids (some twice, as a retrying producer
//!    does), malformed ones without an id and poison ones (their handler always fails). Workers
//!    SIGKILL themselves at scheduled ids, after the side effect ran and its record was written,
//!    before the ack; RabbitMQ redelivers; killed workers are restarted. The handler panics at
//!    other scheduled ids, once, before the side effect. Then: one side effect per id in the
//!    PostgreSQL ledger, nothing left in the queue, every panic retried, and the dead-letter queue
//!    holds exactly the malformed and the poison messages, each poison one after its attempts.
//! 2. Settlement by outcome, in process: a reused id with another body and a message without an id
//!    are dead-lettered, a message whose id is claimed elsewhere is retried after the delay (not in
//!    a hot loop) and acked once the claim completes; a failing handler follows its policy; a
//!    panicking handler is a failure the consumer survives; a handler that always fails or panics
//!    is dead-lettered after the attempts.

#![cfg(all(feature = "amqp", feature = "postgres", feature = "redis"))]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_runtime::consume::amqp::lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use idempotent_runtime::consume::amqp::lapin::types::FieldTable;
use idempotent_runtime::consume::amqp::lapin::{self, BasicProperties, Channel, Connection};
use idempotent_runtime::consume::amqp::{Consumer, declare_with_dead_letter};
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

async fn connect(url: &str) -> (Connection, Channel) {
    let connection =
        Connection::connect(url, lapin::ConnectionProperties::default()).await.expect("connect to RabbitMQ");
    let channel = connection.create_channel().await.expect("a channel");
    channel.confirm_select(ConfirmSelectOptions::default()).await.expect("publisher confirms");
    (connection, channel)
}

async fn publish(channel: &Channel, queue: &str, id: Option<&str>, body: &[u8]) {
    publish_to(channel, "", queue, id, body).await;
}

async fn publish_to(channel: &Channel, exchange: &str, routing_key: &str, id: Option<&str>, body: &[u8]) {
    let mut properties = BasicProperties::default().with_delivery_mode(2);
    if let Some(id) = id {
        properties = properties.with_message_id(id.into());
    }
    let confirm = channel
        .basic_publish(exchange.into(), routing_key.into(), BasicPublishOptions::default(), body, properties)
        .await
        .expect("publish");
    assert!(confirm.await.expect("a confirmation").is_ack(), "RabbitMQ refused a message");
}

/// Deletes a test's queues and closes its connection.
async fn delete_and_close(connection: Connection, channel: &Channel, queues: [&str; 2]) {
    for queue in queues {
        channel.queue_delete(queue.into(), QueueDeleteOptions::default()).await.expect("delete a queue");
    }
    let _ = connection.close(200, "done".into()).await;
}

async fn message_count(channel: &Channel, queue: &str) -> u32 {
    let options = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    channel.queue_declare(queue.into(), options, FieldTable::default()).await.expect("the queue").message_count()
}

/// The producer: every id once, every `DUPLICATE_EVERY`-th id twice, malformed and poison
/// messages in between. Returns how many messages it published.
async fn produce(channel: &Channel, queue: &str) -> usize {
    let mut published = 0;
    for i in 0..MESSAGES {
        let id = message_id(i);
        let body = format!("{{\"amount\":{i}}}");
        publish(channel, queue, Some(&id), body.as_bytes()).await;
        published += 1;
        if i % DUPLICATE_EVERY == 0 {
            publish(channel, queue, Some(&id), body.as_bytes()).await;
            published += 1;
        }
        if i % (MESSAGES / MALFORMED) == 0 {
            publish(channel, queue, None, malformed_body(i / (MESSAGES / MALFORMED)).as_bytes()).await;
            published += 1;
        }
        if i % (MESSAGES / POISON) == 7 {
            let poison = poison_id(i / (MESSAGES / POISON));
            publish(channel, queue, Some(&poison), poison.as_bytes()).await;
            published += 1;
        }
    }
    published
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_workers_sigkilled_before_the_ack_apply_each_message_once() {
    workers_sigkilled_before_the_ack("amqp_workers_sigkilled_before_the_ack_apply_each_message_once", "").await;
}

/// The same fleet with the store behind a `BatchingStore` in each worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_workers_sigkilled_before_the_ack_apply_each_message_once_through_batching() {
    workers_sigkilled_before_the_ack(
        "amqp_workers_sigkilled_before_the_ack_apply_each_message_once_through_batching",
        "batching-",
    )
    .await;
}

/// The kill-and-redeliver scenario; `wrapper` prefixes the workers' store argument
/// (`batching-`: the store behind a `BatchingStore`).
async fn workers_sigkilled_before_the_ack(test: &str, wrapper: &str) {
    let Some(amqp) = services::amqp_url(test) else { return };
    let Some(pg) = services::postgres_url(test) else { return };
    let (store, cleanup) = fresh::postgres_at(&pg, 2).await.expect("a fresh store");
    let ledger = Ledger::create(&pg).await;
    let queue = format!("idempotent-consume-{}", fresh::suffix());
    let (connection, channel) = connect(&amqp).await;
    let dead = declare_with_dead_letter(&channel, &queue).await.expect("declare the queues");

    let kill_ids = kill_schedule(MESSAGES, KILLS);
    let panic_ids = panic_schedule(MESSAGES, PANICS, KILLS);
    let duplicates = MESSAGES.div_ceil(DUPLICATE_EVERY);
    let expected = MESSAGES + duplicates + MALFORMED + POISON;
    let args = vec![
        "amqp".to_owned(),
        amqp.clone(),
        queue.clone(),
        format!("{wrapper}postgres:{pg}|{}", store.table()),
        format!("{pg}|{}", ledger.table),
        kill_ids.join(","),
        panic_ids.join(","),
    ];
    let started = Instant::now();
    let fleet = Fleet::start(env!("CARGO_BIN_EXE_consumer_worker"), WORKERS, args);
    let tally = tokio::task::spawn_blocking(move || fleet.run_until_settled(expected, Duration::from_secs(60)));
    let published = produce(&channel, &queue).await;
    assert_eq!(published, expected);
    let tally = tally.await.expect("the fleet");
    let elapsed = started.elapsed();

    // Every side effect exactly once, every kill happened, every panic was retried, nothing left,
    // the malformed and the poison ones dead-lettered (the poison ones after their attempts).
    let counts = ledger.counts().await;
    let doubles = assert_exactly_once(&counts, MESSAGES);
    assert_eq!(tally.kills, KILLS, "every scheduled kill happened once: {tally:?}");
    assert_eq!(tally.acked, MESSAGES + duplicates, "{tally:?}");
    let poison_ids: Vec<String> = (0..POISON).map(poison_id).collect();
    let mut dead_ids = tally.dead_lettered.clone();
    dead_ids.sort();
    let mut expected_dead = vec!["-".to_owned(); MALFORMED];
    expected_dead.extend(poison_ids.iter().cloned());
    expected_dead.sort();
    assert_eq!(dead_ids, expected_dead, "dead-lettered: the messages without an id and the poison ones, once each");
    let failed_once_less: BTreeMap<String, usize> =
        poison_ids.iter().map(|id| (id.clone(), MAX_ATTEMPTS - 1)).collect();
    assert_eq!(tally.failed, failed_once_less, "each poison message ran {MAX_ATTEMPTS} times, then dead-lettered");
    let panicked_once: BTreeMap<String, usize> = panic_ids.iter().map(|id| (id.clone(), 1)).collect();
    assert_eq!(tally.panicked, panicked_once, "each scheduled panic was retried once: {tally:?}");
    assert_eq!(ledger.panicked().await, panic_ids, "each scheduled panic happened once");
    assert!(tally.redelivered >= KILLS, "each killed delivery came back flagged as redelivered: {tally:?}");
    assert_eq!(message_count(&channel, &queue).await, 0, "nothing left in the queue, acked or not");
    let mut dead_bodies = Vec::new();
    while let Some(message) =
        channel.basic_get(dead.as_str().into(), BasicGetOptions::default()).await.expect("read the dead letters")
    {
        let body = String::from_utf8(message.delivery.data.clone()).expect("a text body");
        let id = message.delivery.properties.message_id().as_ref().map(|id| id.as_str().to_owned());
        assert!(id.is_none() || id.as_deref() == Some(body.as_str()), "a poison letter keeps its id: {id:?} {body}");
        dead_bodies.push(body);
        message.delivery.ack(BasicAckOptions::default()).await.expect("ack a dead letter");
    }
    dead_bodies.sort();
    let mut letters: Vec<String> = (0..MALFORMED).map(malformed_body).chain(poison_ids.iter().cloned()).collect();
    letters.sort();
    assert_eq!(dead_bodies, letters, "the dead-letter queue holds exactly the malformed and the poison messages");
    println!(
        "AMQP kill-and-redeliver ({wrapper}postgres): {MESSAGES} messages with ids + {duplicates} duplicate publishes + {MALFORMED} \
         without an id + {POISON} poison, {WORKERS} competing workers ({} processes started), {} SIGKILLs after \
         the record and before the ack, {} panics before the side effect (each retried once), {} deliveries \
         settled as redelivered, {} retried ({} after a poison failure); double effects {doubles}, ledger rows {}, \
         left in the queue 0, dead letters {} ({MALFORMED} malformed, {POISON} poison after {MAX_ATTEMPTS} runs \
         each); {:.1} s",
        tally.started,
        tally.kills,
        tally.panicked.values().sum::<usize>(),
        tally.redelivered,
        tally.retried,
        tally.failed.values().sum::<usize>(),
        counts.values().sum::<i64>(),
        dead_bodies.len(),
        elapsed.as_secs_f64()
    );

    delete_and_close(connection, &channel, [&queue, &dead]).await;
    ledger.drop_table().await;
    cleanup.run().await;
}

/// The settlements seen by an in-process consumer, with the time each happened.
type Seen = Arc<Mutex<Vec<(Instant, Settled)>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_settles_each_outcome_as_documented() {
    const TEST: &str = "amqp_settles_each_outcome_as_documented";
    const DELAY: Duration = Duration::from_millis(300);
    let Some(amqp) = services::amqp_url(TEST) else { return };
    let (connection, channel) = connect(&amqp).await;
    let queue = format!("idempotent-settle-{}", fresh::suffix());
    let dead = declare_with_dead_letter(&channel, &queue).await.expect("declare the queues");
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
    let attempts: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (store, seen, attempts) = (Arc::clone(&store), Arc::clone(&seen), Arc::clone(&attempts));
        let (channel, queue) = (channel.clone(), queue.clone());
        async move {
            Consumer::new(channel, queue)
                .concurrency(4)
                .retry_delay(DELAY)
                .on_settled(move |s| seen.lock().unwrap().push((Instant::now(), s.clone())))
                .run_until(
                    |message| {
                        let (store, attempts) = (Arc::clone(&store), Arc::clone(&attempts));
                        async move {
                            attempts.lock().unwrap().push((message.id().to_owned(), Instant::now()));
                            let body = message.data().to_vec();
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

    publish(&channel, &queue, Some("a"), b"first").await;
    wait_for(&seen, |s| s.iter().any(|(_, s)| s.message_id.as_deref() == Some("a"))).await;
    publish(&channel, &queue, Some("a"), b"another body").await; // the id reused: dead-letter
    publish(&channel, &queue, None, b"no id").await; // dead-letter
    publish(&channel, &queue, Some("busy"), b"busy-body").await; // in progress elsewhere: retried
    wait_for(&seen, |s| s.iter().filter(|(_, s)| s.disposition == Disposition::Retry).count() >= 2).await;
    finish.send(()).expect("the holder is waiting");
    assert_eq!(holder.await.expect("the holder").expect("the holder's call"), "done elsewhere");
    wait_for(&seen, |s| {
        s.iter().any(|(_, s)| s.message_id.as_deref() == Some("busy") && s.disposition == Disposition::Ack)
    })
    .await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task").expect("the consumer");

    let seen = seen.lock().unwrap().clone();
    let of = |id: Option<&str>| -> Vec<(Disposition, bool)> {
        seen.iter()
            .filter(|(_, s)| s.message_id.as_deref() == id)
            .map(|(_, s)| (s.disposition, s.redelivered))
            .collect()
    };
    let a = of(Some("a"));
    assert_eq!(a, vec![(Disposition::Ack, false), (Disposition::DeadLetter, false)], "{seen:?}");
    assert_eq!(of(None), vec![(Disposition::DeadLetter, false)]);
    let busy = of(Some("busy"));
    // Counted, not ordered: a retry's `nack` can return after its redelivery was replayed and
    // acked, so the observer may see Retry, Retry, Ack, Retry (a CI run did).
    let retries = busy.iter().filter(|(d, _)| *d == Disposition::Retry).count();
    assert!(retries >= 2 && retries + 1 == busy.len(), "two retries or more, and one ack: {busy:?}");
    // Each retry returned a copy of the message (so no quorum queue counts it), which arrives
    // as a new delivery, not flagged as redelivered.
    assert!(busy.contains(&(Disposition::Ack, false)), "acked once the claim completed: {busy:?}");
    // No hot loop: consecutive attempts of the busy message are at least the retry delay apart.
    let times: Vec<Instant> =
        attempts.lock().unwrap().iter().filter(|(id, _)| id == "busy").map(|(_, at)| *at).collect();
    assert_eq!(times.len(), busy.len(), "one attempt per settlement");
    for pair in times.windows(2) {
        assert!(pair[1] - pair[0] >= DELAY, "attempts {:?} apart, under the retry delay {DELAY:?}", pair[1] - pair[0]);
    }
    let unexplained: Vec<_> =
        seen.iter().filter(|(_, s)| s.disposition != Disposition::Ack && s.reason.is_none()).collect();
    assert!(unexplained.is_empty(), "retries or dead letters without a reason: {unexplained:?}");
    assert_eq!(message_count(&channel, &dead).await, 2, "the reused id and the message without an id");
    assert_eq!(message_count(&channel, &queue).await, 0);

    delete_and_close(connection, &channel, [&queue, &dead]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_a_failing_handler_follows_its_policy() {
    let Some(amqp) = services::amqp_url("amqp_a_failing_handler_follows_its_policy") else { return };
    let (connection, channel) = connect(&amqp).await;
    let queue = format!("idempotent-policy-{}", fresh::suffix());
    let dead = declare_with_dead_letter(&channel, &queue).await.expect("declare the queues");

    // A handler's own failure, which the policy calls final, is dead-lettered with its reason.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let failures: Seen = Arc::default();
    publish(&channel, &queue, Some("f"), b"fail-final").await;
    let run = tokio::spawn({
        let (channel, queue, failures) = (channel.clone(), queue.clone(), Arc::clone(&failures));
        async move {
            Consumer::new(channel, queue)
                .on_failure(|_: &Declined| Disposition::DeadLetter)
                .on_settled(move |s| failures.lock().unwrap().push((Instant::now(), s.clone())))
                .run_until(
                    |message| async move { if message.data() == b"fail-final" { Err(Declined) } else { Ok(()) } },
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
        }
    });
    wait_for(&failures, |s| !s.is_empty()).await;
    stop.send(()).expect("the consumer runs");
    run.await.expect("the consumer task").expect("the consumer");
    let failures = failures.lock().unwrap().clone();
    assert_eq!(failures.len(), 1);
    assert_eq!(failures[0].1.disposition, Disposition::DeadLetter);
    assert_eq!(failures[0].1.reason.as_deref(), Some("the handler failed: declined"));
    assert_eq!(message_count(&channel, &dead).await, 1);

    delete_and_close(connection, &channel, [&queue, &dead]).await;
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

async fn wait_for(seen: &Seen, done: impl Fn(&[(Instant, Settled)]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done(&seen.lock().unwrap()) {
        assert!(Instant::now() < deadline, "not settled in time: {:?}", seen.lock().unwrap());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The settlements of one message id by attempt: (disposition, reason). (The copy returned after a
/// failure may be settled before the observer hears of the original's ack.)
fn settlements_of(seen: &Seen, id: &str) -> Vec<(Disposition, Option<String>)> {
    let mut settled: Vec<Settled> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, s)| s.message_id.as_deref() == Some(id))
        .map(|(_, s)| s.clone())
        .collect();
    settled.sort_by_key(|s| s.attempt);
    settled.into_iter().map(|s| (s.disposition, s.reason)).collect()
}

// A current-thread runtime: the log capture sees every task of the test.
#[tokio::test]
async fn amqp_a_panicking_handler_is_retried_and_the_consumer_keeps_running() {
    const TEST: &str = "amqp_a_panicking_handler_is_retried_and_the_consumer_keeps_running";
    let Some(amqp) = services::amqp_url(TEST) else { return };
    let logs = LogCapture::install();
    let (connection, channel) = connect(&amqp).await;
    let queue = format!("idempotent-panic-{}", fresh::suffix());
    let dead = declare_with_dead_letter(&channel, &queue).await.expect("declare the queues");

    let seen: Seen = Arc::default();
    let panicked = Arc::new(AtomicBool::new(false));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (channel, queue, seen, panicked) = (channel.clone(), queue.clone(), Arc::clone(&seen), panicked.clone());
        async move {
            Consumer::new(channel, queue)
                .retry_delay(Duration::from_millis(100))
                .on_settled(move |s| seen.lock().unwrap().push((Instant::now(), s.clone())))
                .run_until(
                    |message| {
                        let panicked = Arc::clone(&panicked);
                        async move {
                            let first = message.data() == b"panics once" && !panicked.swap(true, Ordering::SeqCst);
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

    publish(&channel, &queue, Some("p"), b"panics once").await;
    wait_for(&seen, |s| s.iter().any(|(_, s)| s.message_id.as_deref() == Some("p"))).await;
    publish(&channel, &queue, Some("q"), b"fine").await; // the consumer still runs
    wait_for(&seen, |s| {
        s.iter().any(|(_, s)| s.message_id.as_deref() == Some("p") && s.disposition == Disposition::Ack)
            && s.iter().any(|(_, s)| s.message_id.as_deref() == Some("q"))
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
    assert_eq!(message_count(&channel, &queue).await, 0);
    assert_eq!(message_count(&channel, &dead).await, 0);

    delete_and_close(connection, &channel, [&queue, &dead]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_a_message_that_always_fails_is_dead_lettered_after_the_default_attempts() {
    const TEST: &str = "amqp_a_message_that_always_fails_is_dead_lettered_after_the_default_attempts";
    let Some(amqp) = services::amqp_url(TEST) else { return };
    let (connection, channel) = connect(&amqp).await;
    let queue = format!("idempotent-poison-{}", fresh::suffix());
    let dead = declare_with_dead_letter(&channel, &queue).await.expect("declare the queues");

    let seen: Seen = Arc::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (channel, queue, seen, runs) = (channel.clone(), queue.clone(), Arc::clone(&seen), Arc::clone(&runs));
        async move {
            // The defaults, but for a short retry delay.
            Consumer::new(channel, queue)
                .retry_delay(Duration::from_millis(50))
                .on_settled(move |s| seen.lock().unwrap().push((Instant::now(), s.clone())))
                .run_until(
                    |message| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        async move {
                            match message.data() {
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

    publish(&channel, &queue, Some("fails"), b"always fails").await;
    publish(&channel, &queue, Some("panics"), b"always panics").await;
    wait_for(&seen, |s| s.iter().filter(|(_, s)| s.disposition == Disposition::DeadLetter).count() == 2).await;
    publish(&channel, &queue, Some("after"), b"fine").await;
    wait_for(&seen, |s| s.iter().any(|(_, s)| s.message_id.as_deref() == Some("after"))).await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task").expect("the consumer");

    for id in ["fails", "panics"] {
        let settled = settlements_of(&seen, id);
        let dispositions: Vec<Disposition> = settled.iter().map(|(d, _)| *d).collect();
        let mut expected = vec![Disposition::Retry; MAX_ATTEMPTS - 1];
        expected.push(Disposition::DeadLetter);
        assert_eq!(dispositions, expected, "{id}: {MAX_ATTEMPTS} runs, then the dead-letter queue: {settled:?}");
        let last = settled.last().and_then(|(_, r)| r.clone()).unwrap_or_default();
        assert!(last.contains(&format!("{MAX_ATTEMPTS} of {MAX_ATTEMPTS}")), "the reason says why: {last}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2 * MAX_ATTEMPTS + 1, "the handler ran that often, and once for `after`");
    assert_eq!(message_count(&channel, &queue).await, 0);
    assert_eq!(message_count(&channel, &dead).await, 2, "both are in the dead-letter queue");

    delete_and_close(connection, &channel, [&queue, &dead]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_max_attempts_sets_the_cap_and_each_copy_counts_its_attempt() {
    const TEST: &str = "amqp_max_attempts_sets_the_cap_and_each_copy_counts_its_attempt";
    let Some(amqp) = services::amqp_url(TEST) else { return };
    let (connection, channel) = connect(&amqp).await;
    let queue = format!("idempotent-attempts-{}", fresh::suffix());
    let dead = declare_with_dead_letter(&channel, &queue).await.expect("declare the queues");

    let seen: Seen = Arc::default();
    let runs: Arc<Mutex<Vec<(String, u32, String)>>> = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (channel, queue, seen, runs) = (channel.clone(), queue.clone(), Arc::clone(&seen), Arc::clone(&runs));
        async move {
            Consumer::new(channel, queue)
                .max_attempts(3)
                .retry_delay(Duration::from_millis(50))
                .on_settled(move |s| seen.lock().unwrap().push((Instant::now(), s.clone())))
                .run_until(
                    |message| {
                        let entry = (message.id().to_owned(), message.attempt(), message.routing_key().to_owned());
                        runs.lock().unwrap().push(entry);
                        async move {
                            // "twice" fails on its first two attempts, "always" on every one.
                            if message.id() == "always" || message.attempt() < 3 { Err(Declined) } else { Ok(()) }
                        }
                    },
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
        }
    });

    // Through an exchange, under a routing key that is not the queue's name.
    let routing_key = format!("{queue}.created");
    let (exchange, no_args) = ("amq.direct", FieldTable::default());
    let bind = QueueBindOptions::default();
    channel
        .queue_bind(queue.as_str().into(), exchange.into(), routing_key.as_str().into(), bind, no_args)
        .await
        .expect("bind");
    publish_to(&channel, exchange, &routing_key, Some("twice"), b"fails twice").await;
    publish_to(&channel, exchange, &routing_key, Some("always"), b"always fails").await;
    wait_for(&seen, |s| {
        s.iter().any(|(_, s)| s.message_id.as_deref() == Some("twice") && s.disposition == Disposition::Ack)
            && s.iter().any(|(_, s)| s.disposition == Disposition::DeadLetter)
    })
    .await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task").expect("the consumer");

    let runs = runs.lock().unwrap().clone();
    let of = |id: &str| -> Vec<u32> { runs.iter().filter(|(i, _, _)| i == id).map(|(_, a, _)| *a).collect() };
    assert_eq!(of("twice"), vec![1, 2, 3], "each copy knows its attempt: {runs:?}");
    assert_eq!(of("always"), vec![1, 2, 3], "dead-lettered on the third: {runs:?}");
    assert!(runs.iter().all(|(_, _, key)| *key == routing_key), "the copies keep the routing key: {runs:?}");
    let settled = seen.lock().unwrap().clone();
    let attempts = |id: &str| -> Vec<(Disposition, u32)> {
        let mut of: Vec<(Disposition, u32)> = settled
            .iter()
            .filter(|(_, s)| s.message_id.as_deref() == Some(id))
            .map(|(_, s)| (s.disposition, s.attempt))
            .collect();
        of.sort_by_key(|(_, attempt)| *attempt);
        of
    };
    assert_eq!(attempts("twice"), vec![(Disposition::Retry, 1), (Disposition::Retry, 2), (Disposition::Ack, 3)]);
    assert_eq!(
        attempts("always"),
        vec![(Disposition::Retry, 1), (Disposition::Retry, 2), (Disposition::DeadLetter, 3)]
    );
    assert_eq!(message_count(&channel, &queue).await, 0);
    let letter = channel
        .basic_get(dead.as_str().into(), BasicGetOptions::default())
        .await
        .expect("read the dead letters")
        .expect("one dead letter");
    let id = letter.delivery.properties.message_id().as_ref().map(ToString::to_string);
    assert_eq!(id.as_deref(), Some("always"));
    letter.delivery.ack(BasicAckOptions::default()).await.expect("ack it");

    delete_and_close(connection, &channel, [&queue, &dead]).await;
}

/// A quorum queue with an `x-delivery-limit`, as the module docs advise to bound the loop of a
/// worker killed inside the handler, and a store outage (a real Redis behind a proxy that refuses
/// connections) of a couple of seconds. README: "a store outage or a key claimed elsewhere makes a
/// message wait, never dead-letters it". The consumer's plain `nack` with `requeue` for an
/// `Error::Store` counted as a delivery to the quorum queue (RabbitMQ 3.x counts every requeue),
/// so once the limit was passed RabbitMQ dead-lettered the message (or dropped it, without a
/// dead-letter exchange), its work never done: this test failed so (dead letters 1, the body never
/// ran). Such retries now return a confirmed copy of the message, which the queue counts afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_a_store_outage_on_a_quorum_queue_with_a_delivery_limit_does_not_dead_letter() {
    const TEST: &str = "amqp_a_store_outage_on_a_quorum_queue_with_a_delivery_limit_does_not_dead_letter";
    let Some(amqp) = services::amqp_url(TEST) else { return };
    let Some((store, cleanup, proxy)) = fresh::redis_behind_proxy(TEST).await else { return };
    let store = Arc::new(store);
    let (connection, channel) = connect(&amqp).await;
    let queue = format!("idempotent-quorum-{}", fresh::suffix());
    let dead = format!("{queue}.dead-letter");
    channel
        .queue_declare(dead.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await
        .expect("declare the dead-letter queue");
    let mut arguments = FieldTable::default();
    arguments.insert("x-queue-type".into(), lapin::types::AMQPValue::LongString("quorum".into()));
    arguments.insert("x-delivery-limit".into(), lapin::types::AMQPValue::LongLongInt(2));
    arguments.insert("x-dead-letter-exchange".into(), lapin::types::AMQPValue::LongString("".into()));
    arguments.insert("x-dead-letter-routing-key".into(), lapin::types::AMQPValue::LongString(dead.as_str().into()));
    channel
        .queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), arguments)
        .await
        .expect("declare the quorum queue");

    // The store goes down.
    proxy.set_mode(idempotent_tests::proxy::Mode::Refuse);
    proxy.kill_connections();

    let seen: Seen = Arc::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (channel, queue, seen, runs, store) =
            (channel.clone(), queue.clone(), Arc::clone(&seen), Arc::clone(&runs), Arc::clone(&store));
        async move {
            Consumer::new(channel, queue)
                .retry_delay(Duration::from_millis(100))
                .on_settled(move |s| seen.lock().unwrap().push((Instant::now(), s.clone())))
                .run_until(
                    |message| {
                        let (runs, store) = (Arc::clone(&runs), Arc::clone(&store));
                        async move {
                            Call::new("quorum", message.id())
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

    publish(&channel, &queue, Some("order-1"), b"charge").await;
    // An outage of three retries (each claim fails after the Redis client's reconnection attempts).
    wait_for(&seen, |s| s.iter().filter(|(_, s)| s.disposition == Disposition::Retry).count() >= 3).await;
    proxy.set_mode(idempotent_tests::proxy::Mode::Pass);
    let deadline = Instant::now() + Duration::from_secs(5);
    while runs.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task").expect("the consumer");

    let settled: Vec<(Disposition, u32)> =
        seen.lock().unwrap().iter().map(|(_, s)| (s.disposition, s.attempt)).collect();
    let (in_queue, dead_letters) = (message_count(&channel, &queue).await, message_count(&channel, &dead).await);
    println!(
        "settlements {settled:?}; body runs {}; left in the queue {in_queue}; dead letters {dead_letters}",
        runs.load(Ordering::SeqCst)
    );
    assert_eq!(
        (runs.load(Ordering::SeqCst), dead_letters),
        (1, 0),
        "the message waited out the store outage and ran once, not dead-lettered by the queue's delivery limit: \
         {settled:?}"
    );
    delete_and_close(connection, &channel, [&queue, &dead]).await;
    cleanup.run().await;
}

/// The broker ends the consumption: `run_until` must return (with the channel's error), not wait
/// for ever on a dead channel while the service looks alive. (1) RabbitMQ closes the consumer's
/// channel with a channel error (here a passive declare of a missing queue on a clone of it);
/// (2) the connection to RabbitMQ is cut (a proxy closes it, as a network failure does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_a_closed_channel_or_connection_ends_the_run() {
    const TEST: &str = "amqp_a_closed_channel_or_connection_ends_the_run";
    let Some(amqp) = services::amqp_url(TEST) else { return };
    let target = "127.0.0.1:5672";
    let proxy = idempotent_tests::proxy::FaultProxy::start(target).await.expect("start the proxy");
    let through_proxy = format!("amqp://guest:guest@{}/%2f", proxy.addr());
    let (admin_connection, admin) = connect(&amqp).await;
    let queue = format!("idempotent-closed-{}", fresh::suffix());
    let dead = declare_with_dead_letter(&admin, &queue).await.expect("declare the queues");

    for how in ["channel error", "connection cut"] {
        let (connection, channel) = connect(&through_proxy).await;
        let seen: Seen = Arc::default();
        let consumer = tokio::spawn({
            let (channel, queue, seen) = (channel.clone(), queue.clone(), Arc::clone(&seen));
            async move {
                Consumer::new(channel, queue)
                    .on_settled(move |s| seen.lock().unwrap().push((Instant::now(), s.clone())))
                    .run(|_message| async move { Ok::<_, Error>(()) })
                    .await
            }
        });
        publish(&admin, &queue, Some(&format!("before {how}")), b"x").await;
        wait_for(&seen, |s| !s.is_empty()).await;
        if how == "channel error" {
            let options = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
            let missing = format!("{queue}.missing");
            let refused = channel.queue_declare(missing.as_str().into(), options, FieldTable::default()).await;
            assert!(refused.is_err(), "RabbitMQ closes the channel: {refused:?}");
        } else {
            proxy.kill_connections();
        }
        let ended = tokio::time::timeout(Duration::from_secs(10), consumer).await;
        println!("{how}: {ended:?}");
        assert!(ended.is_ok(), "{how}: run_until still waits 10 s after the broker ended the consumption");
        let _ = connection.close(200, "done".into()).await;
    }
    for q in [&queue, &dead] {
        admin.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await.expect("delete a queue");
    }
    let _ = admin_connection.close(200, "done".into()).await;
}

/// The amount in a payment message's body (panics on a malformed one, as `.expect` does).
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
/// panic of the handler like any other (README: "Panics are failures, not crashes"): the message
/// is retried, then dead-lettered as poison, and the consumer keeps running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_a_handler_that_panics_before_its_future_is_a_failure_not_a_crash() {
    const TEST: &str = "amqp_a_handler_that_panics_before_its_future_is_a_failure_not_a_crash";
    let Some(amqp) = services::amqp_url(TEST) else { return };
    let (connection, channel) = connect(&amqp).await;
    let queue = format!("idempotent-panic-early-{}", fresh::suffix());
    let dead = declare_with_dead_letter(&channel, &queue).await.expect("declare the queues");

    let seen: Seen = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (channel, queue, seen) = (channel.clone(), queue.clone(), Arc::clone(&seen));
        async move {
            Consumer::new(channel, queue)
                .max_attempts(2)
                .retry_delay(Duration::from_millis(50))
                .on_settled(move |s| seen.lock().unwrap().push((Instant::now(), s.clone())))
                .run_until(|message| pay(amount_in(message.data())), async move {
                    let _ = stopped.await;
                })
                .await
        }
    });

    publish(&channel, &queue, Some("malformed"), b"twelve").await;
    publish(&channel, &queue, Some("fine"), b"12").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && !consumer.is_finished() && seen.lock().unwrap().len() < 3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    let ended = consumer.await;
    let settled: Vec<(Option<String>, Disposition, u32)> =
        seen.lock().unwrap().iter().map(|(_, s)| (s.message_id.clone(), s.disposition, s.attempt)).collect();
    println!("consumer: {ended:?}; settled {settled:?}");
    assert!(ended.is_ok(), "the consumer task panicked: {ended:?}; settled {settled:?}");
    assert_eq!(settlements_of(&seen, "fine"), vec![(Disposition::Ack, None)]);
    let malformed: Vec<Disposition> = settlements_of(&seen, "malformed").into_iter().map(|(d, _)| d).collect();
    assert_eq!(malformed, vec![Disposition::Retry, Disposition::DeadLetter]);

    delete_and_close(connection, &channel, [&queue, &dead]).await;
}

/// The id in a message's body, `id=<id>;...` (panics on a malformed one, as `.expect` does).
fn id_field(data: &[u8]) -> String {
    let text = std::str::from_utf8(data).expect("a text body");
    text.strip_prefix("id=").and_then(|rest| rest.split(';').next()).expect("the body starts with its id").to_owned()
}

/// An id reader (`id_from`, "a field of the payload") that panics on a malformed message: the
/// message has no id to run under, so it is dead-lettered like one without an id, and the consumer
/// keeps running (rather than unwinding out of `run_until` with every delivery in hand).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_an_id_reader_that_panics_dead_letters_the_message_not_the_consumer() {
    const TEST: &str = "amqp_an_id_reader_that_panics_dead_letters_the_message_not_the_consumer";
    let Some(amqp) = services::amqp_url(TEST) else { return };
    let (connection, channel) = connect(&amqp).await;
    let queue = format!("idempotent-id-panic-{}", fresh::suffix());
    let dead = declare_with_dead_letter(&channel, &queue).await.expect("declare the queues");

    let seen: Seen = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (channel, queue, seen) = (channel.clone(), queue.clone(), Arc::clone(&seen));
        async move {
            Consumer::new(channel, queue)
                .id_from(|delivery| Some(id_field(&delivery.data)))
                .on_settled(move |s| seen.lock().unwrap().push((Instant::now(), s.clone())))
                .run_until(|_message| async move { Ok::<_, Error>(()) }, async move {
                    let _ = stopped.await;
                })
                .await
        }
    });

    publish(&channel, &queue, None, b"malformed").await;
    publish(&channel, &queue, None, b"id=order-1;amount=12").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && !consumer.is_finished() && seen.lock().unwrap().len() < 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    let ended = consumer.await;
    let settled: Vec<(Option<String>, Disposition)> =
        seen.lock().unwrap().iter().map(|(_, s)| (s.message_id.clone(), s.disposition)).collect();
    println!("consumer: {ended:?}; settled {settled:?}");
    assert!(ended.is_ok(), "the consumer task panicked: {ended:?}; settled {settled:?}");
    assert!(settled.contains(&(Some("order-1".to_owned()), Disposition::Ack)), "{settled:?}");
    assert!(settled.contains(&(None, Disposition::DeadLetter)), "{settled:?}");
    assert_eq!(message_count(&channel, &dead).await, 1);

    delete_and_close(connection, &channel, [&queue, &dead]).await;
}

/// 64 deliveries in flight, the store behind a `BatchingStore`: the claims and records of many
/// deliveries share a statement, and copies of one id land in one batch or in batches side by
/// side. Each id's body runs once, every copy is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_many_deliveries_in_flight_through_batching_run_each_id_once() {
    const TEST: &str = "amqp_many_deliveries_in_flight_through_batching_run_each_id_once";
    const IDS: usize = 300;
    const COPIES: usize = 3;
    let Some(amqp) = services::amqp_url(TEST) else { return };
    let Some(pg) = services::postgres_url(TEST) else { return };
    let (store, cleanup) = fresh::postgres_at(&pg, 8).await.expect("a fresh store");
    let store = Arc::new(idempotent_runtime::stores::batching::BatchingStore::new(store));
    let (connection, channel) = connect(&amqp).await;
    let queue = format!("idempotent-batching-{}", fresh::suffix());
    let dead = declare_with_dead_letter(&channel, &queue).await.expect("declare the queues");
    // An id's copies one after the other: they are in flight together, often in one batch.
    for i in 0..IDS {
        for copy in 0..COPIES {
            publish(&channel, &queue, Some(&message_id(i)), format!("{i}-{copy}").as_bytes()).await;
        }
    }

    let runs: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let seen: Seen = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (channel, queue, seen, runs, store) =
            (channel.clone(), queue.clone(), Arc::clone(&seen), Arc::clone(&runs), Arc::clone(&store));
        async move {
            Consumer::new(channel, queue)
                .concurrency(64)
                .retry_delay(Duration::from_millis(50))
                .on_settled(move |s| seen.lock().unwrap().push((Instant::now(), s.clone())))
                .run_until(
                    |message| {
                        let (runs, store) = (Arc::clone(&runs), Arc::clone(&store));
                        async move {
                            let id = message.id().to_owned();
                            Call::new("batching-consumer", &id)
                                .run(&*store, async {
                                    *runs.lock().unwrap().entry(id.clone()).or_default() += 1;
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
    wait_for(&seen, |s| s.iter().filter(|(_, s)| s.disposition == Disposition::Ack).count() == IDS * COPIES).await;
    stop.send(()).expect("the consumer runs");
    consumer.await.expect("the consumer task did not panic").expect("the consumer");

    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), IDS, "every id ran");
    assert!(runs.values().all(|&n| n == 1), "each id's body once: {runs:?}");
    let settled = seen.lock().unwrap().clone();
    assert!(settled.iter().all(|(_, s)| s.disposition != Disposition::DeadLetter), "nothing dead-lettered");
    let retried = settled.iter().filter(|(_, s)| s.disposition == Disposition::Retry).count();
    assert_eq!(message_count(&channel, &queue).await, 0);
    assert_eq!(message_count(&channel, &dead).await, 0);
    println!(
        "AMQP through BatchingStore: {IDS} ids × {COPIES} copies, 64 in flight: {} acks, {retried} retried while a \
         copy ran, each body once",
        IDS * COPIES
    );

    delete_and_close(connection, &channel, [&queue, &dead]).await;
    cleanup.run().await;
}
