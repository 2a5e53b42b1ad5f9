//! Running a request to its end, on a task of its own once its client is gone, so that a client that
//! disconnects cannot cancel it.

use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::FutureExt as _;
use futures_util::future::CatchUnwind;

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use tower::{Layer, Service};
use tracing::Instrument as _;
use tracing::instrument::Instrumented;

use super::key_header;
use super::problem::Problem;

/// Runs the routes it wraps to their end, so that a request whose handler has started always
/// finishes, even if the client disconnects meanwhile: hyper then drops the request's future, and
/// the layer moves it to a Tokio task of its own instead of letting it be cancelled.
///
/// hyper drops a request's future when its connection closes. A handler under
/// [`#[idempotent]`](macro@crate::idempotent) that is dropped mid-way may have made its side
/// effect (charged a card) without recording its result; depending on the cancellation policy
/// its retry then either runs again or waits for the lease to end. Under this layer the handler is
/// never dropped: it finishes, its result is recorded, and a retry sent meanwhile gets `409` (or,
/// with `wait`, the recorded response once it is there). [`IdempotencyLayer`](super::IdempotencyLayer)
/// does the same by itself; this layer is for handlers that use the attribute.
///
/// A handler that panics is answered with `500` (`urn:idempotent:internal`), and the panic does not
/// reach hyper. Under the attribute, a panicking body releases its key (see [`Call`](crate::Call)).
/// Every response to a request with an `Idempotency-Key` carries that header back, as sent.
///
/// The layer is required, not advised: the [`IdempotencyKeyHeader`](super::IdempotencyKeyHeader)
/// extractor refuses a request that does not run under it (or under
/// [`IdempotencyLayer`](super::IdempotencyLayer)) with `500` (`urn:idempotent:misconfigured`) and
/// an error in the log naming this layer, before the handler starts, so a route that forgot it
/// fails at its first request instead of running a cancelled handler twice.
///
/// ```
/// use axum::{Router, routing::post};
/// use idempotent_runtime::http::RunToCompletionLayer;
///
/// async fn pay() -> &'static str { "paid" }
///
/// let app: Router = Router::new().route("/payments", post(pay)).route_layer(RunToCompletionLayer);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct RunToCompletionLayer;

impl<S> Layer<S> for RunToCompletionLayer {
    type Service = RunToCompletion<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RunToCompletion { inner }
    }
}

/// The service [`RunToCompletionLayer`] wraps around a route.
#[derive(Debug, Clone)]
pub struct RunToCompletion<S> {
    inner: S,
}

impl<S> Service<Request> for RunToCompletion<S>
where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let echo = key_header::echo(request.headers());
        RunsToCompletion::mark(&mut request);
        let running = inner.call(request);
        let task = run_to_completion(|| async move {
            match running.await {
                Ok(response) => response,
                Err(never) => match never {},
            }
        });
        Box::pin(async move {
            let mut response = task.await.unwrap_or_else(|()| panicked());
            key_header::echo_into(&mut response, echo);
            Ok(response)
        })
    }
}

/// The request extension that says the request runs to its end: set by
/// [`RunToCompletion`] and by the idempotency layer, checked by the key extractor.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunsToCompletion;

impl RunsToCompletion {
    pub(crate) fn mark(request: &mut Request) {
        request.extensions_mut().insert(RunsToCompletion);
    }

    /// `Ok` under one of the layers; otherwise the refusal, logged with the fix.
    pub(crate) fn check(parts: &Parts) -> Result<(), Problem> {
        if parts.extensions.get::<RunsToCompletion>().is_some() {
            return Ok(());
        }
        tracing::error!(
            target: "idempotent", path = parts.uri.path(),
            "a handler extracts IdempotencyKeyHeader but is not served under RunToCompletionLayer: hyper would cancel \
             it when its client disconnects, after its side effect and before its result is recorded, and a retry \
             would run it again. Add `.route_layer(idempotent_runtime::http::RunToCompletionLayer)` to the route; \
             the request was refused with 500 before the handler ran"
        );
        Err(Problem::misconfigured(
            "its idempotent handler is not served under RunToCompletionLayer, so a disconnect could cancel it \
             half-way; the server's developer must add the layer to the route",
        ))
    }
}

/// Runs `future` to its end whatever happens to the returned future: it is polled where the
/// returned future is polled (in the request's own task, as a plain handler is) and, if that
/// future is dropped before its end (hyper drops a request's future when its client
/// disconnects), the rest moves to a Tokio task of its own (in the span current when it was
/// made), so dropping never cancels it. A request that runs to its end where it started costs no
/// task, no wake-up and no hop to another worker thread. `Err(())` if it panicked.
pub(crate) fn run_to_completion<F>(make: impl FnOnce() -> F) -> Completing<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    // Boxed first, then wrapped: the wrappers, and the task it may move to, hold the box, not
    // the future. A request's future is kilobytes; wrapping it before boxing moved it three
    // times more, a memcpy each (callgrind: 1,600 instructions per HTTP request saved). And made
    // straight into its box (`make` writes its result there) rather than on the stack and then
    // copied: the HTTP layer's future is several kilobytes (4,512 bytes on the memory store in
    // `instructions_http`, by dhat at `0e5d219`).
    let future: Box<F> = Box::write(Box::new_uninit(), make());
    let future: Pin<Box<dyn Future<Output = F::Output> + Send>> = Box::into_pin(future);
    Completing { running: Some(AssertUnwindSafe(future.in_current_span()).catch_unwind()) }
}

type Running<T> = CatchUnwind<AssertUnwindSafe<Instrumented<Pin<Box<dyn Future<Output = T> + Send>>>>>;

/// The future of [`run_to_completion`]: the running future, until it ends.
pub(crate) struct Completing<T: Send + 'static> {
    running: Option<Running<T>>,
}

impl<T: Send + 'static> Future for Completing<T> {
    type Output = Result<T, ()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(running) = self.running.as_mut() else { return Poll::Ready(Err(())) };
        match Pin::new(running).poll(cx) {
            Poll::Ready(output) => {
                self.running = None;
                Poll::Ready(output.map_err(|_| ()))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: Send + 'static> Drop for Completing<T> {
    fn drop(&mut self) {
        let Some(running) = self.running.take() else { return };
        // Dropped before its end: the rest runs on its own task. Its output (the response of a
        // client that is gone) is dropped there; a panic is caught, and a key it held is released
        // by its call's guard.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            drop(runtime.spawn(running));
        } else {
            tracing::error!(
                target: "idempotent",
                "a request's future was dropped outside a Tokio runtime before its end; it cannot run on"
            );
        }
    }
}

/// The `500` a panicking handler gets.
pub(crate) fn panicked() -> Response {
    tracing::error!(target: "idempotent", "a handler panicked; answering 500");
    Problem::internal("Handler failed", "The server failed while processing the request; retry it later.")
        .into_response()
}
