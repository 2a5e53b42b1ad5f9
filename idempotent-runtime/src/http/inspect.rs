//! The HTTP and gRPC layers' records read back as plain data, for tools that show them (the
//! `idempotent` CLI's `inspect`).

use super::compact;

/// What the HTTP layer ([`IdempotencyLayer`](super::IdempotencyLayer)) or the gRPC layer
/// (`grpc::GrpcIdempotencyLayer`, feature `tonic`) recorded for a key, read from the outcome
/// bytes a store keeps ([`admin::Entry::outcome`](crate::admin::Entry::outcome)).
///
/// The layers record in a compact form, one JSON string inside `{"Ok":..}`; this reads it back
/// without a server. Names are as recorded; values and bodies are bytes (text where the handler
/// sent text).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayerRecord {
    /// An HTTP response: its status, the headers the layer records, its body.
    Response {
        /// The status code.
        status: u16,
        /// The recorded headers, in order.
        headers: Vec<(String, Vec<u8>)>,
        /// The body.
        body: Vec<u8>,
    },
    /// A gRPC answer: its initial metadata, its body (the length-prefixed messages) and its
    /// trailers (with `grpc-status`), or none for a trailers-only answer (status in `headers`).
    Answer {
        /// The initial metadata, in order.
        headers: Vec<(String, Vec<u8>)>,
        /// The body.
        body: Vec<u8>,
        /// The trailing metadata, if the answer had any.
        trailers: Option<Vec<(String, Vec<u8>)>>,
    },
    /// The handler ran, but its response was over the layer's recording limit of `limit` bytes:
    /// a retry gets an error saying so, and nothing runs again.
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The handler ran, but its response failed while it was sent: a retry gets an error saying
    /// so, and nothing runs again.
    Failed {
        /// Why, as the server logged it.
        reason: String,
    },
}

impl LayerRecord {
    /// Reads `outcome` as a record in the layers' compact form; `None` if it is not one.
    ///
    /// `None` also for the layers' earlier form (a JSON object, `{"Ok":{"Response":..}}`), which
    /// reads as it is. An `#[idempotent]` function's outcome that is a string can look like a
    /// record (`{"Ok":"l20"}` reads as `TooLarge`): a tool should show the outcome itself beside
    /// what this reads.
    #[must_use]
    pub fn from_outcome(outcome: &[u8]) -> Option<Self> {
        #[derive(serde::Deserialize)]
        enum Outcome {
            Ok(String),
        }
        let Ok(Outcome::Ok(record)) = serde_json::from_slice(outcome) else { return None };
        let (&tag, rest) = record.as_bytes().split_first()?;
        match tag {
            b'h' => {
                let (status, rest) = rest.split_at_checked(3)?;
                let status = http::StatusCode::from_bytes(status).ok()?.as_u16();
                let (headers, rest) = compact::read_header_list(rest)?;
                Some(LayerRecord::Response { status, headers, body: compact::read_body(rest)?.to_vec() })
            }
            b'a' => {
                let (headers, rest) = compact::read_header_list(rest)?;
                let (trailers, rest) = compact::read_trailers(rest, compact::read_header_list)?;
                Some(LayerRecord::Answer { headers, body: compact::read_body(rest)?.to_vec(), trailers })
            }
            b'l' => Some(LayerRecord::TooLarge { limit: std::str::from_utf8(rest).ok()?.parse().ok()? }),
            b'f' => Some(LayerRecord::Failed { reason: std::str::from_utf8(rest).ok()?.to_owned() }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderName, HeaderValue, header};

    use super::*;
    use crate::http::recorded::Recorded;

    /// What a store keeps for an HTTP response the layer recorded.
    fn http_outcome(status: u16, headers: &[(HeaderName, &[u8])], body: &[u8]) -> Vec<u8> {
        let mut response = http::Response::new(());
        *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
        for (name, value) in headers {
            response.headers_mut().append(name.clone(), HeaderValue::from_bytes(value).unwrap());
        }
        let (parts, ()) = response.into_parts();
        let allowed = [header::CONTENT_TYPE, header::LOCATION];
        let recorded = Recorded::Fresh { parts, body: bytes::Bytes::copy_from_slice(body), allowed: &allowed };
        serde_json::to_vec(&Ok::<_, ()>(recorded)).unwrap()
    }

    #[test]
    fn http_layer_records_read_back_for_tools() {
        let headers = [(header::CONTENT_TYPE, &b"application/json"[..]), (header::LOCATION, b"/o/1")];
        let outcome = http_outcome(201, &headers, br#"{"id":"a\"b"}"#);
        assert!(outcome.starts_with(br#"{"Ok":"h201"#), "{}", String::from_utf8_lossy(&outcome));
        let expected = LayerRecord::Response {
            status: 201,
            headers: vec![("content-type".into(), b"application/json".to_vec()), ("location".into(), b"/o/1".to_vec())],
            body: br#"{"id":"a\"b"}"#.to_vec(),
        };
        assert_eq!(LayerRecord::from_outcome(&outcome), Some(expected));
        // A body that is not UTF-8 comes back as its bytes.
        let outcome = http_outcome(500, &[], b"\xff\x00bin");
        let read = LayerRecord::from_outcome(&outcome);
        assert_eq!(read, Some(LayerRecord::Response { status: 500, headers: vec![], body: b"\xff\x00bin".to_vec() }));
        let limit = serde_json::to_vec(&Ok::<_, ()>(Recorded::TooLarge { limit: 2048 })).unwrap();
        assert_eq!(LayerRecord::from_outcome(&limit), Some(LayerRecord::TooLarge { limit: 2048 }));
        let failed = serde_json::to_vec(&Ok::<_, ()>(Recorded::Failed { reason: "it broke".into() })).unwrap();
        assert_eq!(LayerRecord::from_outcome(&failed), Some(LayerRecord::Failed { reason: "it broke".into() }));
        // Not records of the compact form: other outcomes, the earlier form, damaged records.
        for other in [
            &br#"{"Ok":42}"#[..],
            br#"{"Err":"h201:x"}"#,
            br#"{"Ok":{"Response":{"status":201,"headers":[],"body":{"Text":""}}}}"#,
            br#"{"Ok":"hello"}"#,
            br#"{"Ok":"h2015:x-bin99:v:"}"#,
            br#"{"Ok":"x"}"#,
            b"\xffraw",
        ] {
            assert_eq!(LayerRecord::from_outcome(other), None, "{}", String::from_utf8_lossy(other));
        }
    }

    #[cfg(feature = "tonic")]
    #[test]
    fn grpc_layer_records_read_back_for_tools() {
        use crate::grpc::recorded_for_tests;

        let outcome = recorded_for_tests(
            &[("content-type", b"application/grpc"), ("x-seq", b"\xff7")],
            b"\0\0\0\0\x02\x08\x01",
            Some(&[("grpc-status", b"0")]),
        );
        let expected = LayerRecord::Answer {
            headers: vec![("content-type".into(), b"application/grpc".to_vec()), ("x-seq".into(), b"\xff7".to_vec())],
            body: b"\0\0\0\0\x02\x08\x01".to_vec(),
            trailers: Some(vec![("grpc-status".into(), b"0".to_vec())]),
        };
        assert_eq!(LayerRecord::from_outcome(&outcome), Some(expected));
        let trailers_only = recorded_for_tests(&[("grpc-status", b"5")], b"", None);
        let expected =
            LayerRecord::Answer { headers: vec![("grpc-status".into(), b"5".to_vec())], body: vec![], trailers: None };
        assert_eq!(LayerRecord::from_outcome(&trailers_only), Some(expected));
    }
}
