//! Request fingerprints: a reused key with a different request is rejected, never replayed.

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::StoreError;

/// The length of a fingerprint's text: a SHA-256 in hex.
const HEX_LEN: usize = 64;

/// The SHA-256 of a request's canonical bytes, as 64 lowercase hex digits.
///
/// A `Fingerprint` only ever holds such text: it is made by [`of`](Fingerprint::of) or
/// [`of_bytes`](Fingerprint::of_bytes), or read back from a store with
/// [`parse`](Fingerprint::parse), which refuses anything else. So every store keeps it exactly
/// (plain ASCII, fixed length), whatever its text column does to whitespace or empty strings.
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
///
/// It is held inline (64 bytes, no allocation), so replays and claims copy it cheaply.
#[derive(Clone, PartialEq, Eq, Hash)]
// Aligned like the words around it. At alignment 1, an `Option<Fingerprint>` put the digits one
// byte past its tag, and the compiler moved every `Claim` and `Record` holding one in unaligned
// pieces that straddled the stores that wrote them; each such load waits for those stores to
// retire (a failed store-to-load forwarding). Memory-store replays ran about 5 % faster aligned.
#[repr(align(8))]
pub struct Fingerprint([u8; HEX_LEN]);

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Fingerprint").field(&self.as_str()).finish()
    }
}

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

    /// Fingerprints `fields` as one byte string of each field's length (8 bytes, big-endian)
    /// followed by the field, without building that string (the HTTP layer's method, target and
    /// body).
    #[cfg(feature = "axum")]
    pub(crate) fn of_fields(fields: &[&[u8]]) -> Self {
        let mut hasher = Sha256::new();
        for field in fields {
            hasher.update((field.len() as u64).to_be_bytes());
            hasher.update(field);
        }
        Self::from_digest(hasher)
    }

    /// Reads a fingerprint back from a store, which keeps it as text.
    ///
    /// # Errors
    ///
    /// [`StoreError::Corrupt`] unless `text` is 64 lowercase hex digits: the store holds
    /// something no call wrote, and it is reported, never compared.
    ///
    /// ```
    /// use idempotent_runtime::{Fingerprint, StoreError};
    ///
    /// let made = Fingerprint::of(&("alice", 100)).unwrap();
    /// assert_eq!(Fingerprint::parse(made.as_str()).unwrap(), made);
    /// assert!(matches!(Fingerprint::parse(""), Err(StoreError::Corrupt(_))));
    /// assert!(matches!(Fingerprint::parse(format!("{}\t", made.as_str())), Err(StoreError::Corrupt(_))));
    /// ```
    pub fn parse(text: impl AsRef<str>) -> Result<Self, StoreError> {
        let text = text.as_ref();
        if let Ok(hex) = <[u8; HEX_LEN]>::try_from(text.as_bytes())
            && hex.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            Ok(Fingerprint(hex))
        } else {
            let shown: String = text.chars().take(80).collect();
            Err(StoreError::Corrupt(format!(
                "a stored fingerprint is {shown:?} ({} bytes), not the 64 lowercase hex digits this library \
                 writes; the record was written by something else or damaged",
                text.len()
            )))
        }
    }

    /// The hex text that stores keep.
    #[must_use]
    pub fn as_str(&self) -> &str {
        // Only lowercase hex digits are ever stored (`from_digest`, `parse`): always UTF-8.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }

    /// The hex text's bytes, without the UTF-8 check `as_str` makes (for writing it into a
    /// command).
    #[cfg(feature = "redis")]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    fn from_digest(hasher: Sha256) -> Self {
        Self::from_digest_bytes(&hasher.finalize().into())
    }

    /// The fingerprint whose 32 bytes are `digest` (what [`digest`](Self::digest) gives back).
    pub(crate) fn from_digest_bytes(digest: &[u8; 32]) -> Self {
        Fingerprint(crate::hex::encode(digest))
    }

    /// The 32 bytes the hex text spells: half its size, for stores that keep many.
    pub(crate) fn digest(&self) -> [u8; 32] {
        crate::hex::decode(&self.0)
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

#[cfg(test)]
mod tests {
    use super::Fingerprint;

    #[test]
    fn parse_accepts_exactly_what_the_library_writes() {
        for made in [Fingerprint::of_bytes(b""), Fingerprint::of(&("a", 1)).unwrap()] {
            assert_eq!(Fingerprint::parse(made.as_str()).unwrap(), made);
            assert_eq!(Fingerprint::from_digest_bytes(&made.digest()), made, "kept as bytes and read back");
            for bad in [
                String::new(),
                format!("{}\t", made.as_str()),
                format!(" {}", made.as_str()),
                made.as_str().to_uppercase(),
                made.as_str()[1..].to_owned(),
                format!("{}0", made.as_str()),
                made.as_str().replacen(|c: char| c.is_ascii_digit(), "g", 1),
            ] {
                assert!(Fingerprint::parse(bad.clone()).is_err(), "{bad:?} must be refused");
            }
        }
    }
}
