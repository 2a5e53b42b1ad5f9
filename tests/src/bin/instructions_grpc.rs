//! A fixed workload per case, for counting instructions with callgrind (`scripts/instructions`):
//! unary `Pay` calls through the tonic service in-process (`tower::ServiceExt::oneshot` on the
//! generated server, no connection, no HTTP/2 framing), plain and behind `GrpcIdempotencyLayer`
//! on the memory store.
//!
//! `instructions_grpc <case> <calls>` with the cases `grpc_plain` (the service alone, no key),
//! `grpc_first` (every call a new key) and `grpc_replay` (2,000 recorded keys, in turn). Each
//! answer's body and trailers are read to their end, as a connection would send them.

use bytes::{BufMut as _, Bytes, BytesMut};
use http_body_util::{BodyExt as _, Full};
use idempotent_runtime::MemoryStore;
use idempotent_runtime::grpc::GrpcIdempotencyLayer;
use idempotent_tests::grpc::{Bank, PAY, PayRequest, PaymentsServer};
use prost::Message as _;
use tonic::body::Body;
use tower::{Layer as _, ServiceExt as _};

const KEYS: u64 = 2_000;

/// A `Pay` call as a client sends it: the length-prefixed message, with `key` as its
/// `idempotency-key` metadata if there is one.
fn call(key: Option<u64>) -> http::Request<Body> {
    let message = PayRequest { request_id: String::new(), user: "bench".into(), amount: 1, behaviour: String::new() };
    let mut frame = BytesMut::with_capacity(5 + message.encoded_len());
    frame.put_u8(0);
    frame.put_u32(u32::try_from(message.encoded_len()).expect("a small message"));
    message.encode(&mut frame).expect("room for the message");
    let mut request = http::Request::post(format!("http://localhost{PAY}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(key) = key {
        request = request.header("idempotency-key", format!("k-{key}"));
    }
    request.body(Body::new(Full::new(Bytes::from(frame)))).expect("a valid request")
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(case), Some(calls)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: instructions_grpc <grpc_plain|grpc_first|grpc_replay> <calls>");
        return;
    };
    let calls: u64 = calls.parse().expect("a number of calls");
    let plain = PaymentsServer::new(Bank::default());
    let layered = GrpcIdempotencyLayer::new(MemoryStore::new())
        .keys_shared_by_all_callers()
        .method(PAY)
        .layer(PaymentsServer::new(Bank::default()));
    for key in 0..KEYS {
        layered.clone().oneshot(call(Some(key))).await.expect("infallible").into_body().collect().await.unwrap();
        plain.clone().oneshot(call(None)).await.expect("infallible").into_body().collect().await.unwrap();
    }
    for i in 0..calls {
        let answer = match case.as_str() {
            "grpc_plain" => plain.clone().oneshot(call(None)).await,
            "grpc_first" => layered.clone().oneshot(call(Some(KEYS + i))).await,
            "grpc_replay" => layered.clone().oneshot(call(Some(i % KEYS))).await,
            other => panic!("unknown case {other}"),
        };
        let answer = answer.expect("infallible");
        let replayed = answer.headers().contains_key("idempotent-replayed");
        assert_eq!(replayed, case == "grpc_replay", "{case}: idempotent-replayed");
        let read = answer.into_body().collect().await.expect("a whole answer");
        let status = read.trailers().and_then(|t| t.get("grpc-status")).map(http::HeaderValue::as_bytes);
        assert_eq!(status, Some(&b"0"[..]), "{case}: grpc-status");
        assert!(!read.to_bytes().is_empty(), "{case}: a receipt");
    }
}
