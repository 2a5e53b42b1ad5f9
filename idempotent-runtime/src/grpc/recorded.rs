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
use crate::http::{Chunks, Data, IDEMPOTENT_REPLAYED};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The header that carries a status, in the trailers or (a trailers-only answer) the headers.
const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// A recorded outcome of a covered RPC.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Recorded {
    /// The answer: initial metadata, the body (its length-prefixed messages) and the trailers.
    Answer { headers: Vec<(String, Data)>, body: Data, trailers: Option<Vec<(String, Data)>> },
    /// The handler answered with a body over the layer's limit (sent to the call that ran it).
    TooLarge { limit: usize },
    /// The handler's answer failed mid-way (an error or a panic of its body); for the log.
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
    let mut trailers = None;
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
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(more);
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

    /// Removes the [`not_processed`](super::not_processed) marker; `true` if it was there.
    pub(crate) fn take_not_processed(&mut self) -> bool {
        let in_headers = self.parts.headers.remove(NOT_PROCESSED_HEADER).is_some();
        let in_trailers = self.trailers.as_mut().is_some_and(|t| t.remove(NOT_PROCESSED_HEADER).is_some());
        in_headers || in_trailers
    }

    /// The record of this answer: every header but those of one exchange (`date`,
    /// `content-length`), the body, the trailers.
    pub(crate) fn record(&self) -> Recorded {
        let headers = self
            .parts
            .headers
            .iter()
            .filter(|(name, _)| *name != header::DATE && *name != header::CONTENT_LENGTH)
            .map(entry)
            .collect();
        let trailers = self.trailers.as_ref().map(|t| t.iter().map(entry).collect());
        Recorded::Answer { headers, body: Data::from_bytes(&self.body), trailers }
    }

    /// The answer, to send.
    pub(crate) fn into_response(self) -> http::Response<Body> {
        http::Response::from_parts(self.parts, body(self.body, self.trailers))
    }
}

fn entry((name, value): (&HeaderName, &HeaderValue)) -> (String, Data) {
    (name.as_str().to_owned(), Data::from_bytes(value.as_bytes()))
}

impl Recorded {
    /// The answer a replay sends: the recorded one with `idempotent-replayed: true`.
    pub(crate) fn into_replay(self) -> http::Response<Body> {
        let rebuilt = match self {
            Recorded::Answer { headers, body, trailers } => rebuild(headers, body, trailers),
            Recorded::TooLarge { limit } => Some(status::replay_impossible(&format!(
                "a call with this idempotency-key was processed, but its response was over the {limit}-byte recording \
                 limit, so it cannot be replayed; it will not run again under this key"
            )).into_http()),
            Recorded::Failed { .. } => Some(status::replay_impossible(
                "a call with this idempotency-key was processed, but its response failed while it was sent, so it \
                 cannot be replayed; it will not run again under this key",
            ).into_http()),
        };
        let Some(mut response) = rebuilt else {
            tracing::error!(target: "idempotent", "a recorded RPC answer is malformed and cannot be replayed");
            return tonic::Status::internal(
                "the answer recorded for this idempotency-key cannot be replayed; use a new key",
            )
            .into_http();
        };
        response.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
    }
}

fn rebuild(
    headers: Vec<(String, Data)>,
    body_data: Data,
    trailers: Option<Vec<(String, Data)>>,
) -> Option<http::Response<Body>> {
    let trailers = match trailers {
        Some(entries) => Some(header_map(entries)?),
        None => None,
    };
    let mut response = http::Response::new(body(Bytes::from(body_data.into_bytes()?), trailers));
    *response.headers_mut() = header_map(headers)?;
    Some(response)
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
