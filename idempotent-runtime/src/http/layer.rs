//! The tower layer: `Idempotency-Key` handling for whole routes.

use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::OriginalUri;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::FutureExt as _;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Method, StatusCode, header};
use http_body_util::BodyExt;
use tower::{Layer, Service};

use super::chunks::Chunks;
use super::key_header;
use super::not_processed::NotProcessed;
use super::problem::{Problem, problem_response};
use super::recorded::{DEFAULT_RECORDED_HEADERS, Read, Recorded, read_response};
use super::replayed::mark_replayed;
use super::spawn::{Completing, RunsToCompletion, panicked, run_to_completion};
use crate::edge::{Edge, edge_setters, layer_service};
use crate::setters::setters;
use crate::{Error, Fingerprint, ReleaseErrors, Scope, Store};

/// The largest request body the layer buffers to fingerprint it by default (1 MiB); larger bodies
/// get `413 Payload Too Large`.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1024 * 1024;

/// The largest response body the layer records by default (512 KiB). Binary bodies are stored as
/// base64, a third larger, so this keeps every record within stores' default limit of
/// [`DEFAULT_MAX_RECORD_BYTES`](crate::DEFAULT_MAX_RECORD_BYTES).
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 512 * 1024;

/// The methods the layer applies to by default: `POST` and `PATCH`, the non-idempotent methods
/// the IETF draft is about. Requests with other methods pass through untouched, even with a key.
pub const DEFAULT_METHODS: [Method; 2] = [Method::POST, Method::PATCH];

type StatusFn = dyn Fn(StatusCode) -> bool + Send + Sync;

/// Makes the routes it wraps run at most once per `Idempotency-Key`, replaying the recorded
/// response to retries.
///
/// For each `POST` or `PATCH` request (see [`methods`](Self::methods)) it reads the
/// `Idempotency-Key` header, buffers the body (up to [`max_request_bytes`](Self::max_request_bytes))
/// and fingerprints the method, the path and query as the client sent them (the full path, also
/// under a nested router: axum's `OriginalUri`) and the body, then runs the request through
/// [`Call`](crate::Call) against the store: the inner service runs once per key; its response (status, the
/// [recorded headers](Self::record_header) and the body) is recorded and replayed to later requests
/// with the same key, [marked](super#replays) `Idempotent-Replayed: true`. Requests with other
/// methods pass through untouched, key or not.
///
/// Each request runs to its end: if its client disconnects, the request moves to a Tokio task of
/// its own instead of being cancelled. A handler that has started is never cut off, its response
/// is still recorded, and a retry sent meanwhile gets `409` (or, with [`wait`](Self::wait), the
/// recorded response). A handler that panics gets `500`
/// and its key is released. Every response to a request with an `Idempotency-Key` carries that
/// header back, as sent, so a client can log which key an answer belongs to.
///
/// | request | response |
/// |---|---|
/// | no key (when [required](Self::optional)) | `400`, `urn:idempotent:key-missing` |
/// | malformed key, repeated header, over 255 bytes | `400`, `urn:idempotent:key-malformed` |
/// | body over the limit | `413`, `urn:idempotent:request-too-large` |
/// | the first request with this key is still running | `409` with `Retry-After` (the running claim's remaining lease, in whole seconds rounded up, at least 1) |
/// | the key was used with another method, path, query or body | `422`, `urn:idempotent:key-reused` |
/// | the handler answered (any status, `5xx` included) | that response, recorded; retries get it replayed |
/// | the handler answered with [`NotProcessed`] | that response, not recorded: the key is released |
/// | response body failed mid-way (an error or a panic of its stream) | `500`, `urn:idempotent:response-failed`, to this request and its retries |
/// | response body over [`max_response_bytes`](Self::max_response_bytes) | the whole response to this request; retries get `500`, `urn:idempotent:response-too-large` |
/// | the store is down | `503` with `Retry-After` |
///
/// # Which responses are recorded
///
/// Every response the handler produced, whatever its status. A layer cannot tell from a `500`
/// whether the handler acted before failing (a card charged, then a timeout on the receipt
/// service), and releasing the key would let the client's retry, which carries the same key for
/// exactly this case, charge again. A handler that knows it did nothing says so with the
/// [`NotProcessed`] marker; [`record_status`](Self::record_status) sets a rule by status for a
/// route whose handlers all follow it. The layer's own refusals (a missing or malformed key, a
/// body too large or unreadable, `409`, `422`, a store down before the claim) are never recorded:
/// nothing ran. Once the handler has returned a response, the key is never released, even if the
/// response's body then fails: that is recorded as a failure, and retries get `500` instead of a
/// second run. Errors of the inner service (not a response: axum routes have none) and handler
/// panics release the key, as a panicking `#[idempotent]` body does.
///
/// # Whose keys
///
/// A key is chosen by the client, and two clients can send the same one, so a layer must say
/// whose keys it holds: [`caller`](Self::caller) binds each key to the caller who sent it (two
/// users who send the same key and body each get their own response), and
/// [`keys_shared_by_all_callers`](Self::keys_shared_by_all_callers) says that any caller may get
/// any other's response for the same key. A layer with neither panics when it is applied to a
/// route (at startup), with a message naming both.
///
/// The first response passes through with all its headers; replays carry only the recorded
/// ones. The layer takes `axum::body::Body` requests and responses, as axum routes do; apply it
/// to the routes that need it with `route_layer`, or to one method with `post(handler).layer(...)`.
///
/// ```
/// use axum::{Router, routing::post};
/// use idempotent_runtime::{MemoryStore, http::IdempotencyLayer};
///
/// async fn pay() -> &'static str { "paid" }
///
/// let app: Router = Router::new().route("/payments", post(pay)).route_layer(
///     IdempotencyLayer::new(MemoryStore::new())
///         .scope("payments")
///         .caller(|parts| parts.headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned()),
/// );
/// ```
pub struct IdempotencyLayer<St> {
    /// Shared with every service the layer makes: axum applies a route's layers again for each
    /// request, so making a service must not copy the configuration.
    config: Arc<Config<St>>,
}

