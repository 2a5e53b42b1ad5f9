//! The one string value that holds a record: a header line, then the outcome.
//!
//! ```text
//! idempotent/1 running <token> <fingerprint or ->\n
//! idempotent/1 done <token> <fingerprint or ->\n<outcome>
//! ```
//!
//! `<token>` is the owner token (lowercase hex, 32 digits from [`Token::new`]), `<fingerprint>` the
//! request's fingerprint (64 lowercase hex digits) or `-` when the call has none, and `<outcome>`
//! the encoded outcome, byte for byte (JSON, see the crate docs). A running record ends after the
//! header's newline. The completed record keeps the token that completed it, so a completion
//! retried after a lost reply can tell that it already succeeded.
//!
//! Parsing is strict: anything else (another magic, another state, a missing field, a running
//! record with bytes after its header) is reported as [`StoreError::Corrupt`] naming the key.

use redis::{RedisWrite, ToRedisArgs};

use crate::{Claim, Fingerprint, Record, StoreError, Token};

/// The first word of every value this store writes; the `1` is the format's version.
pub(super) const MAGIC: &str = "idempotent/1";
/// `MAGIC running `, the start of a running record (the owner token follows).
pub(super) const RUNNING: &str = "idempotent/1 running ";
/// `MAGIC done `, the start of a completed record (the completing token follows).
pub(super) const DONE: &str = "idempotent/1 done ";
/// The longest token or fingerprint accepted, in hex digits.
const MAX_HEX: usize = 128;

/// A record's header, `<state><token> <fp|->\n` with `state` [`RUNNING`] or [`DONE`]: the whole
/// running record a claim writes, or the start of the completed record a completion writes
/// ([`Completed`]).
///
/// Written straight into the command's buffer, without an intermediate allocation.
pub(super) struct Header<'a> {
    pub state: &'static str,
    pub token: &'a [u8],
    pub fingerprint: Option<&'a [u8]>,
}

impl Header<'_> {
    /// The header's pieces, in order.
    fn parts(&self) -> [&[u8]; 5] {
        [self.state.as_bytes(), self.token, b" ", self.fingerprint.unwrap_or(b"-"), b"\n"]
    }

    /// Whether `value` is exactly this header: the running record this call's claim wrote, say.
    pub(super) fn is(&self, value: &[u8]) -> bool {
        let mut rest = value;
        for part in self.parts() {
            let Some(tail) = rest.strip_prefix(part) else { return false };
            rest = tail;
        }
        rest.is_empty()
    }
}

impl ToRedisArgs for Header<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        write_arg(out, &self.parts());
    }
}

/// A whole completed record, `<header><outcome>`, written as one argument: what a completion
/// stores.
pub(super) struct Completed<'a> {
    pub header: Header<'a>,
    pub outcome: &'a [u8],
}

impl ToRedisArgs for Completed<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let [state, token, space, fingerprint, newline] = self.header.parts();
        write_arg(out, &[state, token, space, fingerprint, newline, self.outcome]);
    }
}

/// `<prefix> <token> `: what a fenced script compares the start of the stored value with.
pub(super) struct Owned<'a> {
    pub state: &'static str,
    pub token: &'a [u8],
}

impl ToRedisArgs for Owned<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        write_arg(out, &[self.state.as_bytes(), self.token, b" "]);
    }
}

/// Writes `parts`, joined, as the command's next argument.
fn write_arg<W: ?Sized + RedisWrite>(out: &mut W, parts: &[&[u8]]) {
    use std::io::Write as _;
    let mut arg = out.writer_for_next_arg();
    for part in parts {
        // Writing into a Vec cannot fail.
        let _ = arg.write_all(part);
    }
}

/// `true` for the text this store accepts as a token or fingerprint: 1 to 128 lowercase hex
/// digits (so that it can never contain the separators of the header).
pub(super) fn is_hex_field(text: &str) -> bool {
    is_hex_bytes(text.as_bytes())
}

