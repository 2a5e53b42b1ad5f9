//! The history's clients: callers that each send one call through a tonic channel of their own
//! and retry it with the same key, the way a gRPC client's `retryPolicy` and a deadline would.
//!
//! A caller resends on `UNAVAILABLE`, `ABORTED` and `DEADLINE_EXCEEDED` (or `CANCELLED`, what
//! tonic's server answers when a call's deadline passes), and when the call failed in the
//! transport (the connection refused, cut or lost, its own deadline passed): up to its attempts,
//! within 4 s. It waits the server's `grpc-retry-pushback-ms` when positive, and stops at once
//! when it is negative (gRFC A6); otherwise it backs off exponentially from 20 ms to 200 ms, half
//! of each pause jittered.

use std::time::Duration;

use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::{Code, Status};

use super::plan::{CallerPlan, Plan, message};
use super::server::{Answer, PUSHBACK, Seen};
use crate::grpc::PaymentsClient;
use crate::simulation::rng::SplitMix64;

/// A caller's last outcome: the answer it got, or its error (transport, deadline).
pub(super) type Final = Result<Seen, String>;

/// How long a caller keeps retrying, from its first attempt.
const RETRY_BUDGET: Duration = Duration::from_secs(4);

/// The answer a client received: what `result` says, with the metadata a replay carries.
pub(super) fn received(caller: usize, result: &Result<tonic::Response<crate::grpc::Receipt>, Status>) -> Seen {
    let metadata = match result {
        Ok(response) => response.metadata(),
        Err(status) => status.metadata(),
    };
    Seen {
        caller,
        answer: Answer::of(&result.as_ref().map(|r| r.get_ref().clone()).map_err(Clone::clone)),
        replayed: metadata.get("idempotent-replayed").is_some_and(|v| v == "true"),
        pushback: metadata.get(PUSHBACK).and_then(|v| v.to_str().ok()).map(str::to_owned),
        at: Instant::now(),
    }
}

/// Caller `i` sends its call to `target` (with its retries) and returns the last outcome.
pub(super) async fn call(i: usize, plan: &Plan, caller: &CallerPlan, target: &str, key: &str) -> Final {
    tokio::time::sleep(caller.delay).await;
    let channel = Channel::from_shared(target.to_owned()).expect("a channel's address").connect_lazy();
    let mut client = PaymentsClient::new(channel);
    let mut jitter = SplitMix64::new(caller.jitter);
    let started = Instant::now();
    let mut last: Final = Err("no attempt".to_owned());
    for attempt in 1..=caller.attempts {
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
        let sent = client.pay(request);
        let result = match caller.deadline {
            Some(deadline) => tokio::time::timeout(deadline, sent).await.map_err(|_| ()),
            None => Ok(sent.await),
        };
        // What to wait before the next attempt, if there is one.
        let pause = match result {
            Err(()) => {
                last = Err(format!("attempt {attempt}: its deadline passed"));
                None
            }
            Ok(Err(status)) if std::error::Error::source(&status).is_some() => {
                last = Err(format!("attempt {attempt}: {:?} in the transport: {}", status.code(), status.message()));
                None
            }
            Ok(result) => {
                let seen = received(i, &result);
                let code = seen.answer.code;
                let pushback = seen.pushback.as_deref().and_then(|p| p.parse::<i64>().ok());
                last = Ok(seen);
                let retryable =
                    matches!(code, Code::Unavailable | Code::Aborted | Code::DeadlineExceeded | Code::Cancelled);
                match pushback {
                    _ if !retryable => break,
                    Some(ms) if ms < 0 => break,
                    Some(ms) => Some(Duration::from_millis(ms.unsigned_abs())),
                    None => None,
                }
            }
        };
        if attempt == caller.attempts || started.elapsed() >= RETRY_BUDGET {
            break;
        }
        // 20, 40, 80, 160, 200 ms, half of it jittered.
        let backoff = (20 << attempt.min(5).saturating_sub(1)).min(200);
        let backoff = Duration::from_millis(backoff / 2) + jitter.millis(backoff / 2);
        tokio::time::sleep(pause.unwrap_or(backoff)).await;
    }
    last
}
