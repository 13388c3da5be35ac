//! Network faults between the gateway and Redis, injected with the test kit's TCP proxy
//! (`FaultProxy`) in front of a real `redis-server`, and Redis restarts with signals: the
//! gateway notices dead connections however they died, and limiting, admin writes and
//! catalog changes come back on their own within the README's bounds.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;
use tollgate_testkit::FaultProxy;

use crate::helpers::*;

fn token() -> String {
    admin_token("ops", "admin:read admin:write")
}

/// A gateway on Redis behind a fault proxy: plan `gold` with room to spare, client `acme`
/// (key `key-acme-0000`), a route to one upstream, two workers. The decision budget is
/// 100 ms, not 5: these tests are about dead connections (which fail at once, whatever
/// the budget), not about a busy 2-core machine's scheduling stalls.
async fn gateway_behind(proxy_url: &str, up: &Upstream) -> TestGateway {
    let toml = format!(
        "{}[server]\nworkers = 2\n[redis]\nurl = \"{proxy_url}\"\ntimeout_ms = 100\n[catalog]\nrefresh_ms = 1000\n{}{}",
        admin_toml(),
        catalog_toml(("gold", 100_000.0, 1.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    TestGateway::spawn(settings(&toml)).await
}

/// A real Redis behind a fault proxy, an upstream, and a gateway through the proxy that has
/// made its first real decision.
struct Behind {
    redis: RedisServer,
    proxy: FaultProxy,
    up: Upstream,
    gw: TestGateway,
}

impl Behind {
    async fn start() -> Behind {
        let redis = RedisServer::start().unwrap();
        let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port).parse().unwrap());
        let up = Upstream::start(Behaviour::Echo).await;
        let gw = gateway_behind(&proxy.redis_url(), &up).await;
        eventually(Duration::from_secs(5), "a first real decision", || async {
            get(&gw, &key("acme")).await.is_some_and(|r| decided(&r))
        })
        .await;
        Behind {
            redis,
            proxy,
            up,
            gw,
        }
    }
}

/// A request with a short client timeout: a gateway that hangs counts as a failure.
async fn get(gw: &TestGateway, key: &str) -> Option<reqwest::Response> {
    gw.http
        .get(format!("{}/orders", gw.address))
        .header("x-api-key", key)
        .timeout(Duration::from_secs(3))
        .send()
        .await
        .ok()
}

/// A plan write; `None` when the gateway did not answer within 4 s.
async fn put_plan(gw: &TestGateway, name: &str) -> Option<u16> {
    gw.admin(Method::PUT, &format!("/plans/{name}"), &token())
        .json(&json!({"capacity": 10, "rate": 1}))
        .timeout(Duration::from_secs(4))
        .send()
        .await
        .ok()
        .map(|r| r.status().as_u16())
}

/// `CLIENT LIST` of `redis`, without the connection that asks.
fn client_ids(redis: &RedisServer) -> Vec<u64> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut redis.conn().unwrap())
        .unwrap();
    list.lines()
        .filter(|l| !l.contains("cmd=client|list"))
        .map(|l| {
            l.split(' ')
                .find_map(|f| f.strip_prefix("id="))
                .and_then(|id| id.parse().ok())
                .unwrap_or_else(|| panic!("no id in {l:?}"))
        })
        .collect()
}

/// The newest client id Redis has given so far: the asking connection's own (ids only
/// grow, so every client that connects later has a larger one).
fn newest_client_id(redis: &RedisServer) -> u64 {
    redis::cmd("CLIENT")
        .arg("ID")
        .query(&mut redis.conn().unwrap())
        .unwrap()
}

/// Clients connected now that arrived after `newest`.
fn clients_since(redis: &RedisServer, newest: u64) -> usize {
    client_ids(redis)
        .into_iter()
        .filter(|id| *id > newest)
        .count()
}

/// Polls `check` until it holds and returns how long that took; fails after `within`.
async fn time_until<F, Fut>(within: Duration, what: &str, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    eventually(within, what, &mut check).await;
    started.elapsed()
}

