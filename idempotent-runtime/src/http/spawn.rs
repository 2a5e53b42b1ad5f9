//! Running a request on its own task, so that a client that disconnects cannot cancel it.

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

/// Runs the routes it wraps on their own Tokio task, so that a request whose handler has started
/// always runs to its end, even if the client disconnects meanwhile.
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
        let task = run_to_completion(async move {
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

/// The request extension that says the request runs on its own task, to its end: set by
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

/// Runs `future` to its end whatever happens to the returned future: it is polled once right
/// here and, if it is not done by then, moved to a Tokio task of its own (in the current span),
/// so dropping the returned future never cancels it. A request that finishes in its first poll
/// (a replay from an in-process store, a refusal) costs no task. `Err(())` if it panicked or the
/// runtime shut down before it finished.
pub(crate) fn run_to_completion<F>(future: F) -> impl Future<Output = Result<F::Output, ()>> + Send
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Running<F> = CatchUnwind<AssertUnwindSafe<Instrumented<Pin<Box<F>>>>>;
    enum State<F: Future> {
        /// Not polled yet, or polled here once.
        Here(Running<F>),
        /// Moved to its own task.
        Spawned(tokio::task::JoinHandle<std::thread::Result<F::Output>>),
        Done,
    }
    // Boxed first, then wrapped: the wrappers, and the task it may move to, hold the box, not
    // the future. A request's future is kilobytes; wrapping it before boxing moved it three
    // times more, a memcpy each (callgrind: 1,600 instructions per HTTP request saved).
    let mut state = State::Here(AssertUnwindSafe(Box::pin(future).in_current_span()).catch_unwind());
    std::future::poll_fn(move |cx| match &mut state {
        State::Here(running) => match Pin::new(running).poll(cx) {
            Poll::Ready(output) => {
                state = State::Done;
                Poll::Ready(output.map_err(|_| ()))
            }
            Poll::Pending => {
                let State::Here(running) = std::mem::replace(&mut state, State::Done) else { unreachable!() };
                let mut handle = tokio::spawn(running);
                // Polled now so this future is woken when the task ends (the task itself polls
                // `running` again, registering its own wakers).
                let polled = Pin::new(&mut handle).poll(cx);
                state = State::Spawned(handle);
                match polled {
                    Poll::Ready(joined) => {
                        state = State::Done;
                        Poll::Ready(flatten(joined))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        },
        State::Spawned(handle) => match Pin::new(handle).poll(cx) {
            Poll::Ready(joined) => {
                state = State::Done;
                Poll::Ready(flatten(joined))
            }
            Poll::Pending => Poll::Pending,
        },
        State::Done => Poll::Ready(Err(())),
    })
}

fn flatten<T>(joined: Result<std::thread::Result<T>, tokio::task::JoinError>) -> Result<T, ()> {
    match joined {
        Ok(Ok(output)) => Ok(output),
        Ok(Err(_)) => Err(()),
        Err(error) => {
            tracing::error!(target: "idempotent", %error, "a request's task failed");
            Err(())
        }
    }
}

/// The `500` a panicking handler gets.
pub(crate) fn panicked() -> Response {
    tracing::error!(target: "idempotent", "a handler panicked; answering 500");
    Problem::internal("Handler failed", "The server failed while processing the request; retry it later.")
        .into_response()
}
