//! Finding the test servers: a URL from the environment with a loopback default, and the rule for
//! an absent server: skip loudly, or fail when `IDEMPOTENT_REQUIRE_SERVICES=1` (as `.ci/run` sets).

use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

/// `true` when an unreachable service must fail the test instead of skipping it.
#[must_use]
pub fn services_required() -> bool {
    std::env::var("IDEMPOTENT_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// The URL in `var`, or `default`, if a TCP connection to its host and port succeeds.
///
/// Otherwise prints a loud `SKIPPED` line and returns `None`, or panics when services are required.
#[must_use]
pub fn service_url(var: &str, default: &str, test: &str) -> Option<String> {
    let url = std::env::var(var).unwrap_or_else(|_| default.to_owned());
    if reachable(&url) {
        return Some(url);
    }
    absent(&format!("{test}: no server at {url} (set {var} to point elsewhere)"));
    None
}

/// What a test does when something it needs is missing: prints a loud `SKIPPED` line with
/// `message`, or panics with it when services are required.
///
/// # Panics
///
/// When `IDEMPOTENT_REQUIRE_SERVICES=1`.
pub fn absent(message: &str) {
    assert!(!services_required(), "{message}, and IDEMPOTENT_REQUIRE_SERVICES=1 requires it");
    skipped(message);
}

/// Whether each of `programs` runs (`program --version`); if one does not, [`absent`] with a
/// message naming `test` and the programs.
///
/// # Panics
///
/// When one is missing and `IDEMPOTENT_REQUIRE_SERVICES=1`.
#[must_use]
pub fn programs_installed(test: &str, programs: &[&str]) -> bool {
    let runs = |program: &&str| {
        let (null, also_null) = (std::process::Stdio::null(), std::process::Stdio::null());
        std::process::Command::new(program).arg("--version").stdout(null).stderr(also_null).status().is_ok()
    };
    if programs.iter().all(runs) {
        return true;
    }
    absent(&format!("{test}: {} is not installed", programs.join(" or ")));
    false
}

/// Prints a loud `SKIPPED` line that a plain `cargo test` shows.
///
/// libtest captures what a passing test prints with `print!`/`eprintln!` and throws it away, so
/// a skipped test would look like a pass. This writes to the process's standard error directly
/// (a `write_all` on the handle, which the capture does not intercept), so the line appears in
/// the test run's output whether the test passes or not.
pub fn skipped(message: &str) {
    use std::io::Write as _;
    let line = format!("\n*** SKIPPED {message} ***\n");
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_all(line.as_bytes());
    let _ = stderr.flush();
}

/// The arguments of `redis-server` that start the test server as the machine and `.ci/run` do
/// (no persistence), for the tests that stop and restart it.
pub const REDIS_START_ARGS: &[&str] = &[
    "--daemonize",
    "yes",
    "--bind",
    "127.0.0.1 -::1",
    "--port",
    "6379",
    "--save",
    "",
    "--appendonly",
    "no",
    "--dir",
    "/var/lib/redis",
    "--logfile",
    "/var/log/redis/ci.log",
];

/// The port of the Redis server the restart tests stop and start: the port of `REDIS_URL`, or
/// 6379. (They run `redis-cli` and `redis-server` on this machine, so `REDIS_URL` must name a
/// local server for them.)
#[must_use]
pub fn redis_port() -> u16 {
    std::env::var("REDIS_URL").ok().and_then(|url| host_port(&url)).map_or(6379, |(_, port)| port)
}

/// Whether the Redis server on `port` answers `PING` with `PONG`: it is up and has loaded its
/// snapshot (a server still loading one answers `LOADING`). Through `redis-cli`, which the restart
/// tests use to stop and start it.
#[must_use]
pub fn redis_answers_pong(port: u16) -> bool {
    std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string(), "ping"])
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "PONG")
}

/// [`REDIS_START_ARGS`] with `--port` set to [`redis_port`].
#[must_use]
pub fn redis_start_args() -> Vec<String> {
    let mut args: Vec<String> = REDIS_START_ARGS.iter().map(|a| (*a).to_owned()).collect();
    if let Some(at) = args.iter().position(|a| a == "--port") {
        args[at + 1] = redis_port().to_string();
    }
    args
}

