#![cfg(feature = "redis-cluster")]
//! The Redis store on a real Redis Cluster (3 masters, 3 replicas, started by the fixture in
//! `idempotent_tests::cluster`): the conformance suite, the stress harness with keys spread over
//! every master, the record format through the cluster connection, and failover: a master killed
//! with SIGKILL in the middle of a stress run, with and without `WAIT` for a replica.

use idempotent_tests::StoreSteps;
use std::sync::Arc;
use std::time::Duration;

use idempotent_runtime::stores::redis::RedisClusterStore;
use idempotent_runtime::stores::redis::redis::{self, AsyncCommands};
use idempotent_runtime::{Claim, ClaimRequest, Key, Record, Store, Token};
use idempotent_tests::cluster::{Cluster, NODE_TIMEOUT_MS};
use idempotent_tests::stress::{self, StressConfig, StressReport};

fn prefix() -> String {
    format!("idempotent-cluster:{}:", idempotent_tests::fresh::suffix())
}

/// The store as `connect_cluster` builds it (2 s response timeout, 4 retries): for the failover test.
async fn store_on(cluster: &Cluster, prefix: &str) -> RedisClusterStore {
    RedisClusterStore::connect_cluster(&cluster.urls())
        .await
        .expect("connect to the test cluster")
        .with_prefix(prefix)
        .expect("valid prefix")
}

/// The same store over a client with patient timeouts (10 s per reply), for the tests that must see
/// no store error at all while a shared 2-core machine runs the whole suite.
async fn patient_store_on(cluster: &Cluster, prefix: &str) -> RedisClusterStore {
    let client = redis::cluster::ClusterClientBuilder::new(cluster.urls())
        .response_timeout(Duration::from_secs(10))
        .overall_response_timeout(Some(Duration::from_secs(30)))
        .build()
        .expect("a cluster client");
    let connection = client.get_async_connection().await.expect("connect to the test cluster");
    RedisClusterStore::new(connection).with_prefix(prefix).expect("valid prefix")
}

idempotent_tests::conformance_suite!(
    conformance_redis_cluster,
    async {
        let cluster = idempotent_tests::cluster::Cluster::shared("conformance_redis_cluster")?;
        Some(super::patient_store_on(cluster, &super::prefix()).await)
    },
    self_expiring
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_stress_spreads_keys_over_every_master() {
    let Some(cluster) = Cluster::shared("redis_cluster_stress_spreads_keys_over_every_master") else { return };
    let prefix = prefix();
    let store = patient_store_on(cluster, &prefix).await;
    let report = stress::run("redis-cluster", store, StressConfig::from_env(400)).await;
    println!("{report}");
    report.assert_clean();
    let spread = cluster.keys_per_master(&prefix);
    println!("records per master: {spread:?}");
    assert_eq!(spread.len(), 3, "three masters serve the slots: {spread:?}");
    assert!(spread.values().all(|&n| n > 0), "every master must hold some of the records: {spread:?}");
    cluster.delete_prefix(&prefix);
}

/// The record format through the cluster connection, and the scripts sent again after the
/// servers forgot them (`SCRIPT FLUSH` on every node of this test cluster).
#[tokio::test]
async fn redis_cluster_records_are_readable_and_scripts_are_reloaded() {
    let Some(cluster) = Cluster::shared("redis_cluster_records_are_readable_and_scripts_are_reloaded") else {
        return;
    };
    let prefix = prefix();
    let store = patient_store_on(cluster, &prefix).await;
    let mut raw = store.connection();
    let lease = Duration::from_secs(60);
    for i in 0..20 {
        let key = Key::new("format", &i).unwrap();
        let token = Token::new();
        let request = ClaimRequest::new(&key, &token, None, lease);
        assert_eq!(store.claim(&request).await.unwrap(), Claim::Claimed);
        if i % 5 == 0 {
            let () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut raw).await.unwrap();
        }
        store.complete_as(&key, &token, format!("{{\"Ok\":{i}}}").as_bytes(), lease).await.unwrap();
        let value: String = raw.get(store.redis_key(&key)).await.unwrap();
        assert_eq!(value, format!("idempotent/1 done {} -\n{{\"Ok\":{i}}}", token.as_str()));
        let replay = store.claim(&ClaimRequest::new(&key, &Token::new(), None, lease)).await;
        assert_eq!(replay.unwrap(), Claim::Completed(Record::new(None, format!("{{\"Ok\":{i}}}").into_bytes())));
    }
    cluster.delete_prefix(&prefix);
}

