//! The header names shared by the server side (`http`) and the client side (`client`).

/// The request header that carries the key: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: http::HeaderName = http::HeaderName::from_static("idempotency-key");

/// The response header that marks a replayed response: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: http::HeaderName = http::HeaderName::from_static("idempotent-replayed");

/// Whether an answer's headers (or gRPC initial metadata) mark it replayed: `Idempotent-Replayed`
/// is `true`, in any case.
#[cfg(any(feature = "reqwest", feature = "tonic"))]
pub(crate) fn is_replayed(headers: &http::HeaderMap) -> bool {
    headers.get(&IDEMPOTENT_REPLAYED).is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"true"))
}
