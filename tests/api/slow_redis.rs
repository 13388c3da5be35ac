//! A Redis that answers within the budget, but slowly: a hot client must not fail open,
//! and its timeouts must not open the breaker for everyone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tollgate_testkit::FaultProxy;

use crate::helpers::*;

/// `GET /metrics` as name (with labels) → value, as an operator's scraper reads it.
async fn metrics(gw: &TestGateway) -> HashMap<String, f64> {
    let text = gw.get("/metrics", None).await.text().await.unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// A series that must be on `/metrics`.
fn value(m: &HashMap<String, f64>, series: &str) -> f64 {
    *m.get(series)
        .unwrap_or_else(|| panic!("no {series} on /metrics"))
}

fn decisions(m: &HashMap<String, f64>, outcome: &str) -> f64 {
    value(
        m,
        &format!("tollgate_decisions_total{{outcome=\"{outcome}\"}}"),
    )
}

#[tokio::test]
async fn a_hot_client_on_a_redis_at_60_percent_of_the_budget_is_decided_exactly_and_the_breaker_stays_closed(
) {
    // Arrange: Redis behind a proxy that delays every reply by 60% of a 200 ms budget
    // (80 ms to spare: CI runs other tests beside this one on two cores), two workers, a
    // hot client whose bucket allows exactly its capacity (no refill to speak of), and a
    // quiet one.
    const BUDGET_MS: u64 = 200;
    const DELAY_MS: u64 = 120;
    const CAPACITY: f64 = 200.0;
    let redis = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], redis.port).into());
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[server]\nworkers = 2\n[redis]\nurl = \"{}\"\ntimeout_ms = {BUDGET_MS}\n{}{}{}",
        proxy.redis_url(),
        catalog_toml(("hot", CAPACITY, 0.001), &["hot"]),
        catalog_toml(("quiet", 1_000_000.0, 1.0), &["quiet"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    eventually(Duration::from_secs(5), "a first real decision", || async {
        gw.get("/orders", Some(&key("quiet")))
            .await
            .headers()
            .contains_key("ratelimit")
    })
    .await;
    proxy.delay(Duration::from_millis(DELAY_MS));
    let before = metrics(&gw).await;

    // Act: 48 concurrent requests from the hot client for three seconds, while the quiet
    // client sends one request at a time.
    let until = Instant::now() + Duration::from_secs(3);
    let hot_key = key("hot");
    let hot = join_all((0..48).map(|_| async {
        let mut statuses = Vec::new();
        while Instant::now() < until {
            statuses.push(gw.get("/orders/1", Some(&hot_key)).await.status().as_u16());
        }
        statuses
    }));
    let hot_done = AtomicBool::new(false);
    let quiet_key = key("quiet");
    let quiet = async {
        let (mut sent, mut decided) = (0, 0);
        while !hot_done.load(Ordering::Relaxed) {
            let r = gw.get("/orders/1", Some(&quiet_key)).await;
            sent += 1;
            decided += r.headers().contains_key("ratelimit") as usize;
        }
        (sent, decided)
    };
    let (hot, (quiet_sent, quiet_decided)) = tokio::join!(
        async {
            let s = hot.await;
            hot_done.store(true, Ordering::Relaxed);
            s
        },
        quiet
    );
    let after = metrics(&gw).await;

    // Assert: as an operator reads /metrics.
    let delta = |o: &str| decisions(&after, o) - decisions(&before, o);
    let fail_open = delta("fail_open");
    let (allowed, denied) = (delta("allowed"), delta("denied"));
    let total = allowed + denied + fail_open;
    let hot_sent = hot.iter().map(Vec::len).sum::<usize>();
    assert!(
        hot_sent > 300,
        "only {hot_sent} hot requests: too few to judge"
    );
    assert!(
        fail_open < 0.01 * total,
        "{fail_open} of {total} decisions failed open"
    );
    let opened = |m: &HashMap<String, f64>| value(m, "tollgate_breaker_opened_total");
    assert_eq!(opened(&after), opened(&before), "the breaker opened");
    assert_eq!(value(&after, "tollgate_breaker_open"), 0.0);
    assert!(
        quiet_decided * 100 >= quiet_sent * 99,
        "the quiet client was decided for {quiet_decided} of {quiet_sent} requests"
    );
    // Exact: the hot bucket admitted its capacity. A request that failed open was
    // forwarded too, and may or may not have spent its token in Redis, so each fail-open
    // may add one forwarded request.
    let hot_forwarded = hot.iter().flatten().filter(|s| **s == 200).count() as f64;
    assert!(
        hot_forwarded >= CAPACITY && hot_forwarded <= CAPACITY + fail_open,
        "the hot client was forwarded {hot_forwarded} requests by a bucket of {CAPACITY} \
         ({fail_open} fail-opens)"
    );
    let hot_denied = hot.iter().flatten().filter(|s| **s == 429).count() as f64;
    assert_eq!(hot_denied, denied, "429s are the hot client's denials");
}
