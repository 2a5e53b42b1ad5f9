//! The headers that mark a replayed response.

use axum::response::Response;
use http::{HeaderName, HeaderValue, StatusCode};

use super::IDEMPOTENT_REPLAYED;

/// The header with which Stripe's API tells its SDKs whether to retry a request. Stripe's Python
/// SDK (`tests/tests/http_stripe.rs` runs it) reads it before its own rule, which retries every
/// `409` and `5xx`.
const STRIPE_SHOULD_RETRY: HeaderName = HeaderName::from_static("stripe-should-retry");

/// Marks `response` as the answer recorded for its key: `Idempotent-Replayed: true`. A replayed
/// `409` or `5xx`, which Stripe's Python SDK would retry, also gets `Stripe-Should-Retry: false`,
/// since another attempt with the same key gets the same answer: without it that SDK spent every
/// retry it had left, and the back-off before each, on the same replayed `500`.
pub(crate) fn mark_replayed(response: &mut Response) {
    let status = response.status();
    let headers = response.headers_mut();
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if status == StatusCode::CONFLICT || status.is_server_error() {
        headers.insert(STRIPE_SHOULD_RETRY, HeaderValue::from_static("false"));
    }
}
