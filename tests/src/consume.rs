//! The kill-and-redeliver scenario of the broker tests: a fleet of competing consumer processes
//! (`tests/src/bin/consumer_worker.rs`) that SIGKILL themselves at scheduled message ids (and
//! whose handler panics at others, and always fails on poison messages), are restarted, and are
//! stopped once every published message is settled; the PostgreSQL ledger that counts the side
//! effects independently of the idempotency records; and a capture of this thread's log events.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent_runtime::stores::sql::sqlx::{self, PgPool};

/// The id of the `i`-th message the producer publishes.
#[must_use]
pub fn message_id(i: usize) -> String {
    format!("msg-{i:04}")
}

/// The body of the `i`-th malformed message (published without an id).
#[must_use]
pub fn malformed_body(i: usize) -> String {
    format!("malformed-{i}")
}

/// The id of the `i`-th poison message: its handler fails every time (its body is the same text).
#[must_use]
pub fn poison_id(i: usize) -> String {
    format!("poison-{i}")
}

/// The ids whose first execution kills its worker: `kills` ids spread evenly over `messages`,
/// none among the first few (so that every worker is running when they come).
#[must_use]
pub fn kill_schedule(messages: usize, kills: usize) -> Vec<String> {
    (1..=kills).map(|k| message_id(k * messages / (kills + 1))).collect()
}

/// The ids whose handler panics on its first run (once over the whole fleet, before the side
/// effect): `panics` ids spread evenly over `messages`, none of them in `kill_schedule(messages,
/// kills)`.
///
/// # Panics
///
/// When a panic id would also be a kill id.
#[must_use]
pub fn panic_schedule(messages: usize, panics: usize, kills: usize) -> Vec<String> {
    let ids: Vec<String> = (1..=panics).map(|k| message_id(k * messages / (panics + 1) + 3)).collect();
    let kill_ids = kill_schedule(messages, kills);
    assert!(ids.iter().all(|id| !kill_ids.contains(id)), "panic ids {ids:?} meet kill ids {kill_ids:?}");
    ids
}

/// What the fleet saw.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// Deliveries acknowledged.
    pub acked: usize,
    /// Deliveries rejected to the dead-letter path, with their ids (`-` for none).
    pub dead_lettered: Vec<String>,
    /// Deliveries returned for a delayed retry.
    pub retried: usize,
    /// Retries after the handler panicked, by message id.
    pub panicked: BTreeMap<String, usize>,
    /// Retries after the handler failed with its own error, by message id.
    pub failed: BTreeMap<String, usize>,
    /// Settled deliveries that the broker flagged as redelivered.
    pub redelivered: usize,
    /// Workers that died by SIGKILL at a scheduled point.
    pub kills: usize,
    /// Worker processes started.
    pub started: usize,
}

enum Event {
    Line(String),
    Closed(usize),
}

/// Competing worker processes, each restarted when it is killed.
pub struct Fleet {
    program: String,
    args: Vec<String>,
    slots: Vec<Option<(Child, Option<ChildStdin>)>>,
    events: Receiver<Event>,
    sender: Sender<Event>,
    tally: Tally,
}

impl Fleet {
    /// Starts `workers` processes of `program` (`env!("CARGO_BIN_EXE_consumer_worker")`) with `args`.
    #[must_use]
    pub fn start(program: &str, workers: usize, args: Vec<String>) -> Fleet {
        let (sender, events) = channel();
        let mut fleet = Fleet {
            program: program.to_owned(),
            args,
            slots: (0..workers).map(|_| None).collect(),
            events,
            sender,
            tally: Tally::default(),
        };
        for slot in 0..workers {
            fleet.spawn(slot);
        }
        fleet
    }

