//! The statuses the layer answers with itself, and the marker of an answer not to record.

use std::time::Duration;

use http::HeaderName;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use crate::http::{IDEMPOTENT_REPLAYED, KeyHeaderError};
use crate::{Error, KeyError, MAX_KEY_BYTES};

/// The metadata key [`not_processed`] sets: `idempotent-not-processed`. The layer removes it
/// before the answer leaves the server.
pub const NOT_PROCESSED: &str = "idempotent-not-processed";

/// The trailing metadata of gRFC A6 that tells a retrying client how long to wait, or not to retry.
pub(super) const RETRY_PUSHBACK: &str = "grpc-retry-pushback-ms";

/// The longest pushback sent with `ABORTED`: the running call's remaining lease is its upper
/// bound, but a client told to wait a whole lease (a minute by default) would wait long after a
/// typical call ended. One that retries sooner gets `ABORTED` again, never a second run.
const MAX_PUSHBACK: Duration = Duration::from_secs(1);

/// Marks a handler's error as "nothing was done": the layer releases the call's key instead of
/// recording the answer, so the client's retry with the same key runs the handler again.
///
/// Only for errors returned before any effect (a validation failure, a rate limit hit before the
/// work). An error after an effect must stay recorded, or a retry repeats the effect.
///
/// ```
/// use tonic::Status;
/// use idempotent_runtime::grpc::not_processed;
///
/// fn check(amount: i64) -> Result<(), Status> {
///     if amount <= 0 {
///         return Err(not_processed(Status::invalid_argument("amount must be positive")));
///     }
///     Ok(())
/// }
/// # assert!(check(0).is_err());
/// ```
#[must_use]
pub fn not_processed(mut status: Status) -> Status {
    status.metadata_mut().insert(NOT_PROCESSED, MetadataValue::from_static("true"));
    status
}

/// The marker's header name, as the layer looks for it in an answer's headers and trailers.
pub(crate) const NOT_PROCESSED_HEADER: HeaderName = HeaderName::from_static(NOT_PROCESSED);

/// The status an idempotency [`Error`] is answered with (see the module's table).
pub(crate) fn from_error(error: &Error) -> Status {
    match error {
        Error::InvalidKey(KeyError::InvalidScope(_)) => {
            Status::internal("the server's idempotency scope is invalid (a server bug)")
        }
        Error::InvalidKey(key_error) => Status::invalid_argument(format!("invalid idempotency-key: {key_error}")),
        Error::InProgress { retry_after, .. } => {
            let pushback = retry_after.unwrap_or(MAX_PUSHBACK).clamp(Duration::from_millis(1), MAX_PUSHBACK);
            let mut status = Status::aborted(format!(
                "a call with this idempotency-key is still running; retry in {} ms with the same key to receive its \
                 response",
                pushback.as_millis()
            ));
            status
                .metadata_mut()
                .insert(RETRY_PUSHBACK, MetadataValue::from(u64::try_from(pushback.as_millis()).unwrap_or(u64::MAX)));
            status
        }
        Error::FingerprintMismatch { .. } => Status::failed_precondition(
            "this idempotency-key was already used with a different request (another method or message); send a new \
             key for a new request",
        ),
        Error::Store { .. } => Status::unavailable(
            "the call was not processed: the server could not check its idempotency-key; retry with the same key",
        ),
        Error::Unrecordable { .. } => replay_impossible(
            "a call with this idempotency-key was processed, but its response could not be recorded, so it cannot be \
             replayed; it will not run again under this key: check its effect before repeating it with a new key",
        ),
        Error::LeaseLost { .. } => Status::internal(
            "the call took longer than the server's idempotency lease and its outcome was not recorded; check its \
             effect before retrying",
        ),
        _ => {
            tracing::error!(target: "idempotent", %error, "an idempotent RPC failed");
            Status::internal("the server's idempotency layer failed; retry later with the same key")
        }
    }
}

/// The refusal of a key header the layer cannot read.
pub(crate) fn from_key_header(error: &KeyHeaderError) -> Status {
    Status::invalid_argument(match error {
        KeyHeaderError::Repeated => "the idempotency-key metadata appears more than once; send it once".to_owned(),
        KeyHeaderError::Malformed(reason) => format!("invalid idempotency-key: {reason}"),
        KeyHeaderError::TooLong(len) => {
            format!("the idempotency-key is {len} bytes long, over the limit of {MAX_KEY_BYTES}; use a UUID")
        }
    })
}

/// Makes `headers` (an answer's trailers, or the headers of a trailers-only answer) tell a
/// client's retry policy not to retry: a negative pushback means "do not retry" (gRFC A6). For a
/// replayed error, which another attempt would get again.
pub(crate) fn refuse_retries(headers: &mut http::HeaderMap) {
    headers.insert(HeaderName::from_static(RETRY_PUSHBACK), http::HeaderValue::from_static("-1"));
}

/// `status` as this key's final, replayed answer: trailers-only, marked `idempotent-replayed:
/// true`, and refusing retries.
pub(crate) fn replayed(status: Status) -> http::Response<tonic::body::Body> {
    let mut answer = status.into_http();
    refuse_retries(answer.headers_mut());
    answer.headers_mut().insert(IDEMPOTENT_REPLAYED, http::HeaderValue::from_static("true"));
    answer
}

/// `DATA_LOSS`: the call ran and its answer is not kept (over the limit, or its body failed).
pub(crate) fn replay_impossible(message: &str) -> Status {
    Status::new(Code::DataLoss, message)
}

/// The answer of a handler that panicked.
pub(crate) fn panicked() -> Status {
    tracing::error!(target: "idempotent", "an RPC handler panicked; answering INTERNAL");
    Status::internal("the server failed while processing the call; retry it later")
}
