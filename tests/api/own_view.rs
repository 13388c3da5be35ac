//! A client reads its own limits at `edge.limits_path` with its key: every limit, what is
//! left and when it is whole, its override and the override's end, with the `RateLimit`
//! headers a request gets; reading spends nothing, and reading too often is refused by a
//! per-client allowance of its own.

use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::*;

const VIEW: &str = "/_tollgate/limits";

async fn gateway(redis: Option<&RedisServer>, up: &Upstream, extra: &str) -> TestGateway {
    let store = redis.map(redis_toml).unwrap_or_default();
    TestGateway::spawn(settings(&format!(
        "{store}{extra}{}{}{}",
        admin_toml(),
        catalog_toml(("gold", 10.0, 0.001), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    )))
    .await
}

#[tokio::test]
async fn a_clients_view_matches_its_ratelimit_headers_and_spends_nothing() {
    // Arrange: one request spent.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(Some(&redis), &up, "").await;
    let k = key("acme");
    let spent = gw.get("/orders", Some(&k)).await;
    assert_eq!(RateLimit::of(&spent).remaining, 9);

    // Act: five views.
    let mut views = Vec::new();
    for _ in 0..5 {
        views.push(gw.get(VIEW, Some(&k)).await);
    }

    // Assert: each says what the request's headers said, and nothing was spent.
    for v in views {
        assert_eq!(v.status(), 200);
        assert_eq!(v.headers()["cache-control"], "no-store");
        let rl = RateLimit::of(&v);
        assert_eq!((rl.policy.as_str(), rl.remaining), ("gold", 9));
        let body: Value = v.json().await.unwrap();
        assert_eq!(body["client"], "acme");
        assert_eq!(body["plan"], "gold");
        let limit = &body["limits"][0];
        assert_eq!(limit["policy"], "gold");
        assert_eq!(limit["capacity"], 10.0);
        assert_eq!(limit["remaining"].as_f64().unwrap().floor(), 9.0, "{body}");
        assert_eq!(limit["overridden"], false);
    }
    let next = gw.get("/orders", Some(&k)).await;
    assert_eq!(RateLimit::of(&next).remaining, 8);
    assert_eq!(up.hits(), 2);

    // Reading too often is refused by the view's own allowance, not the plan.
    let sixth = gw.get(VIEW, Some(&k)).await;
    assert_eq!(sixth.status(), 429);
    assert!(retry_after(&sixth).is_some());
    let body: Value = sixth.json().await.unwrap();
    assert_eq!(body["limit"], "view");
    assert_eq!(
        RateLimit::of(&gw.get("/orders", Some(&k)).await).remaining,
        7
    );
}

#[tokio::test]
async fn the_view_needs_a_known_key_and_answers_get_and_head_only() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(None, &up, "").await;
    let k = key("acme");

    assert_eq!(gw.get(VIEW, None).await.status(), 401);
    assert_eq!(gw.get(VIEW, Some("key-nobody-0000")).await.status(), 401);
    let head = gw
        .http
        .head(format!("{}{VIEW}", gw.address))
        .header("x-api-key", &k)
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 200);
    assert!(head.headers().contains_key("ratelimit"));
    let post = gw
        .http
        .post(format!("{}{VIEW}", gw.address))
        .header("x-api-key", &k)
        .send()
        .await
        .unwrap();
    assert_eq!(post.status(), 405);
    assert_eq!(post.headers()["allow"], "GET, HEAD");
    assert_eq!(up.hits(), 0);
}

#[tokio::test]
async fn an_override_and_its_end_are_in_the_view() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(None, &up, "").await;
    let token = admin_token("ops", "admin:read admin:write");
    let r = gw
        .admin(Method::PUT, "/clients/acme/overrides/default", &token)
        .json(&json!({"capacity": 400, "until": "2030-01-01T00:00:00Z"}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());

    eventually(
        std::time::Duration::from_secs(5),
        "the override in force",
        || async {
            let body: Value = gw.get(VIEW, Some(&key("acme"))).await.json().await.unwrap();
            body["limits"][0]["capacity"] == 400.0
                && body["limits"][0]["overridden"] == true
                && body["limits"][0]["overridden_until"] == "2030-01-01T00:00:00Z"
        },
    )
    .await;
}

#[tokio::test]
async fn with_no_limits_path_the_path_is_the_proxys() {
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}",
        catalog_toml(("gold", 10.0, 0.001), &["acme"]),
        route_toml("all", "/", &[up.url()]),
    );
    let off = TestGateway::spawn(settings(&format!("[edge]\nlimits_path = \"\"\n{toml}"))).await;
    let on = TestGateway::spawn(settings(&toml)).await;

    assert_eq!(off.get(VIEW, Some(&key("acme"))).await.status(), 200);
    assert_eq!(up.hits(), 1, "forwarded");
    assert_eq!(on.get(VIEW, Some(&key("acme"))).await.status(), 200);
    assert_eq!(up.hits(), 1, "answered by the gateway");
}
