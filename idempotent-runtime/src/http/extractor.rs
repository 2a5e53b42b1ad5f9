//! The `Idempotency-Key` header as an axum extractor, for handlers under `#[idempotent]`.

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use http::request::Parts;

use super::key_header::{self, CallerKey};
use super::problem::Problem;
use super::spawn::RunsToCompletion;

/// The request's `Idempotency-Key`, validated: extract it in a handler and pass it, bound to its
/// caller, as the key of [`#[idempotent]`](macro@crate::idempotent).
///
/// A missing header is refused with a `400` [`Problem`] (`urn:idempotent:key-missing`); extract
/// `Option<IdempotencyKeyHeader>` to make it optional. A malformed one, repeated, empty, over
/// [`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES) bytes or holding control or non-ASCII characters, is
/// refused with `400` (`urn:idempotent:key-malformed`) either way. The value is read as a
/// structured-field string (`"..."`) or, for convenience, as a bare value without quotes (any
/// visible ASCII except `"`, `\`, `,` and `;`), so a UUID can be sent as it is.
///
/// Two choices are made explicit, because the silent ones run or leak twice:
///
/// - **Whose key it is.** The header is not a key by itself: [`for_caller`](Self::for_caller)
///   binds it to who sent it, so two users who send the same key never get each other's results;
///   [`shared_by_all_callers`](Self::shared_by_all_callers) says they may.
/// - **The handler runs to its end.** The extractor refuses with `500`
///   (`urn:idempotent:misconfigured`, the fix in the log) a request that is not served under
///   [`RunToCompletionLayer`](super::RunToCompletionLayer) (or
///   [`IdempotencyLayer`](super::IdempotencyLayer)): without it, hyper cancels a handler whose
///   client disconnects, after its side effect and before its result is recorded, and the retry
///   runs it again. The refusal comes before the handler starts, at the first request.
///
/// ```
/// use axum::extract::State;
/// use axum::http::HeaderMap;
/// use idempotent_runtime::http::{HttpError, IdempotencyKeyHeader, JsonResponse, RunToCompletionLayer};
/// use idempotent_runtime::{idempotent, MemoryStore};
///
/// #[derive(Clone)]
/// struct AppState { store: MemoryStore }
///
/// fn user(headers: &HeaderMap) -> &str {
///     headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("anonymous")
/// }
///
/// #[idempotent(key = key.for_caller(user(&headers)), store = state.store)]
/// async fn create_order(State(state): State<AppState>, key: IdempotencyKeyHeader, headers: HeaderMap) -> Result<JsonResponse<u64>, HttpError> {
///     Ok(JsonResponse::created(42))
/// }
///
/// let app: axum::Router = axum::Router::new()
///     .route("/orders", axum::routing::post(create_order))
///     .route_layer(RunToCompletionLayer)
///     .with_state(AppState { store: MemoryStore::new() });
/// ```
///
/// The header alone does not compile as a key; say whose it is:
///
/// ```compile_fail
/// # use axum::extract::State;
/// # use idempotent_runtime::http::{HttpError, IdempotencyKeyHeader, JsonResponse};
/// # use idempotent_runtime::{idempotent, MemoryStore};
/// # #[derive(Clone)]
/// # struct AppState { store: MemoryStore }
/// #[idempotent(key = key, store = state.store)]
/// async fn create_order(State(state): State<AppState>, key: IdempotencyKeyHeader) -> Result<JsonResponse<u64>, HttpError> {
///     Ok(JsonResponse::created(42))
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKeyHeader(pub String);

impl IdempotencyKeyHeader {
    /// The key's text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// This key bound to the caller who sent it (a user or API-client id), so that two callers who
    /// send the same key never see each other's results: `key = key.for_caller(&user.id)`.
    #[must_use]
    pub fn for_caller<'a>(&'a self, caller: &'a str) -> CallerKey<'a> {
        CallerKey::new(caller, &self.0)
    }

    /// This key as it is, shared by all callers: whoever sends it gets the result recorded under
    /// it, by whichever caller ran it first (`key = key.shared_by_all_callers()`). For services
    /// with one caller or callers that trust each other; otherwise use
    /// [`for_caller`](Self::for_caller).
    #[must_use]
    pub fn shared_by_all_callers(&self) -> &str {
        &self.0
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKeyHeader {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        RunsToCompletion::check(parts)?;
        match key_header::from_headers(&parts.headers) {
            Ok(Some(key)) => Ok(IdempotencyKeyHeader(key)),
            Ok(None) => Err(Problem::missing_key()),
            Err(error) => Err(Problem::from_key_header(&error)),
        }
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKeyHeader {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        RunsToCompletion::check(parts)?;
        key_header::from_headers(&parts.headers)
            .map(|key| key.map(IdempotencyKeyHeader))
            .map_err(|error| Problem::from_key_header(&error))
    }
}
