//! A canonical form of a JSON body for fingerprints: no insignificant whitespace, object keys
//! sorted, strings in one spelling, numbers exactly as the client wrote them.
//!
//! Why our own reader: `serde_json::Value` holds numbers as `u64`, `i64` or `f64`, so two requests
//! whose amounts differ beyond an `f64`'s precision (`12345678901234567.89` and
//! `12345678901234567.00`) would read as one. `serde_json`'s `arbitrary_precision` feature would keep
//! the text, but it changes `serde_json::Number` for every crate in a user's build (features are
//! unified), and canonical-JSON crates (RFC 8785) write numbers through `f64` by design. Reading
//! the grammar here takes one pass and keeps each number's text; `serde_json` still decodes strings.

/// The canonical bytes of `body`, or `None` if it is not JSON (RFC 8259), or nests objects and
/// arrays deeper than [`MAX_DEPTH`].
///
/// Two bodies get the same bytes exactly when they differ only in whitespace, in the order of
/// object keys, or in how strings are escaped (`"\u0041"` and `"A"`): changes that no JSON reader
/// sees. Everything else tells them apart, even where values are equal by some reading: numbers
/// are kept as written (`1`, `1.0`, `1e0` and `1E0` differ, as do `0` and `-0`), and an object
/// that repeats a key keeps every occurrence, in order (readers disagree on which one wins).
pub(crate) fn canonical(body: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(body).ok()?;
    let mut reader = Reader { text, at: 0 };
    let value = reader.value(0)?;
    reader.skip_whitespace();
    if reader.at != text.len() {
        return None;
    }
    let mut out = Vec::with_capacity(body.len());
    value.write(&mut out);
    Some(out)
}

/// How deep objects and arrays may nest (`serde_json`'s default limit too); deeper bodies are
/// fingerprinted byte for byte.
pub(crate) const MAX_DEPTH: usize = 128;

/// A value, with its strings decoded and its numbers and literals as they were written.
enum Node<'a> {
    Object(Vec<(String, Node<'a>)>),
    Array(Vec<Node<'a>>),
    String(String),
    Verbatim(&'a str),
}

impl Node<'_> {
    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Node::Object(entries) => {
                out.push(b'{');
                for (i, (key, value)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_string(key, out);
                    out.push(b':');
                    value.write(out);
                }
                out.push(b'}');
            }
            Node::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    item.write(out);
                }
                out.push(b']');
            }
            Node::String(text) => write_string(text, out),
            Node::Verbatim(text) => out.extend_from_slice(text.as_bytes()),
        }
    }
}

/// One spelling per string: `serde_json`'s (escapes only where JSON requires them).
fn write_string(text: &str, out: &mut Vec<u8>) {
    // Serialising a string into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, text);
}

/// A reader over the body's text; every method returns `None` on anything that is not JSON.
struct Reader<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn skip_whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn value(&mut self, depth: usize) -> Option<Node<'a>> {
        self.skip_whitespace();
        match self.peek()? {
            b'{' if depth < MAX_DEPTH => self.object(depth + 1),
            b'[' if depth < MAX_DEPTH => self.array(depth + 1),
            b'"' => self.string().map(Node::String),
            b't' => self.literal("true"),
            b'f' => self.literal("false"),
            b'n' => self.literal("null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    /// After `{`: members until `}`, sorted by key. The sort is stable, so a repeated key keeps
    /// its occurrences in their order.
    fn object(&mut self, depth: usize) -> Option<Node<'a>> {
        let mut entries = Vec::new();
        self.items(b'}', |reader| {
            reader.skip_whitespace();
            if reader.peek()? != b'"' {
                return None;
            }
            let key = reader.string()?;
            reader.skip_whitespace();
            if reader.peek()? != b':' {
                return None;
            }
            reader.at += 1;
            entries.push((key, reader.value(depth)?));
            Some(())
        })?;
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        Some(Node::Object(entries))
    }

    /// After `[`: items until `]`.
    fn array(&mut self, depth: usize) -> Option<Node<'a>> {
        let mut items = Vec::new();
        self.items(b']', |reader| {
            items.push(reader.value(depth)?);
            Some(())
        })?;
        Some(Node::Array(items))
    }

    /// Steps over the opening bracket, then reads `item`s separated by `,` up to `close`.
    fn items(&mut self, close: u8, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.at += 1;
        self.skip_whitespace();
        if self.peek() == Some(close) {
            self.at += 1;
            return Some(());
        }
        loop {
            item(self)?;
            self.skip_whitespace();
            let next = self.peek()?;
            self.at += 1;
            match next {
                b',' => {}
                _ if next == close => return Some(()),
                _ => return None,
            }
        }
    }

    /// A string token (at its opening quote), decoded.
    fn string(&mut self) -> Option<String> {
        let start = self.at;
        self.at += 1;
        let mut escaped = false;
        loop {
            match self.peek()? {
                b'"' => break,
                // The escape itself is checked when serde_json decodes the token.
                b'\\' => {
                    escaped = true;
                    self.at += 2;
                }
                0x00..=0x1f => return None,
                _ => self.at += 1,
            }
        }
        self.at += 1;
        let token = self.text.get(start..self.at)?;
        if escaped { serde_json::from_str(token).ok() } else { Some(token[1..token.len() - 1].to_owned()) }
    }

    fn literal(&mut self, word: &'static str) -> Option<Node<'a>> {
        let rest = self.text.get(self.at..)?;
        rest.starts_with(word).then(|| {
            self.at += word.len();
            Node::Verbatim(word)
        })
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, kept as written.
    fn number(&mut self) -> Option<Node<'a>> {
        let start = self.at;
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek()? {
            b'0' => self.at += 1,
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            if !self.digits() {
                return None;
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            if !self.digits() {
                return None;
            }
        }
        Some(Node::Verbatim(self.text.get(start..self.at)?))
    }

    /// Skips a run of digits; `false` if there was none.
    fn digits(&mut self) -> bool {
        let start = self.at;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.at += 1;
        }
        self.at > start
    }
}

