//! A JSON response that `#[idempotent]` can record and replay.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde::{Deserialize, Serialize};

use super::problem::Problem;
use super::replayed::mark_replayed;
use crate::Replayable;

/// A JSON response body with its status, recordable by [`#[idempotent]`](macro@crate::idempotent).
///
/// `axum::Json` is not `Serialize`/`Deserialize`, so a handler under the attribute returns this
/// instead: it records `{"status": 201, "body": ...}` and responds with the status and the body as
/// `application/json`. A replay responds like the first call, [marked](super#replays)
/// `Idempotent-Replayed: true` as the layer's replays are: a `JsonResponse` decoded from a record
/// is marked as replayed ([`is_replay`](Self::is_replay)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JsonResponse<T> {
    status: u16,
    body: T,
    #[serde(skip_serializing, default = "decoded_is_replay")]
    replayed: bool,
}

fn decoded_is_replay() -> bool {
    true
}

impl<T> JsonResponse<T> {
    /// `200 OK` with `body`.
    pub fn ok(body: T) -> Self {
        JsonResponse { status: StatusCode::OK.as_u16(), body, replayed: false }
    }

    /// `201 Created` with `body`.
    pub fn created(body: T) -> Self {
        JsonResponse { status: StatusCode::CREATED.as_u16(), body, replayed: false }
    }

    /// `status` with `body`.
    pub fn with_status(status: StatusCode, body: T) -> Self {
        JsonResponse { status: status.as_u16(), body, replayed: false }
    }

    /// The status (a record edited to hold an invalid status reads as `500`).
    #[must_use]
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// `true` when this response was decoded from a record: it is a replay.
    pub fn is_replay(&self) -> bool {
        self.replayed
    }

    /// The body.
    pub fn body(&self) -> &T {
        &self.body
    }

    /// Takes the body out.
    pub fn into_body(self) -> T {
        self.body
    }
}

impl<T: Serialize> IntoResponse for JsonResponse<T> {
    fn into_response(self) -> Response {
        match serde_json::to_vec(&self.body) {
            Ok(bytes) => {
                let mut response = (self.status(), bytes).into_response();
                response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
                if self.replayed {
                    mark_replayed(&mut response);
                }
                response
            }
            Err(error) => {
                tracing::error!(target: "idempotent", %error, "a JsonResponse body failed to serialise");
                Problem::internal("Response not serialisable", "The server could not encode its response.")
                    .into_response()
            }
        }
    }
}

/// Answers like `T`, [marked](super#replays) `Idempotent-Replayed: true` when the value was replayed.
impl<T: IntoResponse> IntoResponse for Replayable<T> {
    fn into_response(self) -> Response {
        let replayed = self.is_replay();
        let mut response = self.into_inner().into_response();
        if replayed {
            mark_replayed(&mut response);
        }
        response
    }
}
