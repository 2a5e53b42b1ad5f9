//! `application/problem+json` responses (RFC 9457) for every idempotency error.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;

use super::key_header::KeyHeaderError;
use crate::{Error, KeyError, MAX_KEY_BYTES};

/// The `Retry-After` value, in seconds, sent with `503 Service Unavailable`, and with `409 Conflict`
/// when the store does not report how long the running claim's lease lasts.
pub const RETRY_AFTER_SECS: u64 = 1;

/// The longest `Retry-After` a `409` carries, in seconds.
///
/// While a request runs, its lease is renewed every third of its length, so the remaining lease of
/// a live claim stays close to the whole lease (60 s by default) although the request may finish in
/// a moment: uncapped, it would tell clients to wait far longer than needed. The cap keeps retries
/// prompt; a shorter remaining lease (a claim whose owner stopped renewing it) is sent as it is.
pub const MAX_RETRY_AFTER_SECS: u64 = 5;

/// The `Retry-After` of a `409`: the running claim's remaining lease in whole seconds, rounded up,
/// at least 1 and at most [`MAX_RETRY_AFTER_SECS`] ([`RETRY_AFTER_SECS`] when the store does not
/// know the lease).
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::http::retry_after_secs;
///
/// assert_eq!(retry_after_secs(Some(Duration::from_millis(2_001))), 3);
/// assert_eq!(retry_after_secs(Some(Duration::ZERO)), 1);
/// assert_eq!(retry_after_secs(Some(Duration::from_secs(58))), 5);
/// assert_eq!(retry_after_secs(None), 1);
/// ```
#[must_use]
pub fn retry_after_secs(lease_remaining: Option<std::time::Duration>) -> u64 {
    lease_remaining.map_or(RETRY_AFTER_SECS, |left| {
        let whole = left.as_secs() + u64::from(left.subsec_nanos() > 0);
        whole.clamp(1, MAX_RETRY_AFTER_SECS)
    })
}

const PROBLEM_JSON: &str = "application/problem+json";

/// A problem detail (RFC 9457): what the idempotency layer and extractor answer when they refuse a
/// request, and what [`problem_response`] builds from an [`Error`].
///
/// It serialises as `{"type", "title", "status", "detail"}` with the content type
/// `application/problem+json`, plus `Retry-After` when one is set. The `type` URIs are stable
/// names (`urn:idempotent:...`), not pages to fetch; match on them to tell the cases apart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// A URI naming the kind of problem, such as `urn:idempotent:key-missing`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// A short summary of the kind of problem, the same for every occurrence.
    pub title: &'static str,
    /// The HTTP status code.
    #[serde(serialize_with = "status_code")]
    pub status: StatusCode,
    /// What happened this time and what the client should do.
    pub detail: String,
    /// Seconds after which a retry may succeed (sent as `Retry-After`).
    #[serde(skip)]
    pub retry_after: Option<u64>,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `serialize_with` passes a reference
fn status_code<S: serde::Serializer>(status: &StatusCode, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_u16(status.as_u16())
}

impl Problem {
    /// A problem with the given status, type URI, title and detail.
    #[must_use]
    pub fn new(status: StatusCode, kind: &'static str, title: &'static str, detail: impl Into<String>) -> Self {
        Problem { kind, title, status, detail: detail.into(), retry_after: None }
    }

