//! Surviving faults and rolling out: fail open, the breaker, safety limits, shadow mode.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::*;

fn token() -> String {
    admin_token("ops", "admin:read admin:write")
}

/// A fail-open answer: forwarded, with the plan's `RateLimit-Policy` and no token count.
fn assert_failed_open(r: &reqwest::Response) {
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["ratelimit-policy"], "\"gold\";q=10000;w=10000");
    assert!(
        !decided(r),
        "a token count while failing open: {:?}",
        r.headers()
    );
}

/// A series on the gateway's `/metrics`, which must be there.
async fn fail_opens(gw: &TestGateway, reason: &str) -> f64 {
    gw.sample(&format!(
        "tollgate_fail_open_reasons_total{{reason=\"{reason}\"}}"
    ))
    .await
}

#[tokio::test]
async fn a_stalled_then_killed_redis_fails_open_and_limiting_resumes_by_itself() {
    // Arrange: the default 5 ms budget, a client with room to spare.
    let mut redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[redis]\nurl = \"{}\"\n[catalog]\nrefresh_ms = 100\n{}{}",
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
    let timeouts_before = fail_opens(&gw, "timeout").await;
    let skipped_before = fail_opens(&gw, "breaker_open").await;
    let fail_open_before = gw.sample("tollgate_fail_open_total").await;

    // Act 1: Redis stalls (SIGSTOP). Every request is still admitted, with the client's
    // policy and no token count (the gateway knows none).
    redis.stall().unwrap();
    let started = Instant::now();
    for _ in 0..30 {
        let r = gw.get("/orders", Some(&k)).await;
        assert_failed_open(&r);
    }
    let stalled_for = started.elapsed();

    // Only the first few waited out the budget; then the breaker answered at once. As an
    // operator reads it on /metrics.
    let waited = fail_opens(&gw, "timeout").await - timeouts_before;
    let skipped = fail_opens(&gw, "breaker_open").await - skipped_before;
    assert!(
        waited <= 5.0,
        "{waited} requests waited for a stalled Redis"
    );
    assert!(
        skipped >= 25.0,
        "only {skipped} requests skipped the stalled Redis"
    );
    assert_eq!(
        gw.sample("tollgate_fail_open_total").await - fail_open_before,
        30.0
    );
    assert!(gw.breaker_open().await);
    assert!(gw.sample("tollgate_breaker_opened_total").await >= 1.0);
    assert!(
        stalled_for < Duration::from_secs(3),
        "30 requests took {stalled_for:?}"
    );
    let ready = gw.get("/readyz", None).await;
    assert_eq!(ready.status(), 503);
    let ready: Value = ready.json().await.unwrap();
    assert_eq!(ready["status"], "unavailable", "{ready}");
    assert!(
        ready["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{ready}"
    );

    // Act 2: Redis resumes; limiting resumes by itself.
    redis.resume().unwrap();
    eventually(
        Duration::from_secs(5),
        "decisions after SIGCONT",
        || async { decided(&gw.get("/orders", Some(&k)).await) },
    )
    .await;
    assert!(!gw.breaker_open().await);

    // Act 3: Redis dies, then comes back empty on the same port.
    redis.kill();
    for _ in 0..10 {
        let r = gw.get("/orders", Some(&k)).await;
        assert_failed_open(&r);
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
    // poll (100 ms here): the client is known again. (Decisions do not need the catalog
    // in Redis, so they can resume before that poll.)
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

/// The `r=` of a response's `RateLimit`, if it carries one.
fn remaining(r: &reqwest::Response) -> Option<i64> {
    let rl = r.headers().get("ratelimit")?.to_str().unwrap();
    Some(
        rl.split(';')
            .find_map(|p| p.strip_prefix("r="))
            .unwrap()
            .parse()
            .unwrap(),
    )
}

#[tokio::test]
async fn replies_stay_with_their_requests_when_redis_stalls_under_load() {
    // Arrange: 12 clients whose capacities are 1000 apart, so a reply delivered to the
    // wrong request would show another client's token count. A 25 ms budget (a debug
    // build deciding 60 requests at once on two busy cores can take 5), and a short
    // breaker back-off, so Redis is asked again soon after each stall.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let clients: Vec<String> = (1..=12).map(|i| format!("c{i}")).collect();
    let capacity = |i: usize| (i as i64 + 1) * 1000;
    let mut toml = format!(
        "[redis]\nurl = \"{}\"\ntimeout_ms = 25\n[periods]\nbreaker_backoff_ms = 20\nbreaker_backoff_max_ms = 20\n",
        redis.url()
    );
    for (i, c) in clients.iter().enumerate() {
        toml.push_str(&format!(
            "[[catalog.plans]]\nname = \"p{c}\"\ncapacity = {}\nrate = 0.001\n[[catalog.clients]]\nid = \"{c}\"\nplan = \"p{c}\"\nkeys = [\"{}\"]\n",
            capacity(i),
            key(c)
        ));
    }
    toml.push_str(&route_toml("orders", "/orders", &[up.url()]));
    let gw = TestGateway::spawn(settings(&toml)).await;

    // Act: concurrent load, 60 requests at a time over the 12 clients, for as long as
    // Redis is frozen and thawed three times. Each stall begins once Redis has decided a
    // request sent since the last thaw (so it answers again, the breaker closed), and
    // lasts until a request has waited out its budget on it: that request's reply comes
    // late, among the replies to the requests sent after the thaw.
    let in_flight = AtomicUsize::new(0);
    let thaws = AtomicUsize::new(0);
    let decided_after: [AtomicUsize; 4] = Default::default();
    let chaos_done = AtomicBool::new(false);
    let load = async {
        // (client, thaws before it was sent, status, remaining)
        let mut answers: Vec<(usize, usize, u16, Option<i64>)> = Vec::new();
        while !chaos_done.load(Ordering::SeqCst) {
            let batch = (0..60).map(|j| {
                let i = (answers.len() + j) % clients.len();
                let k = key(&clients[i]);
                let (gw, in_flight, thaws, decided_after) =
                    (&gw, &in_flight, &thaws, &decided_after);
                async move {
                    let after = thaws.load(Ordering::SeqCst);
                    in_flight.fetch_add(1, Ordering::SeqCst);
                    let r = gw.get("/orders", Some(&k)).await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    let remaining = remaining(&r);
                    if remaining.is_some() {
                        decided_after[after].fetch_add(1, Ordering::SeqCst);
                    }
                    (i, after, r.status().as_u16(), remaining)
                }
            });
            answers.extend(join_all(batch).await);
        }
        answers
    };
    let decided_since_thaw = |n: usize| {
        let decided_after = &decided_after;
        let gw = &gw;
        async move {
            eventually(
                Duration::from_secs(5),
                &format!("a request sent after thaw {n} decided"),
                || async {
                    decided_after[n].load(Ordering::SeqCst) > 0 && !gw.breaker_open().await
                },
            )
            .await
        }
    };
    let chaos = async {
        let mut stalls = Vec::new();
        for n in 0..3 {
            decided_since_thaw(n).await;
            let timeouts_before = fail_opens(&gw, "timeout").await;
            redis.stall().unwrap();
            stalls.push(in_flight.load(Ordering::SeqCst));
            tokio::time::sleep(Duration::from_millis(60)).await;
            eventually(
                Duration::from_secs(2),
                "a request timed out on the frozen Redis",
                || async { fail_opens(&gw, "timeout").await > timeouts_before },
            )
            .await;
            redis.resume().unwrap();
            thaws.fetch_add(1, Ordering::SeqCst);
        }
        decided_since_thaw(3).await;
        chaos_done.store(true, Ordering::SeqCst);
        stalls
    };
    let (answers, stalls) = tokio::join!(load, chaos);

    // Assert: every request was admitted (decided or failing open), and each decided one
    // carried a count of its own client's bucket: between its capacity less every request
    // the client sent (some failed open yet spent a token) and its capacity less one.
    let mut sent = vec![0i64; clients.len()];
    for (i, _, _, _) in &answers {
        sent[*i] += 1;
    }
    for (i, _, status, r) in &answers {
        assert_eq!(*status, 200, "failing open must admit");
        let Some(r) = r else { continue };
        let (cap, sent) = (capacity(*i), sent[*i]);
        assert!(
            (cap - sent..cap).contains(r),
            "client {} (capacity {cap}, {sent} sent) saw remaining {r}",
            clients[*i]
        );
    }

    // ...and the stalls were no idle ones: each caught requests in flight (and lasted
    // until one of them waited out its budget on the frozen Redis).
    assert!(
        stalls.iter().all(|outstanding| *outstanding > 0),
        "requests in flight as each stall began: {stalls:?}"
    );

    // Assert: after a refill, each client's next decisions count exactly from full: a
    // request n is told between capacity - n (every earlier one spent) and capacity less
    // the decided ones so far (a request failing open may not have spent).
    eventually(Duration::from_secs(5), "the breaker closes", || async {
        !gw.breaker_open().await
    })
    .await;
    let _: () = redis::cmd("FLUSHDB")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    let mut failed_open = 0;
    for (i, c) in clients.iter().enumerate() {
        let mut decided = 0;
        for n in 1..=3 {
            let r = gw.get("/orders", Some(&key(c))).await;
            assert_eq!(r.status(), 200);
            let Some(r) = remaining(&r) else {
                failed_open += 1;
                continue;
            };
            decided += 1;
            assert!(
                (capacity(i) - n..=capacity(i) - decided).contains(&r),
                "client {c} (capacity {}) saw remaining {r} on request {n}",
                capacity(i)
            );
        }
    }
    assert!(
        failed_open <= 6,
        "{failed_open} of 36 answers failed open: too few checked"
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
    gw.wait_for_catalog(etag_version(&r)).await;

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
        "{}[redis]\nurl = \"{}\"\ntimeout_ms = 2000\n[limits]\ndefault_mode = \"shadow\"\n[periods]\nshadow_flush_ms = 50\n{}{}{}",
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

    // Each gateway counts its own comparisons; together they are the whole table: "same"
    // agreed 10 times to admit and 20 to refuse; "loose" agreed 10 times to admit and 10
    // to refuse, and the gateway alone refused its requests 11-20.
    let mut table = Vec::new();
    for (gateway, service) in [
        ("allow", "allow"),
        ("deny", "allow"),
        ("deny", "deny"),
        ("allow", "deny"),
    ] {
        let series = format!(
            "tollgate_shadow_comparisons_total{{gateway=\"{gateway}\",service=\"{service}\"}}"
        );
        table.push(a.sample(&series).await + b.sample(&series).await);
    }
    assert_eq!(
        table,
        [20.0, 10.0, 30.0, 0.0],
        "allow/allow, deny/allow, deny/deny, allow/deny"
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
