//! The connections a [`RedisStore`](super::RedisStore) runs over: one server, or a cluster.

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
    }
}

impl sealed::Sealed for ConnectionManager {
    const NAME: &'static str = "redis";
}
impl RedisConnection for ConnectionManager {}
