//! What the layer records of a response, and how a replay is rebuilt from it.

use std::panic::AssertUnwindSafe;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use futures_util::{FutureExt as _, StreamExt as _};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use http_body_util::BodyExt as _;
use serde::{Deserialize, Serialize};

use super::IDEMPOTENT_REPLAYED;
use super::problem::Problem;

/// The response headers recorded and replayed by default: those that describe the body or point
/// at the created resource. Others (`Set-Cookie`, `Date`, tracing ids, ...) belong to one exchange
/// and are not replayed; `Content-Length` is recomputed.
pub const DEFAULT_RECORDED_HEADERS: [HeaderName; 9] = [
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_DISPOSITION,
    header::CONTENT_LOCATION,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::LINK,
];

/// A recorded outcome of a route behind the layer.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Recorded {
    /// The response: status, allow-listed headers in order, body.
    Response { status: u16, headers: Vec<(String, Data)>, body: Data },
    /// The handler ran, but its response body was over the layer's limit (it was sent to the
    /// request that ran it, not recorded).
    TooLarge { limit: usize },
    /// The handler ran and returned a response whose body failed (an error or a panic of its
    /// stream) before its end; `reason` is for the server's log only.
    Failed { reason: String },
}

/// Bytes as JSON: text when they are UTF-8 (compact and readable), base64 otherwise (the standard
/// alphabet with canonical padding, RFC 4648 section 4).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Data {
    Text(String),
    Base64(String),
}

impl Data {
    pub(crate) fn from_bytes(bytes: &[u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(text) => Data::Text(text.to_owned()),
            Err(_) => Data::Base64(BASE64.encode(bytes)),
        }
    }

    pub(crate) fn into_bytes(self) -> Option<Vec<u8>> {
        match self {
            Data::Text(text) => Some(text.into_bytes()),
            Data::Base64(text) => BASE64.decode(text).ok(),
        }
    }
}

impl Recorded {
    /// Records a response's status, the `allowed` headers it has, and its body.
    pub(crate) fn response(status: StatusCode, headers: &HeaderMap, allowed: &[HeaderName], body: &[u8]) -> Self {
        let headers = headers
            .iter()
            .filter(|(name, _)| allowed.contains(name))
            .map(|(name, value)| (name.as_str().to_owned(), Data::from_bytes(value.as_bytes())))
            .collect();
        Recorded::Response { status: status.as_u16(), headers, body: Data::from_bytes(body) }
    }

    /// The response a replay sends: the recorded one plus `Idempotent-Replayed: true`.
    pub(crate) fn into_replay(self) -> Response {
        let rebuilt = match self {
            Recorded::Response { status, headers, body } => rebuild(status, headers, body),
            Recorded::TooLarge { limit } => Some(Problem::response_too_large(limit).into_response()),
            Recorded::Failed { .. } => Some(Problem::response_failed().into_response()),
        };
        let Some(mut response) = rebuilt else {
            tracing::error!(target: "idempotent", "a recorded response is malformed and cannot be replayed");
            return Problem::internal(
                "Recorded response unreadable",
                "The response recorded for this Idempotency-Key cannot be replayed. Use a new key.",
            )
            .into_response();
        };
        response.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
    }
}

/// A response body, read for recording.
pub(crate) enum Read {
    /// The whole body, within the limit.
    Whole(Bytes),
    /// Over the limit: what was read, then the rest of the stream, for the request that ran it.
    TooLarge(Body),
    /// The body failed before its end: the error's text, or a note that its stream panicked.
    Failed(String),
}

/// Reads `body` up to `limit` bytes; past it, stops reading and hands back the body whole. Only
/// data is kept: trailers (rare on responses) are neither recorded nor passed on.
pub(crate) async fn read_response(mut body: Body, limit: usize) -> Read {
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    loop {
        let frame = match AssertUnwindSafe(body.frame()).catch_unwind().await {
            Ok(None) => break,
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(error))) => return Read::Failed(error.to_string()),
            Err(_) => return Read::Failed("the response body's stream panicked".to_owned()),
        };
        let Ok(data) = frame.into_data() else { continue };
        len = len.saturating_add(data.len());
        chunks.push(data);
        if len > limit {
            let read = futures_util::stream::iter(chunks.into_iter().map(Ok));
            return Read::TooLarge(Body::from_stream(read.chain(body.into_data_stream())));
        }
    }
    Read::Whole(match <[Bytes; 1]>::try_from(chunks) {
        Ok([one]) => one,
        Err(chunks) => chunks.concat().into(),
    })
}

fn rebuild(status: u16, headers: Vec<(String, Data)>, body: Data) -> Option<Response> {
    let mut response = Response::new(Body::from(Bytes::from(body.into_bytes()?)));
    *response.status_mut() = StatusCode::from_u16(status).ok()?;
    for (name, value) in headers {
        let name = HeaderName::from_bytes(name.as_bytes()).ok()?;
        let value = HeaderValue::from_bytes(&value.into_bytes()?).ok()?;
        response.headers_mut().append(name, value);
    }
    Some(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_recorded_bytes_are_text_when_utf8_and_base64_otherwise() {
        for len in 0..40 {
            let bytes: Vec<u8> = (0..len).map(|i: u8| i.wrapping_mul(37).wrapping_add(200)).collect();
            let data = Data::from_bytes(&bytes);
            assert_eq!(matches!(data, Data::Text(_)), std::str::from_utf8(&bytes).is_ok(), "{data:?}");
            assert_eq!(data.into_bytes().as_deref(), Some(&bytes[..]));
        }
        assert!(matches!(Data::from_bytes(b"caf\xc3\xa9"), Data::Text(t) if t == "caf\u{e9}"));
        assert!(matches!(Data::from_bytes(b"\xfftest"), Data::Base64(t) if t == "/3Rlc3Q="));
        // A record edited by hand: non-canonical or broken base64 is refused, not guessed at.
        for broken in ["/3Rlc3Q", "/3Rlc3R=", "/3Rl!3Q=", "/3=lc3Q="] {
            assert_eq!(Data::Base64(broken.to_owned()).into_bytes(), None, "{broken}");
        }
    }
}