/// [`is_hex_field`] on bytes.
fn is_hex_bytes(bytes: &[u8]) -> bool {
    /// Which bytes are lowercase hex digits: one load per byte (this runs on every claim and
    /// replay, over the token and the fingerprint).
    const HEX: [bool; 256] = {
        let mut table = [false; 256];
        let mut digit = 0;
        while digit < 16 {
            table[b"0123456789abcdef"[digit] as usize] = true;
            digit += 1;
        }
        table
    };
    !bytes.is_empty() && bytes.len() <= MAX_HEX && bytes.iter().all(|&b| HEX[usize::from(b)])
}

/// Refuses an owner token that could not be parsed back from the header. A [`Fingerprint`] needs
/// no check: it only ever holds 64 lowercase hex digits.
pub(super) fn check_token(token: &Token) -> Result<(), StoreError> {
    if token.is_hex32() || is_hex_field(token.as_str()) {
        return Ok(());
    }
    Err(StoreError::backend(
        "redis",
        format!("owner token {:?} is not 1 to 128 lowercase hex digits; use Token::new()", token.as_str()),
    ))
}

/// A record as read back.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Parsed {
    Running { token: Token, fingerprint: Option<Fingerprint> },
    Done(Record),
}

impl Parsed {
    /// What the record means to a claim by `ours`: its own running record (a resent claim whose
    /// first reply was lost) is its claim.
    pub(super) fn into_claim(self, ours: &Token) -> Claim {
        match self {
            Parsed::Running { token, .. } if token == *ours => Claim::Claimed,
            // `SET ... GET` returns the value, not its time to live.
            Parsed::Running { fingerprint, .. } => Claim::InProgress { fingerprint, lease_remaining: None },
            Parsed::Done(record) => Claim::Completed(record),
        }
    }
}

/// Parses a stored value, reusing its buffer for the outcome. `redis_key` names the key in the
/// error, and is only called for one.
///
/// This runs on every replay, so it reads the header by its layout instead of scanning it: the
/// magic and the state are prefixes, and each field's end is looked for first where a token of
/// [`Token::new`] and a [`Fingerprint`] put it (then searched for). The digit checks that follow
/// refuse a field that holds a separator, so the fast path accepts exactly what the search would.
pub(super) fn parse(mut value: Vec<u8>, redis_key: impl Fn() -> Vec<u8>) -> Result<Parsed, StoreError> {
    const MALFORMED: &str = "does not start with `idempotent/1 <state> <token> <fingerprint>`";
    let corrupt = |value: &[u8], what: &str| corrupt(&redis_key(), value, what);
    let Some(after_magic) = value.strip_prefix(MAGIC.as_bytes()).and_then(|rest| rest.strip_prefix(b" ")) else {
        return Err(corrupt(&value, MALFORMED));
    };
    let (running, fields) = if let Some(fields) = after_magic.strip_prefix(b"running ") {
        (true, fields)
    } else if let Some(fields) = after_magic.strip_prefix(b"done ") {
        (false, fields)
    } else {
        return Err(corrupt(&value, "has an unknown state"));
    };
    let Some(token_len) = field_len(fields, b' ', TOKEN_HEX) else {
        return Err(corrupt(&value, MALFORMED));
    };
    let (token, rest) = (&fields[..token_len], &fields[token_len + 1..]);
    if !is_hex_bytes(token) {
        return Err(corrupt(&value, "has a malformed owner token"));
    }
    let fp_len = if rest.starts_with(b"-\n") { Some(1) } else { field_len(rest, b'\n', FINGERPRINT_HEX) };
    let Some(fp_len) = fp_len else { return Err(corrupt(&value, "has no header line")) };
    let fingerprint = match &rest[..fp_len] {
        b"-" => None,
        // `Fingerprint::parse` checks the digits itself.
        fp => match std::str::from_utf8(fp).map(Fingerprint::parse) {
            Ok(Ok(fingerprint)) => Some(fingerprint),
            Ok(Err(e)) => return Err(corrupt(&value, &e.to_string())),
            Err(_) => return Err(corrupt(&value, "has a malformed fingerprint")),
        },
    };
    // `rest` lies inside `value`: its offset, plus the fingerprint, is the newline's index.
    let newline = value.len() - rest.len() + fp_len;
    match running {
        true if value.len() == newline + 1 => {
            // Only hex digits, checked above: always UTF-8.
            let token = std::str::from_utf8(token).unwrap_or_default();
            Ok(Parsed::Running { token: Token::from_stored(token), fingerprint })
        }
        true => Err(corrupt(&value, "is a running record with bytes after its header")),
        false => {
            value.drain(..=newline);
            Ok(Parsed::Done(Record::new(fingerprint, value)))
        }
    }
}

