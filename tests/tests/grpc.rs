//! The gRPC layer against real clients: Python's grpcio with a service-config retry policy, and
//! tonic's own client. Every test counts the handler's runs in the bank's own ledger, never in
//! the store.

#![cfg(feature = "grpc")]

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use idempotent_runtime::grpc::{
    Attempts, GrpcIdempotencyLayer, GrpcRetry, GrpcRetryLayer, IdempotencyKeys, RetryPolicy,
};
use idempotent_runtime::{Call, Error, MemoryStore, Store};
use idempotent_tests::grpc::{Bank, Ledger, PAY, PayRequest, PaymentsClient, TestServer, request_id};
use idempotent_tests::proxy::FaultProxy;
use serde_json::Value;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

fn layer<St: Store>(store: St) -> GrpcIdempotencyLayer<St> {
    GrpcIdempotencyLayer::new(store).keys_shared_by_all_callers().method(PAY)
}

fn pay(key: Option<&str>, user: &str, amount: i64, behaviour: &str) -> Request<PayRequest> {
    let mut request = Request::new(PayRequest {
        request_id: String::new(),
        user: user.to_owned(),
        amount,
        behaviour: behaviour.to_owned(),
    });
    if let Some(key) = key {
        request.metadata_mut().insert("idempotency-key", key.parse().unwrap());
    }
    request
}

async fn client(addr: std::net::SocketAddr) -> PaymentsClient<Channel> {
    PaymentsClient::connect(format!("http://{addr}")).await.expect("connect to the test server")
}

fn replayed<T>(response: &tonic::Response<T>) -> bool {
    response.metadata().get("idempotent-replayed").is_some_and(|v| v == "true")
}

/// A replayed error tells retry policies not to retry it: a negative pushback (gRFC A6).
fn refuses_retries(status: &tonic::Status) -> bool {
    status.metadata().get("grpc-retry-pushback-ms").is_some_and(|v| v == "-1")
}

// ---- Python's grpcio ------------------------------------------------------------------------

/// The Python interpreter of a virtual environment with grpcio 1.85.0, made once under
/// `target/` (from `PyPI`); `None`, loudly, when it cannot be made and services are not required.
fn python() -> Option<PathBuf> {
    idempotent_tests::python::venv("grpc", "grpcio==1.85.0", "import grpc; assert grpc.__version__ == '1.85.0'")
}

/// Runs `tests/grpc/pay_client.py` against `target` with `calls`; one JSON object per call.
async fn python_calls(python: PathBuf, target: String, calls: Value) -> Vec<Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("grpc/pay_client.py");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python).arg(script).arg(target).arg(calls.to_string()).output().expect("run the Python client")
    })
    .await
    .unwrap();
    assert!(out.status.success(), "the Python client failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|line| serde_json::from_str(line).unwrap()).collect()
}

fn call(key: Option<&str>, user: &str, behaviour: &str, messages: u8) -> Value {
    serde_json::json!({"key": key, "request_id": "", "user": user, "amount": 10, "behaviour": behaviour, "messages": messages})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_python_client_retrying_after_a_lost_answer_gets_the_recorded_one() {
    let Some(python) = python() else { return };
    let proxy = Arc::new(FaultProxy::start("127.0.0.1:9").await.unwrap());
    let ledger = Ledger::default();
    let server =
        TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), Some(Arc::clone(&proxy)))).await;
    proxy.set_target(server.addr);

    let keys: Vec<String> = (0..5).map(|i| format!("py-lost-{i}-{}", uuid::Uuid::new_v4())).collect();
    let mut calls: Vec<Value> =
        keys.iter().enumerate().map(|(i, k)| call(Some(k), &format!("lost-{i}"), "drop-first", 1)).collect();
    let failing = format!("py-failing-{}", uuid::Uuid::new_v4());
    calls.push(call(Some(&failing), "failing", "fail-after-effect", 1));
    let refused = format!("py-refused-{}", uuid::Uuid::new_v4());
    calls.push(call(Some(&refused), "refused", "refuse", 1));
    calls.push(call(Some(&format!("py-stream-{}", uuid::Uuid::new_v4())), "streaming", "", 2));
    calls.push(call(None, "keyless", "", 1));
    let calls = Value::Array(calls);

    let first = python_calls(python.clone(), proxy.addr().to_string(), calls.clone()).await;
    assert_eq!(first.len(), 9, "{first:?}");
    for (i, answer) in first[..5].iter().enumerate() {
        let user = format!("lost-{i}");
        assert_eq!(answer["code"], "OK", "the retry after the lost answer gets the recorded one: {answer}");
        assert_eq!(answer["replayed"], true, "{answer}");
        assert_eq!(ledger.runs_for(&user), 1, "{user} was paid once: {answer}");
    }
    // The handler failed after its effect: the retry policy retries UNAVAILABLE, its retry got
    // the recorded failure with a negative pushback, which stops the policy's retries (gRFC A6),
    // and the payment was made once.
    assert_eq!(first[5]["code"], "UNAVAILABLE", "{}", first[5]);
    assert!(first[5]["details"].as_str().unwrap().contains("receipt service timed out"), "{}", first[5]);
    assert_eq!(first[5]["replayed"], true, "{}", first[5]);
    assert_eq!(ledger.runs_for("failing"), 1);
    assert_eq!(server.attempts(&failing), 2, "one run, one replayed retry, no more: {}", first[5]);
    // Marked not processed: not recorded, nothing paid.
    assert_eq!(first[6]["code"], "INVALID_ARGUMENT", "{}", first[6]);
    assert_eq!(first[6]["replayed"], false, "{}", first[6]);
    // Two messages on a covered method: refused before the handler.
    assert_eq!(first[7]["code"], "UNIMPLEMENTED", "{}", first[7]);
    assert!(first[7]["details"].as_str().unwrap().contains("2 messages"), "{}", first[7]);
    assert_eq!(ledger.runs_for("streaming"), 0);
    assert_eq!(first[8]["code"], "INVALID_ARGUMENT", "{}", first[8]);
    assert!(first[8]["details"].as_str().unwrap().contains("requires an idempotency key"), "{}", first[8]);
    assert_eq!(ledger.runs_for("keyless"), 0);

    // A second client process sends the same calls: the same answers, nothing more paid.
    let paid = ledger.len();
    let again = python_calls(python, proxy.addr().to_string(), calls).await;
    for (before, after) in first[..6].iter().zip(&again[..6]) {
        assert_eq!(before["code"], after["code"], "{before} / {after}");
        assert_eq!(before.get("receipt"), after.get("receipt"), "{before} / {after}");
        assert_eq!(after["replayed"], true, "{after}");
    }
    assert_eq!(ledger.len(), paid, "the repeated calls paid nothing");
    assert_eq!(ledger.runs_for("lost-0") + ledger.runs_for("failing"), 2);
}

