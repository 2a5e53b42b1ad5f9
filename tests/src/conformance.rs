//! The store conformance suite (being written).
