//! Reading the `Idempotency-Key` header value, and scoping a key to its caller.

use std::borrow::Cow;

use http::{HeaderMap, HeaderValue};

use crate::{Fingerprint, IdempotencyKey, MAX_KEY_BYTES};

use super::IDEMPOTENCY_KEY;

/// Why an `Idempotency-Key` header was refused (every case is a `400 Bad Request`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyHeaderError {
    /// The request has the header more than once.
    Repeated,
    /// The value is not a key; the text says why.
    Malformed(String),
    /// The key is longer than [`MAX_KEY_BYTES`].
    TooLong(usize),
}

/// Reads the request's key: `Ok(None)` when the header is absent.
pub(crate) fn from_headers(headers: &HeaderMap) -> Result<Option<String>, KeyHeaderError> {
    Ok(read(headers)?.map(Cow::into_owned))
}

/// Like [`from_headers`], borrowing the key from the header when it needs no unescaping (a bare
/// value, as most clients send).
pub(crate) fn read(headers: &HeaderMap) -> Result<Option<Cow<'_, str>>, KeyHeaderError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyHeaderError::Repeated);
    }
    parse(value).map(Some)
}

/// The request's `Idempotency-Key` value, as sent, to echo on its response (Stripe does, so a
/// client can log the key each answer belongs to); `None` unless the header is there exactly once.
pub(crate) fn echo(headers: &HeaderMap) -> Option<HeaderValue> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let value = values.next()?;
    values.next().is_none().then(|| value.clone())
}

/// Adds the echoed key to `response`, unless the response sets the header itself.
pub(crate) fn echo_into<B>(response: &mut http::Response<B>, echo: Option<HeaderValue>) {
    if let Some(value) = echo {
        response.headers_mut().entry(IDEMPOTENCY_KEY).or_insert(value);
    }
}

/// Parses one header value: an sf-string (`"abc"`, with `\"` and `\\` escapes) or a bare value.
///
/// A bare value is any run of visible ASCII characters except `"`, `\`, `,` and `;` (which would
/// make it a list or carry parameters), so UUIDs, ULIDs and base64 keys work unquoted.
pub(crate) fn parse(value: &HeaderValue) -> Result<Cow<'_, str>, KeyHeaderError> {
    let bytes = value.as_bytes().trim_ascii();
    let key = if let Some(quoted) = bytes.strip_prefix(b"\"") {
        Cow::Owned(parse_sf_string(quoted)?)
    } else {
        Cow::Borrowed(parse_bare(bytes)?)
    };
    if key.is_empty() {
        return Err(KeyHeaderError::Malformed("the key is empty; send a non-empty key such as a UUID".into()));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(KeyHeaderError::TooLong(key.len()));
    }
    Ok(key)
}