// ---- tonic's client ---------------------------------------------------------------------

/// Two copies of one process (a `fork` child beside its parent, as a virtual machine restored
/// twice from one snapshot makes them) each have `IdempotencyKeys` give a call a fresh key: the
/// keys differ. uuid's per-thread generator, which made them before, goes on identically in
/// both copies.
#[cfg(all(feature = "redis", feature = "http"))] // the test program's other modes need them
#[test]
fn grpc_client_copies_of_one_process_give_different_fresh_keys() {
    let keys = idempotent_tests::output_lines(env!("CARGO_BIN_EXE_fork_copies"), &["grpc-key"]);
    assert_eq!(keys.len(), 2, "one key from each copy: {keys:?}");
    assert!(keys.iter().all(|key| uuid::Uuid::parse_str(key).is_ok_and(|u| u.get_version_num() == 4)), "{keys:?}");
    assert_ne!(keys[0], keys[1], "each copy's key is its own");
}

#[tokio::test]
async fn grpc_64_concurrent_duplicates_run_once_memory() {
    let ledger = Ledger::default();
    let server = TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), None)).await;
    let client = client(server.addr).await;
    let key = format!("dup-{}", uuid::Uuid::new_v4());
    let calls = (0..64).map(|_| {
        let mut client = client.clone();
        let key = key.clone();
        tokio::spawn(async move { client.pay(pay(Some(&key), "dup", 10, "slow")).await })
    });
    let answers = futures_util::future::join_all(calls).await;
    // A call the scheduler delays past the first one's end gets the replay instead of ABORTED.
    let (mut ok, mut aborted) = (0, 0);
    for answer in answers {
        match answer.unwrap() {
            Ok(response) if replayed(&response) => aborted += 1,
            Ok(response) => {
                assert_eq!(response.get_ref().seq, 1);
                ok += 1;
            }
            Err(status) => {
                assert_eq!(status.code(), Code::Aborted, "{status:?}");
                let pushback = status.metadata().get("grpc-retry-pushback-ms").expect("a pushback");
                let ms: u64 = pushback.to_str().unwrap().parse().unwrap();
                assert!((1..=1000).contains(&ms), "pushback {ms} ms");
                aborted += 1;
            }
        }
    }
    assert_eq!((ok, aborted), (1, 63), "one run; the others ABORTED (or, if late, replayed)");
    assert_eq!(ledger.len(), 1, "64 concurrent duplicates paid once");
    let replay = client.clone().pay(pay(Some(&key), "dup", 10, "slow")).await.unwrap();
    assert!(replayed(&replay));
    assert_eq!(replay.get_ref().seq, 1);
    assert_eq!(ledger.len(), 1);
}

#[tokio::test]
async fn grpc_reused_key_with_another_message_is_refused_and_runs_nothing_memory() {
    let ledger = Ledger::default();
    let server = TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), None)).await;
    let mut client = client(server.addr).await;
    client.pay(pay(Some("reused"), "alice", 10, "")).await.unwrap();
    let status = client.pay(pay(Some("reused"), "alice", 20, "")).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("different request"), "{status:?}");
    let malformed = client.pay(pay(Some("a b"), "alice", 20, "")).await.unwrap_err();
    assert_eq!(malformed.code(), Code::InvalidArgument, "{malformed:?}");
    assert_eq!(ledger.len(), 1);
}

