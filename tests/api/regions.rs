//! Hot clients sharded by region: regional Redis servers serve the traffic, shares are
//! reconciled through the global store once a period, and the global limit holds. The
//! periods are shortened through `[periods]` so the tests wait on events, not on seconds.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::*;

/// The share period these tests run with (the default is 1 s).
const SHARE: Duration = Duration::from_millis(500);

fn periods_toml() -> String {
    format!("[periods]\nshare_ms = {}\n", SHARE.as_millis())
}

/// The version a write's `ETag` names.
fn version(r: &reqwest::Response) -> u64 {
    r.headers()["etag"]
        .to_str()
        .unwrap()
        .trim_matches('"')
        .parse()
        .unwrap()
}

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
            "{}{}[server]\nregion = \"{region}\"\n[redis]\nurl = \"{}\"\nregional_url = \"{}\"\ntimeout_ms = 2000\n[catalog]\nrefresh_ms = 200\n{}{}",
            admin_toml(),
            periods_toml(),
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
    let sharded_at = version(&r);
    for gw in &gateways {
        gw.wait_for_catalog(sharded_at).await;
    }
    // Every region has a share, and every gateway has read it (it reads twice a period).
    eventually(
        Duration::from_secs(5),
        "every region has a share",
        || async {
            let v = bucket(&gateways[0], "hot").await;
            regions.iter().all(|r| share(&v, r) > 0.0)
        },
    )
    .await;
    tokio::time::sleep(SHARE).await;
    global.reset_command_stats().unwrap();

    // Act 1: 3x the plan's rate for 8 s (16 share periods), demand split 70/20/10.
    let split = [0.7, 0.2, 0.1];
    let seconds = 8.0;
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
    // Each gateway reconciles twice a share period: that, and nothing per request.
    let global_calls = global
        .command_calls()
        .unwrap()
        .get("evalsha")
        .copied()
        .unwrap_or(0);
    let reconciles = 3.0 * elapsed / (SHARE.as_secs_f64() / 2.0);
    let sent: u32 = results.iter().map(|r| r.0).sum();
    assert!(
        (global_calls as f64) < reconciles * 1.2 + 5.0 && global_calls < sent as u64 / 2,
        "the global Redis ran {global_calls} scripts for {sent} requests (reconciliation only: about {reconciles:.0})"
    );

    // Act 2: demand moves to ap (10/20/70); the shares follow within a few periods.
    let shifted = [0.1, 0.2, 0.7];
    let watch = async {
        let t = Instant::now();
        loop {
            let v = bucket(&gateways[0], "hot").await;
            if share(&v, "ap") > 0.5 && share(&v, "eu") < 0.2 {
                return t.elapsed();
            }
            assert!(t.elapsed() < SHARE * 12, "shares did not follow: {v}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let load = futures_util::future::join_all(
        gateways
            .iter()
            .zip(shifted)
            .map(|(gw, f)| drive(gw, "hot", 90.0 * f, SHARE * 12)),
    );
    let (followed_in, _) = tokio::join!(watch, load);
    eprintln!("regions: shares followed the demand in {followed_in:?}");
    let history = &bucket(&gateways[1], "hot").await["shards"]["history"];
    assert!(history.as_array().unwrap().len() >= 10, "{history}");
}

#[tokio::test]
async fn sharding_and_unsharding_keep_the_clients_limit() {
    // Arrange: one gateway (region eu) on one Redis; the client has spent its bucket.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}[server]\nregion = \"eu\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 2000\n[catalog]\nrefresh_ms = 200\n{}{}",
        admin_toml(),
        periods_toml(),
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
    let r = put(json!({"plan": "ten", "shards": {"regions": ["eu", "us"]}}))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    gw.wait_for_catalog(version(&r)).await;
    // Reconciled (eu has its share) and read by the gateway (twice a period).
    eventually(Duration::from_secs(5), "eu has its share", || async {
        share(&bucket(&gw, "hot").await, "eu") > 0.0
    })
    .await;
    tokio::time::sleep(SHARE).await;
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
    let r = put(json!({"plan": "ten"})).await.unwrap();
    assert_eq!(r.status(), 200);
    gw.wait_for_catalog(version(&r)).await;
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
    // A 500 ms window instead of 10 s: the test waits for a window with the traffic in it.
    let toml = format!(
        "{}[periods]\nhot_window_ms = 500\n{}{}",
        admin_toml(),
        catalog_toml(("big", 1e6, 1e6), &["whale", "minnow"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    // Traffic (9 in 10 requests from the whale) until a finished window shows it: first in
    // the hot list with most of the traffic, and the busiest share in the metrics.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        for i in 0..40 {
            let c = if i % 10 == 0 { "minnow" } else { "whale" };
            gw.get("/orders", Some(&key(c))).await;
        }
        let hot: Value = gw
            .admin(Method::GET, "/hot", &token())
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let busiest = gw.metric("tollgate_busiest_client_share").await;
        let top_share = hot["items"][0]["share"].as_f64();
        if hot["items"][0]["id"] == "whale"
            && top_share.is_some_and(|s| s > 0.7)
            && busiest.is_some_and(|s| s > 0.7)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no window showed the whale: {hot} busiest {busiest:?}"
        );
    }
    let metrics = gw.get("/metrics", None).await.text().await.unwrap();
    assert!(!metrics.contains("whale"));
}
