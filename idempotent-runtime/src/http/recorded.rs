//! What the layer records of a response, and how a replay is rebuilt from it.

use std::panic::AssertUnwindSafe;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use futures_util::{FutureExt as _, StreamExt as _};
use http::{HeaderName, HeaderValue, StatusCode, header};
use http_body_util::BodyExt as _;
use serde::{Deserialize, Serialize};

use super::chunks::Chunks;
use super::compact;
use super::problem::Problem;
use super::replayed::mark_replayed;

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
///
/// Recorded as one JSON string in a compact form (see [`Compact`]): `{"Ok":"h201..."}` in the
/// store. Records written before it, JSON objects (`{"Ok":{"Response":{...}}}`), are still read
/// and replayed: a record's first byte after `{"Ok":` tells the two apart (`"` or `{`).
pub(crate) enum Recorded<'a> {
    /// The response of the request that ran, to record (its status, the `allowed` headers it has,
    /// its body) and then to send to that request as it is.
    Fresh { parts: http::response::Parts, body: Bytes, allowed: &'a [HeaderName] },
    /// A recorded response, read back and rebuilt, not yet marked as a replay.
    Response(Response),
    /// The handler ran, but its response body was over the layer's limit (it was sent to the
    /// request that ran it, not recorded).
    TooLarge { limit: usize },
    /// The handler ran and returned a response whose body failed (an error or a panic of its
    /// stream) before its end; `reason` is for the server's log only.
    Failed { reason: String },
    /// A record that was read back but cannot be replayed (edited by hand, or damaged).
    Unreadable,
}

/// The record format before the compact one, read for the records it wrote.
#[derive(Deserialize)]
enum Legacy {
    Response { status: u16, headers: Vec<(String, Data)>, body: Data },
    TooLarge { limit: usize },
    Failed { reason: String },
}

/// Bytes in the legacy forms (the HTTP layer's before its compact one, and the gRPC layer's):
/// text when they were UTF-8, base64 otherwise (the standard alphabet with canonical padding, RFC
/// 4648 section 4).
#[derive(Debug, Deserialize)]
pub(crate) enum Data {
    Text(String),
    Base64(String),
}

impl Data {
    pub(crate) fn into_bytes(self) -> Option<Vec<u8>> {
        match self {
            Data::Text(text) => Some(text.into_bytes()),
            Data::Base64(text) => BASE64.decode(text).ok(),
        }
    }
}

impl Recorded<'_> {
    /// The response this request sends: the one that ran, as it is; a recorded one with
    /// `Idempotent-Replayed: true`.
    pub(crate) fn into_response(self) -> Response {
        let rebuilt = match self {
            Recorded::Fresh { parts, body, .. } => return Response::from_parts(parts, Body::from(body)),
            Recorded::Response(response) => Some(response),
            Recorded::TooLarge { limit } => Some(Problem::response_too_large(limit).into_response()),
            Recorded::Failed { .. } => Some(Problem::response_failed().into_response()),
            Recorded::Unreadable => None,
        };
        let Some(mut response) = rebuilt else {
            tracing::error!(target: "idempotent", "a recorded response is malformed and cannot be replayed");
            return Problem::internal(
                "Recorded response unreadable",
                "The response recorded for this Idempotency-Key cannot be replayed. Use a new key.",
            )
            .into_response();
        };
        mark_replayed(&mut response);
        response
    }
}

/// The compact form of a record, one string (JSON-escaped where it is stored):
///
/// ```text
/// record   = "h" status header* body      a response: 3-digit status, headers in order, body
///          / "l" limit                    TooLarge: the limit in decimal
///          / "f" reason                   Failed: the reason, as text
/// ```
///
/// `header` and `body` are the fields of module `compact`. Written straight into the serializer
/// (no string is built first) and read from the string the deserializer hands over, without an
/// intermediate structure.
struct Compact<'r>(&'r Recorded<'r>);

impl std::fmt::Display for Compact<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Recorded::Fresh { parts, body, allowed } => {
                f.write_str("h")?;
                f.write_str(parts.status.as_str())?;
                for (name, value) in parts.headers.iter().filter(|(name, _)| allowed.contains(name)) {
                    compact::write_header(f, name, value)?;
                }
                compact::write_body(f, body)
            }
            Recorded::TooLarge { limit } => {
                f.write_str("l")?;
                f.write_str(itoa::Buffer::new().format(*limit))
            }
            Recorded::Failed { reason } => {
                f.write_str("f")?;
                f.write_str(reason)
            }
            // Never recorded (`Serialize` refuses them before writing).
            Recorded::Response(_) | Recorded::Unreadable => Ok(()),
        }
    }
}

impl Serialize for Recorded<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if matches!(self, Recorded::Response(_) | Recorded::Unreadable) {
            return Err(serde::ser::Error::custom("a record read back is never recorded again"));
        }
        serializer.collect_str(&Compact(self))
    }
}

impl<'de> Deserialize<'de> for Recorded<'_> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(RecordedVisitor)
    }
}

struct RecordedVisitor;

