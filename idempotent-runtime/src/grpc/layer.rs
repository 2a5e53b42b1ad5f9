//! The tower layer: one run per key for the unary methods of a tonic server.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::FutureExt as _;
use http::Request;
use http::request::Parts;
use http_body_util::Full;
use tonic::Code;
use tonic::body::Body;
use tower::{Layer, Service};

use super::frames::{Message, read_request, single_message};
use super::recorded::{Read, Recorded, read_answer};
use super::status;
use crate::edge::{Edge, edge_setters, layer_service};
use crate::http::{IDEMPOTENCY_KEY, key_header, run_to_completion};
use crate::{Error, Fingerprint, ReleaseErrors, Scope, Store};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type MessageKeyFn = dyn Fn(&[u8]) -> Option<String> + Send + Sync;
type CodeFn = dyn Fn(Code) -> bool + Send + Sync;

/// The largest request the layer buffers by default (4 MiB, tonic's own default limit for a
/// decoded message); larger ones get `RESOURCE_EXHAUSTED`.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// The largest response body the layer records by default (512 KiB; binary bodies are stored as
/// base64, a third larger, within stores' default record limit).
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 512 * 1024;

/// Makes the unary methods it is given run at most once per key, replaying the recorded answer
/// to every later call with the key (see the [module docs](super) for the statuses).
///
/// Give it each method it covers by its path (`/package.Service/Method`): [`method`](Self::method)
/// takes the key from the call's `idempotency-key` metadata, [`method_keyed_by`](Self::method_keyed_by)
/// from a field of the request message (AIP-155's `request_id`). Calls to other paths pass through
/// untouched. Say whose keys they are with [`caller`](Self::caller) or
/// [`keys_shared_by_all_callers`](Self::keys_shared_by_all_callers); a layer with neither, or with
/// no method, panics when tonic applies it (at startup).
///
/// ```
/// use idempotent_runtime::MemoryStore;
/// use idempotent_runtime::grpc::GrpcIdempotencyLayer;
///
/// let layer = GrpcIdempotencyLayer::new(MemoryStore::new())
///     .scope("payments")
///     .caller(|parts| parts.headers.get("x-client-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned())
///     // The key from the `idempotency-key` metadata.
///     .method("/payments.Payments/Pay")
///     // The key from the message: field 1, `request_id`, of RefundRequest (decode it with prost
///     // in real code: `RefundRequest::decode(bytes).ok().map(|r| r.request_id)`).
///     .method_keyed_by("/payments.Payments/Refund", |bytes| {
///         let (&[0x0a, len], rest) = bytes.split_first_chunk::<2>()? else { return None };
///         String::from_utf8(rest.get(..usize::from(len))?.to_vec()).ok()
///     });
/// // tonic::transport::Server::builder().layer(layer).add_service(PaymentsServer::new(service))
/// # let _ = layer;
/// ```
pub struct GrpcIdempotencyLayer<St> {
    /// Shared by every service the layer makes.
    config: Arc<Config<St>>,
}

struct Config<St> {
    edge: Edge<St>,
    methods: Vec<Method>,
    record_code: Arc<CodeFn>,
}

impl<St> Clone for Config<St> {
    fn clone(&self) -> Self {
        Config { edge: self.edge.clone(), methods: self.methods.clone(), record_code: Arc::clone(&self.record_code) }
    }
}

/// A covered method and where its calls' keys come from.
#[derive(Clone)]
struct Method {
    path: String,
    key: Option<Arc<MessageKeyFn>>,
}

impl<St> std::fmt::Debug for GrpcIdempotencyLayer<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let methods: Vec<&str> = self.config.methods.iter().map(|m| m.path.as_str()).collect();
        f.debug_struct("GrpcIdempotencyLayer")
            .field("edge", &self.config.edge)
            .field("methods", &methods)
            .finish_non_exhaustive()
    }
}

impl<St> Clone for GrpcIdempotencyLayer<St> {
    fn clone(&self) -> Self {
        GrpcIdempotencyLayer { config: Arc::clone(&self.config) }
    }
}

