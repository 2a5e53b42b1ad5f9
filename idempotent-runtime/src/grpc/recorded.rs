//! What the layer records of an RPC's answer, and how an answer is rebuilt from the record.

use std::panic::AssertUnwindSafe;

use bytes::Bytes;
use futures_util::{FutureExt as _, StreamExt as _, TryStreamExt};
use http::{HeaderMap, HeaderName, HeaderValue, header};
use http_body::Frame;
use http_body_util::{BodyExt as _, BodyStream, StreamBody};
use serde::{Deserialize, Serialize};
use tonic::Code;
use tonic::body::Body;

use super::status::{self, NOT_PROCESSED_HEADER};
use crate::http::{Chunks, Data, IDEMPOTENT_REPLAYED, compact};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The header that carries a status, in the trailers or (a trailers-only answer) the headers.
const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// A recorded outcome of a covered RPC.
///
/// Recorded as one JSON string in a compact form (see [`Compact`]): `{"Ok":"a..."}` in the store.
/// Records written before it, JSON objects (`{"Ok":{"Answer":{...}}}`), are still read and
/// replayed: a record's first byte after `{"Ok":` tells the two apart (`"` or `{`).
pub(crate) enum Recorded {
    /// The answer of the call that ran, to record and then to send to that call as it is.
    Fresh(Answer),
    /// A recorded answer, read back, not yet marked as a replay.
    Answer(Answer),
    /// The handler answered with a body over the layer's limit (sent to the call that ran it).
    TooLarge { limit: usize },
    /// The handler's answer failed mid-way (an error or a panic of its body); for the log.
    Failed { reason: String },
    /// A record that was read back but cannot be replayed (edited by hand, or damaged).
    Unreadable,
}

/// The record format before the compact one, read for the records it wrote.
#[derive(Deserialize)]
enum Legacy {
    Answer { headers: Vec<(String, Data)>, body: Data, trailers: Option<Vec<(String, Data)>> },
    TooLarge { limit: usize },
    Failed { reason: String },
}

/// A handler's answer, read whole.
pub(crate) struct Answer {
    pub(crate) parts: http::response::Parts,
    pub(crate) body: Bytes,
    pub(crate) trailers: Option<HeaderMap>,
}

/// A handler's answer as the layer read it.
pub(crate) enum Read {
    /// Whole, within the limit.
    Whole(Answer),
    /// Over the limit: the answer to send the call that ran it, whole.
    TooLarge(http::Response<Body>),
    /// Its body failed before its end.
    Failed(String),
}

/// Reads `response`'s body and trailers, up to `limit` bytes of body.
pub(crate) async fn read_answer<B>(response: http::Response<B>, limit: usize) -> Read
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, body) = response.into_parts();
    let mut body = Box::pin(body);
    let mut chunks = Chunks::default();
    let mut trailers: Option<HeaderMap> = None;
    loop {
        let frame = match AssertUnwindSafe(body.frame()).catch_unwind().await {
            Ok(None) => break,
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(error))) => return Read::Failed(error.into().to_string()),
            Err(_) => return Read::Failed("the answer's body panicked".to_owned()),
        };
        let frame = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                // Kept as they come (one map, the usual case), or added to those before them.
                if let Ok(more) = frame.into_trailers() {
                    match &mut trailers {
                        Some(before) => before.extend(more),
                        None => trailers = Some(more),
                    }
                }
                continue;
            }
        };
        chunks.push(frame);
        if chunks.len() > limit {
            let read = futures_util::stream::iter(chunks.into_chunks().map(|chunk| Ok(Frame::data(chunk))));
            let rest = TryStreamExt::map_err(BodyStream::new(body), Into::into);
            return Read::TooLarge(http::Response::from_parts(parts, Body::new(StreamBody::new(read.chain(rest)))));
        }
    }
    Read::Whole(Answer { parts, body: chunks.into_bytes(), trailers })
}

impl Answer {
    /// The answer's status code: from its trailers, or its headers for a trailers-only answer.
    /// An answer with neither is `UNKNOWN`, as a client reads it.
    pub(crate) fn code(&self) -> Code {
        let value =
            self.trailers.as_ref().and_then(|t| t.get(GRPC_STATUS)).or_else(|| self.parts.headers.get(GRPC_STATUS));
        value.map_or(Code::Unknown, |value| Code::from_bytes(value.as_bytes()))
    }

