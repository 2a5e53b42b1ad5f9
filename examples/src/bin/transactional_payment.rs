//! The design notes' `deduct_balance` in transactional mode, on PostgreSQL: the key is claimed and
//! the receipt recorded inside the same transaction as the balance update, so both commit together
//! or not at all.
//!
//! Eight concurrent duplicates of one request (each in its own transaction) deduct once and all get
//! the same receipt: the duplicates wait on the claimed row until the first transaction commits,
//! then replay it. A payment that fails after its UPDATE rolls back, leaving neither the deduction
//! nor the key, so its retry runs.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run -p idempotent-examples --bin transactional_payment
//! ```
//!
//! (`POSTGRES_URL` is read too; the default is `postgres://postgres@127.0.0.1:5432/test`.)

use std::sync::Arc;

use idempotent_runtime::stores::sql::{PostgresStore, PostgresTxStore, sqlx};
use idempotent_runtime::{Error, idempotent};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: String,
    user: String,
    amount: i64,
    balance_after: i64,
}

#[derive(Debug)]
enum PayError {
    Insufficient,
    /// Stands for anything that fails after the UPDATE (a fraud check, a ledger insert...).
    LaterStepFailed,
    Database(sqlx::Error),
    Idempotency(Error),
}

impl From<Error> for PayError {
    fn from(e: Error) -> Self {
        PayError::Idempotency(e)
    }
}

impl From<sqlx::Error> for PayError {
    fn from(e: sqlx::Error) -> Self {
        PayError::Database(e)
    }
}

impl std::fmt::Display for PayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PayError::Insufficient => f.write_str("insufficient balance"),
            PayError::LaterStepFailed => f.write_str("a step after the deduction failed"),
            PayError::Database(e) => write!(f, "database: {e}"),
            PayError::Idempotency(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for PayError {}

/// Deducts `amount` from `user` once per `request_id`, inside the caller's transaction `tx`.
#[idempotent(key = request_id, store = tx, fingerprint = (user, amount))]
async fn deduct_balance(tx: &PostgresTxStore, request_id: &str, user: &str, amount: i64) -> Result<Receipt, PayError> {
    let balance_after: Option<i64> =
        sqlx::query_scalar("UPDATE users SET balance = balance - $1 WHERE id = $2 AND balance >= $1 RETURNING balance")
            .bind(amount)
            .bind(user)
            .fetch_optional(&mut *tx.conn().await)
            .await?;
    let balance_after = balance_after.ok_or(PayError::Insufficient)?;
    if amount == 13 {
        return Err(PayError::LaterStepFailed);
    }
    let id = uuid::Uuid::new_v4().to_string();
    Ok(Receipt { id, user: user.to_owned(), amount, balance_after })
}

/// One request in its own transaction: commit on success, roll back on failure.
async fn pay(store: &PostgresStore, request_id: &str, user: &str, amount: i64) -> Result<Receipt, PayError> {
    let tx = store.begin().await?;
    let result = deduct_balance(&tx, request_id, user, amount).await;
    match &result {
        Ok(_) => tx.commit().await?,
        Err(_) => tx.rollback().await?,
    }
    result
}

async fn balance(store: &PostgresStore, user: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT balance FROM users WHERE id = $1").bind(user).fetch_one(store.pool()).await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .or_else(|_| std::env::var("POSTGRES_URL"))
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(8).connect(&url).await?;
    let store = PostgresStore::new(pool);
    store.create_table().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS users (id TEXT PRIMARY KEY, balance BIGINT NOT NULL)")
        .execute(store.pool())
        .await?;
    let run = uuid::Uuid::new_v4().simple().to_string();
    let user = format!("alice-{}", &run[..8]);
    sqlx::query("INSERT INTO users (id, balance) VALUES ($1, 1000)").bind(&user).execute(store.pool()).await?;
    println!("{user} starts with a balance of {}", balance(&store, &user).await?);

    // A double-click and retries: eight concurrent duplicates of one request.
    let store = Arc::new(store);
    let request = format!("pay-{run}");
    let duplicates: Vec<_> = (0..8)
        .map(|_| {
            let (store, request, user) = (Arc::clone(&store), request.clone(), user.clone());
            tokio::spawn(async move { pay(&store, &request, &user, 100).await })
        })
        .collect();
    let mut receipts = Vec::new();
    for duplicate in duplicates {
        receipts.push(duplicate.await??);
    }
    let first = &receipts[0];
    assert!(receipts.iter().all(|r| r == first), "every duplicate gets the same receipt");
    println!("8 duplicates -> 1 deduction, receipt {} (balance after: {})", first.id, first.balance_after);
    println!("balance now {}", balance(&store, &user).await?);

    // A payment whose later step fails: the deduction and the key roll back together.
    let failing = format!("pay-13-{run}");
    match pay(&store, &failing, &user, 13).await {
        Err(PayError::LaterStepFailed) => println!("the 13 payment failed after its UPDATE and rolled back"),
        other => println!("unexpected: {other:?}"),
    }
    println!("balance still {}", balance(&store, &user).await?);
    let key_left: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_records WHERE idempotency_key = $1")
        .bind(format!("deduct_balance:{failing}"))
        .fetch_one(store.pool())
        .await?;
    println!("records left for the failed request: {key_left}");
    Ok(())
}