    fn spawn(&mut self, slot: usize) {
        let mut child = Command::new(&self.program)
            .args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start a consumer worker");
        let stdout = child.stdout.take().expect("the worker's stdout");
        let stdin = child.stdin.take();
        let sender = self.sender.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if sender.send(Event::Line(line)).is_err() {
                    return;
                }
            }
            let _ = sender.send(Event::Closed(slot));
        });
        self.slots[slot] = Some((child, stdin));
        self.tally.started += 1;
    }

    fn record(&mut self, line: &str) {
        let mut words = line.split(' ');
        if words.next() != Some("SETTLED") {
            return;
        }
        let (Some(disposition), Some(id), Some(redelivered), Some(cause)) =
            (words.next(), words.next(), words.next(), words.next())
        else {
            panic!("a malformed worker line: {line:?}")
        };
        match disposition {
            "ack" => self.tally.acked += 1,
            "dead" => self.tally.dead_lettered.push(id.to_owned()),
            "retry" => self.tally.retried += 1,
            other => panic!("unknown disposition {other:?} in {line:?}"),
        }
        if disposition == "retry" {
            match cause {
                "panic" => *self.tally.panicked.entry(id.to_owned()).or_default() += 1,
                "failed" => *self.tally.failed.entry(id.to_owned()).or_default() += 1,
                _ => {}
            }
        }
        if redelivered == "1" {
            self.tally.redelivered += 1;
        }
    }

    /// Handles the workers' reports until `settled` deliveries were acked or dead-lettered,
    /// restarting every worker that was killed; then stops the workers (closes their standard
    /// input), waits for them to finish and returns the tally.
    ///
    /// # Panics
    ///
    /// When a worker dies otherwise than by a scheduled SIGKILL, or nothing settles within `within`.
    #[must_use]
    pub fn run_until_settled(mut self, settled: usize, within: Duration) -> Tally {
        let deadline = Instant::now() + within;
        while self.tally.acked + self.tally.dead_lettered.len() < settled {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(Event::Line(line)) => self.record(&line),
                Ok(Event::Closed(slot)) => {
                    let (mut child, _) = self.slots[slot].take().expect("a running worker");
                    let status = child.wait().expect("wait for a worker");
                    let signal = std::os::unix::process::ExitStatusExt::signal(&status);
                    assert_eq!(signal, Some(9), "a worker died otherwise than by its scheduled SIGKILL: {status:?}");
                    self.tally.kills += 1;
                    self.spawn(slot);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout | std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    panic!(
                        "only {} of {settled} deliveries settled within {within:?}: {:?}",
                        self.tally.acked + self.tally.dead_lettered.len(),
                        self.tally
                    )
                }
            }
        }
        // Stop: close every worker's standard input; each settles what it holds and exits.
        for (_, stdin) in self.slots.iter_mut().flatten() {
            stdin.take();
        }
        let mut running = self.slots.iter().filter(|s| s.is_some()).count();
        while running > 0 {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(10));
            match self.events.recv_timeout(left).expect("the workers did not stop") {
                Event::Line(line) => self.record(&line),
                Event::Closed(slot) => {
                    let (mut child, _) = self.slots[slot].take().expect("a running worker");
                    let status = child.wait().expect("wait for a worker");
                    assert!(status.success(), "a worker failed while stopping: {status:?}");
                    running -= 1;
                }
            }
        }
        std::mem::take(&mut self.tally)
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for (child, _) in self.slots.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The ledger: one row per side effect, in its own PostgreSQL table (no unique constraint, so a
/// double effect shows as two rows); beside it, the table `<table>_panics` where a worker notes
/// each id whose handler it made panic (one row per id: it panics once over the whole fleet).
pub struct Ledger {
    pool: PgPool,
    /// The table's name.
    pub table: String,
}

impl Ledger {
    /// Creates a fresh ledger table on `url`.
    ///
    /// # Panics
    ///
    /// When PostgreSQL cannot be reached.
    pub async fn create(url: &str) -> Ledger {
        let pool = PgPool::connect(url).await.expect("connect to PostgreSQL for the ledger");
        let table = crate::fresh::table_name("ledger");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE TABLE {table} (msg_id TEXT NOT NULL, pid INTEGER NOT NULL)")))
            .execute(&pool)
            .await
            .expect("create the ledger table");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE TABLE {table}_panics (msg_id TEXT PRIMARY KEY)")))
            .execute(&pool)
            .await
            .expect("create the panics table");
        Ledger { pool, table }
    }

    /// The ids whose handler panicked, sorted.
    ///
    /// # Panics
    ///
    /// When the query fails.
    pub async fn panicked(&self) -> Vec<String> {
        let table = &self.table;
        let rows: Vec<(String,)> =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT msg_id FROM {table}_panics ORDER BY msg_id")))
                .fetch_all(&self.pool)
                .await
                .expect("read the panics table");
        rows.into_iter().map(|(id,)| id).collect()
    }

    /// How many side effects each message id had.
    ///
    /// # Panics
    ///
    /// When the query fails.
    pub async fn counts(&self) -> BTreeMap<String, i64> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT msg_id, COUNT(*) FROM {} GROUP BY msg_id", self.table)))
                .fetch_all(&self.pool)
                .await
                .expect("read the ledger");
        rows.into_iter().collect()
    }

    /// Drops the table.
    pub async fn drop_table(self) {
        let table = &self.table;
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}, {table}_panics")))
            .execute(&self.pool)
            .await;
        self.pool.close().await;
    }
}

