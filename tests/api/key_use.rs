//! Each key shows when it was last used: marked in memory on the request path (no store
//! call), written in batches every `periods.key_use_flush_ms`, read by the admin API; a
//! revoked key's use is forgotten.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::Value;

use crate::helpers::*;

fn rw() -> String {
    admin_token("ops", "admin:read admin:write")
}

async fn gateway(redis: Option<&RedisServer>, up: &Upstream) -> TestGateway {
    let store = redis.map(redis_toml).unwrap_or_default();
    TestGateway::spawn(settings(&format!(
        "{store}[periods]\nkey_use_flush_ms = 200\n{}{}{}",
        admin_toml(),
        catalog_toml(("gold", 100_000.0, 100_000.0), &["acme", "idle"]),
        route_toml("orders", "/orders", &[up.url()]),
    )))
    .await
}

async fn keys_of(gw: &TestGateway, client: &str) -> Vec<Value> {
    let r = gw
        .admin(Method::GET, &format!("/clients/{client}"), &rw())
        .send()
        .await
        .unwrap();
    let c: Value = r.json().await.unwrap();
    c["keys"].as_array().unwrap().clone()
}

fn zadd_calls(redis: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    info.lines()
        .find(|l| l.starts_with("cmdstat_zadd:"))
        .and_then(|l| l.split("calls=").nth(1))
        .and_then(|s| s.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_used_key_shows_when_and_the_store_hears_of_it_once_a_period() {
    // Arrange.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(Some(&redis), &up).await;
    let before = unix_now();

    // Act: 500 requests over about a second.
    let started = Instant::now();
    for _ in 0..500 {
        assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 200);
    }
    let took = started.elapsed();

    // Assert: its key has a last use, the other client's none.
    eventually(
        Duration::from_secs(3),
        "acme's last use recorded",
        || async { keys_of(&gw, "acme").await[0]["last_used_at"].is_string() },
    )
    .await;
    let last = keys_of(&gw, "acme").await[0]["last_used_at"]
        .as_str()
        .map(str::to_string);
    let at: jiff::Timestamp = last.unwrap().parse().unwrap();
    assert!(
        (before..=unix_now() + 1).contains(&(at.as_second() as u64)),
        "{at}"
    );
    assert!(keys_of(&gw, "idle").await[0].get("last_used_at").is_none());
    // Not a write per request: one per period at most (plus the one in flight), over the
    // time until the writes are counted (a period's flush may come after the last request).
    let writes = zadd_calls(&redis);
    let counted = started.elapsed();
    let periods = counted.as_millis() as u64 / 200 + 2;
    assert!(
        (1..=periods).contains(&writes),
        "{writes} ZADDs for 500 requests in {took:?}, counted after {counted:?}"
    );
    let key_id = keys_of(&gw, "acme").await[0]["key_id"]
        .as_str()
        .unwrap()
        .to_string();
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg("tollgate:{keyuse}:last_used")
        .arg(format!("acme/{key_id}"))
        .query(&mut redis.conn().unwrap())
        .unwrap();
    // A later flush may have written a later use since it was read above.
    let score = score.expect("the key's use is in the store") as u64;
    assert!(
        (at.as_second() as u64..=unix_now()).contains(&score),
        "{score} vs {at}"
    );

    // A revoked key's last use is forgotten.
    let r = gw
        .admin(
            Method::DELETE,
            &format!("/clients/acme/keys/{key_id}"),
            &rw(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg("tollgate:{keyuse}:last_used")
        .arg(format!("acme/{key_id}"))
        .query(&mut redis.conn().unwrap())
        .unwrap();
    assert_eq!(score, None);
}

#[tokio::test]
async fn the_embedded_store_shows_the_last_use_too() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(None, &up).await;

    assert_eq!(gw.get("/orders", Some(&key("acme"))).await.status(), 200);

    eventually(
        Duration::from_secs(3),
        "acme's last use recorded",
        || async { keys_of(&gw, "acme").await[0]["last_used_at"].is_string() },
    )
    .await;
}
