//! A busy gateway never opens the gate: with a healthy Redis, a saturated gateway or one
//! whose CPU is taken away decides every request it admits exactly, sheds what it cannot
//! decide (`503` + `Retry-After`), and never opens the breaker.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tollgate_testkit::{signal, FaultProxy};

use crate::helpers::*;

/// Every status a list of them holds, counted: (200, 429, 503, anything else).
fn tally(statuses: &[u16]) -> (usize, usize, usize, usize) {
    let n = |s: u16| statuses.iter().filter(|x| **x == s).count();
    let other = statuses
        .iter()
        .filter(|s| ![200, 429, 503].contains(*s))
        .count();
    (n(200), n(429), n(503), other)
}

/// `conns` connections of the client with key `key`, each sending one request after the
/// other to `url` until `until`; every status, in no order.
async fn flood(url: &str, key: &str, conns: usize, until: Instant) -> Vec<u16> {
    let per_conn = join_all((0..conns).map(|_| async {
        // One connection each: a client of its own, with its own pool.
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .build()
            .unwrap();
        let mut statuses = Vec::new();
        while Instant::now() < until {
            match http.get(url).header("x-api-key", key).send().await {
                Ok(r) => statuses.push(r.status().as_u16()),
                Err(e) => panic!("the gateway did not answer: {e}"),
            }
        }
        statuses
    }))
    .await;
    per_conn.into_iter().flatten().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_gateway_over_a_healthy_redis_admits_exactly_its_limit_and_sheds_the_excess_with_503(
) {
    // Arrange: one worker that counts itself overloaded past 1 ms of delay, a healthy
    // Redis with a 50 ms budget (CI runs other tests beside this one on two cores: a
    // redis-server starved of CPU for 5 ms would be a slow store, which is not what this
    // test is about), and a hot client whose bucket holds 300 tokens (refilled at a token
    // every 1000 s).
    const CAPACITY: usize = 300;
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[server]\nworkers = 1\n[redis]\nurl = \"{}\"\ntimeout_ms = 50\n[overload]\nmax_delay_ms = 1\n{}{}",
        redis.url(),
        catalog_toml(("hot", CAPACITY as f64, 0.001), &["hot"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    eventually(Duration::from_secs(5), "the store answers", || async {
        gw.get("/metrics", None).await.status() == 200
            && decided(&gw.get("/orders/warm", Some(&key("hot"))).await)
    })
    .await;
    let fail_open_before = gw.sample("tollgate_fail_open_total").await;

    // Act: 200 connections of the hot client for three seconds, far more than one
    // worker decides and forwards in time.
    let url = format!("{}/orders/1", gw.address);
    let until = Instant::now() + Duration::from_secs(3);
    let statuses = flood(&url, &key("hot"), 200, until).await;
    // Then one request at a time until the bucket refuses (a host busy with other work
    // may have shed most of the flood): a client with nothing pending is always decided.
    let mut after = 0;
    loop {
        match gw
            .get("/orders/1", Some(&key("hot")))
            .await
            .status()
            .as_u16()
        {
            200 => after += 1,
            429 => break,
            s => panic!("{s} for a lone request"),
        }
    }

    // Assert: exactly the bucket's tokens admitted (one went to the warm-up request), none
    // unchecked, the excess shed and counted, the breaker closed.
    let (ok, limited, shed, other) = tally(&statuses);
    assert_eq!(other, 0, "only 200, 429 and 503 answers");
    assert!(
        ok + limited + shed > 2 * CAPACITY,
        "{} requests: too few to judge",
        statuses.len()
    );
    assert_eq!(
        gw.sample("tollgate_fail_open_total").await,
        fail_open_before,
        "nothing admitted unchecked"
    );
    assert_eq!(
        ok + after,
        CAPACITY - 1,
        "the bucket admits exactly what it holds ({after} after the flood)"
    );
    assert!(shed > 0, "a saturated worker sheds");
    let counted = gw
        .sample("tollgate_shed_total{reason=\"overloaded\"}")
        .await
        + gw.sample("tollgate_shed_total{reason=\"decision_wait\"}")
            .await;
    assert_eq!(counted, shed as f64, "every 503 is counted as shed");
    assert_eq!(
        gw.sample("tollgate_decisions_total{outcome=\"shed\"}")
            .await,
        shed as f64
    );
    assert_eq!(gw.sample("tollgate_breaker_opened_total").await, 0.0);
    assert_eq!(up.hits(), CAPACITY, "shed requests never reach the service");
}

#[tokio::test]
async fn a_request_past_the_workers_bound_of_undecided_requests_gets_503_with_retry_after() {
    // Arrange: Redis 300 ms away, and a worker that may hold one undecided request.
    let redis = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], redis.port).into());
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[redis]\nurl = \"{}\"\ntimeout_ms = 1000\n[overload]\nmax_pending = 1\nmax_wait_ms = 3000\n{}{}",
        proxy.redis_url(),
        catalog_toml(("gold", 100.0, 1.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    eventually(Duration::from_secs(5), "the store answers", || async {
        decided(&gw.get("/orders/warm", Some(&key("acme"))).await)
    })
    .await;
    proxy.delay(Duration::from_millis(300));

    // Act: a request whose decision waits for Redis, and another 100 ms later.
    let acme = key("acme");
    let first = gw.get("/orders/1", Some(&acme));
    let second = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        gw.get("/orders/2", Some(&key("acme"))).await
    };
    let (first, second) = tokio::join!(first, second);

    // Assert: the first decided and forwarded; the second shed before a token was spent or
    // the service was called, told when to come back.
    assert_eq!(first.status(), 200);
    assert!(decided(&first));
    assert_eq!(second.status(), 503);
    assert_eq!(second.headers()["retry-after"], "1");
    assert_eq!(second.headers()["content-type"], "application/problem+json");
    assert!(second.headers().get("ratelimit").is_none());
    let body: serde_json::Value = second.json().await.unwrap();
    assert_eq!(body["type"], "https://tollgate.dev/problems/overloaded");
    assert_eq!(body["status"], 503);
    assert_eq!(up.hits(), 2, "the warm-up and the first request");
    assert_eq!(
        gw.sample("tollgate_shed_total{reason=\"overloaded\"}")
            .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_whose_cpu_is_taken_away_neither_fails_open_nor_opens_the_breaker() {
    // Arrange: Redis 20 ms away, a 50 ms budget (CI runs other tests beside this one: a
    // redis-server starved of CPU for 5 ms would be a slow store, not this test's case),
    // the gateway as a process of its own, and a client whose bucket holds 40 tokens.
    const CAPACITY: usize = 40;
    let redis = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], redis.port).into());
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[redis]\nurl = \"{}\"\ntimeout_ms = 50\n[overload]\nmax_delay_ms = 1000\nmax_wait_ms = 5000\n{}{}",
        proxy.redis_url(),
        catalog_toml(("gold", CAPACITY as f64, 0.001), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = gateway_process(&toml, &[]);
    let http = reqwest::Client::new();
    let url = format!("{}/orders/1", gw.address);
    let metrics = || async {
        http.get(format!("{}/metrics", gw.address))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    eventually(Duration::from_secs(5), "the store answers", || async {
        let r = http.get(&url).header("x-api-key", key("acme")).send().await;
        r.is_ok_and(|r| decided(&r))
    })
    .await;
    proxy.delay(Duration::from_millis(20));

    // Act: for three seconds the host takes the gateway's CPU away 100 ms in every 110
    // (SIGSTOP, SIGCONT: a hypervisor's steal, or a neighbour's burst), twice the budget
    // each time, while the client sends on eight connections. A call goes out while the
    // gateway runs and Redis answers while it is stopped: its timer is long due when it
    // runs again, every time.
    let stealing = Arc::new(AtomicBool::new(true));
    let thief = {
        let (stealing, pid) = (Arc::clone(&stealing), gw.child.id());
        std::thread::spawn(move || {
            while stealing.load(Ordering::Relaxed) {
                // SAFETY: kill(2) on our own child's pid.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) };
                std::thread::sleep(Duration::from_millis(100));
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let until = Instant::now() + Duration::from_secs(3);
    let statuses = flood(&url, &key("acme"), 8, until).await;
    stealing.store(false, Ordering::Relaxed);
    thief.join().unwrap();
    signal(&gw.child, libc::SIGCONT).unwrap();

    // Assert: every request decided by Redis, the bucket's tokens admitted exactly (one
    // went to the warm-up), and the breaker never opened.
    let text = metrics().await;
    let (ok, limited, shed, other) = tally(&statuses);
    assert!(
        statuses.len() > 2 * CAPACITY,
        "{} requests: too few to judge",
        statuses.len()
    );
    assert_eq!((shed, other), (0, 0), "200 and 429 answers only");
    assert_eq!(
        sample_in(&text, "tollgate_fail_open_total"),
        Some(0.0),
        "nothing admitted unchecked ({ok} admitted, {limited} refused)"
    );
    assert_eq!(sample_in(&text, "tollgate_breaker_opened_total"), Some(0.0));
    assert_eq!(ok, CAPACITY - 1, "the bucket admits exactly what it holds");
}

#[tokio::test]
async fn a_decision_held_past_max_wait_is_shed_with_503_and_counted_as_decision_wait() {
    // Arrange: a store budget of 2 s, and a whole-decision bound of 100 ms: an order the
    // settings refuse (the bound must exceed two budgets), set on the parsed settings to
    // reach the bound alone. Then Redis stops answering.
    let redis = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], redis.port).into());
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[redis]\nurl = \"{}\"\ntimeout_ms = 2000\n{}{}",
        proxy.redis_url(),
        catalog_toml(("gold", 100.0, 1.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let mut s = settings(&toml);
    s.overload.max_wait = Duration::from_millis(100);
    let gw = TestGateway::spawn(s).await;
    eventually(Duration::from_secs(5), "the store answers", || async {
        decided(&gw.get("/orders/warm", Some(&key("acme"))).await)
    })
    .await;
    proxy.blackhole();

    // Act
    let started = Instant::now();
    let r = gw.get("/orders/1", Some(&key("acme"))).await;

    // Assert: shed at the bound, not admitted unchecked, never forwarded.
    let took = started.elapsed();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    assert!(
        took >= Duration::from_millis(100) && took < Duration::from_millis(1500),
        "answered after {took:?}"
    );
    assert_eq!(up.hits(), 1, "only the warm-up reached the service");
    assert_eq!(
        gw.sample("tollgate_shed_total{reason=\"decision_wait\"}")
            .await,
        1.0
    );
    assert_eq!(gw.sample("tollgate_fail_open_total").await, 0.0);
}
