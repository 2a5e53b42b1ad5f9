//! Shared pieces of the integration tests: finding the servers, and the store conformance suite
//! that every store must pass.

pub mod conformance;
#[cfg(feature = "postgres")]
pub mod consume;
pub mod fresh;
pub mod proxy;
pub mod services;
pub mod stress;
