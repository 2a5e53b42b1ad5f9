//! What the layer records of a response, and how a replay is rebuilt from it.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
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
    /// The handler ran, but its response body was over the layer's limit.
    TooLarge { limit: usize },
}

/// Bytes as JSON: text when they are UTF-8 (compact and readable), base64 otherwise.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Data {
    Text(String),
    Base64(String),
}

impl Data {
    fn from_bytes(bytes: &[u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(text) => Data::Text(text.to_owned()),
            Err(_) => Data::Base64(base64_encode(bytes)),
        }
    }

    fn into_bytes(self) -> Option<Vec<u8>> {
        match self {
            Data::Text(text) => Some(text.into_bytes()),
            Data::Base64(text) => base64_decode(&text),
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

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let text = text.as_bytes();
    if !text.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    for (index, chunk) in text.chunks(4).enumerate() {
        let last = index + 1 == text.len() / 4;
        let padding = chunk.iter().rev().take_while(|&&c| c == b'=').count();
        if padding > 2 || (padding > 0 && !last) {
            return None;
        }
        let mut n = 0u32;
        for &c in &chunk[..4 - padding] {
            let value = ALPHABET.iter().position(|&a| a == c)?;
            n = n << 6 | u32::try_from(value).ok()?;
        }
        n <<= 6 * padding;
        let decoded = n.to_be_bytes();
        out.extend_from_slice(&decoded[1..4 - padding]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_base64_round_trips() {
        for len in 0..40 {
            let bytes: Vec<u8> = (0..len).map(|i: u8| i.wrapping_mul(37).wrapping_add(200)).collect();
            let text = base64_encode(&bytes);
            assert_eq!(base64_decode(&text).as_deref(), Some(&bytes[..]), "{text}");
        }
        assert_eq!(base64_encode(b"test"), "dGVzdA==");
        assert_eq!(base64_decode("dGVzdA=="), Some(b"test".to_vec()));
        assert_eq!(base64_decode("dGVzdA="), None);
        assert_eq!(base64_decode("dG=zdA=="), None);
        assert_eq!(base64_decode("dGVz!A=="), None);
    }
}
