//! Idempotency keys: what may be a key, how it is validated, and how it is scoped.

use std::fmt::Write as _;

/// The longest key accepted, in bytes (the same cap as Stripe's).
pub const MAX_KEY_BYTES: usize = 255;

/// A value that can serve as an idempotency key.
///
/// Implemented for strings, integers, [`uuid::Uuid`] and references or smart pointers to them.
/// Implement it for your own key types by writing a stable textual form:
///
/// ```
/// use idempotent_runtime::IdempotencyKey;
///
/// struct OrderNo(u64);
///
/// impl IdempotencyKey for OrderNo {
///     fn write_key(&self, out: &mut String) {
///         self.0.write_key(out);
///     }
/// }
/// ```
///
/// The text must not change between releases of your program, or retries would run again.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be used as an idempotency key",
    label = "not a key type",
    note = "keys are strings, integers or UUIDs; implement `IdempotencyKey` for your own type, or build a string with `format!`; an HTTP `IdempotencyKeyHeader` becomes a key with `.for_caller(&user)` or `.shared_by_all_callers()`"
)]
pub trait IdempotencyKey {
    /// Appends this key's text to `out`.
    fn write_key(&self, out: &mut String);

    /// Writes the same text as [`write_key`](IdempotencyKey::write_key) into the start of `out`
    /// and returns its length, or returns `None` (then `write_key` is used): the library's key
    /// types write short keys straight into a [`Key`]'s inline bytes. Not for other types.
    #[doc(hidden)]
    fn write_key_into(&self, out: &mut [u8]) -> Option<usize> {
        let _ = out;
        None
    }
}

/// Copies `text` into the start of `out`, if it fits.
fn copy_into(text: &str, out: &mut [u8]) -> Option<usize> {
    out.get_mut(..text.len())?.copy_from_slice(text.as_bytes());
    Some(text.len())
}

impl IdempotencyKey for str {
    fn write_key(&self, out: &mut String) {
        out.push_str(self);
    }

    fn write_key_into(&self, out: &mut [u8]) -> Option<usize> {
        copy_into(self, out)
    }
}

impl IdempotencyKey for String {
    fn write_key(&self, out: &mut String) {
        out.push_str(self);
    }

    fn write_key_into(&self, out: &mut [u8]) -> Option<usize> {
        copy_into(self, out)
    }
}

impl IdempotencyKey for std::borrow::Cow<'_, str> {
    fn write_key(&self, out: &mut String) {
        out.push_str(self);
    }

    fn write_key_into(&self, out: &mut [u8]) -> Option<usize> {
        copy_into(self, out)
    }
}

impl IdempotencyKey for uuid::Uuid {
    fn write_key(&self, out: &mut String) {
        let _ = write!(out, "{}", self.hyphenated());
    }

    fn write_key_into(&self, out: &mut [u8]) -> Option<usize> {
        copy_into(self.hyphenated().encode_lower(&mut uuid::Uuid::encode_buffer()), out)
    }
}

/// Integers are written in decimal by `itoa`, without `fmt` (a key is made on every call, and
/// `write!` is most of the cost of a small one).
macro_rules! integer_keys {
    ($($t:ty),*) => {$(
        impl IdempotencyKey for $t {
            fn write_key(&self, out: &mut String) {
                out.push_str(itoa::Buffer::new().format(*self));
            }

            fn write_key_into(&self, out: &mut [u8]) -> Option<usize> {
                copy_into(itoa::Buffer::new().format(*self), out)
            }
        }
    )*};
}
integer_keys!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize);

/// Forwards both methods to the pointee.
macro_rules! pointer_keys {
    ($($pointer:ty),*) => {$(
        impl<T: IdempotencyKey + ?Sized> IdempotencyKey for $pointer {
            fn write_key(&self, out: &mut String) {
                (**self).write_key(out);
            }

            fn write_key_into(&self, out: &mut [u8]) -> Option<usize> {
                (**self).write_key_into(out)
            }
        }
    )*};
}
pointer_keys!(&T, Box<T>, std::sync::Arc<T>);

