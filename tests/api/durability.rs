//! What the store keeps across a restart of Redis: the store says it (an append-only file,
//! snapshots, nothing, or that it would not say), and what it says holds: spent tokens
//! survive a restart with an append-only file and are forgotten without persistence.

use std::time::Duration;

use secrecy::SecretString;
use tollgate::domain::Limits;
use tollgate::store::{Keys, Persistence, Store};

use crate::helpers::*;

/// `--dir` is the server's own temporary directory, kept across restarts.
const AOF: &[&str] = &["--appendonly", "yes", "--appendfsync", "always"];
const NOTHING: &[&str] = &["--save", "", "--appendonly", "no"];
/// Managed Redis often renames or disables CONFIG.
const NO_CONFIG: &[&str] = &["--rename-command", "CONFIG", ""];

fn store_on(redis: &RedisServer) -> Store {
    Store::redis(
        &SecretString::from(redis.url()),
        2,
        Duration::from_secs(1),
        Keys::new("t:"),
    )
    .unwrap()
}

/// Spends `cost` (if any) from a plan of a bucket of 100 tokens (refilled at one per
/// 1000 s: nothing visible comes back during a test) and a calendar-month quota of a
/// million, then reads both back: (tokens left, quota left).
async fn spend_then_read(store: &Store, cost: Option<f64>) -> (f64, f64) {
    let limits: Limits = serde_json::from_str(
        r#"[{"name":"default","capacity":100,"rate":0.001},
            {"name":"monthly","quota":1000000,"period":"month"}]"#,
    )
    .unwrap();
    let applied = limits.applied(None);
    let key = "t:b:{acme}";
    if let Some(cost) = cost {
        let ruling = store.buckets.take(key, &applied, cost, None).await.unwrap();
        assert!(ruling.allowed, "{ruling:?}");
    }
    let now = store.buckets.peek(key, &applied).await.unwrap();
    let left = |i: usize| now.levels[i].remaining(&applied[i].kind);
    (left(0), left(1))
}

#[tokio::test]
async fn redis_says_whether_it_appends_every_write_snapshots_or_keeps_nothing() {
    // Arrange
    let aof = RedisServer::start_with(AOF).unwrap();
    let snapshots = RedisServer::start_with(&["--save", "3600 1 300 100"]).unwrap();
    let nothing = RedisServer::start_with(NOTHING).unwrap();

    // Act
    let aof = store_on(&aof).lifecycle.persistence().await.unwrap();
    let snapshots = store_on(&snapshots).lifecycle.persistence().await.unwrap();
    let nothing = store_on(&nothing).lifecycle.persistence().await.unwrap();

    // Assert
    assert_eq!(aof, Persistence::Aof);
    assert!(aof.keeps_quotas());
    assert_eq!(
        snapshots,
        Persistence::Snapshots {
            save: "3600 1 300 100".into()
        }
    );
    assert!(!snapshots.keeps_quotas());
    assert_eq!(nothing, Persistence::None);
    assert!(!nothing.keeps_quotas());
    assert!(
        nothing
            .describe()
            .contains("forgets every bucket and quota"),
        "{}",
        nothing.describe()
    );
}

#[tokio::test]
async fn a_redis_without_config_still_says_it_appends_and_otherwise_that_it_does_not_know() {
    // Arrange: CONFIG is disabled, as on many managed Redis services.
    let aof = RedisServer::start_with(&[AOF, NO_CONFIG].concat()).unwrap();
    let nothing = RedisServer::start_with(&[NOTHING, NO_CONFIG].concat()).unwrap();

    // Act
    let aof = store_on(&aof).lifecycle.persistence().await.unwrap();
    let nothing = store_on(&nothing).lifecycle.persistence().await.unwrap();

    // Assert: INFO tells the append-only file; the snapshot rules are not guessed.
    assert_eq!(aof, Persistence::Aof);
    let Persistence::Unknown(why) = &nothing else {
        panic!("{nothing:?}");
    };
    assert!(why.contains("CONFIG GET save"), "{why}");
    assert!(!nothing.keeps_quotas());
}

#[tokio::test]
async fn the_embedded_store_says_its_buckets_live_in_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::embedded(&dir.path().join("catalog.json")).unwrap();

    let p = store.lifecycle.persistence().await.unwrap();

    assert_eq!(p, Persistence::Embedded);
    assert!(!p.keeps_quotas());
}

