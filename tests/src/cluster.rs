//! A real Redis Cluster on loopback for the tests: 3 masters and 3 replicas started from the
//! installed `redis-server` (or the server `REDIS_SERVER_BIN` names: `scripts/valkey` runs the
//! cluster group on Valkey) in a temporary directory, joined with
//! `redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes`.
//!
//! The servers run under a small shell supervisor whose standard input is a pipe held by the test
//! process: when the process ends (normally, by a panic, or killed), the pipe closes and the
//! supervisor stops every server it started and deletes the directory. [`Cluster::shared`] starts
//! one cluster per test binary and reuses it; [`Cluster::start`] starts a private one (for tests
//! that kill nodes), stopped when it is dropped.
//!
//! Without `redis-server` and `redis-cli` the tests skip loudly, or fail under
//! `IDEMPOTENT_REQUIRE_SERVICES=1`, like every other server of [`services`](crate::services).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use idempotent_runtime::stores::redis::redis;

use crate::services::{redis_query, wait_until};

/// The node timeout of the test clusters: how long a master may be unreachable before its
/// replica is promoted (the failover then takes about one to three times this).
pub const NODE_TIMEOUT_MS: u64 = 1000;

/// The first ports tried, 100 apart; each cluster takes six consecutive ports (and their cluster
/// bus ports, 10,000 higher). `IDEMPOTENT_CLUSTER_PORT` sets the first base.
const BASES: [u16; 8] = [7100, 7200, 7300, 7400, 7500, 7600, 7700, 7800];

/// The supervisor: starts a node per argument port, restarts one on `restart <port>`, and stops
/// every server and removes the directory when its input closes.
const SUPERVISOR: &str = r#"
dir=$1; shift
start() {
  "${REDIS_SERVER_BIN:-redis-server}" --port "$1" --bind 127.0.0.1 --cluster-enabled yes --cluster-config-file "nodes-$1.conf" \
    --cluster-node-timeout "$NODE_TIMEOUT" --dir "$dir" --save '' --appendonly no \
    --logfile "$dir/$1.log" --daemonize no &
}
for port in "$@"; do start "$port"; done
echo started
while read -r command port; do
  case "$command" in
    restart) start "$port"; echo restarted ;;
  esac
done
kill $(jobs -p) 2>/dev/null
wait
rm -rf "$dir"
"#;

/// A running test cluster.
#[derive(Debug)]
pub struct Cluster {
    ports: Vec<u16>,
    supervisor: Mutex<(Child, Option<ChildStdin>)>,
    output: Mutex<BufReader<std::process::ChildStdout>>,
}

/// Serialises port choice and start-up, so two clusters of one process never pick the same ports.
static STARTING: Mutex<()> = Mutex::new(());