#[tokio::test]
async fn grpc_aip155_request_id_in_the_message_is_the_key_memory() {
    let ledger = Ledger::default();
    let layer =
        GrpcIdempotencyLayer::new(MemoryStore::new()).keys_shared_by_all_callers().method_keyed_by(PAY, request_id);
    let server = TestServer::start(layer, Bank::new(ledger.clone(), None)).await;
    let mut client = client(server.addr).await;
    let request = |id: &str| {
        Request::new(PayRequest { request_id: id.to_owned(), user: "bob".into(), amount: 5, behaviour: String::new() })
    };
    let first = client.pay(request("3f1c0a52-8d7e-4c43-9a55-1b2f8f6a9d10")).await.unwrap();
    let second = client.pay(request("3f1c0a52-8d7e-4c43-9a55-1b2f8f6a9d10")).await.unwrap();
    assert!(!replayed(&first) && replayed(&second));
    assert_eq!(first.get_ref(), second.get_ref());
    let missing = client.pay(request("")).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert!(missing.message().contains("in its request message"), "{missing:?}");
    assert_eq!(ledger.len(), 1);
}

#[tokio::test]
async fn grpc_server_restart_on_sqlite_replays() {
    use idempotent_runtime::stores::sql::SqliteStore;
    let path = idempotent_tests::fresh::temp_dir("grpc-restart").join("records.db");
    let ledger = Ledger::default();
    let key = "restart-1";
    let store = SqliteStore::open(&path).await.unwrap();
    let server = TestServer::start(layer(store), Bank::new(ledger.clone(), None)).await;
    let first = client(server.addr).await.pay(pay(Some(key), "carol", 7, "")).await.unwrap();
    server.stop().await;

    let store = SqliteStore::open(&path).await.unwrap();
    let server = TestServer::start(layer(store), Bank::new(ledger.clone(), None)).await;
    let again = client(server.addr).await.pay(pay(Some(key), "carol", 7, "")).await.unwrap();
    assert!(replayed(&again), "the restarted server replays");
    assert_eq!(first.get_ref(), again.get_ref());
    assert_eq!(ledger.len(), 1);
}

#[derive(Debug)]
enum Failed {
    #[allow(dead_code, reason = "read through Debug when a test fails")]
    Idempotency(Error),
    Rpc(Status),
}

impl From<Error> for Failed {
    fn from(error: Error) -> Self {
        Failed::Idempotency(error)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_tonic_client_in_an_idempotent_body_sends_the_same_derived_key_when_the_body_runs_again_memory() {
    let proxy = Arc::new(FaultProxy::start("127.0.0.1:9").await.unwrap());
    let ledger = Ledger::default();
    let server =
        TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), Some(Arc::clone(&proxy)))).await;
    proxy.set_target(server.addr);
    let channel = Channel::from_shared(format!("http://{}", proxy.addr())).unwrap().connect_lazy();
    let client = PaymentsClient::with_interceptor(channel, IdempotencyKeys);

    // The calling service's own idempotent operation: an order that pays through the bank.
    let shop = MemoryStore::new();
    let order = || {
        let mut client = client.clone();
        Call::new("shop", "order-17").run(&shop, async move {
            let receipt = client.pay(pay(None, "dave", 30, "drop-first")).await.map_err(Failed::Rpc)?;
            Ok::<_, Failed>((receipt.get_ref().seq, replayed(&receipt)))
        })
    };
    // The bank paid, the answer was lost: the body failed, its key was released.
    let lost = order().await.unwrap_err();
    assert!(matches!(&lost, Failed::Rpc(_)), "{lost:?}");
    assert_eq!(ledger.len(), 1);
    // The shop's retry runs the body again; its call gets the same derived key, and the bank replays.
    let mut again = order().await;
    for _ in 0..20 {
        // The channel may still be reconnecting through the proxy, or the bank still recording
        // the first run (ABORTED, as a retry policy would retry it).
        let transient = |status: &Status| {
            matches!(status.code(), Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Aborted)
        };
        if !matches!(&again, Err(Failed::Rpc(status)) if transient(status)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        again = order().await;
    }
    let (seq, was_replayed) = again.unwrap();
    assert_eq!(seq, 1);
    assert!(was_replayed, "the bank replayed the derived key's answer");
    assert_eq!(ledger.len(), 1, "one payment for the order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_store_down_before_the_claim_is_unavailable_and_not_recorded_redis() {
    use idempotent_tests::proxy::Mode;
    let test = "grpc_store_down_before_the_claim_is_unavailable_and_not_recorded_redis";
    let Some((store, cleanup, proxy)) = idempotent_tests::fresh::redis_behind_proxy(test).await else { return };
    let ledger = Ledger::default();
    let server = TestServer::start(layer(store), Bank::new(ledger.clone(), None)).await;
    let mut client = client(server.addr).await;
    proxy.set_mode(Mode::Refuse);
    proxy.kill_connections();
    let key = format!("down-{}", uuid::Uuid::new_v4());
    let down = client.pay(pay(Some(&key), "erin", 10, "")).await.unwrap_err();
    assert_eq!(down.code(), Code::Unavailable, "{down:?}");
    assert!(down.message().contains("not processed"), "{down:?}");
    assert!(ledger.is_empty(), "nothing ran");
    proxy.set_mode(Mode::Pass);
    let mut again = client.pay(pay(Some(&key), "erin", 10, "")).await;
    for _ in 0..100 {
        if !matches!(&again, Err(status) if status.code() == Code::Unavailable) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        again = client.pay(pay(Some(&key), "erin", 10, "")).await;
    }
    let again = again.expect("the store is back: the call runs");
    assert!(!replayed(&again), "the UNAVAILABLE was not recorded: the retry ran");
    assert_eq!(ledger.len(), 1);
    drop(server);
    cleanup.run().await;
}

#[tokio::test]
async fn grpc_replay_carries_the_recorded_metadata_status_and_details_memory() {
    let ledger = Ledger::default();
    let server = TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), None)).await;
    let mut client = client(server.addr).await;

    let first = client.pay(pay(Some("with-metadata"), "frank", 3, "metadata")).await.unwrap();
    let again = client.pay(pay(Some("with-metadata"), "frank", 3, "metadata")).await.unwrap();
    assert!(!replayed(&first) && replayed(&again));
    assert_eq!(first.metadata().get("x-ledger-seq"), again.metadata().get("x-ledger-seq"));
    assert_eq!(again.metadata().get("x-ledger-seq").unwrap(), "1");
    assert_eq!(first.get_ref(), again.get_ref());

    let failed = client.pay(pay(Some("with-details"), "grace", 3, "detailed-failure")).await.unwrap_err();
    let replay = client.pay(pay(Some("with-details"), "grace", 3, "detailed-failure")).await.unwrap_err();
    for status in [&failed, &replay] {
        assert_eq!(status.code(), Code::Internal, "{status:?}");
        assert_eq!(status.message(), "ledger closed");
        assert_eq!(status.details(), &[0, 159, 146, 150, 2], "binary details kept byte for byte");
        assert_eq!(status.metadata().get("x-ledger-seq").unwrap(), "2");
    }
    assert!(replay.metadata().get("idempotent-replayed").is_some_and(|v| v == "true"), "{replay:?}");
    assert!(failed.metadata().get("idempotent-replayed").is_none(), "{failed:?}");
    assert_eq!(ledger.len(), 2, "one payment per key");
}