/// Why a key or scope was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is the empty string.
    #[error("the key is empty; pass a non-empty key such as a request id")]
    Empty,
    /// The key is longer than [`MAX_KEY_BYTES`].
    #[error("the key is {len} bytes long, over the limit of {MAX_KEY_BYTES}; use a shorter key such as a UUID")]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The key holds a control character (such as NUL or a newline), which no store keeps reliably.
    #[error("the key holds the control character {ch:?} at byte {at}; keys must be printable text")]
    ControlCharacter {
        /// The character.
        ch: char,
        /// Its byte offset.
        at: usize,
    },
    /// The scope is empty, longer than [`MAX_KEY_BYTES`], or holds a `:` or a control character.
    #[error(
        "the scope {0:?} is invalid: it must be non-empty printable text of at most 255 bytes without ':'; \
         set `scope = \"...\"` (or pass another scope to `Call::new`)"
    )]
    InvalidScope(String),
}

/// A checked scope: a key's namespace, checked once and used for many keys.
///
/// A scope is non-empty text of at most [`MAX_KEY_BYTES`] bytes without `:` or a control
/// character. [`Key::new`] and [`Call::new`](crate::Call::new) check the scope they are given on
/// every call; a `Scope` made once (a `const` for a literal) saves that check, which is what the
/// attribute does with `scope = "..."`.
///
/// ```
/// use idempotent_runtime::{Key, Scope};
///
/// const PAYMENTS: Scope<'static> = Scope::from_static("payments");
/// let key = Key::in_scope(PAYMENTS, &"req-42").unwrap();
/// assert_eq!(key.as_str(), "payments:req-42");
/// assert!(Scope::new("pay:ments").is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scope<'a>(&'a str);

impl<'a> Scope<'a> {
    /// Checks `scope`.
    ///
    /// # Errors
    ///
    /// [`KeyError::InvalidScope`] if it is empty, longer than [`MAX_KEY_BYTES`], or holds `:` or
    /// a control character.
    pub fn new(scope: &'a str) -> Result<Self, KeyError> {
        validate_scope(scope)?;
        Ok(Scope(scope))
    }

    /// Checks a literal scope at compile time when used in a `const`.
    ///
    /// # Panics
    ///
    /// If the scope is empty, longer than [`MAX_KEY_BYTES`], or holds `:` or a control character:
    /// in a `const`, that is a compile error.
    #[must_use]
    pub const fn from_static(scope: &'static str) -> Scope<'static> {
        assert!(
            valid_scope_bytes(scope.as_bytes()),
            "a scope is non-empty text of at most 255 bytes, without ':' or a control character"
        );
        Scope(scope)
    }

    /// The scope's text.
    #[must_use]
    pub const fn as_str(&self) -> &'a str {
        self.0
    }

    /// A scope this crate checked when it was set (an HTTP or gRPC layer's, kept as a `String`).
    #[cfg(feature = "axum")]
    pub(crate) fn checked_before(scope: &'a str) -> Self {
        debug_assert!(validate_scope(scope).is_ok(), "{scope:?} was not checked");
        Scope(scope)
    }
}

/// The scope rule, byte by byte (a `const` can use it). In UTF-8 a control
/// character (`char::is_control`: U+0000 to U+001F and U+007F to U+009F) is a byte below 0x20,
/// 0x7f, or 0xc2 followed by 0x80 to 0x9f.
const fn valid_scope_bytes(bytes: &[u8]) -> bool {
    if bytes.is_empty() || bytes.len() > MAX_KEY_BYTES {
        return false;
    }
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        let c1_control = byte == 0xc2 && i + 1 < bytes.len() && bytes[i + 1] >= 0x80 && bytes[i + 1] <= 0x9f;
        if byte < 0x20 || byte == 0x7f || byte == b':' || c1_control {
            return false;
        }
        i += 1;
    }
    true
}