    /// Where a client reads the answer's status: the trailers, or the headers of a trailers-only
    /// answer; `None` when neither carries `grpc-status` (an HTTP proxy's own answer).
    pub(crate) fn status_metadata(&self) -> Option<&HeaderMap> {
        let carries_status = |map: &&HeaderMap| map.contains_key(GRPC_STATUS);
        self.trailers.as_ref().filter(carries_status).or_else(|| Some(&self.parts.headers).filter(carries_status))
    }

    /// Removes the [`not_processed`](super::not_processed) marker; `true` if it was there.
    pub(crate) fn take_not_processed(&mut self) -> bool {
        let in_headers = self.parts.headers.remove(NOT_PROCESSED_HEADER).is_some();
        let in_trailers = self.trailers.as_mut().is_some_and(|t| t.remove(NOT_PROCESSED_HEADER).is_some());
        in_headers || in_trailers
    }

    /// The answer, to send.
    pub(crate) fn into_response(self) -> http::Response<Body> {
        http::Response::from_parts(self.parts, body(self.body, self.trailers))
    }

    /// An answer of these headers, messages and trailers.
    fn new(headers: HeaderMap, body: Bytes, trailers: Option<HeaderMap>) -> Self {
        let (mut parts, ()) = http::Response::new(()).into_parts();
        parts.headers = headers;
        Answer { parts, body, trailers }
    }

    /// Marks this recorded answer as replayed: `idempotent-replayed: true` and, if it is not `OK`,
    /// a pushback that refuses retries (another attempt would get it again), where a client reads
    /// the status: in the trailers or, for a trailers-only answer, the headers.
    fn mark_replayed(&mut self) {
        if self.code() != Code::Ok {
            status::refuse_retries(self.trailers.as_mut().unwrap_or(&mut self.parts.headers));
        }
        self.parts.headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
}

impl Recorded {
    /// The answer this call sends: the one that ran, as it is; a recorded one with
    /// `idempotent-replayed: true` and, if it is an error, a negative `grpc-retry-pushback-ms`,
    /// which stops a client's retry policy (gRFC A6): a retry would get the same answer.
    pub(crate) fn into_response(self) -> http::Response<Body> {
        match self {
            Recorded::Fresh(answer) => answer.into_response(),
            Recorded::Answer(mut answer) => {
                answer.mark_replayed();
                answer.into_response()
            }
            Recorded::TooLarge { limit } => status::replayed(status::replay_impossible(&format!(
                "a call with this idempotency-key was processed, but its response was over the {limit}-byte recording \
                 limit, so it cannot be replayed; it will not run again under this key"
            ))),
            Recorded::Failed { .. } => status::replayed(status::replay_impossible(
                "a call with this idempotency-key was processed, but its response failed while it was sent, so it \
                 cannot be replayed; it will not run again under this key",
            )),
            Recorded::Unreadable => {
                tracing::error!(target: "idempotent", "a recorded RPC answer is malformed and cannot be replayed");
                tonic::Status::internal(
                    "the answer recorded for this idempotency-key cannot be replayed; use a new key",
                )
                .into_http()
            }
        }
    }
}

/// The compact form of a record, one string (JSON-escaped where it is stored):
///
/// ```text
/// record   = "a" header* ["t" header*] body   an answer: its headers, "t" and its trailers if it
///                                            has trailers, its body (its length-prefixed messages)
///          / "l" limit                       TooLarge: the limit in decimal
///          / "f" reason                      Failed: the reason, as text
/// ```
///
/// `header` and `body` are the fields of module `http::compact`. Every header is kept but those
/// of one exchange (`date`, `content-length`). Written straight into the serializer and read from
/// the string the deserializer hands over, without an intermediate structure.
struct Compact<'r>(&'r Recorded);