#[tokio::test]
async fn spent_tokens_are_still_spent_after_redis_restarts_with_an_append_only_file() {
    // Arrange: 60 of 100 tokens spent.
    let mut redis = RedisServer::start_with(AOF).unwrap();
    let (left, quota) = spend_then_read(&store_on(&redis), Some(60.0)).await;
    assert!((40.0..41.0).contains(&left), "{left}");
    assert_eq!(quota, 999_940.0);

    // Act: Redis stops (SIGTERM) and starts again on its port and directory.
    redis.terminate().unwrap();
    redis.restart().unwrap();

    // Assert: a store connected afresh reads the spent tokens back.
    let (left, quota) = spend_then_read(&store_on(&redis), None).await;
    assert!((40.0..41.0).contains(&left), "after the restart: {left}");
    assert_eq!(quota, 999_940.0, "the month's count survived");
}

#[tokio::test]
async fn spent_tokens_are_forgotten_when_redis_restarts_without_persistence() {
    // Arrange: 60 of 100 tokens spent.
    let mut redis = RedisServer::start_with(NOTHING).unwrap();
    let (left, quota) = spend_then_read(&store_on(&redis), Some(60.0)).await;
    assert!((40.0..41.0).contains(&left), "{left}");
    assert_eq!(quota, 999_940.0);

    // Act
    redis.terminate().unwrap();
    redis.restart().unwrap();

    // Assert: the state is gone: the bucket is full again and the month starts over, a
    // free month.
    assert_eq!(
        spend_then_read(&store_on(&redis), None).await,
        (100.0, 1_000_000.0)
    );
}

#[tokio::test]
async fn a_cluster_keeps_what_its_weakest_master_keeps() {
    // Arrange: three masters, none persisting (the testkit's default).
    let cluster = RedisCluster::start().unwrap();
    let nodes: Vec<SecretString> = cluster.urls().into_iter().map(SecretString::from).collect();
    let store = Store::cluster(&nodes, Duration::from_secs(2), Keys::new("t:")).unwrap();
    let appendonly = |node: &RedisServer, on: &str| {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("appendonly")
            .arg(on)
            .query(&mut node.conn().unwrap())
            .unwrap();
    };

    // Act + Assert: nothing; then an append-only file on every master; then one master
    // turns it off.
    assert_eq!(
        store.lifecycle.persistence().await.unwrap(),
        Persistence::None
    );
    for node in &cluster.nodes {
        appendonly(node, "yes");
    }
    assert_eq!(
        store.lifecycle.persistence().await.unwrap(),
        Persistence::Aof
    );
    appendonly(&cluster.nodes[1], "no");
    assert_eq!(
        store.lifecycle.persistence().await.unwrap(),
        Persistence::None
    );
}

/// The gateway's log once it has said what its store keeps (`store persistence`).
async fn persistence_log(redis: &RedisServer, limits: &str) -> String {
    let toml = format!(
        "{}{}",
        redis_toml(redis),
        limits_catalog_toml("gold", limits, &["acme"])
    );
    let gw = gateway_process(&toml, &[("RUST_LOG", "info"), ("NO_COLOR", "1")]);
    let log_file = gw.dir().join("gateway.log");
    let mut log = String::new();
    eventually(Duration::from_secs(10), "the persistence log line", || {
        log = std::fs::read_to_string(&log_file).unwrap_or_default();
        let said = log.contains("store persistence");
        async move { said }
    })
    .await;
    log
}

const QUOTA: &str = r#"[{ name = "default", capacity = 10, rate = 1 },
    { name = "monthly", quota = 1000, period = "month" }]"#;
const WARNING: &str = "a plan has a quota, and the store does not say it keeps every write";

#[tokio::test]
async fn the_gateway_warns_at_start_when_a_plan_has_a_quota_and_redis_keeps_nothing() {
    let nothing = RedisServer::start_with(NOTHING).unwrap();
    let log = persistence_log(&nothing, QUOTA).await;
    assert!(log.contains(WARNING), "{log}");
}

#[tokio::test]
async fn the_gateway_does_not_warn_with_an_append_only_file_or_without_quotas() {
    let aof = RedisServer::start_with(AOF).unwrap();
    let log = persistence_log(&aof, QUOTA).await;
    assert!(!log.contains(WARNING), "{log}");

    let nothing = RedisServer::start_with(NOTHING).unwrap();
    let buckets_only = r#"[{ name = "default", capacity = 10, rate = 1 }]"#;
    let log = persistence_log(&nothing, buckets_only).await;
    assert!(!log.contains(WARNING), "{log}");
}