struct Config<St> {
    edge: Edge<St>,
    recorded_headers: Vec<HeaderName>,
    record_status: Arc<StatusFn>,
    methods: Vec<Method>,
    json_fingerprint: bool,
}

impl<St> Clone for Config<St> {
    fn clone(&self) -> Self {
        Config {
            edge: self.edge.clone(),
            recorded_headers: self.recorded_headers.clone(),
            record_status: Arc::clone(&self.record_status),
            methods: self.methods.clone(),
            json_fingerprint: self.json_fingerprint,
        }
    }
}

impl<St> Clone for IdempotencyLayer<St> {
    fn clone(&self) -> Self {
        IdempotencyLayer { config: Arc::clone(&self.config) }
    }
}

impl<St> std::fmt::Debug for IdempotencyLayer<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("edge", &self.config.edge)
            .field("recorded_headers", &self.config.recorded_headers)
            .field("methods", &self.config.methods)
            .field("json_fingerprint", &self.config.json_fingerprint)
            .finish_non_exhaustive()
    }
}

impl<St: Store + 'static> IdempotencyLayer<St> {
    /// A layer keeping its records in `store`, with the scope `"http"`, a required key, every
    /// response recorded, the [default headers](super::DEFAULT_RECORDED_HEADERS), and the default
    /// limits, lease and retention.
    ///
    /// Before it is applied, say whose keys it holds: [`caller`](Self::caller) or
    /// [`keys_shared_by_all_callers`](Self::keys_shared_by_all_callers) (see
    /// [whose keys](Self#whose-keys)).
    pub fn new(store: St) -> Self {
        IdempotencyLayer {
            config: Arc::new(Config {
                edge: Edge::new(
                    Arc::new(store),
                    const { Scope::from_static("http") },
                    DEFAULT_MAX_REQUEST_BYTES,
                    DEFAULT_MAX_RESPONSE_BYTES,
                ),
                recorded_headers: DEFAULT_RECORDED_HEADERS.to_vec(),
                record_status: Arc::new(|_| true),
                methods: DEFAULT_METHODS.to_vec(),
                json_fingerprint: false,
            }),
        }
    }

    edge_setters!("IdempotencyLayer", missing: "`400`", running: "`409`", too_large: "a `500` problem (`urn:idempotent:response-too-large`, marked replayed)");

    /// Also records and replays the response header `name`.
    #[must_use]
    pub fn record_header(mut self, name: HeaderName) -> Self {
        if !self.config.recorded_headers.contains(&name) {
            self.config_mut().recorded_headers.push(name);
        }
        self
    }

    setters! { in config_mut:
        /// Records exactly these response headers, instead of [`DEFAULT_RECORDED_HEADERS`](super::DEFAULT_RECORDED_HEADERS).
        pub fn recorded_headers(names: impl IntoIterator<Item = HeaderName>) {
            recorded_headers = names.into_iter().collect()
        }
        /// Chooses by status which of the handler's responses are recorded (and replayed): a status for
        /// which `record` says `false` releases the key, so a retry runs the request again. The default
        /// records every status (see [which responses are recorded](Self#which-responses-are-recorded));
        /// a response marked [`NotProcessed`] is released whatever this says.
        ///
        /// A rule by status is only as safe as the route's handlers: releasing `429` is right if every
        /// handler behind the layer answers `429` before doing anything, and would let a retry act twice
        /// otherwise.
        ///
        /// ```
        /// use http::StatusCode;
        /// use idempotent_runtime::{MemoryStore, http::IdempotencyLayer};
        ///
        /// // This route's rate limiter answers 429 before the handler runs.
        /// let layer = IdempotencyLayer::new(MemoryStore::new())
        ///     .keys_shared_by_all_callers()
        ///     .record_status(|status| status != StatusCode::TOO_MANY_REQUESTS);
        /// # let _ = layer;
        /// ```
        pub fn record_status(record: impl Fn(StatusCode) -> bool + Send + Sync + 'static) {
            record_status = Arc::new(record)
        }
        /// The methods the layer applies to (default [`DEFAULT_METHODS`]: `POST` and `PATCH`).
        /// Requests with other methods pass through untouched, even with an `Idempotency-Key`.
        /// A client that sends keys on another method (a `PUT` with a key set by hand, or
        /// [`IdempotentRetry`](crate::client::IdempotentRetry) given more `methods`) retries it as
        /// it retries a `POST`, trusting the server to run it once: list that method here too.
        ///
        /// ```
        /// use http::Method;
        /// use idempotent_runtime::{MemoryStore, http::IdempotencyLayer};
        ///
        /// let layer = IdempotencyLayer::new(MemoryStore::new()).methods([Method::POST, Method::PATCH, Method::PUT]);
        /// # let _ = layer;
        /// ```
        pub fn methods(methods: impl IntoIterator<Item = Method>) { methods = methods.into_iter().collect() }
        /// Fingerprints JSON bodies by their content, not their bytes: a request whose body
        /// (`Content-Type: application/json` or `*/*+json`) differs from the first only in whitespace,
        /// object key order or string escapes counts as the same request, so it gets the replay, not
        /// `422`. Nothing else is merged: numbers are compared as written (`12345678901234567.89` and
        /// `12345678901234567.00`, `1e2` and `100`, `-0` and `0` are different requests, never one
        /// read through `f64`), and a repeated object key keeps every occurrence in order. Other
        /// bodies, JSON that does not parse, and JSON nested deeper than 128 levels are fingerprinted
        /// byte for byte. Off by default.
        pub fn json_fingerprint() { json_fingerprint = true }
    }
}

