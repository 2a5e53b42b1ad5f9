//! A JSON response that `#[idempotent]` can record and replay.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde::{Deserialize, Serialize};

use super::problem::Problem;

/// A JSON response body with its status, recordable by [`#[idempotent]`](macro@crate::idempotent).
///
/// `axum::Json` is not `Serialize`/`Deserialize`, so a handler under the attribute returns this
/// instead: it records `{"status": 201, "body": ...}` and responds with the status and the body as
/// `application/json`. A replay responds exactly like the first call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JsonResponse<T> {
    status: u16,
    body: T,
}

impl<T> JsonResponse<T> {
    /// `200 OK` with `body`.
    pub fn ok(body: T) -> Self {
        JsonResponse { status: StatusCode::OK.as_u16(), body }
    }

    /// `201 Created` with `body`.
    pub fn created(body: T) -> Self {
        JsonResponse { status: StatusCode::CREATED.as_u16(), body }
    }

    /// `status` with `body`.
    pub fn with_status(status: StatusCode, body: T) -> Self {
        JsonResponse { status: status.as_u16(), body }
    }

    /// The status (a record edited to hold an invalid status reads as `500`).
    #[must_use]
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
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