/// A stress run on a private cluster during which one master is killed (SIGKILL) and its replica
/// promoted; returns the report.
async fn stress_through_a_failover(cluster: &Arc<Cluster>, store: RedisClusterStore, name: &str) -> StressReport {
    let mut config = StressConfig::from_env(400);
    config.keys = 400;
    config.callers = 8;
    config.keys_in_flight = 16;
    config.key_interval = Duration::from_millis(10);
    config.lease = Duration::from_secs(3);
    config.settle = Duration::from_secs(15);
    config.call_timeout = Some(Duration::from_secs(10));
    let victim = cluster.masters()[0];
    // Kill the master, wait until its replica took over, then start the killed node again (it
    // rejoins as the new master's replica, so that `WAIT 1` can be met again on its slots).
    let fault = {
        let cluster = Arc::clone(cluster);
        async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            tokio::task::spawn_blocking(move || {
                let started = std::time::Instant::now();
                cluster.kill(victim);
                cluster.wait_promoted(victim, Duration::from_secs(30));
                let promoted = started.elapsed();
                cluster.restart(victim);
                cluster.wait_healthy(Duration::from_secs(30));
                println!(
                    "  master on port {victim} killed; replica promoted after {} ms; the node is back as a replica after {} ms",
                    promoted.as_millis(),
                    started.elapsed().as_millis()
                );
            })
            .await
            .expect("kill a master");
            1
        }
    };
    let (report, masters_killed) = stress::run_with_faults(name, store, config, fault).await;
    println!("{report}\n  ({masters_killed} master killed, node timeout {NODE_TIMEOUT_MS} ms)");
    report
}

/// Kills a master mid-run, twice: without `WAIT` (asynchronous replication, the default) and with
/// `WAIT 1` per completion. No key stays stuck; every double execution is explained by a caller
/// told `Error::LeaseLost` (its claim was lost in the failover), by a completion that failed (its
/// result was never acknowledged; in the foreground, or in the background after its caller was
/// dropped while recording), or by a run after an acknowledged record; and with `WAIT 1` the
/// last never happens: no acknowledged record is lost. (Callers that replay the later run of such a key are
/// counted by the harness as "wrong results": it takes the first commit as the recorded one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_failover_mid_stress_run() {
    // Alone it takes about 30 s; a hang (a step waiting with no deadline) fails here, saying so.
    tokio::time::timeout(Duration::from_secs(300), failover_mid_stress_run())
        .await
        .expect("the failover test did not finish within 300 s: a call or the harness waited with no deadline");
}

async fn failover_mid_stress_run() {
    let Some(cluster) = Cluster::start("redis_cluster_failover_mid_stress_run") else { return };
    let cluster = Arc::new(cluster);
    for (mode, acks) in [("async replication", 0), ("WAIT 1", 1)] {
        let prefix = prefix();
        let store = store_on(&cluster, &prefix).await.with_replica_acks(acks, Duration::from_millis(500));
        let report = stress_through_a_failover(&cluster, store, &format!("redis-cluster failover, {mode}")).await;
        assert_eq!(report.stuck_keys, 0, "{mode}: no key stays stuck:\n{report}");
        let background = report.failed_detached_completions.expect("the harness counts failed background completions");
        assert!(
            report.double_executions
                <= report.lease_lost + report.runs_after_acknowledged + report.failed_completions + background,
            "{mode}: a double execution that no caller was told about (LeaseLost), not after a completion that \
             failed, and not after an acknowledged record:\n{report}"
        );
        assert!(
            report.wrong_results == 0 || report.double_executions > 0,
            "{mode}: wrong results only on keys that ran twice:\n{report}"
        );
        assert!(
            report.store_failures + report.timed_out > 0,
            "{mode}: the failover must be seen by some calls:\n{report}"
        );
        if acks > 0 {
            assert_eq!(report.lost_records, 0, "{mode}: no acknowledged record may be lost:\n{report}");
            assert_eq!(
                report.runs_after_acknowledged, 0,
                "{mode}: no body may run after its record was acknowledged:\n{report}"
            );
        }
        println!(
            "FAILOVER {mode}: double executions {} ({} after an acknowledged record, {} callers told LeaseLost), lost acknowledged records {}, store errors seen by callers {}",
            report.double_executions,
            report.runs_after_acknowledged,
            report.lease_lost,
            report.lost_records,
            report.store_failures
        );
    }
}

