//! The history's clients: callers that each send one call through a tonic channel of their own
//! and retry it with the same key, the way a gRPC client's `retryPolicy` and a deadline would.
//!
//! A caller resends on `UNAVAILABLE`, `ABORTED` and `DEADLINE_EXCEEDED` (or `CANCELLED`, what
//! tonic's server answers when a call's deadline passes), and when the call failed in the
//! transport (the connection refused, cut or lost, its own deadline passed): up to its attempts,
//! within 4 s. It waits the server's `grpc-retry-pushback-ms` when positive, and stops at once
//! when it is negative (gRFC A6); otherwise it backs off exponentially from 20 ms to 200 ms, half
//! of each pause jittered.
//!
//! A caller does that by one of two means, drawn per caller: a retry loop written by hand around
//! the generated client, or [`GrpcRetryLayer`] on its channel, with those codes, attempts, back-off
//! and budget (a layered caller sees only its last outcome; the layer also stops at a replayed
//! answer). Either sets the key itself (the `idempotency-key` metadata, or the message's
//! `request_id` in plans keyed by message) and a deadline on each attempt (`Request::set_timeout`).
//! Under the layer, a [`Tap`] on the channel numbers each attempt and notes what it got, as the
//! hand loop does for its own: [`Ended::tried`].

use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt as _;
use idempotent_runtime::grpc::{GrpcRetryLayer, RetryPolicy};
use tokio::time::Instant;
use tonic::body::Body;
use tonic::transport::Channel;
use tonic::{Code, Status};

use super::ConfigBug;
use super::plan::{CallerPlan, Plan, message};
use super::server::{Answer, PUSHBACK, Seen, seen};
use crate::grpc::{PAY, PaymentsClient};
use crate::simulation::rng::SplitMix64;

/// A caller's last outcome: the answer it got, or its error (transport, deadline).
pub(super) type Final = Result<Seen, String>;

/// How long a caller keeps retrying, from its first attempt.
pub(super) const RETRY_BUDGET: Duration = Duration::from_secs(4);

/// The codes a caller retries (both kinds).
pub(super) const RETRIED: [Code; 4] = [Code::Unavailable, Code::Aborted, Code::DeadlineExceeded, Code::Cancelled];

/// The shortest and longest back-off of both kinds of caller: 20 ms doubling up to 200 ms.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(20), Duration::from_millis(200));

/// The back-off before retry `retry` (1 for the first): 20, 40, 80, 160, 200 ms, of which a
/// pause is drawn from the upper half. The hand loop spaces its retries as the layer's
/// [`RetryPolicy`] does, so this is that policy's range.
pub(super) fn backoff(retry: u32) -> Duration {
    RetryPolicy::default().backoff(BACKOFF.0, BACKOFF.1).backoff_range(retry).1
}

/// One attempt of a call, as its caller's side saw it.
#[derive(Debug, Clone)]
pub(super) struct Tried {
    /// When it was sent.
    pub(super) sent: Instant,
    /// When its outcome came (its answer's end, or its error).
    pub(super) done: Option<Instant>,
    /// The answer it got, or why none came.
    pub(super) outcome: Final,
}

/// How a caller's call ended: its last outcome, and each attempt it made.
#[derive(Debug, Clone)]
pub(super) struct Ended {
    pub(super) last: Final,
    pub(super) tried: Vec<Tried>,
    /// When the call was made, and when its last outcome came back.
    pub(super) called: Instant,
    pub(super) returned: Instant,
}

/// The answer a client received: what `result` says, with the metadata a replay carries.
pub(super) fn received(caller: usize, result: &Result<tonic::Response<crate::grpc::Receipt>, Status>) -> Seen {
    let metadata = match result {
        Ok(response) => response.metadata(),
        Err(status) => status.metadata(),
    };
    Seen {
        caller,
        attempt: usize::MAX,
        answer: Answer::of(&result.as_ref().map(|r| r.get_ref().clone()).map_err(Clone::clone)),
        replayed: metadata.get("idempotent-replayed").is_some_and(|v| v == "true"),
        pushback: metadata.get(PUSHBACK).and_then(|v| v.to_str().ok()).map(str::to_owned),
        at: Instant::now(),
    }
}

