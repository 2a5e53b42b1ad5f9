//! What a running body knows about its call: who it is (scope and key), how many outbound
//! requests and steps it has made so far, and where its steps are recorded.
//!
//! [`Call::run`](crate::Call::run) scopes a [`CallContext`] (a `tokio::task_local!`) around the
//! body's future, so code the body awaits finds it; a task the body *spawns* does not (task-locals
//! do not cross `tokio::spawn`). The outbound middleware derives its keys from it and
//! [`step`](crate::step) records through it.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use sha2::{Digest as _, Sha256};

use crate::step::JobQueue;
use crate::{Key, KeyError};

tokio::task_local! {
    /// The innermost call (or step) whose body is being polled; `None` inside [`without_derived_keys`].
    static CURRENT: Option<Arc<CallContext>>;
}

/// The identity of one run of a body, and its counters. Made once per run of a body (one `Arc`
/// and one copy of the key); a step's body gets a context of its own.
pub(crate) struct CallContext {
    /// The call's key or, for a step's body, the step's key (in the call's scope).
    key: Key,
    /// What the call's request was aimed at, its fields length-prefixed as [`set_origin`] got them
    /// (empty if it never was; a step's body has its call's): hashed into every key derived in
    /// the run, and only then. A recycled context keeps the buffer's capacity.
    origin: Mutex<Vec<u8>>,
    /// Outbound requests given a derived key so far in this run, counted per method and path.
    outbound: Mutex<Vec<(String, String, u64)>>,
    /// Steps started so far in this run.
    steps: AtomicU64,
    /// The call's context, for a step's: the one whose queue the call serves.
    root: Option<Arc<CallContext>>,
    /// Where the body's steps wait for the call to serve them (the root's only).
    queue: JobQueue,
}

thread_local! {
    /// A finished call's context, kept for the next call on this thread: its allocation is
    /// reused ([`CallContext::recycle`]).
    static SPARE: std::cell::Cell<Option<Arc<CallContext>>> = const { std::cell::Cell::new(None) };
}

impl CallContext {
    /// The context of a run of the body of the call on `key`: this thread's spare one, made
    /// new, or a new one.
    pub(crate) fn root(key: &Key) -> Arc<Self> {
        if let Some(mut spare) = SPARE.try_with(std::cell::Cell::take).ok().flatten()
            && let Some(context) = Arc::get_mut(&mut spare)
        {
            // `recycle` kept it only as a root with an empty queue.
            context.key.clone_from(key);
            context.origin.get_mut().unwrap_or_else(PoisonError::into_inner).clear();
            context.outbound.get_mut().unwrap_or_else(PoisonError::into_inner).clear();
            *context.steps.get_mut() = 0;
            return spare;
        }
        Arc::new(CallContext {
            key: key.clone(),
            origin: Mutex::default(),
            outbound: Mutex::default(),
            steps: AtomicU64::new(0),
            root: None,
            queue: JobQueue::default(),
        })
    }

    /// The context of this run's next step named `name`, whose key (`step-` and 64 hex digits,
    /// in the call's scope) is the step's identity: its position and name. Its body has its own
    /// counters, so outbound requests inside a step keep their keys whether or not the steps
    /// before it were replayed.
    pub(crate) fn next_step(self: &Arc<Self>, name: &str) -> Result<Arc<Self>, KeyError> {
        let position = self.steps.fetch_add(1, Ordering::Relaxed);
        let identity = digest(&[b"step", self.key.key().as_bytes(), &position.to_be_bytes(), name.as_bytes()]);
        Ok(Arc::new(CallContext {
            key: Key::new(self.key.scope(), &format!("step-{identity}"))?,
            origin: Mutex::new(self.origin.lock().unwrap_or_else(PoisonError::into_inner).clone()),
            outbound: Mutex::default(),
            steps: AtomicU64::new(0),
            root: Some(Arc::clone(self.root.as_ref().unwrap_or(self))),
            queue: JobQueue::default(),
        }))
    }

    /// Keeps a finished call's context as this thread's spare, if nothing else holds it (the
    /// body's task-local and steps are gone, nothing leaked it) and its queue is empty.
    pub(crate) fn recycle(context: Option<Arc<Self>>) {
        if let Some(mut context) = context
            && let Some(inner) = Arc::get_mut(&mut context)
            && inner.root.is_none()
            && inner.queue.reset()
        {
            let _ = SPARE.try_with(|spare| spare.set(Some(context)));
        }
    }

    /// The call's key, or the step's.
    pub(crate) fn key(&self) -> &Key {
        &self.key
    }

    /// Whether this run has started a step: until it has, no step job was queued (a nested
    /// step's job needs an outer step first).
    pub(crate) fn had_steps(&self) -> bool {
        self.steps.load(Ordering::Relaxed) > 0
    }

