//! Every option, with literals and expressions, next to other attributes in any order.
#![deny(warnings)]

use std::sync::LazyLock;
use std::time::Duration;

use idempotent_runtime::{Error, MemoryStore, idempotent};
use serde::{Deserialize, Serialize};

static STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);

#[derive(Debug, Serialize, Deserialize)]
enum PayError {
    Insufficient,
    #[serde(skip)]
    Idempotency(Error),
}

impl From<Error> for PayError {
    fn from(e: Error) -> Self {
        PayError::Idempotency(e)
    }
}

fn is_final(e: &PayError) -> bool {
    matches!(e, PayError::Insufficient)
}

const LEASE: Duration = Duration::from_secs(30);

#[allow(clippy::unused_async)]
/// Literals.
#[idempotent(
    key = key,
    store = STORE,
    scope = "payments.v1",
    fingerprint = (user, amount),
    lease = "30s",
    retention = "7d",
    wait = "500ms",
    record_err,
    on_cancel = "keep",
)]
#[must_use = "a payment result should be checked"]
async fn literals(key: &str, user: &str, amount: i64) -> Result<i64, PayError> {
    let _ = user;
    if amount < 0 { Err(PayError::Insufficient) } else { Ok(amount) }
}

#[idempotent(key = key, store = STORE, lease = LEASE, retention = LEASE * 2, wait = Duration::from_millis(10),
             record_err = is_final, crate = "::idempotent_runtime")]
async fn expressions(key: &str) -> Result<(), PayError> {
    Ok(())
}

#[idempotent(key = key, store = STORE, record_err = |e: &PayError| matches!(e, PayError::Insufficient), on_cancel = "release")]
async fn closure(key: &str) -> Result<(), PayError> {
    Ok(())
}

type PayResult<T> = Result<T, PayError>;

#[idempotent(key = key, store = STORE, record_err = false)]
async fn released(key: &str) -> PayResult<u8> {
    Ok(1)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(literals("a", "u", 5).await.unwrap(), 5);
    assert!(matches!(literals("b", "u", -1).await, Err(PayError::Insufficient)));
    expressions("c").await.unwrap();
    closure("d").await.unwrap();
    assert_eq!(released("e").await.unwrap(), 1);
}