/// The Redis URL (`REDIS_URL`, default `redis://127.0.0.1:6379`).
#[must_use]
pub fn redis_url(test: &str) -> Option<String> {
    service_url("REDIS_URL", "redis://127.0.0.1:6379", test)
}

/// The PostgreSQL URL (`POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`).
#[must_use]
pub fn postgres_url(test: &str) -> Option<String> {
    service_url("POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test", test)
}

/// The MySQL/MariaDB URL (`MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`).
#[must_use]
pub fn mysql_url(test: &str) -> Option<String> {
    service_url("MYSQL_URL", "mysql://root@127.0.0.1:3306/test", test)
}

/// The RabbitMQ URL (`AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`).
#[must_use]
pub fn amqp_url(test: &str) -> Option<String> {
    service_url("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f", test)
}

/// The NATS URL, of a server with JetStream enabled (`NATS_URL`, default `nats://127.0.0.1:4222`).
#[must_use]
pub fn nats_url(test: &str) -> Option<String> {
    service_url("NATS_URL", "nats://127.0.0.1:4222", test)
}

fn reachable(url: &str) -> bool {
    let Some((host, port)) = host_port(url) else { return false };
    let Ok(addrs) = (host, port).to_socket_addrs() else { return false };
    addrs.into_iter().any(|addr| std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok())
}

/// `scheme://[user[:pass]@]host[:port][/...]` → (host, port).
fn host_port(url: &str) -> Option<(String, u16)> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split(['/', '?']).next()?;
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let default_port = match url.split_once("://")?.0 {
        "redis" | "rediss" => 6379,
        "postgres" | "postgresql" => 5432,
        "mysql" | "mariadb" => 3306,
        "amqp" | "amqps" => 5672,
        "nats" | "tls" => 4222,
        _ => return None,
    };
    match host_port.rsplit_once(':') {
        Some((host, port)) => Some((host.to_owned(), port.parse().ok()?)),
        None => Some((host_port.to_owned(), default_port)),
    }
}

/// One command to the Redis server on loopback `port`, on a fresh connection with short
/// timeouts (for test fixtures that start servers of their own).
///
/// # Errors
///
/// When the server cannot be reached in 500 ms, does not answer in 2 s, or answers an error.
#[cfg(feature = "redis")]
pub fn redis_query<T: idempotent_runtime::stores::redis::redis::FromRedisValue>(
    port: u16,
    cmd: &idempotent_runtime::stores::redis::redis::Cmd,
) -> idempotent_runtime::stores::redis::redis::RedisResult<T> {
    let client = idempotent_runtime::stores::redis::redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let mut connection = client.get_connection_with_timeout(Duration::from_millis(500))?;
    connection.set_read_timeout(Some(Duration::from_secs(2)))?;
    cmd.query(&mut connection)
}

/// `ACL SETUSER <user>`: a user allowed every command but `EVAL` and `EVALSHA`, with any password.
/// A store connected as that user can complete a call only with the native `SET ... IFEQ`, so
/// the tests that show the completion needs no script connect as it.
#[cfg(feature = "redis")]
#[must_use]
pub fn acl_user_without_scripts(user: &str) -> idempotent_runtime::stores::redis::redis::Cmd {
    let mut cmd = idempotent_runtime::stores::redis::redis::cmd("ACL");
    cmd.arg("SETUSER").arg(user).arg("on").arg("nopass").arg("~*").arg("&*").arg("+@all").arg("-eval").arg("-evalsha");
    cmd
}

/// Polls `condition` every 50 ms until it holds.
///
/// # Panics
///
/// Naming `what`, when it does not hold within `limit`.
pub fn wait_until(limit: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::host_port;

    #[test]
    fn conformance_urls_are_split() {
        assert_eq!(host_port("redis://127.0.0.1:6379"), Some(("127.0.0.1".into(), 6379)));
        assert_eq!(host_port("postgres://postgres@127.0.0.1/test"), Some(("127.0.0.1".into(), 5432)));
        assert_eq!(host_port("mysql://root:pw@db:3307/test?x=1"), Some(("db".into(), 3307)));
        assert_eq!(host_port("amqp://guest:guest@127.0.0.1:5672/%2f"), Some(("127.0.0.1".into(), 5672)));
        assert_eq!(host_port("nats://127.0.0.1"), Some(("127.0.0.1".into(), 4222)));
        assert_eq!(host_port("nonsense"), None);
    }
}