#[tokio::test]
async fn grpc_a_call_whose_deadline_passes_still_runs_to_its_end_and_its_retry_gets_the_answer_memory() {
    let ledger = Ledger::default();
    let server = TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), None)).await;
    let mut client = client(server.addr).await;
    // The handler pays after 300 ms; the client gives up after 50 ms (its grpc-timeout makes
    // tonic's server drop the call's future too).
    let mut hurried = pay(Some("deadline-1"), "heidi", 4, "slow");
    hurried.set_timeout(Duration::from_millis(50));
    let gave_up = client.pay(hurried).await.unwrap_err();
    assert!(matches!(gave_up.code(), Code::DeadlineExceeded | Code::Cancelled), "{gave_up:?}");
    assert!(ledger.is_empty(), "the client gave up before the payment");
    for _ in 0..100 {
        if !ledger.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ledger.len(), 1, "the handler ran to its end after the client gave up");
    let retry = client.pay(pay(Some("deadline-1"), "heidi", 4, "slow")).await.unwrap();
    assert!(replayed(&retry), "the retry gets the answer the abandoned call recorded");
    assert_eq!(retry.get_ref().seq, 1);
    assert_eq!(ledger.len(), 1);
}

/// An answer the store cannot keep (over its record limit) goes to the call that ran; its retries
/// get `DATA_LOSS`, marked as the key's final answer and refusing retries, and nothing runs twice.
#[tokio::test]
async fn grpc_an_answer_the_store_cannot_keep_is_final_and_refuses_retries_memory() {
    let ledger = Ledger::default();
    let layer = layer(MemoryStore::with_max_record_bytes(16));
    let server = TestServer::start(layer, Bank::new(ledger.clone(), None)).await;
    let mut client = client(server.addr).await;
    let first = client.pay(pay(Some("unkept-1"), "judy", 5, "")).await.expect("the answer of the call that ran");
    assert!(!replayed(&first));
    for attempt in ["retry", "another retry"] {
        let status = client.pay(pay(Some("unkept-1"), "judy", 5, "")).await.unwrap_err();
        assert_eq!(status.code(), Code::DataLoss, "{attempt}: {status:?}");
        assert!(status.metadata().get("idempotent-replayed").is_some_and(|v| v == "true"), "{attempt}: {status:?}");
        assert!(refuses_retries(&status), "{attempt}: {status:?}");
    }
    assert_eq!(ledger.len(), 1, "the handler ran once");
}