#[cfg(test)]
mod tests {
    use super::{MAX_DEPTH, canonical};

    fn text(body: &str) -> String {
        String::from_utf8(canonical(body.as_bytes()).unwrap_or_else(|| panic!("not read as JSON: {body}"))).unwrap()
    }

    #[test]
    fn http_canonical_json_ignores_whitespace_key_order_and_escapes_only() {
        let a = text(r#"{"amount": 100, "items": [{"b": 1, "a": "x"}], "currency": "eur"}"#);
        let b = text("{\"currency\":\"eur\",\n  \"items\":[ {\"a\":\"\\u0078\",\"b\":1} ],\"amount\":100}");
        assert_eq!(a, b);
        assert_eq!(a, r#"{"amount":100,"currency":"eur","items":[{"a":"x","b":1}]}"#);
        assert_eq!(text(r#""\ud83d\ude00 \/ \t""#), "\"\u{1f600} / \\t\"");
        assert_eq!(text(" [ true , false , null , { } , [ ] ] "), "[true,false,null,{},[]]");
        assert_ne!(text("[1,2]"), text("[2,1]"), "array order is meaning");
        assert_eq!(text(r#"{"é":1,"e":2,"z":3,"E":4}"#), r#"{"E":4,"e":2,"z":3,"é":1}"#, "keys by code point");
    }

    #[test]
    fn http_canonical_json_keeps_every_number_as_written() {
        let distinct = [
            // Beyond an f64's precision: the same f64, different amounts.
            ("12345678901234567.89", "12345678901234567.00"),
            ("0.1", "0.10000000000000001"),
            ("1.0000000000000001", "1.0"),
            // Large: past u64 and i64, and past f64's range.
            ("18446744073709551616", "18446744073709551617"),
            ("-9223372036854775809", "-9223372036854775810"),
            ("123456789012345678901234567890", "123456789012345678901234567891"),
            ("1e400", "1e401"),
            ("-1e400", "1e400"),
            // Negative zero.
            ("-0", "0"),
            ("-0.0", "0.0"),
            ("-0e0", "0e0"),
            // Exponent forms of one value.
            ("1e2", "100"),
            ("1E2", "1e2"),
            ("1e+2", "1e2"),
            ("1e02", "1e2"),
            ("100", "100.0"),
            ("1.5e-3", "0.0015"),
        ];
        for (one, other) in distinct {
            assert_eq!(text(one), one, "kept as written");
            assert_eq!(text(&format!("{{\"amount\": {one} }}")), format!("{{\"amount\":{one}}}"));
            assert_ne!(text(one), text(other), "{one} ~ {other}");
            assert_ne!(text(&format!("[{one}]")), text(&format!("[{other}]")), "{one} ~ {other}");
        }
    }

    #[test]
    fn http_canonical_json_keeps_repeated_keys_apart() {
        assert_eq!(text(r#"{"b":0,"a":1,"a":2}"#), r#"{"a":1,"a":2,"b":0}"#);
        assert_ne!(text(r#"{"a":1,"a":2}"#), text(r#"{"a":2,"a":1}"#));
        assert_ne!(text(r#"{"a":1,"a":2}"#), text(r#"{"a":2}"#));
    }

    #[test]
    fn http_canonical_json_refuses_what_is_not_json() {
        let not_json: [&[u8]; 22] = [
            b"",
            b"not json",
            b"01",
            b"-",
            b"1.",
            b".5",
            b"+1",
            b"1e",
            b"1e+",
            b"0x10",
            b"NaN",
            b"[1,]",
            b"{\"a\":1,}",
            b"{a:1}",
            b"{\"a\" 1}",
            b"[1 2]",
            b"\"unterminated",
            b"\"tab\tin a string\"",
            b"\"\\ud800\"",
            b"\"\\x\"",
            b"\xff\"",
            b"[1] [2]",
        ];
        for body in not_json {
            assert_eq!(canonical(body), None, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn http_canonical_json_bounds_nesting() {
        let nested = |depth: usize| format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
        assert_eq!(text(&nested(MAX_DEPTH)), nested(MAX_DEPTH));
        assert_eq!(canonical(nested(MAX_DEPTH + 1).as_bytes()), None);
        assert_eq!(canonical(nested(100_000).as_bytes()), None, "no stack overflow");
    }
}
