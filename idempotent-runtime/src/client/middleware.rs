//! The middleware: give a request its key, send it, retry what is safe to retry with that key.

use std::time::Duration;

use http::{Extensions, HeaderValue, Method, StatusCode};
use reqwest::{Request, Response, ResponseBuilderExt as _};
use reqwest_middleware::{Middleware, Next};
use tokio::time::Instant;

use super::error::OutboundError;
use super::policy::{is_retryable_status, retry_after};
use crate::headers::{IDEMPOTENCY_KEY, is_replayed};
use crate::retry::{Attempts, RetryPolicy, Stopped};

/// `reqwest-middleware` middleware that makes non-idempotent requests safe to retry, and retries
/// them: each gets an `Idempotency-Key` (a v4 UUID from the operating system's random source, so
/// that copies of this process never send the same one) unless it has one, and every retry
/// carries the same key, so the server runs the request once however many attempts reach it.
///
/// Requests with a [method](Self::methods) in its set (`POST` and `PATCH` by default), or that
/// already carry an `Idempotency-Key`, are handled; every other request passes through untouched.
///
/// | outcome of an attempt | what happens |
/// |---|---|
/// | connection refused or lost, timeout (no response) | retried after a back-off |
/// | `408`, `409`, `429`, `5xx` | retried after `Retry-After` if sent (at most the time budget), else after a back-off |
/// | a replayed response (`Idempotent-Replayed: true`), whatever its status | returned as it is: it is the recorded outcome, and another attempt would get it again ([`Stopped::Replayed`] if its status asked for a retry) |
/// | `422` refusing the key (problem type `urn:idempotent:key-reused`, as [`IdempotencyLayer`](crate::http::IdempotencyLayer) sends it) | [`OutboundError::KeyReused`]: the key was used with another request |
/// | any other `422` (the handler's own answer, a validation failure) | returned as it is |
/// | any other status | returned as it is |
/// | attempts or time budget used up | the last response, or [`OutboundError::GaveUp`] with the key |
/// | a failure on a streaming body | returned without retry ([`OutboundError::NotReplayable`], or the response marked [`Stopped::BodyNotReplayable`]) |
///
/// Every response it returns carries an [`Attempts`] extension (key, attempts, why it stopped).
/// Bounds, back-off and jitter are set by a [`RetryPolicy`]. A `Retry-After` longer than what is
/// left of the time budget is not waited for: the response is returned at once
/// ([`Stopped::TimeBudgetExhausted`]), however large the value.
///
/// # What it retries, and why that is safe
///
/// It retries an attempt that may not have been processed (no response: the request may or may
/// not have reached the server), or whose answer says "not now" (`408`: a timeout in front of the
/// handler stopped waiting for it; `409`: the first attempt with this key is still running;
/// `429`; `5xx`). Each retry carries the first attempt's key, so
/// **against a server that honours `Idempotency-Key`** the request runs at most once, whatever
/// happened to the attempts before it: a server that already ran it answers with what it recorded
/// instead of running it again. [`IdempotencyLayer`](crate::http::IdempotencyLayer) is such a
/// server: with its defaults it records every response its handler produced, `5xx` included,
/// so a handler that charged and then failed with `500` is not charged again by this retry; the
/// retry gets the recorded `500` back, marked `Idempotent-Replayed: true`, and this middleware
/// stops there. A `408`, `409`, `429` or `5xx` that the server answers *without* running the handler
/// (its store is down, the key is in use) is not recorded, and the retry is what gets it run.
///
/// Against a server that ignores the header, a retried `POST` can run twice, as any retried
/// `POST` can: use this middleware with services that support `Idempotency-Key`, or give it only
/// the [methods](Self::methods) that are idempotent there.
///
/// ```
/// use idempotent_runtime::client::{IdempotentRetry, RetryPolicy};
/// use reqwest_middleware::ClientBuilder;
///
/// let client = ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotentRetry::new(RetryPolicy::default().max_attempts(6)))
///     .build();
/// // client.post(url).json(&payment).send().await: one key, however many attempts.
/// # let _ = client;
/// ```
///
/// # Keys derived from the idempotent call it runs in
///
/// Inside the body of an idempotent call (the attribute, [`Call::run`](crate::Call::run), a
/// handler behind [`IdempotencyLayer`](crate::http::IdempotencyLayer)), a request without an
/// `Idempotency-Key` gets a key derived from the call's scope and key, the request's method and
/// path, its position among the run's derived-key requests with that method and path, and behind a layer the route the
/// call's own request came on (see [`derived_key`](crate::derived_key)),
/// instead of a random one. So when the body runs again for the same key (its `Err` released the
/// key, or its process died and the claim was taken over), it sends the same keys in the same
/// order, and the downstream service replays instead of acting twice. This asks the body to be
/// deterministic in its requests: the same requests, in the same order, on every run for a key
/// (build them from the call's inputs and from [`step`](crate::step) results, not from the clock
/// or random numbers). An explicit `Idempotency-Key` always wins; [`derive_keys(false)`](Self::derive_keys)
/// or [`without_derived_keys`](crate::without_derived_keys) opts out. Outside an idempotent body,
/// and in tasks the body spawns, keys are random v4 UUIDs.
///
/// Middleware attached before it (`.with(a).with(IdempotentRetry::..)`) sees each request once;
/// middleware attached after it runs for every attempt: put there what must be redone per
/// attempt (signing a request with a timestamp, logging each attempt).
#[derive(Debug, Clone)]
pub struct IdempotentRetry {
    policy: RetryPolicy,
    methods: Vec<Method>,
    derive_keys: bool,
}

