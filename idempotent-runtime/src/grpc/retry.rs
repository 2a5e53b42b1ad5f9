//! Retries for tonic clients: a tower layer over the channel that gives a unary call one key,
//! sends it again with that key while its answer says another attempt could change it, and stops
//! at the server's record.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Request};
use http_body_util::{BodyExt as _, Full, LengthLimitError, Limited};
use tokio::time::Instant;
use tonic::body::Body;
use tonic::{Code, Status};
use tower::{Layer, Service};

use super::layer::DEFAULT_MAX_REQUEST_BYTES;
use super::recorded::{Answer, Read, read_answer};
use super::status::RETRY_PUSHBACK;
use crate::headers::{IDEMPOTENCY_KEY, is_replayed};
use crate::retry::{Attempts, RetryPolicy, Stopped};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The codes [`GrpcRetryLayer`] retries unless told otherwise: `UNAVAILABLE` (the server or the
/// way to it is down; [`GrpcIdempotencyLayer`](super::GrpcIdempotencyLayer) answers it when its
/// store is) and `ABORTED` (the layer's "a call with this key is still running", with a pushback).
pub const DEFAULT_RETRY_CODES: [Code; 2] = [Code::Unavailable, Code::Aborted];

/// The largest answer read whole to decide whether to retry it: tonic's default limit for a
/// decoded message, and its 5-byte prefix. A larger answer is passed on as it comes, not retried.
const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024 + 5;

/// Retries the unary calls of a tonic channel with one `idempotency-key` for all their attempts,
/// so that a server honouring the key (as [`GrpcIdempotencyLayer`](super::GrpcIdempotencyLayer)
/// does) runs each call once however many attempts reach it.
///
/// tonic has no retries of its own, and a retry written by hand around a generated client calls
/// the method again: [`IdempotencyKeys`](super::IdempotencyKeys) cannot tell that from a second
/// payment and gives it a new key. This layer sits under the generated client, so it sees each
/// call once and every attempt of it:
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::grpc::{GrpcRetryLayer, RetryPolicy};
///
/// let retries = GrpcRetryLayer::new(RetryPolicy::default().max_elapsed(Duration::from_secs(10)))
///     .method("/payments.Payments/Pay");
/// // let channel = Channel::from_static("http://[::1]:50051").connect_lazy();
/// // let mut client = PaymentsClient::new(retries.service(channel));
/// // client.pay(request).await: one key, however many attempts.
/// # let _ = retries;
/// ```
///
/// It covers the unary methods it is given by path, as the server's layer does; calls to other
/// paths pass through untouched (it buffers a covered call's request to send it again, which a
/// streaming call cannot survive). A covered call gets a key unless it carries one: inside an
/// idempotent body the key [derived](crate::derived_key) from the body's key, the method's path
/// and the call's position (the key [`IdempotencyKeys`](super::IdempotencyKeys) would give it),
/// elsewhere a fresh UUID. A key the call carries is kept.
///
/// | outcome of an attempt | what happens |
/// |---|---|
/// | no answer (connection refused or lost, the call's timeout passed, the answer cut off) | retried after a back-off |
/// | `DEADLINE_EXCEEDED` or `CANCELLED`, not replayed: a server or proxy stopped waiting for the call (tonic's server answers `CANCELLED` when a call's timeout passes), which may have run | retried as the timeout passing on the client is: after the server's `grpc-retry-pushback-ms` if it sent a positive one, else after a back-off |
/// | a code in the [retried set](Self::retry_codes) (default `UNAVAILABLE`, `ABORTED`) | retried after the server's `grpc-retry-pushback-ms` if it sent one, else after a back-off |
/// | either of the two rows above with a negative pushback | returned ([`Stopped::ServerRefusedRetries`]): the server asks not to retry (gRFC A6) |
/// | a replayed answer (`idempotent-replayed: true` in its metadata), whatever its code | returned: it is the call's recorded outcome, which another attempt would get again ([`Stopped::Replayed`] if its code is in the retried set) |
/// | any other answer, `OK` or not | returned as it is |
/// | attempts or time budget used up | the last answer, or the last attempt's error |
///
/// An answer without `grpc-status` (an HTTP proxy's own, such as a load balancer's `503`) is read
/// as gRPC maps its HTTP status: `429`, `502`, `503` and `504` are `UNAVAILABLE`.
///
/// A successful answer carries an [`Attempts`] extension (`tonic::Response::extensions`): the
/// key, the attempts, why it stopped. An error status carries no extensions: set the key yourself
/// (`idempotency-key` metadata) if you need to know it after a failure.
///
/// **Timeouts.** A call's timeout (`Request::set_timeout`, the channel's `timeout`) bounds each
/// attempt; the policy's [`max_elapsed`](RetryPolicy::max_elapsed) bounds them all. A call whose
/// timeout passed may have run on the server: its retry carries the same key, and the server's
/// layer, which runs each call to its end, answers it with `ABORTED` while the first attempt runs
/// and with its recorded answer after. The server sees the timeout too (tonic's server reads it
/// from `grpc-timeout`), and on a busy machine its deadline answer can arrive before the client's
/// own timer fires: that answer is retried the same way, so which of the two comes first does not
/// change the outcome.
///
/// **Against a server that ignores the key** a retried call can run twice, as any retried call
/// can: cover only methods whose server honours `idempotency-key`.
#[derive(Debug, Clone)]
pub struct GrpcRetryLayer {
    config: Arc<Config>,
}

#[derive(Debug, Clone)]
struct Config {
    policy: RetryPolicy,
    methods: Vec<String>,
    codes: Vec<Code>,
    derive_keys: bool,
    max_request_bytes: usize,
}

impl GrpcRetryLayer {
    /// A layer that retries with `policy`, covering no method yet.
    #[must_use]
    pub fn new(policy: RetryPolicy) -> Self {
        GrpcRetryLayer {
            config: Arc::new(Config {
                policy,
                methods: Vec::new(),
                codes: DEFAULT_RETRY_CODES.to_vec(),
                derive_keys: true,
                max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            }),
        }
    }

    /// Covers the unary method at `path` (`/package.Service/Method`).
    #[must_use]
    pub fn method(mut self, path: impl Into<String>) -> Self {
        Arc::make_mut(&mut self.config).methods.push(path.into());
        self
    }

    /// Retries exactly these codes (default [`DEFAULT_RETRY_CODES`]); `OK` is never retried.
    /// Add a code only if the server answers it without acting, or records what it answers: a
    /// retry of a code the server released after acting runs the call again.
    #[must_use]
    pub fn retry_codes(mut self, codes: impl IntoIterator<Item = Code>) -> Self {
        Arc::make_mut(&mut self.config).codes = codes.into_iter().filter(|code| *code != Code::Ok).collect();
        self
    }

    /// Whether a call without a key, made inside an idempotent body, gets the key derived from
    /// that body (default `true`); with `false` it gets a fresh UUID, as outside any body.
    #[must_use]
    pub fn derive_keys(mut self, derive_keys: bool) -> Self {
        Arc::make_mut(&mut self.config).derive_keys = derive_keys;
        self
    }

    /// The largest request it buffers to send again (default 4 MiB); a larger one is refused with
    /// `RESOURCE_EXHAUSTED` before it is sent.
    #[must_use]
    pub fn max_request_bytes(mut self, limit: usize) -> Self {
        Arc::make_mut(&mut self.config).max_request_bytes = limit;
        self
    }

    /// The policy in use.
    #[must_use]
    pub fn policy(&self) -> &RetryPolicy {
        &self.config.policy
    }

    /// Wraps `inner` (a `tonic::transport::Channel`), as [`Layer::layer`] does.
    ///
    /// # Panics
    ///
    /// If the layer covers no method.
    #[must_use]
    pub fn service<S>(&self, inner: S) -> GrpcRetry<S> {
        self.layer(inner)
    }
}

impl<S> Layer<S> for GrpcRetryLayer {
    type Service = GrpcRetry<S>;

    /// # Panics
    ///
    /// If the layer covers no method.
    fn layer(&self, inner: S) -> GrpcRetry<S> {
        assert!(
            !self.config.methods.is_empty(),
            "GrpcRetryLayer covers no method, so it would retry nothing: name each unary method with \
             `.method(\"/package.Service/Method\")`"
        );
        GrpcRetry { inner, config: Arc::clone(&self.config) }
    }
}

/// The service [`GrpcRetryLayer`] wraps around a channel.
#[derive(Debug, Clone)]
pub struct GrpcRetry<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S, B> Service<Request<Body>> for GrpcRetry<S>
where
    S: Service<Request<Body>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The service polled ready sends the first attempt (tower's contract); its clone stays.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        if !self.config.methods.iter().any(|path| path == request.uri().path()) {
            let mut inner = inner;
            return Box::pin(async move { Ok(inner.call(request).await?.map(Body::new)) });
        }
        let config = Arc::clone(&self.config);
        Box::pin(async move { config.send(inner, request).await })
    }
}

