//! Public routes: a request without a key is limited per client address by the route's
//! plan (the address found as it is forwarded: the peer, or the nearest untrusted
//! `X-Forwarded-For` hop from a trusted proxy), in the same store as clients; a keyed
//! request on a public route still counts against its client's plan; an unknown key is
//! `401` there too.

use std::net::IpAddr;
use std::time::Duration;

use crate::helpers::*;

/// Plan `gold` (acme's, roomy) and plan `anonymous`: a burst of 5, refilled once a
/// thousand seconds.
fn catalog() -> String {
    format!(
        "{}[[catalog.plans]]\nname = \"anonymous\"\ncapacity = 5\nrate = 0.001\n",
        catalog_toml(("gold", 1000.0, 1000.0), &["acme"])
    )
}

/// `/orders` private, `/login` public on `plan`, both to `up`.
fn routes(up: &Upstream, plan: &str) -> String {
    format!(
        "{}{}public_plan = {plan:?}\n",
        route_toml("orders", "/orders", &[up.url()]),
        route_toml("login", "/login", &[up.url()]),
    )
}

async fn gateway(redis: Option<&RedisServer>, up: &Upstream, extra: &str) -> TestGateway {
    let store = redis.map(redis_toml).unwrap_or_default();
    TestGateway::spawn(settings(&format!(
        "{store}{extra}{}{}",
        catalog(),
        routes(up, "anonymous")
    )))
    .await
}

/// A client that connects from `from` (all of 127/8 is this host).
fn from(from: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(from.parse::<IpAddr>().unwrap())
        .build()
        .unwrap()
}

/// `n` requests to `path` without a key through `client`, with `xff` if given: the statuses.
async fn statuses(
    client: &reqwest::Client,
    gw: &TestGateway,
    path: &str,
    xff: Option<&str>,
    n: usize,
) -> Vec<u16> {
    let mut out = Vec::new();
    for _ in 0..n {
        let mut req = client.get(format!("{}{path}", gw.address));
        if let Some(xff) = xff {
            req = req.header("x-forwarded-for", xff);
        }
        out.push(req.send().await.unwrap().status().as_u16());
    }
    out
}

fn admitted(statuses: &[u16]) -> usize {
    statuses.iter().filter(|s| **s == 200).count()
}

#[tokio::test]
async fn requests_without_a_key_on_a_public_route_are_limited_per_address() {
    // Arrange.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(Some(&redis), &up, "").await;
    let (a, b) = (from("127.0.0.2"), from("127.0.0.3"));

    // Act: 8 from one address, claiming to be acme to the service, then one from another.
    let mut seen = Vec::new();
    for _ in 0..8 {
        let r = a
            .get(format!("{}/login", gw.address))
            .header("x-client-id", "acme")
            .send()
            .await
            .unwrap();
        seen.push((r.status().as_u16(), RateLimit::of(&r), retry_after(&r)));
    }
    let other = statuses(&b, &gw, "/login", None, 1).await;

    // Assert: its burst, then 429s that say when, under the plan's name; the other
    // address is untouched; the service never sees a client id.
    let codes: Vec<u16> = seen.iter().map(|s| s.0).collect();
    assert_eq!(codes, [200, 200, 200, 200, 200, 429, 429, 429]);
    assert!(seen.iter().all(|s| s.1.policy == "anonymous"), "{seen:?}");
    assert_eq!(seen[4].1.remaining, 0);
    assert!(seen[5].2.is_some_and(|s| s > 900), "{seen:?}");
    assert_eq!(other, [200]);
    assert_eq!(up.hits(), 6);
    assert!(up
        .seen()
        .iter()
        .all(|s| !s.headers.contains_key("x-client-id")));
    // The state is the address's, beside the clients' (it refills from 0 at 1/1000 s).
    let state = stored(&redis, "anonymous@127.0.0.2", "").expect("the address's state");
    assert!(state[0] < 0.1, "{state:?}");
    assert!(stored(&redis, "anonymous@127.0.0.3", "").is_some());
}