/// The request caller `i` sends on each attempt: its message, its key (unless the message carries
/// it), who it is, its deadline.
fn request(i: usize, plan: &Plan, caller: &CallerPlan, key: &str) -> tonic::Request<crate::grpc::PayRequest> {
    let mut request = tonic::Request::new(message(plan, caller.key, key, caller.message));
    let metadata = request.metadata_mut();
    if !plan.keyed_by_message {
        metadata.insert("idempotency-key", key.parse().expect("a key as metadata"));
    }
    metadata.insert("x-user", caller.user.into());
    metadata.insert("x-key", caller.key.into());
    metadata.insert("x-caller", i.into());
    if let Some(deadline) = caller.deadline {
        request.set_timeout(deadline);
    }
    request
}

/// Caller `i` sends its call to `target` (with its retries) and returns how it ended. Under
/// [`ConfigBug::RetryLayerFreshKeys`] a layered caller's attempts each get a fresh key.
pub(super) async fn call(
    i: usize,
    plan: &Plan,
    caller: &CallerPlan,
    target: &str,
    key: &str,
    bug: Option<ConfigBug>,
) -> Ended {
    tokio::time::sleep(caller.delay).await;
    let channel = Channel::from_shared(target.to_owned()).expect("a channel's address").connect_lazy();
    if caller.layered {
        layered(i, plan, caller, channel, key, bug == Some(ConfigBug::RetryLayerFreshKeys)).await
    } else {
        by_hand(i, plan, caller, channel, key).await
    }
}

/// The hand-written retry loop around the generated client.
async fn by_hand(i: usize, plan: &Plan, caller: &CallerPlan, channel: Channel, key: &str) -> Ended {
    let mut client = PaymentsClient::new(channel);
    let mut jitter = SplitMix64::new(caller.jitter);
    let started = Instant::now();
    let mut last: Final = Err("no attempt".to_owned());
    let mut tried = Vec::new();
    for attempt in 1..=caller.attempts {
        let mut request = request(i, plan, caller, key);
        request.metadata_mut().insert("x-attempt", attempt.into());
        let sent_at = Instant::now();
        let sent = client.pay(request);
        let result = match caller.deadline {
            Some(deadline) => tokio::time::timeout(deadline, sent).await.map_err(|_| ()),
            None => Ok(sent.await),
        };
        last = match result {
            Err(()) => Err(format!("attempt {attempt}: its deadline passed")),
            Ok(Err(status)) if std::error::Error::source(&status).is_some() => {
                Err(format!("attempt {attempt}: {:?} in the transport: {}", status.code(), status.message()))
            }
            Ok(result) => Ok(received(i, &result)),
        };
        let outcome = last.clone().map(|seen| Seen { attempt: attempt as usize, ..seen });
        tried.push(Tried { sent: sent_at, done: Some(Instant::now()), outcome });
        // What to wait before the next attempt, if there is one.
        let pause = match &last {
            Err(_) => None,
            Ok(seen) => match seen.pushback.as_deref().and_then(|p| p.parse::<i64>().ok()) {
                _ if !RETRIED.contains(&seen.answer.code) => break,
                Some(ms) if ms < 0 => break,
                Some(ms) => Some(Duration::from_millis(ms.unsigned_abs())),
                None => None,
            },
        };
        if attempt == caller.attempts || started.elapsed() >= RETRY_BUDGET {
            break;
        }
        let backoff = backoff(attempt);
        let backoff = backoff / 2 + jitter.millis(u64::try_from(backoff.as_millis()).unwrap_or(200) / 2);
        tokio::time::sleep(pause.unwrap_or(backoff)).await;
    }
    Ended { last, tried, called: started, returned: Instant::now() }
}