/// What one attempt's outcome calls for.
enum Verdict {
    /// Return it, noting why when it asked for a retry.
    Done(Option<Stopped>),
    /// Retry after the server's pushback if it sent one, else after a back-off.
    Retry { pushback: Option<Duration> },
}

/// One attempt's outcome (an answer too large to read is returned at once).
enum Outcome<E> {
    /// An answer, read whole (boxed: the outcome is moved about, and an answer's head is large).
    Whole(Box<Answer>),
    /// The answer's body failed before its end.
    CutOff(String),
    /// No answer: the channel's error.
    Failed(E),
}

impl Config {
    async fn send<S, B>(&self, mut inner: S, request: Request<Body>) -> Result<http::Response<Body>, S::Error>
    where
        S: Service<Request<Body>, Response = http::Response<B>> + Clone,
        S::Error: std::fmt::Display,
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let (mut parts, body) = request.into_parts();
        let path = parts.uri.path().to_owned();
        let message = match Limited::new(body, self.max_request_bytes).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(error) if error.is::<LengthLimitError>() => {
                return Ok(Status::resource_exhausted(format!(
                    "the request of {path} is over GrpcRetryLayer's limit of {} bytes, so it was not sent; raise \
                     `max_request_bytes` or send a smaller message",
                    self.max_request_bytes
                ))
                .into_http());
            }
            Err(error) => {
                return Ok(Status::cancelled(format!("the request of {path} could not be read: {error}")).into_http());
            }
        };
        let key = self.key(&mut parts.headers, &path);
        let start = Instant::now();
        let mut count = 1;
        loop {
            let outcome = match inner.call(attempt(&parts, &message)).await {
                Ok(answer) => match read_answer(answer, MAX_ANSWER_BYTES).await {
                    Read::Whole(answer) => Outcome::Whole(Box::new(answer)),
                    // Passed on as it comes: its code is in trailers not read yet.
                    Read::TooLarge(answer) => return Ok(mark(answer, &key, count, None)),
                    Read::Failed(reason) => Outcome::CutOff(reason),
                },
                Err(error) => Outcome::Failed(error),
            };
            let pushback = match &outcome {
                Outcome::Whole(answer) => match self.classify(answer) {
                    Verdict::Done(stopped) => return outcome.finish(&path, &key, count, stopped),
                    Verdict::Retry { pushback } => pushback,
                },
                Outcome::CutOff(_) | Outcome::Failed(_) => None,
            };
            let wait = match self.policy.next_wait(count, pushback, start.elapsed()) {
                Ok(wait) => wait,
                Err(stopped) => {
                    tracing::warn!(target: "idempotent", path, key, attempts = count, %stopped, "giving up");
                    return outcome.finish(&path, &key, count, Some(stopped));
                }
            };
            let wait_ms = wait.as_millis();
            match &outcome {
                Outcome::Whole(answer) => tracing::info!(
                    target: "idempotent", path, key, attempt = count, code = ?code_of(answer), wait_ms,
                    "retrying with the same key"
                ),
                Outcome::CutOff(reason) => tracing::info!(
                    target: "idempotent", path, key, attempt = count, reason, wait_ms,
                    "the answer was cut off; retrying with the same key"
                ),
                Outcome::Failed(error) => tracing::info!(
                    target: "idempotent", path, key, attempt = count, %error, wait_ms,
                    "no answer; retrying with the same key"
                ),
            }
            drop(outcome);
            tokio::time::sleep(wait).await;
            inner = inner.clone();
            poll_fn(|cx| inner.poll_ready(cx)).await?;
            count += 1;
        }
    }

    /// The call's key: the one it carries, else one derived from the idempotent body it is made
    /// in, else a fresh UUID; set in `headers`.
    fn key(&self, headers: &mut HeaderMap, path: &str) -> String {
        if let Some(value) = headers.get(&IDEMPOTENCY_KEY) {
            return String::from_utf8_lossy(value.as_bytes()).into_owned();
        }
        let key = crate::context::outbound_key("POST", path, self.derive_keys);
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_str(&key).expect("a UUID or hex digest is valid metadata"));
        key
    }

    fn classify(&self, answer: &Answer) -> Verdict {
        let code = code_of(answer);
        let retried = self.codes.contains(&code);
        if is_replayed(&answer.parts.headers) {
            return Verdict::Done(retried.then_some(Stopped::Replayed));
        }
        // A deadline's answer is not the call's outcome, in the retried set or not: whoever
        // answered stopped waiting for the call (its deadline passed, or its request was cut off),
        // which may still run. The same key gets its answer, unless the server refuses retries.
        let deadline = matches!(code, Code::DeadlineExceeded | Code::Cancelled);
        if !retried && !deadline {
            return Verdict::Done(None);
        }
        // Beside the status; an HTTP proxy's answer has none, and its pushback would be in its headers.
        let status = answer.status_metadata().unwrap_or(&answer.parts.headers);
        let Some(pushback) = status.get(RETRY_PUSHBACK) else {
            return Verdict::Retry { pushback: None };
        };
        // gRFC A6: a negative or unreadable pushback means "do not retry".
        match std::str::from_utf8(pushback.as_bytes()).ok().and_then(|v| v.trim().parse::<u64>().ok()) {
            Some(ms) => Verdict::Retry { pushback: Some(Duration::from_millis(ms)) },
            None => Verdict::Done(Some(Stopped::ServerRefusedRetries)),
        }
    }
}

