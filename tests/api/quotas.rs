//! Calendar quotas across a month's end, on the real binary: the gateway (and Redis, whose
//! `TIME` the script reads) run on a clock the test sets ([`FakeClock`]), a few seconds
//! before midnight on New Year's Eve, and the test watches the month turn.

use std::time::Duration;

use tollgate::store::{state_field, StateGroups};

use crate::helpers::*;

/// 2027-01-01T00:00:00Z: the end of December 2026 in UTC.
const NEW_YEAR_UTC: f64 = 1_798_761_600.0;
/// Five hours later, the end of December 2026 in New York (EST, UTC-5).
const NEW_YEAR_NEW_YORK: f64 = NEW_YEAR_UTC + 5.0 * 3600.0;
/// January 2027's length, which the first window of the new year resets after.
const JANUARY_S: u64 = 31 * 86_400;

/// A plan with a monthly quota of 3 beside a bucket roomy enough never to matter.
fn monthly_toml(time_zone: &str) -> String {
    limits_catalog_toml(
        "m",
        &format!(
            r#"[{{ name = "default", capacity = 100, rate = 100 }},
                {{ name = "monthly", quota = 3, period = "month", time_zone = "{time_zone}" }}]"#
        ),
        &["acme"],
    )
}

/// A request through `gw` (a process's address) with acme's key.
async fn get(http: &reqwest::Client, gw: &GatewayProcess) -> reqwest::Response {
    http.get(format!("{}/orders", gw.address))
        .header("x-api-key", key("acme"))
        .send()
        .await
        .expect("gateway answers")
}

/// Spends the quota of 3 through `gw` and returns the refusal that follows, after checking
/// that each answer reports the quota (closest to refusing) with `reset` at most `t_max`.
async fn use_up(http: &reqwest::Client, gw: &GatewayProcess, t_max: u64) -> reqwest::Response {
    for left in [2, 1, 0] {
        let r = get(http, gw).await;
        assert_eq!(r.status(), 200, "{:?}", r.headers());
        let rl = RateLimit::of(&r);
        assert_eq!((rl.policy.as_str(), rl.remaining), ("m.monthly", left));
        assert!(rl.reset <= t_max, "{rl:?}");
    }
    let refused = get(http, gw).await;
    assert_eq!(refused.status(), 429);
    let rl = RateLimit::of(&refused);
    assert_eq!((rl.policy.as_str(), rl.remaining), ("m.monthly", 0));
    assert!(rl.reset <= t_max, "{rl:?}");
    refused
}

#[tokio::test]
async fn a_monthly_quota_used_up_on_new_years_eve_admits_again_once_the_month_is_over() {
    // Arrange: one clock for Redis and two gateways (the embedded store, and Redis), an
    // hour before the month ends while they start.
    let clock = FakeClock::at(NEW_YEAR_UTC - 3600.0).unwrap();
    let redis = RedisServer::start_with_env(&clock.env()).unwrap();
    let plan = monthly_toml("UTC");
    let up = Upstream::start(Behaviour::Echo).await;
    let route = route_toml("orders", "/orders", &[up.url()]);
    let embedded = gateway_process(&format!("{plan}{route}"), &clock.env());
    let on_redis = gateway_process(
        &format!("{}{plan}{route}", redis_toml(&redis)),
        &clock.env(),
    );
    let http = reqwest::Client::new();

    // Act: two seconds before midnight, each gateway's client uses up its quota.
    clock.set(NEW_YEAR_UTC - 2.0).unwrap();
    let mut waits = Vec::new();
    for (store, gw) in [("embedded", &embedded), ("redis", &on_redis)] {
        let refused = use_up(&http, gw, 2).await;

        // Assert: refused until midnight, at most 2 s away, by the quota.
        let wait = retry_after(&refused).expect("a Retry-After");
        assert!((1..=2).contains(&wait), "{store}: {wait}");
        let body: serde_json::Value = refused.json().await.unwrap();
        assert_eq!(body["limit"], "m.monthly", "{store}: {body}");
        assert!(
            body["retry_after_ms"].as_u64().unwrap() <= 2000,
            "{store}: {body}"
        );
        waits.push(wait);
    }

    // Act: a retry after Retry-After, in the new month.
    tokio::time::sleep(Duration::from_secs(*waits.iter().max().unwrap())).await;

    // Assert: admitted again on both, the quota whole but for this request, until the end
    // of January.
    for (store, gw) in [("embedded", &embedded), ("redis", &on_redis)] {
        let r = get(&http, gw).await;
        assert_eq!(r.status(), 200, "{store}: {:?}", r.headers());
        let rl = RateLimit::of(&r);
        assert_eq!(
            (rl.policy.as_str(), rl.remaining),
            ("m.monthly", 2),
            "{store}"
        );
        assert!(rl.reset.abs_diff(JANUARY_S) <= 3, "{store}: {rl:?}");
    }
    assert_eq!(up.hits(), 8);
    // Redis kept the new window's count, ending with January.
    let state = stored(&redis, "acme", "monthly:").expect("acme's monthly state");
    assert_eq!(state[0], 1.0, "{state:?}");
    let end_s = state[1] as u64 / 1_000_000;
    assert_eq!(end_s, NEW_YEAR_UTC as u64 + JANUARY_S, "{state:?}");
}

