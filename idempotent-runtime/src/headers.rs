//! The header names shared by the server side (`http`) and the client side (`client`).

/// The request header that carries the key: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: http::HeaderName = http::HeaderName::from_static("idempotency-key");

/// The response header that marks a replayed response: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: http::HeaderName = http::HeaderName::from_static("idempotent-replayed");