    /// The queue the call serves.
    pub(crate) fn queue(&self) -> &JobQueue {
        self.root.as_ref().map_or(&self.queue, |root| &root.queue)
    }

    fn next_outbound_key(&self, method: &str, path: &str) -> String {
        // Counted per method and path: requests the body makes concurrently (a `join!`) to
        // different routes may leave in another order on the next run, and keep their keys.
        let position = {
            let mut counts = self.outbound.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some((_, _, count)) = counts.iter_mut().find(|(m, p, _)| m == method && p == path) {
                *count += 1;
                *count - 1
            } else {
                counts.push((method.to_owned(), path.to_owned(), 1));
                0
            }
        };
        let (scope, key, position) = (self.key.scope().as_bytes(), self.key.key().as_bytes(), position.to_be_bytes());
        let (method, path) = (method.as_bytes(), path.as_bytes());
        let origin = self.origin.lock().unwrap_or_else(PoisonError::into_inner);
        if origin.is_empty() {
            // A call given no origin (the attribute, `Call::run`).
            digest(&[b"outbound", scope, key, &position, method, path])
        } else {
            let origin: [u8; 32] = Sha256::digest(&*origin).into();
            digest(&[b"outbound", scope, key, &position, method, path, &origin])
        }
    }
}

/// SHA-256 of `fields`, each preceded by its length (so no two field lists collide), in hex.
fn digest(fields: &[&[u8]]) -> String {
    let mut hasher = Sha256::new();
    for field in fields {
        hasher.update((field.len() as u64).to_be_bytes());
        hasher.update(field);
    }
    let bytes: [u8; 32] = hasher.finalize().into();
    let hex: [u8; 64] = crate::hex::encode(&bytes);
    String::from_utf8_lossy(&hex).into_owned()
}

/// Tells the current call what its request was aimed at (`fields`: the HTTP layer gives the method
/// and the path as the client sent it, the gRPC layer the method's path), before its body runs.
///
/// Keys derived in the run then depend on it too. A layer's default scope is the same in every
/// service that uses it, and a client chooses the key: one user who sends one key to two services
/// would otherwise make both derive the same downstream keys, and a downstream service whose keys
/// its callers share would replay the first one's answer to the second, which then reports work
/// done that was never done. Only the target counts, not the body or the query: a retry after a
/// released `Err` that the client re-formatted still derives the same keys.
#[cfg(any(test, feature = "axum"))]
pub(crate) fn set_origin(fields: &[&[u8]]) {
    if let Some(context) = current() {
        let mut origin = context.origin.lock().unwrap_or_else(PoisonError::into_inner);
        if origin.is_empty() {
            for field in fields {
                origin.extend_from_slice(&(field.len() as u64).to_be_bytes());
                origin.extend_from_slice(field);
            }
        }
    }
}

/// Runs `body` with `context` as the current call.
pub(crate) fn scoped<F: Future>(context: Arc<CallContext>, body: F) -> impl Future<Output = F::Output> {
    CURRENT.scope(Some(context), body)
}

/// The current call, if a body of one is being polled (outside [`without_derived_keys`]).
pub(crate) fn current() -> Option<Arc<CallContext>> {
    CURRENT.try_with(Option::clone).ok().flatten()
}

/// The key the `n`-th outbound request with `method` and `path` of the current body run gets (`n`
/// counted from 0 over the run's requests with that method and path that get a derived key), or
/// `None` outside an idempotent body. Counted per method and path, so requests to different routes
/// that the body makes concurrently keep their keys when they leave in another order on the next
/// run; concurrent requests with one method and path must leave in the same order on every run.
///
/// The key is the SHA-256 (in hex) of the call's scope and key (or, inside a [`step`](crate::step),
/// the step's identity), `n`, `method` and `path`; behind the HTTP or gRPC layer, also of what the
/// call's own request was aimed at (its method and path, or its gRPC method), so that two services
/// on the layer's default scope that get one user's key derive different keys. Every run of the
/// body (a retry after a released `Err`, a takeover after a crash) starts every count again at 0,
/// so a body that makes the same requests, in the same order for each method and path, sends the
/// same keys. [`IdempotentRetry`](crate::client::IdempotentRetry) calls
/// this for requests that carry no `Idempotency-Key`; other clients can call it themselves.
#[must_use]
pub fn derived_key(method: &str, path: &str) -> Option<String> {
    current().map(|context| context.next_outbound_key(method, path))
}

/// The key an outbound request without one gets: inside an idempotent body and with `derive`, the
/// [derived](derived_key) one; otherwise a fresh UUID from the operating system. The one rule of
/// the reqwest middleware, the tonic interceptor and the tonic retry layer.
#[cfg(any(feature = "reqwest", feature = "tonic"))]
pub(crate) fn outbound_key(method: &str, path: &str, derive: bool) -> String {
    let derived = if derive { derived_key(method, path) } else { None };
    derived.unwrap_or_else(|| crate::random::fresh_uuid().to_string())
}