#[tokio::test]
async fn grpc_limits_and_callers_memory() {
    let ledger = Ledger::default();
    let layer = GrpcIdempotencyLayer::new(MemoryStore::new())
        .caller(|parts| parts.headers.get("x-client").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned())
        .method(PAY)
        .max_request_bytes(64)
        .max_response_bytes(8);
    let server = TestServer::start(layer, Bank::new(ledger.clone(), None)).await;
    let mut client = client(server.addr).await;
    let from = |client: &str, key: &str, user: &str| {
        let mut request = pay(Some(key), user, 1, "");
        request.metadata_mut().insert("x-client", client.parse().unwrap());
        request
    };

    // Over the request limit: refused before the handler.
    let big = client.pay(from("a", "big", &"u".repeat(100))).await.unwrap_err();
    assert_eq!(big.code(), Code::ResourceExhausted, "{big:?}");
    assert!(ledger.is_empty());

    // Over the response limit: the first call gets its answer, its retry DATA_LOSS, no second run.
    let first = client.pay(from("a", "k", "ivan-the-long-named")).await.unwrap();
    assert!(!replayed(&first));
    let retry = client.pay(from("a", "k", "ivan-the-long-named")).await.unwrap_err();
    assert_eq!(retry.code(), Code::DataLoss, "{retry:?}");
    assert!(refuses_retries(&retry), "{retry:?}");
    assert_eq!(ledger.len(), 1);

    // Another caller with the same key and message runs on its own.
    let other = client.pay(from("b", "k", "ivan-the-long-named")).await.unwrap();
    assert!(!replayed(&other));
    assert_eq!(other.get_ref().seq, 2);
    assert_eq!(ledger.len(), 2);
}

// ---- Records of earlier versions ------------------------------------------------------------

/// Records the layer wrote before its compact record form (JSON objects, `{"Ok":{"Answer":..}}`)
/// still replay from `store` after an upgrade: an answer, `TooLarge` and `Failed`.
async fn legacy_records_replay<St: Store + Clone + 'static>(store: St) {
    use idempotent_runtime::{Claim, ClaimRequest, Completion, Key, Token};

    let ledger = Ledger::default();
    let server = TestServer::start(layer(store.clone()).scope("legacy"), Bank::new(ledger.clone(), None)).await;
    let mut client = client(server.addr).await;
    // A call run now gives the fingerprint the layer computes for this message, and its record
    // is in the compact form.
    let now = uuid::Uuid::new_v4().to_string();
    client.pay(pay(Some(&now), "legacy", 3, "")).await.expect("the call runs");
    let probe = Key::new("legacy", now.as_str()).expect("a valid key");
    let token = Token::new();
    let Claim::Completed(record) = store
        .claim(&ClaimRequest::new(&probe, &token, None, Duration::from_secs(60)))
        .await
        .expect("the store answers")
    else {
        panic!("the first call's record is not there")
    };
    assert!(record.outcome.starts_with(br#"{"Ok":"a"#), "{:?}", String::from_utf8_lossy(&record.outcome));
    let fingerprint = record.fingerprint.clone();
    assert!(fingerprint.is_some());
    let write = async |outcome: &[u8]| {
        let key = uuid::Uuid::new_v4().to_string();
        let stored = Key::new("legacy", key.as_str()).expect("a valid key");
        let token = Token::new();
        let claim =
            store.claim(&ClaimRequest::new(&stored, &token, fingerprint.as_ref(), Duration::from_secs(60))).await;
        assert_eq!(claim.expect("the store answers"), Claim::Claimed);
        let completion = Completion::new(&stored, &token, fingerprint.as_ref(), outcome, Duration::from_secs(600));
        store.complete(&completion).await.expect("the record is written");
        key
    };

    // The answer an earlier version recorded: a receipt (user "legacy", amount 3, seq 41) as a
    // length-prefixed message, its metadata and its status, each field in the form it used.
    let message = b"\x0a\x06legacy\x10\x03\x18\x29";
    let mut frame = vec![0, 0, 0, 0, u8::try_from(message.len()).unwrap()];
    frame.extend_from_slice(message);
    let legacy = serde_json::json!({"Ok": {"Answer": {
        "headers": [["content-type", {"Text": "application/grpc"}], ["x-ledger-seq", {"Text": "41"}]],
        "body": {"Text": String::from_utf8(frame).unwrap()},
        "trailers": [["grpc-status", {"Text": "0"}], ["x-note-bin", {"Base64": "/3Rlc3Q="}]],
    }}});
    let old = write(legacy.to_string().as_bytes()).await;
    let replay = client.pay(pay(Some(&old), "legacy", 3, "")).await.expect("the recorded answer");
    assert!(replayed(&replay));
    assert_eq!(replay.metadata().get("x-ledger-seq").unwrap(), "41");
    assert_eq!((replay.get_ref().user.as_str(), replay.get_ref().amount, replay.get_ref().seq), ("legacy", 3, 41));
    // A recorded error status replays as that status.
    let failure = serde_json::json!({"Ok": {"Answer": {
        "headers": [["content-type", {"Text": "application/grpc"}]],
        "body": {"Text": ""},
        "trailers": [["grpc-status", {"Text": "14"}], ["grpc-message", {"Text": "receipt service timed out"}]],
    }}});
    let old = write(failure.to_string().as_bytes()).await;
    let status = client.pay(pay(Some(&old), "legacy", 3, "")).await.unwrap_err();
    assert_eq!((status.code(), status.message()), (Code::Unavailable, "receipt service timed out"));
    assert!(refuses_retries(&status), "{status:?}");
    for outcome in [&br#"{"Ok":{"TooLarge":{"limit":2048}}}"#[..], br#"{"Ok":{"Failed":{"reason":"the body broke"}}}"#]
    {
        let old = write(outcome).await;
        let status = client.pay(pay(Some(&old), "legacy", 3, "")).await.unwrap_err();
        assert_eq!(status.code(), Code::DataLoss, "{status:?}");
        assert!(refuses_retries(&status), "{status:?}");
    }
    assert_eq!(ledger.len(), 1, "only the call run now paid");
    drop(server);
}

#[tokio::test]
async fn grpc_legacy_records_replay_memory() {
    legacy_records_replay(MemoryStore::new()).await;
}

#[tokio::test]
async fn grpc_legacy_records_replay_redis() {
    let Some((store, cleanup)) = idempotent_tests::fresh::redis("grpc_legacy_records_replay_redis").await else {
        return;
    };
    legacy_records_replay(store).await;
    cleanup.run().await;
}

/// Inside an idempotent body, `IdempotencyKeys` gives each call the next derived key, and tonic has
/// no retry of its own: a body that retries a call whose deadline passed by calling the method
/// again sent the *next* position's key, and the bank, which ran the first call to its end (as
/// the layer promises), paid again for each attempt (3 payments for 3 attempts of 200 ms against a
/// 300 ms payment, found in review). The interceptor cannot tell a retry from a second payment, so
/// its docs say to take the key once before the loop (`derived_key` with the method and path the
/// interceptor would use) and send it on every attempt; the interceptor keeps a key a call
/// carries. One payment, and the retry gets the first attempt's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_tonic_client_retrying_inside_an_idempotent_body_with_a_key_pinned_before_the_loop_pays_once_memory() {
    let ledger = Ledger::default();
    let server = TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), None)).await;
    let channel = Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect_lazy();
    let client = PaymentsClient::with_interceptor(channel, IdempotencyKeys);
    let shop = MemoryStore::new();
    let receipt = Call::new("shop", "order-19")
        .run(&shop, async move {
            let mut client = client.clone();
            let key = idempotent_runtime::derived_key("POST", "/payments.Payments/Pay").expect("inside a body");
            let mut last = None;
            for _ in 0..6 {
                let mut request = pay(Some(&key), "judy", 7, "slow");
                request.set_timeout(Duration::from_millis(200));
                match client.pay(request).await {
                    Ok(receipt) => return Ok::<_, Failed>((receipt.get_ref().seq, replayed(&receipt))),
                    Err(status)
                        if matches!(
                            status.code(),
                            Code::DeadlineExceeded | Code::Cancelled | Code::Unavailable | Code::Aborted
                        ) =>
                    {
                        last = Some(status);
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    Err(status) => return Err(Failed::Rpc(status)),
                }
            }
            Err(Failed::Rpc(last.expect("an attempt failed")))
        })
        .await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    println!("a key pinned before the loop: outcome {receipt:?}, the bank paid {} time(s)", ledger.len());
    assert_eq!(receipt.unwrap(), (1, true), "the retry got the first attempt's recorded answer");
    assert_eq!(ledger.len(), 1);
}

