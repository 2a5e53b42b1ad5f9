//! HTTP `Idempotency-Key` support (being written).