/// After the fault: limiting resumes within 5 s, an admin write succeeds within 5 s, and
/// a key revoked then stops working within `catalog.refresh_ms` (plus one poll's slack).
async fn assert_recovers(gw: &TestGateway, what: &str) {
    let k = key("acme");
    let t = time_until(Duration::from_secs(5), "limiting resumes", || async {
        get(gw, &k).await.is_some_and(|r| decided(&r))
    })
    .await;
    eprintln!("{what}: limiting resumed after {t:?}");
    let t = time_until(
        Duration::from_secs(5),
        "an admin write succeeds",
        || async { matches!(put_plan(gw, "after-fault").await, Some(200 | 201)) },
    )
    .await;
    eprintln!("{what}: admin write after {t:?}");

    // A catalog change made now is in force within refresh_ms: a revoked key stops working.
    let (key_id, fresh) = new_key(gw, "acme").await;
    eventually(Duration::from_secs(3), "the new key works", || async {
        get(gw, &fresh).await.is_some_and(|r| r.status() == 200)
    })
    .await;
    let revoked = gw
        .admin(
            Method::DELETE,
            &format!("/clients/acme/keys/{key_id}"),
            &token(),
        )
        .timeout(Duration::from_secs(4))
        .send()
        .await
        .unwrap();
    assert!(revoked.status().is_success(), "{}", revoked.status());
    let t = time_until(
        Duration::from_millis(1000 + 500),
        "the revoked key refused within catalog.refresh_ms",
        || async { get(gw, &fresh).await.is_some_and(|r| r.status() == 401) },
    )
    .await;
    eprintln!("{what}: revocation in force after {t:?}");
}

#[tokio::test]
async fn a_failover_behind_the_name_is_left_behind_and_everything_resumes_within_seconds() {
    // Arrange: a gateway whose connections to Redis all work.
    let Behind {
        redis: _redis,
        proxy,
        up: _up,
        gw,
    } = Behind::start().await;
    let k = key("acme");
    assert!(put_plan(&gw, "before").await.is_some_and(|s| s == 201));
    let accepted_before = proxy.accepted();

    // Act: every open connection goes silent while the address serves new ones (a
    // managed failover moving its name, a NAT dropping state): nothing is closed, so
    // only the gateway's own deadlines can tell.
    proxy.blackhole();
    for _ in 0..20 {
        let r = get(&gw, &k)
            .await
            .expect("the gateway answers while Redis is silent");
        assert_eq!(r.status(), 200, "failing open admits");
    }

    // Assert: new connections were dialed, and everything works again.
    assert_recovers(&gw, "failover").await;
    assert!(
        proxy.accepted() > accepted_before,
        "the gateway dialed fresh connections"
    );
    let text = gw.get("/metrics", None).await.text().await.unwrap();
    assert!(text.contains("tollgate_breaker_open 0"), "{text}");
}

#[tokio::test]
async fn a_partition_is_bounded_in_time_and_healed_without_a_restart() {
    // Arrange.
    let Behind {
        redis: _redis,
        proxy,
        up: _up,
        gw,
    } = Behind::start().await;
    let k = key("acme");

    // Act 1: a full partition: open connections go silent and new ones get no answer.
    proxy.partition();
    // Assert: requests are admitted at once (failing open) ...
    let started = Instant::now();
    for _ in 0..30 {
        let r = get(&gw, &k).await.expect("the gateway answers");
        assert_eq!(r.status(), 200);
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "30 requests took {:?}",
        started.elapsed()
    );
    // ... the admin API answers 503 within its deadline instead of hanging ...
    let started = Instant::now();
    let status = put_plan(&gw, "during").await;
    assert_eq!(status, Some(503), "an admin write while partitioned");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    // ... and readiness says so.
    let ready = gw
        .http
        .get(format!("{}/readyz", gw.address))
        .timeout(Duration::from_secs(4))
        .send()
        .await
        .expect("readyz answers while partitioned");
    assert_eq!(ready.status(), 503);

    // Act 2: the network heals (old connections stay dead, as their state is gone).
    proxy.heal();

    // Assert.
    assert_recovers(&gw, "partition").await;
}

