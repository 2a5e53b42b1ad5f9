//! The store over Redis Cluster (feature `redis-cluster`).

use std::sync::Arc;
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
    /// connection. Each node given is checked as [`RedisStore::connect`] checks its server (see
    /// [Server requirements](super#server-requirements)). Build your own `ClusterConnection` and
    /// pass it to [`RedisStore::new`] to choose otherwise.
    pub async fn connect_cluster(nodes: &[impl AsRef<str>]) -> Result<Self, StoreError> {
        let nodes: Vec<&str> = nodes.iter().map(AsRef::as_ref).collect();
        let client = ClusterClientBuilder::new(nodes.clone())
            .retries(DEFAULT_CLUSTER_RETRIES)
            .min_retry_wait(100)
            .max_retry_wait(1000)
            .connection_timeout(DEFAULT_CONNECTION_TIMEOUT)
            .response_timeout(DEFAULT_RESPONSE_TIMEOUT)
            .overall_response_timeout(Some(Duration::from_secs(5)))
            .build()
            .map_err(backend)?;
        let connection = client.get_async_connection().await.map_err(backend)?;
        // Every node given is checked on a connection of its own (a cluster connection routes
        // `INFO` to a node of its choice).
        for node in &nodes {
            let mut direct = redis::Client::open(*node)
                .map_err(backend)?
                .get_multiplexed_async_connection_with_config(
                    &redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(DEFAULT_CONNECTION_TIMEOUT))
                        .set_response_timeout(Some(DEFAULT_RESPONSE_TIMEOUT)),
                )
                .await
                .map_err(backend)?;
            super::server::check(&mut direct, &super::redacted(node)).await?;
        }
        // A cluster connection that stops sending (seen after a master was killed) is replaced
        // after a step times out on it.
        let renew: super::connection::Renew<ClusterConnection> = Arc::new(move || {
            let client = client.clone();
            Box::pin(async move { client.get_async_connection().await })
        });
        Ok(RedisStore::renewable(connection, Some(renew)))
    }
}

impl sealed::Sealed for ClusterConnection {
    const NAME: &'static str = "redis-cluster";
    // The cluster client retries a command whose connection was lost (`DEFAULT_CLUSTER_RETRIES`).
    const RESENDS_LOST: bool = false;
    // Keys spread over slots: a batch is its single steps.
    const PIPELINES_ANY_KEYS: bool = false;
}
impl RedisConnection for ClusterConnection {}
