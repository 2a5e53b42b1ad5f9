//! A gRPC request body as the layer reads it: length-prefixed messages, buffered whole.

use bytes::Bytes;
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use tonic::Status;
use tonic::body::Body;

/// The prefix of each message on the wire: a compressed flag and a big-endian length.
const PREFIX: usize = 5;

/// One message of a request, as sent.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Message<'a> {
    /// The message was compressed with the call's `grpc-encoding`.
    pub(crate) compressed: bool,
    /// The encoded message (compressed if `compressed`).
    pub(crate) payload: &'a [u8],
}

/// Reads the whole request body, up to `limit` bytes: `RESOURCE_EXHAUSTED` past it, the
/// error's own text if the body fails.
pub(crate) async fn read_request(body: Body, limit: usize) -> Result<Bytes, Status> {
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => Err(Status::resource_exhausted(format!(
            "the request is over the idempotency layer's limit of {limit} bytes; raise `max_request_bytes` or \
             send a smaller message"
        ))),
        Err(error) => Err(Status::cancelled(format!("the request body could not be read: {error}"))),
    }
}

/// The one message of a unary call's request body. Several messages (a client-streaming call) or
/// none are refused before anything runs; `path` names the method in the refusal.
pub(crate) fn single_message<'a>(body: &'a [u8], path: &str) -> Result<Message<'a>, Status> {
    let mut rest = body;
    let mut first = None;
    let mut count = 0usize;
    while !rest.is_empty() {
        let Some((message, after)) = split_message(rest) else {
            return Err(Status::invalid_argument(format!(
                "the request of {path} ends inside a message: its last length prefix promises more bytes than were sent"
            )));
        };
        count += 1;
        first.get_or_insert(message);
        rest = after;
    }
    match (first, count) {
        (Some(message), 1) => Ok(message),
        (None, _) => Err(Status::invalid_argument(format!("the request of {path} holds no message"))),
        (Some(_), count) => Err(Status::unimplemented(format!(
            "{path} is covered by the idempotency layer, which handles unary RPCs only, but its request holds {count} \
             messages (a client-streaming RPC); remove the method from the layer's list"
        ))),
    }
}

fn split_message(bytes: &[u8]) -> Option<(Message<'_>, &[u8])> {
    let prefix: &[u8; PREFIX] = bytes.get(..PREFIX)?.try_into().ok()?;
    let len = usize::try_from(u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]])).ok()?;
    let payload = bytes.get(PREFIX..PREFIX.checked_add(len)?)?;
    Some((Message { compressed: prefix[0] != 0, payload }, &bytes[PREFIX + len..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(flag: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![flag];
        out.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn grpc_one_message_is_read_and_others_are_refused() {
        let one = framed(0, b"abc");
        assert_eq!(single_message(&one, "/p.S/M").unwrap(), Message { compressed: false, payload: b"abc" });
        let compressed = framed(1, b"");
        assert_eq!(single_message(&compressed, "/p.S/M").unwrap(), Message { compressed: true, payload: b"" });

        let two = [framed(0, b"a"), framed(0, b"b")].concat();
        let refused = single_message(&two, "/p.S/M").unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unimplemented);
        assert!(refused.message().contains("2 messages"), "{}", refused.message());

        assert_eq!(single_message(b"", "/p.S/M").unwrap_err().code(), tonic::Code::InvalidArgument);
        for cut in 1..one.len() {
            let error = single_message(&one[..cut], "/p.S/M").unwrap_err();
            assert_eq!(error.code(), tonic::Code::InvalidArgument, "cut at {cut}");
        }
    }
}
