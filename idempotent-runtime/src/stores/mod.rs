//! The stores: one file each, and [`AnyStore`], any of them chosen at run time.

pub mod any;
#[cfg(feature = "cache")]
pub mod cache;
pub mod memory;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod sql;

pub use crate::detached::spawn_detached;
pub use any::{AnyStore, StoreUrlError};