/// The call through `GrpcRetryLayer` on the caller's channel, one call of the generated client.
async fn layered(i: usize, plan: &Plan, caller: &CallerPlan, channel: Channel, key: &str, fresh_keys: bool) -> Ended {
    let policy = RetryPolicy::default()
        .max_attempts(caller.attempts)
        .backoff(BACKOFF.0, BACKOFF.1)
        .max_elapsed(RETRY_BUDGET)
        .jitter_seed(caller.jitter);
    let retries = GrpcRetryLayer::new(policy).method(PAY).retry_codes(RETRIED);
    let tried = Arc::new(Mutex::new(Vec::new()));
    let tap = Tap { inner: channel, caller: i, tried: Arc::clone(&tried), fresh_keys };
    let mut client = PaymentsClient::new(retries.service(tap));
    let began = Instant::now();
    let result = client.pay(request(i, plan, caller, key)).await;
    let returned = Instant::now();
    let last = match &result {
        Err(status) if std::error::Error::source(status).is_some() => {
            Err(format!("{:?} in the transport: {}", status.code(), status.message()))
        }
        _ => Ok(received(i, &result)),
    };
    let tried = tried.lock().unwrap_or_else(PoisonError::into_inner).clone();
    Ended { last, tried, called: began, returned }
}

/// Under the retry layer, on the channel: numbers each attempt (`x-attempt`) and notes what it got
/// as the layer receives it. With `fresh_keys` (a planted bug), gives each attempt a fresh key.
#[derive(Clone)]
struct Tap {
    inner: Channel,
    caller: usize,
    tried: Arc<Mutex<Vec<Tried>>>,
    fresh_keys: bool,
}

/// Notes `outcome` as attempt `n`'s.
fn note(tried: &Mutex<Vec<Tried>>, n: usize, outcome: Final) {
    let mut tried = tried.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(attempt) = tried.get_mut(n) {
        attempt.outcome = outcome;
        attempt.done = Some(Instant::now());
    }
}

type ChannelError = <Channel as tower::Service<http::Request<Body>>>::Error;

impl tower::Service<http::Request<Body>> for Tap {
    type Response = http::Response<Body>;
    type Error = ChannelError;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        let n = {
            let mut tried = self.tried.lock().unwrap_or_else(PoisonError::into_inner);
            let outcome = Err("no answer yet".to_owned());
            tried.push(Tried { sent: Instant::now(), done: None, outcome });
            tried.len() - 1
        };
        request.headers_mut().insert("x-attempt", (n + 1).into());
        if self.fresh_keys {
            let fresh = uuid::Uuid::new_v4().to_string();
            request.headers_mut().insert("idempotency-key", fresh.parse().expect("a UUID as metadata"));
        }
        let answer = self.inner.call(request);
        let (tried, caller) = (Arc::clone(&self.tried), self.caller);
        Box::pin(async move {
            let (parts, body) = match answer.await {
                Ok(answer) => answer.into_parts(),
                Err(error) => {
                    note(&tried, n, Err(format!("no answer: {error}")));
                    return Err(error);
                }
            };
            // A trailers-only answer is whole now; another when its trailers come.
            if parts.headers.contains_key("grpc-status") {
                note(&tried, n, Ok(Seen { attempt: n + 1, ..seen(caller, &parts.headers, &Bytes::new(), None) }));
            }
            let (headers, mut data) = (parts.headers.clone(), BytesMut::new());
            let (on_frame, on_error) = (Arc::clone(&tried), Arc::clone(&tried));
            let body = body
                .map_frame(move |frame| {
                    if let Some(chunk) = frame.data_ref() {
                        data.extend_from_slice(chunk);
                    }
                    if let Some(trailers) = frame.trailers_ref() {
                        let whole = seen(caller, &headers, &data.clone().freeze(), Some(trailers));
                        note(&on_frame, n, Ok(Seen { attempt: n + 1, ..whole }));
                    }
                    frame
                })
                .map_err(move |error: Status| {
                    note(&on_error, n, Err(format!("cut off: {error}")));
                    error
                });
            Ok(http::Response::from_parts(parts, Body::new(body)))
        })
    }
}
