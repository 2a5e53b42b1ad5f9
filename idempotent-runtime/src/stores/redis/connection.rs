//! The connections a [`RedisStore`](super::RedisStore) runs over: one server, or a cluster.

use std::future::Future;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{RedisResult, Value};

/// A connection the Redis store can use: [`ConnectionManager`] for one server, and with the
/// `redis-cluster` feature the cluster connection of [`RedisClusterStore`](super::RedisClusterStore).
///
/// Sealed: the store relies on how each routes its commands.
pub trait RedisConnection: ConnectionLike + Clone + Send + Sync + 'static + sealed::Sealed {
    /// `WAIT replicas timeout_ms` on the server that holds `redis_key`.
    #[doc(hidden)]
    fn wait_for_replicas(
        &mut self,
        redis_key: &[u8],
        replicas: u32,
        timeout_ms: u64,
    ) -> impl Future<Output = RedisResult<Value>> + Send;
}

pub(super) mod sealed {
    pub trait Sealed {}
}

impl sealed::Sealed for ConnectionManager {}

impl RedisConnection for ConnectionManager {
    async fn wait_for_replicas(&mut self, _redis_key: &[u8], replicas: u32, timeout_ms: u64) -> RedisResult<Value> {
        redis::cmd("WAIT").arg(replicas).arg(timeout_ms).query_async(self).await
    }
}
