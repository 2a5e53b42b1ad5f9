//! A private Redis master and its replica on loopback, for the tests of replica
//! acknowledgements (`RedisStore::with_replica_acks`) on one server: two `redis-server`
//! processes started by the test, which can stop the replica (`SIGSTOP`) so that it
//! acknowledges nothing while it stays linked.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idempotent_runtime::stores::redis::redis;

/// A private Redis master and its replica, each a `redis-server` on a free loopback port, stopped
/// (and their directory removed) when dropped. The binary is `REDIS_SERVER_BIN` if set (the
/// Redis 8 group of `.ci/run` sets it), else `redis-server` from the `PATH`.
pub struct Replicated {
    master: Child,
    replica: Child,
    /// The master's port.
    pub master_port: u16,
    /// The replica's port.
    pub replica_port: u16,
    dir: PathBuf,
}

impl Replicated {
    /// `None` (after a loud skip) without `redis-server`, unless services are required.
    ///
    /// # Panics
    ///
    /// When the servers are installed but the replica does not link to its master within 20 s.
    #[must_use]
    pub fn start(test: &str) -> Option<Replicated> {
        let binary = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        if !crate::services::programs_installed(test, &[&binary]) {
            return None;
        }
        // Both bound at once, so the two ports differ; released just before the servers take them.
        let free = || std::net::TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
        let (first, second) = (free(), free());
        let port = |listener: &std::net::TcpListener| listener.local_addr().expect("a bound port").port();
        let (master_port, replica_port) = (port(&first), port(&second));
        drop((first, second));
        let dir = crate::fresh::temp_dir("replicated");
        let server = |port: u16, extra: &[String]| {
            Command::new(&binary)
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&dir)
                .args(extra)
                .stdout(Stdio::null())
                .spawn()
                .expect("start redis-server")
        };
        // No delay before the replica's first sync (diskless syncs wait 5 s for more replicas).
        let master = server(master_port, &["--repl-diskless-sync-delay".into(), "0".into()]);
        let replica = server(replica_port, &["--replicaof".into(), format!("127.0.0.1 {master_port}")]);
        let pair = Replicated { master, replica, master_port, replica_port, dir };
        crate::services::wait_until(Duration::from_secs(20), "the replica is linked to its master", || {
            crate::services::redis_query::<String>(replica_port, redis::cmd("INFO").arg("replication"))
                .is_ok_and(|info| info.contains("master_link_status:up"))
        });
        Some(pair)
    }

    /// The URL of the server on `port`.
    #[must_use]
    pub fn url(port: u16) -> String {
        format!("redis://127.0.0.1:{port}")
    }

    /// Stops (`SIGSTOP`) or resumes (`SIGCONT`) the replica's process: stopped, it stays linked
    /// in its master's eyes and acknowledges nothing.
    ///
    /// # Panics
    ///
    /// When `kill` fails.
    pub fn signal_replica(&self, signal: &str) {
        let sent = Command::new("kill").arg(signal).arg(self.replica.id().to_string()).status();
        assert!(sent.is_ok_and(|status| status.success()), "kill {signal} the replica");
    }
}

impl Drop for Replicated {
    fn drop(&mut self) {
        for child in [&mut self.replica, &mut self.master] {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