// ---- tonic's client behind GrpcRetryLayer ------------------------------------------------------

/// A policy with short waits, the same in every run.
fn quick_policy() -> RetryPolicy {
    RetryPolicy::default()
        .max_attempts(6)
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .max_elapsed(Duration::from_secs(10))
        .jitter_seed(7)
}

/// A tonic client of `addr` whose `Pay` calls go through `GrpcRetryLayer`.
fn retrying_client(addr: std::net::SocketAddr, layer: &GrpcRetryLayer) -> PaymentsClient<GrpcRetry<Channel>> {
    let channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect_lazy();
    PaymentsClient::new(layer.service(channel))
}

fn attempts<T>(response: &tonic::Response<T>) -> Attempts {
    response.extensions().get::<Attempts>().cloned().expect("GrpcRetryLayer notes its attempts on an answer")
}

/// The answer to the first attempt is lost after the payment (the bank cuts the connections
/// before it answers). The layer sends the call again with the key it gave the first attempt, and
/// the server replays: one payment, two attempts of one key. A client that retries by calling the
/// method again gets a new key from `IdempotencyKeys` and pays twice (the last test of the tonic
/// section above shows why).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_retry_layer_after_a_lost_answer_gets_the_recorded_one_memory() {
    let proxy = Arc::new(FaultProxy::start("127.0.0.1:9").await.unwrap());
    let ledger = Ledger::default();
    let server =
        TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), Some(Arc::clone(&proxy)))).await;
    proxy.set_target(server.addr);
    let mut client = retrying_client(proxy.addr(), &GrpcRetryLayer::new(quick_policy()).method(PAY));

    let receipt = client.pay(pay(None, "kim", 25, "drop-first")).await.expect("the retry gets the recorded answer");
    let noted = attempts(&receipt);
    assert!(replayed(&receipt), "the second attempt is answered from the record");
    assert_eq!(receipt.get_ref().seq, 1);
    assert_eq!(ledger.runs_for("kim"), 1, "paid once");
    assert_eq!(noted.count, 2, "{noted:?}");
    assert_eq!(noted.stopped, None, "{noted:?}");
    assert_eq!(server.attempts(&noted.key), 2, "both attempts carried the one key {}", noted.key);
}

