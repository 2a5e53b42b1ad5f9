//! The `idempotent` binary, run as an operator runs it, against the real servers.
//!
//! Each store gets the same two tests: every command on records written by the library
//! (`cli_<store>::commands`), and the stuck key (`cli_<store>::stuck_key_after_sigkill`): a child
//! process claims a key and is killed with SIGKILL, `list --state running` finds the claim,
//! `release` frees it, and the retry runs the body exactly once. Scopes and keys are unique per
//! run, so other tests sharing the servers never collide with these. A test whose server is absent
//! skips loudly, and fails when `IDEMPOTENT_REQUIRE_SERVICES=1`.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::net::{TcpStream, ToSocketAddrs as _};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use idempotent_runtime::admin::{Admin, Released};
use idempotent_runtime::{AnyStore, Claim, ClaimRequest, Completion, Key, Store as _, Token, idempotent};
use serde_json::Value;

/// The store URL for `name`, or `None` (after saying so) when its server is not running.
fn url(name: &str) -> Option<String> {
    let (var, default) = match name {
        "redis" => ("REDIS_URL", "redis://127.0.0.1:6379"),
        "postgres" => ("POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test"),
        "mysql" => ("MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
        "cluster" => {
            // The tests' cluster of 3 masters and 3 replicas, started once per test binary.
            let cluster = idempotent_tests::cluster::Cluster::shared("cli cluster")?;
            let nodes: Vec<String> =
                cluster.urls().iter().map(|u| u.trim_start_matches("redis://").to_owned()).collect();
            return Some(format!("redis+cluster://{}", nodes.join(",")));
        }
        _ => {
            // A fresh SQLite file per test, created by the library (the tool never creates one).
            let dir = std::env::temp_dir().join(format!("idempotent-cli-{}-{}", std::process::id(), unique()));
            std::fs::create_dir_all(&dir).unwrap();
            return Some(format!("sqlite://{}", dir.join("records.db").display()));
        }
    };
    let url = std::env::var(var).unwrap_or_else(|_| default.to_owned());
    let authority = url.split("://").nth(1).unwrap_or("").split(['/', '?']).next().unwrap_or("");
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let up = host_port
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .is_some_and(|addr| TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok());
    if up {
        // The single-server Redis tests keep to a database of their own: `list` walks the whole
        // database's keyspace within a 2 s budget per page, and benchmarks and the other test
        // files fill database 0 (a `.ci/run` failed so, with 10 million benchmark keys there).
        return Some(if name == "redis" { redis_database(&url, 4) } else { url });
    }
    let message = format!("cli {name}: no server at {url} (set {var} to point elsewhere)");
    assert!(std::env::var("IDEMPOTENT_REQUIRE_SERVICES").as_deref() != Ok("1"), "{message}");
    eprintln!("\n*** SKIPPED {message} ***\n");
    None
}

/// `url` with its database set to `database` (any path or query it had is dropped).
fn redis_database(url: &str, database: u8) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("redis", url));
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    format!("{scheme}://{authority}/{database}")
}

fn unique() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
}

/// Runs `idempotent --store <url> <args>` with stdin closed.
fn cli(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idempotent"))
        .arg("--store")
        .arg(url)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run the idempotent binary")
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("exited, not killed")
}

/// The command's stdout as JSON, asserting it exited 0.
fn json(url: &str, args: &[&str]) -> Value {
    let output = cli(url, args);
    assert_eq!(code(&output), 0, "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {:?}", output.stdout))
}

fn keys_of(page: &Value) -> Vec<String> {
    page["entries"].as_array().unwrap().iter().map(|e| e["key"].as_str().unwrap().to_owned()).collect()
}

/// A response as the HTTP layer records it (its compact form; the earlier form is shown by
/// `show.rs`'s unit test).
const HTTP_OUTCOME: &str = r#"{"Ok":"h20112:content-type16:application/json:{\"id\":7}"}"#;

