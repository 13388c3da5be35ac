//! Keys have a life: an `expires_at` past which a key answers `401` `key-expired` (not
//! "unknown") on every gateway within `catalog.refresh_ms`, also while Redis is stalled;
//! a roll issues a new key and keeps the old one working until a chosen time, with no
//! restart. Two gateway processes on one Redis, all on one clock the test moves.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::*;

fn rw() -> String {
    admin_token("ops", "admin:read admin:write")
}

struct Fleet {
    clock: FakeClock,
    redis: RedisServer,
    gws: [GatewayProcess; 2],
    http: reqwest::Client,
    _up: Upstream,
}

/// Two gateways on one Redis, `acme` declared with its test key, catalogs followed every
/// 200 ms, all reading `clock` (now, as it starts).
async fn fleet() -> Fleet {
    let clock = FakeClock::at(unix_now() as f64).unwrap();
    let redis = RedisServer::start_with_env(&clock.env()).unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}{}",
        redis_toml(&redis),
        admin_toml(),
        catalog_toml(("gold", 1000.0, 1000.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let [preload, file] = clock.env();
    let env = [preload, file, ("TOLLGATE__CATALOG__REFRESH_MS", "200")];
    let gws = [gateway_process(&toml, &env), gateway_process(&toml, &env)];
    Fleet {
        clock,
        redis,
        gws,
        http: reqwest::Client::new(),
        _up: up,
    }
}

impl Fleet {
    async fn admin(&self, method: Method, path: &str, body: Option<Value>) -> reqwest::Response {
        let mut req = self
            .http
            .request(method, format!("{}/admin/v1{path}", self.gws[0].address))
            .bearer_auth(rw());
        if let Some(body) = body {
            req = req.json(&body);
        }
        req.send().await.unwrap()
    }

    /// The status and problem type (if any) of a request with `key` through gateway `i`.
    async fn through(&self, i: usize, key: &str) -> (u16, String) {
        let r = self
            .http
            .get(format!("{}/orders", self.gws[i].address))
            .header("x-api-key", key)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let kind = match status {
            200 => String::new(),
            _ => r.json::<Value>().await.unwrap()["type"]
                .as_str()
                .unwrap_or("")
                .rsplit('/')
                .next()
                .unwrap()
                .to_string(),
        };
        (status, kind)
    }

    /// Waits until both gateways answer `key` with `want`.
    async fn until_both(&self, key: &str, want: (u16, &str), what: &str) -> Duration {
        let started = Instant::now();
        eventually(Duration::from_secs(5), what, || async {
            let mut ok = true;
            for i in 0..2 {
                let (s, k) = self.through(i, key).await;
                ok &= (s, k.as_str()) == want;
            }
            ok
        })
        .await;
        started.elapsed()
    }

    async fn key_id(&self) -> String {
        let r = self.admin(Method::GET, "/clients/acme", None).await;
        let c: Value = r.json().await.unwrap();
        c["keys"][0]["key_id"].as_str().unwrap().to_string()
    }
}

#[tokio::test]
async fn a_key_rolled_with_a_ten_minute_overlap_works_beside_the_new_one_then_stops() {
    // Arrange.
    let f = fleet().await;
    let (old_key, old_id) = (key("acme"), f.key_id().await);

    // Act: roll with a 10-minute overlap.
    let r = f
        .admin(
            Method::POST,
            &format!("/clients/acme/keys/{old_id}/roll"),
            Some(json!({"overlap_s": 600})),
        )
        .await;
    assert_eq!(r.status(), 201);
    let rolled: Value = r.json().await.unwrap();
    let new_key = rolled["key"].as_str().unwrap().to_string();
    assert_eq!(rolled["old"]["key_id"], old_id.as_str());

    // Assert: both keys work on both gateways during the overlap...
    f.until_both(&new_key, (200, ""), "the new key works").await;
    for i in 0..2 {
        assert_eq!(f.through(i, &old_key).await.0, 200);
    }
    let c: Value = f
        .admin(Method::GET, "/clients/acme", None)
        .await
        .json()
        .await
        .unwrap();
    let keys = c["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 2, "{c}");
    assert_eq!(keys[1]["rolled_from"], old_id.as_str());
    assert_eq!(keys[0]["expired"], false);

    // ...and after it, only the new one, with no restart; the old one says it expired.
    f.clock.set(unix_now() as f64 + 601.0).unwrap();
    f.until_both(&old_key, (401, "key-expired"), "the old key expired")
        .await;
    for i in 0..2 {
        assert_eq!(f.through(i, &new_key).await.0, 200);
    }
    let r = f
        .http
        .get(format!("{}/orders", f.gws[1].address))
        .header("x-api-key", &old_key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["www-authenticate"], "ApiKey error=\"expired\"");
    let body: Value = r.json().await.unwrap();
    assert!(
        body["detail"].as_str().unwrap().contains("expired at"),
        "{body}"
    );
    // One write, one audit entry for the roll.
    let audit: Value = f
        .admin(Method::GET, "/audit?limit=10", None)
        .await
        .json()
        .await
        .unwrap();
    let rolls = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "key.roll")
        .count();
    assert_eq!(rolls, 1, "{audit}");
}

#[tokio::test]
async fn a_key_expires_on_time_on_every_gateway_even_while_redis_is_stalled() {
    // Arrange: a second key for acme that expires in 30 s.
    let f = fleet().await;
    let at = jiff::Timestamp::from_second(unix_now() as i64 + 30).unwrap();
    let r = f
        .admin(
            Method::POST,
            "/clients/acme/keys",
            Some(json!({"expires_at": at.to_string()})),
        )
        .await;
    assert_eq!(r.status(), 201);
    let created: Value = r.json().await.unwrap();
    let expiring = created["key"].as_str().unwrap().to_string();
    f.until_both(&expiring, (200, ""), "the key works").await;

    // Act: Redis stops answering; the clock passes the key's end.
    f.redis.stall().unwrap();
    f.clock.set(unix_now() as f64 + 31.0).unwrap();

    // Assert: it answers "expired" on both gateways within a catalog tick (the tick waits
    // for the stalled store's control timeout, 1 s, at most).
    let took = f
        .until_both(&expiring, (401, "key-expired"), "the key expired")
        .await;
    assert!(took < Duration::from_millis(2500), "{took:?}");
    assert_eq!(f.through(0, &key("acme")).await.0, 200);
    f.redis.resume().unwrap();
}

#[tokio::test]
async fn rolls_and_expiries_that_cannot_be_are_refused_and_change_nothing() {
    let f = fleet().await;
    let old_id = f.key_id().await;
    let roll = |body: Value, id: String| {
        let f = &f;
        async move {
            f.admin(
                Method::POST,
                &format!("/clients/acme/keys/{id}/roll"),
                Some(body),
            )
            .await
        }
    };
    let past = "2001-01-01T00:00:00Z";

    let cases = [
        (roll(json!({}), old_id.clone()).await, 422, "overlap_s"),
        (
            roll(
                json!({"overlap_s": 5, "old_expires_at": "2099-01-01T00:00:00Z"}),
                old_id.clone(),
            )
            .await,
            422,
            "overlap_s",
        ),
        (
            roll(json!({"overlap_s": 31_536_001}), old_id.clone()).await,
            422,
            "overlap_s",
        ),
        (
            roll(json!({"old_expires_at": past}), old_id.clone()).await,
            422,
            "old_expires_at",
        ),
        (
            roll(json!({"overlap_s": 5, "expires_at": past}), old_id.clone()).await,
            422,
            "expires_at",
        ),
        (roll(json!({"overlap_s": 5}), "nokey".into()).await, 404, ""),
        (
            f.admin(
                Method::POST,
                "/clients/acme/keys",
                Some(json!({"expires_at": past})),
            )
            .await,
            422,
            "expires_at",
        ),
    ];
    for (r, status, field) in cases {
        assert_eq!(r.status().as_u16(), status);
        if !field.is_empty() {
            assert_eq!(problem_fields(r).await, [field]);
        }
    }
    // Nothing changed: one key, never expiring.
    let c: Value = f
        .admin(Method::GET, "/clients/acme", None)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(c["keys"].as_array().unwrap().len(), 1, "{c}");
    assert!(c["keys"][0].get("expires_at").is_none(), "{c}");

    // A roll with no overlap stops the old key at once; rolling it again is a conflict.
    let r = roll(json!({"overlap_s": 0}), old_id.clone()).await;
    assert_eq!(r.status(), 201);
    f.until_both(&key("acme"), (401, "key-expired"), "the old key stopped")
        .await;
    let again = roll(json!({"overlap_s": 0}), old_id.clone()).await;
    assert_eq!(again.status(), 409);
}
