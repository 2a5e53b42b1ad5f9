//! HTTP `Idempotency-Key` support for axum (feature `axum`).
//!
//! Clients make a non-idempotent request (a `POST` that charges a card) safe to retry by sending a
//! unique `Idempotency-Key` header with it, as in the IETF draft "The Idempotency-Key HTTP Header
//! Field": the server runs the request once and answers every retry with the same key with the
//! recorded response. There are two ways in, sharing one implementation (the [`Call`](crate::Call)
//! protocol) and working with every [`Store`](crate::Store):
//!
//! - [`IdempotencyLayer`]: a tower layer for whole routes. It fingerprints the method, path, query
//!   and body, records the response's status, [headers](DEFAULT_RECORDED_HEADERS) and body, and
//!   replays it with `Idempotent-Replayed: true`.
//! - [`#[idempotent]`](macro@crate::idempotent) on a handler, with the key from the
//!   [`IdempotencyKeyHeader`] extractor: the handler's result is recorded as a value (return a
//!   [`JsonResponse`]), the fingerprint is whatever the attribute names, and the handler's error type
//!   turns idempotency errors into responses with [`HttpError`] or [`problem_response`].
//!
//! # Statuses
//!
//! Both follow the draft, with `application/problem+json` bodies ([`Problem`]):
//!
//! | case | status |
//! |---|---|
//! | key missing on a route that requires one | 400 |
//! | key malformed (empty, control or non-ASCII characters, repeated header) or over 255 bytes | 400 |
//! | a request with the same key is still running | 409 with `Retry-After` (the running claim's remaining lease, rounded up to whole seconds, at least 1) |
//! | the key was used with a different request | 422 |
//! | the store is unreachable | 503 with `Retry-After` |
//!
//! # The header value
//!
//! The draft makes the value a structured-field string (`Idempotency-Key: "8e03978e-..."`). Most
//! clients send it unquoted, so both are accepted: a quoted string (with `\"` and `\\` escapes) or a
//! bare run of visible ASCII without `"`, `\`, `,` and `;`. Keys are at most
//! [`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES) bytes.
//!
//! # Which responses are recorded
//!
//! By default every response below 500 is recorded, except those that mean "not processed":
//! `401` and `403` (refused before processing: a client that fixes its credentials retries with the
//! same key), `408`, `425` and `429` (come back later). A `5xx` means the server failed to finish
//! the request, so the key is released and a retry runs it again; recording it would make a passing
//! outage permanent for that key. See [`records_by_default`]; the layer's
//! [`record_status`](IdempotencyLayer::record_status) changes this; under the attribute, an `Err`
//! releases the key unless `record_err` says otherwise.
//!
//! # Methods, paths and bodies
//!
//! The layer applies to `POST` and `PATCH` ([`DEFAULT_METHODS`], configurable with
//! [`IdempotencyLayer::methods`]); other methods pass through untouched. Its fingerprint covers the
//! path as the client sent it, also under a nested router, and, with
//! [`IdempotencyLayer::json_fingerprint`], a JSON body by content rather than bytes (whitespace,
//! key order and string escapes aside; numbers as written).
//!
//! # Disconnects and replays under the attribute
//!
//! The layer runs each request on its own task, so a client that disconnects never cancels a
//! started handler; wrap routes whose handlers use the attribute in [`RunToCompletionLayer`] for the
//! same. Under the attribute, a replayed [`JsonResponse`] (or [`Replayable`](crate::Replayable)
//! response) carries `Idempotent-Replayed: true`, as the layer's replays do.
//!
//! # Callers
//!
//! A key is only unique per client, so bind it to the caller:
//! [`IdempotencyLayer::caller`] for the layer, `key = key.for_caller(&user_id)`
//! ([`IdempotencyKeyHeader::for_caller`]) for the attribute. Two users sending the same key then
//! never see each other's responses.

mod canonical_json;
mod extractor;
mod json;
mod key_header;
mod layer;
mod problem;
mod recorded;
mod spawn;

pub use extractor::IdempotencyKeyHeader;
pub use json::JsonResponse;
pub use key_header::CallerKey;
pub use layer::{
    DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_METHODS, IdempotencyLayer, IdempotencyService,
    records_by_default,
};
pub use problem::{HttpError, MAX_RETRY_AFTER_SECS, Problem, RETRY_AFTER_SECS, problem_response, retry_after_secs};
pub use recorded::DEFAULT_RECORDED_HEADERS;
pub use spawn::{RunToCompletion, RunToCompletionLayer};

pub use crate::headers::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
