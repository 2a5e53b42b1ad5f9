//! Calling another service safely: orders placed through `IdempotentRetry` (reqwest-middleware)
//! against the HTTP example, with the network losing an answer.
//!
//! ```text
//! cargo run -p idempotent-examples --bin http_server      # terminal 1: the API, on 127.0.0.1:3000
//! cargo run -p idempotent-examples --bin pay_client       # terminal 2 (API=host:port to point elsewhere)
//! ```
//!
//! 1. The order goes through a relay that cuts the connection as the server's answer comes back:
//!    the server placed the order, the client never heard. The middleware retries with the same
//!    `Idempotency-Key` and gets the recorded answer (`idempotent-replayed: true`): one order.
//! 2. A client that gives up after 1 s on a server that takes 2 s: the retry gets `409` with
//!    `Retry-After` while the first attempt still runs, waits, and gets its answer: one order.
//! 3. The same key with another body: a typed error saying the key was reused.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idempotent_runtime::client::{Attempts, IDEMPOTENT_REPLAYED, IdempotentRetry, OutboundError, RetryPolicy};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn client(timeout: Duration) -> ClientWithMiddleware {
    let inner = reqwest::Client::builder().timeout(timeout).build().expect("a reqwest client");
    let policy = RetryPolicy::default().max_attempts(6).max_elapsed(Duration::from_secs(20));
    ClientBuilder::new(inner).with(IdempotentRetry::new(policy)).build()
}

async fn order(
    client: &ClientWithMiddleware,
    base: &str,
    key: Option<&str>,
    body: &str,
) -> reqwest_middleware::Result<()> {
    let started = Instant::now();
    let mut request =
        client.post(format!("{base}/orders")).header("x-user", "alice").header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = request.body(body.to_owned()).send().await?;
    let attempts = response.extensions().get::<Attempts>().cloned();
    let replayed = response.headers().get(IDEMPOTENT_REPLAYED).is_some();
    let status = response.status();
    let text = response.text().await?;
    if let Some(attempts) = attempts {
        println!("   key {} took {} attempt(s), {} ms", attempts.key, attempts.count, started.elapsed().as_millis());
    }
    println!("   -> {status}{} {text}", if replayed { " (replayed)" } else { "" });
    Ok(())
}

/// A relay on a free loopback port to `api` that cuts the first connection as the server's answer comes back.
async fn lossy_relay(api: SocketAddr) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let lost_one = Arc::new(AtomicBool::new(false));
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let lose = !lost_one.swap(true, Ordering::SeqCst);
            tokio::spawn(relay(client, api, lose));
        }
    });
    Ok(addr)
}

async fn relay(client: TcpStream, api: SocketAddr, lose_the_answer: bool) -> std::io::Result<()> {
    let server = TcpStream::connect(api).await?;
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up = tokio::spawn(async move { tokio::io::copy(&mut client_read, &mut server_write).await });
    let mut buffer = vec![0; 16 * 1024];
    loop {
        let n = server_read.read(&mut buffer).await?;
        if n == 0 {
            break;
        }
        if lose_the_answer {
            println!("   [network] the server answered; the connection drops before the answer arrives");
            up.abort();
            return Ok(()); // both ends closed
        }
        client_write.write_all(&buffer[..n]).await?;
    }
    up.abort();
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let api: SocketAddr = std::env::var("API").unwrap_or_else(|_| "127.0.0.1:3000".to_owned()).parse()?;
    if TcpStream::connect(api).await.is_err() {
        return Err(format!(
            "no server at {api}: start it first with `cargo run -p idempotent-examples --bin http_server`"
        )
        .into());
    }

    println!("1. order a book through a network that loses the first answer");
    let relay = lossy_relay(api).await?;
    order(&client(Duration::from_secs(10)), &format!("http://{relay}"), None, r#"{"item":"book","quantity":1}"#)
        .await?;

    println!("\n2. order a pen with a client that waits 1 s for a server that takes 2 s");
    order(&client(Duration::from_secs(1)), &format!("http://{api}"), None, r#"{"item":"pen","quantity":2}"#).await?;

    println!("\n3. the same key with another body");
    let key = uuid::Uuid::new_v4().to_string();
    let base = format!("http://{api}");
    let patient = client(Duration::from_secs(10));
    order(&patient, &base, Some(&key), r#"{"item":"lamp","quantity":1}"#).await?;
    match order(&patient, &base, Some(&key), r#"{"item":"lamp","quantity":5}"#).await {
        Err(error) => match OutboundError::find(&error) {
            Some(e @ OutboundError::KeyReused { .. }) => println!("   -> refused: {e}"),
            _ => return Err(error.into()),
        },
        Ok(()) => return Err("expected the reused key to be refused".into()),
    }
    println!("\nThree orders, each placed once: their numbers are consecutive, none was placed twice.");
    Ok(())
}
