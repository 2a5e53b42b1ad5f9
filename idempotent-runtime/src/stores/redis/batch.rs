//! Group commit for the Redis store ([`RedisStore::with_batching`](super::RedisStore::with_batching)):
//! while [`PIPELINES`] pipelines of steps are in flight, the steps that arrive wait, and go
//! together as the next pipeline.
//!
//! The aim: with few commands in flight, Redis reads, runs and answers each on its own, and every
//! read and write has a fixed cost (an event-loop turn and system calls on each side). Holding
//! the steps back while the connection is busy makes them arrive as one write, and Redis answers
//! them with one. Each command of a pipeline is still atomic on its own, and each step gets its
//! own reply: a pipeline only shares the trip. What it gained, measured, is small (see
//! `RedisStore::with_batching`).
//!
//! [`PIPELINES`] tasks (the *drivers*) send the pipelines. Each takes the first step waiting and
//! every other one queued behind it (up to [`MAX_BATCH`]), sends them, hands each reply to its
//! step, and takes the next. So a step goes at once while fewer than [`PIPELINES`] pipelines are
//! in flight, and otherwise waits for the first of them to come back. The drivers run on the Tokio
//! runtime of the first step that needed them, and are started again on the runtime of a later
//! step if that runtime has shut down. They end when the store's last clone is dropped.
//!
//! A pipeline whose replies do not come within the store's step timeout fails all its steps with
//! the timeout, as each step alone would have, and its driver takes the next: a connection that
//! stopped answering cannot hold the drivers for ever.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{Cmd, RedisError, RedisResult, Value};
use tokio::sync::{mpsc, oneshot};

use super::connection::Shared;

/// The most pipelines in flight at once: while fewer are, a step goes at once.
///
/// With one, every pipeline waits for the one before it, and the client and Redis take turns
/// idling. (`redis_window` put one pipeline at two thirds of the unbatched rate at 64 in flight,
/// and four level with it, but those runs let keys expire mid-run: BENCHMARKS.md.)
pub(super) const PIPELINES: usize = 4;

/// The most steps in one pipeline: small enough that many steps in flight make several
/// pipelines, which overlap.
pub(super) const MAX_BATCH: usize = 16;

/// One step waiting to be sent, and where its reply goes.
struct Job {
    cmd: Cmd,
    reply: oneshot::Sender<RedisResult<Value>>,
}

/// The store's side of the drivers: the queue of steps, and how to start the drivers.
pub(super) struct Batcher {
    connection: Shared<ConnectionManager>,
    /// The store's step timeout, which also bounds each pipeline.
    timeout: Duration,
    queue: Mutex<Option<mpsc::UnboundedSender<Job>>>,
}

impl Batcher {
    pub(super) fn new(connection: Shared<ConnectionManager>, timeout: Duration) -> Arc<Self> {
        Arc::new(Batcher { connection, timeout, queue: Mutex::new(None) })
    }

    /// The same batching on the same connection, with pipelines bounded by `timeout`.
    pub(super) fn with_timeout(&self, timeout: Duration) -> Arc<Self> {
        Batcher::new(self.connection.clone(), timeout)
    }

    /// Sends `cmd` in the next pipeline and returns its reply.
    pub(super) async fn query(&self, cmd: Cmd) -> RedisResult<Value> {
        let (reply, replied) = oneshot::channel();
        self.enqueue(Job { cmd, reply })?;
        // A driver drops a step's sender without replying only when its runtime shut down
        // with the step in flight: whether Redis ran it is unknown, as after a lost connection.
        replied.await.unwrap_or_else(|_| Err(stopped()))
    }

    /// Queues `job` for the drivers, starting them if none run.
    fn enqueue(&self, job: Job) -> RedisResult<()> {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let job = match queue.as_ref() {
            Some(sender) => match sender.send(job) {
                Ok(()) => return Ok(()),
                // The drivers' runtime shut down: start others on this one.
                Err(mpsc::error::SendError(job)) => job,
            },
            None => job,
        };
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| stopped())?;
        let (sender, receiver) = mpsc::unbounded_channel();
        let receiver = Arc::new(tokio::sync::Mutex::new(receiver));
        for _ in 0..PIPELINES {
            runtime.spawn(drive(self.connection.clone(), self.timeout, Arc::clone(&receiver)));
        }
        sender.send(job).map_err(|_| stopped())?;
        *queue = Some(sender);
        Ok(())
    }
}

/// The queue of steps, which the drivers take turns to read.
type Queue = Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Job>>>;

/// A driver: sends what is queued as one pipeline, hands out the replies, and waits for more;
/// ends when the store's last clone is dropped (the queue's sender with it).
async fn drive(connection: Shared<ConnectionManager>, timeout: Duration, queue: Queue) {
    let mut jobs = Vec::with_capacity(MAX_BATCH);
    let mut waiting = Vec::with_capacity(MAX_BATCH);
    while queue.lock().await.recv_many(&mut jobs, MAX_BATCH).await > 0 {
        let mut pipeline = redis::pipe();
        pipeline.ignore_errors();
        for job in jobs.drain(..) {
            // A step whose caller gave up (its timeout) is not sent.
            if !job.reply.is_closed() {
                pipeline.add_command(job.cmd);
                waiting.push(job.reply);
            }
        }
        if waiting.is_empty() {
            continue;
        }
        let mut link = connection.get();
        let send = async {
            match pipeline.query_async(&mut link).await {
                // As the store's own `query`: a refused connection never reached a server; once
                // more makes the manager reconnect.
                Err(e) if e.is_connection_refusal() => pipeline.query_async(&mut link).await,
                replies => replies,
            }
        };
        let replies: RedisResult<Vec<RedisResult<Value>>> =
            tokio::time::timeout(timeout, send).await.unwrap_or_else(|_| Err(timed_out(timeout)));
        let replies = match replies {
            Ok(replies) if replies.len() == waiting.len() => replies,
            Ok(replies) => {
                let detail = format!("{} replies to {} commands", replies.len(), waiting.len());
                let e = RedisError::from((
                    redis::ErrorKind::Parse,
                    "a pipeline returned another number of replies than it had commands",
                    detail,
                ));
                vec![Err(e); waiting.len()]
            }
            Err(e) => vec![Err(e); waiting.len()],
        };
        for (reply, value) in waiting.drain(..).zip(replies) {
            // The caller may have given up meanwhile; then nobody reads the reply.
            let _ = reply.send(value);
        }
    }
}

/// The error of the steps of a pipeline whose replies did not come within `after`.
fn timed_out(after: Duration) -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("a pipeline of the Redis store's batched steps got no reply within {after:?}"),
    ))
}

/// The error of a step whose driver stopped before it replied, or that found no runtime.
fn stopped() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "the Redis store's batching task stopped (its Tokio runtime shut down) before the step's reply came",
    ))
}