impl<S, St> Layer<S> for IdempotencyLayer<St> {
    type Service = IdempotencyService<S, St>;

    /// # Panics
    ///
    /// If neither [`caller`](IdempotencyLayer::caller) nor
    /// [`keys_shared_by_all_callers`](IdempotencyLayer::keys_shared_by_all_callers) was called:
    /// a layer that silently shared every key across callers would hand one user's responses to
    /// another. axum applies layers while the router is built, so this fails at startup.
    fn layer(&self, inner: S) -> Self::Service {
        self.config.edge.check_callers("IdempotencyLayer");
        IdempotencyService { inner, config: Arc::clone(&self.config) }
    }
}

layer_service! {
    /// The service [`IdempotencyLayer`] wraps around a route.
    IdempotencyService
}

impl<S, St> Service<Request> for IdempotencyService<S, St>
where
    S: Service<Request, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = IdempotencyFuture<S::Future, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // The clone may not be ready: keep the ready service for this request (tower's usual dance).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if !self.config.methods.contains(request.method()) {
            return IdempotencyFuture { kind: Kind::Passthrough(Box::pin(inner.call(request))) };
        }
        let config = Arc::clone(&self.config);
        let echo = key_header::echo(request.headers());
        // To its end: hyper drops this future when the client disconnects, and the request then
        // moves to a task of its own.
        // The handler's future itself, not an `async` block awaiting it (272 bytes less when it
        // was measured), made straight into the box it runs in.
        let task = run_to_completion(|| config.handle(inner, request));
        IdempotencyFuture { kind: Kind::Covered { task, echo } }
    }
}

