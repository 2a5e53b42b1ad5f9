//! The SQL stores (being written).
