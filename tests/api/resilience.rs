//! Surviving faults and rolling out: fail open, the breaker, safety limits, shadow mode.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use reqwest::Method;
use serde_json::{json, Value};
use tollgate::metrics::FailOpenReason;

use crate::helpers::*;

fn token() -> String {
    admin_token("ops", "admin:read admin:write")
}

/// Whether a response carries a real bucket decision (only then is `RateLimit` sent).
fn decided(r: &reqwest::Response) -> bool {
    r.headers().contains_key("ratelimit")
}

#[tokio::test]
async fn a_stalled_then_killed_redis_fails_open_and_limiting_resumes_by_itself() {
    // Arrange: the default 5 ms budget, a client with room to spare.
    let mut redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[redis]\nurl = \"{}\"\n{}{}",
        redis.url(),
        catalog_toml(("gold", 10_000.0, 1.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let k = key("acme");
    eventually(Duration::from_secs(5), "a first real decision", || async {
        decided(&gw.get("/orders", Some(&k)).await)
    })
    .await;
    let metrics = &gw.app.metrics;
    let timeouts_before = metrics.fail_open_count(FailOpenReason::Timeout);

    // Act 1: Redis stalls (SIGSTOP). Every request is still admitted.
    redis.stall().unwrap();
    let started = Instant::now();
    for _ in 0..30 {
        assert_eq!(gw.get("/orders", Some(&k)).await.status(), 200);
    }
    let stalled_for = started.elapsed();

    // Only the first few waited out the budget; then the breaker answered at once.
    let waited = metrics.fail_open_count(FailOpenReason::Timeout) - timeouts_before;
    let skipped = metrics.fail_open_count(FailOpenReason::BreakerOpen);
    assert!(waited <= 5, "{waited} requests waited for a stalled Redis");
    assert!(
        skipped >= 25,
        "only {skipped} requests skipped the stalled Redis"
    );
    assert!(gw.app.limiter.breakers().summary().0);
    assert!(
        stalled_for < Duration::from_secs(3),
        "30 requests took {stalled_for:?}"
    );
    assert_eq!(gw.get("/readyz", None).await.status(), 503);
    let text = gw.get("/metrics", None).await.text().await.unwrap();
    assert!(text.contains("tollgate_breaker_open 1"), "{text}");
    assert!(metrics.fail_open_total() >= 30);

    // Act 2: Redis resumes; limiting resumes by itself.
    redis.resume().unwrap();
    eventually(
        Duration::from_secs(5),
        "decisions after SIGCONT",
        || async { decided(&gw.get("/orders", Some(&k)).await) },
    )
    .await;
    assert!(!gw.app.limiter.breakers().summary().0);

    // Act 3: Redis dies, then comes back empty on the same port.
    redis.kill();
    for _ in 0..10 {
        assert_eq!(gw.get("/orders", Some(&k)).await.status(), 200);
    }
    assert_eq!(gw.get("/readyz", None).await.status(), 503);
    redis.restart().unwrap();
    eventually(
        Duration::from_secs(8),
        "decisions after a restart",
        || async { decided(&gw.get("/orders", Some(&k)).await) },
    )
    .await;
    // The empty Redis gets the catalog back from the gateway's copy at the next catalog
    // poll (1 s): the client is known again. (Decisions do not need the catalog in Redis,
    // so they can resume before that poll.)
    eventually(Duration::from_secs(3), "the catalog restored", || async {
        let stored: Option<String> = redis::cmd("HGET")
            .arg("tollgate:{catalog}:clients")
            .arg("acme")
            .query(&mut redis.conn().unwrap())
            .unwrap();
        stored.is_some()
    })
    .await;
    eventually(Duration::from_secs(3), "ready again", || async {
        gw.get("/readyz", None).await.status() == 200
    })
    .await;
}

#[tokio::test]
async fn replies_stay_with_their_requests_when_redis_stalls_under_load() {
    // Arrange: 12 clients whose capacities are far apart, so a reply delivered to the
    // wrong request would show another client's token count.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let clients: Vec<String> = (1..=12).map(|i| format!("c{i}")).collect();
    let mut toml = format!("[redis]\nurl = \"{}\"\n", redis.url());
    for (i, c) in clients.iter().enumerate() {
        toml.push_str(&format!(
            "[[catalog.plans]]\nname = \"p{c}\"\ncapacity = {}\nrate = 0.001\n[[catalog.clients]]\nid = \"{c}\"\nplan = \"p{c}\"\nkeys = [\"{}\"]\n",
            (i + 1) * 1000,
            key(c)
        ));
    }
    toml.push_str(&route_toml("orders", "/orders", &[up.url()]));
    let gw = TestGateway::spawn(settings(&toml)).await;

    // Act: concurrent load while Redis is frozen and thawed three times.
    let load = async {
        for round in 0..6 {
            let batch = clients.iter().cycle().skip(round).take(60).map(|c| {
                let k = key(c);
                let gw = &gw;
                async move { gw.get("/orders", Some(&k)).await.status().as_u16() }
            });
            for s in join_all(batch).await {
                assert_eq!(s, 200, "failing open must admit");
            }
        }
    };
    let chaos = async {
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(40)).await;
            redis.stall().unwrap();
            tokio::time::sleep(Duration::from_millis(60)).await;
            redis.resume().unwrap();
        }
    };
    tokio::join!(load, chaos);
    eventually(Duration::from_secs(5), "the breaker closes", || async {
        !gw.app.limiter.breakers().summary().0
    })
    .await;

    // Assert: after a refill, each client's decisions carry its own counts.
    let _: () = redis::cmd("FLUSHDB")
        .query(&mut redis.conn().unwrap())
        .unwrap_or(());
    let mut checked = 0;
    for (i, c) in clients.iter().enumerate() {
        let capacity = (i + 1) as i64 * 1000;
        for n in 1..=3 {
            let r = gw.get("/orders", Some(&key(c))).await;
            let Some(rl) = r.headers().get("ratelimit") else {
                continue; // failed open (a slow moment): no count to check
            };
            let remaining: i64 = rl
                .to_str()
                .unwrap()
                .split(';')
                .find_map(|p| p.strip_prefix("r="))
                .unwrap()
                .parse()
                .unwrap();
            assert!(
                (remaining - (capacity - n)).abs() <= 3,
                "client {c} (capacity {capacity}) saw remaining {remaining} on request {n}"
            );
            checked += 1;
        }
    }
    // Nearly every answer was a real decision, so the check above really ran.
    assert!(
        checked >= 30,
        "only {checked} of 36 answers carried a count"
    );
}