/// Checks the ledger: ids `0..messages` had exactly one side effect each, and nothing else had one.
/// Returns the number of double effects (always 0 when it returns).
///
/// # Panics
///
/// When an id had no side effect, or more than one, or an unknown id had one.
#[must_use]
pub fn assert_exactly_once(counts: &BTreeMap<String, i64>, messages: usize) -> i64 {
    let doubles: i64 = counts.values().map(|c| (c - 1).max(0)).sum();
    let missing: Vec<String> = (0..messages).map(message_id).filter(|id| !counts.contains_key(id)).collect();
    let unknown: Vec<&String> = counts.keys().filter(|id| !(0..messages).any(|i| message_id(i) == **id)).collect();
    assert_eq!(doubles, 0, "double side effects: {:?}", counts.iter().filter(|(_, c)| **c > 1).collect::<Vec<_>>());
    assert!(missing.is_empty(), "messages whose side effect never happened: {missing:?}");
    assert!(unknown.is_empty(), "side effects for ids never published: {unknown:?}");
    doubles
}

/// The `tracing` events of this thread while it lives (install it in a test on a current-thread
/// runtime: every task of that runtime runs on the thread), each as `LEVEL target: field=value ...`.
///
/// The subscriber is process-wide and keeps the events of the threads that installed a capture.
/// (A thread-local subscriber, `tracing::subscriber::set_default`, missed events here: tracing
/// caches per call site whether anyone listens, and tests on other threads that reached the same
/// call sites first could leave that cache saying no.)
pub struct LogCapture {
    events: Arc<Mutex<Vec<String>>>,
}

type Buffers = Mutex<Vec<(std::thread::ThreadId, Arc<Mutex<Vec<String>>>)>>;

/// The capturing threads and their buffers.
static CAPTURING: Buffers = Mutex::new(Vec::new());

impl LogCapture {
    /// Starts capturing this thread's events.
    ///
    /// # Panics
    ///
    /// When another global `tracing` subscriber is installed in this process.
    #[must_use]
    pub fn install() -> LogCapture {
        use tracing_subscriber::layer::SubscriberExt as _;
        static INSTALLED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
        INSTALLED.get_or_init(|| {
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(CaptureLayer))
                .expect("LogCapture is the only global tracing subscriber of this test binary");
        });
        let events: Arc<Mutex<Vec<String>>> = Arc::default();
        CAPTURING.lock().expect("the captures").push((std::thread::current().id(), Arc::clone(&events)));
        LogCapture { events }
    }

    /// The events captured so far.
    ///
    /// # Panics
    ///
    /// When the capture's lock is poisoned.
    #[must_use]
    pub fn events(&self) -> Vec<String> {
        self.events.lock().expect("the capture").clone()
    }
}

impl Drop for LogCapture {
    fn drop(&mut self) {
        if let Ok(mut capturing) = CAPTURING.lock() {
            capturing.retain(|(_, events)| !Arc::ptr_eq(events, &self.events));
        }
    }
}

struct CaptureLayer;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CaptureLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let thread = std::thread::current().id();
        let Some(events) = CAPTURING
            .lock()
            .ok()
            .and_then(|capturing| capturing.iter().find(|(t, _)| *t == thread).map(|(_, e)| Arc::clone(e)))
        else {
            return;
        };
        events.lock().expect("the capture").push(crate::event_text(event));
    }
}