/// A validated key inside its scope, as stores see it: `scope:key`.
///
/// The scope holds no `:`, so the first `:` always separates the two parts and no user key can
/// reach into another scope.
///
/// A key of up to 69 bytes (`scope:key` together) is held inline, so making, copying and storing
/// one allocates nothing; longer keys are boxed. 69 bytes hold a UUID in a scope of up to 32
/// bytes, which covers most default scopes (`shop.payments.deduct_balance`).
#[derive(Clone)]
pub struct Key {
    repr: Repr,
}

/// The longest `scope:key` held inline (a 72-byte `Key`). Not more: with 77 (an 80-byte `Key`),
/// the HTTP layer's request future was copied twice more per request, 3,568 bytes each (about
/// 750 instructions per first request and 1,000 per replay, BENCHMARKS.md), which cost more than
/// the caller-bound keys (74 bytes with a UUID) it would have held inline saved.
const INLINE: usize = 69;

#[derive(Clone)]
enum Repr {
    /// `scope:key` in the first `len` bytes; the scope is the first `scope_len`.
    Inline { scope_len: u8, len: u8, bytes: [u8; INLINE] },
    /// A longer `scope:key`.
    Boxed { scope_len: u8, text: Box<str> },
}

thread_local! {
    /// Where keys are written before they are stored (`IdempotencyKey` writes into a `String`):
    /// reused, so a key costs no allocation.
    static BUFFER: std::cell::Cell<String> = const { std::cell::Cell::new(String::new()) };
}

/// The largest buffer kept for the next key (a key that failed validation may be huge).
const KEPT_BUFFER: usize = 1024;

impl Key {
    /// Validates `key` and places it in `scope`.
    ///
    /// ```
    /// use idempotent_runtime::Key;
    ///
    /// let key = Key::new("payments", &"req-42").unwrap();
    /// assert_eq!(key.as_str(), "payments:req-42");
    /// assert_eq!(key.scope(), "payments");
    /// assert_eq!(key.key(), "req-42");
    /// assert!(Key::new("payments", &"").is_err());
    /// ```
    pub fn new(scope: &str, key: &(impl IdempotencyKey + ?Sized)) -> Result<Self, KeyError> {
        Self::in_scope(Scope::new(scope)?, key)
    }

    /// Validates `key` and places it in `scope`, checked before.
    ///
    /// # Errors
    ///
    /// If the key is empty, longer than [`MAX_KEY_BYTES`], or holds a control character.
    pub fn in_scope(scope: Scope<'_>, key: &(impl IdempotencyKey + ?Sized)) -> Result<Self, KeyError> {
        let scope = scope.as_str();
        if let Some(key) = Self::inline(scope, key) {
            return Ok(key);
        }
        // Taken out while the key writes itself (a key type whose `write_key` makes a key finds an
        // empty buffer and allocates its own).
        let mut full = BUFFER.try_with(std::cell::Cell::take).unwrap_or_default();
        full.clear();
        full.push_str(scope);
        full.push(':');
        key.write_key(&mut full);
        let made = Self::checked(&full, scope.len());
        if full.capacity() <= KEPT_BUFFER {
            let _ = BUFFER.try_with(|buffer| buffer.set(full));
        }
        made
    }

    /// The key written straight into inline bytes, when its type can ([`IdempotencyKey::write_key_into`]),
    /// it fits and it is non-empty printable ASCII; `None` sends every other case (errors
    /// included) through the general path.
    fn inline(scope: &str, key: &(impl IdempotencyKey + ?Sized)) -> Option<Self> {
        let mut bytes = [0; INLINE];
        bytes.get_mut(..scope.len())?.copy_from_slice(scope.as_bytes());
        *bytes.get_mut(scope.len())? = b':';
        let written = key.write_key_into(bytes.get_mut(scope.len() + 1..)?)?;
        let len = scope.len() + 1 + written;
        let user = &bytes[scope.len() + 1..len];
        if user.is_empty() || !printable_ascii(user) {
            return None;
        }
        let scope_len = u8::try_from(scope.len()).ok()?;
        Some(Key { repr: Repr::Inline { scope_len, len: u8::try_from(len).ok()?, bytes } })
    }

