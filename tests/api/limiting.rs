//! One bucket per client, enforced once at the edge, over real Redis.

use std::time::Duration;

use futures_util::future::join_all;

use crate::helpers::*;

/// Waits until Redis has run nothing but `INFO` between two looks 50 ms apart: the
/// gateway's start-up traffic (the first catalog poll, each worker's request-path
/// connection) is over, so command counts from here on are the test's.
pub(crate) async fn quiet(redis: &RedisServer) {
    let counts = || {
        let mut calls = redis.command_calls().unwrap();
        calls.remove("info");
        calls
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut last = counts();
    // Start-up's tasks (catalog load, persistence check) may come late on a loaded
    // host: quiet means four checks in a row with nothing new.
    let mut still = 0;
    loop {
        // Yielding also lets the gateway's background tasks (on this runtime) run.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = counts();
        if now == last {
            still += 1;
            if still == 4 {
                return;
            }
            continue;
        }
        still = 0;
        assert!(
            std::time::Instant::now() < deadline,
            "Redis still busy 5 s after start-up: {now:?}"
        );
        last = now;
    }
}

#[tokio::test]
async fn three_gateways_on_one_redis_admit_exactly_the_capacity_across_two_services() {
    // Arrange: one Redis, two services with two replicas each, three gateways.
    let redis = RedisServer::start().unwrap();
    let orders = [
        Upstream::start(Behaviour::Echo).await,
        Upstream::start(Behaviour::Echo).await,
    ];
    let billing = [
        Upstream::start(Behaviour::Echo).await,
        Upstream::start(Behaviour::Echo).await,
    ];
    let toml = format!(
        "{}{}{}{}",
        redis_toml(&redis),
        catalog_toml(("gold", 40.0, 0.001), &["acme"]),
        route_toml("orders", "/orders", &[orders[0].url(), orders[1].url()]),
        route_toml("billing", "/billing", &[billing[0].url(), billing[1].url()]),
    );
    let mut gateways = Vec::new();
    for _ in 0..3 {
        gateways.push(TestGateway::spawn(settings(&toml)).await);
    }

    // Act: 120 concurrent requests from one client, spread over gateways and services.
    let k = key("acme");
    let requests = (0..120).map(|i| {
        let gw = &gateways[i % 3];
        let path = if i % 2 == 0 {
            "/orders/1"
        } else {
            "/billing/1"
        };
        gw.get(path, Some(&k))
    });
    let statuses: Vec<u16> = join_all(requests)
        .await
        .into_iter()
        .map(|r| r.status().as_u16())
        .collect();

    // Assert: exactly the capacity admitted, the rest refused, and only the admitted
    // ones reached a service.
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    let refused = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!(admitted, 40, "{statuses:?}");
    assert_eq!(refused, 80);
    let reached: usize = orders.iter().chain(billing.iter()).map(|u| u.hits()).sum();
    assert_eq!(reached, admitted);
    // Both services and all four replicas took part.
    assert!(orders.iter().chain(billing.iter()).all(|u| u.hits() > 0));
}

#[tokio::test]
async fn each_decision_is_one_script_call_and_nothing_else() {
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}[catalog]\nrefresh_ms = 600000\n",
        redis_toml(&redis),
        catalog_toml(("gold", 5.0, 1.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    // Start-up traffic (script load, seeding, the first catalog poll) is over first.
    quiet(&redis).await;
    redis.reset_command_stats().unwrap();

    for _ in 0..12 {
        gw.get("/orders", Some(&key("acme"))).await;
    }

    // INFO commandstats also counts the commands the script runs inside Redis: one read
    // and one write of the client's state group, and no expiry (groups have none).
    let calls = redis.command_calls().unwrap();
    assert_eq!(calls.get("evalsha"), Some(&12), "{calls:?}");
    for inside_the_script in ["time", "hmget"] {
        assert_eq!(calls.get(inside_the_script), Some(&12), "{calls:?}");
    }
    // A group is swept at most once a second (HLEN, HSCAN, and an HSET of its mark, which
    // every call reads with its fields): the first call's, and perhaps one more.
    let swept = calls.get("hscan").copied().unwrap_or(0);
    assert!((1..=2).contains(&swept), "{calls:?}");
    assert_eq!(calls.get("hlen"), Some(&swept), "{calls:?}");
    assert_eq!(calls.get("hset"), Some(&(12 + swept)), "{calls:?}");
    // The group is a hash table from its first write (its mark is longer than a listpack
    // value may be): a listpack would look fields up by walking every entry.
    let encoding: String = redis::cmd("OBJECT")
        .arg("ENCODING")
        .arg("tollgate:s:{0}")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    assert_eq!(encoding, "hashtable");
    let others: Vec<_> = calls
        .keys()
        .filter(|c| {
            !matches!(
                c.as_str(),
                "evalsha"
                    | "time"
                    | "hmget"
                    | "hset"
                    | "hlen"
                    | "hscan"
                    | "info"
                    | "config|resetstat"
            )
        })
        .collect();
    assert!(
        others.is_empty(),
        "unexpected commands on the request path: {others:?}"
    );
}

#[tokio::test]
async fn takes_of_many_clients_share_script_calls_and_each_client_keeps_its_exact_limit() {
    // Arrange: one worker, 60 clients with 3 tokens each and next to no refill.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let clients: Vec<String> = (0..60).map(|i| format!("c{i}")).collect();
    let names: Vec<&str> = clients.iter().map(String::as_str).collect();
    let toml = format!(
        "{}{}{}",
        redis_toml(&redis),
        catalog_toml(("gold", 3.0, 0.001), &names),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    quiet(&redis).await;
    redis.reset_command_stats().unwrap();

    // Act: 4 requests per client, all 240 at once, clients interleaved.
    let keys: Vec<String> = clients.iter().map(|c| key(c)).collect();
    let answers = join_all((0..240).map(|i| gw.get("/orders/1", Some(&keys[i % 60])))).await;

    // Assert: each client got exactly its 3 tokens, each admitted request its own place
    // in its own bucket (remaining 2, 1, 0)...
    let mut places: Vec<Vec<u64>> = vec![Vec::new(); 60];
    for (i, r) in answers.iter().enumerate() {
        if r.status() == 200 {
            let rl = RateLimit::of(r);
            places[i % 60].push(rl.remaining);
        } else {
            assert_eq!(r.status(), 429);
        }
    }
    for (c, p) in places.iter_mut().enumerate() {
        p.sort_unstable();
        assert_eq!(*p, vec![0, 1, 2], "client c{c}");
    }
    assert_eq!(up.hits(), 180);
    // ...and the takes of different clients went to Redis together: fewer calls than
    // half the clients, where one call per client (or per request) would be 60 (240).
    let calls = redis.command_calls().unwrap()["evalsha"];
    assert!(
        calls < 30,
        "{calls} script calls for 240 requests of 60 clients: takes of different clients were not gathered"
    );
}

#[tokio::test]
async fn concurrent_takes_for_one_bucket_share_script_calls_and_keep_exact_verdicts() {
    // Arrange: one worker, one client with 50 tokens and next to no refill.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}",
        redis_toml(&redis),
        catalog_toml(("gold", 50.0, 0.001), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    quiet(&redis).await;
    redis.reset_command_stats().unwrap();

    // Act: 200 requests at once.
    let k = key("acme");
    let answers = join_all((0..200).map(|_| gw.get("/orders/1", Some(&k)))).await;

    // Assert: exactly the capacity admitted, each admitted request told its own place in
    // the bucket (remaining 49, 48, ... 0: one verdict per request, not one per call)...
    let mut remaining: Vec<u64> = answers
        .iter()
        .filter(|r| r.status() == 200)
        .map(|r| {
            let v = r.headers()["ratelimit"].to_str().unwrap();
            v.split("r=")
                .nth(1)
                .unwrap()
                .split(';')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    remaining.sort_unstable();
    assert_eq!(remaining, (0..50).collect::<Vec<u64>>());
    assert_eq!(answers.iter().filter(|r| r.status() == 429).count(), 150);
    assert_eq!(up.hits(), 50);
    // ...and the requests that queued behind a call in flight went to Redis together: on
    // one worker, a call per round trip, not per request (a handful here; at least ten
    // requests a call on average, where one call per request would be 200).
    let calls = redis.command_calls().unwrap()["evalsha"];
    assert!(
        calls * 10 <= 200,
        "{calls} script calls for 200 requests: the queued requests were not batched"
    );
    let metrics = gw.get("/metrics", None).await.text().await.unwrap();
    assert!(
        metrics.contains(&format!("tollgate_store_bucket_calls_total {calls}\n")),
        "{metrics}"
    );
    assert!(metrics.contains("tollgate_store_bucket_takes_total 200\n"));
}

#[tokio::test]
async fn retry_after_is_honest_and_at_most_a_second_pessimistic() {
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}",
        redis_toml(&redis),
        catalog_toml(("slow", 2.0, 0.5), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let k = key("acme");

    assert_eq!(gw.get("/orders", Some(&k)).await.status(), 200);
    assert_eq!(gw.get("/orders", Some(&k)).await.status(), 200);
    let denied = gw.get("/orders", Some(&k)).await;
    assert_eq!(denied.status(), 429);
    assert_eq!(denied.headers()["content-type"], "application/problem+json");
    assert!(denied.headers().contains_key("ratelimit-policy"));
    assert!(denied.headers().contains_key("ratelimit"));
    let retry_after: u64 = denied.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body: serde_json::Value = denied.json().await.unwrap();
    let wait_ms = body["retry_after_ms"].as_u64().unwrap();

    // The real wait is ~2 s (one token at 0.5/s); Retry-After rounds it up by < 1 s.
    assert!(retry_after >= 1);
    assert!(
        retry_after * 1000 >= wait_ms,
        "{retry_after} s < {wait_ms} ms"
    );
    assert!(
        retry_after * 1000 - wait_ms < 1000,
        "{retry_after} s vs {wait_ms} ms"
    );
    assert_eq!(
        up.hits(),
        2,
        "the refused request must not reach the service"
    );

    tokio::time::sleep(Duration::from_secs(retry_after)).await;
    assert_eq!(gw.get("/orders", Some(&k)).await.status(), 200);
}

#[tokio::test]
async fn a_gateway_whose_clock_is_hours_off_decides_like_the_others() {
    // Arrange: one gateway in this process, one as a process whose clock is 5 hours
    // behind (libfaketime), both on one Redis.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}",
        redis_toml(&redis),
        catalog_toml(("gold", 10.0, 1.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let normal = TestGateway::spawn(settings(&toml)).await;
    let lib = faketime_library();
    let skewed = gateway_process(&toml, &[("LD_PRELOAD", lib), ("FAKETIME", "-5h")]);
    let http = reqwest::Client::new();

    // The skewed gateway really lives 5 hours in the past.
    let health = http
        .get(format!("{}/healthz", skewed.address))
        .send()
        .await
        .unwrap();
    let date = httpdate(health.headers()["date"].to_str().unwrap());
    let skew = std::time::SystemTime::now().duration_since(date).unwrap();
    assert!(skew > Duration::from_secs(4 * 3600), "skew {skew:?}");

    // Act: alternate between the two.
    let mut statuses = Vec::new();
    for i in 0..16 {
        let r = if i % 2 == 0 {
            normal.get("/orders", Some(&key("acme"))).await
        } else {
            http.get(format!("{}/orders", skewed.address))
                .header("x-api-key", key("acme"))
                .send()
                .await
                .unwrap()
        };
        statuses.push((
            i % 2,
            r.status().as_u16(),
            r.headers().get("retry-after").cloned(),
        ));
    }

    // Assert: together exactly the capacity, and every denial, from either gateway, says
    // the same wait (one token at 1/s); admitted answers carry none.
    let admitted = statuses.iter().filter(|(_, s, _)| *s == 200).count();
    assert_eq!(admitted, 10, "{statuses:?}");
    let skewed_denials: Vec<_> = statuses
        .iter()
        .filter(|(g, s, _)| *g == 1 && *s == 429)
        .collect();
    assert!(!skewed_denials.is_empty());
    for (_, status, retry_after) in &statuses {
        let expected = (*status == 429).then_some("1");
        assert_eq!(
            retry_after.as_ref().map(|v| v.to_str().unwrap()),
            expected,
            "{statuses:?}"
        );
    }
}

/// libfaketime from Debian's `faketime` package, wherever this architecture keeps it.
fn faketime_library() -> &'static str {
    ["x86_64-linux-gnu", "aarch64-linux-gnu"]
        .iter()
        .map(|arch| format!("/usr/lib/{arch}/faketime/libfaketime.so.1"))
        .find(|p| std::path::Path::new(p).exists())
        .map(|p| &*Box::leak(p.into_boxed_str()))
        .expect("libfaketime is needed: apt-get install faketime (.ci/run does)")
}

fn httpdate(s: &str) -> std::time::SystemTime {
    // e.g. "Mon, 30 Nov 2026 00:10:11 GMT"
    let parts: Vec<&str> = s.split_whitespace().collect();
    let day: u64 = parts[1].parse().unwrap();
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ]
    .iter()
    .position(|m| *m == parts[2])
    .unwrap() as u64
        + 1;
    let year: u64 = parts[3].parse().unwrap();
    let hms: Vec<u64> = parts[4].split(':').map(|x| x.parse().unwrap()).collect();
    // Days since the epoch (civil from days, Howard Hinnant's algorithm, inverted).
    let (y, m) = if month <= 2 {
        (year - 1, month + 9)
    } else {
        (year, month - 3)
    };
    let era = y / 400;
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    std::time::UNIX_EPOCH
        + Duration::from_secs(days * 86_400 + hms[0] * 3600 + hms[1] * 60 + hms[2])
}

#[tokio::test]
async fn an_unknown_or_missing_key_gets_401_and_touches_nothing() {
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}[catalog]\nrefresh_ms = 600000\n",
        redis_toml(&redis),
        catalog_toml(("gold", 5.0, 1.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    quiet(&redis).await;
    redis.reset_command_stats().unwrap();

    for k in [None, Some("not-a-known-key"), Some("")] {
        let r = gw.get("/orders", k).await;
        assert_eq!(r.status(), 401);
        assert_eq!(r.headers()["www-authenticate"], "ApiKey");
        assert_eq!(r.headers()["content-type"], "application/problem+json");
    }

    assert_eq!(up.hits(), 0);
    assert!(redis.keys("tollgate:s:*").unwrap().is_empty());
    assert_eq!(redis.command_calls().unwrap().get("evalsha"), None);
}

#[tokio::test]
async fn script_flush_mid_traffic_keeps_decisions_correct() {
    // Arrange: no catalog polls to muddy the counts; start-up (which loaded the scripts)
    // is over once `build` returns, so from here on every SCRIPT LOAD is a reload.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}[catalog]\nrefresh_ms = 600000\n",
        redis_toml(&redis),
        catalog_toml(("gold", 30.0, 0.001), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    quiet(&redis).await;
    redis.reset_command_stats().unwrap();

    // Act: 50 requests, the scripts flushed before requests 6, 16, 26, 36 and 46.
    let mut admitted = 0;
    let mut flushes = 0;
    for i in 0..50 {
        if i % 10 == 5 {
            let _: () = redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query(&mut redis.conn().unwrap())
                .unwrap();
            flushes += 1;
        }
        let r = gw.get("/orders", Some(&key("acme"))).await;
        assert!(
            r.headers().contains_key("ratelimit"),
            "request {i} was not decided"
        );
        if r.status() == 200 {
            admitted += 1;
        }
    }

    // Assert: exactly the capacity, nothing failed open, and each flush cost exactly one
    // SCRIPT LOAD and one extra EVALSHA (the one that met NOSCRIPT).
    assert_eq!(admitted, 30);
    assert_eq!(gw.metric("tollgate_fail_open_total").await, Some(0.0));
    let calls = redis.command_calls().unwrap();
    assert_eq!(calls.get("script|load"), Some(&flushes), "{calls:?}");
    assert_eq!(calls.get("evalsha"), Some(&(50 + flushes)), "{calls:?}");
}

#[tokio::test]
async fn idle_state_is_swept_once_its_bucket_is_full_again_and_not_before() {
    // Arrange: acme spends 4 of 10 tokens at 2 tokens/s: full again in 2 s.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}",
        redis_toml(&redis),
        catalog_toml(("gold", 10.0, 2.0), &["acme", "other"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    for _ in 0..4 {
        gw.get("/orders", Some(&key("acme"))).await;
    }
    let [tokens, at, over] = stored(&redis, "acme", "").expect("acme's state");
    assert!((tokens - 6.0).abs() < 0.2, "{tokens}");
    // Sweepable once full (about 2 s after the last take) plus 1 s of slack.
    let full_in = (10.0 - tokens) / 2.0;
    assert!(
        ((over - at) / 1e6 - full_in - 1.0).abs() < 0.001,
        "{at} {over}"
    );

    // Act: other traffic (which carries the sweeps) for a second: acme is not full yet.
    let other = || async {
        for _ in 0..8 {
            gw.get("/orders", Some(&key("other"))).await;
            tokio::time::sleep(Duration::from_millis(130)).await;
        }
    };
    other().await;
    assert!(stored(&redis, "acme", "").is_some(), "swept too early");

    // Act: past the time acme's state says nothing a missing one would not.
    tokio::time::sleep(Duration::from_secs(2)).await;
    other().await;

    // Assert: swept; acme starts full, as its bucket would be.
    assert!(stored(&redis, "acme", "").is_none(), "never swept");
    let r = gw.get("/orders", Some(&key("acme"))).await;
    assert_eq!(RateLimit::of(&r).remaining, 9);
}

#[tokio::test]
async fn the_embedded_store_limits_without_redis() {
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}",
        catalog_toml(("gold", 7.0, 0.001), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let k = key("acme");
    let statuses: Vec<u16> = join_all((0..20).map(|_| gw.get("/orders", Some(&k))))
        .await
        .into_iter()
        .map(|r| r.status().as_u16())
        .collect();
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 7);
    assert_eq!(up.hits(), 7);
}

#[tokio::test]
async fn allowed_responses_carry_the_rate_limit_headers() {
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}",
        catalog_toml(("gold", 10.0, 5.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let r = gw.get("/orders", Some(&key("acme"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["ratelimit-policy"], "\"gold\";q=10;w=2");
    assert_eq!(r.headers()["ratelimit"], "\"gold\";r=9;t=1");
}

#[tokio::test]
async fn a_route_costing_more_than_the_plan_holds_gets_429_without_retry_after() {
    // Arrange: a plan of 10 tokens, a route costing 12 and a route costing 1.
    let redis = RedisServer::start().unwrap();
    let bulk = Upstream::start(Behaviour::Echo).await;
    let orders = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}cost = 12.0\n{}",
        redis_toml(&redis),
        catalog_toml(("gold", 10.0, 1.0), &["acme"]),
        route_toml("bulk", "/bulk", &[bulk.url()]),
        route_toml("orders", "/orders", &[orders.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let k = key("acme");

    // Act + Assert: on a full bucket, the costly route is refused every time, with no
    // wait to retry after (none would help), by the gateway itself.
    for _ in 0..3 {
        let r = gw.get("/bulk/export", Some(&k)).await;
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        assert!(
            !r.headers().contains_key("retry-after"),
            "Retry-After on a request no wait can admit: {:?}",
            r.headers()
        );
        assert_eq!(r.headers()["ratelimit-policy"], "\"gold\";q=10;w=10");
        assert_eq!(r.headers()["ratelimit"], "\"gold\";r=10;t=0");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["status"], 429);
        assert!(body.get("retry_after_ms").is_none(), "{body}");
    }
    assert_eq!(bulk.hits(), 0, "a refused request reached the service");

    // ...and refusing it spent nothing: the cheap route finds the bucket full.
    let r = gw.get("/orders", Some(&k)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["ratelimit"], "\"gold\";r=9;t=1");
}

#[tokio::test]
async fn a_route_costing_more_than_the_plan_holds_is_refused_even_while_failing_open() {
    // Arrange: as above, then Redis goes away (the breaker may open or not: either way
    // the store cannot be asked).
    let mut redis = RedisServer::start().unwrap();
    let bulk = Upstream::start(Behaviour::Echo).await;
    let orders = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[redis]\nurl = \"{}\"\ntimeout_ms = 50\n{}{}cost = 12.0\n{}",
        redis.url(),
        catalog_toml(("gold", 10.0, 1.0), &["acme"]),
        route_toml("bulk", "/bulk", &[bulk.url()]),
        route_toml("orders", "/orders", &[orders.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let k = key("acme");
    redis.kill();

    // Act + Assert: the cheap route fails open (no token count)...
    let r = gw.get("/orders", Some(&k)).await;
    assert_eq!(r.status(), 200);
    assert!(!r.headers().contains_key("ratelimit"));
    // ...but no answer from the store could admit the costly one, so none is needed to
    // refuse it.
    for _ in 0..3 {
        let r = gw.get("/bulk", Some(&k)).await;
        assert_eq!(
            r.status(),
            429,
            "a request the plan can never admit was admitted"
        );
        assert!(
            !r.headers().contains_key("retry-after"),
            "{:?}",
            r.headers()
        );
        assert_eq!(r.headers()["ratelimit-policy"], "\"gold\";q=10;w=10");
        assert!(!r.headers().contains_key("ratelimit"), "{:?}", r.headers());
    }
    assert_eq!(bulk.hits(), 0);
    assert_eq!(
        gw.metric("tollgate_decisions_total{outcome=\"denied\"}")
            .await,
        Some(3.0)
    );
}
