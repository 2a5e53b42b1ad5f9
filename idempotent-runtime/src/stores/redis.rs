//! The Redis store (being written).