impl<E> Outcome<E> {
    /// What the caller gets for this outcome, marked with the attempts.
    fn finish(self, path: &str, key: &str, count: u32, stopped: Option<Stopped>) -> Result<http::Response<Body>, E> {
        let answer = match self {
            Outcome::Whole(answer) => answer.into_response(),
            Outcome::CutOff(reason) => Status::unavailable(format!(
                "the answer of {path} was cut off after {count} attempt(s) with idempotency-key {key:?} ({reason}); \
                 the call may have run: call again with the same key to get its answer"
            ))
            .into_http(),
            Outcome::Failed(error) => return Err(error),
        };
        Ok(mark(answer, key, count, stopped))
    }
}

/// The code a client reads from `answer`: its `grpc-status`, or, when it has none (an HTTP proxy's
/// own answer), the code gRPC's spec maps its HTTP status to (`502`, `503`, `504` and `429` are
/// `UNAVAILABLE`).
fn code_of(answer: &Answer) -> Code {
    if answer.status_metadata().is_some() {
        return answer.code();
    }
    match answer.parts.status.as_u16() {
        400 => Code::Internal,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::Unimplemented,
        429 | 502 | 503 | 504 => Code::Unavailable,
        _ => Code::Unknown,
    }
}

/// An attempt of the call: its head again, and its buffered message.
fn attempt(parts: &Parts, message: &Bytes) -> Request<Body> {
    let mut request = Request::new(Body::new(Full::new(message.clone())));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = parts.version;
    *request.headers_mut() = parts.headers.clone();
    *request.extensions_mut() = parts.extensions.clone();
    request
}

