//! A gateway that starts while Redis is down still knows its clients: the last-known
//! catalog from its cache file, or else what its configuration declares, until Redis
//! answers; then the store's catalog, by the usual restore rules.

use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::*;

fn rw() -> String {
    admin_token("ops", "admin:read admin:write")
}

/// A gateway with the admin API on `redis`: plan `gold`, client `declared`, a route.
fn admin_gateway_toml(redis: &RedisServer, up: &Upstream) -> String {
    format!(
        "{}[redis]\nurl = \"{}\"\n{}{}",
        admin_toml(),
        redis.url(),
        catalog_toml(("gold", 1000.0, 1.0), &["declared"]),
        route_toml("orders", "/orders", &[up.url()]),
    )
}

/// A client that keeps no connections alive: gateway processes are restarted under it.
fn unpooled_client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

async fn get(http: &reqwest::Client, base: &str, key: &str) -> reqwest::Response {
    http.get(format!("{base}/orders"))
        .header("x-api-key", key)
        .send()
        .await
        .expect("the gateway answers")
}

async fn metrics(http: &reqwest::Client, base: &str) -> String {
    http.get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

async fn readyz(http: &reqwest::Client, base: &str) -> Value {
    readiness(http, base).await.1
}

/// `/readyz`: its status code and body.
async fn readiness(http: &reqwest::Client, base: &str) -> (u16, Value) {
    let r = http.get(format!("{base}/readyz")).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test]
async fn a_first_start_with_redis_down_serves_the_declared_clients_failing_open() {
    // Arrange: nothing listening on the configured Redis port, and nothing cached.
    let mut redis = RedisServer::start().unwrap();
    redis.kill();
    let up = Upstream::start(Behaviour::Echo).await;
    // A budget no loaded test machine overruns: the test is about the catalog and the
    // limits it serves, not about the 5 ms default.
    let toml = format!(
        "[redis]\nurl = \"{}\"\ntimeout_ms = 100\n{}{}",
        redis.url(),
        catalog_toml(("gold", 3.0, 0.001), &["acme", "burst"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = gateway_process(&toml, &[]);
    let http = unpooled_client();

    // Act + Assert: the declared client is known and fails open, with its policy but no
    // token count; an unknown key is refused; the gateway says what it serves.
    for _ in 0..5 {
        let r = get(&http, &gw.address, &key("acme")).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["ratelimit-policy"], "\"gold\";q=3;w=3000");
        assert!(!decided(&r), "no token count while failing open");
    }
    assert_eq!(
        get(&http, &gw.address, "key-nobody-000").await.status(),
        401
    );
    let text = metrics(&http, &gw.address).await;
    assert!(
        text.contains("tollgate_catalog_source{source=\"config\"} 1"),
        "{text}"
    );
    let (status, ready) = readiness(&http, &gw.address).await;
    assert_eq!(status, 503, "ready with no store: {ready}");
    assert_eq!(ready["status"], "unavailable", "{ready}");
    assert!(
        ready["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "no reason given: {ready}"
    );
    assert_eq!(ready["catalog"], "config");
    // Failing open is bounded by the safety limit: 10 x the plan of 3, then 429s from
    // the gateway itself.
    for n in 1..=30 {
        let r = get(&http, &gw.address, &key("burst")).await;
        assert_eq!(r.status(), 200, "request {n} within the safety limit");
    }
    let r = get(&http, &gw.address, &key("burst")).await;
    assert_eq!(r.status(), 429, "past the safety limit");
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(up.hits(), 5 + 30);

    // Act: Redis comes back.
    redis.restart().unwrap();

    // Assert: limiting resumes within 5 s, on the store's catalog.
    eventually(Duration::from_secs(5), "limiting resumes", || async {
        decided(&get(&http, &gw.address, &key("acme")).await)
    })
    .await;
    eventually(
        Duration::from_secs(3),
        "serving the store's catalog",
        || async {
            metrics(&http, &gw.address)
                .await
                .contains("tollgate_catalog_source{source=\"store\"} 1")
        },
    )
    .await;
    let mut denied = 0;
    for _ in 0..5 {
        if get(&http, &gw.address, &key("acme")).await.status() == 429 {
            denied += 1;
        }
    }
    assert!(
        denied >= 3,
        "the plan of 3 is enforced again ({denied} of 5 denied)"
    );
    eventually(Duration::from_secs(3), "ready", || async {
        readiness(&http, &gw.address).await == (200, json!({"status": "ready", "catalog": "store"}))
    })
    .await;
}

#[tokio::test]
async fn a_gateway_restarted_during_an_outage_still_knows_what_the_admin_api_changed() {
    // Arrange: a client created through the admin API with two keys, one revoked, all
    // before Redis goes down; the gateway has cached that catalog.
    let mut redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = admin_gateway_toml(&redis, &up);
    let mut gw = gateway_process(&toml, &[("TOLLGATE__CATALOG__REFRESH_MS", "100")]);
    let http = unpooled_client();
    let admin = |m: Method, path: &str| {
        http.request(m, format!("{}/admin/v1{path}", gw.address))
            .bearer_auth(rw())
    };
    let r = admin(Method::PUT, "/clients/fresh")
        .json(&json!({"plan": "gold"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let mut keys = Vec::new();
    for _ in 0..2 {
        let k: Value = admin(Method::POST, "/clients/fresh/keys")
            .json(&json!({}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        keys.push((
            k["key_id"].as_str().unwrap().to_string(),
            k["key"].as_str().unwrap().to_string(),
        ));
    }
    let (kept, revoked) = (keys[0].1.clone(), keys[1].1.clone());
    let r = admin(
        Method::DELETE,
        &format!("/clients/fresh/keys/{}", keys[1].0),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), 204);
    let version: u64 = redis::cmd("GET")
        .arg("tollgate:{catalog}:version")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    let cache = gw.catalog.with_file_name("catalog-cache.json");
    eventually(Duration::from_secs(3), "the catalog cached", || async {
        cached_version(&cache) == Some(version)
    })
    .await;
    let journal = cache.with_file_name("catalog-cache.json.log");
    let cached = std::fs::read_to_string(&cache).unwrap()
        + &std::fs::read_to_string(&journal).unwrap_or_default();
    assert!(
        !cached.contains(&kept) && !cached.contains(&revoked),
        "keys in plaintext"
    );
    use std::os::unix::fs::PermissionsExt;
    for file in [&cache, &journal] {
        if let Ok(meta) = std::fs::metadata(file) {
            assert_eq!(
                meta.permissions().mode() & 0o777,
                0o600,
                "{}",
                file.display()
            );
        }
    }

    // Act: Redis goes down, then the gateway restarts.
    redis.kill();
    gw.restart().unwrap();

    // Assert: the client the admin API created is known (failing open), the revoked key
    // is still refused, and the gateway says it serves its cache.
    let r = get(&http, &gw.address, &kept).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("ratelimit-policy"));
    assert!(!decided(&r));
    assert_eq!(get(&http, &gw.address, &revoked).await.status(), 401);
    let text = metrics(&http, &gw.address).await;
    assert!(
        text.contains("tollgate_catalog_source{source=\"cache\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("tollgate_catalog_cache_age_seconds"),
        "{text}"
    );
    assert_eq!(readyz(&http, &gw.address).await["catalog"], "cache");

    // Act: Redis comes back, empty.
    redis.restart().unwrap();

    // Assert: limiting resumes within 5 s, and the store gets the cached catalog back
    // (its version, the client, not the revoked key).
    eventually(Duration::from_secs(5), "limiting resumes", || async {
        decided(&get(&http, &gw.address, &kept).await)
    })
    .await;
    eventually(Duration::from_secs(3), "the store restored", || async {
        redis::cmd("GET")
            .arg("tollgate:{catalog}:version")
            .query::<Option<u64>>(&mut redis.conn().unwrap())
            .unwrap()
            == Some(version)
    })
    .await;
    let stored: Option<String> = redis::cmd("HGET")
        .arg("tollgate:{catalog}:clients")
        .arg("fresh")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    assert!(stored.is_some_and(|c| !c.contains(&keys[1].0)));
    assert_eq!(get(&http, &gw.address, &revoked).await.status(), 401);
}

#[tokio::test]
async fn a_cache_older_than_the_store_gives_way_to_the_store_when_it_answers() {
    // Arrange: gateway G caches the catalog, then stops; through gateway H a client is
    // created; Redis saves a snapshot and goes down.
    let mut redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = admin_gateway_toml(&redis, &up);
    let env = [("TOLLGATE__CATALOG__REFRESH_MS", "100")];
    let mut g = gateway_process(&toml, &env);
    let http = unpooled_client();
    eventually(Duration::from_secs(3), "G cached the catalog", || async {
        g.catalog.with_file_name("catalog-cache.json").exists()
    })
    .await;
    let _ = g.child.kill();
    let _ = g.child.wait();
    let h = gateway_process(&toml, &env);
    let r = http
        .put(format!("{}/admin/v1/clients/later", h.address))
        .bearer_auth(rw())
        .json(&json!({"plan": "gold"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let k: Value = http
        .post(format!("{}/admin/v1/clients/later/keys", h.address))
        .bearer_auth(rw())
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let later = k["key"].as_str().unwrap().to_string();
    let _: () = redis::cmd("SAVE")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    drop(h);
    redis.kill();

    // Act: G starts while Redis is down (its cache predates "later"), then Redis comes
    // back from its snapshot.
    g.restart().unwrap();
    assert_eq!(get(&http, &g.address, &later).await.status(), 401);
    assert_eq!(readyz(&http, &g.address).await["catalog"], "cache");
    redis.restart().unwrap();

    // Assert: G takes the store's newer catalog (and writes nothing of its own).
    eventually(
        Duration::from_secs(5),
        "G limits the later client",
        || async { decided(&get(&http, &g.address, &later).await) },
    )
    .await;
    assert_eq!(readyz(&http, &g.address).await["catalog"], "store");
    let restores: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg("tollgate:{catalog}:audit")
        .arg("-")
        .arg("+")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    assert!(
        restores
            .iter()
            .all(|(_, f)| !f.iter().any(|(_, v)| v == "catalog.restore")),
        "a cache older than the store was written over it"
    );
}

/// The catalog version the cache files hold: the journal's last line's, or else the
/// snapshot's.
fn cached_version(snapshot: &std::path::Path) -> Option<u64> {
    let journal = std::fs::read_to_string(snapshot.with_file_name("catalog-cache.json.log"))
        .unwrap_or_default();
    let last = journal
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
        .and_then(|l| l["version"].as_u64());
    last.or_else(|| {
        std::fs::read(snapshot)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .and_then(|c| c["catalog"]["version"].as_u64())
    })
}
