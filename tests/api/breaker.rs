//! The circuit breaker's back-off, as an operator sees it on `/metrics`: how long the
//! breaker stays open after it opens, doubling while the store keeps failing right after
//! recovering, capped, and back to the first once the store has been stable.

use std::time::{Duration, Instant};

use crate::helpers::*;

/// The configured back-off: first, cap, and how long closed counts as stable.
const BASE: Duration = Duration::from_millis(100);
const MAX: Duration = Duration::from_millis(400);
const STABLE: Duration = Duration::from_millis(600);

/// Polls `check` every 5 ms (`eventually` polls every 50, too coarse to time a back-off)
/// until it holds; fails after `within`.
async fn poll_until<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Freezes Redis until requests open the breaker, thaws it at once, and returns how long
/// the breaker then stayed open (its back-off: the probe that closes it waits that long
/// after opening), as `/metrics` shows it. Returns once limiting has resumed.
async fn open_and_time_the_back_off(gw: &TestGateway, redis: &RedisServer) -> Duration {
    let k = key("acme");
    redis.stall().unwrap();
    // Each request waits out the 50 ms budget and fails open; the third in a row opens
    // the breaker.
    poll_until(Duration::from_secs(3), "the breaker opens", || async {
        assert_eq!(gw.get("/orders", Some(&k)).await.status(), 200);
        gw.breaker_open().await
    })
    .await;
    let opened = Instant::now();
    redis.resume().unwrap();
    poll_until(Duration::from_secs(3), "the breaker closes", || async {
        !gw.breaker_open().await
    })
    .await;
    let open_for = opened.elapsed();
    poll_until(Duration::from_secs(3), "limiting resumes", || async {
        gw.get("/orders", Some(&k))
            .await
            .headers()
            .contains_key("ratelimit")
    })
    .await;
    open_for
}

#[tokio::test]
async fn the_breaker_backs_off_twice_as_long_each_time_it_reopens_soon_up_to_the_cap_and_starts_over_once_stable(
) {
    // Arrange: a 50 ms budget, shortened back-off periods, no catalog polls.
    let redis = RedisServer::start().unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let toml = format!(
        "[redis]\nurl = \"{}\"\ntimeout_ms = 50\n[catalog]\nrefresh_ms = 600000\n[periods]\nbreaker_backoff_ms = {}\nbreaker_backoff_max_ms = {}\nbreaker_stable_ms = {}\n{}{}",
        redis.url(),
        BASE.as_millis(),
        MAX.as_millis(),
        STABLE.as_millis(),
        catalog_toml(("gold", 100_000.0, 1.0), &["acme"]),
        route_toml("orders", "/orders", &[up.url()]),
    );
    let gw = TestGateway::spawn(settings(&toml)).await;
    assert_eq!(gw.sample("tollgate_breaker_opened_total").await, 0.0);

    // Act: Redis fails four times, each time right after the breaker closed (well within
    // the stable period), then once more after staying up longer than it.
    let mut open_for = Vec::new();
    for n in 1..=4 {
        open_for.push(open_and_time_the_back_off(&gw, &redis).await);
        assert_eq!(gw.sample("tollgate_breaker_opened_total").await, n as f64);
    }
    // Staying closed for the stable period is the condition under test: sleep through it.
    tokio::time::sleep(STABLE + Duration::from_millis(100)).await;
    open_for.push(open_and_time_the_back_off(&gw, &redis).await);
    assert_eq!(gw.sample("tollgate_breaker_opened_total").await, 5.0);

    // Assert: 100, 200, 400 (doubled each time), 400 (capped: not 800), then 100 again.
    // Each is measured from when /metrics first showed the breaker open to when it first
    // showed it closed: a few ms short of the back-off at worst, and late by the probe
    // (a fresh connection and a PING) and a poll.
    let expected = [BASE, BASE * 2, MAX, MAX, BASE];
    for (n, (took, backoff)) in open_for.iter().zip(expected).enumerate() {
        let (low, high) = (
            backoff.mul_f64(0.9) - Duration::from_millis(10),
            backoff.mul_f64(1.5) + Duration::from_millis(40),
        );
        assert!(
            (low..high).contains(took),
            "opening {}: open for {took:?}, expected a back-off of {backoff:?}; all: {open_for:?}",
            n + 1
        );
    }
}