impl std::fmt::Display for Compact<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Recorded::Fresh(answer) => {
                f.write_str("a")?;
                for (name, value) in &answer.parts.headers {
                    if name != header::DATE && name != header::CONTENT_LENGTH {
                        compact::write_header(f, name, value)?;
                    }
                }
                if let Some(trailers) = &answer.trailers {
                    f.write_str("t")?;
                    for (name, value) in trailers {
                        compact::write_header(f, name, value)?;
                    }
                }
                compact::write_body(f, &answer.body)
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
            Recorded::Answer(_) | Recorded::Unreadable => Ok(()),
        }
    }
}

impl Serialize for Recorded {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if matches!(self, Recorded::Answer(_) | Recorded::Unreadable) {
            return Err(serde::ser::Error::custom("a record read back is never recorded again"));
        }
        serializer.collect_str(&Compact(self))
    }
}

impl<'de> Deserialize<'de> for Recorded {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(RecordedVisitor)
    }
}

struct RecordedVisitor;

impl<'de> serde::de::Visitor<'de> for RecordedVisitor {
    type Value = Recorded;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a recorded RPC answer")
    }

    /// The compact form.
    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Self::Value, E> {
        Ok(read_compact(text.as_bytes()).unwrap_or(Recorded::Unreadable))
    }

    /// The form before it.
    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Ok(match Legacy::deserialize(serde::de::value::MapAccessDeserializer::new(map))? {
            Legacy::Answer { headers, body, trailers } => {
                rebuild(headers, body, trailers).map_or(Recorded::Unreadable, Recorded::Answer)
            }
            Legacy::TooLarge { limit } => Recorded::TooLarge { limit },
            Legacy::Failed { reason } => Recorded::Failed { reason },
        })
    }
}

/// Reads a record in the [`Compact`] form; `None` if it is not one.
fn read_compact(record: &[u8]) -> Option<Recorded> {
    let (&tag, rest) = record.split_first()?;
    match tag {
        b'a' => {
            let (headers, rest) = compact::read_headers(rest)?;
            let (trailers, rest) = compact::read_trailers(rest, compact::read_headers)?;
            Some(Recorded::Answer(Answer::new(headers, compact::read_body(rest)?, trailers)))
        }
        b'l' => Some(Recorded::TooLarge { limit: std::str::from_utf8(rest).ok()?.parse().ok()? }),
        b'f' => Some(Recorded::Failed { reason: String::from_utf8(rest.to_vec()).ok()? }),
        _ => None,
    }
}

/// An answer of the [`Legacy`] form.
fn rebuild(headers: Vec<(String, Data)>, body_data: Data, trailers: Option<Vec<(String, Data)>>) -> Option<Answer> {
    let trailers = match trailers {
        Some(entries) => Some(header_map(entries)?),
        None => None,
    };
    Some(Answer::new(header_map(headers)?, Bytes::from(body_data.into_bytes()?), trailers))
}

fn header_map(entries: Vec<(String, Data)>) -> Option<HeaderMap> {
    let mut map = HeaderMap::with_capacity(entries.len());
    for (name, value) in entries {
        map.append(HeaderName::from_bytes(name.as_bytes()).ok()?, HeaderValue::from_bytes(&value.into_bytes()?).ok()?);
    }
    Some(map)
}

/// A body of `data` followed by `trailers`. A trailers-only answer (its status in its headers)
/// gets a body that says it is empty, so its headers end the stream as gRPC requires: clients
/// refuse a trailers-only answer followed by an empty data frame.
fn body(data: Bytes, trailers: Option<HeaderMap>) -> Body {
    if data.is_empty() && trailers.is_none() {
        return Body::empty();
    }
    let data = (!data.is_empty()).then(|| Frame::data(data));
    let frames = data.into_iter().chain(trailers.map(Frame::trailers));
    Body::new(StreamBody::new(futures_util::stream::iter(frames.map(Ok::<_, std::convert::Infallible>))))
}

