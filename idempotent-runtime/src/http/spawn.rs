//! Running a request on its own task, so that a client that disconnects cannot cancel it.

use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::FutureExt as _;

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use tower::{Layer, Service};
use tracing::Instrument as _;

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
/// reach hyper. Under the attribute, the claim of a panicking body is handled by the protocol's
/// cancellation policy (see [`Call`](crate::Call)).
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

    fn call(&mut self, request: Request) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let running = inner.call(request);
        let task = spawn(async move {
            match AssertUnwindSafe(running).catch_unwind().await {
                Ok(Ok(response)) => response,
                Ok(Err(never)) => match never {},
                Err(_) => panicked(),
            }
        });
        Box::pin(async move { Ok(task.await.unwrap_or_else(|()| panicked())) })
    }
}

/// Spawns `future` on its own task (in the current span), so dropping the returned future does not
/// cancel it; `Err(())` if the task panicked or the runtime shut down first.
pub(crate) fn spawn<T: Send + 'static>(
    future: impl Future<Output = T> + Send + 'static,
) -> impl Future<Output = Result<T, ()>> + Send {
    let handle = tokio::spawn(future.in_current_span());
    async move {
        handle.await.map_err(|error| {
            tracing::error!(target: "idempotent", %error, "a request's task failed");
        })
    }
}

/// The `500` a panicking handler gets.
pub(crate) fn panicked() -> Response {
    tracing::error!(target: "idempotent", "a handler panicked; answering 500");
    Problem::internal("Handler failed", "The server failed while processing the request; retry it later.")
        .into_response()
}
