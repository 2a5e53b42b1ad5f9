//! What the two server layers share, HTTP's [`IdempotencyLayer`](crate::http::IdempotencyLayer)
//! and gRPC's `GrpcIdempotencyLayer`: whose keys they hold, the settings of each request's
//! [`Call`], the builder methods that set them, and the ways a request's body can end unrecorded.

use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;

use crate::http::CallerKey;
use crate::{Call, DEFAULT_LEASE, DEFAULT_RETENTION, Error, Fingerprint, Scope};

/// Reads who sent a request.
pub(crate) type CallerFn = dyn Fn(&Parts) -> String + Send + Sync;

/// Whose keys a layer holds.
#[derive(Clone)]
pub(crate) enum Callers {
    /// Not said yet: the layer refuses to be applied.
    Unchosen,
    /// Every caller's: `keys_shared_by_all_callers`.
    Shared,
    /// Each caller's own: `caller`.
    Each(Arc<CallerFn>),
}

impl std::fmt::Debug for Callers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Callers::Unchosen => "unchosen",
            Callers::Shared => "shared by all callers",
            Callers::Each(_) => "each caller's own",
        })
    }
}

/// The settings a layer makes each request's call with.
pub(crate) struct Edge<St> {
    pub(crate) store: Arc<St>,
    /// Checked when set (`Edge::new`, the layers' `scope`).
    pub(crate) scope: String,
    pub(crate) required: bool,
    pub(crate) callers: Callers,
    pub(crate) max_request_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) wait: Option<Duration>,
}

impl<St> Clone for Edge<St> {
    fn clone(&self) -> Self {
        Edge {
            store: Arc::clone(&self.store),
            scope: self.scope.clone(),
            required: self.required,
            callers: self.callers.clone(),
            max_request_bytes: self.max_request_bytes,
            max_response_bytes: self.max_response_bytes,
            lease: self.lease,
            retention: self.retention,
            wait: self.wait,
        }
    }
}

impl<St> std::fmt::Debug for Edge<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Edge { scope, callers, lease, retention, wait, .. } = self;
        write!(f, "scope {scope:?}, keys {callers:?}, lease {lease:?}, retention {retention:?}, wait {wait:?}")
    }
}

impl<St> Edge<St> {
    /// Keys required, whose keys not chosen yet, the default lease and retention.
    pub(crate) fn new(store: Arc<St>, scope: Scope<'_>, max_request_bytes: usize, max_response_bytes: usize) -> Self {
        Edge {
            store,
            scope: scope.as_str().to_owned(),
            required: true,
            callers: Callers::Unchosen,
            max_request_bytes,
            max_response_bytes,
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            wait: None,
        }
    }

    /// The call of the request with `key` (bound to its caller, if the layer says so) and
    /// `fingerprint`, with the layer's lease, retention and wait.
    pub(crate) fn call(&self, parts: &Parts, key: &str, fingerprint: Fingerprint) -> Call {
        let scope = Scope::checked_before(&self.scope);
        let call = match &self.callers {
            Callers::Each(identity) => Call::in_scope(scope, &CallerKey::new(&identity(parts), key)),
            Callers::Shared | Callers::Unchosen => Call::in_scope(scope, key),
        };
        let call = call.with_fingerprint(Ok(fingerprint)).lease(self.lease).retention(self.retention);
        match self.wait {
            Some(wait) => call.wait(wait),
            None => call,
        }
    }

    /// # Panics
    ///
    /// If the layer (named `layer`) has not said whose keys it holds: a layer that silently
    /// shared every key across callers would hand one caller's answers to another.
    pub(crate) fn check_callers(&self, layer: &str) {
        assert!(
            !matches!(self.callers, Callers::Unchosen),
            "{layer} (scope {:?}) does not say whose keys it holds: two callers who send the same key and request \
             would get one recorded answer, the first caller's. Call `.caller(|parts| ...)` to bind each key to who \
             sent it (a user or API-client id, for example from the extensions your authentication layer sets), or \
             `.keys_shared_by_all_callers()` if every caller may get every other caller's answers (one caller, or \
             callers that trust each other)",
            self.scope
        );
    }
}

/// Why the body a layer gives to [`Call`] did not produce a recordable answer (a response `R`);
/// every case releases the key.
pub(crate) enum Failure<E, R> {
    Idempotency(Error),
    Inner(E),
    Panicked,
    NotRecorded(R),
}

impl<E, R> From<Error> for Failure<E, R> {
    fn from(error: Error) -> Self {
        Failure::Idempotency(error)
    }
}