#[tokio::test]
async fn a_restarted_redis_costs_no_decision_no_admin_call_and_no_flush() {
    // Arrange: two workers, each with its request-path connection open, and a shadow
    // client whose comparisons are flushed to Redis every second.
    let mut redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}[server]\nworkers = 2\n[redis]\nurl = \"{}\"\ntimeout_ms = 100\n{}{}[[catalog.clients]]\nid = \"shadowy\"\nplan = \"gold\"\nmode = \"shadow\"\nkeys = [\"{}\"]\n",
        admin_toml(),
        redis.url(),
        catalog_toml(("gold", 100_000.0, 1.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
        key("shadowy"),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    let k = key("acme");
    eventually(Duration::from_secs(5), "real decisions", || async {
        futures_util::future::join_all((0..8).map(|_| get(&gw, &k)))
            .await
            .iter()
            .all(|r| r.as_ref().is_some_and(decided))
    })
    .await;
    assert_eq!(put_plan(&gw, "before").await, Some(201));

    // Act: Redis restarts (SIGKILL, then an empty server on the same port). Nothing is
    // sent in between, so every pooled and per-worker connection is dead when the next
    // calls come.
    redis.kill();
    redis.restart().unwrap();
    // No wait: the promise is the first decision after Redis answers `PING`, whether or
    // not the worker's keeper has re-dialed yet (it may be in its back-off, up to 500 ms).
    let fail_open_before = gw.sample("tollgate_fail_open_total").await;

    // Assert: the very first decisions (on both workers), admin write and shadow flush
    // after the restart all succeed.
    let first = futures_util::future::join_all((0..8).map(|_| get(&gw, &k))).await;
    for r in &first {
        let r = r.as_ref().expect("the gateway answers");
        assert!(decided(r), "a first decision after the restart failed open");
    }
    assert_eq!(
        gw.sample("tollgate_fail_open_total").await,
        fail_open_before
    );
    assert_eq!(
        put_plan(&gw, "after").await,
        Some(201),
        "the first admin write after the restart"
    );
    assert_eq!(get(&gw, &key("shadowy")).await.unwrap().status(), 200);
    eventually(
        Duration::from_millis(2500),
        "the shadow comparison flushed to the restarted Redis",
        || async {
            let counted: Option<u64> = redis::cmd("HGET")
                .arg("tollgate:{shadow}:compared")
                .arg("shadowy")
                .query(&mut redis.conn().unwrap())
                .unwrap();
            counted == Some(1)
        },
    )
    .await;
}

#[tokio::test]
async fn connections_reset_under_the_gateway_are_replaced_before_the_next_call() {
    // Arrange.
    let Behind {
        redis,
        proxy,
        up: _up,
        gw,
    } = Behind::start().await;
    let k = key("acme");

    // Act: every connection is reset (RST) under the gateway, Redis itself untouched.
    let newest = newest_client_id(&redis);
    proxy.reset();
    // The reset reaches the gateway asynchronously (a request sent before it does would
    // meet it); what an operator sees once it has: both workers' keepers connected anew,
    // as fresh clients in Redis's CLIENT LIST.
    eventually(
        Duration::from_secs(2),
        "two fresh connections at Redis",
        || async { clients_since(&redis, newest) >= 2 },
    )
    .await;

    // Assert: no call pays for it.
    let fail_open_before = gw.sample("tollgate_fail_open_total").await;
    for _ in 0..10 {
        assert!(get(&gw, &k).await.is_some_and(|r| decided(&r)));
    }
    assert_eq!(
        gw.sample("tollgate_fail_open_total").await,
        fail_open_before
    );
    assert_eq!(put_plan(&gw, "after-reset").await, Some(201));
    let ready = gw.get("/readyz", None).await;
    assert_eq!(ready.status(), 200);
}

#[tokio::test]
async fn every_socket_to_redis_has_tcp_keepalive() {
    // Arrange: every connection the gateway opens goes through the proxy's port (the
    // test's own inspection connections go to Redis directly).
    let Behind {
        redis: _redis,
        proxy,
        up: _up,
        gw: _gw,
    } = Behind::start().await;

    // Act: the kernel's view of this process's established connections to the proxy.
    // /proc/net/tcp: "sl local remote st tx:rx tr:when ..."; timer 02 is keepalive (01,
    // retransmit, shows only while a command is unanswered; 00 is no timer at all).
    let port = format!(":{:04X}", proxy.port());
    let timers = || -> Vec<String> {
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        table
            .lines()
            .skip(1)
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.get(2)?.ends_with(&port) && f.get(3)? == &"01")
                    .then(|| f.get(5)?.split(':').next().map(str::to_string))?
            })
            .collect()
    };

    // Assert: once the per-worker and pooled connections are open (three at least), they
    // all run the keepalive timer at once. A socket without keepalive never does.
    eventually(
        Duration::from_secs(5),
        "three connections to Redis, all with the keepalive timer",
        || async {
            let t = timers();
            t.len() >= 3 && t.iter().all(|t| t == "02")
        },
    )
    .await;
}

#[tokio::test]
async fn a_redis_that_refuses_connections_costs_nothing_and_is_rejoined() {
    // Arrange.
    let Behind {
        redis: _redis,
        proxy,
        up: _up,
        gw,
    } = Behind::start().await;
    let k = key("acme");

    // Act: every connection is reset and new ones are refused (a Redis whose process is
    // gone, a firewall answering RST).
    proxy.reset();
    proxy.refuse();
    let started = Instant::now();
    for _ in 0..30 {
        let r = get(&gw, &k).await.expect("the gateway answers");
        assert_eq!(r.status(), 200, "failing open admits");
        assert!(!decided(&r));
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "30 requests took {:?}",
        started.elapsed()
    );
    let started = Instant::now();
    assert_eq!(put_plan(&gw, "refused").await, Some(503));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );

    // Assert: once connections are accepted again, everything resumes.
    proxy.heal();
    assert_recovers(&gw, "refused").await;
}

