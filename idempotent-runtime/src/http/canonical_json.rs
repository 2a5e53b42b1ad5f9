//! A canonical form of a JSON body for fingerprints: no insignificant whitespace, object keys sorted.

use serde_json::Value;

/// The canonical bytes of `body`, or `None` if it is not JSON.
///
/// Two bodies get the same bytes when they differ only in whitespace, in the order of object keys,
/// or in string escapes (`"\u0041"` and `"A"`). Numbers keep their form (`1` and `1.0` differ), and
/// an object with a repeated key is read as the JSON parser does (the last value wins).
pub(crate) fn canonical(body: &[u8]) -> Option<Vec<u8>> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let mut out = Vec::with_capacity(body.len());
    write(&value, &mut out);
    Some(out)
}

fn write(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                // Serialising a string or a scalar into a Vec cannot fail.
                let _ = serde_json::to_writer(&mut *out, key);
                out.push(b':');
                write(value, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out);
            }
            out.push(b']');
        }
        scalar => {
            let _ = serde_json::to_writer(&mut *out, scalar);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::canonical;

    #[test]
    fn http_canonical_json_ignores_whitespace_and_key_order_only() {
        let a = canonical(br#"{"amount": 100, "items": [{"b": 1, "a": "x"}], "currency": "eur"}"#).unwrap();
        let b =
            canonical(b"{\"currency\":\"eur\",\n  \"items\":[ {\"a\":\"\\u0078\",\"b\":1} ],\"amount\":100}").unwrap();
        assert_eq!(a, b);
        assert_eq!(a, br#"{"amount":100,"currency":"eur","items":[{"a":"x","b":1}]}"#);
        assert_ne!(canonical(br#"{"amount":100}"#), canonical(br#"{"amount":100.0}"#));
        assert_ne!(canonical(b"[1,2]"), canonical(b"[2,1]"), "array order is meaning");
        assert_eq!(canonical(b"not json"), None);
    }
}
