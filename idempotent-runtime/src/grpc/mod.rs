//! Idempotent unary RPCs for tonic servers and clients (feature `tonic`).
//!
//! gRPC clients retry by themselves: a service config's `retryPolicy` resends a call that failed
//! with a retryable status, and a client whose deadline passed or whose connection dropped sends
//! it again. For a call that charges a card, each resend is a second charge unless the server
//! knows it is the same call. [`GrpcIdempotencyLayer`] makes the server know: it takes each call's
//! key from its `idempotency-key` metadata or from a field of its request message (the
//! `request_id` of Google's AIP-155, the `idempotency_key` of AEP-155), runs the handler once per
//! key through the [`Call`](crate::Call) protocol on any [`Store`](crate::Store), records the
//! response (initial metadata, the message, the status and trailing metadata) and replays it to
//! every later call with the key, as AIP-155 asks ("the server should return the response for the
//! previously successful request"), with `idempotent-replayed: true` in its initial metadata. A
//! replayed error also carries `grpc-retry-pushback-ms: -1` beside its status: a negative
//! pushback tells a client's `retryPolicy` not to retry (gRFC A6), since another attempt would get
//! the same answer.
//!
//! # Statuses
//!
//! | case | status |
//! |---|---|
//! | no key on a method that requires one | `INVALID_ARGUMENT` |
//! | key malformed (empty, control or non-ASCII characters, repeated) or over 255 bytes | `INVALID_ARGUMENT` |
//! | request over [`max_request_bytes`](GrpcIdempotencyLayer::max_request_bytes) | `RESOURCE_EXHAUSTED` |
//! | a covered method's request holds more than one message (a client-streaming RPC) | `UNIMPLEMENTED` |
//! | a call with the same key is still running | `ABORTED`, with `grpc-retry-pushback-ms` (the running claim's remaining lease) |
//! | the key was used with another method or message | `FAILED_PRECONDITION` |
//! | the store is unreachable before the claim | `UNAVAILABLE` |
//! | the handler answered (any status) | that answer, recorded and replayed |
//! | the handler answered with [`not_processed`] | that answer, not recorded: the key is released |
//! | the response was over [`max_response_bytes`](GrpcIdempotencyLayer::max_response_bytes) or failed mid-way | the answer to this call; retries get `DATA_LOSS` |
//!
//! The codes follow the definitions of `google.rpc.Code`. `ABORTED` is the code for "a
//! concurrency conflict, retry": a client whose `retryPolicy` lists it waits the pushback and gets
//! the replay. A reused key with another request is `FAILED_PRECONDITION`, not `INVALID_ARGUMENT`:
//! the request is valid by itself and refused only because of the state the key is in (the code's
//! definition: "the system is not in a state required for the operation's execution"); AIP-155
//! itself names no code for it. Neither is retried by the usual policies, and neither ran anything.
//!
//! # What is recorded
//!
//! Whatever the handler answered, error statuses included: a handler that fails with
//! `UNAVAILABLE` after it charged the card (the receipt service timed out) must not run again when
//! the client's `retryPolicy`, which retries `UNAVAILABLE`, resends the call. A handler that knows
//! it did nothing says so with [`not_processed`] (the key is released, the next call runs);
//! [`record_code`](GrpcIdempotencyLayer::record_code) sets a rule by code for a service whose
//! handlers all follow it. The layer's own refusals above never are: nothing ran.
//!
//! Each call runs to its end: a client that cancels, a deadline that passes (tonic's `timeout`
//! drops the call's future) or a connection that drops moves a handler that has started to a Tokio
//! task of its own instead of stopping it: it finishes, its answer is recorded, and the client's next attempt gets it.
//!
//! # Streaming RPCs
//!
//! The layer covers the unary methods it is given by path, and nothing else: calls to other
//! methods pass through untouched. It buffers a call's request whole before the handler sees it,
//! which a bidirectional or client-streaming RPC cannot survive, so do not list those; a listed
//! method whose request turns out to hold several messages is refused with `UNIMPLEMENTED` before
//! the handler runs. Server-streaming methods are not tested under the layer: do not list them
//! either.
//!
//! # Clients
//!
//! [`GrpcRetryLayer`] goes under a generated tonic client and retries the unary calls it covers
//! with one `idempotency-key` for all their attempts: on no answer, `UNAVAILABLE` and `ABORTED`,
//! after the server's pushback, and never past a replayed answer or a negative pushback. A call
//! without a key gets one: inside an idempotent body, the key derived from the body's key and the
//! call's position (see [`derived_key`](crate::derived_key)), so a body that runs again after a
//! crash sends the same key and the server replays; elsewhere a fresh UUID.
//! [`IdempotencyKeys`] is a tonic interceptor that gives each call such a key and does nothing
//! more.

mod client;
mod frames;
mod layer;
mod recorded;
mod retry;
mod status;

#[cfg(test)]
pub(crate) use recorded::recorded_for_tests;

pub use crate::retry::{Attempts, RetryPolicy, Stopped};
pub use client::IdempotencyKeys;
pub use layer::{DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_RESPONSE_BYTES, GrpcIdempotencyLayer, GrpcIdempotencyService};
pub use retry::{DEFAULT_RETRY_CODES, GrpcRetry, GrpcRetryLayer};
pub use status::{NOT_PROCESSED, not_processed};