    /// `full` (`scope:key`, the scope `scope_len` bytes long and valid) as a key, if the key is.
    fn checked(full: &str, scope_len: usize) -> Result<Self, KeyError> {
        let user = &full[scope_len + 1..];
        if user.is_empty() {
            return Err(KeyError::Empty);
        }
        if user.len() > MAX_KEY_BYTES {
            return Err(KeyError::TooLong { len: user.len() });
        }
        // Printable ASCII, the usual key, is checked a word at a time; other text by character.
        if !printable_ascii(user.as_bytes())
            && let Some((at, ch)) = user.char_indices().find(|(_, c)| c.is_control())
        {
            return Err(KeyError::ControlCharacter { ch, at });
        }
        // The scope is at most MAX_KEY_BYTES (255) long: `validate_scope`.
        let scope_len = u8::try_from(scope_len).unwrap_or(u8::MAX);
        let repr = match u8::try_from(full.len()) {
            Ok(len) if full.len() <= INLINE => {
                let mut bytes = [0; INLINE];
                bytes[..full.len()].copy_from_slice(full.as_bytes());
                Repr::Inline { scope_len, len, bytes }
            }
            _ => Repr::Boxed { scope_len, text: full.into() },
        };
        Ok(Key { repr })
    }

    /// `scope:key`, the text stores index by.
    #[must_use]
    pub fn as_str(&self) -> &str {
        match &self.repr {
            // Copied from a `str` whole: always UTF-8.
            Repr::Inline { len, bytes, .. } => std::str::from_utf8(&bytes[..usize::from(*len)]).unwrap_or_default(),
            Repr::Boxed { text, .. } => text,
        }
    }

