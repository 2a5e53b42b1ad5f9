//! The payment scenario of the design notes, on the embedded default store (an SQLite file).
//!
//! A user double-clicks "pay", then the client times out and retries: `deduct_balance` runs once
//! and every repeat gets the same receipt. A new request id charges again. Run it twice: the
//! records live in the file, so the second run's repeated request id is replayed, not charged.
//!
//! ```text
//! cargo run -p idempotent-examples            # uses <temp dir>/idempotent-payment-example.db
//! cargo run -p idempotent-examples -- my.db   # or a file of your choice
//! IDEMPOTENT_STORE=redis://127.0.0.1:6379 cargo run -p idempotent-examples   # records elsewhere
//! ```
//!
//! The balances always live in the SQLite file; `IDEMPOTENT_STORE` (a URL, see `AnyStore`) moves
//! only the idempotency records, which default to the same file.

use std::time::Duration;

use idempotent_runtime::stores::AnyStore;
use idempotent_runtime::stores::sql::SqliteStore;
use idempotent_runtime::{Error, idempotent};
use serde::{Deserialize, Serialize};

/// What a successful payment returns, and what retries get back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    request_id: String,
    user: String,
    amount: i64,
    balance_after: i64,
}

/// Why a payment failed.
#[derive(Debug, Serialize, Deserialize)]
enum PayError {
    /// Final: recorded, so a retry gets the same answer instead of trying again.
    InsufficientBalance { user: String, amount: i64 },
    /// The database failed: not recorded, a retry may succeed.
    Database(String),
    /// The idempotency layer said no (in progress, key reused with another amount, store down...).
    #[serde(skip)]
    Idempotency(Error),
}

impl From<Error> for PayError {
    fn from(error: Error) -> Self {
        PayError::Idempotency(error)
    }
}

impl From<sqlx::Error> for PayError {
    fn from(error: sqlx::Error) -> Self {
        PayError::Database(error.to_string())
    }
}

impl PayError {
    fn is_final(&self) -> bool {
        matches!(self, PayError::InsufficientBalance { .. })
    }
}

struct Payments {
    store: AnyStore,
    /// The balances.
    db: sqlx::SqlitePool,
}