impl Cluster {
    /// The cluster shared by every test of this binary, started on first use; `None` (after a
    /// loud skip) if `redis-server` or `redis-cli` is missing and services are not required.
    pub fn shared(test: &str) -> Option<&'static Cluster> {
        static SHARED: OnceLock<Option<Cluster>> = OnceLock::new();
        SHARED.get_or_init(|| Cluster::start(test)).as_ref()
    }

    /// Starts a private cluster, stopped when dropped; `None` as for [`Cluster::shared`].
    ///
    /// # Panics
    ///
    /// When the servers are installed but the cluster does not come up.
    #[must_use]
    pub fn start(test: &str) -> Option<Cluster> {
        let server = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        if !crate::services::programs_installed(test, &[&server, "redis-cli"]) {
            return None;
        }
        let _starting = STARTING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let base = free_base().expect("no six free consecutive loopback ports (and bus ports) in 7100..7900");
        let ports: Vec<u16> = (base..base + 6).collect();
        let dir = crate::fresh::temp_dir("cluster");
        let mut child = Command::new("bash")
            .arg("-c")
            .arg(SUPERVISOR)
            .arg("supervisor")
            .arg(&dir)
            .args(ports.iter().map(u16::to_string))
            .env("NODE_TIMEOUT", NODE_TIMEOUT_MS.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the cluster supervisor (bash)");
        let stdin = child.stdin.take();
        let mut output = BufReader::new(child.stdout.take().expect("supervisor output"));
        let mut line = String::new();
        output.read_line(&mut line).expect("the supervisor's first line");
        assert_eq!(line.trim(), "started", "the cluster supervisor failed to start (see {})", dir.display());
        let cluster = Cluster { ports, supervisor: Mutex::new((child, stdin)), output: Mutex::new(output) };
        for &port in &cluster.ports {
            wait_until(Duration::from_secs(20), &format!("redis-server on port {port} answers"), || {
                redis_query::<String>(port, &redis::cmd("PING")).is_ok()
            });
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        create.args(cluster.ports.iter().map(|p| format!("127.0.0.1:{p}")));
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        let created = create.output().expect("run redis-cli --cluster create");
        assert!(
            created.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&created.stdout),
            String::from_utf8_lossy(&created.stderr)
        );
        cluster.wait_healthy(Duration::from_secs(30));
        eprintln!("cluster: 3 masters + 3 replicas on 127.0.0.1:{}..{} (logs in {})", base, base + 5, dir.display());
        Some(cluster)
    }

    /// The nodes' URLs, to connect with.
    #[must_use]
    pub fn urls(&self) -> Vec<String> {
        self.ports.iter().map(|p| format!("redis://127.0.0.1:{p}")).collect()
    }

    /// Every port of the cluster.
    #[must_use]
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// The ports of the masters that serve slots now, as a live node sees them.
    ///
    /// # Panics
    ///
    /// When no node answers.
    #[must_use]
    pub fn masters(&self) -> Vec<u16> {
        let nodes = self.nodes().expect("a node answers CLUSTER NODES");
        let mut masters: Vec<u16> = nodes
            .iter()
            .filter(|n| n.flags.iter().any(|f| f == "master") && !n.failed() && n.has_slots)
            .map(|n| n.port)
            .collect();
        masters.sort_unstable();
        masters
    }

    /// For each master, its replicas' ports.
    #[must_use]
    pub fn replicas_of(&self, master: u16) -> Vec<u16> {
        let Some(nodes) = self.nodes() else { return Vec::new() };
        let Some(id) = nodes.iter().find(|n| n.port == master).map(|n| n.id.clone()) else { return Vec::new() };
        nodes.iter().filter(|n| n.master_id == id && !n.failed()).map(|n| n.port).collect()
    }

    /// Kills the node on `port` with SIGKILL (no chance to hand anything over).
    ///
    /// # Panics
    ///
    /// When the node does not answer or `kill` fails.
    pub fn kill(&self, port: u16) {
        let info: String =
            redis_query(port, redis::cmd("INFO").arg("server")).expect("INFO server of the node to kill");
        let pid = info
            .lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .map(str::trim)
            .expect("INFO server names the process id")
            .to_owned();
        let status = Command::new("kill").arg("-KILL").arg(&pid).status().expect("run kill");
        assert!(status.success(), "kill -KILL {pid} failed");
        wait_until(Duration::from_secs(10), &format!("the node on {port} is down"), || {
            redis_query::<String>(port, &redis::cmd("PING")).is_err()
        });
    }

    /// Starts the node on `port` again (with its cluster configuration: it rejoins).
    ///
    /// # Panics
    ///
    /// When the supervisor is gone or the node does not answer within 20 s.
    pub fn restart(&self, port: u16) {
        {
            let mut supervisor = self.supervisor.lock().unwrap();
            let stdin = supervisor.1.as_mut().expect("the supervisor's input");
            writeln!(stdin, "restart {port}").expect("tell the supervisor to restart a node");
            stdin.flush().expect("flush");
        }
        let mut line = String::new();
        self.output.lock().unwrap().read_line(&mut line).expect("the supervisor's answer");
        assert_eq!(line.trim(), "restarted");
        wait_until(Duration::from_secs(20), &format!("the restarted node on {port} answers"), || {
            redis_query::<String>(port, &redis::cmd("PING")).is_ok()
        });
    }

    /// Waits until the slots of the killed master `port` are served by another master (its
    /// replica was promoted).
    ///
    /// # Panics
    ///
    /// When that does not happen within `limit`.
    pub fn wait_promoted(&self, port: u16, limit: Duration) {
        wait_until(limit, &format!("a replica of {port} is promoted"), || {
            let masters = self.masters();
            masters.len() == 3 && !masters.contains(&port)
        });
    }

    /// Waits until every live node reports `cluster_state:ok`, 3 masters serve all slots, and
    /// each has a replica whose link is up.
    ///
    /// # Panics
    ///
    /// When that does not happen within `limit`.
    pub fn wait_healthy(&self, limit: Duration) {
        wait_until(limit, "the cluster is healthy (state ok, 3 masters, each with a synced replica)", || {
            let live: Vec<u16> =
                self.ports.iter().copied().filter(|&p| redis_query::<String>(p, &redis::cmd("PING")).is_ok()).collect();
            let ok = live.iter().all(|&p| {
                redis_query::<String>(p, redis::cmd("CLUSTER").arg("INFO"))
                    .is_ok_and(|i| i.contains("cluster_state:ok"))
            });
            let masters = self.masters();
            ok && masters.len() == 3
                && masters.iter().all(|&m| {
                    self.replicas_of(m).iter().any(|&r| {
                        redis_query::<String>(r, redis::cmd("INFO").arg("replication"))
                            .is_ok_and(|i| i.contains("master_link_status:up"))
                    })
                })
        });
    }

    /// How many keys under `prefix` each master holds (by `SCAN` on each master).
    ///
    /// # Panics
    ///
    /// When a master does not answer.
    #[must_use]
    pub fn keys_per_master(&self, prefix: &str) -> HashMap<u16, usize> {
        self.masters().into_iter().map(|port| (port, scan(port, prefix).len())).collect()
    }

    /// Deletes every key under `prefix` on every master.
    pub fn delete_prefix(&self, prefix: &str) {
        for port in self.masters() {
            for key in scan(port, prefix) {
                let _ = redis_query::<i64>(port, redis::cmd("DEL").arg(&key));
            }
        }
    }

    fn nodes(&self) -> Option<Vec<Node>> {
        self.ports
            .iter()
            .find_map(|&p| redis_query::<String>(p, redis::cmd("CLUSTER").arg("NODES")).ok())
            .map(|text| text.lines().filter_map(Node::parse).collect())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let mut supervisor = self.supervisor.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        drop(supervisor.1.take()); // EOF: the supervisor stops the servers and removes the directory
        let _ = supervisor.0.wait();
    }
}