#[tokio::test]
async fn while_failing_open_the_safety_limit_still_refuses_a_client_far_past_its_plan() {
    let mut redis = RedisServer::start().unwrap();
    let orders = Upstream::start(Behaviour::Echo).await;
    let billing = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}[redis]\nurl = \"{}\"\n[catalog]\nrefresh_ms = 100\n{}{}{}",
        admin_toml(),
        redis.url(),
        catalog_toml(("tiny", 2.0, 0.001), &["acme"]),
        route_toml("orders", "/orders", &[orders.url()]),
        route_toml("billing", "/billing", &[billing.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    // The default is 10x the plan; orders gets its own 3x through the admin API.
    let r = gw
        .admin(Method::PUT, "/safety", &token())
        .json(&json!({"multiplier": 10, "services": {"orders": 3}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    eventually(
        Duration::from_secs(2),
        "the override reaches the mirror",
        || async { gw.app.catalog.safety_guard().is_some() },
    )
    .await;

    redis.kill();
    let mut statuses = std::collections::HashMap::new();
    for path in ["/orders", "/billing"] {
        for _ in 0..40 {
            let r = gw.get(path, Some(&key("acme"))).await;
            if r.status() == 429 {
                assert!(r.headers().contains_key("retry-after"));
            }
            *statuses.entry((path, r.status().as_u16())).or_insert(0) += 1;
        }
    }

    // 2 tokens x 3 on orders, 2 x 10 on billing; everything else refused by the gateway.
    assert_eq!(statuses.get(&("/orders", 200)), Some(&6), "{statuses:?}");
    assert_eq!(statuses.get(&("/orders", 429)), Some(&34), "{statuses:?}");
    assert_eq!(statuses.get(&("/billing", 200)), Some(&20), "{statuses:?}");
    assert_eq!(statuses.get(&("/billing", 429)), Some(&20), "{statuses:?}");
    assert_eq!((orders.hits(), billing.hits()), (6, 20));
}

#[tokio::test]
async fn shadow_mode_forwards_everything_and_reports_disagreement_over_all_gateways() {
    // Arrange: two gateways on one Redis; two shadow clients with the same plan; one
    // service limits exactly like the gateway, the other is twice as lenient.
    let redis = RedisServer::start().unwrap();
    let exact = Upstream::start(Behaviour::Limit(10)).await;
    let lenient = Upstream::start(Behaviour::Limit(20)).await;
    let toml = format!(
        "{}[redis]\nurl = \"{}\"\ntimeout_ms = 2000\n[limits]\ndefault_mode = \"shadow\"\n{}{}{}",
        admin_toml(),
        redis.url(),
        catalog_toml(("ten", 10.0, 0.001), &["same", "loose"]),
        route_toml("exact", "/exact", &[exact.url()]),
        route_toml("lenient", "/lenient", &[lenient.url()]),
    );
    let a = TestGateway::spawn(settings(&toml)).await;
    let b = TestGateway::spawn(settings(&toml)).await;

    // Act: 30 requests each, alternating gateways.
    for i in 0..30 {
        let gw = if i % 2 == 0 { &a } else { &b };
        gw.get("/exact", Some(&key("same"))).await;
        gw.get("/lenient", Some(&key("loose"))).await;
    }

    // Assert: every request reached its service, over the gateway's limit or not.
    assert_eq!((exact.hits(), lenient.hits()), (30, 30));
    let shadow = || async {
        a.admin(Method::GET, "/shadow", &token())
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()
    };
    eventually(
        Duration::from_secs(4),
        "both gateways' counts flushed",
        || async { shadow().await["compared"] == 60 },
    )
    .await;
    let report = shadow().await;
    // The lenient service admitted requests 11-20 that the gateway would refuse.
    assert_eq!(report["disagreements"], 10, "{report}");
    assert_eq!(report["ready_to_enforce"], false);
    let client = |id: &str| {
        report["clients"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == id)
            .cloned()
            .unwrap()
    };
    assert_eq!(client("same")["disagreements"], 0);
    assert_eq!(client("same")["rate"], 0.0);
    assert_eq!(client("loose")["disagreements"], 10);
    assert!((client("loose")["rate"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-9);

    let metrics = a.get("/metrics", None).await.text().await.unwrap();
    assert!(
        metrics.contains("tollgate_shadow_comparisons_total{gateway=\"deny\",service=\"allow\"}")
    );

    // After a reset, a service that agrees reads as ready to enforce.
    let r = a
        .admin(Method::DELETE, "/shadow", &token())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    for _ in 0..5 {
        b.get("/exact", Some(&key("same"))).await;
    }
    eventually(Duration::from_secs(4), "agreement reported", || async {
        let r: Value = a
            .admin(Method::GET, "/shadow", &token())
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        r["compared"] == 5 && r["ready_to_enforce"] == true
    })
    .await;
}

#[tokio::test]
async fn metrics_use_the_specified_names_and_never_a_client_id() {
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}",
        catalog_toml(("gold", 2.0, 0.001), &["secret-client-name"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    for _ in 0..3 {
        gw.get("/orders", Some(&key("secret-client-name"))).await;
    }
    gw.get("/orders", Some("unknown-key-123")).await;
    let text = gw.get("/metrics", None).await.text().await.unwrap();
    for line in [
        "tollgate_decisions_total{outcome=\"allowed\"} 2",
        "tollgate_decisions_total{outcome=\"denied\"} 1",
        "tollgate_decisions_total{outcome=\"unknown_key\"} 1",
        "tollgate_fail_open_total 0",
        "tollgate_limiter_seconds_count 3",
        "tollgate_upstream_requests_total{service=\"orders\",status_class=\"2xx\"} 2",
        "tollgate_shadow_comparisons_total{gateway=\"allow\",service=\"allow\"} 0",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    assert!(!text.contains("secret-client-name"));
    assert!(!text.contains(&key("secret-client-name")));
}
