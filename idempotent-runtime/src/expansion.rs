//! What the `#[idempotent]` expansion calls besides [`Call`](crate::Call): checks shaped so that a
//! mistake is reported once, at the user's token, in words that say what to change. Reached
//! through `__private`; not a public API.

use core::marker::PhantomData;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{Error, RecordErrors, RecordErrorsIf, Store};

/// Resolves `store = ...` by method call: a value that is not a store is reported once, at the
/// option, and the failed lookup keeps rustc from reporting it again at each later use.
pub trait AsStore: Store {
    /// The store itself.
    fn idempotent_store(&self) -> &Self {
        self
    }
}

impl<S: Store + ?Sized> AsStore for S {}

/// The error type of the function's `Result`, however the return type is spelled.
pub trait ResultType {
    /// `E` of `Result<T, E>`.
    type Err;
}

impl<T, E> ResultType for Result<T, E> {
    type Err = E;
}

/// An error type that can carry the idempotency errors (in progress, key reused, store down).
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` cannot return its errors through `{Self}`: it does not implement `From<idempotent_runtime::Error>`",
    label = "the error type of this `Result` must implement `From<idempotent_runtime::Error>`",
    note = "return `Result<T, E>` with an `E` that has `impl From<idempotent_runtime::Error>` (or `idempotent_runtime::Error` itself); \
            `io::Result<T>` and one-parameter `Result` aliases fix `E` to a type that may not"
)]
pub trait CarriesErrors: From<Error> {}

impl<E: From<Error>> CarriesErrors for E {}

/// Checks, before the call, that the function's error type carries [`Error`].
pub const fn check_result<R: ResultType>()
where
    R::Err: CarriesErrors,
{
}

/// The function's return type, named so that `record_err` is checked against its error type at
/// the option, and a `record_err = <fn>` closure has its argument type inferred.
pub struct Output<R>(PhantomData<fn() -> R>);

#[allow(clippy::new_without_default)] // only the expansion makes one
impl<R> Output<R> {
    /// The marker; it holds nothing.
    #[must_use]
    pub const fn new() -> Self {
        Output(PhantomData)
    }
}

/// `record_err`: recording errors needs `E: Serialize + DeserializeOwned`. A method (not a
/// function) so that an unserialisable `E` is one error, at the option.
pub trait RecordsErrors<E> {
    /// `record_err` / `record_err = true`.
    fn record_errors(self) -> RecordErrors;
    /// `record_err = <predicate>`.
    fn record_errors_if<F: Fn(&E) -> bool>(self, predicate: F) -> RecordErrorsIf<F>;
}

impl<T, E: Serialize + DeserializeOwned> RecordsErrors<E> for Output<Result<T, E>> {
    fn record_errors(self) -> RecordErrors {
        RecordErrors
    }

    fn record_errors_if<F: Fn(&E) -> bool>(self, predicate: F) -> RecordErrorsIf<F> {
        RecordErrorsIf(predicate)
    }
}