/// Defaults composed: the server records the handler's `UNAVAILABLE` after a payment (its default),
/// the layer retries `UNAVAILABLE` (its default). The retry gets the recorded failure, marked
/// replayed with a negative pushback, and stops there: paid once, two attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_retry_layer_stops_at_a_replayed_failure_and_pays_once_memory() {
    let ledger = Ledger::default();
    let server = TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), None)).await;
    let mut client = retrying_client(server.addr, &GrpcRetryLayer::new(quick_policy()).method(PAY));
    let key = format!("retry-failed-{}", uuid::Uuid::new_v4());

    let status = client.pay(pay(Some(&key), "lee", 5, "fail-after-effect")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("receipt service timed out (seq 1)"), "the first run's answer: {status:?}");
    assert!(refuses_retries(&status), "replayed with a negative pushback: {status:?}");
    assert_eq!(ledger.runs_for("lee"), 1, "paid once");
    assert_eq!(server.attempts(&key), 2, "one run, one replayed retry, no more");
}

/// Inside an idempotent body, each attempt's timeout (200 ms) passes before the payment's 300 ms.
/// The layer derives the call's key once and sends it on every attempt: the server, which runs
/// the first attempt to its end, answers the next with `ABORTED` and a pushback, then with the
/// recorded receipt. One payment; the same scenario with a retry loop around the generated client
/// paid once per attempt until its key was pinned by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_retry_layer_inside_an_idempotent_body_outlasts_timeouts_with_one_derived_key_memory() {
    let ledger = Ledger::default();
    let server = TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), None)).await;
    let client = retrying_client(server.addr, &GrpcRetryLayer::new(quick_policy()).method(PAY));
    let shop = MemoryStore::new();
    let outcome = Call::new("shop", "order-20")
        .run(&shop, async move {
            let mut client = client.clone();
            let mut request = pay(None, "mia", 7, "slow");
            request.set_timeout(Duration::from_millis(200));
            let receipt = client.pay(request).await.map_err(Failed::Rpc)?;
            let noted = attempts(&receipt);
            Ok::<_, Failed>((receipt.get_ref().seq, replayed(&receipt), noted.key, noted.count))
        })
        .await;
    let (seq, was_replayed, key, count) = outcome.unwrap();
    // The key a run of this call derives first for `Pay` (a run on another store: the key depends
    // on the call's scope and key, not on the store).
    let first_derived = Call::new("shop", "order-20")
        .run(&MemoryStore::new(), async { Ok::<_, Failed>(idempotent_runtime::derived_key("POST", PAY).unwrap()) })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    println!("timeouts inside a body: {count} attempts with key {key}, the bank paid {} time(s)", ledger.len());
    assert_eq!((seq, was_replayed), (1, true), "a later attempt got the first one's recorded answer");
    assert!(count >= 2, "{count} attempts");
    assert_eq!(key, first_derived, "the layer took the body's derived key, once for all attempts");
    assert_eq!(server.attempts(&key), usize::try_from(count).unwrap(), "every attempt had the one key");
    assert_eq!(ledger.len(), 1, "paid once");
}

/// The same timeout seen by the server first: its deadline (150 ms here, before the payment's 300)
/// passes before the client's, and tonic's server answers `CANCELLED` ("Timeout expired") while
/// the layer runs the call on. That answer is no more the call's outcome than the client's own
/// timer firing: the layer retries it with the same key and gets the recorded receipt. (Which of
/// the two timers fires first on the test above depends on the machine's load; here the server's
/// always does, as the client sets no timeout.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_retry_layer_retries_the_servers_deadline_answer_with_the_same_key_memory() {
    let ledger = Ledger::default();
    let server = TestServer::start_with_timeout(
        layer(MemoryStore::new()),
        Bank::new(ledger.clone(), None),
        Some(Duration::from_millis(150)),
    )
    .await;
    let mut client = retrying_client(server.addr, &GrpcRetryLayer::new(quick_policy()).method(PAY));

    let receipt = client.pay(pay(None, "uma", 9, "slow")).await.expect("a retry gets the recorded receipt");
    let noted = attempts(&receipt);
    assert!(replayed(&receipt), "the receipt is the first attempt's, recorded: {noted:?}");
    assert_eq!(receipt.get_ref().seq, 1);
    assert!(noted.count >= 2, "{noted:?}");
    assert_eq!(server.attempts(&noted.key), usize::try_from(noted.count).unwrap(), "every attempt had the one key");
    assert_eq!(ledger.runs_for("uma"), 1, "paid once");
}

