//! Hot clients sharded by region: regional Redis servers serve the traffic, shares are
//! reconciled through the global store once a second, and the global limit holds.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::*;

fn token() -> String {
    admin_token("ops", "admin:read admin:write")
}

async fn bucket(gw: &TestGateway, client: &str) -> Value {
    gw.admin(Method::GET, &format!("/clients/{client}/bucket"), &token())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn share(view: &Value, region: &str) -> f64 {
    view["shards"]["current"]["regions"]
        .as_array()
        .and_then(|rs| rs.iter().find(|r| r["region"] == region))
        .and_then(|r| r["share"].as_f64())
        .unwrap_or(0.0)
}

/// Sends `rate` requests per second for `duration` through `gw`; returns (sent, admitted).
async fn drive(gw: &TestGateway, client: &str, rate: f64, duration: Duration) -> (u32, u32) {
    let k = key(client);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let end = Instant::now() + duration;
    let (mut sent, mut admitted) = (0, 0);
    while Instant::now() < end {
        tick.tick().await;
        sent += 1;
        if gw.get("/orders", Some(&k)).await.status() == 200 {
            admitted += 1;
        }
    }
    (sent, admitted)
}

#[tokio::test]
async fn three_regions_share_one_limit_and_shares_follow_demand() {
    // Arrange: one global Redis, one Redis per region, a gateway per region.
    let global = RedisServer::start().unwrap();
    let regional: Vec<RedisServer> = (0..3).map(|_| RedisServer::start().unwrap()).collect();
    let up = Upstream::start(Behaviour::Echo).await;
    let regions = ["eu", "us", "ap"];
    let mut gateways = Vec::new();
    for (i, region) in regions.iter().enumerate() {
        let toml = format!(
            "{}[server]\nregion = \"{region}\"\n[redis]\nurl = \"{}\"\nregional_url = \"{}\"\ntimeout_ms = 2000\n[catalog]\nrefresh_ms = 200\n{}{}",
            admin_toml(),
            global.url(),
            regional[i].url(),
            catalog_toml(("hot", 30.0, 30.0), &["hot"]),
            route_toml("orders", "/orders", &[up.url()]),
        );
        gateways.push(TestGateway::spawn(settings(&toml)).await);
    }
    let r = gateways[0]
        .admin(Method::PUT, "/clients/hot", &token())
        .json(&json!({"plan": "hot", "shards": {"regions": regions}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(5);
    while bucket(&gateways[0], "hot").await["shards"]["current"].is_null() {
        assert!(Instant::now() < deadline, "sharding never reconciled");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Every region's gateway has read its first share.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    global.reset_command_stats().unwrap();

    // Act 1: 3x the plan's rate for 14 s, demand split 70/20/10.
    let split = [0.7, 0.2, 0.1];
    let seconds = 14.0;
    let started = Instant::now();
    let results = futures_util::future::join_all(
        gateways
            .iter()
            .zip(split)
            .map(|(gw, f)| drive(gw, "hot", 90.0 * f, Duration::from_secs_f64(seconds))),
    )
    .await;
    let elapsed = started.elapsed().as_secs_f64();

    // Assert: the total is within 5% of capacity + rate x T...
    let admitted: u32 = results.iter().map(|r| r.1).sum();
    let expected = 30.0 + 30.0 * elapsed;
    let error = (admitted as f64 - expected) / expected;
    eprintln!("regions: (sent, admitted) {results:?}; total {admitted}, expected {expected:.0}, error {:+.2}%", error * 100.0);
    assert!(
        error.abs() < 0.05,
        "admitted {admitted}, expected {expected:.0} ({:+.1}%): {results:?}",
        error * 100.0
    );
    // ...every region got at least half its demand-proportional share...
    for (i, f) in split.iter().enumerate() {
        assert!(
            results[i].1 as f64 >= 0.5 * f * admitted as f64,
            "{} admitted {} of {admitted}: {results:?}",
            regions[i],
            results[i].1
        );
    }
    // ...and the hot traffic ran on the regional Redis servers, not the global one.
    for (i, region) in regions.iter().enumerate() {
        let calls = regional[i]
            .command_calls()
            .unwrap()
            .get("evalsha")
            .copied()
            .unwrap_or(0);
        assert!(
            calls as u32 >= results[i].0 * 9 / 10,
            "{region}: {calls} script calls for {} requests",
            results[i].0
        );
        assert_eq!(
            regional[i]
                .keys(&format!("tollgate:b:{{hot:{region}}}"))
                .unwrap()
                .len(),
            1
        );
    }
    let global_calls = global
        .command_calls()
        .unwrap()
        .get("evalsha")
        .copied()
        .unwrap_or(0);
    assert!(
        global_calls < 100,
        "the global Redis ran {global_calls} scripts (reconciliation only)"
    );

    // Act 2: demand moves to ap (10/20/70); the shares follow within about 2 s.
    let shifted = [0.1, 0.2, 0.7];
    let watch = async {
        let t = Instant::now();
        loop {
            let v = bucket(&gateways[0], "hot").await;
            if share(&v, "ap") > 0.5 && share(&v, "eu") < 0.2 {
                return t.elapsed();
            }
            assert!(
                t.elapsed() < Duration::from_secs(4),
                "shares did not follow: {v}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let load = futures_util::future::join_all(
        gateways
            .iter()
            .zip(shifted)
            .map(|(gw, f)| drive(gw, "hot", 90.0 * f, Duration::from_secs(4))),
    );
    let (followed_in, _) = tokio::join!(watch, load);
    eprintln!("regions: shares followed the demand in {followed_in:?}");
    assert!(
        followed_in < Duration::from_millis(3000),
        "shares followed in {followed_in:?}"
    );
    let history = &bucket(&gateways[1], "hot").await["shards"]["history"];
    assert!(history.as_array().unwrap().len() >= 10, "{history}");
}

#[tokio::test]
async fn sharding_and_unsharding_keep_the_clients_limit() {
    // Arrange: one gateway (region eu) on one Redis; the client has spent its bucket.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}[server]\nregion = \"eu\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 2000\n[catalog]\nrefresh_ms = 200\n{}{}",
        admin_toml(),
        redis.url(),
        catalog_toml(("ten", 10.0, 0.001), &["hot"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let mut statuses: HashMap<&str, Vec<u16>> = HashMap::new();
    let k = key("hot");
    for _ in 0..12 {
        statuses
            .entry("before")
            .or_default()
            .push(gw.get("/orders", Some(&k)).await.status().as_u16());
    }

    // Act: shard it, spend, un-shard it, spend.
    let put = |body: Value| {
        gw.admin(Method::PUT, "/clients/hot", &token())
            .json(&body)
            .send()
    };
    assert_eq!(
        put(json!({"plan": "ten", "shards": {"regions": ["eu", "us"]}}))
            .await
            .unwrap()
            .status(),
        200
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for _ in 0..12 {
        statuses
            .entry("sharded")
            .or_default()
            .push(gw.get("/orders", Some(&k)).await.status().as_u16());
    }
    assert!(
        bucket(&gw, "hot").await["shards"]["current"]["seed"]
            .as_f64()
            .unwrap()
            < 0.05
    );
    assert_eq!(put(json!({"plan": "ten"})).await.unwrap().status(), 200);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for _ in 0..12 {
        statuses
            .entry("unsharded")
            .or_default()
            .push(gw.get("/orders", Some(&k)).await.status().as_u16());
    }

    // Assert: the 10-token burst was spent once; neither switch handed out a new one.
    let admitted = |phase: &str| statuses[phase].iter().filter(|s| **s == 200).count();
    assert_eq!(admitted("before"), 10, "{statuses:?}");
    assert!(admitted("sharded") <= 1, "{statuses:?}");
    assert!(admitted("unsharded") <= 1, "{statuses:?}");
    // The regional shard was really used while sharded.
    assert_eq!(redis.keys("tollgate:b:{hot:eu}").unwrap().len(), 1);
}

#[tokio::test]
async fn the_busiest_client_shows_in_the_hot_list_and_the_metrics() {
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}",
        admin_toml(),
        catalog_toml(("big", 1e6, 1e6), &["whale", "minnow"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    for i in 0..400 {
        let c = if i % 10 == 0 { "minnow" } else { "whale" };
        gw.get("/orders", Some(&key(c))).await;
    }
    // The window rotates every 10 s.
    tokio::time::sleep(Duration::from_millis(10_500)).await;
    let hot: Value = gw
        .admin(Method::GET, "/hot", &token())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(hot["items"][0]["id"], "whale", "{hot}");
    assert!(hot["items"][0]["share"].as_f64().unwrap() > 0.7, "{hot}");
    let metrics = gw.get("/metrics", None).await.text().await.unwrap();
    let share: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tollgate_busiest_client_share "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(share > 0.7, "{share}");
    assert!(!metrics.contains("whale"));
}
