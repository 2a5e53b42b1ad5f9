//! The recorded-outcome format and the choice of which errors are recorded.
//!
//! An outcome is stored as JSON, one of:
//! `{"Ok": <value>}`, `{"Err": <error>}` (only when errors are recorded), or
//! `{"Unrecordable": "<reason>"}` (the call ran but its result could not be recorded).

use serde::de::{DeserializeOwned, IgnoredAny};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub(crate) enum Outcome<T, E> {
    Ok(T),
    Err(E),
    Unrecordable(String),
}

/// What a replay decoded.
pub(crate) enum Replayed<T, E> {
    Value(Result<T, E>),
    Unrecordable(String),
}

/// Decides which `Err` results are recorded (and replayed) and which release the key for a retry.
///
/// The attribute's `record_err` option picks one: [`ReleaseErrors`] (the default),
/// [`RecordErrors`] with `record_err = true`, or [`RecordErrorsIf`] with `record_err = some_fn`.
pub trait ErrorPolicy<E> {
    /// Encodes `error` for recording, or returns `None` to release the claim instead.
    fn encode(&self, error: &E) -> Option<Result<Vec<u8>, serde_json::Error>>;

    /// Decodes a recorded error.
    fn decode(&self, outcome: &[u8]) -> Result<Option<E>, serde_json::Error>;
}

/// Never records an `Err`: the claim is released so a retry runs the body again.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReleaseErrors;

/// Records every `Err`, so retries replay it. Use it when the function's errors are final.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordErrors;

/// Records the errors for which the predicate says `true` (final errors) and releases the others.
///
/// ```
/// use idempotent_runtime::RecordErrorsIf;
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// enum PayError { Insufficient, Timeout }
///
/// let policy = RecordErrorsIf(|e: &PayError| matches!(e, PayError::Insufficient));
/// # let _ = policy;
/// ```
#[derive(Debug, Clone, Copy)]
pub struct RecordErrorsIf<F>(pub F);

impl<E> ErrorPolicy<E> for ReleaseErrors {
    fn encode(&self, _: &E) -> Option<Result<Vec<u8>, serde_json::Error>> {
        None
    }

    fn decode(&self, _: &[u8]) -> Result<Option<E>, serde_json::Error> {
        Ok(None)
    }
}

impl<E: Serialize + DeserializeOwned> ErrorPolicy<E> for RecordErrors {
    fn encode(&self, error: &E) -> Option<Result<Vec<u8>, serde_json::Error>> {
        Some(serde_json::to_vec(&Outcome::<(), &E>::Err(error)))
    }

    fn decode(&self, outcome: &[u8]) -> Result<Option<E>, serde_json::Error> {
        match serde_json::from_slice::<Outcome<IgnoredAny, E>>(outcome)? {
            Outcome::Err(e) => Ok(Some(e)),
            _ => Ok(None),
        }
    }
}

impl<E: Serialize + DeserializeOwned, F: Fn(&E) -> bool> ErrorPolicy<E> for RecordErrorsIf<F> {
    fn encode(&self, error: &E) -> Option<Result<Vec<u8>, serde_json::Error>> {
        if (self.0)(error) { RecordErrors.encode(error) } else { None }
    }

    fn decode(&self, outcome: &[u8]) -> Result<Option<E>, serde_json::Error> {
        <RecordErrors as ErrorPolicy<E>>::decode(&RecordErrors, outcome)
    }
}

pub(crate) fn encode_ok<T: Serialize>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(&Outcome::<&T, ()>::Ok(value))
}

/// How an `Ok` outcome starts: `{"Ok":`, then the value and `}`.
const OK_PREFIX: &[u8] = br#"{"Ok":"#;

thread_local! {
    /// A buffer for the next call's outcome: a call encodes into it and gives it back once the
    /// store has copied the outcome ([`recycle`]), so a small outcome costs no allocation.
    static BUFFER: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The largest buffer kept for the next outcome.
const KEPT_BUFFER: usize = 4096;

/// Like [`encode_ok`], into this thread's spare buffer (see [`recycle`]).
pub(crate) fn encode_ok_reusing<T: Serialize>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let mut buffer = BUFFER.try_with(std::cell::Cell::take).unwrap_or_default();
    buffer.clear();
    // What serde_json writes for `Outcome::Ok(value)`, with the variant's name written as it is
    // (not through the string escaper).
    buffer.extend_from_slice(OK_PREFIX);
    serde_json::to_writer(&mut buffer, value)?;
    buffer.push(b'}');
    Ok(buffer)
}

/// Keeps `buffer` (an outcome the store has copied) for the next call's outcome, unless it is large.
pub(crate) fn recycle(buffer: Vec<u8>) {
    if buffer.capacity() <= KEPT_BUFFER {
        let _ = BUFFER.try_with(|spare| spare.set(buffer));
    }
}

pub(crate) fn encode_unrecordable(reason: &str) -> Vec<u8> {
    serde_json::to_vec(&Outcome::<(), ()>::Unrecordable(reason.to_owned())).unwrap_or_default()
}

/// Decodes a recorded outcome: `Ok` values directly, errors through the policy.
pub(crate) fn decode<T: DeserializeOwned, E>(
    outcome: &[u8],
    policy: &impl ErrorPolicy<E>,
) -> Result<Replayed<T, E>, String> {
    // What `encode_ok` writes, `{"Ok":<value>}`, read as the value alone (the common replay);
    // anything else takes the general path below.
    if let Some(value) = outcome.strip_prefix(OK_PREFIX).and_then(|rest| rest.strip_suffix(b"}"))
        && let Ok(value) = serde_json::from_slice::<T>(value)
    {
        return Ok(Replayed::Value(Ok(value)));
    }
    match serde_json::from_slice::<Outcome<T, IgnoredAny>>(outcome) {
        Ok(Outcome::Ok(value)) => Ok(Replayed::Value(Ok(value))),
        Ok(Outcome::Unrecordable(reason)) => Ok(Replayed::Unrecordable(reason)),
        Ok(Outcome::Err(_)) => match policy.decode(outcome) {
            Ok(Some(error)) => Ok(Replayed::Value(Err(error))),
            Ok(None) => Err("an error was recorded, but this function does not record errors (record_err)".into()),
            Err(e) => Err(e.to_string()),
        },
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_ok_outcomes_are_encoded_as_serde_writes_them() {
        #[derive(Serialize)]
        struct Receipt<'a> {
            id: u64,
            note: &'a str,
            tags: Vec<&'a str>,
        }
        let receipt = Receipt { id: 7, note: "a \"quoted\" note\n", tags: vec!["x", "ü"] };
        for _ in 0..2 {
            let reused = encode_ok_reusing(&receipt).unwrap();
            assert_eq!(reused, encode_ok(&receipt).unwrap());
            recycle(reused);
        }
        assert_eq!(encode_ok_reusing(&42u64).unwrap(), br#"{"Ok":42}"#);
        assert_eq!(encode_ok_reusing(&"s").unwrap(), encode_ok(&"s").unwrap());
        assert_eq!(encode_ok_reusing(&()).unwrap(), encode_ok(&()).unwrap());
    }
}