async fn commands(name: &str) {
    let Some(url) = url(name) else { return };
    let store = AnyStore::from_url(&url).await.unwrap();
    let scope = format!("cli_{name}_{}", unique());
    let key = |k: &str| Key::new(&scope, k).unwrap();
    let long = Duration::from_secs(600);
    let running = Token::new();
    assert_eq!(store.claim(&ClaimRequest::new(&key("run"), &running, None, long)).await.unwrap(), Claim::Claimed);
    for (k, outcome) in [("done", HTTP_OUTCOME), ("pay", r#"{"Ok":42}"#)] {
        let token = Token::new();
        store.claim(&ClaimRequest::new(&key(k), &token, None, long)).await.unwrap();
        store.complete(&Completion::new(&key(k), &token, None, outcome.as_bytes(), long)).await.unwrap();
    }

    // inspect: the running claim, the HTTP outcome pretty-printed, an absent key.
    let seen = json(&url, &["--json", "inspect", &scope, "run"]);
    assert_eq!((seen["state"].as_str(), seen["token"].as_str()), (Some("running"), Some(running.as_str())));
    assert!(seen["remaining_ms"].as_u64().is_some_and(|ms| ms > 500_000 && ms <= 600_000), "{seen}");
    let shown = cli(&url, &["inspect", &scope, "done"]);
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(
        text.contains("state        done")
            && text.contains("HTTP 201")
            && text.contains("content-type: application/json"),
        "{text}"
    );
    assert!(text.contains("\"id\": 7"), "the JSON body is indented: {text}");
    let seen = json(&url, &["--json", "inspect", &scope, "done"]);
    assert_eq!(seen["layer_record"]["status"], 201, "{seen}");
    assert_eq!(seen["layer_record"]["body"], r#"{"id":7}"#, "{seen}");
    assert_eq!(code(&cli(&url, &["inspect", &scope, "absent"])), 1);

    // list: filtered by state, and paged one entry at a time through every record of the scope.
    let page = json(&url, &["--json", "list", "--scope", &scope, "--state", "running"]);
    assert_eq!(keys_of(&page), ["run"]);
    let (mut listed, mut after) = (Vec::new(), None::<String>);
    for _ in 0..20 {
        let mut args = vec!["--json", "list", "--scope", &scope, "--limit", "1"];
        if let Some(cursor) = &after {
            args.extend(["--after", cursor]);
        }
        let page = json(&url, &args);
        listed.extend(keys_of(&page));
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    listed.sort();
    assert_eq!(listed, ["done", "pay", "run"], "every record once, across pages");

    // stats: this scope's counts.
    let stats = json(&url, &["--json", "stats"]);
    let count = |state: &str| {
        stats["counts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["scope"] == scope.as_str() && c["state"] == state)
            .map(|c| c["count"].as_u64().unwrap())
    };
    assert_eq!((count("running"), count("done")), (Some(1), Some(2)), "{stats}");

    // release: a completed record needs --force; without --yes and a terminal, nothing is deleted.
    assert_eq!(code(&cli(&url, &["release", &scope, "pay", "--yes"])), 4);
    assert_eq!(code(&cli(&url, &["release", &scope, "run"])), 4);
    // A running claim whose lease is live needs --force too: its call may still be running.
    let refused = cli(&url, &["release", &scope, "run", "--yes"]);
    assert_eq!(code(&refused), 4, "{}", String::from_utf8_lossy(&refused.stderr));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--force"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    assert_eq!(json(&url, &["--json", "inspect", &scope, "run"])["state"], "running", "refusals delete nothing");
    assert_eq!(json(&url, &["--json", "inspect", &scope, "pay"])["state"], "done", "refusals delete nothing");
    let released = json(&url, &["--json", "release", &scope, "pay", "--force", "--yes"]);
    assert_eq!(released["released"], true);
    assert_eq!(code(&cli(&url, &["inspect", &scope, "pay"])), 1);
    assert_eq!(code(&cli(&url, &["release", &scope, "pay", "--yes"])), 1, "gone now");

    // The fence: a claim that completed after it was inspected is not released as running.
    let seen = Admin::inspect(&store, &key("run")).await.unwrap().unwrap();
    store.complete(&Completion::new(&key("run"), &running, None, b"{\"Ok\":1}", long)).await.unwrap();
    assert_eq!(Admin::release(&store, &key("run"), &seen).await.unwrap(), Released::Changed);
    assert_eq!(json(&url, &["--json", "inspect", &scope, "run"])["state"], "done", "left alone");

    // An expired claim holds nothing, so it is released without --force (Redis deletes it itself).
    let lapsing = Duration::from_millis(1);
    store.claim(&ClaimRequest::new(&key("lapsed"), &Token::new(), None, lapsing)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    if matches!(name, "redis" | "cluster") {
        assert_eq!(code(&cli(&url, &["release", &scope, "lapsed", "--yes"])), 1, "Redis expired it by itself");
    } else {
        assert_eq!(json(&url, &["--json", "inspect", &scope, "lapsed"])["state"], "expired");
        let released = json(&url, &["--json", "release", &scope, "lapsed", "--yes"]);
        assert_eq!(released["released"], true, "{released}");
    }

    // purge: a count (Redis expires by itself: 0).
    let purged = json(&url, &["--json", "purge", "--expired"]);
    assert!(purged["purged"].is_u64(), "{purged}");
    assert_eq!(code(&cli(&url, &["purge"])), 2, "--expired is required");
    let older = cli(&url, &["list", "--older-than", "5m"]);
    assert_eq!(code(&older), 2);
    assert!(String::from_utf8_lossy(&older.stderr).contains("--expiring-within"));
}

/// How many times `charge`'s body ran, per key (the stores' tests run in parallel).
static BODY_RUNS: Mutex<BTreeMap<String, u32>> = Mutex::new(BTreeMap::new());

fn runs(key: &str) -> u32 {
    BODY_RUNS.lock().unwrap().get(key).copied().unwrap_or(0)
}

#[idempotent(key = key, store = store, scope = "cli_stuck", lease = "120s", retention = "10m")]
async fn charge(store: &AnyStore, key: &str) -> Result<u32, idempotent_runtime::Error> {
    let mut runs = BODY_RUNS.lock().unwrap();
    let count = runs.entry(key.to_owned()).or_default();
    *count += 1;
    Ok(*count)
}

/// Run as a child process by the stuck-key tests: claims `CLI_HOLD_KEY` in scope `cli_stuck` as
/// `charge` would, says so, and waits to be killed.
#[tokio::test]
#[ignore = "a child process of the stuck-key tests"]
async fn cli_holder_child() {
    let (Ok(url), Ok(key)) = (std::env::var("CLI_HOLD_URL"), std::env::var("CLI_HOLD_KEY")) else { return };
    let store = AnyStore::from_url(&url).await.unwrap();
    let key = Key::new("cli_stuck", &key).unwrap();
    let claim = store.claim(&ClaimRequest::new(&key, &Token::new(), None, Duration::from_secs(120))).await.unwrap();
    assert_eq!(claim, Claim::Claimed);
    println!("claimed");
    tokio::time::sleep(Duration::from_secs(600)).await;
}

async fn stuck_key(name: &str) {
    let Some(url) = url(name) else { return };
    let store = AnyStore::from_url(&url).await.unwrap();
    let key = format!("{name}-{}", unique());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "cli_holder_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env("CLI_HOLD_URL", &url)
        .env("CLI_HOLD_KEY", &key)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let claimed = BufReader::new(stdout).lines().map_while(Result::ok).any(|line| line.ends_with("claimed"));
    assert!(claimed, "the child claimed the key");
    child.kill().unwrap(); // SIGKILL: no destructor, no release.
    let _ = child.wait();

    // The crashed claim blocks the key: a retry now does not run the body.
    let blocked = charge(&store, &key).await;
    assert!(matches!(blocked, Err(idempotent_runtime::Error::InProgress { .. })), "{blocked:?}");

    // The operator finds it and frees it.
    let page = json(&url, &["--json", "list", "--scope", "cli_stuck", "--state", "running", "--limit", "1000"]);
    assert!(keys_of(&page).contains(&key), "the stuck claim is listed: {page}");
    let released = json(&url, &["--json", "release", "cli_stuck", &key, "--force", "--yes"]);
    assert_eq!((released["released"].as_bool(), released["was"]["state"].as_str()), (Some(true), Some("running")));

    // The retry runs the body once; the next replays.
    assert_eq!(runs(&key), 0, "nothing ran while the dead claim held the key");
    assert_eq!(charge(&store, &key).await.unwrap(), 1);
    assert_eq!(charge(&store, &key).await.unwrap(), 1, "replayed");
    assert_eq!(runs(&key), 1, "the body ran exactly once after the release");
    assert_eq!(json(&url, &["--json", "inspect", "cli_stuck", &key])["state"], "done");
}

macro_rules! store_tests {
    ($($module:ident: $store:literal),*) => {$(
        mod $module {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn commands() {
                super::commands($store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stuck_key_after_sigkill() {
                super::stuck_key($store).await;
            }
        }
    )*};
}

store_tests!(cli_redis: "redis", cli_cluster: "cluster", cli_postgres: "postgres", cli_mysql: "mysql", cli_sqlite: "sqlite");

/// A scope's one record among 300,000 other keys of the same Redis database: `list` walks the
/// keyspace in `SCAN` batches of 1,000 (it used batches of the page size, at least 10: one round
/// trip per ten keys, which ran into the store's 10 s step timeout and exit 3 on a Redis a
/// benchmark had filled with 800,000 keys), and ends a page short, with a cursor, after 2 s. The
/// keys live in database 5, so the server's `SCAN` count is this test's (other tests scan small
/// databases).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_redis_lists_a_scope_among_many_other_keys() {
    use idempotent_runtime::stores::redis::redis;

    let Some(url) = url("redis") else { return };
    let url = redis_database(&url, 5);
    let mut connection = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let scans = async |connection: &mut redis::aio::MultiplexedConnection| -> u64 {
        let info: String = redis::cmd("INFO").arg("commandstats").query_async(connection).await.unwrap();
        info.lines()
            .find_map(|line| line.strip_prefix("cmdstat_scan:calls="))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |calls| calls.parse().unwrap())
    };
    let foreign = format!("cli-foreign-{}:", unique());
    let names = |batch: usize| (0..10_000).map(|i| format!("{foreign}{batch}-{i}")).collect::<Vec<_>>();
    for batch in 0..30 {
        let mut pipe = redis::pipe();
        for name in names(batch) {
            pipe.cmd("SET").arg(name).arg(1).arg("EX").arg(300).ignore();
        }
        pipe.query_async::<()>(&mut connection).await.unwrap();
    }
    let store = AnyStore::from_url(&url).await.unwrap();
    let scope = format!("cli_many_{}", unique());
    let key = Key::new(&scope, "only").unwrap();
    let token = Token::new();
    let claim = store.claim(&ClaimRequest::new(&key, &token, None, Duration::from_secs(600))).await.unwrap();
    assert_eq!(claim, Claim::Claimed);

    let scans_before = scans(&mut connection).await;
    let (mut listed, mut after, mut pages) = (Vec::new(), None::<String>, 0);
    loop {
        let mut args = vec!["--json", "list", "--scope", &scope, "--limit", "1"];
        if let Some(cursor) = &after {
            args.extend(["--after", cursor]);
        }
        let page = json(&url, &args);
        listed.extend(keys_of(&page));
        pages += 1;
        assert!(pages < 1000, "the listing does not end");
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(listed, ["only"]);
    // About 300 batches of 1,000 for the whole keyspace (SCAN may return a key twice, and other
    // tests scan their small databases meanwhile); batches of 10 took 30,000.
    let scanned = scans(&mut connection).await - scans_before;
    assert!(scanned < 3_000, "{scanned} SCAN calls to list 300,000 keys");

    for batch in 0..30 {
        let mut pipe = redis::pipe();
        for name in names(batch) {
            pipe.cmd("UNLINK").arg(name).ignore();
        }
        pipe.query_async::<()>(&mut connection).await.unwrap();
    }
    idempotent_runtime::Store::release(&store, &key, &token).await.unwrap();
}

#[test]
fn cli_usage_errors_exit_2_and_unreachable_stores_exit_3() {
    let bad = cli("nope://x", &["stats"]);
    assert_eq!(code(&bad), 2);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown store URL scheme"));
    let down = cli("redis://127.0.0.1:1", &["--json", "stats"]);
    assert_eq!(code(&down), 3);
    let error: Value = serde_json::from_slice(&down.stderr).unwrap();
    assert_eq!(error["exit"], 3);
    let missing = cli("sqlite:///nonexistent/dir/records.db", &["stats"]);
    assert_eq!(code(&missing), 3);
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no SQLite database"));
    let none =
        Command::new(env!("CARGO_BIN_EXE_idempotent")).arg("stats").env_remove("IDEMPOTENT_STORE").output().unwrap();
    assert_eq!(code(&none), 2);
}
