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
//!   replays it [marked](#replays) `Idempotent-Replayed: true`.
//! - [`#[idempotent]`](macro@crate::idempotent) on a handler, with the key from the
//!   [`IdempotencyKeyHeader`] extractor: the handler's result is recorded as a value (return a
//!   [`JsonResponse`]), the fingerprint is whatever the attribute names, and the handler's error type
//!   turns idempotency errors into responses with [`HttpError`] or [`problem_response`].
//!
//! # Replays
//!
//! A replayed response carries `Idempotent-Replayed: true` ([`IDEMPOTENT_REPLAYED`]), from the
//! layer and from a replayed [`JsonResponse`] or [`Replayable`](crate::Replayable) alike. A
//! replayed `409` or `5xx` also carries `Stripe-Should-Retry: false`: Stripe's Python SDK
//! retries those statuses unless that header says not to, and another attempt with the key gets
//! the same answer. The first response, from the request that ran, carries neither.
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
//! A response to a request with an `Idempotency-Key` carries the header back, as the client sent it
//! (as Stripe's API does), so a client can log which key an answer belongs to: on every method the
//! layer covers, and on every route under [`RunToCompletionLayer`].
//!
//! # The header value
//!
//! The draft makes the value a structured-field string (`Idempotency-Key: "8e03978e-..."`). Most
//! clients send it unquoted, so both are accepted: a quoted string (with `\"` and `\\` escapes) or a
//! bare run of visible ASCII without `"`, `\`, `,` and `;`. Keys are at most
//! [`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES) bytes.
//!
//! # What is recorded
//!
//! Whatever the handler answered. Under the layer, that is every response the handler produced,
//! `5xx` included: a `500` may come after the handler acted (a charge made, then a timeout on the
//! receipt), and a client retrying with the same key, as
//! [`IdempotentRetry`](crate::client::IdempotentRetry) does, must get that `500` back rather than a
//! second charge. A handler that knows it did nothing marks its response [`NotProcessed`]; the key
//! is then released and a retry runs. The layer's own refusals (a bad key, a body too large, `409`,
//! `422`, the store down before the claim) are never recorded. Once the handler has returned, the
//! key is kept whatever its body does: a body that fails mid-way is recorded as a failure, and a
//! body over the recording limit goes whole to its own request while retries get `500`
//! (`urn:idempotent:response-too-large`). See [`IdempotencyLayer`].
//!
//! Under the attribute, what is recorded is the handler's `Ok` value, whatever status it carries
//! (`JsonResponse::with_status(StatusCode::BAD_GATEWAY, ..)` is recorded and replayed like a
//! `201`). An `Err` is the attribute's "nothing was done": it releases the key, so a retry runs
//! the handler again, unless `record_err` records it. So answer a failure that comes *after* the
//! effect with an `Ok` response (or a recorded error), and use `Err` for refusals before it. A
//! recorded `Err` replays through its own `IntoResponse`, which does not know it is a replay, so
//! it lacks `Idempotent-Replayed`; a `JsonResponse` has it.
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
//! The layer runs each request to its end (on a task of its own once its client has disconnected),
//! so a client that disconnects never cancels a started handler. Routes whose handlers use the
//! attribute need [`RunToCompletionLayer`] for the same, and the [`IdempotencyKeyHeader`] extractor refuses (`500`,
//! `urn:idempotent:misconfigured`, the fix in the log) requests served without it, before the
//! handler starts. Under the attribute, a replayed [`JsonResponse`] (or
//! [`Replayable`](crate::Replayable) response) carries `Idempotent-Replayed: true`, as the layer's
//! replays do.
//!
//! # Callers
//!
//! A key is only unique per client, so the server must say whose keys they are, and both ways in
//! make it say so: [`IdempotencyLayer::caller`] or [`IdempotencyLayer::keys_shared_by_all_callers`]
//! for the layer (without either, applying it panics at startup), and
//! `key = key.for_caller(&user_id)` ([`IdempotencyKeyHeader::for_caller`]) or
//! `key = key.shared_by_all_callers()` for the attribute (the header alone is not a key). Bound to
//! the caller, two users sending the same key never see each other's responses.

mod canonical_json;
mod chunks;
pub(crate) mod compact;
mod extractor;
mod inspect;
mod json;
pub(crate) mod key_header;
mod layer;
mod not_processed;
mod problem;
mod recorded;
mod replayed;
mod spawn;

pub use extractor::IdempotencyKeyHeader;
pub use inspect::LayerRecord;
pub use json::JsonResponse;
pub use key_header::CallerKey;
pub use layer::{
    DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_METHODS, IdempotencyFuture, IdempotencyLayer,
    IdempotencyService,
};
pub use not_processed::NotProcessed;
pub use problem::{HttpError, MAX_RETRY_AFTER_SECS, Problem, RETRY_AFTER_SECS, problem_response, retry_after_secs};
pub use recorded::DEFAULT_RECORDED_HEADERS;
pub use spawn::{RunToCompletion, RunToCompletionLayer};

pub use crate::headers::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};

// What the gRPC layer shares with this one.
#[cfg(all(test, feature = "tonic"))]
pub(crate) use chunks::tests as chunk_cases;
#[cfg(feature = "tonic")]
pub(crate) use {chunks::Chunks, key_header::KeyHeaderError, recorded::Data, spawn::run_to_completion};
