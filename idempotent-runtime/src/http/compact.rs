//! The fields of the compact record form: headers and a body, written straight into a formatter
//! and read back from the string a store hands over. The HTTP layer's records and the gRPC
//! layer's are both made of them (each module documents its own record's grammar).
//!
//! ```text
//! header   = len ":" name value               the name, its byte length before it
//! value    = len ":" text / len ";" base64
//! body     = ":" text / ";" base64            to the end of the record
//! ```
//!
//! Bytes are kept as text when they are UTF-8, and as base64 (standard alphabet, padded)
//! otherwise. A header starts with a digit and the body with `:` or `;`, so the body ends a list
//! of headers without a count.

use std::fmt::{self, Formatter};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

/// Writes one header.
pub(crate) fn write_header(f: &mut Formatter<'_>, name: &HeaderName, value: &HeaderValue) -> fmt::Result {
    let name = name.as_str();
    f.write_str(itoa::Buffer::new().format(name.len()))?;
    f.write_str(":")?;
    f.write_str(name)?;
    write_data(f, value.as_bytes(), true)
}

/// Writes the body, which ends the record.
pub(crate) fn write_body(f: &mut Formatter<'_>, body: &[u8]) -> fmt::Result {
    write_data(f, body, false)
}

/// `bytes` as text (`:`) or base64 (`;`), length-prefixed if `counted`.
fn write_data(f: &mut Formatter<'_>, bytes: &[u8], counted: bool) -> fmt::Result {
    if let Ok(text) = std::str::from_utf8(bytes) {
        if counted {
            f.write_str(itoa::Buffer::new().format(text.len()))?;
        }
        f.write_str(":")?;
        return f.write_str(text);
    }
    if counted {
        // At most 4/3 of a header value's length: it cannot overflow.
        let len = base64::encoded_len(bytes.len(), true).unwrap_or(usize::MAX);
        f.write_str(itoa::Buffer::new().format(len))?;
    }
    f.write_str(";")?;
    fmt::Display::fmt(&base64::display::Base64Display::new(bytes, &BASE64), f)
}

/// Reads the headers at the start of `record` into a map; returns the map and what follows them.
/// `None` if one is malformed.
pub(crate) fn read_headers(mut record: &[u8]) -> Option<(HeaderMap, &[u8])> {
    let mut headers = HeaderMap::new();
    while record.first().is_some_and(u8::is_ascii_digit) {
        let (name, value, after) = read_header(record)?;
        let value = match value {
            Data::Text(text) => HeaderValue::from_bytes(text),
            Data::Base64(base64) => HeaderValue::from_bytes(&BASE64.decode(base64).ok()?),
        };
        headers.append(HeaderName::from_bytes(name).ok()?, value.ok()?);
        record = after;
    }
    Some((headers, record))
}

/// Reads the headers at the start of `record` as they were written, names and values as bytes;
/// returns them and what follows them. `None` if one is malformed.
pub(crate) fn read_header_list(mut record: &[u8]) -> Option<(HeaderList, &[u8])> {
    let mut headers = Vec::new();
    while record.first().is_some_and(u8::is_ascii_digit) {
        let (name, value, after) = read_header(record)?;
        let value = match value {
            Data::Text(text) => text.to_vec(),
            Data::Base64(base64) => BASE64.decode(base64).ok()?,
        };
        headers.push((String::from_utf8(name.to_vec()).ok()?, value));
        record = after;
    }
    Some((headers, record))
}

/// A reader of headers: what it read, and what follows them.
pub(crate) type Reader<'r, T> = fn(&'r [u8]) -> Option<(T, &'r [u8])>;

/// After a gRPC answer's headers: `t` and its trailers, read by `read`, if it had trailers; and
/// what follows them. `None` if the trailers are malformed.
pub(crate) fn read_trailers<'r, T>(record: &'r [u8], read: Reader<'r, T>) -> Option<(Option<T>, &'r [u8])> {
    match record.split_first() {
        Some((b't', rest)) => read(rest).map(|(trailers, rest)| (Some(trailers), rest)),
        _ => Some((None, record)),
    }
}

/// Headers as written: names and values as bytes, in order.
pub(crate) type HeaderList = Vec<(String, Vec<u8>)>;

/// A header at the start of a record: its name, its value, what follows it.
type Header<'r> = (&'r [u8], Data<'r>, &'r [u8]);

/// A value as written: text, or base64 still to decode.
enum Data<'r> {
    Text(&'r [u8]),
    Base64(&'r [u8]),
}

/// The header at the start of `record`, which starts with a digit; `None` if it is malformed.
fn read_header(record: &[u8]) -> Option<Header<'_>> {
    let (b':', name, after) = counted(record)? else { return None };
    let (kind, value, after) = counted(after)?;
    let value = if kind == b':' { Data::Text(value) } else { Data::Base64(value) };
    Some((name, value, after))
}

/// Reads the body that ends a record; `None` if `record` does not start one.
pub(crate) fn read_body(record: &[u8]) -> Option<Bytes> {
    match record.split_first()? {
        (b':', text) => Some(Bytes::copy_from_slice(text)),
        (b';', base64) => Some(Bytes::from(BASE64.decode(base64).ok()?)),
        _ => None,
    }
}

/// Splits `len kind data rest` (`kind` being `:` or `;`, `data` `len` bytes long) into its parts.
fn counted(field: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let digits = field.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits > 9 {
        return None;
    }
    let len: usize = std::str::from_utf8(&field[..digits]).ok()?.parse().ok()?;
    let (&kind, rest) = field[digits..].split_first()?;
    if kind != b':' && kind != b';' {
        return None;
    }
    let (data, rest) = rest.split_at_checked(len)?;
    Some((kind, data, rest))
}