    /// Adds a `Retry-After` header of `seconds`.
    #[must_use]
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// `400`: a route that requires an `Idempotency-Key` got none.
    #[must_use]
    pub fn missing_key() -> Self {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "urn:idempotent:key-missing",
            "Idempotency-Key header missing",
            "This operation requires an Idempotency-Key header; send a unique value (such as a UUID) \
             and reuse it only to retry the same request.",
        )
    }

    /// `413`: the request body is over the limit the layer buffers to fingerprint it.
    #[must_use]
    pub fn request_too_large(limit: usize) -> Self {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "urn:idempotent:request-too-large",
            "Request body too large",
            format!(
                "The request body is over the limit of {limit} bytes for idempotent requests; send a smaller body."
            ),
        )
    }

    /// `400`: the request body could not be read (the client went away or sent a broken body).
    #[must_use]
    pub fn request_unreadable(reason: &str) -> Self {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "urn:idempotent:request-unreadable",
            "Request body unreadable",
            format!("The request body could not be read ({reason}); send the request again."),
        )
    }

    /// `500`, to a retry: the request was processed and its response went to the request that ran
    /// it, but its body is over the recording limit, so it cannot be replayed. The request will not
    /// be processed again under this key.
    #[must_use]
    pub fn response_too_large(limit: usize) -> Self {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "urn:idempotent:response-too-large",
            "Response too large to replay",
            format!(
                "A request with this Idempotency-Key was processed, and its response was sent to that request, \
                 but its body is over the server's limit of {limit} bytes for recorded responses, so it cannot be \
                 replayed. It will not be processed again under this key; check its effect (for example with a \
                 GET on the resource) instead of repeating it with a new key."
            ),
        )
    }

    /// `500`: the handler ran and returned a response, but the response's body failed before its
    /// end. The request will not be processed again under this key.
    #[must_use]
    pub fn response_failed() -> Self {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "urn:idempotent:response-failed",
            "Response failed",
            "A request with this Idempotency-Key was processed, but its response failed while it was being \
             produced, so it cannot be returned or replayed. It will not be processed again under this key; \
             check its effect before repeating it with a new key.",
        )
    }

    /// `500`: the server's idempotency setup is wrong for this route, so the request was refused
    /// before it was processed. `fix` says what the server's developer must change.
    #[must_use]
    pub fn misconfigured(fix: &str) -> Self {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "urn:idempotent:misconfigured",
            "Idempotency misconfigured",
            format!("The request was not processed: the server is misconfigured ({fix})."),
        )
    }

    /// `500`: something on the server broke; the details are in its log, not in the response.
    #[must_use]
    pub fn internal(title: &'static str, detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "urn:idempotent:internal", title, detail)
    }

    pub(crate) fn from_key_header(error: &KeyHeaderError) -> Self {
        let malformed = |detail: String| {
            Problem::new(
                StatusCode::BAD_REQUEST,
                "urn:idempotent:key-malformed",
                "Idempotency-Key header malformed",
                detail,
            )
        };
        match error {
            KeyHeaderError::Repeated => {
                malformed("The Idempotency-Key header appears more than once; send it exactly once.".into())
            }
            KeyHeaderError::Malformed(reason) => malformed(format!("Invalid Idempotency-Key: {reason}.")),
            KeyHeaderError::TooLong(len) => malformed(format!(
                "The Idempotency-Key is {len} bytes long, over the limit of {MAX_KEY_BYTES}; use a shorter key such as a UUID."
            )),
        }
    }

    /// The problem for an idempotency [`Error`], as [`problem_response`] sends it.
    ///
    /// | error | status |
    /// |---|---|
    /// | [`Error::InvalidKey`] | 400 (500 for an invalid scope: a server bug) |
    /// | [`Error::InProgress`] | 409 with `Retry-After` ([`retry_after_secs`] of the remaining lease) |
    /// | [`Error::FingerprintMismatch`] | 422 |
    /// | [`Error::Store`] | 503 with `Retry-After` |
    /// | [`Error::Unrecordable`], [`Error::LeaseLost`], [`Error::Decode`], [`Error::Fingerprint`] | 500 |
    ///
    /// 5xx details do not include the error's text (it may name servers or keys); it is logged
    /// with `tracing` at `error` level instead.
    #[must_use]
    pub fn from_error(error: &Error) -> Self {
        let problem = match error {
            Error::InvalidKey(KeyError::InvalidScope(_)) => {
                Problem::internal("Idempotency misconfigured", "The server's idempotency scope is invalid.")
            }
            Error::InvalidKey(key_error) => Problem::new(
                StatusCode::BAD_REQUEST,
                "urn:idempotent:key-malformed",
                "Idempotency-Key header malformed",
                format!("Invalid Idempotency-Key: {key_error}."),
            ),
            Error::InProgress { retry_after, .. } => {
                let seconds = retry_after_secs(*retry_after);
                Problem::new(
                    StatusCode::CONFLICT,
                    "urn:idempotent:in-progress",
                    "Request in progress",
                    format!(
                        "A request with this Idempotency-Key is still being processed. Retry in \
                         {seconds} s with the same key to receive its response; do not change the key."
                    ),
                )
                .retry_after(seconds)
            }
            Error::FingerprintMismatch { .. } => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "urn:idempotent:key-reused",
                "Idempotency-Key reused",
                "This Idempotency-Key was already used with a different request (method, path or body \
                 differ). Send a new key for a new request.",
            ),
            Error::Store { .. } => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "urn:idempotent:store-unavailable",
                "Idempotency store unavailable",
                "The request was not processed because the server could not check its Idempotency-Key. \
                 Retry later with the same key.",
            )
            .retry_after(RETRY_AFTER_SECS),
            Error::Unrecordable { .. } => Problem::internal(
                "Response not replayable",
                "A request with this Idempotency-Key was processed, but its response could not be recorded, \
                 so it cannot be replayed. It will not be processed again under this key; check its effect \
                 before repeating it with a new key.",
            ),
            Error::LeaseLost { .. } => Problem::internal(
                "Request outcome not recorded",
                "The request took longer than the server allows for an Idempotency-Key and its outcome was \
                 not recorded. Check its effect before retrying.",
            ),
            _ => Problem::internal(
                "Idempotency failure",
                "The server could not process this Idempotency-Key. Retry later; if it persists, use a new key.",
            ),
        };
        if problem.status.is_server_error() {
            // The error's text names the key, which may be a secret: log the kind and the cause.
            let cause = match error {
                Error::Store { source, operation, .. } => format!("{operation}: {source}"),
                Error::Unrecordable { reason, .. } | Error::Decode { reason, .. } | Error::Fingerprint(reason) => {
                    reason.clone()
                }
                _ => String::new(),
            };
            tracing::error!(target: "idempotent", kind = problem.kind, cause, status = problem.status.as_u16(), "idempotent HTTP request failed");
        }
        problem
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = match serde_json::to_vec(&self) {
            Ok(body) => body,
            Err(_) => br#"{"title":"Internal Server Error","status":500}"#.to_vec(),
        };
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// The `application/problem+json` response for an idempotency [`Error`] (see
/// [`Problem::from_error`] for the statuses).
#[must_use]
pub fn problem_response(error: &Error) -> Response {
    Problem::from_error(error).into_response()
}

/// An idempotency [`Error`] that responds as a problem: a ready error type for handlers, or a
/// variant of your own error type.
///
/// ```
/// use axum::response::{IntoResponse, Response};
/// use idempotent_runtime::http::HttpError;
///
/// enum ApiError {
///     Idempotency(HttpError),
///     InsufficientFunds,
/// }
///
/// impl From<idempotent_runtime::Error> for ApiError {
///     fn from(e: idempotent_runtime::Error) -> Self {
///         ApiError::Idempotency(e.into())
///     }
/// }
///
/// impl IntoResponse for ApiError {
///     fn into_response(self) -> Response {
///         match self {
///             ApiError::Idempotency(e) => e.into_response(),
///             ApiError::InsufficientFunds => (http::StatusCode::PAYMENT_REQUIRED, "insufficient funds").into_response(),
///         }
///     }
/// }
/// ```
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct HttpError(#[from] pub Error);

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        problem_response(&self.0)
    }
}
