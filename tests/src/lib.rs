//! Shared pieces of the integration tests: finding the servers, and the store conformance suite
//! that every store must pass.

#[cfg(feature = "redis-cluster")]
pub mod cluster;
pub mod conformance;
#[cfg(feature = "postgres")]
pub mod consume;
pub mod fresh;
pub mod proxy;
pub mod services;
pub mod stress;