/// The builder methods of the settings in [`Edge`], for a layer `{ config: Arc<Config<St>> }`
/// whose `Config` has an `edge` field; with them the private `config_mut` (the configuration, made
/// unique on write: a service made earlier keeps its copy). The strings fill the docs: the layer's name, what a
/// request without a key gets, what a duplicate gets while the first runs, and what the retries
/// of a request whose answer was too large to record get.
macro_rules! edge_setters {
    ($layer:literal, missing: $missing:literal, running: $running:literal, too_large: $too_large:literal) => {
        fn config_mut(&mut self) -> &mut Config<St> {
            std::sync::Arc::make_mut(&mut self.config)
        }

        fn edge_mut(&mut self) -> &mut $crate::edge::Edge<St> {
            &mut self.config_mut().edge
        }

        /// The namespace of this layer's keys in the store: give layers that share a store
        /// different scopes if clients may use the same key on both.
        ///
        /// # Panics
        ///
        /// If `scope` is empty, over 255 bytes, or holds `:` or a control character: a bug in the
        /// program, caught when the layer is built rather than on the first request.
        #[must_use]
        pub fn scope(mut self, scope: impl Into<String>) -> Self {
            let scope = scope.into();
            if let Err(e) = $crate::Scope::new(&scope) {
                panic!("{}::scope: {e}", $layer);
            }
            self.edge_mut().scope = scope;
            self
        }

        $crate::setters::setters! { in edge_mut:
            #[doc = concat!("Lets requests without a key through, without idempotency (by default they get ", $missing, "). A malformed key is still refused.")]
            pub fn optional() { required = false }
            /// Scopes keys to the caller: `identity` reads who sent the request (a user id set by an
            /// authentication layer in the extensions, an API-key id from a header or metadata) and the
            /// key is bound to it (see [`CallerKey`](crate::http::CallerKey)), so two callers that send
            /// the same key never see each other's answers. Callers mapped to the same text share their
            /// keys; map anonymous callers to something unique or refuse them before this layer.
            /// Replaces [`keys_shared_by_all_callers`](Self::keys_shared_by_all_callers) if both are called.
            pub fn caller(identity: impl Fn(&http::request::Parts) -> String + Send + Sync + 'static) {
                callers = $crate::edge::Callers::Each(std::sync::Arc::new(identity))
            }
            /// Says that keys are shared by all callers: whoever sends a key that another caller used
            /// for the same request gets that caller's recorded answer. Right for a service with one
            /// caller, or whose callers trust each other (an internal job queue, a single-tenant
            /// backend); wrong for a public API, where [`caller`](Self::caller) keeps each user's
            /// answers to that user. Replaces `caller` if both are called.
            pub fn keys_shared_by_all_callers() { callers = $crate::edge::Callers::Shared }
            /// The largest request body buffered (default [`DEFAULT_MAX_REQUEST_BYTES`]); a larger
            /// one is refused before anything runs.
            pub fn max_request_bytes(max_request_bytes: usize);
            #[doc = concat!("The largest response body recorded (default [`DEFAULT_MAX_RESPONSE_BYTES`]). A larger one is never truncated: the request that ran gets its whole answer, and every retry with its key gets ", $too_large, " saying the request was processed and its answer cannot be replayed; it does not run again. The store's own record limit applies too.")]
            pub fn max_response_bytes(max_response_bytes: usize);
            /// How long a request holds its key if the process dies (default
            /// [`DEFAULT_LEASE`](crate::DEFAULT_LEASE)); make it longer than the handler can take.
            pub fn lease(lease: std::time::Duration);
            /// How long a recorded answer is replayed (default [`DEFAULT_RETENTION`](crate::DEFAULT_RETENTION)).
            pub fn retention(retention: std::time::Duration);
            #[doc = concat!("Makes a request that arrives while the first with its key runs wait up to `wait` for its answer, instead of getting ", $running, " at once.")]
            pub fn wait(wait: std::time::Duration) { wait = Some(wait) }
        }
    };
}
pub(crate) use edge_setters;

/// The service a layer wraps around the routes it covers: the inner service and the layer's
/// shared `Config<St>` (a type of the module that invokes this), cloned with the service.
macro_rules! layer_service {
    ($(#[$attr:meta])* $name:ident) => {
        $(#[$attr])*
        pub struct $name<S, St> {
            inner: S,
            config: std::sync::Arc<Config<St>>,
        }

        impl<S: Clone, St> Clone for $name<S, St> {
            fn clone(&self) -> Self {
                $name { inner: self.inner.clone(), config: std::sync::Arc::clone(&self.config) }
            }
        }

        impl<S: std::fmt::Debug, St> std::fmt::Debug for $name<S, St> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name)).field("inner", &self.inner).finish_non_exhaustive()
            }
        }
    };
}
pub(crate) use layer_service;