/// Notes the attempts on the answer, where `tonic::Response::extensions` finds them.
fn mark(mut answer: http::Response<Body>, key: &str, count: u32, stopped: Option<Stopped>) -> http::Response<Body> {
    answer.extensions_mut().insert(Attempts { key: key.to_owned(), count, stopped });
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(
        status: u16,
        headers: &[(&'static str, &'static str)],
        trailers: &[(&'static str, &'static str)],
    ) -> Answer {
        let map = |entries: &[(&'static str, &'static str)]| {
            entries.iter().map(|(k, v)| (http::HeaderName::from_static(k), HeaderValue::from_static(v))).collect()
        };
        let (mut parts, ()) = http::Response::new(()).into_parts();
        parts.status = http::StatusCode::from_u16(status).unwrap();
        parts.headers = map(headers);
        Answer { parts, body: Bytes::new(), trailers: (!trailers.is_empty()).then(|| map(trailers)) }
    }

    fn verdict(answer: &Answer) -> (bool, Option<Duration>, Option<Stopped>) {
        let config = GrpcRetryLayer::new(RetryPolicy::default()).method("/p.S/M").config;
        match config.classify(answer) {
            Verdict::Retry { pushback } => (true, pushback, None),
            Verdict::Done(stopped) => (false, None, stopped),
        }
    }

    #[test]
    fn grpc_retry_reads_codes_pushbacks_and_replay_marks() {
        let retry = |pushback| (true, pushback, None);
        // The code in the trailers, or in the headers of a trailers-only answer.
        assert_eq!(verdict(&answer(200, &[], &[("grpc-status", "14")])), retry(None), "UNAVAILABLE");
        assert_eq!(verdict(&answer(200, &[("grpc-status", "10")], &[])), retry(None), "ABORTED, trailers-only");
        assert_eq!(verdict(&answer(200, &[], &[("grpc-status", "0")])), (false, None, None), "OK");
        assert_eq!(
            verdict(&answer(200, &[], &[("grpc-status", "13")])),
            (false, None, None),
            "INTERNAL: not in the set"
        );
        // gRFC A6's pushback: wait it when positive, stop when negative or unreadable.
        let aborted = [("grpc-status", "10"), ("grpc-retry-pushback-ms", "250")];
        assert_eq!(verdict(&answer(200, &aborted, &[])), retry(Some(Duration::from_millis(250))));
        assert_eq!(verdict(&answer(200, &[], &aborted)), retry(Some(Duration::from_millis(250))));
        let refused = (false, None, Some(Stopped::ServerRefusedRetries));
        for value in ["-1", "soon", "1.5", ""] {
            let pushback = [("grpc-status", "14"), ("grpc-retry-pushback-ms", value)];
            assert_eq!(verdict(&answer(200, &[], &pushback)), refused, "{value:?}");
        }
        // A deadline's answer (tonic's server answers CANCELLED when a call's timeout passes) is not
        // the call's outcome, in or out of the retried set; replayed, it is. A negative pushback
        // beside it still refuses retries.
        for code in ["1", "4"] {
            assert_eq!(verdict(&answer(200, &[("grpc-status", code)], &[])), retry(None), "{code}");
            let replayed = [("grpc-status", code), ("idempotent-replayed", "true")];
            assert_eq!(verdict(&answer(200, &replayed, &[])), (false, None, None), "{code}");
            let refusing = [("grpc-status", code), ("grpc-retry-pushback-ms", "-1")];
            assert_eq!(verdict(&answer(200, &[], &refusing)), (false, None, Some(Stopped::ServerRefusedRetries)));
        }
        // A replay is the call's outcome, whatever its code.
        let replayed = [("idempotent-replayed", "true")];
        let stopped = (false, None, Some(Stopped::Replayed));
        assert_eq!(verdict(&answer(200, &replayed, &[("grpc-status", "14")])), stopped);
        assert_eq!(verdict(&answer(200, &replayed, &[("grpc-status", "0")])), (false, None, None));
        // No grpc-status: an HTTP proxy's answer, read as gRPC's spec maps it.
        for status in [429, 502, 503, 504] {
            assert_eq!(verdict(&answer(status, &[], &[])), retry(None), "{status}");
        }
        for status in [200, 400, 401, 403, 404, 500] {
            assert_eq!(verdict(&answer(status, &[], &[])), (false, None, None), "{status}");
        }
    }

    #[test]
    fn grpc_retry_layer_without_a_method_panics_naming_the_fix() {
        let panic = std::panic::catch_unwind(|| GrpcRetryLayer::new(RetryPolicy::default()).service(()))
            .expect_err("a layer that covers nothing");
        let message = panic.downcast_ref::<String>().map(String::as_str).or(panic.downcast_ref::<&str>().copied());
        assert!(message.is_some_and(|m| m.contains(".method(")), "{message:?}");
    }
}