/// The future of an [`IdempotencyService`] call: the response to a request the layer covers (run
/// to its end even if this future is dropped), or the inner service's own future for a method it
/// does not cover.
pub struct IdempotencyFuture<F, E: Send + 'static> {
    kind: Kind<F, E>,
}

enum Kind<F, E: Send + 'static> {
    Passthrough(Pin<Box<F>>),
    // One box per request, the task's: this future is not boxed again around it.
    Covered { task: Completing<Result<Response, E>>, echo: Option<HeaderValue> },
}

impl<F, E: Send + 'static> std::fmt::Debug for IdempotencyFuture<F, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyFuture").finish_non_exhaustive()
    }
}

impl<F, E> Future for IdempotencyFuture<F, E>
where
    F: Future<Output = Result<Response, E>>,
    E: Send + 'static,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().kind {
            Kind::Passthrough(future) => future.as_mut().poll(cx),
            Kind::Covered { task, echo } => {
                let Poll::Ready(result) = Pin::new(task).poll(cx) else { return Poll::Pending };
                let mut response = result.unwrap_or_else(|()| Ok(panicked()))?;
                key_header::echo_into(&mut response, echo.take());
                Poll::Ready(Ok(response))
            }
        }
    }
}

type Failure<E> = crate::edge::Failure<E, Response>;

impl<St: Store> Config<St> {
    async fn handle<S>(self: Arc<Self>, mut inner: S, request: Request) -> Result<Response, S::Error>
    where
        S: Service<Request, Response = Response>,
    {
        let (parts, body) = request.into_parts();
        let key = match key_header::read(&parts.headers) {
            Ok(Some(key)) => key,
            Ok(None) if !self.edge.required => return inner.call(handed_on(parts, body)).await,
            Ok(None) => return Ok(Problem::missing_key().into_response()),
            Err(error) => return Ok(Problem::from_key_header(&error).into_response()),
        };
        let bytes = match read_request(&parts, body, self.edge.max_request_bytes).await {
            Ok(bytes) => bytes,
            Err(problem) => return Ok(problem.into_response()),
        };
        let fingerprint = request_fingerprint(&parts, &bytes, self.json_fingerprint);
        let call = self.edge.call(&parts, &key, fingerprint);
        let mut first = None;
        let body = async {
            // Keys the handler derives depend on the route it was called on (not the body: a
            // re-formatted retry derives the same ones).
            crate::context::set_origin(&[parts.method.as_str().as_bytes(), original_uri(&parts).path().as_bytes()]);
            // The request is put back together only here: a replay, a `409` or a `422` never hands
            // it on, and pays neither for its body's box nor for the extension.
            let request = handed_on(parts, Body::from(bytes));
            let response = AssertUnwindSafe(inner.call(request)).catch_unwind().await.map_err(|_| Failure::Panicked)?;
            let mut response = response.map_err(Failure::Inner)?;
            if NotProcessed::take(&mut response) || !(self.record_status)(response.status()) {
                return Err(Failure::NotRecorded(response));
            }
            // From here on the handler has answered: whatever happens to its body, the key is
            // recorded, never released, so a retry cannot run the handler a second time.
            let (parts, body) = response.into_parts();
            let recorded = match read_response(body, self.edge.max_response_bytes).await {
                // Recorded from the response itself, which then goes to this request as it is.
                Read::Whole(body) => Recorded::Fresh { parts, body, allowed: &self.recorded_headers },
                Read::TooLarge(body) => {
                    tracing::warn!(
                        target: "idempotent", limit = self.edge.max_response_bytes,
                        "a response body is over the recording limit; it goes to this request, retries get 500"
                    );
                    first = Some(Response::from_parts(parts, body));
                    Recorded::TooLarge { limit: self.edge.max_response_bytes }
                }
                Read::Failed(reason) => {
                    tracing::error!(
                        target: "idempotent", reason,
                        "a response body failed after the handler returned; recorded as failed, retries get 500"
                    );
                    first = Some(Problem::response_failed().into_response());
                    Recorded::Failed { reason }
                }
            };
            Ok(recorded)
        };
        let result = call.run_with(&*self.edge.store, ReleaseErrors, body).await;
        match result {
            Ok(recorded) => Ok(match first {
                Some(response) => response,
                None => recorded.into_response(),
            }),
            Err(Failure::Inner(error)) => Err(error),
            Err(Failure::Panicked) => Ok(panicked()),
            Err(Failure::NotRecorded(response)) => Ok(response),
            Err(Failure::Idempotency(error)) => {
                let mut response = problem_response(&error);
                // The record says the request ran and its response could not be kept: that too
                // is this key's final answer, so it is marked like every replay.
                if matches!(error, Error::Unrecordable { .. }) {
                    mark_replayed(&mut response);
                }
                Ok(response)
            }
        }
    }
}

