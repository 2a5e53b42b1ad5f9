//! The connections a [`RedisStore`](super::RedisStore) runs over: one server, or a cluster.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use redis::aio::{ConnectionLike, ConnectionManager};

/// A connection the Redis store can use: [`ConnectionManager`] for one server, and with the
/// `redis-cluster` feature the cluster connection of [`RedisClusterStore`](super::RedisClusterStore).
///
/// Sealed: the store relies on how each routes its commands (a pipeline goes to one node).
pub trait RedisConnection: ConnectionLike + Clone + Send + Sync + 'static + sealed::Sealed {}

pub(super) mod sealed {
    pub trait Sealed {
        /// The store's name in metrics and logs.
        const NAME: &'static str;
        /// Whether the store sends a step again when the connection was lost with the step in
        /// flight (`false` for a client that already does so itself).
        const RESENDS_LOST: bool;
        /// Whether one pipeline may hold commands on any keys (one server), so that a batch is
        /// one round trip; a cluster connection sends a pipeline to one node.
        const PIPELINES_ANY_KEYS: bool;
    }
}

impl sealed::Sealed for ConnectionManager {
    const NAME: &'static str = "redis";
    // The manager reconnects after a lost connection but fails the commands that were on it.
    const RESENDS_LOST: bool = true;
    const PIPELINES_ANY_KEYS: bool = true;
}
impl RedisConnection for ConnectionManager {}

/// Makes a fresh connection: how a store replaces one that stopped answering.
pub(super) type Renew<C> =
    Arc<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = redis::RedisResult<C>> + Send>> + Send + Sync>;

/// The store's connection, which it replaces when a step timed out on it and it knows how to
/// make a new one (the cluster store: a cluster client was seen sending nothing at all after a
/// master was killed, every later step waiting on it).
pub(super) struct Shared<C> {
    current: Arc<RwLock<C>>,
    renew: Option<Renew<C>>,
    renewing: Arc<AtomicBool>,
    /// When the last replacement was made: at most one a second.
    renewed: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
}

impl<C: Clone> Clone for Shared<C> {
    fn clone(&self) -> Self {
        Shared {
            current: Arc::clone(&self.current),
            renew: self.renew.clone(),
            renewing: Arc::clone(&self.renewing),
            renewed: Arc::clone(&self.renewed),
        }
    }
}

impl<C: RedisConnection> Shared<C> {
    pub(super) fn new(connection: C, renew: Option<Renew<C>>) -> Self {
        Shared {
            current: Arc::new(RwLock::new(connection)),
            renew,
            renewing: Arc::new(AtomicBool::new(false)),
            renewed: Arc::default(),
        }
    }

    /// The connection to send the next command on.
    pub(super) fn get(&self) -> C {
        self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// After a step timed out or lost its link: makes a new connection in the background, one at
    /// a time, and uses it for the steps after it (the ones in flight keep the old one).
    pub(super) fn renew(&self) {
        let Some(renew) = self.renew.clone() else { return };
        let recently = self
            .renewed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|at| at.elapsed() < MIN_RENEW_INTERVAL);
        if recently || self.renewing.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.renewing.store(false, Ordering::Release);
            return;
        };
        let (current, renewing, renewed) =
            (Arc::clone(&self.current), Arc::clone(&self.renewing), Arc::clone(&self.renewed));
        runtime.spawn(async move {
            match tokio::time::timeout(RENEW_TIMEOUT, renew()).await {
                Ok(Ok(fresh)) => {
                    *current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
                    tracing::warn!(target: "idempotent", "a Redis step timed out or lost its link; the store made a new connection");
                }
                Ok(Err(e)) => tracing::warn!(target: "idempotent", error = %e, "could not make a new Redis connection; will try again after the next timeout"),
                Err(_) => tracing::warn!(target: "idempotent", "making a new Redis connection timed out; will try again after the next timeout"),
            }
            *renewed.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(tokio::time::Instant::now());
            renewing.store(false, Ordering::Release);
        });
    }
}

/// The least time between two replacements.
const MIN_RENEW_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// How long making a replacement connection may take.
const RENEW_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