#[tokio::test]
async fn cluster_connections_that_go_silent_are_replaced_by_fresh_ones() {
    // Arrange: a three-master cluster reached only through fault proxies, clients spread
    // over its nodes.
    let cluster = RedisCluster::start().unwrap();
    let proxies = cluster.behind_proxies().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let clients: Vec<String> = (0..12).map(|i| format!("c{i}")).collect();
    let mut names: Vec<&str> = clients.iter().map(String::as_str).collect();
    names.push("acme");
    let seeds: Vec<String> = proxies.iter().map(|p| p.redis_url()).collect();
    let toml = format!(
        "{}[server]\nworkers = 2\n[redis]\ncluster_nodes = {seeds:?}\ntimeout_ms = 100\n[catalog]\nrefresh_ms = 1000\n{}{}",
        admin_toml(),
        catalog_toml(("gold", 100_000.0, 1.0), &names),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    for c in &names {
        eventually(Duration::from_secs(10), "a first real decision", || async {
            get(&gw, &key(c)).await.is_some_and(|r| decided(&r))
        })
        .await;
    }
    let accepted_before: usize = proxies.iter().map(FaultProxy::accepted).sum();

    // Act: every node connection goes silent while the nodes' addresses serve new ones.
    for p in &proxies {
        p.blackhole();
    }

    // Assert: every client's limit, the admin API and catalog changes come back.
    for c in &clients {
        eventually(
            Duration::from_secs(5),
            "limiting resumes on every node",
            || async { get(&gw, &key(c)).await.is_some_and(|r| decided(&r)) },
        )
        .await;
    }
    assert_recovers(&gw, "cluster").await;
    let accepted: usize = proxies.iter().map(FaultProxy::accepted).sum();
    assert!(accepted > accepted_before, "fresh connections were made");
}

/// `GET /orders` with `client`'s key, `n` times in a row: each answer's status, and
/// whether Redis decided it (a `RateLimit` header) or the gateway failed open.
async fn orders(address: &str, client: &str, n: usize) -> Vec<(u16, bool)> {
    let http = reqwest::Client::new();
    let mut out = Vec::new();
    for _ in 0..n {
        let r = http
            .get(format!("{address}/orders"))
            .header("x-api-key", key(client))
            .send()
            .await
            .expect("the gateway answers");
        out.push((r.status().as_u16(), decided(&r)));
    }
    out
}

/// A sample of the process gateway at `address`'s `/metrics`.
async fn sample_at(address: &str, series: &str) -> f64 {
    let text = reqwest::get(format!("{address}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    sample_in(&text, series).unwrap_or_else(|| panic!("no {series} on /metrics"))
}

#[tokio::test]
async fn a_redis_out_of_memory_fails_open_logs_why_once_and_limits_again_once_memory_is_freed() {
    // Arrange: the eviction policy the README recommends (`noeviction`), and a plan of 3
    // with next to no refill.
    let redis = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]).unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "{}{}{}",
        redis_toml(&redis),
        catalog_toml(("small", 3.0, 0.001), &["acme", "beta"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = gateway_process(&toml, &[("RUST_LOG", "info"), ("NO_COLOR", "1")]);
    let at = gw.address.clone();
    eventually(Duration::from_secs(10), "a first decision", || async {
        orders(&at, "acme", 1).await == [(200, true)]
    })
    .await;
    assert_eq!(
        orders(&at, "acme", 3).await,
        [(200, true), (200, true), (429, true)]
    );

    // Act: memory runs out (another tenant's data, a runaway key), so Redis refuses every
    // write and keeps answering reads.
    redis.fill_memory().unwrap();
    let during_beta = orders(&at, "beta", 10).await;
    let during_acme = orders(&at, "acme", 2).await;

    // Assert: every request fails open (the safety limit still stands behind them), each
    // is counted, and the log names the cause once, not once per request.
    assert_eq!(during_beta, [(200, false); 10]);
    assert_eq!(during_acme, [(200, false); 2], "nothing can be recorded");
    assert_eq!(
        sample_at(&at, "tollgate_fail_open_reasons_total{reason=\"error\"}").await,
        12.0
    );
    assert_eq!(
        sample_at(&at, "tollgate_store_errors_total{kind=\"reply\"}").await,
        12.0
    );
    assert_eq!(
        sample_at(&at, "tollgate_breaker_open").await,
        0.0,
        "Redis answers"
    );
    let log = std::fs::read_to_string(gw.dir().join("gateway.log")).unwrap();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("store call failed"))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        lines[0].contains("OOM") && lines[0].contains("maxmemory"),
        "{}",
        lines[0]
    );

    // Assert: once memory is freed, limiting resumes at once, and nothing was half
    // written meanwhile: `beta` starts with a full bucket.
    redis.free_memory().unwrap();
    assert_eq!(
        orders(&at, "beta", 4).await,
        [(200, true), (200, true), (200, true), (429, true)]
    );
}
