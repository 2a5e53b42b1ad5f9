//! The stores: one file each.

pub mod memory;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod sql;

pub use crate::detached::spawn_detached;
