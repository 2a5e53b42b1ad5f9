//! The payment scenario with its records in Redis: retries and concurrent duplicates of one
//! payment request deduct the balance once.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin redis_payment
//! ```
//!
//! Records live under the prefix `example:payments:`; look at one with
//! `redis-cli GET 'example:payments:deduct_balance:<request id>'` (a header line, then the JSON outcome).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use idempotent_runtime::stores::redis::RedisStore;
use idempotent_runtime::{Error, idempotent};
use serde::{Deserialize, Serialize};

/// What a successful payment returns, recorded and replayed to retries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    user: String,
    amount: i64,
    balance_after: i64,
}

#[derive(Debug)]
enum PayError {
    /// Not recorded: a retry with the same key runs again once the balance is topped up.
    Insufficient {
        balance: i64,
    },
    Idempotency(Error),
}

impl From<Error> for PayError {
    fn from(error: Error) -> Self {
        PayError::Idempotency(error)
    }
}

impl std::fmt::Display for PayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PayError::Insufficient { balance } => write!(f, "insufficient balance ({balance})"),
            PayError::Idempotency(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for PayError {}

/// The non-idempotent side: balances held in memory here, a database in real life.
struct Payments {
    store: RedisStore,
    balances: Mutex<HashMap<String, i64>>,
}

impl Payments {
    #[idempotent(key = request_id, store = self.store, fingerprint = (user, amount), lease = "30s")]
    async fn deduct_balance(&self, request_id: &str, user: &str, amount: i64) -> Result<Receipt, PayError> {
        let mut balances = self.balances.lock().expect("balances lock");
        let balance = balances.entry(user.to_owned()).or_insert(0);
        if *balance < amount {
            return Err(PayError::Insufficient { balance: *balance });
        }
        *balance -= amount;
        println!("  (body ran: deducted {amount} from {user})");
        Ok(Receipt { user: user.to_owned(), amount, balance_after: *balance })
    }

    fn balance(&self, user: &str) -> i64 {
        self.balances.lock().expect("balances lock").get(user).copied().unwrap_or(0)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let store = match RedisStore::connect(&url).await {
        Ok(store) => store.with_prefix("example:payments:")?,
        Err(e) => {
            eprintln!("cannot reach Redis at {url}: {e}\nstart a server or set REDIS_URL to point at one");
            std::process::exit(1);
        }
    };
    let payments = Arc::new(Payments { store, balances: Mutex::new(HashMap::from([("alice".to_owned(), 500)])) });
    // A fresh request id per run, as a client would generate per payment attempt.
    let request = format!("req-{}", uuid_like());

    println!("alice pays 100 with request {request}:");
    let first = payments.deduct_balance(&request, "alice", 100).await?;
    println!("  -> {first:?}");

    println!("the client retries the same request (a timeout made it unsure):");
    let retry = payments.deduct_balance(&request, "alice", 100).await?;
    println!("  -> {retry:?} (replayed from Redis)");
    assert_eq!(first, retry);

    println!("the same request id with another amount is refused:");
    match payments.deduct_balance(&request, "alice", 999).await {
        Err(e) => println!("  -> {e}"),
        Ok(r) => return Err(format!("a reused key with another amount must be refused, got {r:?}").into()),
    }

    let second = format!("{request}-b");
    println!("eight concurrent duplicates of a new request {second}:");
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (payments, second) = (payments.clone(), second.clone());
            tokio::spawn(async move { payments.deduct_balance(&second, "alice", 50).await })
        })
        .collect();
    for task in tasks {
        match task.await? {
            Ok(receipt) => println!("  -> {receipt:?}"),
            Err(e) => println!("  -> {e}"),
        }
    }

    println!("alice's balance: {} (500 - 100 - 50: each request deducted once)", payments.balance("alice"));
    assert_eq!(payments.balance("alice"), 350);
    Ok(())
}

/// A process-unique suffix without extra dependencies: the time and the process id.
fn uuid_like() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{nanos:x}-{}", std::process::id())
}