impl<'de> serde::de::Visitor<'de> for RecordedVisitor {
    type Value = Recorded<'static>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a recorded HTTP response")
    }

    /// The compact form.
    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Self::Value, E> {
        Ok(read_compact(text.as_bytes()).unwrap_or(Recorded::Unreadable))
    }

    /// The form before it.
    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Ok(match Legacy::deserialize(serde::de::value::MapAccessDeserializer::new(map))? {
            Legacy::Response { status, headers, body } => {
                rebuild(status, headers, body).map_or(Recorded::Unreadable, Recorded::Response)
            }
            Legacy::TooLarge { limit } => Recorded::TooLarge { limit },
            Legacy::Failed { reason } => Recorded::Failed { reason },
        })
    }
}

/// Reads a record in the [`Compact`] form; `None` if it is not one.
fn read_compact(record: &[u8]) -> Option<Recorded<'static>> {
    let (&tag, rest) = record.split_first()?;
    match tag {
        b'h' => {
            let (status, rest) = rest.split_at_checked(3)?;
            let status = StatusCode::from_bytes(status).ok()?;
            let (headers, rest) = compact::read_headers(rest)?;
            let mut response = Response::new(Body::from(compact::read_body(rest)?));
            *response.status_mut() = status;
            *response.headers_mut() = headers;
            Some(Recorded::Response(response))
        }
        b'l' => Some(Recorded::TooLarge { limit: std::str::from_utf8(rest).ok()?.parse().ok()? }),
        b'f' => Some(Recorded::Failed { reason: String::from_utf8(rest.to_vec()).ok()? }),
        _ => None,
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
    let mut chunks = Chunks::default();
    loop {
        let frame = match AssertUnwindSafe(body.frame()).catch_unwind().await {
            Ok(None) => break,
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(error))) => return Read::Failed(error.to_string()),
            Err(_) => return Read::Failed("the response body's stream panicked".to_owned()),
        };
        let Ok(data) = frame.into_data() else { continue };
        chunks.push(data);
        if chunks.len() > limit {
            let read = futures_util::stream::iter(chunks.into_chunks().map(Ok));
            return Read::TooLarge(Body::from_stream(read.chain(body.into_data_stream())));
        }
    }
    Read::Whole(chunks.into_bytes())
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
    use crate::http::chunks::tests::{PAST_5, WITHIN_5};

    /// A test case: status, the response's headers, body.
    type Case = (u16, &'static [(&'static str, &'static [u8])], &'static [u8]);

    fn fresh<'a>(status: u16, headers: &[(&str, &[u8])], body: &[u8], allowed: &'a [HeaderName]) -> Recorded<'a> {
        let mut response = Response::new(());
        *response.status_mut() = StatusCode::from_u16(status).unwrap();
        for (name, value) in headers {
            response
                .headers_mut()
                .append(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_bytes(value).unwrap());
        }
        let (parts, ()) = response.into_parts();
        Recorded::Fresh { parts, body: Bytes::copy_from_slice(body), allowed }
    }

    /// What a store keeps for `recorded`, read back as a replay reads it.
    fn round_trip(recorded: &Recorded<'_>) -> (String, Recorded<'static>) {
        let json = serde_json::to_string(recorded).unwrap();
        let read = serde_json::from_str::<Recorded<'static>>(&json).unwrap();
        (json, read)
    }

    async fn parts_of(response: Response) -> (u16, Vec<(String, Vec<u8>)>, Vec<u8>) {
        let (parts, body) = response.into_parts();
        let headers = parts.headers.iter().map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec())).collect();
        (parts.status.as_u16(), headers, body.collect().await.unwrap().to_bytes().to_vec())
    }

    #[tokio::test]
    async fn http_recorded_compact_form_round_trips_text_and_binary() {
        let allowed = [header::CONTENT_TYPE, header::LOCATION, HeaderName::from_static("x-bin")];
        let cases: [Case; 5] = [
            (
                201,
                &[("content-type", b"application/json"), ("x-trace", b"not recorded"), ("location", b"/o/1")],
                br#"{"id":"a\"b","n":1}"#,
            ),
            (200, &[], b""),
            (500, &[("x-bin", b"caf\xe9 \x80"), ("x-bin", b"second")], b"\xff\x00binary\n"),
            (404, &[("location", b"/:;12:")], "caf\u{e9} \u{1F600} 12:3;".as_bytes()),
            (999, &[("content-type", b"text/plain; charset=utf-8")], b"h201:l5f"),
        ];
        for (status, headers, body) in cases {
            let (json, read) = round_trip(&fresh(status, headers, body, &allowed));
            assert!(json.starts_with("\"h"), "{json}");
            let Recorded::Response(response) = read else { panic!("not read back: {json}") };
            let kept: Vec<(String, Vec<u8>)> = headers
                .iter()
                .filter(|(name, _)| allowed.iter().any(|a| a.as_str() == *name))
                .map(|(n, v)| ((*n).to_owned(), v.to_vec()))
                .collect();
            assert_eq!(parts_of(response).await, (status, kept, body.to_vec()), "{json}");
        }
        let (json, read) = round_trip(&Recorded::TooLarge { limit: 2048 });
        assert_eq!(json, r#""l2048""#);
        assert!(matches!(read, Recorded::TooLarge { limit: 2048 }));
        let (json, read) = round_trip(&Recorded::Failed { reason: "stream \"broke\"".into() });
        assert!(matches!(read, Recorded::Failed { reason } if reason == "stream \"broke\""), "{json}");
    }

    #[tokio::test]
    async fn http_recorded_legacy_json_records_still_replay() {
        // What the layer wrote before the compact form, as stores keep it (the value inside `{"Ok":..}`).
        let legacy = r#"{"Response":{"status":201,"headers":[["content-type",{"Text":"application/json"}],["x-bin",{"Base64":"/3Rlc3Q="}]],"body":{"Text":"{\"id\":7}"}}}"#;
        let Ok(Recorded::Response(response)) = serde_json::from_str::<Recorded<'static>>(legacy) else { panic!() };
        let expected =
            vec![("content-type".to_owned(), b"application/json".to_vec()), ("x-bin".to_owned(), b"\xfftest".to_vec())];
        assert_eq!(parts_of(response).await, (201, expected, br#"{"id":7}"#.to_vec()));
        let binary = r#"{"Response":{"status":200,"headers":[],"body":{"Base64":"/3Rlc3Q="}}}"#;
        let Ok(Recorded::Response(response)) = serde_json::from_str::<Recorded<'static>>(binary) else { panic!() };
        assert_eq!(parts_of(response).await, (200, vec![], b"\xfftest".to_vec()));
        assert!(matches!(serde_json::from_str(r#"{"TooLarge":{"limit":9}}"#), Ok(Recorded::TooLarge { limit: 9 })));
        assert!(
            matches!(serde_json::from_str(r#"{"Failed":{"reason":"r"}}"#), Ok(Recorded::Failed { reason }) if reason == "r")
        );
        // A legacy record with a header no response can carry is unreadable, not a decoding error.
        let broken = r#"{"Response":{"status":201,"headers":[["bad name",{"Text":"v"}]],"body":{"Text":""}}}"#;
        assert!(matches!(serde_json::from_str(broken), Ok(Recorded::Unreadable)));
    }

    #[test]
    fn http_recorded_damaged_compact_records_are_unreadable() {
        for damaged in [
            "",
            "x",
            "h20",
            "h2x1:",
            "h201",
            "h20112:content-type",
            "h2015:x-bin5;ab",
            "h2015:x-bin99:v:",
            "h201a:b1:c:",
            "h2013:a b1:v:",
            "h201;%%",
            "lten",
        ] {
            let json = serde_json::to_string(damaged).unwrap();
            assert!(matches!(serde_json::from_str(&json), Ok(Recorded::Unreadable)), "{damaged:?}");
        }
    }

    /// A response body streamed in `chunks` (empty ones included), as a handler may send it.
    fn chunked(chunks: &[&[u8]]) -> Body {
        let chunks: Vec<Result<Bytes, std::io::Error>> = chunks.iter().map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        Body::from_stream(futures_util::stream::iter(chunks))
    }

    #[tokio::test]
    async fn http_response_bodies_are_read_whole_within_the_limit_and_passed_on_whole_past_it() {
        // A body of one chunk is kept as it is, not copied.
        let one = Bytes::from_static(br#"{"id":1}"#);
        let Read::Whole(read) = read_response(Body::from(one.clone()), 64).await else { panic!("one chunk") };
        assert_eq!((read.as_ptr(), read.len()), (one.as_ptr(), one.len()));
        let Read::Whole(read) = read_response(Body::empty(), 5).await else { panic!("no chunk") };
        assert!(read.is_empty());
        // Several chunks, empty ones among them, are joined in order, up to the limit exactly.
        for chunks in WITHIN_5 {
            let Read::Whole(read) = read_response(chunked(chunks), 5).await else { panic!("{chunks:?}") };
            assert_eq!(read, chunks.concat(), "{chunks:?}");
        }
        // Past the limit at the first, a middle or the last chunk: the client gets every byte, in order.
        for chunks in PAST_5 {
            let Read::TooLarge(body) = read_response(chunked(chunks), 5).await else { panic!("{chunks:?}") };
            assert_eq!(body.collect().await.unwrap().to_bytes(), chunks.concat(), "{chunks:?}");
        }
    }

    #[test]
    fn http_recorded_legacy_data_is_text_or_canonical_base64() {
        let read = |json: &str| serde_json::from_str::<Data>(json).unwrap().into_bytes();
        assert_eq!(read(r#"{"Text":"caf\u00e9"}"#).as_deref(), Some("caf\u{e9}".as_bytes()));
        assert_eq!(read(r#"{"Base64":"/3Rlc3Q="}"#).as_deref(), Some(&b"\xfftest"[..]));
        assert_eq!(read(r#"{"Base64":""}"#).as_deref(), Some(&b""[..]));
        // A record edited by hand: non-canonical or broken base64 is refused, not guessed at.
        for broken in ["/3Rlc3Q", "/3Rlc3R=", "/3Rl!3Q=", "/3=lc3Q="] {
            assert_eq!(Data::Base64(broken.to_owned()).into_bytes(), None, "{broken}");
        }
    }
}
