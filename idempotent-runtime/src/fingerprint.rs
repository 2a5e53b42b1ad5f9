//! Request fingerprints: a reused key with a different request is rejected, never replayed.

use serde::Serialize;
use sha2::{Digest, Sha256};

/// The SHA-256 of a request's canonical bytes, as 64 lowercase hex digits.
///
/// ```
/// use idempotent_runtime::Fingerprint;
///
/// let a = Fingerprint::of(&("alice", 100)).unwrap();
/// let b = Fingerprint::of(&("alice", 100)).unwrap();
/// let c = Fingerprint::of(&("alice", 101)).unwrap();
/// assert_eq!(a, b);
/// assert_ne!(a, c);
/// assert_eq!(a.as_str().len(), 64);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint(String);

impl Fingerprint {
    /// Fingerprints a serialisable value by hashing its JSON encoding.
    ///
    /// Field order is the declaration order, so the same value always gives the same fingerprint;
    /// a `HashMap` inside the value serialises in arbitrary order: use a `BTreeMap` there.
    pub fn of<T: Serialize + ?Sized>(value: &T) -> Result<Self, serde_json::Error> {
        let mut hasher = HashWriter(Sha256::new());
        serde_json::to_writer(&mut hasher, value)?;
        Ok(Self::from_digest(hasher.0))
    }

    /// Fingerprints raw bytes, such as an HTTP method, path and body.
    #[must_use]
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self::from_digest(Sha256::new_with_prefix(bytes))
    }

    /// Takes a fingerprint read back from a store. Stores keep it as text.
    #[must_use]
    pub fn from_stored(text: impl Into<String>) -> Self {
        Fingerprint(text.into())
    }

    /// The hex text that stores keep.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn from_digest(hasher: Sha256) -> Self {
        use std::fmt::Write as _;
        let digest = hasher.finalize();
        let mut hex = String::with_capacity(64);
        for byte in digest {
            let _ = write!(hex, "{byte:02x}");
        }
        Fingerprint(hex)
    }
}

struct HashWriter(Sha256);

impl std::io::Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
