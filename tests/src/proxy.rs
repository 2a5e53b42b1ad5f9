//! A TCP proxy that injects network faults between a client and its server (a store and its
//! database, an HTTP client and its API): it delays traffic, stalls it (a black hole that delivers
//! what it held once it heals), loses responses (the request reaches the server, the connection
//! is cut before the answer gets back), refuses new connections, or kills every open connection.
//!
//! ```ignore
//! let proxy = FaultProxy::start("127.0.0.1:6379").await?;
//! let store = RedisStore::connect(&format!("redis://{}", proxy.addr())).await?;
//! proxy.set_mode(Mode::Delay(Duration::from_secs(3))); // every chunk waits 3 s each way
//! proxy.kill_connections();                             // every open connection is closed
//! proxy.set_mode(Mode::Pass);
//! ```
//!
//! It listens on a loopback port of its own and connects only to the given target; it stops when
//! dropped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// How the proxy treats traffic now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward at once.
    Pass,
    /// Forward every chunk after this delay, in each direction.
    Delay(Duration),
    /// Hold every chunk until the mode changes, then handle it under the new mode.
    Stall,
    /// Close new connections at once (open ones keep their mode of forwarding: [`Mode::Pass`]).
    Refuse,
    /// Forward what the client sends, but cut the connection (both ends) when the server's first
    /// bytes come back, without delivering them: the server did the work, the client never hears.
    LoseResponses,
    /// Like [`Mode::LoseResponses`] for the next response only: the first connection whose answer
    /// comes back is cut, and the proxy is in [`Mode::Pass`] from then on (a client that sends
    /// again on a new connection gets its answer).
    LoseOneResponse,
}

/// What the proxy did, for the test's report.
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// Connections accepted.
    pub accepted: AtomicU64,
    /// Connections refused in [`Mode::Refuse`].
    pub refused: AtomicU64,
    /// Connections closed by [`FaultProxy::kill_connections`].
    pub killed: AtomicU64,
    /// Chunks that were delayed or stalled.
    pub held_chunks: AtomicU64,
    /// Bytes forwarded, both directions.
    pub bytes: AtomicU64,
    /// Connections cut in [`Mode::LoseResponses`] or [`Mode::LoseOneResponse`] as their answer came back.
    pub lost_responses: AtomicU64,
}