impl<St: Store> GrpcIdempotencyLayer<St> {
    /// A layer over `store` that covers no method yet, in scope `"grpc"`, with the default limits,
    /// lease and retention.
    pub fn new(store: St) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// A layer over a store shared with other code.
    pub fn from_arc(store: Arc<St>) -> Self {
        GrpcIdempotencyLayer {
            config: Arc::new(Config {
                edge: Edge::new(
                    store,
                    const { Scope::from_static("grpc") },
                    DEFAULT_MAX_REQUEST_BYTES,
                    DEFAULT_MAX_RESPONSE_BYTES,
                ),
                methods: Vec::new(),
                record_code: Arc::new(|_| true),
            }),
        }
    }
}

impl<St> GrpcIdempotencyLayer<St> {
    edge_setters!("GrpcIdempotencyLayer", missing: "`INVALID_ARGUMENT`", running: "`ABORTED`", too_large: "`DATA_LOSS`");

    /// Covers the unary method at `path` (`/package.Service/Method`), with each call's key taken
    /// from its `idempotency-key` metadata.
    #[must_use]
    pub fn method(mut self, path: impl Into<String>) -> Self {
        self.config_mut().methods.push(Method { path: path.into(), key: None });
        self
    }

    /// Covers the unary method at `path`, with each call's key read from its request message by
    /// `key_of` (given the encoded message; decode it with the message's type). `None` or an empty
    /// key counts as no key, as an unset proto3 string does. A compressed request message is
    /// refused with `UNIMPLEMENTED` (the layer does not decompress): clients that compress should
    /// send the key as metadata.
    #[must_use]
    pub fn method_keyed_by(
        mut self,
        path: impl Into<String>,
        key_of: impl Fn(&[u8]) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.config_mut().methods.push(Method { path: path.into(), key: Some(Arc::new(key_of)) });
        self
    }

    /// Chooses by status code which of the handlers' answers are recorded: a code for which
    /// `record` says `false` releases the key, so a retry runs the handler again. The default
    /// records every code; an answer marked [`not_processed`](super::not_processed) is released
    /// whatever this says. Only as safe as the handlers: release a code only if every covered
    /// handler answers it before any effect.
    #[must_use]
    pub fn record_code(mut self, record: impl Fn(Code) -> bool + Send + Sync + 'static) -> Self {
        self.config_mut().record_code = Arc::new(record);
        self
    }
}

impl<S, St> Layer<S> for GrpcIdempotencyLayer<St> {
    type Service = GrpcIdempotencyService<S, St>;

    /// # Panics
    ///
    /// If the layer covers no method, or says neither [`caller`](GrpcIdempotencyLayer::caller)
    /// nor [`keys_shared_by_all_callers`](GrpcIdempotencyLayer::keys_shared_by_all_callers).
    fn layer(&self, inner: S) -> Self::Service {
        self.config.edge.check_callers("GrpcIdempotencyLayer");
        assert!(
            !self.config.methods.is_empty(),
            "GrpcIdempotencyLayer (scope {:?}) covers no method, so it would protect nothing: name each unary method \
             with `.method(\"/package.Service/Method\")` or `.method_keyed_by(..)`",
            self.config.edge.scope
        );
        GrpcIdempotencyService { inner, config: Arc::clone(&self.config) }
    }
}

layer_service! {
    /// The service [`GrpcIdempotencyLayer`] wraps around a tonic server's routes.
    GrpcIdempotencyService
}

impl<S, St, B> Service<Request<Body>> for GrpcIdempotencyService<S, St>
where
    S: Service<Request<Body>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    St: Store + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let Some(method) = self.config.methods.iter().position(|m| m.path == request.uri().path()) else {
            return Box::pin(async move { Ok(inner.call(request).await?.map(Body::new)) });
        };
        let config = Arc::clone(&self.config);
        // To its end: a cancelled call (client gone, deadline passed) moves to a task of its own.
        let task = run_to_completion(|| async move { config.handle(inner, method, request).await });
        Box::pin(async move { task.await.unwrap_or_else(|()| Ok(status::panicked().into_http())) })
    }
}

type Failure<E> = crate::edge::Failure<E, http::Response<Body>>;

