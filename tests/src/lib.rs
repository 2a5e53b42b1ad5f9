//! Shared pieces of the integration tests: finding the servers, and the store conformance suite
//! that every store must pass.

#[cfg(feature = "redis-cluster")]
pub mod cluster;
pub mod conformance;
#[cfg(feature = "postgres")]
pub mod consume;
pub mod fresh;
#[cfg(feature = "grpc")]
pub mod grpc;
pub mod proxy;
#[cfg(feature = "redis")]
pub mod replicated;
pub mod services;
pub mod simulation;
pub mod stress;

use std::future::Future;
use std::time::Duration;

use idempotent_runtime::{Completion, Key, Store, StoreError, Token};

/// Direct store steps in the short form the tests use.
pub trait StoreSteps: Store {
    /// [`Store::complete`] of `token`'s claim on `key` with `outcome`, without a fingerprint.
    fn complete_as<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        outcome: &'a [u8],
        retention: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        async move { self.complete(&Completion::new(key, token, None, outcome, retention)).await }
    }
}

impl<S: Store + ?Sized> StoreSteps for S {}