#[tokio::test]
async fn a_month_in_new_york_ends_at_five_in_the_morning_utc_not_at_midnight() {
    // Arrange: the embedded store, on a clock two seconds before midnight UTC, which is
    // seven in the evening of New Year's Eve in New York.
    let clock = FakeClock::at(NEW_YEAR_UTC - 3600.0).unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let gw = gateway_process(
        &format!(
            "{}{}",
            monthly_toml("America/New_York"),
            route_toml("orders", "/orders", &[up.url()])
        ),
        &clock.env(),
    );
    let http = reqwest::Client::new();
    let five_hours = 5 * 3600;

    // Act + Assert: used up two seconds before midnight UTC, refused until 05:00Z...
    clock.set(NEW_YEAR_UTC - 2.0).unwrap();
    let refused = use_up(&http, &gw, five_hours + 2).await;
    let wait = retry_after(&refused).unwrap();
    assert!((five_hours..=five_hours + 2).contains(&wait), "{wait}");

    // ...still refused once the UTC month has turned...
    clock.set(NEW_YEAR_UTC + 1.0).unwrap();
    let r = get(&http, &gw).await;
    assert_eq!(r.status(), 429);
    let wait = retry_after(&r).unwrap();
    assert!((five_hours - 2..five_hours).contains(&wait), "{wait}");

    // ...and a second before five, for a second more...
    clock.set(NEW_YEAR_NEW_YORK - 1.0).unwrap();
    let r = get(&http, &gw).await;
    assert_eq!(r.status(), 429);
    assert_eq!(retry_after(&r), Some(1));

    // ...then admitted, in New York's January.
    clock.set(NEW_YEAR_NEW_YORK + 0.5).unwrap();
    let r = get(&http, &gw).await;
    assert_eq!(r.status(), 200, "{:?}", r.headers());
    let rl = RateLimit::of(&r);
    assert_eq!((rl.policy.as_str(), rl.remaining), ("m.monthly", 2));
    assert!(rl.reset.abs_diff(JANUARY_S) <= 2, "{rl:?}");
    assert_eq!(up.hits(), 4);
}

#[tokio::test]
async fn a_quota_counted_by_a_gateway_before_the_kind_mark_counts_on_after_the_upgrade() {
    // Arrange: acme's monthly quota has 2 of 3 used, as a gateway from before the quota's
    // mark wrote it: its sweep time whole (a window's end + 1 s), no half microsecond.
    let clock = FakeClock::at(NEW_YEAR_UTC - 3600.0).unwrap();
    let redis = RedisServer::start_with_env(&clock.env()).unwrap();
    let end_us = NEW_YEAR_UTC * 1e6;
    let legacy: Vec<u8> = [2.0, end_us, end_us + 1e6]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    redis::cmd("HSET")
        .arg(StateGroups::new("tollgate:", 1).key(0))
        .arg(state_field("acme", "monthly:"))
        .arg(legacy)
        .exec(&mut redis.conn().unwrap())
        .unwrap();
    let up = Upstream::start(Behaviour::Echo).await;
    let config = format!(
        "{}{}{}",
        redis_toml(&redis),
        monthly_toml("UTC"),
        route_toml("orders", "/orders", &[up.url()])
    );
    let gw = gateway_process(&config, &clock.env());
    let http = reqwest::Client::new();

    // Act: this gateway's first two requests.
    let first = get(&http, &gw).await;
    let second = get(&http, &gw).await;

    // Assert: the quota read on from 2 (not reset, not read as anything else): one request
    // left, then none; and the state now carries the mark.
    assert_eq!(first.status(), 200, "{:?}", first.headers());
    let rl = RateLimit::of(&first);
    assert_eq!((rl.policy.as_str(), rl.remaining), ("m.monthly", 0));
    assert_eq!(second.status(), 429);
    assert_eq!(up.hits(), 1);
    let state = stored(&redis, "acme", "monthly:").expect("acme's monthly state");
    assert_eq!(state, [3.0, end_us, end_us + 1e6 + 0.5]);
}