impl Payments {
    /// Deducts `amount` from `user`'s balance, once per `request_id`.
    ///
    /// A concurrent duplicate (the second click) waits up to 5 s for the first and gets its
    /// receipt; the same `request_id` with another user or amount is refused.
    #[idempotent(
        key = request_id,
        store = self.store,
        scope = "deduct_balance",
        fingerprint = (user, amount),
        wait = "5s",
        record_err = PayError::is_final,
    )]
    async fn deduct_balance(&self, request_id: &str, user: &str, amount: i64) -> Result<Receipt, PayError> {
        // The bank is slow today: long enough for the client to time out and retry.
        tokio::time::sleep(Duration::from_millis(300)).await;
        // The side effect is ONE statement that also returns everything the receipt needs. Once it
        // has committed, nothing can fail before we return `Ok`, so the result is always recorded
        // (and a failure before it commits leaves nothing behind, so releasing the key is safe).
        // A second statement after the write, say a `SELECT balance`, could fail: its `Err` would
        // release the key and the retry would deduct again. For a body with several writes, record
        // the key in the same transaction instead (see `transactional_payment`), which also closes
        // the window of a crash between this write and its record.
        let balance_after: Option<i64> = sqlx::query_scalar(
            "UPDATE users SET balance = balance - ?1 WHERE id = ?2 AND balance >= ?1 RETURNING balance",
        )
        .bind(amount)
        .bind(user)
        .fetch_optional(&self.db)
        .await?;
        let Some(balance_after) = balance_after else {
            return Err(PayError::InsufficientBalance { user: user.to_owned(), amount });
        };
        println!("    [server] charged {user} {amount} for {request_id}; balance now {balance_after}");
        Ok(Receipt { request_id: request_id.to_owned(), user: user.to_owned(), amount, balance_after })
    }

    async fn balance(&self, user: &str) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar("SELECT balance FROM users WHERE id = ?1").bind(user).fetch_one(&self.db).await
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path =
        std::env::args().nth(1).map_or_else(|| std::env::temp_dir().join("idempotent-payment-example.db"), Into::into);
    println!("balances: SQLite file {}", path.display());
    let file = SqliteStore::open(&path).await?;
    let store = match std::env::var("IDEMPOTENT_STORE") {
        Ok(url) => AnyStore::from_url(&url).await.map_err(|e| format!("IDEMPOTENT_STORE: {e}"))?,
        Err(_) => AnyStore::new(file.clone()),
    };
    println!("idempotency records: {}", std::env::var("IDEMPOTENT_STORE").as_deref().unwrap_or("the same file"));
    let db = file.pool().clone();
    sqlx::query("CREATE TABLE IF NOT EXISTS users (id TEXT PRIMARY KEY, balance INTEGER NOT NULL)")
        .execute(&db)
        .await?;
    sqlx::query("INSERT OR IGNORE INTO users (id, balance) VALUES ('alice', 1000)").execute(&db).await?;
    let payments = std::sync::Arc::new(Payments { store, db });

    let start = payments.balance("alice").await?;
    println!("alice's balance: {start}\n");

    // The same request id in every run of the program: the first run charges, later runs replay.
    let request_id = "order-2026-0001";
    println!("1. alice double-clicks \"pay 100\" ({request_id}): two concurrent calls");
    let (a, b) = tokio::join!(
        payments.deduct_balance(request_id, "alice", 100),
        payments.deduct_balance(request_id, "alice", 100)
    );
    let (a, b) = (a.map_err(|e| format!("{e:?}"))?, b.map_err(|e| format!("{e:?}"))?);
    println!("   click 1 -> {a:?}\n   click 2 -> {b:?}");
    assert_eq!(a, b, "both clicks get the one receipt");

    println!("\n2. the client gives up after 100 ms and retries the same request");
    let fresh_id = format!("order-{}", uuid::Uuid::new_v4().simple());
    let server = {
        let (payments, id) = (payments.clone(), fresh_id.clone());
        tokio::spawn(async move { payments.deduct_balance(&id, "alice", 30).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    println!("   client: timed out waiting for {fresh_id}; retrying");
    let retried = payments.deduct_balance(&fresh_id, "alice", 30).await.map_err(|e| format!("{e:?}"))?;
    let original = server.await?.map_err(|e| format!("{e:?}"))?;
    println!("   retry  -> {retried:?}");
    assert_eq!(retried, original, "the retry gets the first call's receipt");

    println!("\n3. the same request id with another amount is refused, not charged");
    match payments.deduct_balance(&fresh_id, "alice", 999).await {
        Err(PayError::Idempotency(e @ Error::FingerprintMismatch { .. })) => println!("   refused: {e}"),
        other => return Err(format!("expected a fingerprint mismatch, got {other:?}").into()),
    }

    println!("\n4. an amount alice cannot pay fails for good; its retry replays the failure");
    let broke = format!("order-{}", uuid::Uuid::new_v4().simple());
    for attempt in 1..=2 {
        let result = payments.deduct_balance(&broke, "alice", 1_000_000).await;
        println!("   attempt {attempt} -> {result:?}");
        assert!(matches!(result, Err(PayError::InsufficientBalance { .. })));
    }

    let end = payments.balance("alice").await?;
    let first_run = a.balance_after == start - 100;
    println!("\nalice's balance: {start} -> {end}");
    if first_run {
        println!("{request_id} was charged in this run (once, for two clicks); {fresh_id} once despite the retry.");
        assert_eq!(end, start - 100 - 30);
    } else {
        println!("{request_id} was charged in an earlier run and replayed now; only {fresh_id} was charged.");
        assert_eq!(end, start - 30);
    }
    println!("Run the program again: {request_id} will be replayed from the file, not charged.");
    Ok(())
}
