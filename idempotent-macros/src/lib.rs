//! The `#[idempotent]` attribute of [`idempotent-runtime`](https://docs.rs/idempotent-runtime),
//! which re-exports it: depend on that crate, not on this one.

mod args;
mod duration;
mod expand;
mod impl_block;

use proc_macro::TokenStream;

/// Makes an `async fn` returning `Result<T, E>` run **once per key**: the first call claims the
/// key in the store, runs the body and records its `Ok` value; every later call with that key
/// gets the recorded value back without running the body. Two concurrent calls never both run.
///
/// ```
/// use idempotent_runtime::{idempotent, Error, MemoryStore};
///
/// #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
/// struct Receipt { user: String, amount: i64 }
///
/// struct Payments { store: MemoryStore }
///
/// impl Payments {
///     #[idempotent(key = request_id, store = self.store, scope = "payments.deduct", fingerprint = (user, amount))]
///     async fn deduct_balance(&self, request_id: &str, user: &str, amount: i64) -> Result<Receipt, Error> {
///         // UPDATE users SET balance = balance - amount WHERE id = user AND balance >= amount
///         Ok(Receipt { user: user.to_owned(), amount })
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let payments = Payments { store: MemoryStore::new() };
/// let first = payments.deduct_balance("req-1", "alice", 100).await.unwrap();
/// let retry = payments.deduct_balance("req-1", "alice", 100).await.unwrap(); // replayed, not run
/// assert_eq!(first, retry);
/// // The same key with another request is refused, and runs nothing.
/// assert!(matches!(payments.deduct_balance("req-1", "alice", 5).await, Err(Error::FingerprintMismatch { .. })));
/// # }
/// ```
///
/// The function must be `async` and return `Result<T, E>` with `T: Serialize +
/// DeserializeOwned` (what is recorded) and `E: From<idempotent_runtime::Error>` (the
/// idempotency errors: in progress, key reused, store down, ...). It may be a free function, a
/// method with any receiver, generic, in a trait impl or an `#[async_trait]` impl, next to other
/// attributes such as `#[tracing::instrument]`. Its signature is unchanged.
///
/// # Options
///
/// ## `key = <expr>` (required)
///
/// The idempotency key, evaluated before the body: a string, an integer, a `Uuid`, a
/// `format!(..)`, or any `IdempotencyKey`. Empty keys, keys over 255 bytes and keys with control
/// characters are an `Error::InvalidKey`; the body does not run.
///
/// ```
/// # use idempotent_runtime::{idempotent, Error, MemoryStore};
/// #[idempotent(key = format!("{user}:{order}"), store = store)]
/// async fn ship(store: &MemoryStore, user: &str, order: u64) -> Result<u64, Error> { Ok(order) }
/// ```
///
/// ## `store = <expr>` (required)
///
/// Where records live: a store value, a reference, an `Arc`, a field such as `self.store`, or a
/// `static` `LazyLock`. Evaluated once per call. Any `Store`: `MemoryStore`, the Redis and SQL
/// stores, `AnyStore`, `CachedStore`, a transactional `SqlTxStore`.
///
/// ```
/// # use idempotent_runtime::{idempotent, Error, MemoryStore};
/// static STORE: std::sync::LazyLock<MemoryStore> = std::sync::LazyLock::new(MemoryStore::new);
///
/// #[idempotent(key = order, store = STORE)]
/// async fn ship(order: u64) -> Result<u64, Error> { Ok(order) }
/// ```
///
/// ## `scope = "..."`
///
/// The keys' namespace: two functions share records only if they have the same scope. The
/// default is the module path and the function's name (`shop.payments.pay`), with the type's
/// name in between for the methods of an impl marked `#[idempotent]`; two functions that arrive at
/// one default are refused with `Error::ScopeCollision`. Name the scope explicitly for every
/// function whose keys outlive a deploy, so that moving or renaming the code keeps its records.
///
/// ```
/// # use idempotent_runtime::{idempotent, Error, MemoryStore};
/// struct Orders { store: MemoryStore }
///
/// #[idempotent] // default scopes `<module>.Orders.<method>`
/// impl Orders {
///     #[idempotent(key = id, store = self.store)]
///     async fn create(&self, id: &str) -> Result<String, Error> { Ok(id.to_owned()) }
///
///     #[idempotent(key = id, store = self.store, scope = "orders.cancel")] // stable across moves
///     async fn cancel(&self, id: &str) -> Result<String, Error> { Ok(id.to_owned()) }
/// }
/// ```
///
/// ## `fingerprint = <expr>`
///
/// A serialisable value describing the request (for example `(user, amount)`). Its SHA-256 is
/// stored with the claim; a reused key with another fingerprint gets
/// `Error::FingerprintMismatch` (while the first runs, after it completed, and for waiters) and
/// never runs. See the first example.
///
/// ## `lease = "60s"`
///
/// How long a claim lasts if its caller dies (default 60 s, from 1 ms to 24 h). While the body
/// runs the lease is renewed every third of its length (and while its result is recorded, for up
/// to one more lease), so it is not a guess at the body's duration but how long a crashed caller
/// blocks its key.
///
/// ```
/// # use idempotent_runtime::{idempotent, Error, MemoryStore};
/// #[idempotent(key = id, store = store, lease = "10s")]
/// async fn charge(store: &MemoryStore, id: &str) -> Result<u32, Error> { Ok(1) }
/// ```
///
/// ## `retention = "24h"`
///
/// How long a completed result is replayed (default 24 h; at least the lease, at most 3650 days;
/// a literal is checked at compile time against the literal lease or the default one).
///
/// ```
/// # use idempotent_runtime::{idempotent, Error, MemoryStore};
/// #[idempotent(key = id, store = store, retention = "7d")]
/// async fn charge(store: &MemoryStore, id: &str) -> Result<u32, Error> { Ok(1) }
/// ```
///
/// ## `wait = "5s"`
///
/// A concurrent duplicate waits (bounded back-off, up to this long, at most 24 h) for the first
/// call and returns its result, instead of failing at once with `Error::InProgress`.
///
/// ```
/// # use idempotent_runtime::{idempotent, Error, MemoryStore};
/// #[idempotent(key = id, store = store, wait = "5s")]
/// async fn charge(store: &MemoryStore, id: &str) -> Result<u32, Error> { Ok(1) }
/// ```
///
/// ## `on_cancel = "keep"` or `"release"`
///
/// What a cancelled call (its future dropped while the body runs: a client disconnect, a
/// `timeout`, a `select!`) does with its claim: `"keep"` it until the lease ends, as a crash does
/// (the default: the body's effects may still be landing), or `"release"` it at once, for bodies
/// that are safe to run again.
///
/// ```
/// # use idempotent_runtime::{idempotent, Error, MemoryStore};
/// #[idempotent(key = id, store = store, on_cancel = "release")]
/// async fn refresh_cache(store: &MemoryStore, id: &str) -> Result<u32, Error> { Ok(1) }
/// ```
///
/// ## `record_err`, `record_err = true | false | <fn(&E) -> bool>`
///
/// Whether an `Err` is recorded and replayed. By default (`false`) an `Err` releases the key so a
/// retry runs the body again; `record_err` records every error (then `E: Serialize +
/// DeserializeOwned`); `record_err = is_final` records only the errors the predicate calls final.
///
/// ```
/// # use idempotent_runtime::{idempotent, Error, MemoryStore};
/// #[derive(Debug, serde::Serialize, serde::Deserialize)]
/// enum PayError { Declined, Unavailable, #[serde(skip)] Idempotency(Error) }
/// impl From<Error> for PayError { fn from(e: Error) -> Self { PayError::Idempotency(e) } }
///
/// fn is_final(e: &PayError) -> bool { matches!(e, PayError::Declined) }
///
/// #[idempotent(key = id, store = store, record_err = is_final)]
/// async fn charge(store: &MemoryStore, id: &str) -> Result<u32, PayError> { Err(PayError::Declined) }
/// ```
///
/// ## `crate = "path"`
///
/// Where `idempotent_runtime` is, for crates that re-export it (default `::idempotent_runtime`).
///
/// ```
/// # use idempotent_runtime::{idempotent, Error, MemoryStore};
/// mod reexport { pub use idempotent_runtime as runtime; }
///
/// #[idempotent(key = id, store = store, crate = "crate::reexport::runtime")]
/// async fn charge(store: &MemoryStore, id: &str) -> Result<u32, Error> { Ok(1) }
/// # fn main() {}
/// ```
///
/// Durations are literals with a unit (`"500ms"`, `"90s"`, `"15m"`, `"24h"`, `"7d"`), checked at
/// compile time, or any `std::time::Duration` expression, checked when the call starts.
///
/// # On an impl block
///
/// `#[idempotent]` without options on an `impl` only names the impl's type in the default
/// scopes of the `#[idempotent(...)]` methods inside (see `scope` above). On a trait it is an
/// error: a default method has no scope per implementor, so give it an explicit `scope`.
///
/// # Errors at compile time
///
/// Mistakes are errors on the offending token, each reported once, saying what to change: an
/// unknown option (the message lists the valid ones), a repeated or malformed option, a bad
/// duration or `on_cancel`, a fn that is not `async`, a return type that is not a `Result` or is
/// `impl Trait`, a `store` that is not a store, a key that is not a key, an `Ok` type that does
/// not serialise, an error type without `From<idempotent_runtime::Error>`.
///
/// # What the expansion does
///
/// The body becomes a future handed to `idempotent_runtime::Call::run_with`, after the key, the
/// store and the fingerprint are evaluated; the protocol is check, claim, execute, record (see
/// the runtime crate's docs for the guarantees and their limits).
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