/// Runs `future` as if outside any idempotent body: outbound requests it makes get fresh keys,
/// not derived ones, and do not count towards the body's positions; [`step`](crate::step) inside it
/// fails with [`Error::StepOutsideCall`](crate::Error::StepOutsideCall). For requests that must
/// really be new on every run (a status poll, a notification that may repeat). An idempotent call
/// started inside it has its own context again.
pub fn without_derived_keys<F: Future>(future: F) -> impl Future<Output = F::Output> {
    CURRENT.scope(None, future)
}

#[cfg(test)]
mod tests {
    use crate::{Call, Error, MemoryStore, derived_key};

    /// The derived keys of one run of a body on `key` that then fails (so its key is released).
    async fn derived_keys_of_a_run(store: &MemoryStore, key: &str) -> Vec<String> {
        derived_keys_of_a_run_from(store, key, None).await
    }

    /// The same, for a run told that its request was aimed at `origin` (as the layers tell it).
    async fn derived_keys_of_a_run_from(store: &MemoryStore, key: &str, origin: Option<&str>) -> Vec<String> {
        let mut keys = Vec::new();
        let _ = Call::new("context-test", key)
            .run(store, async {
                if let Some(origin) = origin {
                    super::set_origin(&[b"POST", origin.as_bytes()]);
                }
                keys.push(derived_key("POST", "/a").expect("inside a body"));
                keys.push(derived_key("POST", "/a").expect("inside a body"));
                Err::<(), Error>(Error::Fingerprint("fail so that the key is released".into()))
            })
            .await;
        keys
    }

    #[tokio::test(flavor = "current_thread")]
    async fn memory_a_reused_context_starts_like_a_new_one() {
        let store = MemoryStore::new();
        let first = derived_keys_of_a_run(&store, "x").await;
        assert_ne!(first[0], first[1]);
        let other = derived_keys_of_a_run(&store, "y").await;
        assert!(other.iter().all(|key| !first.contains(key)), "another call's keys: {other:?} {first:?}");
        // The thread's spare context, made new for the same key, derives the same keys.
        assert_eq!(derived_keys_of_a_run(&store, "x").await, first);
        assert!(derived_key("POST", "/a").is_none(), "outside any body");
    }

    /// Behind a layer, two requests on different routes that share a scope and a key (one user's
    /// key sent to two services on the layer's default scope) derive different keys; each run for
    /// one route derives the same ones; and a call given no origin derives what it always did.
    #[tokio::test(flavor = "current_thread")]
    async fn memory_derived_keys_depend_on_the_route_the_call_was_aimed_at() {
        let store = MemoryStore::new();
        let orders = derived_keys_of_a_run_from(&store, "k", Some("/orders")).await;
        let membership = derived_keys_of_a_run_from(&store, "k", Some("/membership")).await;
        assert!(membership.iter().all(|key| !orders.contains(key)), "{orders:?} {membership:?}");
        assert_eq!(derived_keys_of_a_run_from(&store, "k", Some("/orders")).await, orders, "a run again");
        let plain = derived_keys_of_a_run(&store, "k").await;
        assert!(plain.iter().all(|key| !orders.contains(key)), "{orders:?} {plain:?}");
        // The keys of a call given no origin, as the derivation has made them since it began: the
        // SHA-256 of "outbound", the scope, the key, the position, the method and the path.
        let first = super::digest(&[b"outbound", b"context-test", b"k", &0u64.to_be_bytes(), b"POST", b"/a"]);
        assert_eq!(plain[0], first);
    }

    /// Positions are counted per method and path: requests to two routes that leave in one order
    /// in one run and in the other in the next keep their keys; two to one route are told apart.
    #[tokio::test(flavor = "current_thread")]
    async fn memory_derived_keys_are_counted_per_method_and_path() {
        let store = MemoryStore::new();
        let run = |order: [&'static str; 3]| {
            let store = &store;
            async move {
                let mut keys = Vec::new();
                let _ = Call::new("context-test", "k")
                    .run(store, async {
                        for path in order {
                            keys.push((path, derived_key("POST", path).expect("inside a body")));
                        }
                        Err::<(), Error>(Error::Fingerprint("fail so that the key is released".into()))
                    })
                    .await;
                keys.sort();
                keys
            }
        };
        let first = run(["/a", "/b", "/a"]).await;
        assert_eq!(run(["/b", "/a", "/a"]).await, first);
        assert_eq!(run(["/a", "/a", "/b"]).await, first);
        let a: Vec<_> = first.iter().filter(|(path, _)| *path == "/a").collect();
        assert_ne!(a[0].1, a[1].1, "two requests to one route: {first:?}");
    }
}