/// The request as the inner service gets it, marked as running to its end (which the key
/// extractor checks).
fn handed_on(parts: Parts, body: Body) -> Request {
    let mut request = Request::from_parts(parts, body);
    RunsToCompletion::mark(&mut request);
    request
}

/// Buffers the request body up to `limit` bytes: `413` past it (from `Content-Length` at once).
async fn read_request(parts: &Parts, body: Body, limit: usize) -> Result<Bytes, Problem> {
    let declared = parts.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(Problem::request_too_large(limit));
    }
    // Read frame by frame rather than through `collect`: a body of one chunk (hyper's usual
    // small body) is kept as it is, without the buffer list and trailer map `collect` builds.
    let mut body = body;
    let mut chunks = Chunks::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| Problem::request_unreadable(&error.to_string()))?;
        // Trailers (rare on requests) are not part of the fingerprint, as before.
        let Ok(data) = frame.into_data() else { continue };
        if chunks.len() + data.len() > limit {
            return Err(Problem::request_too_large(limit));
        }
        chunks.push(data);
    }
    Ok(chunks.into_bytes())
}

/// SHA-256 over the method, the path with its query as the client sent it, and the body (or, with
/// `json`, a canonical form of a JSON body), each length-prefixed.
fn request_fingerprint(parts: &Parts, body: &[u8], json: bool) -> Fingerprint {
    let uri = original_uri(parts);
    let target = uri.path_and_query().map_or("/", http::uri::PathAndQuery::as_str);
    let canonical = if json && is_json(parts) { super::canonical_json::canonical(body) } else { None };
    let body = canonical.as_deref().unwrap_or(body);
    Fingerprint::of_fields(&[parts.method.as_str().as_bytes(), target.as_bytes(), body])
}

/// The request's URI as the client sent it: under a nested router `parts.uri` lost the outer
/// prefix, and axum keeps the original.
fn original_uri(parts: &Parts) -> &http::Uri {
    parts.extensions.get::<OriginalUri>().map_or(&parts.uri, |original| &original.0)
}

/// `Content-Type: application/json` or `*/*+json`, with or without parameters.
fn is_json(parts: &Parts) -> bool {
    let Some(value) = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) else { return false };
    let essence = value.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    essence == "application/json" || (essence.contains('/') && essence.ends_with("+json"))
}

const _: fn() = || {
    fn service<T: Service<Request, Response = Response, Error = Infallible>>() {}
    service::<IdempotencyService<axum::routing::Route, crate::MemoryStore>>();
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::chunks::tests::{PAST_5, WITHIN_5};

    /// A request body streamed in `chunks` (empty ones included), with no `Content-Length`.
    fn chunked(chunks: &[&[u8]]) -> (Parts, Body) {
        let chunks: Vec<Result<Bytes, std::io::Error>> = chunks.iter().map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        Request::new(Body::from_stream(futures_util::stream::iter(chunks))).into_parts()
    }

    #[tokio::test]
    async fn http_request_bodies_are_read_whole_within_the_limit_and_refused_past_it() {
        for chunks in WITHIN_5 {
            let (parts, body) = chunked(chunks);
            let read = read_request(&parts, body, 5).await.map_err(|problem| problem.kind);
            assert_eq!(read, Ok(Bytes::from(chunks.concat())), "{chunks:?}");
        }
        for chunks in PAST_5 {
            let (parts, body) = chunked(chunks);
            let refused = read_request(&parts, body, 5).await.map_err(|problem| problem.kind);
            assert_eq!(refused, Err("urn:idempotent:request-too-large"), "{chunks:?}");
        }
    }
}