impl Default for IdempotentRetry {
    fn default() -> Self {
        Self::new(RetryPolicy::default())
    }
}

/// What one attempt's outcome calls for.
enum Verdict {
    /// Return it (noting why, when it asked for a retry).
    Done(Option<Stopped>),
    /// `422` on a keyed request.
    KeyReused,
    /// Retry, after `Retry-After` if the server sent it.
    Retry { retry_after: Option<Duration> },
}

impl IdempotentRetry {
    /// The middleware with `policy`, handling `POST` and `PATCH`.
    #[must_use]
    pub fn new(policy: RetryPolicy) -> Self {
        IdempotentRetry { policy, methods: vec![Method::POST, Method::PATCH], derive_keys: true }
    }

    /// Handles exactly these methods (default `POST` and `PATCH`). Requests that already carry
    /// an `Idempotency-Key` are handled whatever their method.
    #[must_use]
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Whether a request without a key, sent from inside an idempotent body, gets a key derived
    /// from that call (default `true`; see [the section above](Self#keys-derived-from-the-idempotent-call-it-runs-in)).
    /// With `false`, every such request gets a random key, as outside any call.
    #[must_use]
    pub fn derive_keys(mut self, derive_keys: bool) -> Self {
        self.derive_keys = derive_keys;
        self
    }