/// What a store keeps for an answer with `headers`, `body` and `trailers`, as this layer records
/// it (for the tests of `http::LayerRecord`).
#[cfg(test)]
pub(crate) fn recorded_for_tests(
    headers: &[(&'static str, &[u8])],
    body: &[u8],
    trailers: Option<&[(&'static str, &[u8])]>,
) -> Vec<u8> {
    serde_json::to_vec(&Ok::<_, ()>(tests::fresh(headers, body, trailers))).expect("a record")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::chunk_cases::{PAST_5, WITHIN_5};

    /// An answer whose body sends `chunks` (empty ones included), then `trailers` if any.
    fn answer(chunks: &[&[u8]], trailers: Option<HeaderMap>) -> http::Response<Body> {
        let data = chunks.iter().map(|c| Frame::data(Bytes::copy_from_slice(c)));
        let frames = data.chain(trailers.map(Frame::trailers)).map(Ok::<_, std::convert::Infallible>);
        http::Response::new(Body::new(StreamBody::new(futures_util::stream::iter(frames.collect::<Vec<_>>()))))
    }

    fn status(code: &'static str) -> HeaderMap {
        HeaderMap::from_iter([(GRPC_STATUS, HeaderValue::from_static(code))])
    }

    /// An answer as the handler gave it: `headers`, `body`, `trailers` if any.
    pub(super) fn fresh(
        headers: &[(&'static str, &[u8])],
        body: &[u8],
        trailers: Option<&[(&'static str, &[u8])]>,
    ) -> Recorded {
        let map = |entries: &[(&'static str, &[u8])]| -> HeaderMap {
            entries
                .iter()
                .map(|(name, value)| (HeaderName::from_static(name), HeaderValue::from_bytes(value).unwrap()))
                .collect()
        };
        let (parts, ()) = http::Response::new(()).into_parts();
        let mut answer = Answer { parts, body: Bytes::copy_from_slice(body), trailers: trailers.map(map) };
        answer.parts.headers = map(headers);
        Recorded::Fresh(answer)
    }

    /// An answer's headers, body and trailers, read to its end.
    type Sent = (Vec<(String, Vec<u8>)>, Vec<u8>, Option<Vec<(String, Vec<u8>)>>);

    async fn sent(answer: http::Response<Body>) -> Sent {
        let list = |map: &HeaderMap| map.iter().map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec())).collect();
        let headers = list(answer.headers());
        let collected = answer.into_body().collect().await.unwrap();
        let trailers = collected.trailers().map(list);
        (headers, collected.to_bytes().to_vec(), trailers)
    }

    /// What a store keeps of `recorded` (inside `{"Ok":..}`), read back as a replay reads it.
    fn round_trip(recorded: &Recorded) -> (String, Recorded) {
        let json = serde_json::to_string(recorded).unwrap();
        let read = serde_json::from_str::<Recorded>(&json).unwrap();
        (json, read)
    }

    /// The pairs of `entries`, owned, for comparing with what was sent.
    fn owned(entries: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
        entries.iter().map(|(n, v)| ((*n).to_owned(), v.to_vec())).collect()
    }

    #[tokio::test]
    async fn grpc_recorded_compact_form_round_trips_headers_body_and_trailers() {
        type Case =
            (&'static [(&'static str, &'static [u8])], &'static [u8], Option<&'static [(&'static str, &'static [u8])]>);
        let cases: [Case; 6] = [
            // The usual answer: a message (a zero byte and its length first), then the status.
            (&[("content-type", b"application/grpc")], b"\0\0\0\0\x02\x08\x01", Some(&[("grpc-status", b"0")])),
            // An error with metadata and binary details, and a value that is not UTF-8.
            (
                &[("content-type", b"application/grpc"), ("x-ledger-seq", b"7"), ("x-raw", b"caf\xe9 \x80")],
                b"\0\0\0\0\x03\xff\xfe\x00",
                Some(&[
                    ("grpc-status", b"13"),
                    ("grpc-message", b"ledger closed"),
                    ("grpc-status-details-bin", b"AJ+Slgc"),
                ]),
            ),
            // Trailers-only: the status in the headers, no body, no trailers.
            (
                &[("content-type", b"application/grpc"), ("grpc-status", b"5"), ("grpc-message", b"not found")],
                b"",
                None,
            ),
            // Trailers with nothing in them, a value and a body with the form's own separators.
            (&[("x-sep", b"1:a;2t:")], b"t12:x:;", Some(&[])),
            // No headers at all, and a repeated trailer.
            (&[], b"\0\0\0\0\x01a", Some(&[("x-seen", b"1"), ("x-seen", b"2")])),
            // An empty body followed by trailers.
            (&[("content-type", b"application/grpc")], b"", Some(&[("grpc-status", b"0")])),
        ];
        for (headers, body, trailers) in cases {
            let (json, read) = round_trip(&fresh(headers, body, trailers));
            assert!(json.starts_with("\"a"), "{json}");
            let Recorded::Answer(_) = &read else { panic!("not read back: {json}") };
            let (mut expected_headers, mut expected_trailers) = (owned(headers), trailers.map(owned));
            // A replayed answer that is not `OK` refuses retries, beside its status.
            if trailers.and_then(status_of).or_else(|| status_of(headers)) != Some(b"0") {
                let pushback = ("grpc-retry-pushback-ms".to_owned(), b"-1".to_vec());
                expected_trailers.as_mut().unwrap_or(&mut expected_headers).push(pushback);
            }
            expected_headers.push(("idempotent-replayed".to_owned(), b"true".to_vec()));
            assert_eq!(
                sent(read.into_response()).await,
                (expected_headers, body.to_vec(), expected_trailers),
                "{json}"
            );
        }
        // The call that ran gets its answer as it is: not marked as a replay.
        let ran = fresh(&[("content-type", b"application/grpc")], b"\0\0\0\0\0", Some(&[("grpc-status", b"0")]));
        assert!(!sent(ran.into_response()).await.0.iter().any(|(name, _)| name == "idempotent-replayed"));
        // Headers of one exchange are not recorded.
        let (json, _) = round_trip(&fresh(
            &[("date", b"Fri, 04 Dec 2026 22:00:00 GMT"), ("content-length", b"7"), ("x-kept", b"k")],
            b"",
            None,
        ));
        assert_eq!(json, r#""a6:x-kept1:k:""#);
        let (json, read) = round_trip(&Recorded::TooLarge { limit: 4096 });
        assert_eq!(json, r#""l4096""#);
        assert!(matches!(read, Recorded::TooLarge { limit: 4096 }));
        let (json, read) = round_trip(&Recorded::Failed { reason: "stream \"broke\"".into() });
        assert!(matches!(read, Recorded::Failed { reason } if reason == "stream \"broke\""), "{json}");
    }

    /// The value of `grpc-status` among `fields`.
    fn status_of<'a>(fields: &[(&str, &'a [u8])]) -> Option<&'a [u8]> {
        fields.iter().find(|(name, _)| *name == "grpc-status").map(|field| field.1)
    }

    #[tokio::test]
    async fn grpc_recorded_legacy_json_records_still_replay() {
        // What the layer wrote before the compact form, as stores keep it (the value inside `{"Ok":..}`).
        let legacy = r#"{"Answer":{"headers":[["content-type",{"Text":"application/grpc"}],["x-ledger-seq",{"Text":"3"}]],"body":{"Text":"\u0000\u0000\u0000\u0000\u0002\b\u0001"},"trailers":[["grpc-status",{"Text":"0"}],["x-bin",{"Base64":"/3Rlc3Q="}]]}}"#;
        let Ok(read @ Recorded::Answer(_)) = serde_json::from_str::<Recorded>(legacy) else { panic!() };
        let expected = (
            owned(&[("content-type", b"application/grpc"), ("x-ledger-seq", b"3"), ("idempotent-replayed", b"true")]),
            b"\0\0\0\0\x02\x08\x01".to_vec(),
            Some(owned(&[("grpc-status", b"0"), ("x-bin", b"\xfftest")])),
        );
        assert_eq!(sent(read.into_response()).await, expected);
        let trailers_only =
            r#"{"Answer":{"headers":[["grpc-status",{"Text":"5"}]],"body":{"Text":""},"trailers":null}}"#;
        let Ok(read @ Recorded::Answer(_)) = serde_json::from_str::<Recorded>(trailers_only) else { panic!() };
        let expected = (
            owned(&[("grpc-status", b"5"), ("grpc-retry-pushback-ms", b"-1"), ("idempotent-replayed", b"true")]),
            vec![],
            None,
        );
        assert_eq!(sent(read.into_response()).await, expected);
        assert!(matches!(serde_json::from_str(r#"{"TooLarge":{"limit":9}}"#), Ok(Recorded::TooLarge { limit: 9 })));
        assert!(
            matches!(serde_json::from_str(r#"{"Failed":{"reason":"r"}}"#), Ok(Recorded::Failed { reason }) if reason == "r")
        );
        // A legacy record with a header no answer can carry is unreadable, not a decoding error.
        let broken = r#"{"Answer":{"headers":[["bad name",{"Text":"v"}]],"body":{"Text":""},"trailers":null}}"#;
        assert!(matches!(serde_json::from_str(broken), Ok(Recorded::Unreadable)));
    }

    #[tokio::test]
    async fn grpc_recorded_damaged_compact_records_are_unreadable() {
        for damaged in [
            "",
            "x",
            "a",
            "a12:content-type",
            "a5:x-bin5;ab",
            "a5:x-bin99:v:",
            "at",
            "at1:",
            "a1:a1:vt1:b",
            "a;%%",
            "lten",
            "t:",
        ] {
            let json = serde_json::to_string(damaged).unwrap();
            let read = serde_json::from_str::<Recorded>(&json);
            assert!(matches!(read, Ok(Recorded::Unreadable)), "{damaged:?}");
            // Replayed as INTERNAL, never as an answer the handler did not give.
            let answer = read.unwrap().into_response();
            let status = tonic::Status::from_header_map(answer.headers()).expect("a trailers-only status");
            assert_eq!(status.code(), Code::Internal, "{damaged:?}");
        }
    }

    #[tokio::test]
    async fn grpc_answers_are_read_whole_within_the_limit_and_passed_on_whole_past_it() {
        // A body of one chunk is kept as it is, not copied.
        let one = Bytes::from_static(b"\0\0\0\0\x02\x08\x01");
        let single = http::Response::new(Body::new(StreamBody::new(futures_util::stream::iter([
            Ok::<_, std::convert::Infallible>(Frame::data(one.clone())),
            Ok(Frame::trailers(status("0"))),
        ]))));
        let Read::Whole(read) = read_answer(single, 64).await else { panic!("one chunk") };
        assert_eq!((read.body.as_ptr(), read.body.len()), (one.as_ptr(), one.len()));
        assert_eq!(read.code(), Code::Ok);
        // Trailers that come in two frames are both kept.
        let more = HeaderMap::from_iter([(HeaderName::from_static("x-more"), HeaderValue::from_static("1"))]);
        let split = http::Response::new(Body::new(StreamBody::new(futures_util::stream::iter([
            Ok::<_, std::convert::Infallible>(Frame::data(one.clone())),
            Ok(Frame::trailers(status("0"))),
            Ok(Frame::trailers(more)),
        ]))));
        let Read::Whole(read) = read_answer(split, 64).await else { panic!("two trailer frames") };
        let trailers = read.trailers.as_ref().expect("trailers");
        assert_eq!(
            (trailers.get(GRPC_STATUS), trailers.get("x-more")),
            (Some(&status("0")[GRPC_STATUS]), Some(&HeaderValue::from_static("1")))
        );
        // Several chunks, empty ones among them, are joined in order, up to the limit exactly.
        for chunks in WITHIN_5 {
            let Read::Whole(read) = read_answer(answer(chunks, Some(status("5"))), 5).await else {
                panic!("{chunks:?}")
            };
            assert_eq!(read.body, chunks.concat(), "{chunks:?}");
            assert_eq!(read.code(), Code::NotFound, "{chunks:?}: the trailers are kept");
        }
        // Past the limit at the first, a middle or the last chunk: the call gets every byte, in
        // order, and the trailers after them.
        for chunks in PAST_5 {
            let Read::TooLarge(response) = read_answer(answer(chunks, Some(status("0"))), 5).await else {
                panic!("{chunks:?}")
            };
            let collected = response.into_body().collect().await.unwrap();
            assert_eq!(collected.trailers().and_then(|t| t.get(GRPC_STATUS)), Some(&HeaderValue::from_static("0")));
            assert_eq!(collected.to_bytes(), chunks.concat(), "{chunks:?}");
        }
    }
}
