//! The history's clients: the callers that send the request (the network's faults are
//! [`edge`](crate::simulation::edge)'s).

use std::time::Duration;

use idempotent_runtime::client::{IdempotentRetry, OutboundError, RetryPolicy};
use idempotent_runtime::http::IDEMPOTENCY_KEY;

use super::plan::{CallerPlan, request_body};
use super::server::{Seen, seen};

/// A caller's last outcome: the response it got, or its error.
pub(super) type Final = Result<Seen, String>;

/// Caller `i` sends its request (with its retries) and reads the answer.
pub(super) async fn call(i: usize, plan: &CallerPlan, url: &str, key: &str) -> Final {
    tokio::time::sleep(plan.delay).await;
    let inner = reqwest::Client::builder().build().expect("a reqwest client");
    let client = match plan.retry {
        Some((attempts, jitter)) => reqwest_middleware::ClientBuilder::new(inner)
            .with(IdempotentRetry::new(
                RetryPolicy::default()
                    .max_attempts(attempts)
                    .backoff(Duration::from_millis(20), Duration::from_millis(200))
                    .max_elapsed(Duration::from_secs(4))
                    .jitter_seed(jitter),
            ))
            .build(),
        None => reqwest_middleware::ClientBuilder::new(inner).build(),
    };
    let mut request = client
        .post(url)
        .header(IDEMPOTENCY_KEY, key)
        .header("x-user", plan.user.to_string())
        .header("x-key", plan.key.to_string())
        .header("x-caller", i.to_string())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(request_body(plan.key, plan.body));
    if let Some(timeout) = plan.timeout {
        request = request.timeout(timeout);
    }
    let response = match request.send().await {
        Ok(response) => response,
        Err(e) => {
            return Err(match OutboundError::find(&e) {
                Some(outbound) => format!("{outbound}"),
                None => format!("{e}"),
            });
        }
    };
    let (status, headers) = (response.status(), response.headers().clone());
    match response.bytes().await {
        Ok(body) => Ok(seen(i, status, &headers, &body)),
        Err(e) => Err(format!("reading the body of a {status}: {e}")),
    }
}