/// One line of `CLUSTER NODES`.
#[derive(Debug)]
struct Node {
    id: String,
    port: u16,
    flags: Vec<String>,
    master_id: String,
    has_slots: bool,
}

impl Node {
    fn parse(line: &str) -> Option<Node> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let address = fields.get(1)?.split('@').next()?;
        Some(Node {
            id: (*fields.first()?).to_owned(),
            port: address.rsplit_once(':')?.1.parse().ok()?,
            flags: fields.get(2)?.split(',').map(str::to_owned).collect(),
            master_id: (*fields.get(3)?).to_owned(),
            has_slots: fields.len() > 8,
        })
    }

    fn failed(&self) -> bool {
        self.flags.iter().any(|f| f == "fail" || f == "fail?" || f == "noaddr")
    }
}

fn free_base() -> Option<u16> {
    let first = std::env::var("IDEMPOTENT_CLUSTER_PORT").ok().and_then(|p| p.parse().ok());
    first.into_iter().chain(BASES).find(|&base| {
        (base..base + 6).all(|p| {
            TcpListener::bind(("127.0.0.1", p)).is_ok() && TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok()
        })
    })
}

fn scan(port: u16, prefix: &str) -> Vec<String> {
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis_query(
            port,
            redis::cmd("SCAN").arg(cursor).arg("MATCH").arg(format!("{prefix}*")).arg("COUNT").arg(1000),
        )
        .expect("SCAN a master");
        keys.extend(batch);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
}