#[tokio::test]
async fn a_key_on_a_public_route_counts_against_its_client_and_must_be_known() {
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(Some(&redis), &up, "").await;

    // A known key: its client's plan, its client id passed on, no address state.
    let r = gw.get("/login", Some(&key("acme"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(RateLimit::of(&r).policy, "gold");
    assert_eq!(up.seen()[0].headers["x-client-id"], "acme");
    assert!(stored(&redis, "anonymous@127.0.0.1", "").is_none());
    assert!(stored(&redis, "acme", "").is_some());

    // An unknown key is refused, not taken for a request without one.
    let r = gw.get("/login", Some("key-nobody-0000")).await;
    assert_eq!(r.status(), 401);
    // Without a key, a private route and an unrouted path are both 401: which paths are
    // routed is not told.
    assert_eq!(gw.get("/orders", None).await.status(), 401);
    assert_eq!(gw.get("/nowhere", None).await.status(), 401);
    assert_eq!(gw.get("/nowhere", Some(&key("acme"))).await.status(), 404);
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn a_client_behind_no_trusted_proxy_cannot_spread_over_addresses_it_claims() {
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(Some(&redis), &up, "").await;
    let client = from("127.0.0.2");

    let mut codes = Vec::new();
    for i in 1..=20 {
        let xff = format!("{i}.1.1.1");
        codes.extend(statuses(&client, &gw, "/login", Some(&xff), 1).await);
    }

    assert_eq!(admitted(&codes), 5, "{codes:?}");
    assert!(stored(&redis, "anonymous@1.1.1.1", "").is_none());
}

#[tokio::test]
async fn behind_a_trusted_proxy_each_forwarded_client_is_its_own_address() {
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let trusted = "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n";
    let gw = gateway(Some(&redis), &up, trusted).await;
    let proxy = from("127.0.0.1");

    // Two clients behind the proxy: 5 each.
    let one = statuses(&proxy, &gw, "/login", Some("1.1.1.1"), 7).await;
    let two = statuses(&proxy, &gw, "/login", Some("9.9.9.9, 2.2.2.2"), 7).await;
    assert_eq!((admitted(&one), admitted(&two)), (5, 5));
    // A hop the proxy wrote that is no address: the proxy's own bucket, never the
    // address the client wrote left of it.
    let bogus = statuses(&proxy, &gw, "/login", Some("1.1.1.1, bogus"), 7).await;
    assert_eq!(admitted(&bogus), 5);
    assert!(stored(&redis, "anonymous@127.0.0.1", "").is_some());
    // IPv6 clients share their /64; a mapped IPv4 address is that IPv4 address.
    let v6a = statuses(&proxy, &gw, "/login", Some("2001:db8:0:1::1"), 3).await;
    let v6b = statuses(&proxy, &gw, "/login", Some("2001:db8:0:1::2"), 3).await;
    let v6c = statuses(&proxy, &gw, "/login", Some("2001:db8:0:2::1"), 3).await;
    assert_eq!((admitted(&v6a), admitted(&v6b), admitted(&v6c)), (3, 2, 3));
    assert!(stored(&redis, "anonymous@2001:db8:0:1::~64", "").is_some());
    let mapped = statuses(&proxy, &gw, "/login", Some("::ffff:1.1.1.1"), 1).await;
    assert_eq!(mapped, [429]);
}

#[tokio::test]
async fn addresses_are_grouped_by_the_configured_prefix() {
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n[edge]\nipv4_prefix = 24\n";
    let gw = gateway(Some(&redis), &up, toml).await;
    let proxy = from("127.0.0.1");

    let a = statuses(&proxy, &gw, "/login", Some("203.0.113.1"), 3).await;
    let b = statuses(&proxy, &gw, "/login", Some("203.0.113.200"), 3).await;
    let c = statuses(&proxy, &gw, "/login", Some("203.0.114.1"), 3).await;

    assert_eq!((admitted(&a), admitted(&b), admitted(&c)), (3, 2, 3));
    assert!(stored(&redis, "anonymous@203.0.113.0~24", "").is_some());
}

#[tokio::test]
async fn a_public_plan_of_several_limits_holds_each_in_one_decision() {
    // A quota of 3 an hour beside a bucket roomy enough never to matter.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}",
        redis_toml(&redis),
        limits_catalog_toml(
            "anonymous",
            r#"[{ name = "burst", capacity = 100, rate = 100 },
                { name = "hourly", quota = 3, period = "hour" }]"#,
            &[],
        ),
        routes(&up, "anonymous"),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    clear_of_the_hour().await;

    let mut last = None;
    let mut codes = Vec::new();
    for _ in 0..5 {
        let r = from("127.0.0.2")
            .get(format!("{}/login", gw.address))
            .send()
            .await
            .unwrap();
        codes.push(r.status().as_u16());
        last = Some(r);
    }

    assert_eq!(codes, [200, 200, 200, 429, 429]);
    let body: serde_json::Value = last.unwrap().json().await.unwrap();
    assert_eq!(body["limit"], "anonymous.hourly", "{body}");
}

/// Waits until the next hour is more than 10 s away, so an hourly window does not end
/// inside a test.
async fn clear_of_the_hour() {
    let into = unix_now() % 3600;
    if into > 3590 {
        tokio::time::sleep(Duration::from_secs(3601 - into)).await;
    }
}

#[tokio::test]
async fn a_public_route_whose_plan_is_not_in_the_catalog_forwards_nothing() {
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}",
        redis_toml(&redis),
        catalog(),
        routes(&up, "nowhere")
    );
    let gw = TestGateway::spawn(settings(&toml)).await;

    let r = gw.get("/login", None).await;

    assert_eq!(r.status(), 503);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(body["type"]
        .as_str()
        .unwrap()
        .ends_with("/public-plan-unavailable"));
    assert!(
        body["detail"].as_str().unwrap().contains("nowhere"),
        "{body}"
    );
    assert_eq!(gw.get("/login", Some(&key("acme"))).await.status(), 200);
    assert_eq!(up.hits(), 1);
    let missing = gw
        .sample("tollgate_decisions_total{outcome=\"public_plan_missing\"}")
        .await;
    assert_eq!(missing, 1.0);
}

#[tokio::test]
async fn public_routes_hold_on_the_embedded_store() {
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway(None, &up, "").await;

    let a = statuses(&from("127.0.0.2"), &gw, "/login", None, 7).await;
    let b = statuses(&from("127.0.0.3"), &gw, "/login", None, 7).await;

    assert_eq!((admitted(&a), admitted(&b)), (5, 5));
}

#[tokio::test]
async fn while_redis_is_stalled_an_address_is_held_to_the_safety_limit() {
    // Arrange: the safety limit is 10 x the plan's burst of 5; the store's budget short.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[redis]\nurl = \"{}\"\ntimeout_ms = 20\n{}{}",
        redis.url(),
        catalog(),
        routes(&up, "anonymous")
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    assert_eq!(
        statuses(&from("127.0.0.2"), &gw, "/login", None, 1).await,
        [200]
    );

    // Act.
    redis.stall().unwrap();
    let codes = statuses(&from("127.0.0.3"), &gw, "/login", None, 80).await;
    redis.resume().unwrap();

    // Assert: failed open up to the safety burst, then refused.
    assert_eq!(admitted(&codes), 50, "{codes:?}");
    assert_eq!(codes[79], 429);
}