    /// `scope:key` as bytes, without the UTF-8 check `as_str` makes of an inline key (for
    /// hashing and comparing).
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match &self.repr {
            Repr::Inline { len, bytes, .. } => &bytes[..usize::from(*len)],
            Repr::Boxed { text, .. } => text.as_bytes(),
        }
    }

    fn scope_len(&self) -> usize {
        match &self.repr {
            Repr::Inline { scope_len, .. } | Repr::Boxed { scope_len, .. } => usize::from(*scope_len),
        }
    }

    /// The scope part.
    #[must_use]
    pub fn scope(&self) -> &str {
        &self.as_str()[..self.scope_len()]
    }

    /// The scope as bytes, without the UTF-8 check `scope` makes of an inline key.
    pub(crate) fn scope_bytes(&self) -> &[u8] {
        &self.as_bytes()[..self.scope_len()]
    }

    /// Held inline, without an allocation of its own.
    #[cfg(test)]
    pub(crate) fn is_inline(&self) -> bool {
        matches!(self.repr, Repr::Inline { .. })
    }

    /// The caller's key part.
    #[must_use]
    pub fn key(&self) -> &str {
        &self.as_str()[self.scope_len() + 1..]
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        // The scope holds no `:`, so equal text means equal scopes.
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Key {}

impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Key").field("full", &self.as_str()).field("scope_len", &self.scope_len()).finish()
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The scope rule, at run time: a scope is checked once (`Scope::new`), not per call, so the
/// `const` rule serves both.
fn validate_scope(scope: &str) -> Result<(), KeyError> {
    if !valid_scope_bytes(scope.as_bytes()) {
        return Err(KeyError::InvalidScope(scope.to_owned()));
    }
    Ok(())
}

/// Whether every byte is printable ASCII (0x20 to 0x7e), eight bytes at a time: a UUID key is
/// 36 bytes, checked on every call.
#[inline]
fn printable_ascii(bytes: &[u8]) -> bool {
    /// `0x01` in every byte of a word.
    const ONES: u64 = u64::MAX / 255;
    const HIGH_BITS: u64 = ONES * 0x80;
    // Whether a byte of `word` is below `n` (at most 0x80), or is 0: exact as a yes or no,
    // since a borrow only crosses out of a byte that is itself below `n`.
    let any_below = |word: u64, n: u64| word.wrapping_sub(ONES * n) & !word & HIGH_BITS != 0;
    let (words, rest) = bytes.as_chunks::<8>();
    words.iter().all(|chunk| {
        let word = u64::from_le_bytes(*chunk);
        word & HIGH_BITS == 0 && !any_below(word, 0x20) && !any_below(word ^ (ONES * 0x7f), 1)
    }) && rest.iter().all(|b| (0x20..0x7f).contains(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Scope::from_static`'s byte rule (for a `const`) refuses exactly what `Scope::new` refuses,
    /// which is also the attribute's check of `scope = "..."`: no scope that the attribute takes
    /// fails its `const`, and none that `Scope::new` refuses passes it.
    #[test]
    fn memory_const_scopes_follow_the_same_rule() {
        let chars = (0..0x300u32).chain([0x2028, 0x200b, 0xfeff, 0xfffd, 0x1_f600]).filter_map(char::from_u32);
        for c in chars {
            for text in [c.to_string(), format!("pay{c}"), format!("{c}x.y"), format!("a{c}{c}b")] {
                let attribute = !text.chars().any(|c| c == ':' || c.is_control());
                assert_eq!(valid_scope_bytes(text.as_bytes()), attribute, "{text:?}");
                assert_eq!(Scope::new(&text).is_ok(), attribute, "{text:?}");
            }
        }
        for (text, valid) in [(String::new(), false), ("s".repeat(MAX_KEY_BYTES), true), ("s".repeat(256), false)] {
            assert_eq!(valid_scope_bytes(text.as_bytes()), valid, "{} bytes", text.len());
            assert_eq!(Scope::new(&text).is_ok(), valid, "{} bytes", text.len());
        }
        let pay = const { Scope::from_static("shop.pay") };
        assert_eq!(Key::in_scope(pay, &7u8).unwrap(), Key::new("shop.pay", &7u8).unwrap());
        let refused = std::panic::catch_unwind(|| Scope::from_static("a:b"));
        assert!(refused.is_err(), "outside a `const`, a bad literal panics");
    }

    /// The word-at-a-time check agrees with the byte-by-byte one for every byte value at every
    /// position of texts of 1 to 24 bytes.
    #[test]
    fn memory_key_bytes_are_checked_alike_a_word_at_a_time() {
        let plain = |bytes: &[u8]| bytes.iter().all(|b| (0x20..0x7f).contains(b));
        for len in 1..=24 {
            let good: Vec<u8> = b"shop.payments_v2 Pay-Now~".iter().copied().cycle().take(len).collect();
            assert!(printable_ascii(&good), "{good:?}");
            for at in 0..len {
                for byte in 0..=255u8 {
                    let mut bytes = good.clone();
                    bytes[at] = byte;
                    assert_eq!(printable_ascii(&bytes), plain(&bytes), "{bytes:?}");
                }
            }
        }
    }

    #[test]
    fn memory_keys_are_validated() {
        assert_eq!(Key::new("s", &"").unwrap_err(), KeyError::Empty);
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        assert_eq!(Key::new("s", &long).unwrap_err(), KeyError::TooLong { len: 256 });
        assert!(Key::new("s", &"k".repeat(MAX_KEY_BYTES)).is_ok());
        assert_eq!(Key::new("s", &"a\0b").unwrap_err(), KeyError::ControlCharacter { ch: '\0', at: 1 });
        assert!(matches!(Key::new("a:b", &"k"), Err(KeyError::InvalidScope(_))));
        assert!(matches!(Key::new("", &"k"), Err(KeyError::InvalidScope(_))));
    }

    #[test]
    fn memory_keys_of_every_kind() {
        assert_eq!(Key::new("s", &42u64).unwrap().key(), "42");
        assert_eq!(Key::new("s", &-7i32).unwrap().key(), "-7");
        for (value, text) in
            [(0i64, "0"), (9, "9"), (10, "10"), (i64::MIN, "-9223372036854775808"), (i64::MAX, "9223372036854775807")]
        {
            assert_eq!(Key::new("s", &value).unwrap().key(), text);
        }
        assert_eq!(Key::new("s", &u128::MAX).unwrap().key(), u128::MAX.to_string());
        assert_eq!(Key::new("s", &i128::MIN).unwrap().key(), i128::MIN.to_string());
        assert_eq!(Key::new("s", &u8::MAX).unwrap().key(), "255");
        assert_eq!(Key::new("s", &i8::MIN).unwrap().key(), "-128");
        assert_eq!(Key::new("s", &String::from("x")).unwrap().key(), "x");
        let id = uuid::Uuid::nil();
        assert_eq!(Key::new("s", &id).unwrap().key(), "00000000-0000-0000-0000-000000000000");
        assert_eq!(Key::new("s", &"ключ:1").unwrap().as_str(), "s:ключ:1");
    }

    #[test]
    fn memory_keys_written_inline_equal_keys_written_to_a_string() {
        /// Writes its key only through `write_key` (the general path).
        struct General<T>(T);
        impl<T: IdempotencyKey> IdempotencyKey for General<T> {
            fn write_key(&self, out: &mut String) {
                self.0.write_key(out);
            }
        }
        fn same<T: IdempotencyKey>(scope: &str, key: T) {
            let fast = Key::new(scope, &key);
            let general = Key::new(scope, &General(key));
            assert_eq!(fast, general);
            if let Ok(key) = fast {
                assert_eq!((key.as_str(), key.scope_len()), (general.unwrap().as_str(), scope.len()));
            }
        }
        for scope in ["s", "payments", &"p".repeat(59), &"p".repeat(60), &"p".repeat(200)] {
            same(scope, 0u64);
            same(scope, u128::MAX);
            same(scope, i128::MIN);
            same(scope, -1i8);
            same(scope, "req-1");
            same(scope, "");
            same(scope, "a\0b");
            same(scope, "ключ");
            same(scope, "k".repeat(55));
            same(scope, "k".repeat(256));
            same(scope, String::from("owned"));
            same(scope, std::borrow::Cow::Borrowed("cow"));
            same(scope, Box::new(7u32));
            same(scope, std::sync::Arc::new("arc"));
            same(scope, uuid::Uuid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef));
        }
    }

    #[test]
    fn memory_a_uuid_in_a_scope_of_up_to_32_bytes_is_held_inline() {
        let uuid = uuid::Uuid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef);
        let text = uuid.to_string();
        for scope in ["shop.payments.deduct_balance", &"s".repeat(32)] {
            assert!(Key::new(scope, &uuid).unwrap().is_inline(), "{scope}");
            assert!(Key::new(scope, &text).unwrap().is_inline(), "{scope}");
        }
        assert!(!Key::new(&"s".repeat(33), &text).unwrap().is_inline());
    }

    #[test]
    fn memory_keys_inline_and_boxed_read_the_same() {
        // A key type that makes a key while it writes itself (checked at the end).
        struct Nested;
        impl IdempotencyKey for Nested {
            fn write_key(&self, out: &mut String) {
                out.push_str(Key::new("inner", &"1").unwrap().key());
            }
        }
        // `scope:` is 6 bytes: the last inline key and the first boxed one are among these.
        for len in [1, 50, INLINE - 7, INLINE - 6, INLINE - 5, 200, MAX_KEY_BYTES] {
            let text = "k".repeat(len);
            let key = Key::new("scope", &text).unwrap();
            assert_eq!(key.as_str(), format!("scope:{text}"));
            assert_eq!((key.scope(), key.key()), ("scope", text.as_str()));
            assert_eq!(key.as_bytes(), key.as_str().as_bytes());
            assert_eq!(key.clone(), key);
            assert_ne!(Key::new("scope", &format!("{}x", &text[1..])).unwrap(), key);
        }
        assert_eq!(Key::new("outer", &Nested).unwrap().as_str(), "outer:1");
        let long = "ü".repeat(100);
        assert_eq!(Key::new(&"s".repeat(MAX_KEY_BYTES), &long).unwrap().key(), long);
    }
}