impl<St: Store> Config<St> {
    async fn handle<S, B>(
        &self,
        mut inner: S,
        method: usize,
        request: Request<Body>,
    ) -> Result<http::Response<Body>, S::Error>
    where
        S: Service<Request<Body>, Response = http::Response<B>>,
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let method = &self.methods[method];
        let (parts, body) = request.into_parts();
        let bytes = match read_request(body, self.edge.max_request_bytes).await {
            Ok(bytes) => bytes,
            Err(refusal) => return Ok(refusal.into_http()),
        };
        let message = match single_message(&bytes, &method.path) {
            Ok(message) => message,
            Err(refusal) => return Ok(refusal.into_http()),
        };
        let key = match method.key(&parts, &message) {
            Ok(Some(key)) => key,
            Ok(None) if !self.edge.required => {
                let request = Request::from_parts(parts, Body::new(Full::new(bytes)));
                return Ok(inner.call(request).await?.map(Body::new));
            }
            Ok(None) => {
                return Ok(tonic::Status::invalid_argument(format!(
                    "{} requires an idempotency key{}; send a unique one (a UUID) with each new request and the same \
                     one with its retries",
                    method.path,
                    if method.key.is_some() { " in its request message" } else { " in the idempotency-key metadata" },
                ))
                .into_http());
            }
            Err(refusal) => return Ok(refusal.into_http()),
        };
        let fingerprint = Fingerprint::of_fields(&[method.path.as_bytes(), &bytes]);
        let call = self.edge.call(&parts, &key, fingerprint);

        let request = Request::from_parts(parts, Body::new(Full::new(bytes)));
        let mut first = None;
        let body = async {
            // Keys the handler derives depend on the method it was called on.
            crate::context::set_origin(&[method.path.as_bytes()]);
            let answer = AssertUnwindSafe(inner.call(request)).catch_unwind().await.map_err(|_| Failure::Panicked)?;
            let answer = answer.map_err(Failure::Inner)?;
            // From here on the handler has answered: the key is recorded whatever its body does.
            let recorded = match read_answer(answer, self.edge.max_response_bytes).await {
                Read::Whole(mut answer) => {
                    if answer.take_not_processed() || !(self.record_code)(answer.code()) {
                        return Err(Failure::NotRecorded(answer.into_response()));
                    }
                    Recorded::Fresh(answer)
                }
                Read::TooLarge(answer) => {
                    tracing::warn!(
                        target: "idempotent", limit = self.edge.max_response_bytes,
                        "an RPC answer is over the recording limit; it goes to this call, retries get DATA_LOSS"
                    );
                    first = Some(answer);
                    Recorded::TooLarge { limit: self.edge.max_response_bytes }
                }
                Read::Failed(reason) => {
                    tracing::error!(
                        target: "idempotent", reason,
                        "an RPC answer failed after the handler returned; recorded as failed, retries get DATA_LOSS"
                    );
                    first = Some(status::replay_impossible("the server's answer failed while it was sent").into_http());
                    Recorded::Failed { reason }
                }
            };
            Ok(recorded)
        };
        Ok(match call.run_with(&*self.edge.store, ReleaseErrors, body).await {
            Ok(recorded) => first.unwrap_or_else(|| recorded.into_response()),
            Err(Failure::Inner(error)) => return Err(error),
            Err(Failure::Panicked) => status::panicked().into_http(),
            Err(Failure::NotRecorded(answer)) => answer,
            // The record says the call ran and its answer could not be kept: that is this key's
            // final answer, marked like every replay.
            Err(Failure::Idempotency(error @ Error::Unrecordable { .. })) => {
                status::replayed(status::from_error(&error))
            }
            Err(Failure::Idempotency(error)) => status::from_error(&error).into_http(),
        })
    }
}

impl Method {
    /// The call's key, from its metadata or its message: `Ok(None)` when it has none.
    fn key(&self, parts: &Parts, message: &Message<'_>) -> Result<Option<String>, tonic::Status> {
        let Some(key_of) = &self.key else {
            return key_header::from_headers(&parts.headers).map_err(|e| status::from_key_header(&e));
        };
        if message.compressed {
            return Err(tonic::Status::unimplemented(format!(
                "{} takes its idempotency key from the request message, which the idempotency layer cannot read \
                 compressed; send the call uncompressed or put the key in the {IDEMPOTENCY_KEY} metadata",
                self.path
            )));
        }
        // Checked like every key when the call is made: too long or with control characters, it
        // gets `INVALID_ARGUMENT` before anything runs.
        Ok(key_of(message.payload).filter(|key| !key.is_empty()))
    }
}
