//! A result that knows whether it was replayed.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A value that tells a replay from a first execution: return `Result<Replayable<T>, E>` from a
/// function under [`#[idempotent]`](macro@crate::idempotent) and check
/// [`is_replay`](Replayable::is_replay).
///
/// It is recorded as `T` alone (its `Serialize` writes only the value) and every value decoded from
/// a record is marked as replayed (its `Deserialize` sets the mark), so the first call returns
/// `is_replay() == false` and every repeat `true`. With the feature `axum`, a `Replayable<T>` whose
/// `T` is a response answers like `T`, plus `Idempotent-Replayed: true` on a replay (and, on a
/// replayed `409` or `5xx`, `Stripe-Should-Retry: false`), as the HTTP layer does.
///
/// ```
/// use idempotent_runtime::{idempotent, Error, MemoryStore, Replayable};
///
/// #[idempotent(key = id, store = store)]
/// async fn charge(store: &MemoryStore, id: &str) -> Result<Replayable<u64>, Error> {
///     Ok(Replayable::new(100))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let store = MemoryStore::new();
/// let first = charge(&store, "req-1").await.unwrap();
/// let again = charge(&store, "req-1").await.unwrap();
/// assert_eq!((first.is_replay(), again.is_replay()), (false, true));
/// assert_eq!(again.into_inner(), 100);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Replayable<T> {
    value: T,
    replayed: bool,
}

impl<T> Replayable<T> {
    /// A value from a first execution.
    pub fn new(value: T) -> Self {
        Replayable { value, replayed: false }
    }

    /// `true` when this value was decoded from a record: the call was a replay.
    pub fn is_replay(&self) -> bool {
        self.replayed
    }

    /// The value.
    pub fn get(&self) -> &T {
        &self.value
    }

    /// Takes the value out.
    pub fn into_inner(self) -> T {
        self.value
    }
}

impl<T> From<T> for Replayable<T> {
    fn from(value: T) -> Self {
        Replayable::new(value)
    }
}

impl<T: Serialize> Serialize for Replayable<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.value.serialize(serializer)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Replayable<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        T::deserialize(deserializer).map(|value| Replayable { value, replayed: true })
    }
}