/// The server is down for the first 300 ms (the proxy points at a closed port): the attempts
/// find no answer, and the layer retries them until the server is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_retry_layer_retries_while_the_server_is_unreachable_memory() {
    let proxy = Arc::new(FaultProxy::start("127.0.0.1:9").await.unwrap());
    let ledger = Ledger::default();
    let server = TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), None)).await;
    let mut client = retrying_client(proxy.addr(), &GrpcRetryLayer::new(quick_policy()).method(PAY));
    let target = server.addr;
    let repair = {
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            proxy.set_target(target);
        })
    };
    let receipt = client.pay(pay(None, "ned", 3, "")).await.expect("an attempt after the repair is answered");
    repair.await.unwrap();
    let noted = attempts(&receipt);
    assert!(noted.count >= 2, "the attempts before the repair were retried: {noted:?}");
    assert!(!replayed(&receipt), "the first attempt that reached the server ran the call");
    assert_eq!(server.attempts(&noted.key), 1);
    assert_eq!(ledger.runs_for("ned"), 1);
}

/// The server says how to go on: a released `UNAVAILABLE` is retried until the attempts are used
/// (the handler says it did nothing, so each retry runs it again); the same with a negative
/// pushback is returned at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_retry_layer_bounds_its_attempts_and_obeys_a_negative_pushback_memory() {
    let ledger = Ledger::default();
    let server = TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), None)).await;
    let mut client = retrying_client(server.addr, &GrpcRetryLayer::new(quick_policy().max_attempts(3)).method(PAY));

    let busy = format!("retry-busy-{}", uuid::Uuid::new_v4());
    let status = client.pay(pay(Some(&busy), "olga", 1, "busy")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(server.attempts(&busy), 3, "max_attempts(3)");

    let closed = format!("retry-closed-{}", uuid::Uuid::new_v4());
    let status = client.pay(pay(Some(&closed), "olga", 1, "no-retry")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(refuses_retries(&status), "{status:?}");
    assert_eq!(server.attempts(&closed), 1, "a negative pushback is not retried");
    assert_eq!(ledger.runs_for("olga"), 0);
}

/// A key the call carries is kept; a method the layer does not cover passes through untouched
/// (no key added: the server refuses it for want of one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_retry_layer_keeps_a_callers_key_and_passes_other_methods_memory() {
    let ledger = Ledger::default();
    let server = TestServer::start(layer(MemoryStore::new()), Bank::new(ledger.clone(), None)).await;

    let mut covered = retrying_client(server.addr, &GrpcRetryLayer::new(quick_policy()).method(PAY));
    let key = format!("retry-mine-{}", uuid::Uuid::new_v4());
    let receipt = covered.pay(pay(Some(&key), "pat", 2, "")).await.unwrap();
    assert_eq!(attempts(&receipt), Attempts { key: key.clone(), count: 1, stopped: None });
    assert_eq!(server.attempts(&key), 1);

    let elsewhere = GrpcRetryLayer::new(quick_policy()).method("/payments.Payments/Refund");
    let mut uncovered = retrying_client(server.addr, &elsewhere);
    let status = uncovered.pay(pay(None, "pat", 2, "")).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "sent without a key: {status:?}");
    assert!(status.message().contains("requires an idempotency key"), "{status:?}");
    assert_eq!(ledger.runs_for("pat"), 1);
}

/// The server's store is unreachable until the layer has retried the call: the server answers
/// `UNAVAILABLE` without running anything and records nothing, the layer retries it with the same
/// key, and the first attempt after the store is back runs the call, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_retry_layer_outlasts_a_store_outage_and_pays_once_redis() {
    use idempotent_tests::proxy::Mode;
    let test = "grpc_retry_layer_outlasts_a_store_outage_and_pays_once_redis";
    let Some((store, cleanup, proxy)) = idempotent_tests::fresh::redis_behind_proxy(test).await else { return };
    let ledger = Ledger::default();
    let server = Arc::new(TestServer::start(layer(store), Bank::new(ledger.clone(), None)).await);
    let policy = quick_policy().max_attempts(100).max_elapsed(Duration::from_secs(30));
    let mut client = retrying_client(server.addr, &GrpcRetryLayer::new(policy).method(PAY));
    let key = format!("retry-outage-{}", uuid::Uuid::new_v4());
    proxy.set_mode(Mode::Refuse);
    proxy.kill_connections();
    let repair = {
        let (server, key) = (Arc::clone(&server), key.clone());
        tokio::spawn(async move {
            // Back once a retry has reached the server: the first attempt was answered UNAVAILABLE.
            let start = tokio::time::Instant::now();
            while server.attempts(&key) < 2 && start.elapsed() < Duration::from_secs(20) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            proxy.set_mode(Mode::Pass);
            proxy
        })
    };
    let receipt = client.pay(pay(Some(&key), "quinn", 4, "")).await.expect("an attempt after the outage runs the call");
    let _proxy = repair.await.unwrap();
    let noted = attempts(&receipt);
    println!("a store outage: {noted:?}, the bank paid {} time(s)", ledger.len());
    assert!(noted.count >= 2, "the attempts during the outage were retried: {noted:?}");
    assert!(!replayed(&receipt), "the UNAVAILABLE answers were not recorded: an attempt ran the call");
    assert_eq!(server.attempts(&key), usize::try_from(noted.count).unwrap(), "one key for every attempt");
    assert_eq!(ledger.len(), 1, "paid once");
    drop(server);
    cleanup.run().await;
}