    /// The policy in use.
    #[must_use]
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    async fn send(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> Result<Response, reqwest_middleware::Error> {
        let key = if let Some(value) = request.headers().get(&IDEMPOTENCY_KEY) {
            String::from_utf8_lossy(value.as_bytes()).into_owned()
        } else {
            let key = crate::context::outbound_key(request.method().as_str(), request.url().path(), self.derive_keys);
            let value = HeaderValue::from_str(&key).expect("a UUID or hex digest is a valid header value");
            request.headers_mut().insert(IDEMPOTENCY_KEY, value);
            key
        };
        let url = request.url().to_string();
        let start = Instant::now();
        let mut count = 1;
        loop {
            let spare = request.try_clone();
            let result = next.clone().run(request, extensions).await;
            let retry_after = match classify(&result) {
                Verdict::Done(stopped) => return Ok(mark(result?, &key, count, stopped)),
                Verdict::KeyReused => {
                    return match refusal_or_answer(result?, key.clone(), url).await {
                        // Not the key's refusal: the server's answer, returned as it came.
                        Ok(response) => Ok(mark(response, &key, count, None)),
                        Err(error) => Err(error),
                    };
                }
                Verdict::Retry { retry_after } => retry_after,
            };
            let Some(spare) = spare else {
                tracing::warn!(target: "idempotent", %url, key, "not retrying: the request body is a stream");
                return match result {
                    Ok(response) => Ok(mark(response, &key, count, Some(Stopped::BodyNotReplayable))),
                    Err(source) => Err(reqwest_middleware::Error::middleware(OutboundError::NotReplayable {
                        key,
                        url,
                        source: Box::new(source),
                    })),
                };
            };
            let wait = match self.policy.next_wait(count, retry_after, start.elapsed()) {
                Ok(wait) => wait,
                Err(stopped) => {
                    tracing::warn!(target: "idempotent", %url, key, attempts = count, %stopped, "giving up");
                    return match result {
                        Ok(response) => Ok(mark(response, &key, count, Some(stopped))),
                        Err(source) => Err(reqwest_middleware::Error::middleware(OutboundError::GaveUp {
                            key,
                            url,
                            attempts: count,
                            elapsed: start.elapsed(),
                            source: Box::new(source),
                        })),
                    };
                }
            };
            match &result {
                Ok(response) => tracing::info!(
                    target: "idempotent", %url, key, attempt = count, status = response.status().as_u16(),
                    wait_ms = wait.as_millis(), "retrying with the same key"
                ),
                Err(error) => tracing::info!(
                    target: "idempotent", %url, key, attempt = count, %error,
                    wait_ms = wait.as_millis(), "retrying with the same key"
                ),
            }
            drop(result);
            tokio::time::sleep(wait).await;
            request = spare;
            count += 1;
        }
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotentRetry {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> Result<Response, reqwest_middleware::Error> {
        if !self.methods.contains(request.method()) && !request.headers().contains_key(&IDEMPOTENCY_KEY) {
            return next.run(request, extensions).await;
        }
        self.send(request, extensions, next).await
    }
}

fn classify(result: &Result<Response, reqwest_middleware::Error>) -> Verdict {
    match result {
        // The server's record of this key: every later attempt gets the same answer.
        Ok(response) if is_replayed(response.headers()) => {
            Verdict::Done(is_retryable_status(response.status()).then_some(Stopped::Replayed))
        }
        Ok(response) if response.status() == StatusCode::UNPROCESSABLE_ENTITY => Verdict::KeyReused,
        Ok(response) if is_retryable_status(response.status()) => {
            Verdict::Retry { retry_after: retry_after(response.headers()) }
        }
        // No response: the request may or may not have reached the server, and the key makes
        // sending it again safe either way.
        Err(reqwest_middleware::Error::Reqwest(error))
            if error.is_connect() || error.is_timeout() || error.is_request() =>
        {
            Verdict::Retry { retry_after: None }
        }
        // Other statuses are answers. Builder, redirect and other middleware's errors: another
        // attempt would fail the same way.
        Ok(_) | Err(_) => Verdict::Done(None),
    }
}

fn mark(mut response: Response, key: &str, count: u32, stopped: Option<Stopped>) -> Response {
    response.extensions_mut().insert(Attempts { key: key.to_owned(), count, stopped });
    response
}

/// The problem type of `IdempotencyLayer`'s (and `HttpError`'s) refusal of a key used with
/// another request.
const KEY_REUSED_PROBLEM: &str = "urn:idempotent:key-reused";

/// A `422` on a keyed request: the typed error if it is the server's refusal of a reused key (a
/// problem document of type `urn:idempotent:key-reused`, with the server's `detail`), otherwise
/// the response itself, rebuilt from its status, headers and body: a `422` the handler answered
/// (a validation failure, axum's `Json` rejection) is its answer to a fresh key, not a reused one.
async fn refusal_or_answer(
    mut response: Response,
    key: String,
    url: String,
) -> Result<Response, reqwest_middleware::Error> {
    let (status, version, headers) = (response.status(), response.version(), response.headers().clone());
    let (response_url, extensions) = (response.url().clone(), std::mem::take(response.extensions_mut()));
    let body = response.bytes().await?;
    let problem = serde_json::from_slice::<serde_json::Value>(&body).ok();
    if problem.as_ref().and_then(|p| p.get("type")?.as_str()) != Some(KEY_REUSED_PROBLEM) {
        let mut rebuilt = http::Response::builder()
            .status(status)
            .version(version)
            .url(response_url)
            .body(body)
            .expect("the parts of a response that was received");
        *rebuilt.headers_mut() = headers;
        rebuilt.extensions_mut().extend(extensions);
        return Ok(Response::from(rebuilt));
    }
    let detail = problem.and_then(|problem| problem.get("detail")?.as_str().map(str::to_owned));
    Err(reqwest_middleware::Error::middleware(OutboundError::KeyReused { key, url, detail }))
}