fn parse_sf_string(after_quote: &[u8]) -> Result<String, KeyHeaderError> {
    let mut key = String::with_capacity(after_quote.len());
    let mut bytes = after_quote.iter().copied().enumerate();
    while let Some((at, byte)) = bytes.next() {
        match byte {
            b'"' => {
                if at + 1 != after_quote.len() {
                    return Err(malformed(
                        "characters follow the closing quote; send one quoted string without parameters",
                    ));
                }
                return Ok(key);
            }
            b'\\' => match bytes.next() {
                Some((_, escaped @ (b'"' | b'\\'))) => key.push(char::from(escaped)),
                _ => {
                    return Err(malformed(r#"a backslash in a quoted key must escape `"` or `\`"#));
                }
            },
            0x20..=0x7e => key.push(char::from(byte)),
            other => return Err(invalid_byte(other)),
        }
    }
    Err(malformed("the quoted key has no closing quote"))
}

fn parse_bare(bytes: &[u8]) -> Result<&str, KeyHeaderError> {
    for &byte in bytes {
        match byte {
            b'"' | b'\\' | b',' | b';' | b' ' | b'\t' => {
                return Err(malformed(
                    "an unquoted key cannot hold spaces, quotes, backslashes, commas or semicolons; \
                     send it as a quoted string (\"...\") or use a UUID",
                ));
            }
            0x21..=0x7e => {}
            other => return Err(invalid_byte(other)),
        }
    }
    // Every byte is visible ASCII: the conversion cannot fail.
    std::str::from_utf8(bytes).map_err(|_| malformed("the key is not ASCII"))
}

fn malformed(reason: &str) -> KeyHeaderError {
    KeyHeaderError::Malformed(reason.to_owned())
}

fn invalid_byte(byte: u8) -> KeyHeaderError {
    if byte.is_ascii_control() {
        KeyHeaderError::Malformed(format!("the key holds the control character 0x{byte:02x}; keys are printable ASCII"))
    } else {
        KeyHeaderError::Malformed(format!("the key holds the non-ASCII byte 0x{byte:02x}; keys are printable ASCII"))
    }
}

/// A client's key bound to the caller who sent it, so that two callers using the same key never
/// share a record (see [`IdempotencyKeyHeader::for_caller`](super::IdempotencyKeyHeader::for_caller)).
///
/// Its text is `<first 32 hex digits of SHA-256(caller)>/<key>`. When that would pass
/// [`MAX_KEY_BYTES`], the key part is replaced by `sha256:<its 64-hex SHA-256>`, so every key the
/// header accepts still fits; the caller's identity itself never appears in the store.
#[derive(Debug, Clone, Copy)]
pub struct CallerKey<'a> {
    caller: &'a str,
    key: &'a str,
}

impl<'a> CallerKey<'a> {
    /// Binds `key` to `caller` (a user id, an API client id, a tenant: whatever identifies who sent it).
    #[must_use]
    pub fn new(caller: &'a str, key: &'a str) -> Self {
        CallerKey { caller, key }
    }
}

const CALLER_DIGITS: usize = 32;

impl IdempotencyKey for CallerKey<'_> {
    fn write_key(&self, out: &mut String) {
        let caller = Fingerprint::of_bytes(self.caller.as_bytes());
        out.push_str(&caller.as_str()[..CALLER_DIGITS]);
        out.push('/');
        if CALLER_DIGITS + 1 + self.key.len() <= MAX_KEY_BYTES {
            out.push_str(self.key);
        } else {
            out.push_str("sha256:");
            out.push_str(Fingerprint::of_bytes(self.key.as_bytes()).as_str());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Key;

    fn parsed(text: &[u8]) -> Result<String, KeyHeaderError> {
        parse(&HeaderValue::from_bytes(text).unwrap()).map(Cow::into_owned)
    }

    #[test]
    fn http_key_values() {
        assert_eq!(parsed(b"8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
        assert_eq!(parsed(br#""abc def""#).unwrap(), "abc def");
        assert_eq!(parsed(br#"  "a\"b\\c"  "#).unwrap(), r#"a"b\c"#);
        assert_eq!(parsed(b"dGVzdA==").unwrap(), "dGVzdA==");
        assert!(matches!(parsed(b""), Err(KeyHeaderError::Malformed(_))));
        assert!(matches!(parsed(br#""""#), Err(KeyHeaderError::Malformed(_))));
        assert!(matches!(parsed(br#""abc"#), Err(KeyHeaderError::Malformed(_))));
        assert!(matches!(parsed(br#""abc";p=1"#), Err(KeyHeaderError::Malformed(_))));
        assert!(matches!(parsed(br#""a\nb""#), Err(KeyHeaderError::Malformed(_))));
        assert!(matches!(parsed(b"a b"), Err(KeyHeaderError::Malformed(_))));
        assert!(matches!(parsed(b"a,b"), Err(KeyHeaderError::Malformed(_))));
        assert!(matches!(parsed(b"a\tb"), Err(KeyHeaderError::Malformed(_))));
        assert!(matches!(parsed("ключ".as_bytes()), Err(KeyHeaderError::Malformed(_))));
        assert!(parsed("k".repeat(MAX_KEY_BYTES).as_bytes()).is_ok());
        assert_eq!(parsed("k".repeat(MAX_KEY_BYTES + 1).as_bytes()), Err(KeyHeaderError::TooLong(256)));
    }

    #[test]
    fn http_caller_keys_fit_and_differ() {
        let alice = Key::new("s", &CallerKey::new("alice", "k1")).unwrap();
        let bob = Key::new("s", &CallerKey::new("bob", "k1")).unwrap();
        assert_ne!(alice, bob);
        assert!(alice.key().ends_with("/k1"), "{alice}");
        let long = "k".repeat(MAX_KEY_BYTES);
        let scoped = Key::new("s", &CallerKey::new("alice", &long)).unwrap();
        assert_eq!(scoped.key().len(), CALLER_DIGITS + 1 + 7 + 64);
        let shorter = "k".repeat(MAX_KEY_BYTES - 1);
        assert_ne!(scoped, Key::new("s", &CallerKey::new("alice", &shorter)).unwrap());
    }
}