/// A running proxy; dropping it stops it and closes its connections.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    target: watch::Sender<SocketAddr>,
    mode: watch::Sender<Mode>,
    kills: watch::Sender<u64>,
    stats: Arc<ProxyStats>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy on `127.0.0.1:<free port>` to `target`, in [`Mode::Pass`].
    ///
    /// # Errors
    ///
    /// When `target` does not resolve or no local port can be bound.
    pub async fn start(target: &str) -> std::io::Result<Self> {
        let target: SocketAddr = tokio::net::lookup_host(target)
            .await?
            .next()
            .ok_or_else(|| std::io::Error::other(format!("{target} resolves to no address")))?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (mode, _) = watch::channel(Mode::Pass);
        let (kills, _) = watch::channel(0u64);
        let stats = Arc::new(ProxyStats::default());
        let (target, _) = watch::channel(target);
        let accept =
            tokio::spawn(accept_loop(listener, target.subscribe(), mode.clone(), kills.clone(), Arc::clone(&stats)));
        Ok(FaultProxy { addr, target, mode, kills, stats, accept })
    }

    /// The address clients connect to.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends new connections to `target` from now on (a server restarted on another port); open
    /// connections stay where they are.
    pub fn set_target(&self, target: SocketAddr) {
        self.target.send_replace(target);
    }

    /// Changes how traffic is treated from now on (held chunks are re-examined at once).
    pub fn set_mode(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Closes every open connection, both ends.
    pub fn kill_connections(&self) {
        self.kills.send_modify(|generation| *generation += 1);
    }

    /// What the proxy did so far.
    #[must_use]
    pub fn stats(&self) -> &ProxyStats {
        &self.stats
    }

    /// Waits until `done` holds for the stats (checked every 5 ms), for ordering a test's steps
    /// on what the proxy saw rather than on sleeps.
    ///
    /// # Panics
    ///
    /// If it does not hold within `limit`.
    pub async fn wait_until(&self, what: &str, limit: Duration, done: impl Fn(&ProxyStats) -> bool) {
        let deadline = tokio::time::Instant::now() + limit;
        while !done(&self.stats) {
            assert!(tokio::time::Instant::now() < deadline, "proxy: not within {limit:?}: {what}; {:?}", self.stats);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.kill_connections();
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: watch::Receiver<SocketAddr>,
    mode: watch::Sender<Mode>,
    kills: watch::Sender<u64>,
    stats: Arc<ProxyStats>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else { continue };
        if *mode.borrow() == Mode::Refuse {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            drop(client);
            continue;
        }
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        let (mode, kills, stats) = (mode.clone(), kills.subscribe(), Arc::clone(&stats));
        let target = *target.borrow();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(target).await else { return };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = server.into_split();
            let mut kill_watch = kills.clone();
            let (lost, lost_signal) = tokio::sync::oneshot::channel();
            let up = pump(client_read, server_write, Direction::Request, &mode, Arc::clone(&stats));
            let down = async {
                if pump(server_read, client_write, Direction::Response, &mode, Arc::clone(&stats)).await == End::Lost {
                    let _ = lost.send(());
                }
            };
            tokio::select! {
                () = async { tokio::join!(up, down); } => {}
                Ok(()) = lost_signal => {}
                _ = kill_watch.changed() => {
                    stats.killed.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
}

/// Which way a pump copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Request,
    Response,
}

/// How a pump ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Closed,
    /// A response chunk was withheld in [`Mode::LoseResponses`] or [`Mode::LoseOneResponse`]: cut the connection.
    Lost,
}

/// Copies one direction, chunk by chunk, applying the mode to each chunk.
///
/// It reads on while it holds chunks: they queue in the proxy, not in the socket.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    direction: Direction,
    switch: &watch::Sender<Mode>,
    stats: Arc<ProxyStats>,
) -> End {
    let mut mode = switch.subscribe();
    let (chunks, mut spooled) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    let read = async {
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if chunks.send(buffer[..n].to_vec()).is_err() {
                break;
            }
        }
        // The writer ends once it has forwarded what was read.
        drop(chunks);
        std::future::pending::<End>().await
    };
    let write = async {
        while let Some(chunk) = spooled.recv().await {
            loop {
                let current = *mode.borrow_and_update();
                match current {
                    Mode::LoseResponses if direction == Direction::Response => {
                        stats.lost_responses.fetch_add(1, Ordering::Relaxed);
                        return End::Lost;
                    }
                    // Only the first connection to get here loses its answer.
                    Mode::LoseOneResponse if direction == Direction::Response => {
                        let lost = switch.send_if_modified(|mode| {
                            let lose = *mode == Mode::LoseOneResponse;
                            if lose {
                                *mode = Mode::Pass;
                            }
                            lose
                        });
                        if lost {
                            stats.lost_responses.fetch_add(1, Ordering::Relaxed);
                            return End::Lost;
                        }
                    }
                    Mode::Pass | Mode::Refuse | Mode::LoseResponses | Mode::LoseOneResponse => break,
                    Mode::Delay(delay) => {
                        stats.held_chunks.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(delay).await;
                        break;
                    }
                    Mode::Stall => {
                        stats.held_chunks.fetch_add(1, Ordering::Relaxed);
                        if mode.changed().await.is_err() {
                            return End::Closed;
                        }
                    }
                }
            }
            if to.write_all(&chunk).await.is_err() {
                break;
            }
            stats.bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
        let _ = to.shutdown().await;
        End::Closed
    };
    tokio::select! {
        end = write => end,
        end = read => end,
    }
}