/// The hex digits of a token made by [`Token::new`].
const TOKEN_HEX: usize = 32;
/// The hex digits of a [`Fingerprint`].
const FINGERPRINT_HEX: usize = 64;

/// The length of the field at the start of `bytes` that `end` ends: `usual` if the byte there is
/// `end`, else the position of the first `end` within the longest field accepted.
fn field_len(bytes: &[u8], end: u8, usual: usize) -> Option<usize> {
    if bytes.get(usual) == Some(&end) {
        return Some(usual);
    }
    bytes.iter().take(MAX_HEX + 1).position(|&b| b == end)
}

/// The error for a value this store did not write (or an incompatible version wrote).
pub(super) fn corrupt(redis_key: &[u8], value: &[u8], what: &str) -> StoreError {
    let shown = &value[..value.len().min(80)];
    StoreError::Corrupt(format!(
        "Redis key {:?} {what} (value starts {:?}); it was not written by this store or by a \
         compatible version: inspect it with `redis-cli GET`, then delete it or use another prefix",
        String::from_utf8_lossy(redis_key),
        String::from_utf8_lossy(shown),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    fn written(record: &impl ToRedisArgs) -> Vec<u8> {
        let mut args = record.to_redis_args();
        assert_eq!(args.len(), 1);
        args.remove(0)
    }

    #[test]
    fn redis_records_are_written_in_the_documented_format() {
        let fp = "ab".repeat(32);
        let running = written(&Header { state: RUNNING, token: TOKEN.as_bytes(), fingerprint: Some(fp.as_bytes()) });
        assert_eq!(running, format!("idempotent/1 running {TOKEN} {fp}\n").into_bytes());
        let bare = written(&Header { state: RUNNING, token: TOKEN.as_bytes(), fingerprint: None });
        assert_eq!(bare, format!("idempotent/1 running {TOKEN} -\n").into_bytes());
        assert_eq!(
            written(&Owned { state: DONE, token: TOKEN.as_bytes() }),
            format!("idempotent/1 done {TOKEN} ").into_bytes()
        );
    }

    /// What a native completion compares the value `SET ... GET` returned with: the exact
    /// running record this call's claim wrote, and nothing longer, shorter or else.
    #[test]
    fn redis_headers_match_only_their_exact_bytes() {
        let fp = "ab".repeat(32);
        let header = Header { state: RUNNING, token: TOKEN.as_bytes(), fingerprint: Some(fp.as_bytes()) };
        let exact = written(&header);
        assert!(header.is(&exact));
        assert!(!header.is(&exact[..exact.len() - 1]), "shorter");
        assert!(!header.is(&[exact.as_slice(), b"{}"].concat()), "longer: a completed record's header and outcome");
        assert!(!header.is(b""));
        let done = written(&Header { state: DONE, token: TOKEN.as_bytes(), fingerprint: Some(fp.as_bytes()) });
        assert!(!header.is(&done), "another state");
        let bare = Header { state: RUNNING, token: TOKEN.as_bytes(), fingerprint: None };
        assert!(!bare.is(&exact), "another fingerprint");
        assert!(bare.is(format!("idempotent/1 running {TOKEN} -\n").as_bytes()));
        let other = "1".repeat(32);
        assert!(!header.is(&written(&Header {
            state: RUNNING,
            token: other.as_bytes(),
            fingerprint: Some(fp.as_bytes())
        })));
    }

    #[test]
    fn redis_completed_records_are_the_header_then_the_outcome_in_one_argument() {
        let fp = "cd".repeat(32);
        let header = Header { state: DONE, token: TOKEN.as_bytes(), fingerprint: Some(fp.as_bytes()) };
        let completed = written(&Completed { header, outcome: b"{\"Ok\":7}" });
        assert_eq!(completed, format!("idempotent/1 done {TOKEN} {fp}\n{{\"Ok\":7}}").into_bytes());
        let header = Header { state: DONE, token: TOKEN.as_bytes(), fingerprint: None };
        assert_eq!(written(&Completed { header, outcome: b"" }), format!("idempotent/1 done {TOKEN} -\n").into_bytes());
    }

    #[test]
    fn redis_records_parse_back() {
        let fp = "0f".repeat(32);
        let running = written(&Header { state: RUNNING, token: TOKEN.as_bytes(), fingerprint: Some(fp.as_bytes()) });
        assert_eq!(
            parse(running, || b"k".to_vec()).unwrap(),
            Parsed::Running {
                token: Token::from_stored(TOKEN),
                fingerprint: Some(Fingerprint::parse(fp.as_str()).unwrap())
            }
        );
        let done = format!("idempotent/1 done {TOKEN} -\n{{\"Ok\":\"a\nb\"}}").into_bytes();
        let record = Record::new(None, b"{\"Ok\":\"a\nb\"}".to_vec());
        assert_eq!(parse(done, || b"k".to_vec()).unwrap(), Parsed::Done(record));
        // The outcome is kept byte for byte, even when it is not UTF-8.
        let mut binary = format!("idempotent/1 done {TOKEN} {fp}\n").into_bytes();
        binary.extend_from_slice(b"\xff\x00");
        let Parsed::Done(record) = parse(binary, || b"k".to_vec()).unwrap() else { panic!() };
        assert_eq!(record.outcome, &b"\xff\x00"[..]);
        // A token of another length (not from `Token::new`) is found by the search, not the fast path.
        let long = "0123456789abcdef0123456789abcdef01234567";
        let running = written(&Header { state: RUNNING, token: long.as_bytes(), fingerprint: None });
        let parsed = parse(running, || b"k".to_vec()).unwrap();
        assert_eq!(parsed, Parsed::Running { token: Token::from_stored(long), fingerprint: None });
        let done = format!("idempotent/1 done {long} {fp}\n42").into_bytes();
        let Parsed::Done(record) = parse(done, || b"k".to_vec()).unwrap() else { panic!() };
        assert_eq!(
            (record.fingerprint, &record.outcome[..]),
            (Some(Fingerprint::parse(fp.as_str()).unwrap()), &b"42"[..])
        );
    }

    #[test]
    fn redis_foreign_values_are_corrupt_and_name_the_key() {
        let bad: &[&[u8]] = &[
            b"",
            b"1",
            b"not ours",
            b"idempotent/1 running\n",
            b"idempotent/2 done 0a -\n{}",
            b"idempotent/1 finished 0a -\n{}",
            b"idempotent/1 running 0A -\n",
            b"idempotent/1 running 0a  -\n",
            b"idempotent/1 running 0a -\nextra",
            b"idempotent/1 done 0a xyz\n{}",
            b"idempotent/1 done 0a - more\n{}",
            b"idempotent/1 done \xff -\n{}",
            // Separators where the fast path looks, inside a field the digit checks refuse.
            b"idempotent/1 done 0123456789abcdef0123456789abcde\n -\n{}",
            b"idempotent/1 done 0123456789abcdef0123456789abcdef -x\n{}",
            b"idempotent/1 done 0123456789abcdef0123456789abcdef 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcde \n{}",
            b"idempotent/1 done 0123456789abcdef0123456789abcdef -",
        ];
        for value in bad {
            match parse(value.to_vec(), || b"app:s:k".to_vec()) {
                Err(StoreError::Corrupt(message)) => {
                    assert!(message.contains("\"app:s:k\"") && message.contains("redis-cli GET"), "{message}");
                }
                other => panic!("{:?} parsed as {other:?}", String::from_utf8_lossy(value)),
            }
        }
    }

    #[test]
    fn redis_tokens_and_fingerprints_must_be_hex() {
        assert!(check_token(&Token::new()).is_ok());
        // Tokens of another form are read digit by digit.
        assert!(check_token(&Token::from_stored("0a")).is_ok());
        assert!(check_token(&Token::from_stored("ab".repeat(MAX_HEX / 2))).is_ok());
        assert!(check_token(&Token::from_stored("0A")).is_err());
        assert!(check_token(&Token::from_stored("a b")).is_err());
        assert!(check_token(&Token::from_stored("")).is_err());
        assert!(!is_hex_field(&"a".repeat(MAX_HEX + 1)));
    }
}