/// `AnyStore::from_url("redis+cluster://host:port,host:port")` opens the cluster store, and a call
/// through it runs once and replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_any_store_opens_from_a_url() {
    let Some(cluster) = Cluster::shared("redis_cluster_any_store_opens_from_a_url") else { return };
    let nodes: Vec<String> =
        cluster.urls().iter().map(|url| url.trim_start_matches("redis://").trim_end_matches('/').to_owned()).collect();
    let url = format!("redis+cluster://{}", nodes.join(","));
    let store = idempotent_runtime::stores::any::AnyStore::from_url(&url).await.expect("the cluster URL opens");
    let runs = std::sync::atomic::AtomicU32::new(0);
    let key = format!("any-{}", prefix());
    for _ in 0..2 {
        let call = idempotent_runtime::Call::new("any-cluster", &key);
        let value = call
            .run(&store, async {
                Ok::<_, idempotent_runtime::Error>(runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1)
            })
            .await
            .unwrap();
        assert_eq!(value, 1, "the second call replays the first run");
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    let bad = idempotent_runtime::stores::any::AnyStore::from_url("redis+cluster://127.0.0.1:7100,,x").await;
    assert!(bad.unwrap_err().to_string().contains("seed nodes"));
}

/// The cluster store completes calls with one native `SET ... IFEQ ... GET` where its servers
/// have the option (`scripts/valkey` runs this group on Valkey 8.1): a user refused `EVAL` and
/// `EVALSHA` by an ACL on every node completes calls on keys spread over every master, and the
/// same user with the native completion turned off is refused. On servers without the option
/// the completion falls back to the script (the conformance suite covers it) and this test only
/// says so, unless `IDEMPOTENT_EXPECT_SET_IFEQ=1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_completions_are_one_native_set_where_the_servers_have_ifeq() {
    use idempotent_runtime::StoreError;
    use idempotent_tests::services::redis_query;

    let test = "redis_cluster_completions_are_one_native_set_where_the_servers_have_ifeq";
    let Some(cluster) = Cluster::shared(test) else { return };
    // `SET ... IFEQ` on a missing key writes nothing; an older server refuses the option.
    let mut connection = patient_store_on(cluster, &prefix()).await.connection();
    let probe: redis::RedisResult<Option<String>> = redis::cmd("SET")
        .arg(format!("{}ifeq-probe", prefix()))
        .arg("x")
        .arg("IFEQ")
        .arg("y")
        .query_async(&mut connection)
        .await;
    if probe.as_ref().is_err_and(|e| e.to_string().contains("syntax error")) {
        assert!(
            std::env::var("IDEMPOTENT_EXPECT_SET_IFEQ").as_deref() != Ok("1"),
            "IDEMPOTENT_EXPECT_SET_IFEQ=1, but the cluster's servers refuse SET ... IFEQ"
        );
        eprintln!("{test}: these servers have no SET ... IFEQ; the completions use the script");
        return;
    }

    let user = format!("idempotent-test-noscript-{}", idempotent_tests::fresh::suffix());
    for &port in cluster.ports() {
        let acl = idempotent_tests::services::acl_user_without_scripts(&user);
        redis_query::<()>(port, &acl).expect("create the ACL user on every node");
    }
    let urls: Vec<String> = cluster.ports().iter().map(|p| format!("redis://{user}:any@127.0.0.1:{p}")).collect();
    let prefix = prefix();
    let store =
        RedisClusterStore::connect_cluster(&urls).await.expect("connect as the user").with_prefix(&prefix).unwrap();

    let keys: Vec<Key> = (0..30).map(|i| Key::new("native", &i).unwrap()).collect();
    let outcome = br#"{"Ok":1}"#;
    for key in &keys {
        let owner = Token::new();
        assert_eq!(
            store.claim(&ClaimRequest::new(key, &owner, None, Duration::from_secs(60))).await.unwrap(),
            Claim::Claimed
        );
        store
            .complete_as(key, &owner, outcome, Duration::from_secs(600))
            .await
            .expect("completed by SET ... IFEQ, no script");
        let replay = store.claim(&ClaimRequest::new(key, &Token::new(), None, Duration::from_secs(60))).await.unwrap();
        assert_eq!(replay, Claim::Completed(Record::new(None, outcome.to_vec())));
    }
    let spread = cluster.keys_per_master(&prefix);
    assert_eq!(spread.len(), 3, "the keys reached every master: {spread:?}");

    let scripted = store.clone().with_native_completion(false);
    let (key, owner) = (Key::new("native", &"scripted").unwrap(), Token::new());
    assert_eq!(
        scripted.claim(&ClaimRequest::new(&key, &owner, None, Duration::from_secs(60))).await.unwrap(),
        Claim::Claimed
    );
    let refused = scripted.complete_as(&key, &owner, outcome, Duration::from_secs(600)).await;
    let refused_script =
        matches!(&refused, Err(e @ StoreError::Rejected { .. }) if e.to_string().contains("'evalsha'"));
    assert!(refused_script, "{refused:?}");

    for &port in cluster.ports() {
        redis_query::<()>(port, redis::cmd("ACL").arg("DELUSER").arg(&user)).expect("delete the ACL user");
    }
    cluster.delete_prefix(&prefix);
}
