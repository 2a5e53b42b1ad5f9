//! The handler's way of saying "I did nothing": a response marker the layer reads and removes.

use std::convert::Infallible;

use axum::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};

/// Marks a response as produced **without processing the request**: behind
/// [`IdempotencyLayer`](super::IdempotencyLayer), such a response is not recorded, the key is
/// released, and a retry with the same key runs the handler again.
///
/// The layer records every response its handler produces, `5xx` included, because it cannot tell
/// from a status whether the handler acted before failing (a charge made, then a timeout on the
/// receipt: a `500` that must not be run again). Only the handler knows; when it knows that
/// nothing happened (it refused before touching anything, a dependency was down before the first
/// write), it says so with this marker. The layer removes the marker from the response, so the
/// layers around it never see it; it is never sent to the client.
///
/// Add it like a header, as part of the response (`(status, NotProcessed, body)`, or
/// `(status, NotProcessed)` for an empty body, as with axum's `Extension`):
///
/// ```
/// use axum::http::StatusCode;
/// use axum::response::{IntoResponse, Response};
/// use idempotent_runtime::http::NotProcessed;
///
/// async fn pay() -> Response {
///     let ledger_up = false; // checked before anything is written
///     if !ledger_up {
///         // Nothing was done: a retry with the same key may run.
///         return (StatusCode::SERVICE_UNAVAILABLE, NotProcessed, "ledger unavailable, nothing charged").into_response();
///     }
///     (StatusCode::CREATED, "charged").into_response()
/// }
/// ```
///
/// Mark only responses that come before any side effect: a marked response whose handler did act
/// lets a retry act again. Under [`#[idempotent]`](macro@crate::idempotent) the same role is
/// played by an `Err`, which releases the key unless `record_err` says otherwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct NotProcessed;

impl NotProcessed {
    /// Whether `response` carries the marker.
    #[must_use]
    pub fn is_marked(response: &Response) -> bool {
        response.extensions().get::<NotProcessed>().is_some()
    }

    /// Removes the marker; `true` if `response` had it.
    pub(crate) fn take(response: &mut Response) -> bool {
        response.extensions_mut().remove::<NotProcessed>().is_some()
    }
}

impl IntoResponseParts for NotProcessed {
    type Error = Infallible;

    fn into_response_parts(self, mut parts: ResponseParts) -> Result<ResponseParts, Self::Error> {
        parts.extensions_mut().insert(self);
        Ok(parts)
    }
}

/// An empty response that carries the marker (`200`, or the status it is paired with).
impl IntoResponse for NotProcessed {
    fn into_response(self) -> Response {
        let mut response = ().into_response();
        response.extensions_mut().insert(self);
        response
    }
}
