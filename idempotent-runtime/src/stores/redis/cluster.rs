//! The store over Redis Cluster (feature `redis-cluster`).

use std::time::Duration;

use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;

use super::connection::{RedisConnection, sealed};
use super::{DEFAULT_CONNECTION_TIMEOUT, DEFAULT_RESPONSE_TIMEOUT, RedisStore, backend};
use crate::StoreError;

/// How many times [`RedisClusterStore::connect_cluster`]'s client retries a command that failed
/// on a node (moved slot, lost connection, failover in progress) before the call fails.
pub const DEFAULT_CLUSTER_RETRIES: u32 = 4;

/// The Redis store over Redis Cluster: the same records, commands and guarantees as
/// [`RedisStore`] over one server (see the [module docs](super)), each record on the slot of its
/// key.
///
/// ```no_run
/// use idempotent_runtime::stores::redis::RedisClusterStore;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let nodes = ["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"];
/// let store = RedisClusterStore::connect_cluster(&nodes).await?.with_prefix("shop:idem:")?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
pub type RedisClusterStore = RedisStore<ClusterConnection>;

impl RedisStore<ClusterConnection> {
    /// Connects to the cluster that `nodes` (some of its nodes' URLs) belong to.
    ///
    /// The client learns the slot map from them, follows `MOVED` and `ASK` redirections, and
    /// refreshes the map when the topology changes. A command failing on a node is retried
    /// [`DEFAULT_CLUSTER_RETRIES`] times with back-off; each waits at most
    /// [`DEFAULT_RESPONSE_TIMEOUT`] for a reply and [`DEFAULT_CONNECTION_TIMEOUT`] for a
    /// connection. Build your own `ClusterConnection` and pass it to [`RedisStore::new`] to
    /// choose otherwise.
    pub async fn connect_cluster(nodes: &[impl AsRef<str>]) -> Result<Self, StoreError> {
        let nodes: Vec<&str> = nodes.iter().map(AsRef::as_ref).collect();
        let client = ClusterClientBuilder::new(nodes)
            .retries(DEFAULT_CLUSTER_RETRIES)
            .min_retry_wait(100)
            .max_retry_wait(1000)
            .connection_timeout(DEFAULT_CONNECTION_TIMEOUT)
            .response_timeout(DEFAULT_RESPONSE_TIMEOUT)
            .overall_response_timeout(Some(Duration::from_secs(5)))
            .build()
            .map_err(backend)?;
        let connection = client.get_async_connection().await.map_err(backend)?;
        Ok(RedisStore::new(connection))
    }
}

impl sealed::Sealed for ClusterConnection {
    const NAME: &'static str = "redis-cluster";
}
impl RedisConnection for ClusterConnection {}
